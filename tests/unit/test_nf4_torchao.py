"""handle's NF4 (bitsandbytes' format, torch_handle/finetune/nf4.py) against torchao's ``NF4Tensor`` (the tensor
subclass torchtune's QLoRA shards under FSDP2) on the same weights; skipped where torchao (the ``torchao`` extra) is
not installed.

They are not one format, and the tests say exactly where they part (docs/qlora.md, "torchao's NF4"):

- the block absmax (max |w| over 64 consecutive weights) and the packing (two codes a byte, the first in the high
  nibble) are the same: identical bytes;
- the 4-bit codes: torchao writes the NF4 table to 4 digits (-0.6962, ...) in the weight's dtype and takes the
  nearest value of ``w / absmax`` in that dtype; bitsandbytes takes the float32 quantiles and ``w * (1 / absmax)``
  in float32. On fp32 weights the codes agree except for values within 1e-4 of a decision boundary (where the
  4-digit table moves the boundary); on bf16 weights, where torchao's arithmetic is bf16, in all but ~1 %;
- the second level differs in kind: torchao quantises the centred absmax linearly to int8 with one float factor
  per group of 256 (``round(x · 256 / (2 · max|x|))``), bitsandbytes with the 8-bit dynamic tree code and one
  float32 absmax per group. Both give back each block's absmax within their own step, not the same bytes.
"""

from __future__ import annotations

import pytest
import torch

from torch_handle.finetune.nf4 import _table, quantize_nf4

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
                                 reason="torchao (the torchao extra) is not installed")


def _weights(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.randn(256, 1024) * 0.02).to(dtype)  # 4,096 blocks: 16 groups of 256 (torchao needs whole groups)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed >> 4, packed & 15], dim=1).flatten()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_absmax_and_packing_are_the_same_bytes(dtype) -> None:
    w = _weights(dtype)
    ours = quantize_nf4(w, double_quant=False)
    theirs = nf4_tensor.to_nf4(w, 64, 256)
    assert torch.equal(nf4_tensor.get_block_absmax(w.flatten(), 64).float(), ours.absmax)
    assert theirs.quantized_data.dtype == ours.packed.dtype == torch.uint8
    assert theirs.quantized_data.shape == ours.packed.shape == (w.numel() // 2,)


def test_fp32_codes_differ_only_at_a_boundary() -> None:
    w = _weights(torch.float32)
    ours = quantize_nf4(w, double_quant=False)
    theirs = nf4_tensor.to_nf4(w, 64, 256)
    mine, other = _codes(ours.packed), _codes(theirs.quantized_data)
    differ = (mine != other).nonzero().flatten()
    assert 0 < differ.numel() < 1e-3 * w.numel()  # 33 of 262,144 here
    scaled = w.flatten()[differ] * (1.0 / ours.absmax.repeat_interleave(64)[differ])
    distance = (scaled.view(-1, 1) - _table("midpoints", torch.device("cpu")).view(1, -1)).abs().amin(dim=1)
    assert distance.max() < 1e-4  # every one a value on the edge between two codes
    assert ((mine[differ].int() - other[differ].int()).abs() == 1).all()  # and the neighbouring code


def test_bf16_codes_agree_but_for_torchaos_bf16_arithmetic() -> None:
    w = _weights(torch.bfloat16)
    mine = _codes(quantize_nf4(w, double_quant=False).packed)
    other = _codes(nf4_tensor.to_nf4(w, 64, 256).quantized_data)
    differ = mine != other
    assert differ.float().mean() < 0.01
    assert ((mine[differ].int() - other[differ].int()).abs() == 1).all()


def test_second_level_constants_differ_in_kind_and_both_recover_the_absmax() -> None:
    w = _weights(torch.float32)
    ours = quantize_nf4(w)
    theirs = nf4_tensor.to_nf4(w, 64, 256)
    assert ours.absmax_codes.dtype == torch.uint8 and theirs.quantized_scalers.dtype == torch.int8
    assert ours.absmax_codes.shape == theirs.quantized_scalers.shape
    absmax = quantize_nf4(w, double_quant=False).absmax
    recovered = theirs.dequantize_scalers(theirs.quantized_scalers, theirs.quantization_factor, 256).float()
    spread = (absmax - absmax.mean()).abs().max()
    assert (recovered - absmax).abs().max() <= spread / 127  # torchao: half a step of its linear int8
    assert (ours.block_absmax() - absmax).abs().max() <= spread * 0.05  # ours: the dynamic code's coarsest step
    assert not torch.equal(ours.block_absmax(), recovered)

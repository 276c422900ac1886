"""Whether a finished run handed on its whole model: the check every layout's test applies to its runs.

``model.safetensors`` holds the one-process model's every tensor by name and shape (the model ``handle generate``
builds from the run's preset, which then loads it strictly and samples from it), and the last checkpoint's
consolidated state (its portable form: :mod:`torch_handle.checkpoint.convert`) holds the same tensors; where the
model is one a Hugging Face class computes (and the run trains it whole, not LoRA adapters), ``handle export
--format hf`` of the run, read back into handle's names, holds them too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file


def assert_whole_weights(run_dir: Path) -> None:
    """Raises AssertionError (naming ``run_dir`` and what differs) unless the run's final weights are whole."""
    from handle_cli.main import cli
    from torch_handle.checkpoint import convert, store
    from torch_handle.infer.generate import load_run

    run_dir = Path(run_dir)
    final = load_file(str(run_dir / "model.safetensors"))
    model = load_run(run_dir).model  # handle generate's loader: the one-process model, loaded strictly
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in final.items()}
    assert got == want, (f"{run_dir.name}: model.safetensors lacks {sorted(want.keys() - got.keys())[:4]}, has "
                         f"{sorted(got.keys() - want.keys())[:4]} beyond, {len(got)} of {len(want)} tensors")
    result = CliRunner().invoke(cli, ["generate", str(run_dir), "the", "--max-new-tokens", "2", "--seed", "0"])
    assert result.exit_code == 0, f"{run_dir.name}: handle generate: {result.output[-1000:]}"

    newest = store.list_checkpoints(run_dir / "checkpoints")[-1]
    layout = store.read_layout(newest)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    convert.ensure_portable(newest, layout, names)
    weights, _, _ = convert.read_portable(convert.portable_dir(newest, layout))
    missing = sorted(final.keys() - weights.keys() - {"lm_head.weight"})  # a tied head: stored once, by embed
    assert not missing, f"{run_dir.name}: the checkpoint's portable form lacks {missing[:4]}"
    for name, value in final.items():
        if name in weights:
            assert torch.equal(weights[name].to(value.dtype), value), f"{run_dir.name}: {name} differs"
    _assert_hf_export_holds(run_dir, weights, model.args)


def _assert_hf_export_holds(run_dir: Path, weights: dict[str, torch.Tensor], args) -> None:
    """``handle export RUN --format hf`` (fp32) holds the checkpoint's consolidated ``weights`` under Hugging Face
    names; nothing is checked for a model no Hugging Face class computes, or a LoRA run (its adapters export in
    peft's format: tests/test_lora_strategies.py)."""
    from handle_cli.main import cli
    from torch_handle.checkpoint import hf_dir
    from torch_handle.errors import CheckpointError
    from torch_handle.infer.adapter_export import finetune_method
    from torch_handle.model.hf_names import from_hf_state_dict

    try:
        if finetune_method(run_dir) != "none":
            return
    except CheckpointError:  # inexpressible: handle validate --target hf names why
        return
    out = run_dir.parent / f"{run_dir.name}-hf"
    result = CliRunner().invoke(cli, ["export", str(run_dir), str(out), "--format", "hf", "--force"])
    assert result.exit_code == 0, f"{run_dir.name}: handle export --format hf: {result.output[-1000:]}"
    exported = from_hf_state_dict(hf_dir.read_weights(out), args)
    for name, value in weights.items():
        if name in exported:
            assert torch.equal(exported[name], value.to(exported[name].dtype)), f"{run_dir.name}: hf {name} differs"
    missing = sorted(weights.keys() - exported.keys() - {"lm_head.weight"})
    assert not missing, f"{run_dir.name}: the Hugging Face export lacks {missing[:4]}"

"""NF4, the 4-bit NormalFloat storage of QLoRA's frozen base, written out: the code book, block-wise absmax
quantisation, double quantisation of the absmax constants, dequantisation, and ``NF4Linear``, a frozen linear that
keeps its weight so and dequantises it on the fly.

Source: Dettmers, Pagnoni, Holtzman, Zettlemoyer 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"
(arXiv:2305.14314), §3 (4-bit NormalFloat, double quantisation) and appendix E (the asymmetric NF4 construction).
The layout and every rounding step are those of the authors' library, bitsandbytes (``quantize_4bit(w,
blocksize=64, quant_type="nf4", compress_statistics=True)``); ``tests/unit/test_nf4.py`` checks the bytes and the
dequantised weight against it bit for bit (the 8-bit codes of the constants against its reference kernel: its
native CPU kernel searches the code approximately, docs/qlora.md). A weight of n elements (row-major, read as
float32) is stored as:

    packed        (ceil(n/2),) uint8     two 4-bit codes a byte: element 2i in the high nibble, 2i+1 in the low one
    absmax        (n_blocks,) float32    max |w| over each block of ``block_size`` (64) consecutive elements, or,
                                         double-quantised (the default), in place of it:
    absmax_codes  (n_blocks,) uint8      8-bit code of (absmax - absmax_mean) / absmax_scale of its group,
    absmax_scale  (n_groups,) float32    max |absmax - absmax_mean| over each group of 256 constants,
    absmax_mean   () float32             the mean of absmax, subtracted first: absmax > 0 always, so centring
                                         lets the signed 8-bit code use both halves of its range.

n_blocks = ceil(n / 64) and n_groups = ceil(n_blocks / 256). Bits per parameter: 4 + 32/64 = 4.5 with float32
constants; 4 + 8/64 + 32/(64·256) ≈ 4.127 double-quantised (plus 32 bits a tensor for the mean), against 16 for
bf16: 0.258x of bf16's bytes.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.model.attention import StackedLinear, select_parts

BLOCK_SIZE = 64
"""Weights per absmax constant (the paper's block size for the 4-bit quantisation)."""
ABSMAX_BLOCK_SIZE = 256
"""Absmax constants per second-level scale in the double quantisation (the paper's block size for it)."""
NF4_OFFSET = 0.9677083
"""The outermost quantile of NF4's positive half: ½((1 − 1/(2·15)) + (1 − 1/(2·16))), the mean of the two
asymmetric halves' end points (appendix E), at the 7 digits bitsandbytes writes it. The exact fraction
(0.96770833...) rounds to another float32 and would move three of the 16 values by one float32 step."""


def nf4_code() -> Tensor:
    """The 16 values of NF4, sorted: (16,) float32 in [-1, 1], code 7 exactly 0.

    Each half of a k-bit NormalFloat holds the quantiles of N(0, 1) that split it into equal-probability bins
    (§3: the information-theoretically optimal code for normally distributed weights). With 2^k = 16 codes and an
    exact zero this needs an asymmetric split (appendix E): 8 positive quantiles ``ndtri(linspace(offset, 0.5,
    9)[:-1])``, 7 negative ones ``-ndtri(linspace(offset, 0.5, 8)[:-1])`` and 0, all divided by the largest, so
    that ±1 are the ends. Computed as bitsandbytes' ``create_normal_map`` does (the linspace in float32, the
    quantiles in float64, the normalisation in float32): the result equals its table bit for bit.
    """
    positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9)[:-1].double()).float()  # 8 quantiles
    negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8)[:-1].double()).float()  # 7 quantiles
    values = torch.cat([negative, torch.zeros(1), positive]).sort().values
    return values / values.max()


def dynamic_code() -> Tensor:
    """The signed 8-bit dynamic code that double quantisation stores the centred absmax constants in: (256,)
    float32, sorted, in [-0.993, 1].

    The "8-bit float" of QLoRA §3 is bitsandbytes' dynamic tree quantisation (Dettmers 2016, "8-Bit
    Approximations for Parallelism in Deep Learning", arXiv:1511.04561): after the sign bit, a run of zero bits
    sets a decimal exponent 10^-6 ... 10^0 and the bits after the first one a linear fraction, so small magnitudes
    get fine steps and large ones coarse steps. For exponent 10^(i-6), i = 0..6, the code holds the 2^i midpoints
    of ``linspace(0.1, 1, 2^i + 1)`` with both signs (254 values), plus 0 and 1. Built as bitsandbytes'
    ``create_dynamic_map(signed=True)`` builds it, in float32.
    """
    values: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        values += ((10 ** (i - 6)) * means).tolist()
        values += (-(10 ** (i - 6)) * means).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


@dataclass
class NF4Weight:
    """A tensor stored as NF4: the fields of the module docstring, and the shape and dtype to give back.

    ``absmax`` is set without double quantisation; ``absmax_codes``, ``absmax_scale`` and ``absmax_mean`` with it.
    """

    packed: Tensor
    absmax: Tensor | None
    absmax_codes: Tensor | None
    absmax_scale: Tensor | None
    absmax_mean: Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    block_size: int = BLOCK_SIZE
    absmax_block_size: int = ABSMAX_BLOCK_SIZE

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.absmax is None

    def tensors(self) -> dict[str, Tensor]:
        """The stored tensors by field name (the ones that are set)."""
        names = ("packed", "absmax") if self.absmax is not None else (
            "packed", "absmax_codes", "absmax_scale", "absmax_mean")
        return {name: getattr(self, name) for name in names}

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors: what the weight costs in memory."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def block_absmax(self) -> Tensor:
        """The absmax constants, (n_blocks,) float32, dequantised when double-quantised: code * scale + mean."""
        if self.absmax is not None:
            return self.absmax
        groups = _pad_to(_table_like("dynamic", self.packed)[self.absmax_codes.int()],
                         self.absmax_block_size).view(-1, self.absmax_block_size)  # (n_groups, 256)
        scaled = (groups * self.absmax_scale.view(-1, 1)).flatten()[: self.absmax_codes.numel()]
        return scaled + self.absmax_mean

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight the codes stand for: ``shape``, in ``dtype`` (default: the quantised tensor's dtype).

        Each element is NF4[code] * absmax of its block, a float32 product rounded once to ``dtype``.
        """
        # One lookup a byte in the (256, 2) table of (NF4[b >> 4], NF4[b & 15]): the codes never exist unpacked.
        pairs = _table_like("pairs", self.packed).index_select(0, self.packed.int()).flatten()[: self.numel]  # (n,)
        blocks = _pad_to(pairs, self.block_size).view(-1, self.block_size)  # (n_blocks, block_size)
        values = (blocks * self.block_absmax().view(-1, 1)).flatten()[: self.numel]
        return values.view(self.shape).to(dtype or self.dtype)


def quantize_blockwise(flat: Tensor, block_size: int, midpoints: Tensor) -> tuple[Tensor, Tensor]:
    """Block-wise absmax quantisation of ``flat`` (n,) float32 to the code whose sorted values have ``midpoints``
    (the float32 midpoints of neighbouring values): returns (codes (n,) uint8, absmax (ceil(n / block_size),)
    float32).

    Per block of ``block_size`` consecutive elements: absmax = max |x|; x is scaled as x * (1 / absmax), absmax
    floored at 1e-38 so that an all-zero block scales to 0, and takes the index of the nearest code value, a value
    exactly on a midpoint taking the lower one. Both levels of QLoRA's quantisation are this one rule (the 4-bit
    weights with the NF4 code, the 8-bit constants with the dynamic code), as in bitsandbytes' reference kernels.
    """
    blocks = _pad_to(flat, block_size).view(-1, block_size)  # zero padding leaves every absmax as it is
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1)).clamp(-1, 1).flatten()[: flat.numel()]
    return torch.bucketize(scaled, midpoints).to(torch.uint8), absmax


def quantize_nf4(weight: Tensor, *, block_size: int = BLOCK_SIZE, double_quant: bool = True,
                 absmax_block_size: int = ABSMAX_BLOCK_SIZE) -> NF4Weight:
    """Quantise ``weight`` (any shape, float32/bf16/fp16, read as float32 in row-major order) to NF4.

    The weights: ``quantize_blockwise`` with ``block_size`` and the NF4 code, codes packed two a byte, high nibble
    first. With ``double_quant``, the absmax constants: mean = absmax.mean(), then ``quantize_blockwise`` of
    absmax - mean with ``absmax_block_size`` and the 8-bit ``dynamic_code`` (QLoRA §3, double quantisation).
    Deterministic: the same weight gives the same bytes on every call, so a checkpoint that references the base
    weights can rebuild its NF4 copy instead of storing it; but the mean is a float32 reduction whose last bit
    depends on the device and the number of CPU threads (as bitsandbytes' does), so rebuild under both the same.

    Raises:
        ValueError: ``weight`` is not floating point, is empty, or a block size is not positive.
    """
    if not weight.is_floating_point() or weight.numel() == 0:
        raise ValueError(f"quantize_nf4: expected a non-empty floating-point tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if block_size <= 0 or absmax_block_size <= 0:
        raise ValueError(f"quantize_nf4: block sizes must be positive, got {block_size} and {absmax_block_size}")
    device = weight.device
    codes, absmax = quantize_blockwise(weight.detach().reshape(-1).float(), block_size, _table("midpoints", device))
    nf4 = NF4Weight(_pack_nibbles(codes), absmax, None, None, None, tuple(weight.shape), weight.dtype, block_size,
                    absmax_block_size)
    if double_quant:
        nf4.absmax_mean = absmax.mean()
        nf4.absmax_codes, nf4.absmax_scale = quantize_blockwise(absmax - nf4.absmax_mean, absmax_block_size,
                                                                _table("dynamic_midpoints", device))
        nf4.absmax = None
    return nf4


class _NF4LinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b with W dequantised from NF4 in the forward and again in the backward: autograd keeps only the
    module, never a full-precision copy of W (the point of QLoRA's memory figures), nor even the 4-bit codes it read
    in the forward: the backward reads the module's ``weight_nf4`` as it is then, which a sharding strategy has
    gathered again for the backward (FSDP2 and scratch-fsdp into the same storage, DeepSpeed ZeRO-3 into a new
    one; a saved view would keep the forward's gathered copy alive until the backward). ``rows`` picks rows of W (a
    ``StackedLinear``'s parts), or None for all."""

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, module: NF4Linear, rows: Callable[[Tensor], Tensor] | None):
        ctx.module, ctx.rows = module, rows
        return F.linear(x, _weight(module, rows, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:  # (..., out) @ (out, in) -> (..., in)
            grad_x = grad_out.matmul(_weight(ctx.module, ctx.rows, grad_out.dtype))
        if ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_bias, None, None


def _weight(module: NF4Linear, rows: Callable[[Tensor], Tensor] | None, dtype: torch.dtype) -> Tensor:
    weight = module.dequantize(dtype)
    return weight if rows is None else rows(weight)


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is stored in NF4: y = x Wᵀ + b, W dequantised on every call.

    Stands where an ``nn.Linear`` stood (``in_features``, ``out_features``, ``bias``; a ``StackedLinear``'s
    ``part_features`` and ``forward(x, parts=...)`` too), so a LoRA wrapper can wrap it. The weight gets no
    gradient and no optimizer sees it. The bias, if any, stays a parameter, frozen (``requires_grad=False``; set it
    to True to train it).

    Storage: ``weight_nf4``, one frozen ``nn.Parameter`` (``requires_grad=False``) of dtype uint8 and shape
    ``(nbytes,)`` holding every stored tensor end to end (:data:`STORAGE_ORDER`: the float32 constants first, as
    their bytes, then the 8-bit absmax codes, then the packed codes). A parameter, so that every strategy that
    shards parameters shards it on dim 0 like any other (FSDP2's ``fully_shard``, scratch-fsdp, DeepSpeed ZeRO-3:
    each rank ceil(nbytes / W) bytes, gathered whole before the forward and the backward as a weight is); uint8,
    so that no mixed-precision cast touches it (FSDP2 casts floating-point parameters only; DeepSpeed's
    ``module.bfloat16()`` and ``model.to(dtype)`` likewise); one tensor, so that no 0-d mean meets FSDP2's refusal
    of scalar parameters. The design and why not a tensor subclass: docs/qlora.md, "Sharded".

    Compute dtype: the input's. W is dequantised to ``x.dtype`` (one float32 product rounded to it), so the output
    equals ``F.linear(x, self.dequantize(x.dtype), bias)`` bit for bit, and the input gradient equals that of an
    ``nn.Linear`` holding the dequantised weight.

    State dict: ``weight_nf4`` and ``bias``; a checkpoint that holds them reloads them exactly. A fine-tuning run's
    checkpoint need not hold them: they are a deterministic function of the base weights (on one device and CPU
    thread count: ``quantize_nf4``), so resuming from a reference to the trained base (verified by its hash) and
    ``from_linear`` gives the same bytes again.

    Shape:
        x (..., in_features) -> (..., out_features), or (..., the selected parts' features) with ``parts``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, dtype: torch.dtype = torch.float32,
                 block_size: int = BLOCK_SIZE, double_quant: bool = True, part_features: Sequence[int] | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_dtype, self.block_size, self.double_quant = dtype, block_size, double_quant
        self.part_features = None if part_features is None else tuple(part_features)
        # Zeros of the stored size, so that load_state_dict can fill a fresh module.
        nbytes = sum(_nbytes(*shape_dtype) for shape_dtype in self._stored_shapes().values())
        self.weight_nf4 = nn.Parameter(torch.zeros(nbytes, dtype=torch.uint8, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def _stored_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return _stored_shapes(self.in_features * self.out_features, self.block_size, self.double_quant)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, block_size: int = BLOCK_SIZE, double_quant: bool = True) -> NF4Linear:
        """The NF4 copy of ``linear`` (its weight quantised, its bias copied, on its device)."""
        weight = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype=weight.dtype,
                     block_size=block_size, double_quant=double_quant,
                     part_features=getattr(linear, "part_features", None), device=weight.device)
        stored = quantize_nf4(weight, block_size=block_size, double_quant=double_quant).tensors()
        with torch.no_grad():
            module.weight_nf4.copy_(torch.cat([stored[name].reshape(-1).view(torch.uint8)
                                               for name in module._stored_shapes()]))
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def nf4_weight(self) -> NF4Weight:
        """The stored weight as an ``NF4Weight``: the uint8 codes are views of ``weight_nf4``, the float32 constants
        copies of their bytes (a few bytes per 16,384 weights; a copy, because a gathered ``weight_nf4`` may sit
        at any byte offset of a collective's buffer, where a float32 view is not allowed)."""
        stored: dict[str, Tensor | None] = dict.fromkeys(_FIELDS)
        offset = 0
        for name, (shape, dtype) in self._stored_shapes().items():
            size = _nbytes(shape, dtype)
            raw = self.weight_nf4.narrow(0, offset, size)
            stored[name] = raw if dtype == torch.uint8 else raw.clone().view(dtype).reshape(shape)
            offset += size
        return NF4Weight(**stored, shape=(self.out_features, self.in_features), dtype=self.weight_dtype,
                         block_size=self.block_size)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """W, (out_features, in_features), in ``dtype`` (default: the original weight's dtype)."""
        return self.nf4_weight().dequantize(dtype)

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """The plain linear of the dequantised weight (a ``StackedLinear`` where this one has parts), bias copied,
        on this module's device: what an export writes (``handle export --merge`` of a QLoRA run)."""
        bias, device = self.bias is not None, self.weight_nf4.device
        linear = nn.Linear(self.in_features, self.out_features, bias=bias) if self.part_features is None \
            else StackedLinear(self.in_features, self.part_features, bias=bias)
        linear = linear.to(device=device, dtype=self.weight_dtype)
        linear.weight.copy_(self.dequantize())
        if bias:
            linear.bias.copy_(self.bias)
        return linear

    def forward(self, x: Tensor, parts: slice | None = None) -> Tensor:
        if parts is None:
            return _NF4LinearFunction.apply(x, self.bias, self, None)
        if self.part_features is None:
            raise TypeError("NF4Linear: parts= needs a StackedLinear's part_features")
        def rows(stacked: Tensor) -> Tensor:
            return select_parts(stacked, self.part_features, parts)

        bias = None if self.bias is None else rows(self.bias)
        return _NF4LinearFunction.apply(x, bias, self, rows)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) leaves the uint8 storage as it is (only floating-point tensors are cast); the
        # dtype that dequantize() returns by default follows the cast as an nn.Linear's weight would.
        self.weight_dtype = fn(torch.zeros((), dtype=self.weight_dtype, device=self.weight_nf4.device)).dtype
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        absmax = "double-quantised" if self.double_quant else "float32"
        parts = "" if self.part_features is None else f", part_features={self.part_features}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block_size={self.block_size}, absmax {absmax}{parts}")


_FIELDS = ("packed", "absmax", "absmax_codes", "absmax_scale", "absmax_mean")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _stored_shapes(n: int, block_size: int, double_quant: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Field -> (shape, dtype) of the tensors that store n elements, in their order in ``weight_nf4``
    (:data:`STORAGE_ORDER`)."""
    n_blocks = -(-n // block_size)
    if not double_quant:
        return {"absmax": ((n_blocks,), torch.float32), "packed": (((n + 1) // 2,), torch.uint8)}
    return {"absmax_mean": ((), torch.float32), "absmax_scale": ((-(-n_blocks // ABSMAX_BLOCK_SIZE),), torch.float32),
            "absmax_codes": ((n_blocks,), torch.uint8), "packed": (((n + 1) // 2,), torch.uint8)}


STORAGE_ORDER = tuple(_stored_shapes(1, BLOCK_SIZE, True))
"""The fields in ``NF4Linear.weight_nf4``, double-quantised (without: ``absmax`` then ``packed``)."""


def quantize_linears(model: nn.Module, *, skip: tuple[str, ...] = (), block_size: int = BLOCK_SIZE,
                     double_quant: bool = True, shapes_only: bool = False) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` by its ``NF4Linear``, in place; returns the qualified names replaced.

    Left as they are: linears whose qualified name matches a pattern of ``skip`` (``fnmatch``: ``"lm_head"``,
    ``"layers.*.ff.*"``), and linears whose weight is shared with another module (a tied output projection: the
    embedding table stays in full precision, as QLoRA keeps embeddings).

    ``shapes_only``: the ``NF4Linear`` gets a ``weight_nf4`` of the stored size without quantising (zeros; no values on
    the meta device, where ``handle estimate`` sizes a QLoRA model: the same bytes as quantising gives).
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name
               and not any(fnmatch.fnmatchcase(name, s) for s in skip) and owners[id(m.weight)] == 1]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _shaped(linear, block_size, double_quant) if shapes_only
                else NF4Linear.from_linear(linear, block_size=block_size, double_quant=double_quant))
    return [name for name, _ in targets]


def _shaped(linear: nn.Linear, block_size: int, double_quant: bool) -> NF4Linear:
    return NF4Linear(linear.in_features, linear.out_features, linear.bias is not None, dtype=linear.weight.dtype,
                     block_size=block_size, double_quant=double_quant,
                     part_features=getattr(linear, "part_features", None), device=linear.weight.device)


def nf4_storage(model: nn.Module) -> list[Tensor]:
    """The ``weight_nf4`` of every :class:`NF4Linear` of ``model`` (its quantised weights, frozen uint8
    parameters; biases excluded), registration order."""
    return [m.weight_nf4 for m in model.modules() if isinstance(m, NF4Linear)]


def dequantize_linears(model: nn.Module) -> list[str]:
    """Replace every :class:`NF4Linear` of ``model`` by its dequantised plain linear (:meth:`NF4Linear.to_linear`),
    in place; returns the qualified names replaced."""
    names = [name for name, m in model.named_modules() if isinstance(m, NF4Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, getattr(parent, child).to_linear())
    return names


def _pad_to(flat: Tensor, multiple: int) -> Tensor:
    """``flat`` (n,) with zeros appended up to a multiple of ``multiple``."""
    return F.pad(flat, (0, -flat.numel() % multiple))


def _pack_nibbles(codes: Tensor) -> Tensor:
    """(n,) uint8 codes in 0..15 -> (ceil(n/2),) uint8, codes[2i] << 4 | codes[2i + 1] (an odd n pads code 0.0)."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_full((1,), 7)])  # 7: the code of 0.0, as bitsandbytes pads
    return (codes[0::2] << 4) | codes[1::2]


def _table_like(name: str, like: Tensor) -> Tensor:
    """:func:`_table` on ``like``'s device; a fake tensor of it when ``like`` is one (``handle estimate`` runs a
    QLoRA model's forward and backward on fake tensors, which refuse the cached real table)."""
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return _table(name, like.device)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the code books are built from values (tolist), which fake tensors lack
        table = _table(name, like.device)
    return mode.from_tensor(table)


@functools.cache
def _table(name: str, device: torch.device) -> Tensor:
    """The code tables on ``device``, built once: ``"dynamic"`` (256,) the 8-bit code; ``"midpoints"`` (15,) and
    ``"dynamic_midpoints"`` (255,) the float32 midpoints between neighbouring values of NF4 and of the 8-bit code;
    ``"pairs"`` (256, 2), row b = (NF4[b >> 4], NF4[b & 15])."""
    code = (dynamic_code() if name.startswith("dynamic") else nf4_code()).to(device)
    if name.endswith("midpoints"):
        return (code[:-1] + code[1:]) / 2
    if name == "dynamic":
        return code
    byte = torch.arange(256, device=device)
    return torch.stack([code[byte >> 4], code[byte & 15]], dim=1)

"""LoRA: a low-rank update trained on a frozen base (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models", arXiv:2106.09685, §4.1), computed as peft's ``tuners/lora/layer.py`` (``Linear.forward``) computes it::

    h = base(x) + (α / r) · B · A · dropout(x)        A: (r, in_features), B: (out_features, r)

A starts kaiming-uniform with a = √5 (peft's default, ``init_lora_weights=True``; nn.Linear's own init) and B at
zero, so the adapted model starts as the base. Only A and B train: every other parameter of the model (the
wrapped linears' weights and biases, the embeddings, the norms, the output projection) is frozen
(``requires_grad = False``), so the strategies leave it out of their optimizers and gradient buffers.

What is saved. :func:`apply_lora` hooks the model's ``state_dict``: the frozen base is left out of every
checkpoint and of the final ``model.safetensors`` (whatever the strategy: DDP, FSDP2's DCP, DeepSpeed's engine
all call it), which keep the adapters plus :data:`BASE_HASH_BUFFER`, the SHA-256 of the frozen base; loading one
back checks that hash first (a changed base is a one-line ``CheckpointError``) and accepts the base's absence.

Names. Adapters sit on the linears ``target_modules`` names (:func:`resolve_targets`): this model's names or the
Hugging Face names peft uses (``o_proj`` is ``out_proj`` here); ``attention``, ``mlp`` and ``all`` name groups. A
fused Q/K/V projection (``qkv_proj``, a ``StackedLinear``) gets one adapter per targeted part, so ``q_proj`` and
``v_proj`` adapt the q and v blocks of its rows and export under peft's separate names (``peft_format.py``).

Shapes: x (..., in_features) -> (..., out_features); A·x (..., r).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from torch_handle.config.schema import FINETUNE_TARGETS as TARGETS
from torch_handle.errors import CheckpointError

ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")
MLP = ("gate_proj", "up_proj", "down_proj", "linear1", "linear2")
GROUPS: dict[str, tuple[str, ...]] = {"attention": ATTENTION, "mlp": MLP, "all": ATTENTION + MLP}
"""``target_modules`` groups -> the linears' names (SwiGLU's three and the paper's FFN's two are both "mlp")."""
HF_NAMES: dict[str, str] = {"o_proj": "out_proj"}
"""Hugging Face's (peft's) name -> this model's, where they differ (``model/hf_names.py``)."""
FUSED: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
"""A stacked projection -> the names of its parts, in row order."""
DEFAULT_ADAPTER = "default"
"""peft's adapter name: the key of an unfused linear's one adapter (``q_proj.lora_A.default.weight``)."""
BASE_HASH_BUFFER = "lora_base_sha256"
"""The model's buffer (32 uint8) holding the SHA-256 of its frozen base, saved with the adapters."""


def resolve_targets(target_modules: Sequence[str]) -> set[str]:
    """The linears' names (this model's) that ``target_modules`` selects.

    Raises:
        ValueError: an unknown name (the valid ones listed).
    """
    names: set[str] = set()
    for target in target_modules:
        if target not in TARGETS:
            raise ValueError(f"{target!r} is not a linear of the Transformer (valid: {', '.join(TARGETS)})")
        names.update(GROUPS.get(target, (HF_NAMES.get(target, target),)))
    return names


class LoRALinear(nn.Module):
    """A frozen ``base`` linear plus low-rank adapters: ``base(x) + (alpha / rank) · B · A · dropout(x)``.

    ``base`` is any module with ``in_features``, ``out_features`` and ``forward(x)``: an ``nn.Linear``, a
    ``StackedLinear`` (then ``parts`` names the targeted blocks of its rows, each its own A and B), or a quantised
    frozen base such as QLoRA's NF4 linear (Dettmers et al. 2023), which plugs in here unchanged.

    Args:
        base: the frozen linear; its parameters get ``requires_grad = False``.
        rank: r, the adapters' inner width.
        alpha: α; the update is scaled by α / r (Hu et al. 2021, §4.1).
        dropout: dropout probability on the adapter's input (peft's ``lora_dropout``).
        parts: for a stacked base, the names of its ``part_features`` blocks to adapt, as ``{name: index}``;
            None: one adapter over all rows, named :data:`DEFAULT_ADAPTER`.

    Raises:
        ValueError: a base without in_features / out_features, or rank < 1.
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 parts: dict[str, int] | None = None) -> None:
        super().__init__()
        if not (hasattr(base, "in_features") and hasattr(base, "out_features")):
            raise ValueError(f"{type(base).__name__} has no in_features / out_features: not a linear LoRA can wrap")
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.part_features: tuple[int, ...] = tuple(getattr(base, "part_features", None) or (base.out_features,))
        self.parts = dict(parts) if parts else {DEFAULT_ADAPTER: 0}
        self.adapters_off = False
        """True: the layer is its base alone (:func:`adapters_disabled`: a preference loss's reference model)."""
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.ModuleDict({name: nn.Linear(self.in_features, rank, bias=False) for name in self.parts})
        self.lora_B = nn.ModuleDict({name: nn.Linear(rank, self._rows(i), bias=False)
                                     for name, i in self.parts.items()})
        for p in base.parameters():
            p.requires_grad_(False)
        self.reset_lora_parameters()

    def _rows(self, index: int) -> int:
        return self.out_features if self.parts.keys() == {DEFAULT_ADAPTER} else self.part_features[index]

    def reset_lora_parameters(self) -> None:
        """A kaiming-uniform (a = √5), B zero: peft's ``reset_lora_parameters`` with ``init_lora_weights=True``."""
        for name in self.parts:
            nn.init.kaiming_uniform_(self.lora_A[name].weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[name].weight)

    def delta(self, x: Tensor, parts: slice | None = None, width: int | None = None) -> Tensor:
        """(α / r) · B · A · dropout(x): (..., in) -> (..., rows of ``parts``; all rows when None), zero in the
        rows of blocks without an adapter. ``width``: the base's output features here, when the layer is split
        over tensor-parallel ranks (each part then holds its share of the rows: :meth:`tensor_parallel_plan`)."""
        h = self.lora_dropout(x)
        if self.parts.keys() == {DEFAULT_ADAPTER}:
            return self.lora_B[DEFAULT_ADAPTER](self.lora_A[DEFAULT_ADAPTER](h)) * self.scaling
        index = range(len(self.part_features))[parts or slice(None)]
        whole = sum(self.part_features[i] for i in index)
        by_index = {i: name for name, i in self.parts.items()}
        done = {i: self.lora_B[by_index[i]](self.lora_A[by_index[i]](h)) * self.scaling for i in index
                if i in by_index}
        # the zero blocks take the adapters' leading shape: under sequence parallelism B's layer gathers the sequence
        lead = next(iter(done.values())).shape[:-1] if done else h.shape[:-1]
        blocks = [done[i] if i in done else h.new_zeros(*lead, self.part_features[i] * (width or whole) // whole)
                  for i in index]
        return torch.cat(blocks, dim=-1)

    def forward(self, x: Tensor, parts: slice | None = None) -> Tensor:
        """(..., in_features) -> (..., out_features), or a stacked base's rows of ``parts`` (cross-attention)."""
        out = self.base(x) if parts is None else self.base(x, parts=parts)
        if self.adapters_off:
            return out
        return out + self.delta(x, parts, out.shape[-1]).to(out.dtype)

    def tensor_parallel_plan(self, style: Any) -> dict[str, Any]:
        """How to split this layer when its base is split as ``style`` (a tensor-parallel plan's entry, see
        :mod:`torch_handle.parallel.tensor.plan`): names relative to this module -> their styles. The adapters
        follow the base (Megatron's layout applied to W + B·A), so each rank computes its slice of the update:

        - column-parallel base (``COLWISE``, ``Stacked``: q/k/v, gate/up): B split on its output rows as the base
          is (a stacked base's adapters each on their own part's rows), A replicated. B's layer takes A·x through
          the TP region's ``f`` (identity forward, all-reduce backward), so A's gradient and the input's are
          whole on every rank; under sequence parallelism it gathers A·x (r wide) along the sequence, A's
          gradient is a partial sum (``NORM``) and the adapter's dropout draws the one-process mask
          (``DROPOUT``).
        - row-parallel base (``ROWWISE``: out_proj, down_proj): A split on its input columns as the base is, its
          partial products (r wide) summed over the group (``g``), B replicated (``NORM``: a partial sum under
          sequence parallelism); the adapter's dropout draws the one-process mask of the whole input and keeps
          this rank's features (``SLICE_DROPOUT``).

        Raises:
            ValueError: a style that is not a linear's split (the vocabulary's, a norm's)."""
        from torch_handle.parallel.tensor.plan import Stacked, Style

        if style is Style.ROWWISE:
            split, replicated = "lora_A", "lora_B"
        elif style is Style.COLWISE or isinstance(style, Stacked):
            split, replicated = "lora_B", "lora_A"
        else:
            raise ValueError(f"LoRA adapts linears split by rows or columns, not {style}")
        plan: dict[str, Any] = {"base": style}
        plan.update({f"{split}.{name}": Style.ROWWISE if split == "lora_A" else Style.COLWISE for name in self.parts})
        plan.update({f"{replicated}.{name}": Style.NORM for name in self.parts})
        if isinstance(self.lora_dropout, nn.Dropout):
            plan["lora_dropout"] = Style.DROPOUT if split == "lora_B" else Style.SLICE_DROPOUT
        return plan

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """W + (α / r) · B · A, (out_features, in_features): the base weight with the update folded in (what
        peft's ``merge_and_unload`` writes); a quantised base (NF4) dequantised first. Raises AttributeError for a
        base with neither a plain ``weight`` nor ``dequantize()``."""
        weight = self.base.dequantize() if hasattr(self.base, "dequantize") else self.base.weight.detach().clone()
        offsets = [sum(self.part_features[:i]) for i in range(len(self.part_features))]
        for name, i in self.parts.items():
            update = (self.lora_B[name].weight @ self.lora_A[name].weight) * self.scaling
            start = 0 if name == DEFAULT_ADAPTER else offsets[i]
            weight[start:start + update.shape[0]] += update.to(weight.dtype)
        return weight

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}, adapters={list(self.parts)}"


def _wrap_plan(model: nn.Module, targets: set[str]) -> list[tuple[str, dict[str, int] | None]]:
    """(module name, parts) of every linear ``targets`` selects, in ``named_modules`` order."""
    plan = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not (hasattr(module, "in_features") and hasattr(module, "out_features")) or isinstance(module, LoRALinear):
            continue
        if leaf in FUSED:
            parts = {part: i for i, part in enumerate(FUSED[leaf]) if part in targets}
            if parts:
                plan.append((name, parts))
        elif leaf in targets:
            plan.append((name, None))
    return plan


def base_hash(model: nn.Module, frozen: Iterable[str]) -> bytes:
    """SHA-256 over the frozen parameters ``frozen`` (names, in order) of ``model``: each name, dtype, shape and
    bytes. The reference to the base that checkpoints carry; the same on every rank (each builds the full base)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    digest = hashlib.sha256()
    for name in frozen:
        t = params[name].detach()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.digest()


def wrap_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: Sequence[str]) -> int:
    """Freeze every parameter of ``model`` and wrap its targeted linears in :class:`LoRALinear`, in place, and
    install a ``flops_per_token`` that counts what is computed (:func:`lora_flops_per_token`): the adapted
    architecture alone, no hash and no state-dict hooks, so it runs on the meta device too (``handle estimate``
    sizes a LoRA preset's model with it). Returns the number of linears adapted.

    Raises:
        ValueError: an unknown target name, or no linear of ``model`` matched.
    """
    plan = _wrap_plan(model, resolve_targets(target_modules))
    if not plan:
        raise ValueError(f"finetune.target_modules = {list(target_modules)} matches no linear of the model")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, parts in plan:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), rank, alpha, dropout, parts))
    flops = getattr(model, "flops_per_token", None)
    if flops is not None:
        model.flops_per_token = functools.partial(lora_flops_per_token, model, flops)
    return len(plan)


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: Sequence[str], *,
               quantize: Callable[[nn.Module], Any] | None = None,
               modules_to_save: Sequence[str] = ()) -> dict[str, Any]:
    """Wrap ``model``'s targeted linears in :class:`LoRALinear` in place and freeze everything else, with a
    ``flops_per_token`` that counts what is computed (:func:`wrap_lora`); register the state-dict hooks that keep
    the frozen base out of saved state (see the module's docstring) and the base's hash buffer. Call it on the
    full model, after its base weights are loaded and before any wrapping or sharding.

    ``quantize(model)``, if given, runs after the hash is taken and the adapters are in place, and may replace
    frozen linears by quantised ones (QLoRA: ``finetune/build.py``); the buffers it adds are base storage, kept
    out of saved state like the frozen parameters and rebuilt from the hash-checked base on every load.

    ``modules_to_save`` (this model's module names) stay trainable whole and are saved with the adapters, as
    peft's ``modules_to_save``: the embedding and output projection of a base whose vocabulary grew
    (:mod:`torch_handle.finetune.vocab`).

    Returns:
        ``{"adapted": n linears, "trainable": parameters, "frozen": parameters, "base_sha256": hex}``.

    Raises:
        ValueError: an unknown target name, or no linear of ``model`` matched.
    """
    frozen = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    digest = base_hash(model, frozen)
    adapted = wrap_lora(model, rank, alpha, dropout, target_modules)
    for name in modules_to_save:
        model.get_submodule(name).requires_grad_(True)
    counts = {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad)}
    buffers = {n for n, _ in model.named_buffers()}
    if quantize is not None:
        quantize(model)
    # names after wrapping: the base's weight of "x.q_proj" is now "x.q_proj.base.weight"
    frozen_now = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    frozen_now |= {n for n, _ in model.named_buffers() if n not in buffers}
    model.register_buffer(BASE_HASH_BUFFER, torch.frombuffer(bytearray(digest), dtype=torch.uint8).clone())
    model._register_state_dict_hook(functools.partial(_drop_frozen, frozen=frozen_now))
    model._register_load_state_dict_pre_hook(functools.partial(_check_base, digest=digest), with_module=False)
    model.register_load_state_dict_post_hook(functools.partial(_frozen_not_missing, frozen=frozen_now))
    return {"adapted": adapted, **counts, "base_sha256": digest.hex()}


def _relative(key: str, prefix: str) -> str:
    return key[len(prefix):] if key.startswith(prefix) else key


def _drop_frozen(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any, *,
                 frozen: set[str]) -> None:
    for key in [k for k in state if _relative(k, prefix) in frozen]:
        del state[key]


def _check_base(state: dict[str, Any], prefix: str, *args: Any, digest: bytes) -> None:
    saved = state.get(prefix + BASE_HASH_BUFFER)
    if saved is None:
        raise CheckpointError("the weights hold no LoRA base hash: they are not a LoRA run's adapters")
    saved = saved.full_tensor() if hasattr(saved, "full_tensor") else saved
    theirs = bytes(torch.as_tensor(saved).detach().cpu().to(torch.uint8).tolist())
    if theirs != digest:
        raise CheckpointError(f"the frozen base changed since these adapters were trained (base SHA-256 "
                              f"{digest.hex()[:12]} now, {theirs.hex()[:12]} in the checkpoint): restore the base "
                              f"model.init_from had, or start a new run")


def _frozen_not_missing(module: nn.Module, incompatible: Any, *, frozen: set[str]) -> None:
    # missing keys carry the prefix of the module load_state_dict was called on (DDP's "module.", ...)
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                    if not any(k == f or k.endswith("." + f) for f in frozen)]


def adapter_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Module name -> :class:`LoRALinear`, every adapted linear of ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Every :class:`LoRALinear` of ``model`` computes its base alone inside the block: the frozen base as a
    reference model without a second copy (peft's ``disable_adapter``; TRL's and torchtune's DPO reference under
    PEFT). Not reentrant-safe across threads; the flags are restored on exit, also after an error."""
    layers = list(adapter_modules(model).values())
    for layer in layers:
        layer.adapters_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_off = False


def lora_flops_per_token(model: nn.Module, full: Any, seq_len: int) -> float:
    """Training FLOPs per token of a LoRA model: what is computed, not 6N.

    A trained weight costs 6 FLOPs per parameter and token (2 forward, 2 for the input's gradient, 2 for the
    weight's gradient; PaLM appendix B, ``model/flops.py``). A frozen weight skips its weight-gradient matmul: 4.
    So the count is ``full(seq_len)`` (6 N over every matmul parameter, adapters included, plus the attention
    scores' 12·L·width·seq_len, which have no weights) minus 2 per frozen matmul parameter. Slight overcounts
    kept: the first block's input gradient (the frozen embedding needs none) and the norms' gains (counted as
    matmul parameters by ``flops.matmul_params``). QLoRA's NF4 weights: 4 FLOPs each (forward and the input's
    gradient, on the dequantised weight); their storage (``weight_nf4``, uint8 parameters, which ``full`` counts
    as 6 per byte) none."""
    from torch_handle.finetune.nf4 import NF4Linear, nf4_storage
    from torch_handle.model.flops import embedding_weights

    tables = {id(w) for w in embedding_weights(model)}
    lm_head = getattr(model, "lm_head", None)
    tied = lm_head is not None and id(getattr(lm_head, "weight", None)) in tables
    storage = nf4_storage(model)
    seen: set[int] = {id(t) for t in storage}
    frozen_matmul = 0
    for p in model.parameters():
        if p.requires_grad or id(p) in seen or (id(p) in tables and not tied):
            continue
        seen.add(id(p))
        frozen_matmul += p.numel()
    nf4 = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, NF4Linear))
    return float(full(seq_len)) - 2.0 * frozen_matmul - 6.0 * sum(t.numel() for t in storage) + 4.0 * nf4


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W + (α/r)·B·A) and put the base linear back in its place, in
    place; drops the hooks' buffer. A quantised base (QLoRA's NF4) becomes plain linears of its dequantised
    weights. Returns ``model``, now the plain architecture with merged weights (what ``handle export --merge``
    writes; peft's ``merge_and_unload``)."""
    from torch_handle.finetune.nf4 import dequantize_linears

    for name, module in adapter_modules(model).items():
        base = module.base.to_linear() if hasattr(module.base, "to_linear") else module.base
        base.weight.data.copy_(module.merged_weight())
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, base)
    dequantize_linears(model)
    model._buffers.pop(BASE_HASH_BUFFER, None)
    model._state_dict_hooks.clear()
    model._load_state_dict_pre_hooks.clear()
    model._load_state_dict_post_hooks.clear()
    model.__dict__.pop("flops_per_token", None)
    return model

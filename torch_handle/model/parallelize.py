"""How a model is cut into units: its repeated blocks, what activation checkpointing, FSDP sharding and
per-block compilation all act on, declared once (``BlockModel``) and checked once (``model_blocks``).

The place of torchtitan's ``models/llama3/parallelize.py``: the model's parallel plan (tensor and pipeline
splits) joins it here. Users: the trainer (``training.compile`` compiles each block), the ``fsdp`` strategy
(``fully_shard`` per block, then the model), ``handle estimate`` and the activation telemetry
(``checkpointed_blocks``). The project's ``DecoderLM`` / ``EncoderDecoder`` and the ``hf`` plugin's wrapper are
``BlockModel``s. No torch at import.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

_REQUIRED: Any = object()


@runtime_checkable
class BlockModel(Protocol):
    """A model made of repeated blocks (e.g. Transformer layers).

    ``blocks()`` returns them in forward order, non-empty; each is checkpointed on its own when
    ``args.activation_checkpointing`` is set, is its own FSDP unit and its own ``torch.compile`` unit. ``args`` is
    a frozen dataclass with a bool ``activation_checkpointing``; assigning a new one (``dataclasses.replace``)
    switches checkpointing of the built model (``set_activation_checkpointing``). A model plugin's model may
    leave both out: it is then sharded and compiled as one unit and never checkpointed.
    """

    args: Any

    def blocks(self) -> list[nn.Module]: ...


class NoBlocksError(TypeError):
    """The model does not declare its repeated blocks (``BlockModel.blocks``)."""


def model_blocks(model: Any, default: Any = _REQUIRED) -> list[nn.Module]:
    """The blocks ``model`` declares: ``list(model.blocks())``.

    Args:
        model: an ``nn.Module``, unwrapped (not DDP/DeepSpeed's wrapper).
        default: returned instead of raising for a model that declares none.

    Raises:
        NoBlocksError: ``"<class> has no blocks() (its repeated layers)"``, when ``model`` has no callable
            ``blocks`` or it returns nothing, and no ``default`` is given.
    """
    blocks = list(model.blocks()) if callable(getattr(model, "blocks", None)) else []
    if blocks:
        return blocks
    if default is not _REQUIRED:
        return default
    raise NoBlocksError(f"{type(model).__name__} has no blocks() (its repeated layers)")


def pipeline_parts(model: Any) -> list[nn.Module] | None:
    """The stage modules of a pipeline's shard (:class:`~torch_handle.model.pipeline.PipelineShard`: the modules the
    pipeline calls, one per stage this rank runs), as a list a data-parallel strategy may replace items of with their
    wrappers (DDP) or change in place (fully_shard); None for a model that is not such a shard."""
    return getattr(model, "stage_views", None)


def activation_checkpointing(model: Any) -> bool:
    """``model.args.activation_checkpointing``; False for a model without it."""
    return bool(getattr(getattr(model, "args", None), "activation_checkpointing", False))


def set_activation_checkpointing(model: Any, on: bool) -> None:
    """Switch activation checkpointing of a built ``BlockModel`` by replacing its ``args``."""
    model.args = dataclasses.replace(model.args, activation_checkpointing=on)


def checkpointed_blocks(model: Any) -> list[nn.Module]:
    """The blocks whose inputs autograd keeps instead of their activations: the blocks of a model that trains
    with activation checkpointing (``model`` may be DDP's or DeepSpeed's wrapper: its ``.module`` is used), else
    none."""
    model = getattr(model, "module", model)
    if activation_checkpointing(model) and model.training:
        return model_blocks(model, default=[])
    return []


# ---- tensor parallelism: which linear is split how ---------------------------------------------------------------


def tensor_parallel_plan(model: Any) -> dict[str, Any]:
    """The tensor-parallel plan of the project's decoder or encoder-decoder (Megatron's layout, Shoeybi et al. 2019
    §3): module name -> :class:`torch_handle.parallel.tensor.plan.Style`.

    In each block, Q, K and V (or the fused QKV, each of its parts split on its own: ``Stacked``) are
    column-parallel and the attention's output projection row-parallel, so each rank attends with n_heads/tp whole
    query heads and n_kv_heads/tp whole key/value heads; as query head h reads key/value head h // (n_heads /
    n_kv_heads), rank r's query heads are exactly those of its key/value heads (grouped-query attention needs
    n_kv_heads % tp == 0: :func:`tensor_parallel_problems`). The per-head q/k norms (``qk_norm``) are replicated and
    act on the rank's own heads, no communication (``HEAD_NORM``: their gradients are summed over the TP group).
    RoPE rotates each head by the positions of the whole sequence: attention always sees all of it. The FFN's first
    linear (SwiGLU: its gate and up projections) is column-parallel and its second (down) row-parallel (d_ff/tp
    hidden units per rank: SiLU(gate)·up is elementwise, so each rank's units need nothing else). The norms
    (LayerNorm or RMSNorm) are replicated, and so is a mixture-of-experts layer (router, experts, shared experts):
    every TP rank routes the same tokens (the whole sequence: sequence parallelism is refused with MoE) through the
    same experts, so their gradients are equal on the TP ranks and need no reduction over them. The encoder-decoder's
    cross-attention is split the same way: Q from the decoder state and K, V from the encoder memory are
    column-parallel (two calls of the one fused projection), so the memory enters the TP region of every decoder
    block, gathered along the sequence under sequence parallelism. The token embedding (shared by source and target)
    and the LM head are split over the vocabulary (the loss is vocabulary-parallel: the logits are never gathered).
    Under sequence parallelism the norms and the embedding and residual dropouts run on 1/tp of the sequence,
    from the positional encoding on (the encoder's and the decoder's; the dropouts draw the one-process masks:
    ``Style.DROPOUT``). A planned linear wrapped by LoRA (``LoRALinear``) is planned as its parts: its base split as
    the linear would be, its adapters with it (``LoRALinear.tensor_parallel_plan``).

    Raises:
        ValueError: one line, for a model without a plan (one that is not ``DecoderLM`` or ``EncoderDecoder``).
    """
    from torch_handle.model.moe import MoEFeedForward
    from torch_handle.model.transformer import DecoderLM, EncoderDecoder
    from torch_handle.parallel.tensor.plan import Stacked, Style

    if isinstance(model, DecoderLM):
        stacks, final_norms = {"layers": model.layers}, ["final_norm"]
    elif isinstance(model, EncoderDecoder):
        stacks = {"encoder_layers": model.encoder_layers, "decoder_layers": model.decoder_layers}
        final_norms = ["encoder_norm", "decoder_norm"]
    else:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (the project's decoder and "
                         f"encoder-decoder have one)")
    plan = {"embed": Style.VOCAB_EMBED, "pos_encoding": Style.TO_SEQUENCE, "embed_dropout": Style.DROPOUT}
    for stack, layers in stacks.items():
        for i, layer in enumerate(layers):
            prefix = f"{stack}.{i}"
            for name in ("self_attn", "cross_attn"):
                attn = getattr(layer, name, None)
                if attn is None:
                    continue
                if attn.fused_qkv:
                    q, kv = attn.n_heads * attn.d_k, attn.n_kv_heads * attn.d_k  # from the heads: a split model too
                    plan[f"{prefix}.{name}.qkv_proj"] = Stacked((q, kv, kv))
                else:
                    plan.update({f"{prefix}.{name}.{p}_proj": Style.COLWISE for p in "qkv"})
                plan[f"{prefix}.{name}.out_proj"] = Style.ROWWISE
                plan.update({f"{prefix}.{name}.{norm}": Style.HEAD_NORM for norm in ("q_norm", "k_norm")
                             if getattr(attn, norm, None) is not None})
            if not isinstance(layer.ff, MoEFeedForward):  # an MoE layer is replicated over tp (see above)
                ff = ("gate_proj", "up_proj", "down_proj") if hasattr(layer.ff, "gate_proj") else ("linear1", "linear2")
                plan.update({f"{prefix}.ff.{linear}": Style.COLWISE for linear in ff[:-1]})
                plan[f"{prefix}.ff.{ff[-1]}"] = Style.ROWWISE
            plan.update({f"{prefix}.{norm}": Style.NORM for norm in ("self_attn_norm", "cross_attn_norm", "ff_norm")
                         if getattr(layer, norm, None) is not None})
            plan[f"{prefix}.dropout"] = Style.DROPOUT
    if model.args.norm_first:
        plan.update({norm: Style.NORM for norm in final_norms})
    plan["lm_head"] = Style.VOCAB_HEAD
    return _wrapped_plans(model, plan)


def _wrapped_plans(model: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` with each planned module that wraps its linear (LoRA's ``LoRALinear``: the base plus adapters) replaced
    by the plan the wrapper gives for its parts (``module.tensor_parallel_plan(style)``, names relative to it)."""
    out = {}
    for name, style in plan.items():
        split = getattr(model.get_submodule(name), "tensor_parallel_plan", None)
        out.update({f"{name}.{part}": s for part, s in split(style).items()} if callable(split) else {name: style})
    return out


def replicated_numel(model: Any) -> int:
    """Elements of the parameters a tensor-parallel split of ``model`` keeps whole on every TP rank: those of the
    plan's NORM and HEAD_NORM modules and the biases of its ROWWISE linears (what sequence parallelism all-reduces
    once a step, :func:`torch_handle.parallel.tensor.layers.all_reduce_sp_grads`). Raises ValueError for a model
    without a plan."""
    from torch_handle.parallel.tensor.plan import Style

    n = 0
    for name, style in tensor_parallel_plan(model).items():
        module = model.get_submodule(name)
        if style is Style.NORM or style is Style.HEAD_NORM:
            n += sum(p.numel() for p in module.parameters())
        elif style is Style.ROWWISE and module.bias is not None:
            n += module.bias.numel()
    return n


def tensor_parallel_problems(args: Any, tp: int, *, vocab_size: int | None, seq_len: int, sequence_parallel: bool,
                             scratch: bool) -> list[tuple[str, str]]:
    """What keeps a model with ``args`` (``n_heads``, ``d_ff``: a TransformerArgs or the plugin's options) from
    splitting ``tp`` ways, as (key, message) pairs; empty when it can. Checked before anything starts: every rank
    must get whole heads and equal slices. ``vocab_size`` None: not known before the tokenizer is built. The
    model's part (:func:`width_problems`) and the data's (:func:`data_split_problems`) read nothing of each other."""
    return [*width_problems(args, tp), *data_split_problems(tp, vocab_size=vocab_size, seq_len=seq_len,
                                                            sequence_parallel=sequence_parallel, scratch=scratch)]


def width_problems(args: Any, tp: int) -> list[tuple[str, str]]:
    """The model's widths that ``tp`` ranks cannot split evenly (``n_heads``, ``n_kv_heads``, ``d_ff``), as (key,
    message) pairs.

    Grouped-query attention with n_kv_heads not divisible by tp is refused, naming the tp that work (the divisors of
    n_kv_heads), rather than each rank keeping copies of the key/value heads its query heads need (Megatron-LM's
    answer when tp > n_kv_heads): the copies would be replicated parameters whose gradients must be summed across the
    ranks sharing them, for a layout that only pays off with more ranks than key/value heads."""
    out = []
    if args.n_heads % tp:
        out.append(("n_heads", f"{args.n_heads} is not divisible by parallel.tp = {tp} (each rank takes whole heads)"))
    n_kv_heads = getattr(args, "n_kv_heads", None)
    if n_kv_heads and n_kv_heads % tp and not args.n_heads % tp:
        valid = ", ".join(str(d) for d in range(1, n_kv_heads + 1) if n_kv_heads % d == 0)
        out.append(("n_kv_heads", f"{n_kv_heads} is not divisible by parallel.tp = {tp} (each rank takes whole "
                                  f"key/value heads; tp may be {valid})"))
    if args.d_ff % tp:
        out.append(("d_ff", f"{args.d_ff} is not divisible by parallel.tp = {tp}"))
    return out


def data_split_problems(tp: int, *, vocab_size: int | None, seq_len: int, sequence_parallel: bool, scratch: bool
                        ) -> list[tuple[str, str]]:
    """The data's sizes that ``tp`` ranks cannot split evenly (``vocab_size`` for the hand-written vocabulary-parallel
    embedding, ``seq_len`` under sequence parallelism), as (key, message) pairs."""
    out = []
    if scratch and vocab_size is not None and vocab_size % tp:
        out.append(("vocab_size", f"{vocab_size} is not divisible by parallel.tp = {tp} (the hand-written "
                                  f"vocabulary-parallel embedding and loss split it evenly)"))
    if sequence_parallel and seq_len % tp:
        out.append(("seq_len", f"{seq_len} is not divisible by parallel.tp = {tp} (sequence parallelism splits the "
                               f"sequence evenly)"))
    return out


def parallelize_tensor(model: Any, impl: str, tp: Any, *, sequence_parallel: bool = False) -> Any:
    """Split ``model`` (built with the same seed on every TP rank) over its TP group, in place; returns it.

    ``impl``: ``"scratch"`` (``tp`` a :class:`~torch_handle.parallel.tensor.mappings.TPGroup`: the hand-written
    layers; the forward returns local logits (B, T, V/tp) for ``vocab_parallel_cross_entropy``) or ``"native"``
    (``tp`` the "tp" ``DeviceMesh``: DTensor ``parallelize_module``; the forward returns a vocabulary-sharded
    DTensor for ``F.cross_entropy`` under ``loss_parallel()``). Tied embeddings stay tied: the token table and the
    LM head are split over the same vocabulary rows, so each rank's slices are one tensor. An encoder-decoder under
    sequence parallelism pads its inputs to a multiple of tp inside its forward (:class:`PadToMultiple`). A frozen
    parameter (LoRA's base) stays frozen in its split.

    Raises:
        ValueError: a model without a plan, or an unknown ``impl``."""
    from torch_handle.model.transformer import EncoderDecoder
    from torch_handle.parallel.tensor.plan import apply_native, apply_scratch

    plan = tensor_parallel_plan(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # LoRA's base: stays frozen
    if impl == "scratch":
        apply_scratch(model, plan, tp, sequence_parallel=sequence_parallel)
    elif impl == "native":
        apply_native(model, plan, tp, sequence_parallel=sequence_parallel)
    else:
        raise ValueError(f"unknown tensor-parallel implementation {impl!r}; expected 'scratch' or 'native'")
    if model.args.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    for name, p in model.named_parameters():  # the split layers' parameters are new ones (names unchanged)
        p.requires_grad_(name not in frozen)
    if sequence_parallel and isinstance(model, EncoderDecoder):
        PadToMultiple(tp.size if impl == "scratch" else tp.size(), model.args.pad_id).attach(model)
    return model


class PadToMultiple:
    """Right-pad the encoder-decoder's source and target to a multiple of tp, for sequence parallelism, and cut
    the logits back to the target's length.

    A translation batch is padded to its longest sentence (``pad_collate``), any length; sequence parallelism
    splits both sequences evenly. Extra ``pad_id`` positions change nothing the loss sees: padded source
    positions are masked as keys (encoder self-attention, cross-attention), padded target positions come after
    every real one (causal) and are masked as keys too, and their logits are dropped, so they get no gradient.
    The data never exceeds ``data.seq_len`` tokens, a multiple of tp under sequence parallelism, so the padded
    length stays within the positional table.

    Shapes: forward(src_ids (B, S), tgt_ids (B, T)) -> logits (B, T, V or V/tp), S and T padded inside."""

    def __init__(self, multiple: int, pad_id: int | None) -> None:
        self.multiple, self.pad_id = multiple, pad_id
        self.tgt_len = 0

    def attach(self, model: Any) -> None:
        model.register_forward_pre_hook(self.pad, with_kwargs=True)
        model.register_forward_hook(self.cut)

    def _pad(self, ids: Any) -> Any:
        import torch.nn.functional as F

        extra = -ids.shape[1] % self.multiple
        if extra and self.pad_id is None:
            raise ValueError(f"sequence length {ids.shape[1]} is not divisible by parallel.tp = {self.multiple} and "
                             f"the model has no pad_id to pad it with (sequence parallelism splits it evenly)")
        return F.pad(ids, (0, extra), value=self.pad_id) if extra else ids

    def pad(self, _model: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = {**dict(zip(("src_ids", "tgt_ids"), args)), **kwargs}
        self.tgt_len = ids["tgt_ids"].shape[1]
        return (), {**ids, "src_ids": self._pad(ids["src_ids"]), "tgt_ids": self._pad(ids["tgt_ids"])}

    def cut(self, _model: Any, _args: tuple, logits: Any) -> Any:
        return logits[:, :self.tgt_len] if logits.shape[1] != self.tgt_len else logits

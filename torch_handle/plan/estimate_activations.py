"""Activation bytes of one micro-batch on one rank, measured on fake tensors: the activation part of ``handle
estimate`` (:mod:`torch_handle.plan.estimate`).

One forward and backward of the real model on fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``:
shapes and dtypes only, no memory), counting the distinct storages autograd saves for backward
(:class:`~torch_handle.observe.activations.SavedTensorCounter`) at the preset's precision, sequence length,
micro-batch size and activation checkpointing (``activation_saved_bytes``); plus the loss path's fp32
logits-sized buffers beyond those (``activation_logits_bytes``: :func:`full_loss_bytes`, or one chunk's with
the chunked loss, :func:`chunked_loss_bytes`), and with checkpointing the largest block's activations recomputed
during backward (``activation_recompute_bytes``); ``activation_bytes`` is their total. Like torchtitan's memory
estimator (which runs the train step under ``FakeTensorMode`` and tracks allocations), nothing is allocated.

With ``[parallel] tp > 1`` the model measured is one TP rank's split model (:func:`~torch_handle.plan.
estimate_model.build_model`: the hand-written layers with a shape-only group), its loss the vocabulary-parallel
cross-entropy, so the figure is what this project's TP code saves, including what the analytic figure leaves out:
with sequence parallelism a column-parallel linear keeps its all-gathered (b, s, h) input for backward, where
Megatron-LM keeps the 1/tp shard and gathers it again. The analytic figure is Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", Table 2 (:func:`korthikanti_layer_bytes`); the
logits buffers are (b, s, V/tp) with the vocabulary-parallel loss. DTensor's ``native`` split saves the same local
storages but a few small ones (checked on real 2-rank runs of both, ``tests/test_estimate.py``).

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch_handle.common.precision import torch_dtype
from torch_handle.observe.activations import SavedTensorCounter, _storage
from torch_handle.observe.fields import (ACTIVATION_BYTES, ACTIVATION_LOGITS_BYTES, ACTIVATION_RECOMPUTE_BYTES,
                                         ACTIVATION_SAVED_BYTES)
from torch_handle.plan.estimate_model import ModelBuild, build_model, lm_inputs, model_build, rows_per_sample

if TYPE_CHECKING:
    import torch

    from torch_handle.config.schema import Preset
    from torch_handle.registry import PluginRegistry

__all__ = ["ActivationBytes", "PartSaved", "activation_bytes", "chunked_loss_bytes", "compute_mode", "fake_activations",
           "full_loss_bytes", "korthikanti_layer_bytes", "saved_activation_bytes"]


FULL_LOSS_BUFFERS = 2
"""fp32 (tokens x V) buffers the full loss path holds beside what autograd saves, on one process: the logits in
forward; in backward ``F.cross_entropy``'s ``nll_loss`` writes the log-probabilities' gradient and ``log_softmax``
the logits' gradient beside the saved log-probabilities (which the saved count has): three logits-sized fp32
buffers live at once, two of them beyond it. Pricing one (as before) put the estimate at 0.72x the measured full
path (``benchmarks/loss_memory.py --as-cuda``, docs/performance.md); two, at 0.99-1.00x."""
SPLIT_LOSS_BUFFERS = 1
"""The same for the vocabulary-parallel loss (``parallel.tp > 1``, (tokens x V/tp) buffers): its backward writes
one gradient beside the saved softmax (``parallel.tensor.cross_entropy``), so one beyond the saved count."""


def full_loss_bytes(tokens: int, vocab: int, split: bool = False) -> int:
    """Bytes the full loss path holds beside what autograd saves: ``FULL_LOSS_BUFFERS`` fp32 (``tokens`` x
    ``vocab``) buffers, ``SPLIT_LOSS_BUFFERS`` for the vocabulary-parallel loss (``split``; ``vocab`` then this
    rank's V/tp). ``ActivationBytes.logits`` of a full row; ``benchmarks/loss_memory.py`` prints it against the
    measured loss path."""
    return (SPLIT_LOSS_BUFFERS if split else FULL_LOSS_BUFFERS) * tokens * vocab * 4


def chunked_loss_bytes(tokens: int, vocab: int, width: int, dtype: Any, weight_dtype: Any, hidden_itemsize: int
                       ) -> int:
    """Bytes the chunked loss (``model.linear_cross_entropy``) holds beside what autograd saves, at a GPU's chunk:
    one chunk's fp32 logits (``chunk_rows`` rows of ``vocab``) and beside them the larger of their gradient in
    ``dtype`` and, where the weight is read a block at a time (not ``cast_whole``), twice a block of ``weight_rows``
    rows in ``dtype`` (the cast block and what its product with the chunk takes while the logits are filled); the
    (V, C) weight in ``dtype`` where it is cast whole; and the hidden states' gradient (tokens x ``width`` x
    ``hidden_itemsize``), computed in forward and held until backward. ``ActivationBytes.logits`` of a chunked row;
    ``benchmarks/loss_memory.py`` prints it against the measured loss path."""
    import torch

    from torch_handle.model.linear_cross_entropy import cast_whole, chunk_rows, weight_rows

    rows, itemsize = chunk_rows(tokens, vocab, "cuda"), dtype.itemsize
    weight = torch.empty((vocab, width), dtype=weight_dtype, device="meta")
    whole = weight_dtype == dtype or cast_whole(tokens, weight, dtype)
    copy = vocab * width * itemsize if weight_dtype != dtype and whole else 0
    blocks = 0 if whole else 2 * weight_rows(vocab, width, "cuda") * width * itemsize
    return rows * vocab * 4 + max(rows * vocab * itemsize, blocks) + copy + tokens * width * hidden_itemsize


def saved_activation_bytes(run_forward_backward: Callable[[], Any], model: torch.nn.Module | None = None) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``run_forward_backward()`` (one
    micro-batch's forward, loss and backward), on real tensors: the telemetry's ``activation_saved_bytes``.

    ``model``: its parameters and buffers are left out (model state), and with activation checkpointing
    (``model.args.activation_checkpointing``) its ``blocks()``' inputs count in place of what the checkpointed
    blocks would have saved. The function adds nothing to the memory held: tensors are saved unchanged.

    This is the ``saved`` part of :class:`ActivationBytes` (the estimate adds the fp32 logits buffer and the
    recomputed block). ``model`` may be wrapped (DDP, a DeepSpeed engine: its ``.module`` is used). Under ZeRO-3
    and FSDP2 the parameters gathered for a block are other storages than the shards, so weights that autograd
    saves (e.g. for a matmul's backward) count here too, at their gathered size, although the strategy may free
    or reshard them between forward and backward.
    """
    from torch_handle.model.parallelize import checkpointed_blocks

    exclude = [*model.parameters(), *model.buffers()] if model is not None else []
    with SavedTensorCounter(exclude, checkpointed_blocks(model) if model is not None else []) as counter:
        run_forward_backward()
    return counter.bytes


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one micro-batch on one rank."""

    saved: int
    """Distinct storages autograd saves in forward (inputs of checkpointed blocks included): held until backward
    frees them."""
    logits: int
    """The loss path's bytes beside what autograd saves: with the full path two fp32 (B, T, V) buffers (the logits
    in forward; the log-probabilities' and the logits' gradients in backward, beside the saved log-probabilities),
    one (B, T, V/tp) with tensor parallelism (its gradient beside the saved softmax): :func:`full_loss_bytes`."""
    recompute: int
    """With activation checkpointing: the largest block's saved tensors, rebuilt in backward; else 0."""
    loss_impl: str = "full"
    """The loss path priced (``training.loss_impl`` as the run resolves it): ``"full"``, ``logits`` is
    :func:`full_loss_bytes`; ``"chunked"``, one chunk's fp32 logits and their gradient in the compute dtype
    (``model.linear_cross_entropy.chunk_rows`` rows, at a GPU's chunk) plus the hidden states' gradient, which the
    chunked loss computes in forward and holds until backward."""

    @property
    def total(self) -> int:
        return self.saved + self.logits + self.recompute

    def as_fields(self) -> dict[str, int]:
        """The parts and their total under the names the memory telemetry uses
        (:mod:`torch_handle.observe.fields`): ``activation_bytes`` is the total, ``activation_saved_bytes`` what
        the trainer measures."""
        return {ACTIVATION_BYTES: self.total, ACTIVATION_SAVED_BYTES: self.saved,
                ACTIVATION_LOGITS_BYTES: self.logits, ACTIVATION_RECOMPUTE_BYTES: self.recompute}


class PartSaved:
    """Which parts of a decoder save each storage for backward, from one forward and backward of the whole model:
    part 0 is the embedding (token table, positions, embedding dropout), 1 .. L the layers, L + 1 the final norm
    and the head, L + 2 the loss. A storage belongs to the part whose forward saves it (under activation checkpointing
    a block's input belongs to that block), to every such part when several save it.

    A pipeline stage running parts a .. b saves every storage that one of them saves: :meth:`stage_bytes`. A
    tensor the whole model computes once and several layers save (the padding mask) counts once per stage, as
    each stage computes its own; a stage's received activation is what its first layer saves of the previous
    layer's output."""

    def __init__(self) -> None:
        self.saved: dict[frozenset[int], int] = {}
        """Bytes of the distinct storages saved by exactly each set of parts."""
        self.params: dict[frozenset[int], int] = {}
        """The same for the parameters autograd saves (a matmul's weight): what FSDP2 and ZeRO-3 hold gathered,
        at full size, while a micro-batch's saved tensors reference them."""
        self.n_layers = 0

    def counter(self, model: Any, exclude: list[Any], blocks: list[Any]) -> SavedTensorCounter:
        """A :class:`SavedTensorCounter` for ``model``'s step that fills this object when it exits."""
        return _PartCounter(self, model, exclude, blocks)

    def extended(self, n_layers: int) -> PartSaved | None:
        """The parts of the same decoder with ``n_layers`` layers, from this measurement of it with 3 (first,
        middle, last layer): the middle layer's own storages repeat for every middle layer, storages saved by all
        three layers (the padding mask) by all ``n_layers``. None where a storage is shared otherwise (measure the
        whole model then)."""
        n = self.n_layers
        if n == n_layers:
            return self
        if n != 3 or n_layers < 3:
            return None
        out = PartSaved()
        out.n_layers = n_layers
        middle = range(2, n_layers)
        where = {0: [0], 1: [1], 2: list(middle), 3: [n_layers], 4: [n_layers + 1], 5: [n_layers + 2]}
        for table, into in ((self.saved, out.saved), (self.params, out.params)):
            for parts, nbytes in table.items():
                if parts == {2}:
                    sets = [frozenset([j]) for j in middle]
                elif {1, 2, 3} <= parts or 2 not in parts:
                    sets = [frozenset(j for p in parts for j in where[p])]
                else:
                    return None
                for key in sets:
                    into[key] = into.get(key, 0) + nbytes
        return out

    def stage_bytes(self, first: int, last: int, params: bool = False) -> int:
        """Bytes one micro-batch saves in a stage that runs parts ``first`` .. ``last`` (inclusive); ``params``:
        of the parameters it saves."""
        table = self.params if params else self.saved
        return sum(n for parts, n in table.items() if any(first <= p <= last for p in parts))


class _PartCounter(SavedTensorCounter):
    def __init__(self, out: PartSaved, model: Any, exclude: list[Any], blocks: list[Any]) -> None:
        super().__init__(exclude, blocks)
        self._out, self._model, self._part = out, model, 0
        self._parts: dict[int, set[int]] = {}
        self._params: dict[int, tuple[int, set[int]]] = {}
        self._labels: list[Any] = []

    def add(self, t: Any) -> None:
        super().add(t)
        if getattr(t, "numel", None) is not None and t.numel() > 0:
            key, nbytes = _storage(t)
            if key in self._seen:
                self._parts.setdefault(key, set()).add(self._part)
            elif key in self._exclude and t.is_floating_point():
                self._params.setdefault(key, (nbytes, set()))[1].add(self._part)

    def _label(self, part: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._part = part
        return hook

    def __enter__(self) -> _PartCounter:
        m = self._model
        parts = {id(layer): i + 1 for i, layer in enumerate(m.layers)}
        run_block = m._run_block

        def labelled(name: str, block: Any, *args: Any, **kwargs: Any) -> Any:
            self._part = parts[id(block)]  # before checkpointing saves the block's inputs
            return run_block(name, block, *args, **kwargs)

        m._run_block = labelled
        self._labels = [m.final_norm.register_forward_pre_hook(self._label(len(m.layers) + 1)),
                        m.lm_head.register_forward_hook(self._label(len(m.layers) + 2))]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for h in self._labels:
            h.remove()
        del self._model._run_block
        self._out.n_layers = len(self._model.layers)
        for key, parts in self._parts.items():
            ps = frozenset(parts)
            self._out.saved[ps] = self._out.saved.get(ps, 0) + self._seen[key]
        for nbytes, parts in self._params.values():
            ps = frozenset(parts)
            self._out.params[ps] = self._out.params.get(ps, 0) + nbytes


def korthikanti_layer_bytes(seq_len: int, micro_batch_size: int, d_model: int, n_heads: int, tp: int = 1,
                            sequence_parallel: bool = False) -> float:
    """Activation bytes one Transformer layer keeps for backward on one TP rank, by Korthikanti et al. 2022, Table 2
    (16-bit activations, 1-byte dropout masks, FFN of 4h, no recomputation): s = ``seq_len``, b =
    ``micro_batch_size``, h = ``d_model``, a = ``n_heads``, t = ``tp``::

        s·b·h·(10 + 24/t + 5·a·s/(h·t))     tensor parallel
        s·b·h·(34/t + 5·a·s/(h·t))           tensor + sequence parallel

    (t = 1: s·b·h·(34 + 5·a·s/h)). The reference the measured figure is checked against, not what the estimate
    reports (that is measured, :func:`activation_bytes`)."""
    s, b, h, a, t = seq_len, micro_batch_size, d_model, n_heads, tp
    attention_scores = 5 * a * s / (h * t)
    per_token = 34 / t if sequence_parallel else 10 + 24 / t
    return s * b * h * (per_token + attention_scores)


def compute_mode(strategy: str, precision: str) -> str:
    """How the strategy computes: ``fp32``; ``autocast`` (single, ddp, scratch-ddp: fp32 weights, bf16/fp16
    autocast); ``cast`` (deepspeed and fsdp: the weights themselves are bf16/fp16 during compute)."""
    if precision == "fp32":
        return "fp32"
    return "autocast" if strategy in ("single", "ddp", "scratch-ddp") else "cast"


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for floating parameters and buffers, tied weights kept tied; works on fake tensors
    (where ``Module.to`` refuses to swap them)."""
    import torch

    cast: dict[int, Any] = {}
    for module in model.modules():
        for table, make in ((module._parameters, torch.nn.Parameter), (module._buffers, lambda t: t)):
            for name, t in table.items():
                if t is not None and t.is_floating_point():
                    if id(t) not in cast:
                        cast[id(t)] = make(t.detach().to(dtype))
                    table[name] = cast[id(t)]


def fake_activations(build: ModelBuild, batch: int, seq_len: int, precision: str, mode: str, checkpointing: bool,
                     parts: PartSaved | None = None, backward: bool = True, loss_impl: str = "full"
                     ) -> ActivationBytes:
    """:class:`ActivationBytes` of ``build``'s model (one TP rank's split model when ``build.tp`` > 1) for one
    micro-batch of ``batch`` x ``seq_len`` tokens, computed in ``mode`` (:func:`compute_mode`), on fake tensors.

    ``parts`` (a decoder's only): filled with which parts of the model save each storage (:class:`PartSaved`).
    ``backward=False``: forward and loss only; what is saved is counted when the forward saves it, so only the
    time differs (checkpointed blocks' recomputation in backward saves through the checkpoint's own hooks).
    ``loss_impl = "chunked"`` (a decoder on one TP rank): the model returns its hidden states and the chunked
    loss applies the output layer (:func:`torch_handle.train.loss.chunked_loss_fn`), as the trainer runs it."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from torch_handle.model.parallelize import checkpointed_blocks, model_blocks, set_activation_checkpointing
    from torch_handle.model.linear_cross_entropy_tp import vocab_parallel_linear_cross_entropy
    from torch_handle.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
    from torch_handle.plan.shape_tp_group import ShapeTPGroup

    from torch_handle.plan.estimate_moe import dropless, fake_grouped_matmuls
    from torch_handle.train.loss import chunked_loss_fn

    build = dropless(build)  # a capacity's cut depends on the routing: measured at its most, dropless
    dtype = torch_dtype(precision)
    group = ShapeTPGroup(build.tp) if build.tp > 1 else None
    # the vocabulary-parallel loss's backward indexes with nonzero(): a data-dependent shape needs a ShapeEnv
    with FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv() if group else None):
        model = build_model(build, group)
        fake_grouped_matmuls(model)
        model.train()
        if mode == "cast":
            _cast_parameters(model, dtype)
        ids = torch.randint(4, build.vocab_size, (batch, seq_len))
        inputs = lm_inputs(build, ids) if build.kind == "lm" else {"src_ids": ids, "tgt_ids": ids.clone()}
        labels = torch.randint(4, build.vocab_size, (batch, seq_len))
        autocast = torch.autocast("cpu", dtype=dtype) if mode == "autocast" else contextlib.nullcontext()
        exclude = [*model.parameters(), *model.buffers()]
        per_block: list[int] = []
        vocab_local: list[int] = []
        loss_path: list[int] = []  # bytes of the loss path beside the saved tensors (the ActivationBytes' logits)

        def step(counter: SavedTensorCounter, blocks: list[Any]) -> None:
            before: list[int] = []
            handles = [b.register_forward_pre_hook(lambda *_: before.append(counter.bytes)) for b in blocks]
            handles += [b.register_forward_hook(lambda *_: per_block.append(counter.bytes - before.pop()))
                        for b in blocks]
            try:
                with counter:
                    if loss_impl == "chunked":
                        with autocast:
                            hidden = model(**inputs, return_hidden=True)  # (B, T, C); (B, T/tp, C) under sp
                            if group is None:
                                loss, _ = chunked_loss_fn(hidden, model.lm_head.weight, labels)
                            else:  # each rank its (V/tp, C) rows
                                loss = vocab_parallel_linear_cross_entropy(
                                    hidden, model.lm_head.weight, labels, group,
                                    sequence_parallel=build.sequence_parallel)
                        weight = model.lm_head.weight  # (V, C)
                        loss_path.append(chunked_loss_bytes(batch * seq_len, weight.shape[0], weight.shape[1],
                                                            dtype if mode == "autocast" else weight.dtype,
                                                            weight.dtype, hidden.element_size()))
                        if backward:
                            loss.backward()
                        return
                    with autocast:
                        logits = model(**inputs)
                    vocab_local.append(logits.shape[-1])
                    loss_path.append(full_loss_bytes(batch * seq_len, logits.shape[-1], group is not None))  # V/tp
                    if group is None:
                        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
                    else:
                        loss, _ = vocab_parallel_cross_entropy(logits, labels, group)
                    if backward:
                        loss.backward()
            finally:
                for h in handles:
                    h.remove()

        counter = SavedTensorCounter(exclude, checkpointed_blocks(model))
        if parts is not None:
            counter = parts.counter(model, exclude, checkpointed_blocks(model))
        step(counter, [])
        recompute = 0
        if checkpointing:  # what one block saves, measured on the same model without checkpointing
            set_activation_checkpointing(model, False)
            step(SavedTensorCounter(exclude), model_blocks(model))
            recompute = max(per_block, default=0)
        return ActivationBytes(counter.bytes, loss_path[0], recompute, loss_impl)


def activation_bytes(preset: Preset, registry: PluginRegistry, strategy: str | None = None,
                     loss_impl: str | None = None) -> ActivationBytes:
    """Activation bytes of one micro-batch (``training.micro_batch_size`` x ``data.seq_len``, twice the rows for
    DPO pairs: :func:`~torch_handle.plan.estimate_model.rows_per_sample`) of ``preset``'s
    model under ``strategy``'s way of computing (default: the preset's), on one rank, measured on fake tensors;
    with ``[parallel] tp > 1``, of one TP rank (with or without sequence parallelism, as the preset says). The loss
    path is ``loss_impl`` (default: what the preset's run takes, :func:`loss_impl_of`).

    Encoder-decoder models take source and target of ``seq_len`` tokens each (an upper bound: batches are
    padded to their longest sentence).

    Raises:
        PresetError: a dataset without ``vocab_size``/``seq_len`` options.
        ValueError: tp > 1 for a model that has no tensor-parallel plan.
    """
    build = model_build(preset, registry)
    mode = compute_mode(strategy or preset.strategy.name, preset.training.precision)
    seq, rows = preset.data.options.seq_len, preset.training.micro_batch_size * rows_per_sample(preset)
    return fake_activations(build, rows, seq, preset.training.precision, mode,
                            bool(getattr(preset.model.options, "activation_checkpointing", False)),
                            loss_impl=loss_impl or loss_impl_of(preset, registry))


def loss_impl_of(preset: Preset, registry: PluginRegistry, strategy: str | None = None, zero_stage: int = 0) -> str:
    """The loss path (``"full"`` or ``"chunked"``) a run of ``preset`` takes (``training.loss_impl`` resolved by
    :func:`torch_handle.train.loss.pick_loss_impl`), under ``strategy`` at ``zero_stage`` when given (a
    ``--compare`` row's) instead of the preset's own; a row where ``"chunked"`` cannot run is priced ``"full"``."""
    from types import SimpleNamespace

    from torch_handle.config.loss_impl import chunked_loss_problem
    from torch_handle.train.loss import pick_loss_impl

    t = preset.training
    tokens = t.micro_batch_size * rows_per_sample(preset) * preset.data.options.seq_len
    vocab = model_build(preset, registry).vocab_size
    layout: Any = preset
    if strategy is not None:
        layout = SimpleNamespace(model=preset.model, parallel=preset.parallel, strategy=SimpleNamespace(
            name=strategy, options=SimpleNamespace(zero_stage=zero_stage)))
    problem = chunked_loss_problem(layout)
    return pick_loss_impl("auto" if t.loss_impl == "chunked" and problem else t.loss_impl, tokens, vocab, problem)

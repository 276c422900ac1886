"""The decoder's pipeline split: which layers each stage runs, and the stage modules themselves.

A decoder of L layers splits into ``n_stages`` consecutive runs of layers; the first stage also embeds the tokens,
the last also applies the final norm and the output projection (torchtitan's ``pipeline_module_split`` does the
same for its models). Each rank keeps a :class:`PipelineShard`: the parts of the model its stages run, under the
names they have in the whole model (``layers.5.ff.linear1.weight`` stays that), so a stage's state dict is a slice
of the one-process state dict and checkpoints join by name.

Tied embeddings: the first stage's token table and the last stage's output projection are one matrix in the
one-process model. Split over two ranks each holds a copy; the pipeline sums their gradients across the two
before the optimizer step (DeepSpeed's ``TiedLayerSpec``), so both copies take the same step and stay equal.

The encoder-decoder has no split: an encoder's output is needed by every decoder layer, so a pipeline over it
sends the memory to every decoder stage (Megatron-LM dropped its encoder-decoder pipelining in 2025). It is a
one-line error (:func:`pipeline_problems`).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import Tensor, nn

from torch_handle.model.transformer import DecoderLM, _TransformerModel, documents_of


def split_layers(n_layers: int, n_stages: int, layers: Sequence[int] = (), *, by: str = "layers",
                 layer_params: int = 0, embed_params: int = 0, head_params: int = 0) -> list[range]:
    """The layers of each stage, as consecutive ranges covering ``range(n_layers)``.

    ``layers`` given: the number of layers of each stage, as the preset lists them. Else balanced: ``by =
    "layers"`` gives every stage ``n_layers / n_stages`` (the first stages one more when it does not divide);
    ``by = "params"`` counts the embedding on the first stage and the head on the last as that many parameters
    (``embed_params``, ``head_params``; a tied head counts once, on the first stage) and gives each stage layers until
    it holds its share of ``layer_params · n_layers + embed_params + head_params`` (greedy, at least one layer each).

    Raises:
        ValueError: a stage without layers, or ``layers`` that do not add up to ``n_layers``.
    """
    if layers:
        counts = list(layers)
    elif by == "params" and layer_params > 0:
        extra = [0] * n_stages
        extra[0] += embed_params
        extra[-1] += head_params
        share = (layer_params * n_layers + embed_params + head_params) / n_stages
        counts = []
        left = n_layers
        for s in range(n_stages):
            stages_after = n_stages - s - 1
            want = round((share - extra[s]) / layer_params) if s < n_stages - 1 else left
            counts.append(max(1, min(want, left - stages_after)))
            left -= counts[-1]
    else:
        base, rest = divmod(n_layers, n_stages)
        counts = [base + (s < rest) for s in range(n_stages)]
    if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(f"layers per stage {counts} must be {n_stages} counts >= 1 adding up to {n_layers}")
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [range(a, a + c) for a, c in zip(starts, counts)]


def pipeline_problems(args: Any, kind: str, n_stages: int, layers: Sequence[int],
                      valid_pp: Sequence[int] | None = None) -> list[tuple[str, str]]:
    """What keeps a transformer with ``args`` (its ``n_layers``) of ``kind`` from splitting into ``n_stages`` stages,
    as (key, message) pairs; empty when it can. ``valid_pp``: the pipeline degrees that would fit, named in the
    message of too few layers."""
    if kind != "decoder":
        return [("kind", f"{kind!r} has no pipeline split (the decoder has one; see docs/pipeline-parallel.md)")]
    if layers:
        if len(layers) != n_stages or sum(layers) != args.n_layers or min(layers) < 1:
            return [("pp_layers", f"{list(layers)} must list {n_stages} stages (parallel.pp x "
                                  f"parallel.pp_stages_per_rank) of >= 1 layer adding up to n_layers = "
                                  f"{args.n_layers}")]
    elif args.n_layers < n_stages:
        valid = f" (valid parallel.pp: {', '.join(map(str, valid_pp))})" if valid_pp else ""
        return [("n_layers", f"{args.n_layers} layers cannot fill {n_stages} pipeline stages (parallel.pp x "
                             f"parallel.pp_stages_per_rank): every stage needs at least one{valid}")]
    return []


class PipelineShard(nn.Module):
    """The parts of a :class:`DecoderLM` that one rank's stages run, under their one-process names.

    ``embed``, ``pos_encoding`` and ``embed_dropout`` when the rank runs the first stage; ``layers`` (a
    ``ModuleDict`` keyed by the layer's index in the whole model); ``final_norm`` and ``lm_head`` when it runs the
    last. ``blocks()`` are its layers (for activation checkpointing and FSDP, as for the whole model)."""

    def __init__(self, model: DecoderLM, layer_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        self.args = model.args
        if first:
            self.embed, self.pos_encoding, self.embed_dropout = model.embed, model.pos_encoding, model.embed_dropout
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if last:
            self.final_norm, self.lm_head = model.final_norm, model.lm_head
        # the whole model's own buffers and state-dict hooks (LoRA's: the frozen base left out of saved state,
        # the base's hash saved and checked on load) hold for every shard of it: names are the same
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in model._non_persistent_buffers_set)
        for hooks in ("_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"):
            getattr(self, hooks).update(getattr(model, hooks))
        self.stage_views: list[nn.Module] = []  # a plain list: the views' modules are this shard's, registered once

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def train(self, mode: bool = True) -> PipelineShard:
        """Train or eval mode for the shard and its stage views (their ``training`` decides checkpointing)."""
        super().train(mode)
        for view in self.stage_views:  # a view may be wrapped (DDP): its own train() reaches the view
            view.train(mode)
        return self


class DecoderStage(nn.Module):
    """One pipeline stage of a decoder: ``forward(h, *, input_ids, position_ids=None)`` -> the next stage's input
    (B, T, C), or the logits (B, T, V) on the last stage (its hidden states (B, T, C) with :attr:`return_hidden`).
    ``h`` is None on the first stage, which embeds ``input_ids`` (B, T); every stage reads ``input_ids`` for the
    padding mask of its attention.

    Packed documents (``position_ids`` (B, T), as ``DecoderLM.forward`` takes them): every stage builds the
    block-causal mask (``documents_of``) from the micro-batch's ``position_ids`` itself, once per stage forward,
    and its RoPE reads them. Both pipeline implementations hand every stage the micro-batch's keyword arguments
    (every rank holds the whole batch: the hand-written schedules pass ``inputs[i]`` to each stage, torch's
    ``PipelineStage.forward_one_chunk`` its ``kwargs``), so nothing more crosses the pipeline than the (B, T, C)
    activation. Sending the mask from stage 0 instead would add B·T² bytes to every send of B·T·C activation
    elements (at T = 4096, C = 2048: as much again as the bf16 activation) and a second tensor to torch's shape
    inference, to save each stage one elementwise pass over B·T² booleans.

    A view of the :class:`PipelineShard` ``shard`` (it shares its modules; its parameters are the shard's)."""

    def __init__(self, shard: PipelineShard, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.args, self.first, self.last, self.layer_ids = shard.args, first, last, list(layers)
        if first:
            self.embed, self.pos_encoding, self.embed_dropout = shard.embed, shard.pos_encoding, shard.embed_dropout
        self.layers = nn.ModuleDict({str(i): shard.layers[str(i)] for i in layers})
        if last:
            self.final_norm, self.lm_head = shard.final_norm, shard.lm_head
        self.return_hidden = False
        """The last stage's output: its final normalised hidden states (B, T, C) rather than the logits, for a loss
        that applies ``lm_head`` itself chunk by chunk (``training.loss_impl = "chunked"``, as ``DecoderLM.forward
        (return_hidden=True)``); set by the pipeline's share."""
        for name in ("rope_cos", "rope_sin"):  # the model's RoPE table (a view of the shard's, not saved)
            if hasattr(shard, name):
                self.register_buffer(name, getattr(shard, name), persistent=False)

    _embed = _TransformerModel._embed
    _padding_mask = _TransformerModel._padding_mask
    _run_block = _TransformerModel._run_block
    _rope = _TransformerModel._rope

    def forward(self, h: Tensor | None = None, *, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        padding_mask = self._padding_mask(input_ids)  # (B, T) or None
        documents = documents_of(input_ids, position_ids)  # attn_mask (B, 1, T, T), position_ids (B, T), or none
        x = self._embed(input_ids, 0, documents.get("position_ids")) if self.first else h  # (B, T, C)
        for i, layer in self.layers.items():
            x = self._run_block(f"decoder.layer{i}", layer, x, key_padding_mask=padding_mask, **documents,
                                **self._rope())
        if not self.last:
            return x
        x = self.final_norm(x)
        return x if self.return_hidden else self.lm_head(x)


def split_decoder(model: nn.Module, ranges: list[range], my_stages: Sequence[int]
                  ) -> tuple[PipelineShard, list[DecoderStage]]:
    """This rank's :class:`PipelineShard` of ``model`` and its stage modules (stage s runs ``ranges[s]``).

    Raises:
        ValueError: ``model`` is not a :class:`DecoderLM` (the only model with a split)."""
    if not isinstance(model, DecoderLM):
        raise ValueError(f"{type(model).__name__} has no pipeline split (the decoder has one)")
    last_stage = len(ranges) - 1
    first, last = 0 in my_stages, last_stage in my_stages
    shard = PipelineShard(model, [i for s in my_stages for i in ranges[s]], first=first, last=last)
    stages = [DecoderStage(shard, ranges[s], first=s == 0, last=s == last_stage) for s in my_stages]
    shard.stage_views.extend(stages)
    return shard, stages


def tied_names(model: nn.Module) -> dict[str, str]:
    """Parameter names that alias another in the whole model, mapped to the name ``named_parameters`` keeps
    (``{"lm_head.weight": "embed.weight"}`` with tied embeddings)."""
    seen: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    return out

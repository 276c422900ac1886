"""``training.loss_impl``: where the chunked loss (the output layer and the cross-entropy a chunk of tokens at a
time, :func:`torch_handle.train.loss.chunked_loss_fn`) can run.

It takes the model's last hidden states and its output weight *outside* the model's forward, so it needs

* the from-scratch decoder (``model.name = "transformer"``, ``kind = "decoder"``: ``DecoderLM.forward`` returns
  its hidden states on request; a plugin's model or the encoder-decoder returns logits only);
* no expert parallelism (``parallel.ep = 1``; tensor, pipeline and context parallelism run it): under ``parallel.tp``
  each rank computes its vocabulary slice of each chunk's logits (:mod:`torch_handle.model.linear_cross_entropy_tp`,
  both ``tp_impl``, with or without sequence parallelism, the token-mean loss and a preference objective's
  per-sequence log-probabilities alike); under ``parallel.pp`` the last stage returns its hidden states and the
  pipeline's share applies the output layer (the token-mean loss; not a preference objective's log-probabilities,
  nor under a zero-bubble schedule, whose split backward would run the loss's backward twice); under ``parallel.cp``
  each rank applies it to its T/cp tokens, the loss scaled to the whole sequence's count and a preference
  objective's row sums gathered over the cp ranks;
* a strategy that holds whole parameters after the forward pass: not ``fsdp``, ``scratch-fsdp`` or ``deepspeed``
  with ``zero_stage = 3`` (their output weight is a shard outside the forward).

``"auto"`` (the default) takes the chunked loss where it can run and the logits would be large
(:func:`torch_handle.train.loss.pick_loss_impl`); ``"chunked"`` where it cannot is refused before anything starts
(:func:`torch_handle.config.layout.check_parallel`), naming why.

Standard library only.
"""

from __future__ import annotations

from typing import Any

SPLIT_BACKWARD_SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")
"""torch's zero-bubble pipeline schedules: each stage's backward runs as an input-gradient pass, then a weight pass
through the same graph, where the chunked loss hands its gradients (computed in the forward) over once."""

SHARDING_STRATEGIES = ("fsdp", "scratch-fsdp")
"""Strategies whose parameters are shards outside the forward pass (plus ``deepspeed`` at ZeRO-3)."""


def chunked_loss_problem(preset: Any) -> str | None:
    """Why ``preset``'s run cannot take the chunked loss (one clause, no key), or None when it can."""
    model, par, strategy = preset.model, preset.parallel, preset.strategy
    if model.name != "transformer" or getattr(model.options, "kind", "decoder") != "decoder":
        return (f"needs the from-scratch decoder (model.name = 'transformer', kind = 'decoder'), not "
                f"{model.name!r} of kind {getattr(model.options, 'kind', '?')!r}")
    if par.ep > 1:
        return (f"runs on unsplit, tensor-, pipeline- or context-parallel models only, not with parallel.ep = "
                f"{par.ep} (that split model's loss is computed from its logits)")
    if par.pp > 1 and getattr(par, "pp_schedule", "1f1b") in SPLIT_BACKWARD_SCHEDULES:
        return (f"runs its backward once, and the zero-bubble schedule {par.pp_schedule!r} splits the last stage's "
                f"backward in two (input, then weight gradients; valid: gpipe, 1f1b, interleaved-1f1b, looped-bfs)")
    if par.pp > 1 and getattr(getattr(preset, "finetune", None), "objective", "lm") == "dpo":
        return (f"does not give a preference loss's per-sequence log-probabilities on a pipeline's last stage "
                f"(finetune.objective = 'dpo' with parallel.pp = {par.pp}: they come from its logits)")
    if strategy.name in SHARDING_STRATEGIES or (strategy.name == "deepspeed"
                                                 and getattr(strategy.options, "zero_stage", 0) == 3):
        return (f"needs whole parameters after the forward pass; strategy {strategy.name!r} holds the output weight "
                f"as a shard there (valid: single, ddp, scratch-ddp, deepspeed with zero_stage <= 2)")
    return None

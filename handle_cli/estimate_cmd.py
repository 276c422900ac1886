"""``handle estimate``: the bytes each rank will hold for a preset, per strategy and world size, before running it
(the figures: ``torch_handle.plan.estimate``). Click, the standard library and torch-free project modules only at
import; torch is imported when the command runs."""

from __future__ import annotations

import json
import textwrap
import time

import click

from handle_cli.common import fail
from torch_handle.common.run_layout import RunLayout
from torch_handle.config.tp_impl import KEY as TP_KEY
from torch_handle.common.units import fmt_bytes, parse_bytes

DEFAULT_NPROC = "1,2,4,8"
NOTE = ("activations: one micro-batch's tensors saved for backward (+ two fp32 logits-sized buffers of the "
        "loss, one of V/tp with tp > 1, or with training.loss_impl chunked one chunk's logits and the hidden "
        "states' gradient, + one recomputed block with activation checkpointing), measured on fake tensors; not "
        "included: allocator fragmentation and caching, communication buffers (DDP/ZeRO buckets, FSDP's gathered "
        "block, TP collectives), other backward temporaries, CUDA context; with tp > 1, every figure is one TP "
        "rank's")


def loss_line(rows: list, loss_impl: str) -> str:
    """Which loss path the rows price (``training.loss_impl`` resolved per row: ``estimate_activations.loss_impl_of``)
    and its bytes: the full loss's fp32 logits-sized buffers (``full_loss_bytes``), or one chunk's logits and the
    hidden states' gradient."""
    paths = sorted({r.activation.loss_impl for r in rows})
    size = " / ".join(fmt_bytes(b) for b in sorted({r.activation.logits for r in rows}))
    what = {"full": "fp32 logits-sized buffers (the logits, then their gradients)",
            "chunked": "one chunk's logits + the hidden states' gradient"}
    return (f"loss path: {' and '.join(paths)} (training.loss_impl = {loss_impl}): "
            f"{'; '.join(what[p] for p in paths)}, {size} per micro-batch")


def parse_nproc(text: str) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8] (sorted, unique).

    Raises:
        ValueError: an entry that is not a positive integer.
    """
    out = set()
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--nproc: {part!r} is not a positive integer (example: --nproc 1,2,4,8)")
        out.add(int(part))
    return sorted(out)


def layout_overrides(overrides: tuple[str, ...] | list[str]) -> list[str]:
    """The ``--set`` list an estimate loads the preset with: when it sets ``parallel.tp`` and/or ``parallel.pp``
    (product N > 1) and no launch size, ``launch.nproc_per_node=N`` goes first, so that the preset's own world size
    (one replica of tp x pp ranks) passes the layout checks; the world sizes estimated are --nproc's. A malformed
    --set is left for the loader to report."""
    from torch_handle.config.overrides import parse_override
    from torch_handle.errors import PresetError

    degrees, launch = {"tp": 1, "pp": 1}, False
    for text in overrides:
        try:
            keys, value = parse_override(text)
        except PresetError:
            return list(overrides)
        if keys[0] == "parallel" and keys[1:] in (["tp"], ["pp"]) and isinstance(value, int) and value > 0:
            degrees[keys[1]] = value
        launch = launch or keys[:2] in (["launch", "nproc_per_node"], ["launch", "nnodes"])
    n = degrees["tp"] * degrees["pp"]
    if n > 1 and not launch:
        return [f"launch.nproc_per_node={n}", *overrides]
    return list(overrides)


def row_layouts(rows: list, preset, registry) -> dict[tuple[str, int], str]:
    """The layout line of each (strategy variant, world size) of ``rows``, as every view names a run
    (:class:`RunLayout`: ``dp 2 (deepspeed ZeRO-2)``, ``dp 1 × tp 2 (tp scratch)``: the strategy named only where
    dp > 1 runs it; not at all when ``rows`` hold several variants, which their own column names), with the
    tensor-parallel implementation that variant's strategy runs (``tp_impl = "auto"``: its own choice)."""
    from torch_handle.config.tp_impl import chosen_impl, requested_tp_impl

    p, requested = preset.parallel, requested_tp_impl(preset)
    compare = len({r.strategy for r in rows}) > 1
    out = {}
    for r in rows:
        strategy = r.options.get("strategy", preset.strategy.name)
        registration = registry.registrations["strategy"].get(strategy)
        impl = chosen_impl(requested, strategy, getattr(registration, "config_cls", object), p.pp)
        named = (None, None) if compare else (strategy, getattr(preset.strategy.options, "zero_stage", None))
        out[r.strategy, r.world_size] = RunLayout.from_parts(
            r.world_size, *named, r.tp, r.pp, impl, p.sequence_parallel, p.pp_impl, p.pp_schedule,
            p.pp_stages_per_rank, cp=r.cp, cp_impl=r.cp_impl).label()
    return out


def _table(rows: list, device_memory: int | None, layouts: dict[tuple[str, int], str]) -> list[str]:
    pipeline = any(r.pp > 1 for r in rows)
    compare = len({r.strategy for r in rows}) > 1  # a replica of several ranks (dp 1) names no strategy: say it here
    finetune = rows[0].frozen_param_bytes is not None  # the params column as LoRA's telemetry splits it
    stage_cols = ["stage", "in flight", "rank"] if pipeline else []
    head = [*(["strategy"] if compare else []), "layout", "world", *stage_cols,
            *(["trainable", "frozen"] if finetune else ["params"]), "grads", "optimizer", "activations",
            "device total", "host"]
    if device_memory is not None:
        head.append("fits")
    body = []
    for r in rows:
        params = (r.trainable_param_bytes, r.frozen_param_bytes) if finetune else (r.param_bytes,)
        sizes = (*params, r.grad_bytes, r.optimizer_bytes, r.activation_bytes, r.device_bytes)
        stage = [",".join(map(str, r.pp_stages or [])), "+".join(map(str, r.pp_in_flight or [])),
                 f"{r.rank}{'*' if r.largest else ''}"] if pipeline else []
        cells = [*([r.strategy] if compare else []), layouts[r.strategy, r.world_size], str(r.world_size), *stage,
                 *(fmt_bytes(x, precise=True) for x in sizes),
                 fmt_bytes(r.host_bytes, precise=True) if r.host_bytes else "-"]
        if device_memory is not None:
            cells.append("yes" if r.fits else "no")
        body.append(cells)
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    text = head.index("layout") + 1  # the text columns, left-aligned; the figures right-aligned
    fmt = lambda cells: "  ".join(c.ljust(w) if i < text else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [fmt(head), *(fmt(c) for c in body)]


def _largest(rows: list, layouts: dict[tuple[str, int], str]) -> str:
    """``largest rank (*): dp 1 × pp 2 (pp 1F1B native): rank 0 (stage 0) 2.46 MiB, ...``: with a pipeline, the
    global rank of each (strategy, world size) that holds the most device bytes (every TP rank of its stage holds
    the same)."""
    compare = len({r.strategy for r in rows}) > 1
    parts = [f"{f'{r.strategy} ' if compare else ''}{layouts[r.strategy, r.world_size]}: rank {r.rank} (stage "
             f"{','.join(map(str, r.pp_stages or []))}) {fmt_bytes(r.device_bytes, precise=True)}"
             for r in rows if r.largest]
    return "largest rank (*): " + ", ".join(parts)


def finetune_line(row, preset) -> str:
    """What a LoRA / QLoRA preset trains and freezes, from an :class:`~torch_handle.plan.estimate.Estimate`."""
    f, ft = row.finetune, preset.finetune
    total = f["trainable_params"] + f["frozen_params"]
    nf4 = ", the blocks' linears in NF4 besides" if ft.method == "qlora" else ""
    flops = f"; {f['flops_per_token']:,.0f} training FLOPs per token (what the run's MFU counts: 4 per frozen " \
            f"matmul weight, not 6)" if f["flops_per_token"] else ""
    return (f"finetune: {ft.method} rank {ft.rank} on {', '.join(ft.target_modules)}: {f['trainable_params']:,} "
            f"trainable parameters ({f['trainable_params'] / total:.2%}), {f['frozen_params']:,} frozen{nf4} (no "
            f"gradient, no optimizer state; sharded as the strategy shards parameters){flops}")


def sft_line(preset) -> str:
    """What an SFT preset (``finetune.objective = "sft"``) is priced as: packed samples, every position computed,
    the document mask among the activations, and where the vocabulary came from."""
    from torch_handle.plan.estimate_model import prepared_vocab_size

    t, seq = preset.training, preset.data.options.seq_len
    vocab, where = prepared_vocab_size(preset)
    source = f"; vocabulary {vocab:,} from {where}" if vocab is not None and where else ""
    return (f"sft: each micro-batch is {t.micro_batch_size} sample(s) of {seq} positions packed with conversations, "
            f"every position computed (padding included) as in pretraining, so the trained share changes no byte; "
            f"the document mask (bool, {t.micro_batch_size} x 1 x {seq} x {seq}: "
            f"{fmt_bytes(t.micro_batch_size * seq * seq, precise=True)}) is priced with the activations; the loss "
            f"path computes every position's logits (untrained labels are ignored, not skipped){source}")


def dpo_line(preset, row=None) -> str:
    """What a DPO preset (``finetune.objective = "dpo"``) is priced as: each micro-batch's pairs as one forward of
    twice the rows, and what its reference adds (no activation bytes:
    :func:`torch_handle.plan.estimate_model.rows_per_sample`; its own bytes on ``row``'s rank, an
    :class:`~torch_handle.plan.estimate.Estimate`: :mod:`torch_handle.plan.estimate_reference`)."""
    b, seq = preset.training.micro_batch_size, preset.data.options.seq_len
    reference = preset.finetune.preference.resolved(preset.finetune.method)
    held = "" if row is None or row.reference_bytes is None else \
        f" ({fmt_bytes(row.reference_bytes, precise=True)} on rank {row.rank}, part of its total)"
    adds = {"adapters_off": "runs before the policy's under no_grad: no saved activation, its logits freed with it, "
                            "no second copy",
            "copy": f"is a frozen copy of the model held as the strategy holds the policy's parameters{held}: no "
                    f"gradients, no optimizer state; its forward runs before the policy's under no_grad, no saved "
                    f"activation",
            "precomputed": f"is read from a float64 table on the device (16 bytes a pair of both splits{held}), no "
                           f"forward, no reference model",
            "none": "is not computed (a reference-free loss)"}[reference]
    return (f"dpo: each micro-batch is {b} pair(s), one forward of {2 * b} rows of {seq} positions (chosen and "
            f"rejected, each padded to seq_len), priced as {2 * b} samples; the reference ({reference}) {adds}")


def qlora_line(rows: list) -> str:
    """A QLoRA preset's NF4 base per rank and the rows ``handle run`` refuses, from its estimates."""
    sizes = sorted({r.nf4_bytes for r in rows})
    how = {"whole": "whole on every rank where the strategy does not shard parameters",
           "stage": "each pipeline rank its own stages' layers", "sharded": "cut on dim 0 under fsdp, "
           "scratch-fsdp and ZeRO-3, as they shard every parameter"}
    layouts = "; ".join(how[x] for x in sorted({r.nf4_layout for r in rows}))
    text = f"NF4 base: {' to '.join(fmt_bytes(x, precise=True) for x in sizes[::max(1, len(sizes) - 1)])} per " \
           f"rank ({layouts}), part of frozen"
    if any(not r.finetune_runs for r in rows):
        text += "; handle run refuses QLoRA with tp > 1 (docs/qlora.md): these rows price what it would hold"
    return text


def moe_line(row) -> str:
    """What the experts add, from an :class:`~torch_handle.plan.estimate.Estimate` of a model with experts."""
    m = row.moe
    text = (f"experts: {m.n_experts} per MoE layer in {m.moe_layers} layer(s), top_k {m.top_k}: {m.active_params:,} "
            f"of {m.params:,} parameters active per token (what the FLOPs and MFU count); {m.expert_params:,} in "
            f"the routed experts, split over ep = {row.ep}")
    if row.expert_param_bytes is not None:
        text += (f": {fmt_bytes(row.expert_param_bytes, precise=True)} of expert parameters per rank (rank "
                 f"{row.rank}), all-to-all {fmt_bytes(row.all_to_all_bytes or 0, precise=True)} sent per step, token "
                 f"buffers {fmt_bytes(row.token_buffer_bytes or 0, precise=True)} per micro-batch (in the "
                 f"activations)")
    return text


@click.command("estimate", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("preset")
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE",
              help="Override a preset key, as for `handle run` (repeatable).")
@click.option("--nproc", "nproc", default=DEFAULT_NPROC, show_default=True, metavar="N[,N...]",
              help="Processes per node to estimate for (comma-separated).")
@click.option("--nnodes", type=click.IntRange(min=1), default=None, metavar="N",
              help="Nodes (world size = nproc x nnodes; default: the preset's launch.nnodes).")
@click.option("--compare", is_flag=True,
              help="Every built-in strategy (DDP, scratch-ddp +/- ZeRO-1, ZeRO 0-3 +/- CPU offload, FSDP2), "
                   "not only the preset's.")
@click.option("--device-memory", "device_memory", default=None, metavar="SIZE",
              help="Memory of one accelerator, e.g. 80GiB, 24GB or bytes: mark what fits and the smallest world "
                   "size that does.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per (strategy, world size), one per line.")
def estimate(preset: str, overrides: tuple[str, ...], nproc: str, nnodes: int | None, compare: bool,
             device_memory: str | None, as_json: bool) -> None:
    """Memory each rank needs for PRESET, per strategy and world size.

    Parameters, gradients and optimizer state (fp32 master copies and DeepSpeed's buffers included) follow the
    ZeRO accounting (Rajbhandari et al. 2020) made exact for each built-in strategy, from real runs' telemetry;
    activations of one micro-batch are measured by running the model's forward and backward on fake tensors
    (no memory allocated). Figures are those of the rank that holds the most; host = state offloaded to CPU.
    With --json, activation_bytes comes with its parts: activation_saved_bytes (what a run's memory telemetry
    reports), activation_logits_bytes and activation_recompute_bytes.

    With --set parallel.tp=N (tensor parallelism) each row is one TP rank of a dp x tp layout, dp = world / N:
    its shard of the model (the preset's model split by its own plan: split tensors 1/N, LayerNorms and
    row-parallel biases whole) under the strategy's own sharding over dp, and its activations, measured on the
    split model. World sizes N does not divide are left out; --compare lists the strategies that run with tp.

    With --set parallel.pp=N (pipeline parallelism) each row is one pipeline rank: the model states of its stages'
    layers (the embedding on the first, the head on the last, a tied embedding on both), and the activations of
    the micro-batches its schedule keeps in flight: GPipe all m, 1F1B min(m, p - stage), interleaved and
    zero-bubble schedules walked in torch's order (--json: pp_in_flight, pp_microbatch_saved_bytes per stage).
    With tp and pp both, and dp = world / (tp x pp), each row is a pipeline rank's TP shard of its stages, the
    strategy's sharding over dp applied per stage; `rank` is its global rank (TP fastest), * (--json: largest)
    marks the rank that holds the most, named below the table.

    A model with experts (model.n_experts > 0) gets a line of total and active parameters (a token passes
    through top_k of the experts: the FLOPs count those), the routed experts' bytes per rank with
    parallel.ep ranks splitting them (their gradients and optimizer state likewise), the bytes each rank sends by
    all-to-all in a step (4 per MoE layer and micro-batch with ep > 1, uniform routing) and the token buffers of a
    micro-batch; --json: active_params, expert_params, expert_param_bytes, all_to_all_bytes, token_buffer_bytes.

    \b
    Examples:
      handle estimate presets/zero2.toml
      handle estimate presets/zero2.toml --compare --nproc 1,2,4,8 --device-memory 80GiB
      handle estimate zero3 --set model.d_model=2048 --set model.n_heads=16 --set model.n_layers=20 \\
        --set model.d_ff=8192 --compare --json                  # about 1B parameters
      handle estimate presets/fsdp.toml --nproc 8 --nnodes 4 --json
      handle estimate presets/single.toml --set parallel.tp=2 --set parallel.sequence_parallel=true --nproc 2
      handle estimate presets/single.toml --set parallel.pp=2 --set parallel.pp_schedule=gpipe \
        --set training.grad_accum=8 --nproc 2
      handle estimate presets/moe.toml --nproc 2,4 --json    # total, active and expert parameters

    Exit code 2 with one line on stderr for a bad preset, --set, --nproc or --device-memory.
    """
    try:
        nprocs = parse_nproc(nproc)
        memory = parse_bytes(device_memory) if device_memory is not None else None
    except ValueError as e:
        fail(str(e) if str(e).startswith("--") else f"--device-memory: {e}")

    from handle_cli.presets_cmd import resolve_preset_spec
    from torch_handle.config.loader import load_preset
    from torch_handle.registry import get_registry

    start = time.perf_counter()
    registry = get_registry()
    # PresetError: one line, exit 2
    loaded = load_preset(resolve_preset_spec(preset), layout_overrides(overrides), registry)
    auto = None
    if loaded.training.precision == "auto":  # estimated as a run here would train (launch/precision.py)
        from torch_handle.launch.precision import concrete

        loaded, auto = concrete(loaded)
    from torch_handle.plan.estimate import (COMPARE_VARIANTS, estimate_preset, smallest_fit,
                                           supports_pipeline_parallel, supports_tensor_parallel)

    nodes = nnodes or loaded.launch.nnodes
    worlds = [n * nodes for n in nprocs]
    tp, pp = loaded.parallel.tp, loaded.parallel.pp
    variants, left_out = list(COMPARE_VARIANTS) if compare else None, []
    if compare and (tp > 1 or pp > 1):
        supports = supports_tensor_parallel if tp > 1 else supports_pipeline_parallel
        left_out = sorted({v.strategy for v in variants if not supports(registry, v.strategy)})
        variants = [v for v in variants if v.strategy not in left_out]
    try:
        rows = estimate_preset(loaded, registry, worlds, variants, memory)
    except ValueError as e:
        fail(str(e))
    if not rows:
        if pp > 1:
            fail(f"strategy 'single' runs one pipeline of parallel.pp = {pp} ranks (dp = 1): use --nproc {pp}")
        if tp > 1 and all(w % tp for w in worlds):
            fail(f"no world size in --nproc is divisible by parallel.tp = {tp} (the data-parallel degree is world "
                 f"size / tp)")
        if tp > 1 and compare:
            fail(f"no strategy that runs with parallel.tp = {tp} fits these world sizes (single: --nproc {tp}; "
                 f"left out: {', '.join(left_out)})")
        if tp > 1:
            fail(f"strategy 'single' runs one replica of parallel.tp = {tp} ranks: use --nproc {tp}, or --compare")
        fail(f"strategy {loaded.strategy.name!r} runs one process: use --nproc 1, or --compare")
    layouts = row_layouts(rows, loaded, registry)
    if as_json:
        sft = {"objective": loaded.finetune.objective} if loaded.finetune.objective in ("sft", "dpo") else {}
        for r in rows:
            click.echo(json.dumps({**r.as_dict(), **sft, "layout": layouts[r.strategy, r.world_size]}))
        return
    t = loaded.training
    checkpointing = getattr(loaded.model.options, "activation_checkpointing", False)
    precision = t.precision if auto is None else f"{t.precision} ({auto.reason})"
    click.echo(f"{loaded.source}: {rows[0].params:,} parameters, {precision}, micro_batch_size "
               f"{t.micro_batch_size} x seq_len {loaded.data.options.seq_len}, activation checkpointing "
               f"{'on' if checkpointing else 'off'}, {nodes} node(s)")
    if rows[0].moe is not None:
        for line in textwrap.wrap(moe_line(rows[0]), 110, subsequent_indent="  "):
            click.echo(line)
    if rows[0].cp > 1:
        r = rows[0]
        held = "holding every layer's gathered K/V until backward" if r.cp_impl == "native" else "for one layer"
        click.echo(f"cp: {r.cp} ranks per sequence ({r.cp_impl}): activations of seq_len / {r.cp} = "
                   f"{loaded.data.options.seq_len // r.cp} tokens per rank, + {fmt_bytes(r.cp_buffer_bytes or 0, precise=True)}"
                   f" of {r.cp_impl} buffers {held} (in the device total)")
    if rows[0].finetune is not None:
        for line in textwrap.wrap(finetune_line(rows[0], loaded), 110, subsequent_indent="  "):
            click.echo(line)
        if rows[0].nf4_bytes is not None:
            for line in textwrap.wrap(qlora_line(rows), 110, subsequent_indent="  "):
                click.echo(line)
    if loaded.finetune.objective == "sft":
        for line in textwrap.wrap(sft_line(loaded), 110, subsequent_indent="  "):
            click.echo(line)
    if loaded.finetune.objective == "dpo":
        for line in textwrap.wrap(dpo_line(loaded, rows[0]), 110, subsequent_indent="  "):
            click.echo(line)
    cp = rows[0].cp
    if tp > 1 or pp > 1 or cp > 1:  # the line every view shows (handle validate, handle runs, the dashboard)
        replica = "((pp_rank x dp + dp_rank) x cp + cp_rank)" if cp > 1 else "(pp_rank x dp + dp_rank)"
        rank = f"{replica} x tp + tp_rank"
        click.echo(f"layout: {RunLayout.from_preset(loaded).label()} at the preset's world size "
                   f"{loaded.world_size}; each row's rank is a global rank, {rank}")
    if tp > 1:
        p = loaded.parallel
        sp = "on" if p.sequence_parallel else "off"
        why = f"; {loaded.resolved[TP_KEY]}" if TP_KEY in loaded.resolved else ""
        click.echo(f"tensor parallel: tp = {tp} ({p.tp_impl}, sequence parallelism {sp}{why}), "
                   f"{rows[0].tp_shard_params:,} parameters per TP rank; data parallel: dp = world / "
                   f"{'(tp x pp)' if pp > 1 else '(cp x tp), the strategy over dp x cp' if cp > 1 else 'tp'}")
    if pp > 1:
        p, r0 = loaded.parallel, rows[0]
        batch = t.micro_batch_size * t.grad_accum // r0.pp_microbatches
        click.echo(f"pipeline: pp = {pp} ({p.pp_impl} {p.pp_schedule}, {p.pp_stages_per_rank} stage(s) per rank), "
                   f"m = {r0.pp_microbatches} micro-batches of {batch} sample(s); one row per pipeline rank: its "
                   f"stages' model states, activations of the micro-batches in flight per stage at the peak")
    if left_out:
        click.echo(f"left out: {', '.join(left_out)} (no parallel.{'pp' if pp > 1 else 'tp'} > 1)")
    click.echo(loss_line(rows, t.loss_impl))
    click.echo("bytes per rank (the rank that holds the most; with pp > 1 every pipeline rank); host = offloaded to "
               "CPU memory")
    click.echo("")
    for line in _table(rows, memory, layouts):
        click.echo(line)
    click.echo("")
    if pp > 1:
        for line in textwrap.wrap(_largest(rows, layouts), 110, subsequent_indent="  "):
            click.echo(line)
    if memory is not None:
        fits = smallest_fit(rows)
        parts = [f"{name} {w}" if w else f"{name} none" for name, w in fits.items()]
        text = f"smallest world size that fits in {fmt_bytes(memory, precise=True)}: " + ", ".join(parts)
        for line in textwrap.wrap(text, 110, subsequent_indent="  "):
            click.echo(line)
    for line in textwrap.wrap(f"note: {NOTE}", 110, subsequent_indent="  "):
        click.echo(line)
    click.echo(f"({time.perf_counter() - start:.1f} s)")

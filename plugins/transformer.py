"""Model plugin ``transformer``: the project's from-scratch Transformer (``torch_handle/model/``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from torch_handle.api import CheckpointError, InvalidValue, hookimpl, param
from torch_handle.model.args import DATASET_FIELDS, Activation, ModelKind, TransformerArgs

_MLP_DEFAULT = next(f.default for f in dataclasses.fields(TransformerArgs) if f.name == "mlp")


def _post_init(self) -> None:
    """``activation``, the option's name before SwiGLU, becomes ``mlp`` (so presets and run directories written
    before it load, and resume, as the same model); it is then unset, so the resolved preset names ``mlp`` only."""
    if self.activation is not None and self.mlp in (_MLP_DEFAULT, self.activation):
        self.mlp, self.activation = self.activation, None
    # else a contradiction, left for ``check`` to report (a constructor that raises reads as a plugin bug)


def _check(self) -> Iterator[InvalidValue]:
    """Every problem of the table, each independent of the others: a problem of one key never hides one of another
    (the head width RoPE rotates is checked only when the heads divide d_model, since it is computed from them)."""
    if self.activation is not None:
        yield InvalidValue("activation", f"{self.activation!r} is the old name of mlp, which says {self.mlp!r}; "
                                         f"give mlp only")
    if self.init_from is not None and self.kind != "decoder":
        yield InvalidValue("init_from", f"loads a decoder (LlamaForCausalLM, Qwen3ForCausalLM) but kind = "
                                        f"{self.kind!r}; use kind = 'decoder'")
    heads_divide = self.head_dim is not None or self.d_model % self.n_heads == 0
    if not heads_divide:
        yield InvalidValue("n_heads", f"{self.n_heads} does not divide d_model={self.d_model} (or give head_dim)")
    if self.n_kv_heads is not None and (self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads):
        yield InvalidValue("n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads} (each key/value "
                                         f"head serves an equal group of query heads)")
    if self.n_experts:
        yield from _check_experts(self)
    d_k = self.head_dim or self.d_model // self.n_heads
    if heads_divide and self.position == "rope" and d_k % 2:
        yield InvalidValue("head_dim" if self.head_dim else "n_heads",
                           f"RoPE rotates channel pairs: the head width {d_k} must be even")


def _check_experts(self) -> Iterator[InvalidValue]:
    """The mixture-of-experts options, when n_experts > 0: every problem."""
    if self.top_k > self.n_experts:
        yield InvalidValue("top_k", f"{self.top_k} is more than n_experts={self.n_experts} (each token goes to top_k "
                                    f"different experts)")
    if self.moe_every > self.n_layers:
        yield InvalidValue("moe_every", f"{self.moe_every} is more than n_layers={self.n_layers}: no layer would be "
                                        f"an MoE layer")
    if self.top_k == 1 and self.norm_topk_prob:
        yield InvalidValue("norm_topk_prob", "with top_k = 1 it makes every weight 1, and the router would learn from "
                                             "its balancing loss only; set norm_topk_prob = false (Switch)")


_DOC = """``[model]`` options of the ``transformer`` plugin. ``kind`` picks the class: ``"decoder"``, a decoder-only
language model; ``"encoder-decoder"``, translation (Vaswani et al. 2017). Every other option is the
``TransformerArgs`` field of the same name, with its type, default, range and documentation
(``torch_handle/model/args.py``: the one source of the model's defaults), except those the dataset supplies
(``DATASET_FIELDS``). ``activation`` is ``mlp``'s name from before SwiGLU, still read.

``init_from = "DIR"``: start from the weights of a local Hugging Face directory (a ``handle export --format hf``
of a run, or a Llama / Qwen 3 checkpoint whose config.json gives the same shape as this table: each option is
checked before the run starts, the first that differs named). A decoder only; the shape is not filled in from
config.json: the preset says it, init_from checks it. A resumed run starts from its checkpoint instead."""

TransformerConfig = dataclasses.make_dataclass(
    "TransformerConfig",
    [("kind", ModelKind, dataclasses.field(default="decoder")),
     *((f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
       for f in dataclasses.fields(TransformerArgs) if f.name not in DATASET_FIELDS),
     ("activation", Activation | None, dataclasses.field(default=None)),
     ("init_from", str | None, param(None, frozen_on_resume="a resumed run starts from its checkpoint"))],
    namespace={"__module__": __name__, "__doc__": _DOC, "__post_init__": _post_init, "check": _check,
               "tensor_parallel": True, "pipeline_parallel": True})



def _check_task(options: TransformerConfig, preset) -> Iterator[InvalidValue]:
    data_kind = getattr(preset.data.options, "task", None)
    wanted = {"lm": "decoder", "translation": "encoder-decoder"}.get(data_kind)
    if wanted and options.kind != wanted:
        yield InvalidValue("kind", f"{options.kind!r} cannot train on data {preset.data.name!r} ({data_kind}); use "
                                   f"kind = {wanted!r}")


def _check_widths(options: TransformerConfig, preset) -> Iterator[InvalidValue]:
    if preset.parallel.tp == 1:
        return
    from torch_handle.model.parallelize import width_problems  # torch: only for a tp > 1 preset

    for key, message in width_problems(options, preset.parallel.tp):
        yield InvalidValue(key, message)


def _check_data_split(options: TransformerConfig, preset) -> Iterator[InvalidValue]:
    parallel = preset.parallel
    if parallel.tp == 1:
        return
    from torch_handle.model.parallelize import data_split_problems

    data = preset.data.options
    for key, message in data_split_problems(parallel.tp, vocab_size=getattr(data, "vocab_size", None),
                                            seq_len=getattr(data, "seq_len", 0),
                                            sequence_parallel=parallel.sequence_parallel,
                                            scratch=parallel.tp_impl == "scratch"):
        yield InvalidValue(f"data.{key}", message)


def _check_pipeline(options: TransformerConfig, preset) -> Iterator[InvalidValue]:
    parallel = preset.parallel
    if parallel.pp == 1:
        return
    from torch_handle.model.pipeline import pipeline_problems  # torch: only for a pp > 1 preset

    v = parallel.pp_stages_per_rank
    stages = parallel.pp * v
    valid_pp = None
    if options.kind == "decoder" and not parallel.pp_layers and options.n_layers < stages:
        # the pp this model can split into that also divide the world size (over tp)
        valid_pp = [p for p in range(1, options.n_layers // v + 1) if preset.world_size % (parallel.tp * p) == 0]
    for key, message in pipeline_problems(options, options.kind, stages, parallel.pp_layers, valid_pp=valid_pp):
        yield InvalidValue(key if key != "pp_layers" else "parallel.pp_layers", message)


def _check_experts_layout(options: TransformerConfig, preset) -> Iterator[InvalidValue]:
    """What mixture-of-experts layers do not support yet: tensor parallelism with sequence parallelism or expert
    parallelism, compiled blocks, and the expert-bias update under DeepSpeed (its optimizer has no step hooks)."""
    if not options.n_experts:
        return
    parallel = preset.parallel
    if parallel.tp > 1 and (parallel.sequence_parallel or parallel.ep > 1):
        yield InvalidValue("parallel.tp", f"mixture-of-experts layers (n_experts = {options.n_experts}) are replicated "
                                          f"over the TP ranks, which must route the same tokens: tp > 1 works without "
                                          f"sequence_parallel and with ep = 1 (or use parallel.tp = 1)")
    if preset.training.compile:
        yield InvalidValue("training.compile", "mixture-of-experts layers are not compiled yet (their token counts "
                                               "set the shapes); use compile = false")
    if options.balance == "aux_free" and preset.strategy.name == "deepspeed":
        yield InvalidValue("balance", "'aux_free' moves the expert biases in an optimizer step hook, which "
                                      "DeepSpeed's optimizer does not run; use 'aux_loss' or another strategy")


def _check_eval_tasks(options: TransformerConfig, preset) -> Iterator[InvalidValue]:
    """``[eval] tasks`` (scored during training, issue 50): a decoder's, with known names (the close ones listed),
    existing include directories and local data files; the harness's own names are read from its YAML files (about
    1 s), not from its task index."""
    tasks = preset.eval
    if not tasks.tasks:
        return
    if options.kind != "decoder":
        yield InvalidValue("eval.tasks", f"the harness scores decoders, this model is kind = {options.kind!r} "
                                         f"(handle eval RUN --split test gives its BLEU and chrF)")
        return
    from torch_handle.errors import DataError
    from torch_handle.infer.downstream import resolve_tasks

    try:
        resolve_tasks(tasks.tasks, tasks.include_paths, names_only=True)
    except ImportError:
        yield InvalidValue("eval.tasks", "needs the eval extra (lm-eval): pip install 'torch-handle[eval]'")
    except DataError as e:
        key = "eval.include_paths" if str(e).startswith("--include-path") else "eval.tasks"
        yield InvalidValue(key, str(e).removeprefix("--tasks: ").removeprefix("--include-path "))


CHECKS = (_check_pipeline, _check_widths, _check_data_split, _check_experts_layout, _check_task, _check_eval_tasks)
"""The cross-table checks (``check_preset``), each run on its own, so a problem in one table hides no other."""


def _args(options: TransformerConfig, vocab_size: int, pad_id: int | None, max_len: int) -> TransformerArgs:
    """Every option but ``kind`` and ``init_from`` is the ``TransformerArgs`` field of the same name."""
    shared = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
              if f.name not in ("kind", "activation", "init_from")}
    return TransformerArgs(vocab_size=vocab_size, pad_id=pad_id, max_len=max_len, **shared)


def build(options: TransformerConfig, vocab_size: int, pad_id: int, max_len: int):
    """``factory(options, vocab_size, pad_id, max_len) -> nn.Module``; the dataset supplies vocab_size, pad_id and
    max_len. ``init_from`` is not read here: the trainer loads it into the built model (a new run only)."""
    from torch_handle.model.transformer import build_transformer

    return build_transformer(_args(options, vocab_size, pad_id, max_len), kind=options.kind)


def preflight(options: TransformerConfig, preset) -> None:
    """A new run with ``init_from``: the directory holds a config.json whose model has this table's shape, and a
    vocabulary the run's tokenizer can fill (at most ``data.vocab_size``; the exact size is checked when the
    weights load). Raises CheckpointError naming every mismatch, one line each."""
    if options.init_from is None:
        return
    from torch_handle.checkpoint.hf_dir import CONFIG_FILE, config_mismatches, read_config

    vocab_size = getattr(preset.data.options, "vocab_size", None)
    try:
        mismatches = config_mismatches(_args(options, vocab_size or 1, None, 1), options.init_from)
        theirs = read_config(options.init_from).get("vocab_size")
    except CheckpointError as e:  # the directory or its config.json: say which option named it
        raise CheckpointError(f"model.init_from: {e}") from None
    if isinstance(vocab_size, int) and isinstance(theirs, int) and theirs > vocab_size:
        mismatches.append(f"data.vocab_size = {vocab_size} but {options.init_from}/{CONFIG_FILE} has vocab_size = "
                          f"{theirs} (the run's tokenizer has at most data.vocab_size tokens)")
    if mismatches:
        raise CheckpointError("\n".join(mismatches))  # the CLI prints one error line each


@hookimpl
def handle_register_models(register):
    register("transformer", TransformerConfig, build, "from-scratch Transformer (decoder-only or encoder-decoder)",
             CHECKS, preflight)

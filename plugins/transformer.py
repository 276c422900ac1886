"""Model plugin ``transformer``: the project's from-scratch Transformer (``torch_handle/model/``)."""

from __future__ import annotations

import dataclasses

from torch_handle.api import InvalidValue, hookimpl
from torch_handle.model.args import DATASET_FIELDS, Activation, ModelKind, TransformerArgs

_MLP_DEFAULT = next(f.default for f in dataclasses.fields(TransformerArgs) if f.name == "mlp")


def _post_init(self) -> None:
    """``activation``, the option's name before SwiGLU, becomes ``mlp`` (so presets and run directories written
    before it load, and resume, as the same model); it is then unset, so the resolved preset names ``mlp`` only."""
    if self.activation is None:
        return
    if self.mlp not in (_MLP_DEFAULT, self.activation):
        raise InvalidValue("activation", f"{self.activation!r} is the old name of mlp, which says {self.mlp!r}; "
                                         f"give mlp only")
    self.mlp, self.activation = self.activation, None


def _check(self) -> None:
    if self.head_dim is None and self.d_model % self.n_heads:
        raise InvalidValue("n_heads", f"{self.n_heads} does not divide d_model={self.d_model} (or give head_dim)")
    if self.n_kv_heads is not None and (self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads):
        raise InvalidValue("n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads} (each key/value "
                                         f"head serves an equal group of query heads)")
    d_k = self.head_dim or self.d_model // self.n_heads
    if self.position == "rope" and d_k % 2:
        raise InvalidValue("head_dim" if self.head_dim else "n_heads",
                           f"RoPE rotates channel pairs: the head width {d_k} must be even")


_DOC = """``[model]`` options of the ``transformer`` plugin. ``kind`` picks the class: ``"decoder"``, a decoder-only
language model; ``"encoder-decoder"``, translation (Vaswani et al. 2017). Every other option is the
``TransformerArgs`` field of the same name, with its type, default, range and documentation
(``torch_handle/model/args.py``: the one source of the model's defaults), except those the dataset supplies
(``DATASET_FIELDS``). ``activation`` is ``mlp``'s name from before SwiGLU, still read."""

TransformerConfig = dataclasses.make_dataclass(
    "TransformerConfig",
    [("kind", ModelKind, dataclasses.field(default="decoder")),
     *((f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
       for f in dataclasses.fields(TransformerArgs) if f.name not in DATASET_FIELDS),
     ("activation", Activation | None, dataclasses.field(default=None))],
    namespace={"__module__": __name__, "__doc__": _DOC, "__post_init__": _post_init, "check": _check,
               "tensor_parallel": True, "pipeline_parallel": True})



def check_preset(options: TransformerConfig, preset) -> None:
    data_kind = getattr(preset.data.options, "task", None)
    wanted = {"lm": "decoder", "translation": "encoder-decoder"}.get(data_kind)
    if wanted and options.kind != wanted:
        raise InvalidValue("kind", f"{options.kind!r} cannot train on data {preset.data.name!r} "
                                   f"({data_kind}); use kind = {wanted!r}")
    parallel = preset.parallel
    if parallel.tp > 1:
        from torch_handle.model.parallelize import tensor_parallel_problems

        vocab_size = getattr(preset.data.options, "vocab_size", None)
        seq_len = getattr(preset.data.options, "seq_len", 0)
        for key, message in tensor_parallel_problems(options, parallel.tp, vocab_size=vocab_size, seq_len=seq_len,
                                                     sequence_parallel=parallel.sequence_parallel,
                                                     scratch=parallel.tp_impl == "scratch"):
            raise InvalidValue(key if key in ("n_heads", "n_kv_heads", "d_ff") else f"data.{key}", message)
    if parallel.pp > 1:
        from torch_handle.model.pipeline import pipeline_problems

        stages = parallel.pp * parallel.pp_stages_per_rank
        for key, message in pipeline_problems(options, options.kind, stages, parallel.pp_layers):
            raise InvalidValue(key if key != "pp_layers" else "parallel.pp_layers", message)


def build(options: TransformerConfig, vocab_size: int, pad_id: int, max_len: int):
    """``factory(options, vocab_size, pad_id, max_len) -> nn.Module``: every option but ``kind`` is the
    ``TransformerArgs`` field of the same name; the dataset supplies vocab_size, pad_id and max_len."""
    from torch_handle.model.transformer import build_transformer

    shared = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name not in ("kind",
                                                                                                       "activation")}
    args = TransformerArgs(vocab_size=vocab_size, pad_id=pad_id, max_len=max_len, **shared)
    return build_transformer(args, kind=options.kind)


@hookimpl
def handle_register_models(register):
    register("transformer", TransformerConfig, build, "from-scratch Transformer (decoder-only or encoder-decoder)",
             check_preset)

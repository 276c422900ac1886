"""One source of the model's defaults: the ``transformer`` plugin's ``[model]`` options are ``TransformerArgs``'
fields (torch_handle/model/args.py), less those the dataset supplies, plus ``kind``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from handle_plugins.transformer import TransformerConfig
from torch_handle.model.args import DATASET_FIELDS, TransformerArgs


def test_plugin_options_are_the_args_fields_with_their_defaults_and_ranges():
    args = {f.name: f for f in dataclasses.fields(TransformerArgs) if f.name not in DATASET_FIELDS}
    options = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    assert list(options) == ["kind", *args, "activation"]  # activation: mlp's old name, read by the plugin only
    for name, f in args.items():
        assert (options[name].type, options[name].default, dict(options[name].metadata)) == \
               (f.type, f.default, dict(f.metadata)), name


def test_a_preset_that_omits_norm_first_still_gets_post_ln():
    assert TransformerConfig().norm_first is False and TransformerArgs(8).norm_first is False


def test_reading_the_options_imports_no_torch():
    code = "import sys, handle_plugins.transformer; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_activation_is_read_as_mlp_so_older_presets_and_runs_still_load():
    """``activation`` was ``mlp``'s name before SwiGLU: every run directory written before it has
    ``activation = "gelu"`` (or "relu") in its preset.toml. It loads as ``mlp``, resolves without it (so a resumed
    run sees no change), and contradicting mlp is one line."""
    from torch_handle.config.loader import dump_preset, preset_from_dict
    from torch_handle.errors import PresetError

    old = preset_from_dict({"model": {"activation": "relu"}})
    assert (old.model.options.mlp, old.model.options.activation) == ("relu", None)
    assert "activation =" not in dump_preset(old) and 'mlp = "relu"' in dump_preset(old)
    assert preset_from_dict({"model": {"activation": "relu", "mlp": "relu"}}).model.options == old.model.options
    try:
        preset_from_dict({"model": {"activation": "relu", "mlp": "swiglu"}})
    except PresetError as e:
        assert str(e) == "model.activation: 'relu' is the old name of mlp, which says 'swiglu'; give mlp only"
    else:
        raise AssertionError("a contradicting activation was accepted")


def test_the_new_shapes_are_checked_before_anything_starts():
    from torch_handle.config.loader import preset_from_dict
    from torch_handle.errors import PresetError

    for model, message in [
        ({"n_kv_heads": 3}, "model.n_kv_heads: 3 does not divide n_heads=4"),
        ({"d_model": 100, "n_heads": 3}, "model.n_heads: 3 does not divide d_model=100 (or give head_dim)"),
        ({"position": "rope", "head_dim": 7}, "model.head_dim: RoPE rotates channel pairs: the head width 7 must be"),
    ]:
        try:
            preset_from_dict({"model": model})
        except PresetError as e:
            assert str(e).startswith(message), str(e)
        else:
            raise AssertionError(f"{model} was accepted")
    assert preset_from_dict({"model": {"d_model": 100, "n_heads": 3, "head_dim": 32}}).model.options.head_dim == 32

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
    # activation: mlp's old name, read by the plugin only; init_from: weights loaded into the built model (docs/hf.md)
    assert list(options) == ["kind", *args, "activation", "init_from"]
    for name, f in args.items():
        assert (options[name].type, options[name].default, dict(options[name].metadata)) == \
               (f.type, f.default, dict(f.metadata)), name


def test_a_preset_that_omits_norm_first_still_gets_post_ln():
    assert TransformerConfig().norm_first is False and TransformerArgs(8).norm_first is False


def test_reading_the_options_imports_no_torch():
    code = "import sys, handle_plugins.transformer; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

"""Whether a finished run handed on its whole model: the check every layout's test applies to its runs.

``model.safetensors`` holds the one-process model's every tensor by name and shape (the model ``handle generate``
builds from the run's preset, which then loads it strictly and samples from it), and the last checkpoint's
consolidated state (its portable form: :mod:`torch_handle.checkpoint.convert`) holds the same tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import load_file


def assert_whole_weights(run_dir: Path) -> None:
    """Raises AssertionError (naming ``run_dir`` and what differs) unless the run's final weights are whole."""
    from handle_cli.main import cli
    from torch_handle.checkpoint import convert, store
    from torch_handle.infer.generate import load_run

    run_dir = Path(run_dir)
    final = load_file(str(run_dir / "model.safetensors"))
    model = load_run(run_dir).model  # handle generate's loader: the one-process model, loaded strictly
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in final.items()}
    assert got == want, (f"{run_dir.name}: model.safetensors lacks {sorted(want.keys() - got.keys())[:4]}, has "
                         f"{sorted(got.keys() - want.keys())[:4]} beyond, {len(got)} of {len(want)} tensors")
    result = CliRunner().invoke(cli, ["generate", str(run_dir), "the", "--max-new-tokens", "2", "--seed", "0"])
    assert result.exit_code == 0, f"{run_dir.name}: handle generate: {result.output[-1000:]}"

    newest = store.list_checkpoints(run_dir / "checkpoints")[-1]
    layout = store.read_layout(newest)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    convert.ensure_portable(newest, layout, names)
    weights, _, _ = convert.read_portable(convert.portable_dir(newest, layout))
    missing = sorted(final.keys() - weights.keys() - {"lm_head.weight"})  # a tied head: stored once, by embed
    assert not missing, f"{run_dir.name}: the checkpoint's portable form lacks {missing[:4]}"
    for name, value in final.items():
        if name in weights:
            assert torch.equal(weights[name].to(value.dtype), value), f"{run_dir.name}: {name} differs"

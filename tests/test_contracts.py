"""The model, strategy and registration contracts, in one process: a strategy is built with its model (nothing
left None), FSDP2 shards the blocks the model declares (``model.blocks()``) and warns about a model that declares
none, and a dataset's ``preflight`` is a ``register`` argument that ``handle validate`` / ``handle run`` call."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch import nn

from handle_cli.main import cli
from handle_plugins.strategies import (DDPConfig, FSDPConfig, ScratchDDPConfig, ScratchFSDPConfig, SingleConfig,
                                       build_ddp, build_fsdp, build_scratch_ddp, build_scratch_fsdp, build_single)
from torch_handle.errors import DataError
from torch_handle.hookspecs import hookimpl
from torch_handle.model.args import TransformerArgs
from torch_handle.model.transformer import build_transformer
from torch_handle.registry import PluginInfo, PluginRegistry, load_registry
from torch_handle.config.schema import TrainingConfig
from torch_handle.train.strategy import DistContext

V = 23
TRAINING = TrainingConfig(steps=4, warmup_steps=1, precision="fp32")


def tiny(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return build_transformer(TransformerArgs(V, d_model=16, n_heads=4, n_layers=2, d_ff=32, dropout=0.0, norm_first=True), kind=kind)


@pytest.fixture
def one_rank(tmp_path):
    """A 1-process gloo group, as a torchrun worker of world size 1 has."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    finally:
        dist.destroy_process_group()


def one_step(strategy, kind: str) -> float:
    ids = torch.randint(0, V, (2, 6))
    with strategy.accumulating(sync=True), strategy.autocast():
        logits = strategy.model(ids) if kind == "decoder" else strategy.model(ids, ids)
    strategy.backward(logits.float().logsumexp(-1).mean())
    return strategy.step()


# ---------------------------------------------------------------------------------------------------------------
# strategies are built with their model
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single", "ddp", "fsdp", "scratch-ddp", "scratch-fsdp"])
def test_a_strategy_is_built_with_its_model(name, one_rank):
    factory, options = {"single": (build_single, SingleConfig()), "ddp": (build_ddp, DDPConfig()),
                        "fsdp": (build_fsdp, FSDPConfig()),
                        "scratch-ddp": (build_scratch_ddp, ScratchDDPConfig()),
                        "scratch-fsdp": (build_scratch_fsdp, ScratchFSDPConfig())}[name]
    model = tiny("decoder")
    strategy = factory(options, TRAINING, one_rank, model)
    assert strategy.model is not None and strategy.optimizer is not None and strategy.scheduler is not None
    assert strategy.unwrapped() is model
    assert strategy.describe()["optimizer"] == "AdamW" and strategy.lr > 0
    assert strategy.param_bytes() > 0
    before = strategy.lr
    assert one_step(strategy, "decoder") > 0
    assert strategy.lr != before  # the schedule stepped with the optimizer
    assert registered_factory(name) is factory


def registered_factory(name: str):
    return load_registry().get("strategy", name).factory


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 shards the model's blocks
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decoder", "encoder-decoder"])
def test_fsdp_shards_each_block_then_the_model(kind, one_rank, monkeypatch, caplog):
    import torch.distributed.fsdp as fsdp

    calls = []
    real = fsdp.fully_shard

    def counting_fully_shard(module, **kwargs):
        calls.append(module)
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", counting_fully_shard)
    model = tiny(kind)
    blocks = model.blocks()
    with caplog.at_level(logging.WARNING, logger="torch_handle"):
        strategy = build_fsdp(FSDPConfig(), TRAINING, one_rank, model)
    assert calls == [*blocks, model]  # one unit per block, in forward order, then the rest of the model
    assert [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)] == [model, *blocks]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert one_step(strategy, kind) > 0


class NoBlocks(nn.Module):
    """A model plugin's model that does not say which modules repeat."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, V)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return torch.log_softmax(self.head(x), dim=-1)


def test_fsdp_shards_a_model_without_blocks_whole_and_warns(one_rank, caplog):
    from torch.distributed.fsdp import FSDPModule

    model = NoBlocks()
    with caplog.at_level(logging.WARNING, logger="torch_handle"):
        strategy = build_fsdp(FSDPConfig(), TRAINING, one_rank, model)
    assert [m for m in model.modules() if isinstance(m, FSDPModule)] == [model]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "NoBlocks has no blocks()" in warning.getMessage() and "one unit" in warning.getMessage()
    assert one_step(strategy, "decoder") > 0


# ---------------------------------------------------------------------------------------------------------------
# register(..., preflight=...)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ProbeConfig:
    path: str = ""


def _info(name: str) -> PluginInfo:
    return PluginInfo(name=name, distribution="test-dist", version="0", builtin=False)


def _build(options, ctx):
    raise AssertionError("the factory must not run before a launch")


def test_a_non_callable_preflight_fails_the_plugin():
    class NotCallable:
        @hookimpl
        def handle_register_datasets(self, register):
            register("probe", ProbeConfig, _build, "", preflight="check the paths")

    class OnAStrategy:
        @hookimpl
        def handle_register_strategies(self, register):
            register("probe", ProbeConfig, _build, "", preflight=lambda options: None)

    reg = PluginRegistry()
    reg.add_plugin(NotCallable(), _info("not-callable"))
    info = reg.plugins["not-callable"]
    assert info.status == "failed" and "dataset 'probe': preflight must be callable" in info.error
    assert reg.names("dataset") == []
    reg.add_plugin(OnAStrategy(), _info("on-a-strategy"))
    assert "preflight is only run for datasets and models" in reg.plugins["on-a-strategy"].error


def test_builtin_datasets_register_their_preflight():
    from handle_plugins.datasets import preflight_parallel, preflight_text

    reg = load_registry()
    assert reg.get("dataset", "text").preflight is preflight_text
    assert reg.get("dataset", "parallel").preflight is preflight_parallel
    assert reg.get("dataset", "pydoc").preflight is None


@pytest.mark.parametrize("command", ["validate", "run"])
def test_validate_and_run_call_the_registered_preflight(command, tmp_path, monkeypatch, no_launch):
    import torch_handle.registry as registry_module

    seen = []

    def preflight(options):
        seen.append(options)
        raise DataError(f"{options.path}: no such file (data.path)")

    class Probe:
        @hookimpl
        def handle_register_datasets(self, register):
            register("probe", ProbeConfig, _build, "a dataset with a pre-flight check", preflight=preflight)

    reg = load_registry()
    reg.add_plugin(Probe(), _info("probe-plugin"))
    monkeypatch.setattr(registry_module, "_REGISTRY", reg)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HANDLE_DEBUG", raising=False)
    (tmp_path / "p.toml").write_text(f'[run]\noutput_dir = "{tmp_path / "out"}"\n'
                                     '[data]\nname = "probe"\npath = "missing.txt"\n')
    result = CliRunner().invoke(cli, [command, "p.toml"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert seen == [ProbeConfig(path="missing.txt")]
    assert result.stderr.strip() == "error: missing.txt: no such file (data.path)"
    assert not (tmp_path / "out").exists()

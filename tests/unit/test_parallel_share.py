"""The parallel-share contract (torch_handle/train/share.py): the TP, pipeline and expert-parallel shares each
implement every call of ``ParallelShare`` with its parameters, the run's one share is resolved in the stated order
(the pipeline's, which composes the others), and an expert-parallel run imports no tensor parallelism."""

from __future__ import annotations

import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest

from torch_handle.train.compose import Shares
from torch_handle.train.expert_parallel import ExpertParallel
from torch_handle.train.pipeline_parallel import PipelineParallel
from torch_handle.train.share import COMPOSITION, Checkpointer, ParallelShare
from torch_handle.train.strategy import Strategy
from torch_handle.train.tensor_parallel import TensorParallel


def _calls(protocol: type) -> list[str]:
    """The calls ``protocol`` names, its bases' (Checkpointer's) included."""
    return [name for klass in reversed(protocol.__mro__) if klass in (Checkpointer, ParallelShare)
            for name, value in vars(klass).items() if inspect.isfunction(value) and name[0] != "_"]


CONTRACT = _calls(ParallelShare)


def test_the_contract_names_every_call_the_trainer_makes() -> None:
    assert sorted(CONTRACT) == sorted([
        "parallelize", "bind", "begin_step", "micro_batch", "loss", "before_step", "step_stats", "checkpoint_layout",
        "loads_natively", "save", "load", "load_portable", "full_state_dict", "parameter_names"])
    assert COMPOSITION == ("pipeline", "tensor", "expert")
    assert sorted(_calls(Checkpointer)) == sorted(["checkpoint_layout", "loads_natively", "save", "load",
                                                   "load_portable", "parameter_names"])


def test_the_strategy_is_a_checkpointer() -> None:
    """A run without a share saves and loads through its strategy: the trainer's ``checkpointer`` either way."""
    for name in _calls(Checkpointer):
        want = list(inspect.signature(getattr(Checkpointer, name)).parameters)
        assert list(inspect.signature(getattr(Strategy, name)).parameters) == want, name


@pytest.mark.parametrize("share", [TensorParallel, PipelineParallel, ExpertParallel], ids=lambda c: c.__name__)
def test_every_share_implements_the_contract(share: type) -> None:
    for name in CONTRACT:
        method = getattr(share, name, None)
        assert callable(method), f"{share.__name__} has no {name}"
        assert method is not getattr(ParallelShare, name), f"{share.__name__}.{name} is the protocol's stub"
        want = list(inspect.signature(getattr(ParallelShare, name)).parameters)
        got = list(inspect.signature(method).parameters)
        assert got == want, f"{share.__name__}.{name}{tuple(got)}: the contract's is {tuple(want)}"
        optional = [p for p in inspect.signature(getattr(ParallelShare, name)).parameters.values()
                    if p.default is not inspect.Parameter.empty]
        for p in optional:  # what the trainer may leave out, every share lets it leave out
            assert inspect.signature(method).parameters[p.name].default == p.default, (share.__name__, name, p)


def test_the_run_has_one_share_the_pipeline_composing_the_others() -> None:
    tp, pp, ep = SimpleNamespace(name="tp"), SimpleNamespace(name="pp"), SimpleNamespace(name="ep")
    assert Shares(None).run is None
    assert Shares(None, tp=tp).run is tp and Shares(None, ep=ep).run is ep
    assert Shares(None, tp=tp, pp=pp).run is pp  # tp x pp and dp x tp x pp (presets/3d.toml): the stages joined
    assert Shares(None, pp=pp, ep=ep).run is pp


def test_an_expert_parallel_run_imports_no_tensor_parallelism() -> None:
    """What an EP-only run's trainer imports (the shares' modules only when their degree is above 1) leaves the
    tensor-parallel share out; the check sees it once the trainer does import it."""
    code = ("import sys; import torch_handle.train.trainer, torch_handle.train.compose, torch_handle.parallel.mesh, "
            "torch_handle.train.expert_parallel, torch_handle.train.pipeline_parallel; "
            "print('torch_handle.train.tensor_parallel' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    seen = code.replace("torch_handle.parallel.mesh,", "torch_handle.parallel.mesh, torch_handle.train.tensor_parallel,")
    assert subprocess.run([sys.executable, "-c", seen], capture_output=True, text=True).stdout.strip() == "True"

"""The parallel-share contract (torch_handle/train/shares/contract.py): the TP, pipeline and expert-parallel shares
each implement every call of ``ParallelShare`` with its parameters, the run's one share is resolved in the stated order
(the pipeline's, which composes the others), and an expert-parallel run imports no tensor parallelism. The
contract is checked against the calls the trainer's modules make (read from their source), the order against what
``build_shares(...).run`` resolves for every layout."""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from torch_handle.train import trainer as trainer_module
from torch_handle.train.shares import compose
from torch_handle.train.shares.contract import COMPOSITION, Checkpointer, ParallelShare
from torch_handle.train.shares.expert import ExpertParallel
from torch_handle.train.shares.pipeline import PipelineParallel
from torch_handle.train.shares.tensor import TensorParallel
from torch_handle.train.strategy import DistContext, Strategy


def _calls(protocol: type) -> list[str]:
    """The calls ``protocol`` names, its bases' (Checkpointer's) included."""
    return [name for klass in reversed(protocol.__mro__) if klass in (Checkpointer, ParallelShare)
            for name, value in vars(klass).items() if inspect.isfunction(value) and name[0] != "_"]


def _members(protocol: type) -> set[str]:
    """Its calls and the attributes it declares (``ParallelShare.strategy``), its bases' included."""
    return set(_calls(protocol)) | {name for klass in protocol.__mro__ if klass in (Checkpointer, ParallelShare)
                                    for name in inspect.get_annotations(klass)}


CONTRACT = _calls(ParallelShare)
HOLDERS = {"share": ParallelShare, "checkpointer": Checkpointer}
"""What the trainer's modules call the run's share (``self.share``, a ``share`` argument or loop variable) and its
checkpointer (``self.checkpointer``, ``trainer.checkpointer``): the strategy, or the share bound to it."""
TRAIN = Path(inspect.getsourcefile(trainer_module)).parent


def _trainer_sources() -> dict[str, str]:
    """The trainer's modules (torch_handle/train/*.py: the trainer and what it hands the share to; the shares, which
    hand it on; the objectives, which compute a split model's losses through it), by name."""
    paths = sorted([*TRAIN.glob("*.py"), *TRAIN.glob("shares/*.py"), *TRAIN.glob("objectives/*.py")])
    return {str(path.relative_to(TRAIN)): path.read_text(encoding="utf-8") for path in paths}


def _uses(sources: dict[str, str]) -> dict[str, set[str]]:
    """The attributes the ``sources`` use on each of :data:`HOLDERS` (``self.share.loss(...)``: ``loss`` of share)."""
    used: dict[str, set[str]] = {holder: set() for holder in HOLDERS}
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, ast.Attribute):
                held = node.value
                holder = held.id if isinstance(held, ast.Name) else getattr(held, "attr", None)
                if holder in used:
                    used[holder].add(node.attr)
    return used


def _contract_problems(used: dict[str, set[str]]) -> list[str]:
    """What the protocols and the trainer's uses disagree on: a use the protocol lacks, or a protocol call no
    module makes (every ParallelShare call through the share or the checkpointer; every Checkpointer call through
    the checkpointer, which is the strategy when there is no share)."""
    problems = []
    for holder, protocol in HOLDERS.items():
        problems += [f"{holder}.{name} is not in {protocol.__name__}"
                     for name in sorted(used[holder] - _members(protocol))]
    problems += [f"ParallelShare.{name} is never used" for name in CONTRACT
                 if name not in used["share"] | used["checkpointer"]]
    problems += [f"Checkpointer.{name} is not used through the checkpointer" for name in _calls(Checkpointer)
                 if name not in used["checkpointer"]]
    return problems


def test_the_contract_names_every_call_the_trainer_makes_and_no_other() -> None:
    assert _contract_problems(_uses(_trainer_sources())) == []


def test_the_contract_check_sees_a_call_added_or_dropped() -> None:
    """The check reads the modules' text: a call the trainer adds, or one it stops making, is reported."""
    sources = _trainer_sources()

    def new_problems(trainer: str) -> list[str]:
        before = _contract_problems(_uses(sources))
        return [p for p in _contract_problems(_uses({**sources, "trainer.py": trainer})) if p not in before]

    assert new_problems(sources["trainer.py"] + (
        "\n\ndef _added(self, trainer):\n    self.share.rebalance()\n    trainer.checkpointer.compact()\n")) == [
        "share.rebalance is not in ParallelShare", "checkpointer.compact is not in Checkpointer"]
    assert ".before_step(" in sources["trainer.py"]
    assert new_problems(sources["trainer.py"].replace(".before_step(", ".step_before(")) == [
        "share.step_before is not in ParallelShare", "ParallelShare.before_step is never used"]


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


def test_the_run_has_one_share_the_first_of_composition_composing_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """For every layout (pp, cp, tp, ep each 1 or 2; cp with ep refused by ``handle validate``), ``build_shares(...)
    .run`` is the share present first in :data:`COMPOSITION` (each name that of its module: ``tensor`` ->
    torch_handle/train/shares/tensor.py), and it holds the other present ones it composes in COMPOSITION's order:
    the pipeline every other, the context share the TP share."""
    built: list[Any] = []

    def stub(kind: str) -> type:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            self.kind, self.args = kind, (*args, *kwargs.values())
            built.append(self)
        return type(f"Stub{kind.title()}", (), {"__init__": init})

    for kind in COMPOSITION:  # built as compose builds them: imported from their modules when needed
        monkeypatch.setattr(importlib.import_module(f"torch_handle.train.shares.{kind}"), f"{kind.title()}Parallel",
                            stub(kind))
    monkeypatch.setattr(compose, "attach_layout", lambda ctx, parallel: ctx)  # no mesh: a collective
    monkeypatch.setattr(compose, "pipeline_microbatches", lambda preset: 2)
    ctx = DistContext(rank=0, local_rank=0, world_size=16, device=torch.device("cpu"), backend="gloo")
    seen: set[str] = set()
    holds = {"pipeline": COMPOSITION[1:], "context": ("tensor",)}
    for pp, cp, tp, ep in itertools.product((1, 2), repeat=4):
        if cp > 1 and ep > 1:
            continue
        built.clear()
        preset = SimpleNamespace(parallel=SimpleNamespace(tp=tp, pp=pp, ep=ep, cp=cp, ep_impl="native"),
                                 data=SimpleNamespace(options=SimpleNamespace(document_mask=True)),
                                 training=SimpleNamespace(label_smoothing=0.0))
        run = compose.build_shares(preset, ctx).run
        present = [share.kind for share in built]
        seen.update(present)
        first = next((kind for kind in COMPOSITION if kind in present), None)
        assert (run and run.kind) == first, (pp, cp, tp, ep)
        if first in holds:
            held = [arg.kind for arg in run.args if any(arg is share for share in built)]
            assert held == [kind for kind in holds[first] if kind in present], (pp, cp, tp, ep)
    assert seen == set(COMPOSITION)  # every name of COMPOSITION is a share some layout builds


def test_an_expert_parallel_run_imports_no_tensor_parallelism() -> None:
    """What an EP-only run's trainer imports (the shares' modules only when their degree is above 1) leaves the
    tensor-parallel share out; the check sees it once the trainer does import it."""
    probe = "print('torch_handle.train.shares.tensor' in sys.modules)"
    # one interpreter: a fresh torch import is seconds
    code = ("import sys; import torch_handle.train.trainer, torch_handle.train.shares.compose, "
            "torch_handle.parallel.mesh, torch_handle.train.shares.expert, torch_handle.train.shares.pipeline; "
            f"{probe}; import torch_handle.train.shares.tensor; {probe}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]

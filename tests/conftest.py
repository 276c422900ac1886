"""Shared fixtures (kept generic: each test module holds its own helpers)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    """The repository checkout (``presets/`` lives here)."""
    return REPO_ROOT


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything tries to start torchrun workers (in this process)."""
    import handle_cli.runner
    import torch_handle.launch.supervisor

    def refuse(*args, **kwargs):
        raise AssertionError("a run was launched")

    monkeypatch.setattr(torch_handle.launch.supervisor.Launch, "start", refuse)
    monkeypatch.setattr(handle_cli.runner, "spawn_detached", refuse)

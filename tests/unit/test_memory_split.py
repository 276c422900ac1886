"""A LoRA run's memory view: the frozen base apart from what trains, in the dashboard's memory panel (80 columns)
and in `handle run`'s final summary; a full run's view unchanged."""

from __future__ import annotations

from pathlib import Path

from handle_cli.runner import summary_text
from handle_cli.tui.memory_panel import MemoryBars
from torch_handle.observe.state import RunState

LORA = {"param_bytes": 16_598_016, "trainable_param_bytes": 598_016, "frozen_param_bytes": 16_000_000,
        "grad_bytes": 598_016, "optimizer_bytes": 1_196_256, "rss_bytes": 900_000_000}
FULL = {"param_bytes": 16_000_000, "trainable_param_bytes": 16_000_000, "frozen_param_bytes": 0,
        "grad_bytes": 16_000_000, "optimizer_bytes": 32_000_120, "rss_bytes": 900_000_000}


def _panel(memory: dict[str, int], width: int) -> str:
    bars = MemoryBars()
    bars.set_memory({0: memory})
    return "\n".join(line.plain for line in bars.lines(width))


def test_the_panel_names_the_frozen_share_of_params() -> None:
    wide, narrow = _panel(LORA, 120), _panel(LORA, 78)
    assert "params 15.8 MiB · frozen 15.3 MiB · grads 584.0 KiB" in wide
    assert "par 15.8M fro 15.3M gra 584.0K" in narrow and all(len(line) <= 78 for line in narrow.splitlines())
    assert "fro" not in _panel(FULL, 120)  # a full run: nothing frozen, the line as before


def test_the_summary_gives_trainable_and_frozen_bytes() -> None:
    state = RunState(Path("runs/x"))
    state.peak_memory = {0: LORA, 1: FULL}
    text = summary_text(state, Path("runs/x"), {"status": "finished"})
    assert "rank 0: params 15.8 MiB (584.0 KiB trainable, 15.3 MiB frozen)  grads 584.0 KiB" in text
    assert "rank 1: params 15.3 MiB  grads" in text

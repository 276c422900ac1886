"""events.jsonl: the writer's seq numbering and flushing, the reader's handling of growing and bad files, the fold
that ``handle run`` prints from; telemetry sinks in a real run (TensorBoard, and one that raises)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from tests.helpers import tiny_preset
from torch_handle.observe.state import RunState
from torch_handle.observe.tail import EventReader
from torch_handle.observe.telemetry import EventWriter, last_seq


def test_writer_numbers_events_and_continues_after_reopen(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    w.emit("status", status="running", steps=3)
    w.emit("step", step=1, loss=2.0)
    w.close()
    w = EventWriter(path)  # a resumed run
    w.emit("step", step=2, loss=1.5)
    w.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["seq"] for e in events] == [0, 1, 2]
    assert last_seq(path) == 2
    assert all(isinstance(e["time"], float) for e in events)


def test_reader_waits_for_a_partial_line_and_reports_bad_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.poll() == []
    path.write_text('{"seq":0,"kind":"step","step":1}\n{"seq":1,"ki')
    assert [e["seq"] for e in reader.poll()] == [0]
    with open(path, "a") as f:
        f.write('nd":"step","step":2}\nnot json\n[1,2]\n{"seq":2,"kind":"eval","val_loss":1.0}\n')
    assert [e["seq"] for e in reader.poll()] == [1, 2]
    assert [b.line_no for b in reader.bad_lines] == [3, 4]


def test_summary_tracks_progress_memory_peaks_and_eta(tmp_path):
    s = RunState(tmp_path)
    s.apply([{"kind": "status", "status": "running", "steps": 10, "time": 100.0}])
    for step in range(1, 5):
        s.apply([{"kind": "step", "step": step, "loss": 5.0 - step, "lr": 1e-3, "tokens_per_s": 1000.0 * step,
                  "step_time_s": 0.5, "time": 100.0 + step,
                  "memory": [{"rank": 0, "param_bytes": 10 * step, "rss_bytes": 5}]}])
    s.apply([{"kind": "eval", "step": 4, "val_loss": 1.5}])
    assert (s.step, s.last_loss, s.last_val_loss) == (4, 1.0, 1.5)
    assert s.peak_memory[0]["param_bytes"] == 40
    assert s.eta_s() == 3.0
    assert s.mean_tokens_per_s == 3500.0


def test_summary_ignores_fields_of_the_wrong_type(tmp_path):
    s = RunState(tmp_path)
    for bad in ({"kind": "step", "step": "x", "loss": "nan?", "tokens_per_s": "fast", "memory": "x"},
                {"kind": "step", "step": 2, "memory": [{"rank": "a"}, 3, {"rank": 1, "rss_bytes": "big"}]},
                {"kind": "eval", "val_loss": None}, {"kind": "status", "status": 5, "steps": "ten"}):
        s.apply([bad])
    assert s.step == 2 and s.last_loss is None and s.last_val_loss is None and s.mean_tokens_per_s is None
    assert s.peak_memory == {1: {}}


def test_non_finite_figures_are_written_as_null(tmp_path):
    path = tmp_path / "events.jsonl"
    w = EventWriter(path)
    w.emit("step", step=1, loss=float("nan"), grad_norm=float("inf"), skipped=True)
    w.close()
    line = path.read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line)["loss"] is None


# ---------------------------------------------------------------------------------------------------------------
# sinks in real runs
# ---------------------------------------------------------------------------------------------------------------

RAISING_SINK = '''
    """A sink that raises on every event (what a broken metrics service looks like to a run)."""

    from torch_handle.api import Sink, hookimpl


    class Raising(Sink):
        def emit(self, event):
            raise RuntimeError(f"cannot send event {event['seq']}")


    @hookimpl
    def handle_register_sinks(register):
        register("raising", lambda run_dir, preset: Raising(), "raises on every event")
'''


def raising_sink_site(root: Path) -> Path:
    """A directory that, on PYTHONPATH, adds the plugin ``raising`` (entry point group ``handle``) without
    installing anything: importlib.metadata finds the ``.dist-info`` on sys.path."""
    site = root / "site"
    info = site / "handle_raising_sink-0.0.1.dist-info"
    info.mkdir(parents=True)
    (site / "handle_raising_sink.py").write_text(textwrap.dedent(RAISING_SINK))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: handle-raising-sink\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[handle]\nraising = handle_raising_sink\n")
    return site


def handle_env(pythonpath: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HANDLE_LOAD_PLUGINS", "PYTHONPATH")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_plugins_list_shows_the_tensorboard_sink():
    result = CliRunner().invoke(cli, ["plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    sinks = {p["name"]: p for p in json.loads(result.output)["plugins"]}["sinks"]
    assert sinks["status"] == "loaded" and sinks["builtin"] and sinks["registers"] == {"sink": ["tensorboard"]}
    assert "TensorBoard" in sinks["descriptions"]["sink"]["tensorboard"]
    result = CliRunner().invoke(cli, ["plugins", "list", "--kind", "sink"])
    assert result.exit_code == 0 and any(line.split()[:2] == ["tensorboard", "sinks"]
                                         for line in result.output.splitlines()), result.output


@pytest.mark.dist
def test_a_sink_that_raises_on_every_event_changes_neither_losses_nor_exit_code(tmp_path):
    """The same tiny run (single process) with and without a plugin whose sink raises on every event: the
    same losses exactly, exit code 0, one warning in events.jsonl; TensorBoard still gets its scalars.

    Both runs say ``training.precision = "auto"``: the launcher resolves it once (the probe is cached after the
    first), and preset.toml, run.json and the run's first lines carry the concrete precision and the reason."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(tiny_preset(tmp_path / "runs", steps=4, strategy="single", log_every=2))
    site = raising_sink_site(tmp_path)
    listed = subprocess.run([sys.executable, "-m", "handle_cli", "plugins", "list", "--json"], capture_output=True,
                            text=True, timeout=120, env=handle_env(site))
    plugins = {p["name"]: p for p in json.loads(listed.stdout)["plugins"]}
    assert plugins["raising"]["registers"] == {"sink": ["raising"]}, listed.stdout
    runs = {}
    for name, pythonpath in (("plain", None), ("raising", site)):
        proc = subprocess.run([sys.executable, "-m", "handle_cli", "run", str(preset), "--set", f"run.name={name}",
                               "--set", "launch.nproc_per_node=1", "--set", "training.eval_every=2",
                               "--set", "training.precision=auto"],
                              capture_output=True, text=True, timeout=300, env=handle_env(pythonpath))
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        run_dir = Path(next(ln for ln in proc.stdout.splitlines() if ln.startswith("run directory: ")).split(": ")[1])
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        runs[name] = (proc, run_dir, events)
    losses = {name: {e["step"]: e["loss"] for e in events if e["kind"] == "step"} for name, (_, _, events) in
              runs.items()}
    assert sorted(losses["plain"]) == [1, 2, 3, 4] and losses["raising"] == losses["plain"]

    def warnings(events):
        return [e["message"] for e in events if e["kind"] == "log" and e["level"] == "warning"]

    proc, run_dir, events = runs["raising"]
    assert warnings(runs["plain"][2]) == []
    assert warnings(events) == ["sink 'raising' disabled: RuntimeError: cannot send event 0 (in emit)"]
    assert "warning: sink 'raising' disabled" in proc.stdout
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    for name, (proc, run_dir, _) in runs.items():  # auto, resolved once by the launcher
        info = json.loads((run_dir / "run.json").read_text())
        chosen = info["precision"]
        assert chosen in ("fp32", "bf16") and info["precision_reason"].startswith(f"auto → {chosen}: bf16 matmul ")
        assert f'precision = "{chosen}"' in (run_dir / "preset.toml").read_text()
        assert f"precision: {chosen} ({info['precision_reason']})" in proc.stdout.splitlines()[:4], name
    for name, (_, run_dir, events) in runs.items():  # TensorBoard: the same scalars at the same steps as before
        scalars = tensorboard_scalars(run_dir)
        assert sorted(scalars) == ["time/backward_s", "time/data_s", "time/forward_s", "time/optimizer_s",
                                   "time/sync_s", "train/grad_norm", "train/loss", "train/lr", "train/mfu",
                                   "train/step_time_s", "train/tokens_per_s", "valid/loss"], name
        assert [s for s, _ in scalars["time/forward_s"]] == [1, 2, 3, 4]
        assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
        assert [v for _, v in scalars["train/loss"]] == pytest.approx([losses[name][s] for s in (1, 2, 3, 4)])
        assert [s for s, _ in scalars["valid/loss"]] == [2, 4]  # the step-0 baseline is in events.jsonl only


def test_tensorboard_sink_writes_a_dpo_runs_rewards_and_logps(tmp_path):
    """In-process: the six preference metrics (objectives.preference.METRICS) of step events as ``train/<name>``,
    of eval events after step 0 as ``valid/<name>``; the step-0 baseline, as for ``valid/loss``, is not written."""
    pytest.importorskip("tensorboard")
    from handle_plugins.sinks import build_tensorboard
    from torch_handle.train.objectives.preference import METRICS

    metrics = {name: 0.25 * (i + 1) for i, name in enumerate(METRICS)}
    sink = build_tensorboard(tmp_path, None)
    sink.emit({"kind": "eval", "step": 0, "time": 1.0, "val_loss": 0.7, **metrics})
    for n in (1, 2):
        sink.emit({"kind": "step", "step": n, "time": 1.0 + n, "loss": 0.69, **{k: v * n for k, v in metrics.items()}})
    sink.emit({"kind": "eval", "step": 2, "time": 4.0, "val_loss": 0.6, **{k: -v for k, v in metrics.items()}})
    sink.close()
    scalars = tensorboard_scalars(tmp_path)
    for k, v in metrics.items():
        assert scalars[f"train/{k}"] == [(1, pytest.approx(v)), (2, pytest.approx(2 * v))]
        assert scalars[f"valid/{k}"] == [(2, pytest.approx(-v))]
    assert sorted(scalars) == sorted(["train/loss", "valid/loss", *(f"{p}/{k}" for p in ("train", "valid")
                                                                    for k in METRICS)])

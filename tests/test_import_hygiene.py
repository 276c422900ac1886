"""The library never pulls in the UI or the CLI, and ``handle --help`` stays fast (no torch, no textual).

Each check runs in a fresh interpreter, so modules imported by other tests cannot hide a regression.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ("torch", "textual", "textual_plotext", "plotext", "deepspeed")


def loaded_after(code: str) -> set[str]:
    """Top-level names of the modules loaded after running ``code`` in a new interpreter."""
    probe = textwrap.dedent(code) + textwrap.dedent("""
        import json, sys
        print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_library_imports_no_ui_and_no_cli() -> None:
    loaded = loaded_after("import torch_handle, torch_handle.observe.telemetry, torch_handle.config.loader, torch_handle.rundir, "
                          "torch_handle.launch.supervisor")
    assert not {m for m in loaded if m.startswith("textual")}
    assert "click" not in loaded
    assert "plotext" not in loaded


def test_cli_help_imports_neither_torch_nor_textual() -> None:
    loaded = loaded_after("""
        from handle_cli.main import cli
        try:
            cli(["--help"], standalone_mode=False)
        except SystemExit:
            pass
        import handle_cli.tui  # the package itself imports textual only inside run_app()
        import handle_cli.tui.model  # the dashboard's plain-Python half
    """)
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_python_m_handle_cli_help_with_importtime() -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "handle_cli", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Usage:" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert imported, "no -X importtime output"
    assert not imported & set(HEAVY), imported & set(HEAVY)


def test_preparing_a_corpus_imports_no_torch() -> None:
    """``handle run`` prepares its corpus in the launcher (a tokenizer trained, the text encoded into shards) before
    any worker starts: without torch, whose import was half the launcher's CPU (torch_handle.data.tokenizer_file)."""
    loaded = loaded_after("""
        import tempfile
        from pathlib import Path
        from torch_handle.data.prepare import prepare
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "corpus").mkdir()
            for i in range(20):  # a document a file
                (Path(d) / "corpus" / f"{i}.txt").write_text(f"document {i}: the quick brown fox. " * 40)
            prepare([str(Path(d) / "corpus")], Path(d) / "out", vocab_size=300, valid_fraction=0.1, workers=1)
    """)
    assert "torch" not in loaded, "preparing a corpus imported torch"

"""``handle tui``: the live dashboard of a run (Textual).

Textual is imported inside :func:`run_app`, so importing ``handle_cli`` (and ``handle --help``) stays fast.
"""

from __future__ import annotations

from pathlib import Path


def run_app(run_dir: Path, output_dir: Path | None = None) -> None:
    """Show the dashboard of ``run_dir`` until the user quits; the picker (``r``) lists runs under ``output_dir``
    (default: the run directory's parent)."""
    from handle_cli.tui.app import HandleDashboard

    HandleDashboard(Path(run_dir), output_dir=Path(output_dir) if output_dir is not None else None).run()


__all__ = ["run_app"]

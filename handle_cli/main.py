"""``handle``: train a from-scratch Transformer across processes and watch it.

Heavy modules (torch, deepspeed, textual) are imported inside the commands that need them, so ``handle --help``
answers instantly.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

import click

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_STOPPED = 130


class HandleGroup(click.Group):
    """Runs commands inside one error boundary: expected errors become one line on stderr and exit code 2."""

    def invoke(self, ctx: click.Context):
        from torch_handle.errors import USER_ERRORS

        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            if os.environ.get("HANDLE_DEBUG") or "--debug" in sys.argv:
                raise
            fail(str(e))


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.group(cls=HandleGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="torch-handle", prog_name="handle")
def cli() -> None:
    """Train a Transformer with DDP, DeepSpeed ZeRO or FSDP2 across processes, and watch it live.

    \b
    Quick start:
      handle run presets/zero2.toml          # 2 workers, DeepSpeed ZeRO-2, on CPU or GPU
      handle tui                             # dashboard of the newest run
    """


# ---------------------------------------------------------------------------------------------------------------
# handle run
# ---------------------------------------------------------------------------------------------------------------


@cli.command()
@click.argument("preset", required=False)
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE",
              help="Override a preset key, typed by its field (repeatable), e.g. --set training.steps=50.")
@click.option("--run-dir", type=click.Path(path_type=Path), help="Run directory (default: <output_dir>/<name>-<UTC time>).")
@click.option("--resume", "resume_dir", type=click.Path(path_type=Path), metavar="RUN_DIR",
              help="Continue RUN_DIR from its newest valid checkpoint (PRESET is then not needed).")
@click.option("--tui", is_flag=True, help="Start the run in the background and open the dashboard on it.")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def run(preset: str | None, overrides: tuple[str, ...], run_dir: Path | None, resume_dir: Path | None, tui: bool,
        debug: bool) -> None:
    """Validate PRESET, start torchrun workers and show live progress.

    Exit code: 0 finished, 1 failed, 2 bad input (nothing started), 130 stopped by Ctrl-C.
    The first Ctrl-C lets the workers finish the step and write a checkpoint; a second one stops them at once.
    """
    from handle_cli.runner import prepare_run, supervise

    if preset is None and resume_dir is None:
        fail("missing PRESET (for example: handle run presets/zero2.toml), or --resume RUN_DIR")
    if preset is not None and resume_dir is not None:
        fail("give either PRESET or --resume RUN_DIR, not both (use --set to change a resumed run)")
    loaded, directory = prepare_run(preset, overrides, run_dir, resume_dir)
    if tui:
        from handle_cli.runner import spawn_detached

        spawn_detached(directory)
        from handle_cli.tui import run_app

        run_app(directory)
        return
    sys.exit(supervise(loaded, directory))


@cli.command(hidden=True)
@click.argument("run_dir", type=click.Path(path_type=Path))
def supervise_run(run_dir: Path) -> None:
    """Supervise an already prepared run directory without a terminal (used by --tui)."""
    from torch_handle.config import load_preset

    from handle_cli.runner import supervise

    sys.exit(supervise(load_preset(run_dir / "preset.toml"), run_dir, quiet=True))


# ---------------------------------------------------------------------------------------------------------------
# presets and validation
# ---------------------------------------------------------------------------------------------------------------


@cli.command()
@click.argument("preset")
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE", help="Override a preset key.")
def validate(preset: str, overrides: tuple[str, ...]) -> None:
    """Check PRESET and every plugin section without starting anything."""
    from torch_handle.config import load_preset

    p = load_preset(preset, overrides)
    click.echo(f"{p.source}: ok ({p.strategy.name}, world size {p.world_size}, {p.training.steps} steps)")


@cli.group()
def presets() -> None:
    """Show and list presets."""


@presets.command("show")
@click.argument("preset")
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE", help="Override a preset key.")
def presets_show(preset: str, overrides: tuple[str, ...]) -> None:
    """Print the fully resolved PRESET (defaults + extends + overrides) as TOML, exactly as a run uses it."""
    from torch_handle.config import dump_preset, load_preset

    click.echo(dump_preset(load_preset(preset, overrides)), nl=False)


@presets.command("list")
def presets_list() -> None:
    """Presets in ./presets, each with its one-line description."""
    from torch_handle.config import preset_description

    for path in sorted(Path("presets").glob("*.toml")):
        click.echo(f"{path.stem:<16} {preset_description(path)}")


# ---------------------------------------------------------------------------------------------------------------
# dashboard
# ---------------------------------------------------------------------------------------------------------------


@cli.command()
@click.argument("run_dir", required=False, type=click.Path(path_type=Path))
@click.option("--output-dir", default="runs", show_default=True, type=click.Path(path_type=Path),
              help="Where to look for runs.")
def tui(run_dir: Path | None, output_dir: Path) -> None:
    """Live dashboard of RUN_DIR (default: the newest run under --output-dir)."""
    from torch_handle.rundir import newest_run, read_run_info

    if run_dir is None:
        run_dir = newest_run(output_dir)
        if run_dir is None:
            fail(f"{output_dir}: no runs yet (start one with: handle run presets/zero2.toml)")
    else:
        read_run_info(run_dir)  # a clear error when it is not a run
    from handle_cli.tui import run_app

    run_app(run_dir, output_dir=output_dir)


def main() -> None:  # pragma: no cover
    cli()


if __name__ == "__main__":  # pragma: no cover
    main()

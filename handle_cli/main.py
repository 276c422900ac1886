"""``handle``: train a from-scratch Transformer across processes and watch it.

Heavy modules (torch, deepspeed, textual) are imported inside the commands that need them, so ``handle --help``
answers instantly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
import click

from handle_cli.common import EXIT_FAILED, fail


class HandleGroup(click.Group):
    """Runs commands inside one error boundary: expected errors become one line on stderr and exit code 2.

    Plugins may add commands (``handle_register_commands``); they are looked up only after the core commands,
    so a plugin can never shadow a core command (``handle plugins list`` reports such a refusal). A plugin
    command that crashes is one line naming the plugin, exit code 1 (``HANDLE_DEBUG=1``: the traceback).
    """

    def invoke(self, ctx: click.Context):
        from torch_handle.errors import USER_ERRORS

        debug = os.environ.get("HANDLE_DEBUG") or "--debug" in sys.argv
        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            if debug:
                raise
            fail(str(e))
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit,
                KeyboardInterrupt):
            raise
        except Exception as e:
            name = ctx.invoked_subcommand
            if debug or name is None or name in self.commands:
                raise
            plugin = self._plugin_commands().get(name, ("?", None))[0]
            text = " ".join(str(e).split())
            fail(f"command {name!r} of plugin {plugin!r} failed: {type(e).__name__}"
                 f"{': ' + text if text else ''}", code=EXIT_FAILED)

    def _plugin_commands(self) -> dict:
        try:
            from torch_handle.registry import get_registry

            from handle_cli.plugins_cmd import accepted_commands

            return accepted_commands(get_registry(), set(self.commands))
        except Exception:  # noqa: BLE001 - the core commands must keep working whatever a plugin does
            return {}

    def get_command(self, ctx: click.Context, cmd_name: str):
        core = super().get_command(ctx, cmd_name)
        if core is not None:
            return core
        entry = self._plugin_commands().get(cmd_name)
        return entry[1] if entry else None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), *sorted(self._plugin_commands())]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        core, extra = [], []
        plugin_cmds = self._plugin_commands()
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is None or cmd.hidden:
                continue
            if name in self.commands:
                core.append((name, cmd.get_short_help_str(limit=formatter.width - 6 - len(name))))
            else:
                short = cmd.get_short_help_str(limit=formatter.width - 6 - len(name))
                extra.append((name, f"{short} [plugin {plugin_cmds[name][0]}]".strip()))
        if core:
            with formatter.section("Commands"):
                formatter.write_dl(core)
        if extra:
            with formatter.section("Plugin commands"):
                formatter.write_dl(extra)


@click.group(cls=HandleGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="torch-handle", prog_name="handle")
def cli() -> None:
    """Train a Transformer across processes, and watch it live: data parallelism (DDP, DeepSpeed ZeRO, FSDP2),
    tensor parallelism and pipeline parallelism, alone or composed (dp x tp x pp).

    \b
    Quick start:
      handle run presets/zero2.toml          # 2 workers, DeepSpeed ZeRO-2, on CPU or GPU
      handle run presets/3d.toml             # 8 workers: dp 2 x tp 2 x pp 2 on one mesh
      handle tui                             # dashboard of the newest run
      handle env --check-dist 2              # can this machine run 2 processes?
      handle bench comm --nproc 2            # collective bandwidth, like nccl-tests
      handle plugins list                    # strategies, models, datasets, profilers

    HANDLE_LOAD_PLUGINS=a,b limits the external plugins that load (empty: none); see `handle plugins --help`.
    """


# ---------------------------------------------------------------------------------------------------------------
# handle run
# ---------------------------------------------------------------------------------------------------------------


@cli.command()
@click.argument("preset", required=False)
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE",
              help="Override a preset key, typed by its field (repeatable), e.g. --set training.steps=50.")
@click.option("--run-dir", type=click.Path(path_type=Path),
              help="Run directory (default: <output_dir>/<name>-<UTC time>).")
@click.option("--resume", "resume_dir", type=click.Path(path_type=Path), metavar="RUN_DIR",
              help="Continue RUN_DIR from its newest valid checkpoint (PRESET is then not needed).")
@click.option("--tui", is_flag=True, help="Start the run in the background and open the dashboard on it.")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def run(preset: str | None, overrides: tuple[str, ...], run_dir: Path | None, resume_dir: Path | None, tui: bool,
        debug: bool) -> None:
    """Validate PRESET, start torchrun workers and show live progress.

    Exit code: 0 finished, 1 failed, 2 bad input (nothing started), 130 stopped by Ctrl-C.
    The first Ctrl-C lets the workers finish the step and write a checkpoint; a second one stops them at once.

    Settings left to "auto" are chosen once, before the workers start, and printed with the reason (also in
    run.json; the run's preset.toml holds the choice): training.precision (what this machine computes fastest)
    and, with parallel.tp > 1, parallel.tp_impl (DTensor where the strategy and layout run it: single or fsdp
    without a pipeline; the hand-written TP elsewhere, e.g. ddp or pp > 1). On a CPU, more ranks x threads than
    this node's usable cores print one warning line (oversubscribed: expect slow steps).

    \b
    Examples:
      handle run presets/zero2.toml --set training.steps=50
      handle run presets/ddp.toml --set parallel.tp=2 --set launch.nproc_per_node=4   # dp 2 x tp 2, TP by hand
      handle run --resume runs/zero2-20260101-120000
    """
    from torch_handle.launch.run import prepare_run

    from handle_cli.runner import supervise

    if preset is None and resume_dir is None:
        fail("missing PRESET (for example: handle run presets/zero2.toml), or --resume RUN_DIR")
    if preset is not None and resume_dir is not None:
        fail("give either PRESET or --resume RUN_DIR, not both (use --set to change a resumed run)")
    if preset is not None:
        from handle_cli.presets_cmd import resolve_preset_spec

        preset = resolve_preset_spec(preset)  # a bare NAME not in ./presets may be a plugin's preset
    if tui:
        from torch_handle.checkpoint.resume import resumed_mapping
        from torch_handle.config.loader import load_preset
        from torch_handle.rundir import PRESET_FILE

        if resume_dir is None:
            nnodes = load_preset(preset, overrides).launch.nnodes
        else:  # what the resume asks for (prepare_run reports its problems)
            asked = resumed_mapping(resume_dir, load_preset(Path(resume_dir) / PRESET_FILE), overrides) or {}
            nnodes = asked.get("launch", {}).get("nnodes", 1)
        if isinstance(nnodes, int) and nnodes > 1:  # the detached launcher reads the run's preset (node 0's)
            fail(f"--tui runs one node; with launch.nnodes = {nnodes} start each node's handle run without "
                 f"--tui and watch with: handle tui RUN_DIR")
    from handle_cli.data_cmd import progress_bar

    with progress_bar("preparing data") as show:  # text and pydoc: prepared here, before any worker starts
        loaded, directory = prepare_run(preset, overrides, run_dir, resume_dir,
                                        note=lambda line: click.echo(f"note: {line}"), progress=show)
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
    from torch_handle.config.loader import load_preset

    from handle_cli.runner import supervise

    sys.exit(supervise(load_preset(run_dir / "preset.toml"), run_dir, quiet=True))


# ---------------------------------------------------------------------------------------------------------------
# presets, validation, plugins, environment, planning, profiles (their own modules; click and stdlib at import)
# ---------------------------------------------------------------------------------------------------------------

from handle_cli.bench_cmd import bench  # noqa: E402
from handle_cli.bench_comm_cmd import comm  # noqa: E402
from handle_cli.bench_scaling_cmd import scaling  # noqa: E402
from handle_cli.data_cmd import data  # noqa: E402
from handle_cli.env_cmd import env  # noqa: E402
from handle_cli.estimate_cmd import estimate  # noqa: E402
from handle_cli.export_cmd import export  # noqa: E402
from handle_cli.generate_cmd import chat, eval_cmd, generate, translate  # noqa: E402
from handle_cli.plan_cmd import plan  # noqa: E402
from handle_cli.plugins_cmd import plugins  # noqa: E402
from handle_cli.presets_cmd import presets, presets_list, presets_new, presets_show, validate  # noqa: E402,F401
from handle_cli.profile_cmd import profile  # noqa: E402
from handle_cli.runs_cmd import runs  # noqa: E402
from handle_cli.slurm_cmd import slurm  # noqa: E402
from handle_cli.stacks_cmd import stacks  # noqa: E402

cli.add_command(validate)
cli.add_command(presets)
cli.add_command(plugins)
cli.add_command(env)
cli.add_command(bench)
bench.add_command(comm)
bench.add_command(scaling)
cli.add_command(data)
cli.add_command(estimate)
cli.add_command(plan)
cli.add_command(profile)
cli.add_command(generate)
cli.add_command(chat)
cli.add_command(translate)
cli.add_command(eval_cmd)
cli.add_command(export)
cli.add_command(runs)
cli.add_command(slurm)
cli.add_command(stacks)


# ---------------------------------------------------------------------------------------------------------------
# dashboard
# ---------------------------------------------------------------------------------------------------------------


@cli.command()
@click.argument("run_dir", required=False, type=click.Path(path_type=Path))
@click.option("--output-dir", default=None, type=click.Path(path_type=Path),
              help="Where to look for runs.")
def tui(run_dir: Path | None, output_dir: Path) -> None:
    """Live dashboard of RUN_DIR (default: the newest run under --output-dir, default ./runs)."""
    from torch_handle.rundir import newest_run, read_run_info

    if run_dir is None:
        output_dir = output_dir or Path("runs")
        run_dir = newest_run(output_dir)
        if run_dir is None:
            fail(f"{output_dir}: no runs yet (start one with: handle run presets/zero2.toml)")
    else:
        read_run_info(run_dir)  # a clear error when it is not a run
    from handle_cli.tui import run_app

    run_app(run_dir, output_dir=output_dir or Path(run_dir).parent)


def main() -> None:  # pragma: no cover
    cli()


if __name__ == "__main__":  # pragma: no cover
    main()

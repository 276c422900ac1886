"""``handle slurm``: write (and with ``--submit`` submit) an sbatch script that runs a preset on several nodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import click

from handle_cli.common import EXIT_FAILED, fail


@click.command("slurm")
@click.argument("preset")
@click.option("--nodes", type=click.IntRange(1, 4096), default=2, show_default=True, help="Nodes to allocate.")
@click.option("--gpus-per-node", type=click.IntRange(1, 64), default=None,
              help="GPUs per node; each node runs that many workers (default: CPUs, the preset's nproc_per_node).")
@click.option("--partition", default=None, help="Slurm partition (#SBATCH --partition).")
@click.option("--time", "time_limit", default=None, metavar="TIME", help="Time limit, e.g. 02:00:00 (#SBATCH --time).")
@click.option("--account", default=None, help="Slurm account to charge (#SBATCH --account).")
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE",
              help="Override a preset key (repeatable), as for handle run.")
@click.option("--port", type=click.IntRange(1, 65535), default=29400, show_default=True,
              help="Rendezvous port on the first node of the allocation.")
@click.option("--script", "script_path", type=click.Path(path_type=Path), default=None,
              help="Where to write the script (default: <output_dir>/slurm/<name>-<UTC time>.sbatch).")
@click.option("--submit", is_flag=True, help="Submit it with sbatch (which must be on PATH).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def slurm(preset: str, nodes: int, gpus_per_node: int | None, partition: str | None, time_limit: str | None,
          account: str | None, overrides: tuple[str, ...], port: int, script_path: Path | None, submit: bool,
          as_json: bool) -> None:
    """Write an sbatch script that runs PRESET on --nodes nodes, one `handle run` per node; print its path.

    The script starts one `handle run` per node with `srun --ntasks-per-node=1`; the rendezvous is on the first
    node of the allocation (scontrol show hostnames), each node's launch.node_rank is $SLURM_NODEID, and all nodes
    share one run directory, <output_dir>/<name>-slurm-<job id>, which must be on a shared filesystem (so must the
    preset, this Python environment and the data). The job's output goes to slurm-<job name>-<job id>.out in the
    submission directory; the run's own logs to <run directory>/logs. Two minutes before --time runs out, the runs
    get SIGTERM and stop after a checkpoint; a requeued job continues its run with --resume.

    \b
    Examples:
      handle slurm presets/zero2.toml --nodes 2 --gpus-per-node 8 --partition gpu --time 04:00:00
      handle slurm presets/zero2.toml --nodes 4 --set training.steps=5000 --submit
      handle slurm presets/ddp.toml --json          # {"script": ..., "run_dir": ..., "job_id": null}
    """
    from torch_handle.config.loader import load_preset
    from torch_handle.launch.run import check_inputs
    from torch_handle.launch.slurm import SET_BY_SLURM, SlurmJob, default_script_path, sbatch_script

    from handle_cli.presets_cmd import resolve_preset_spec

    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in SET_BY_SLURM:
            fail(f"--set {item}: {key} is set by the script (from --nodes, $SLURM_NODEID and the first node of "
                 f"the allocation); leave it out")
    sbatch = shutil.which("sbatch") if submit else None
    if submit and sbatch is None:
        fail("--submit: sbatch is not on PATH (run this on a Slurm login node, or drop --submit and copy the script "
             "there)")
    spec = resolve_preset_spec(preset)
    # everything each node will be given, validated here with a stand-in endpoint and node 0
    launch = [f"launch.nnodes={nodes}", "launch.node_rank=0", f"launch.rdzv_endpoint=first-node:{port}"]
    if gpus_per_node:
        launch.append(f"launch.nproc_per_node={gpus_per_node}")
    loaded = load_preset(spec, [*overrides, *launch])
    check_inputs(loaded)
    spec_path = Path(spec)
    preset_file = str(spec_path.resolve()) if spec_path.exists() else str(Path(str(loaded.source)).resolve())
    output_dir = Path(loaded.run.output_dir)
    job = SlurmJob(preset=preset_file, name=loaded.run.name, output_dir=str(output_dir.resolve()),
                   workdir=os.getcwd(), nodes=nodes, gpus_per_node=gpus_per_node, partition=partition,
                   time=time_limit, account=account, overrides=list(overrides), port=port)
    path = script_path or default_script_path(output_dir, loaded.run.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(sbatch_script(job), encoding="utf-8")
        path.chmod(0o755)
    except OSError as e:
        fail(f"{path}: cannot write the script ({e.strerror or e})")
    result = {"script": str(path), "run_dir": f"{job.output_dir}/{job.name}-slurm-<job id>", "nodes": nodes,
              "gpus_per_node": gpus_per_node, "processes": nodes * loaded.launch.nproc_per_node, "job_id": None}
    if submit:
        proc = subprocess.run([sbatch, str(path)], check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            why = " ".join((proc.stderr or proc.stdout).split()) or f"exit code {proc.returncode}"
            fail(f"sbatch {path}: {why}", code=EXIT_FAILED)
        words = proc.stdout.split()
        result["job_id"] = words[-1] if words and words[-1].isdigit() else proc.stdout.strip()
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(str(path))  # stdout: the path alone, for scripts; the rest on stderr
    click.echo(f"  {nodes} nodes x {loaded.launch.nproc_per_node} processes, run directory {result['run_dir']}",
               err=True)
    if submit:
        click.echo(f"  submitted: job {result['job_id']} (output: slurm-{job.name}-{result['job_id']}.out)", err=True)
    else:
        click.echo(f"  submit with: sbatch {path}", err=True)

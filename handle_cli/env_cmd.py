"""``handle env``: what this environment can run (versions, CUDA/NCCL, backends, plugins), and
``--check-dist N``: a real N-process all-reduce under torchrun.

torch is imported inside the command only; deepspeed is never imported (its version comes from the package
metadata: importing it takes seconds and prints).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from handle_cli.common import fail
from torch_handle.common.text import one_line

ENV_VARS = ("HANDLE_LOAD_PLUGINS", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME",
            "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def torch_info() -> dict[str, Any]:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - report, do not crash
        return {"version": None, "error": one_line(e)}
    info: dict[str, Any] = {"version": torch.__version__, "cuda_build": torch.version.cuda,
                            "hip_build": getattr(torch.version, "hip", None), "threads": torch.get_num_threads()}
    cuda = torch.cuda.is_available()
    info["cuda_available"] = cuda
    info["cuda_devices"] = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["cuda_devices"].append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                                         "capability": f"{p.major}.{p.minor}"})
        info["cudnn"] = torch.backends.cudnn.version()
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    nccl_version = None
    try:
        if torch.cuda.is_available() or torch.version.cuda:
            v = torch.cuda.nccl.version()
            nccl_version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - a build without NCCL
        nccl_version = None
    info["nccl_version"] = nccl_version
    available = dist.is_available()
    info["distributed"] = available
    info["backends"] = {
        "gloo": available and dist.is_gloo_available(),
        "nccl": available and dist.is_nccl_available(),
        "mpi": available and dist.is_mpi_available(),
        "ucc": available and bool(getattr(dist, "is_ucc_available", lambda: False)()),
    }
    info["default_backend"] = "nccl" if cuda and info["backends"]["nccl"] else "gloo"
    return info


def plugins_info() -> dict[str, Any]:
    from torch_handle.registry import get_registry

    reg = get_registry()
    return {
        "loaded": sorted(n for n, i in reg.plugins.items() if i.status == "loaded"),
        "failed": [{"name": n, "distribution": i.distribution, "error": i.error}
                   for n, i in sorted(reg.plugins.items()) if i.status == "failed"],
        "skipped": sorted(reg.skipped),
    }


def collect_env() -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable, "prefix": sys.prefix},
        "platform": platform.platform(),
        "torch_handle": _version("torch-handle"),
        "torch": torch_info(),
        "deepspeed": _version("deepspeed"),
        "cpu": {"count": os.cpu_count(), "usable": usable, "machine": platform.machine()},
        "plugins": plugins_info(),
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


def env_text(info: dict[str, Any]) -> list[str]:
    t = info["torch"]
    rows = [("python", f"{info['python']['version']} ({info['python']['executable']})"),
            ("platform", info["platform"]),
            ("torch-handle", info["torch_handle"] or "not installed")]
    if t.get("version") is None:
        rows.append(("torch", f"cannot be imported: {t.get('error')}"))
    else:
        rows.append(("torch", t["version"]))
    rows.append(("deepspeed", info["deepspeed"] or "not installed"))
    if t.get("version") is not None:
        if t["cuda_available"]:
            devs = ", ".join(f"{d['index']}: {d['name']} ({d['memory_bytes'] / 2**30:.0f} GiB)"
                             for d in t["cuda_devices"])
            rows.append(("CUDA", f"{t['cuda_build']}, {len(t['cuda_devices'])} device(s): {devs}"))
        else:
            why = f"built for CUDA {t['cuda_build']}, but no device is visible" if t["cuda_build"] \
                else "torch is a CPU build"
            rows.append(("CUDA", f"not available ({why})"))
        rows.append(("NCCL", t["nccl_version"] or "not available"))
        rows.append(("backends", ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in t["backends"].items())
                     + f"; default {t['default_backend']}"))
    cpu = info["cpu"]
    rows.append(("CPUs", f"{cpu['count']} ({cpu['usable']} usable by this process), {cpu['machine']}"))
    p = info["plugins"]
    text = f"{len(p['loaded'])} loaded ({', '.join(p['loaded'])}), {len(p['failed'])} failed"
    if p["failed"]:
        text += ": " + "; ".join(f"{f['name']}: {f['error']}" for f in p["failed"])
    if p["skipped"]:
        text += f"; not loaded (HANDLE_LOAD_PLUGINS): {', '.join(p['skipped'])}"
    rows.append(("plugins", text))
    for k, v in info["env"].items():
        rows.append((k, repr(v)))
    return [f"{k:<13} {v}" for k, v in rows]


# ---------------------------------------------------------------------------------------------------------------
# --check-dist N
# ---------------------------------------------------------------------------------------------------------------


def check_dist(nproc: int, backend: str = "auto", timeout_s: float = 120.0, *, nnodes: int = 1, node_rank: int = 0,
               rdzv_endpoint: str = "") -> dict[str, Any]:
    """Run ``handle_cli.env_check`` on ``nproc`` processes with torchrun; never leaves a process behind.

    On several nodes (``nnodes > 1``) every node runs this with its own ``node_rank`` and the same
    ``rdzv_endpoint`` (``host:port`` of node 0, which hosts the static rendezvous, as ``handle run`` does); the
    all-reduce then spans ``nproc * nnodes`` processes, and each node reports the verdict all of them agreed on.

    Returns a dict with ``ok``, ``wall_s``, ``returncode``, the workers' result (when this node's first rank got
    that far) and, on failure, ``error`` and the tail of the output.
    """
    from torch_handle.launch.probe import run_job, torchrun_command

    from handle_cli.env_check import MARKER

    args = ["--backend", backend, "--timeout", str(max(10, int(timeout_s)))]
    cmd = torchrun_command("handle_cli.env_check", nproc, args, nnodes=nnodes, node_rank=node_rank,
                           rdzv_endpoint=rdzv_endpoint, rdzv_id="handle-env-check")
    with tempfile.TemporaryDirectory() as tmp:  # KeyboardInterrupt propagates, every process already stopped
        job = run_job(cmd, MARKER, Path(tmp) / "torchrun.log", timeout_s)
    result: dict[str, Any] = {"nproc": nproc, "nnodes": nnodes, "node_rank": node_rank, "ok": False,
                              "wall_s": round(job.wall_s, 3), "returncode": job.returncode, "command": cmd}
    if job.records:
        result["result"] = job.records[-1]
    if job.timed_out:
        result["error"] = f"timed out after {timeout_s:.0f} s (workers stopped)"
    elif job.returncode != 0:
        result["error"] = f"torchrun exited {job.returncode}" + (f"; {job.errors[0]}" if job.errors else "")
    elif "result" not in result:
        result["error"] = "the node's first rank printed no result"
    elif not result["result"]["ok"]:
        r = result["result"]
        result["error"] = f"wrong all-reduce result: sum {r['sum']} (expected {r['expected']}), " \
                          f"4 MiB all-reduce {'ok' if r['large_allreduce_ok'] else 'wrong'}"
    else:
        result["ok"] = True
    if not result["ok"]:
        result["worker_errors"] = job.errors
        result["output_tail"] = "\n".join(job.output)[-3000:]
    return result


def check_text(r: dict[str, Any]) -> list[str]:
    if r["ok"]:
        w = r["result"]
        bw = f", ~{w['bus_bandwidth_mib_s']:,.0f} MiB/s bus bandwidth" if w.get("bus_bandwidth_mib_s") else ""
        nodes = (f" on {w['nnodes']} nodes ({', '.join(w['hosts'])}; this is node {r['node_rank']})"
                 if r.get("nnodes", 1) > 1 else "")
        return [f"check-dist: ok: {w['world_size']} processes{nodes}, backend {w['backend']} ({w['device']}), "
                f"all_reduce sum {w['sum']:g} == {w['expected']:g}",
                f"  init {w['init_s']:.2f} s, all_reduce {w['allreduce_small_s'] * 1e3:.2f} ms, "
                f"{w['allreduce_mib']:g} MiB all_reduce {w['allreduce_large_s'] * 1e3:.1f} ms{bw}; "
                f"total {r['wall_s']:.2f} s (torchrun start-up included)"]
    nodes = f" per node on {r['nnodes']} nodes (this is node {r['node_rank']})" if r.get("nnodes", 1) > 1 else ""
    lines = [f"check-dist: FAILED with {r['nproc']} processes{nodes} after {r['wall_s']:.2f} s: {r['error']}"]
    tail = r.get("output_tail", "").strip()
    if tail:
        lines += ["--- output (tail) ---", *tail.splitlines()[-40:]]
    return lines


@click.command("env")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--check-dist", "nproc", type=click.IntRange(1, 256), metavar="N",
              help="Also start N processes with torchrun that all-reduce a tensor and check the sum.")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto", show_default=True,
              help="Backend of --check-dist: auto = nccl with one GPU per process, else gloo.")
@click.option("--timeout", "timeout_s", type=click.IntRange(10, 3600), default=120, show_default=True,
              help="Seconds before --check-dist gives up (every process is stopped).")
@click.option("--nnodes", type=click.IntRange(1, 4096), default=1, show_default=True,
              help="With --check-dist: nodes taking part; run the same command on each with its --node-rank.")
@click.option("--node-rank", type=click.IntRange(0, 4095), default=0, show_default=True,
              help="With --check-dist --nnodes: this node's rank (0 on the node of --rdzv-endpoint).")
@click.option("--rdzv-endpoint", default="", metavar="HOST:PORT",
              help="With --check-dist --nnodes: node 0's address and a free port there (as launch.rdzv_endpoint).")
@click.option("--peak", is_flag=True,
              help="Measure this device's dense matmul peak (fp32, bf16, fp16; cached) for MFU.")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="CPU threads for --peak (default: torch's; a worker of an N-process CPU run has 1).")
@click.option("--refresh", is_flag=True, help="With --peak: measure again instead of reading the cache.")
def env(as_json: bool, nproc: int | None, backend: str, timeout_s: int, nnodes: int, node_rank: int,
        rdzv_endpoint: str, peak: bool, threads: int | None, refresh: bool) -> None:
    """Python, torch, DeepSpeed, CUDA/NCCL, CPUs, distributed backends and plugins of this environment.

    With --check-dist N: a real N-process run (torchrun, --standalone) that initialises the process group,
    all-reduces a tensor and verifies the sum; prints the result and the time, exits 1 on failure.

    With --peak: the best FLOP/s of large matrix products in fp32, bf16 and fp16 on this device (GPU 0, else
    the CPU with --threads threads), the denominator of the MFU that step events carry. Measured once (a few
    seconds) and cached per device, thread count and torch version.

    \b
    Examples:
      handle env                      # versions, backends, plugins
      handle env --check-dist 2       # can this machine run 2 processes?
      handle env --check-dist 1 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400   # on node0, and
      handle env --check-dist 1 --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400   # on the other node
      handle env --peak --threads 1   # the peak one rank of a 2-process CPU run sees
    """
    if peak:
        _peak(as_json, threads, refresh)
        return
    if nnodes > 1 or node_rank or rdzv_endpoint:
        _check_nodes(nproc, nnodes, node_rank, rdzv_endpoint)
    info = collect_env()
    if nproc is not None:
        try:
            info["check_dist"] = check_dist(nproc, backend, timeout_s, nnodes=nnodes, node_rank=node_rank,
                                            rdzv_endpoint=rdzv_endpoint)
        except KeyboardInterrupt:
            click.echo("check-dist: stopped", err=True)
            sys.exit(130)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
    else:
        for line in env_text(info):
            click.echo(line)
        if nproc is not None:
            for line in check_text(info["check_dist"]):
                click.echo(line)
    if nproc is not None and not info["check_dist"]["ok"]:
        sys.exit(1)


def _check_nodes(nproc: int | None, nnodes: int, node_rank: int, rdzv_endpoint: str) -> None:
    """The multi-node options, checked as ``[launch]`` checks them; a one-line error (exit 2) otherwise."""
    from torch_handle.errors import InvalidValue
    from torch_handle.config.schema import LaunchConfig

    if nproc is None:
        fail("--nnodes, --node-rank and --rdzv-endpoint go with --check-dist N (for example: handle env "
             "--check-dist 1 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400)")
    try:
        LaunchConfig(nproc_per_node=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint).check()
    except InvalidValue as e:
        option = {"node_rank": "--node-rank", "rdzv_endpoint": "--rdzv-endpoint"}.get(e.key, f"--{e.key}")
        fail(f"{option}: {e.message}".replace("nnodes", "--nnodes"))


def _peak(as_json: bool, threads: int | None, refresh: bool) -> None:
    import torch

    from torch_handle.observe.peak import DTYPES, cache_path, peak_flops

    if threads is not None:
        torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = peak_flops(device, refresh=refresh)
    if as_json:
        click.echo(json.dumps({**result, "cache": str(cache_path())}, indent=2))
        return
    how = "cached" if result["cached"] else "measured now"
    click.echo(f"dense matmul peak ({how}): {result['key']}")
    for name in DTYPES:
        value = result.get(name)
        click.echo(f"  {name:5} {value / 1e12:8.3f} TFLOP/s" if value else f"  {name:5}        - (not supported)")
    click.echo(f"cache: {cache_path()} (--refresh to measure again)")

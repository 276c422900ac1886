"""Resume under another strategy or world size: every built-in checkpoint format converted to one portable form.

The portable form of a checkpoint is a directory with

- ``dcp/``: a ``torch.distributed.checkpoint`` (DCP) checkpoint of ``{"model": model state dict, "optim":
  {"state": {FQN: {"step", "exp_avg", "exp_avg_sq"}}}}``, full (unsharded) tensors keyed by the parameters'
  fully qualified names, as ``torch.distributed.checkpoint.state_dict.get_state_dict`` names them;
- ``scheduler.pt``: the LR scheduler's state dict;
- ``meta.json`` (converted ones only): where it came from and what the conversion cost.

FSDP2 writes exactly this as its own format (``dcp/`` + ``scheduler.pt``), so its checkpoints need no conversion;
DCP reshards them on load for any world size. The other formats are converted once, on demand, by rank 0, into
``<checkpoint>/portable/`` (kept with the checkpoint, so a second resume reuses it):

- ``torch`` (single, ddp, scratch-ddp): ``model.pt`` + ``optim.pt`` (an optimizer state dict whose parameters are
  numbered in ``named_parameters()`` order): the numbers are mapped to names;
- ``torch-sharded`` (scratch-ddp with ``shard_optimizer``): ``model.pt`` + one ``optim-rank<R>.pt`` per rank,
  each listing the parameters it owns: the shards are merged;
- ``param-sharded`` (scratch-fsdp, ZeRO-2/3): one ``shard-rank<R>.pt`` per rank, per parameter its rows of
  dim 0 of the weights and AdamW state: the rows are joined in rank order; ``flat-sharded`` (scratch-fsdp before
  it sharded per parameter): per unit a slice of the unit's flat padded fp32 weights and AdamW state, joined and
  cut into the named parameters;
- ``deepspeed`` (ZeRO 1-3): DeepSpeed's own converter to its *universal checkpoint*
  (``deepspeed.checkpoint.ds_to_universal``, one directory per parameter with ``fp32.pt``, ``exp_avg.pt``,
  ``exp_avg_sq.pt`` and, for stages 1-2, ``step.pt``), then its per-parameter files are mapped to the names
  above; ZeRO-0 keeps a plain optimizer state dict in its model-states file, mapped like ``torch``.

Loading the portable form is each strategy's :meth:`~torch_handle.train.strategy.Strategy.load_portable`: the base
strategy (single, ddp, fsdp, unsharded scratch-ddp) with :func:`load_into` (DCP into ``get_state_dict``'s
sharded or full targets, then ``set_state_dict``); DeepSpeed and the sharded scratch-ddp with
:func:`read_portable` (every tensor, full, on every rank) and their own setters.

What is not carried over: a loss scaler (fp16; it starts again from its initial scale) and the optimizer's
hyperparameters other than the learning rate (they are the preset's, which a resume may not change).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from torch_handle.checkpoint.store import safe_load, verify_weights_only
from torch_handle.common.text import strategy_label
from torch_handle.errors import CheckpointError

log = logging.getLogger("torch_handle")

PORTABLE = "portable"
"""The converted form's directory inside a checkpoint (not listed in its manifest)."""
META = "meta.json"
"""Written last into a converted ``portable/``: ``source`` (the layout), ``seconds``, ``bytes``."""

StateByName = dict[str, dict[str, torch.Tensor]]


def portable_dir(ckpt_dir: Path, layout: dict[str, Any]) -> Path:
    """Where the portable form of the checkpoint ``ckpt_dir`` written with ``layout`` is (or will be)."""
    return Path(ckpt_dir) if layout.get("format") == "dcp" else Path(ckpt_dir) / PORTABLE


def describe(layout: dict[str, Any]) -> str:
    """``deepspeed ZeRO-2 on 2 ranks`` (what wrote a checkpoint, for messages)."""
    name = layout.get("strategy") or f"a {layout.get('format')} checkpoint"
    if layout.get("format") == "torch-sharded":
        name += " with its optimizer sharded"
    else:
        name = strategy_label(name, layout.get("zero_stage"))
    ranks = layout.get("world_size")
    return name + (f" on {ranks} rank{'s' if ranks != 1 else ''}" if ranks else "")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def ensure_portable(ckpt_dir: Path, layout: dict[str, Any], param_names: list[str]) -> dict[str, Any] | None:
    """Rank 0: convert the checkpoint to its portable form unless it is portable already or was converted before.

    Args:
        ckpt_dir: a finalized checkpoint directory.
        layout: its layout (:func:`torch_handle.checkpoint.store.read_layout`).
        param_names: the model's parameter names in ``named_parameters()`` order (shared parameters once): what
            ``torch``-format optimizer states are numbered by.

    Returns:
        ``{"seconds", "bytes", "cached"}`` of the conversion (``cached``: done by an earlier resume), or None for
        a ``dcp`` checkpoint.

    Raises:
        CheckpointError: an unknown format, files that do not match the model, or a library checkpoint that
            would run code when unpickled.
    """
    fmt = layout.get("format")
    if fmt == "dcp":
        return None
    ckpt_dir = Path(ckpt_dir)
    readers = {"torch": _from_torch, "torch-sharded": _from_torch_sharded, "param-sharded": _from_param_sharded,
               "flat-sharded": _from_flat_sharded, "deepspeed": _from_deepspeed}
    if fmt not in readers:
        raise CheckpointError(f"{ckpt_dir}: cannot convert a checkpoint of format {fmt!r} (known: dcp, "
                              f"{', '.join(readers)})")
    out = ckpt_dir / PORTABLE
    if (out / META).is_file():
        try:
            meta = json.loads((out / META).read_text(encoding="utf-8"))
            return {"seconds": float(meta["seconds"]), "bytes": int(meta["bytes"]), "cached": True}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged record: convert again
    tmp = ckpt_dir / f".{PORTABLE}-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    start = time.perf_counter()
    try:
        model, state, scheduler = readers[fmt](ckpt_dir, param_names, tmp)
        write_portable(tmp, model, state, scheduler)
        shutil.rmtree(tmp / "work", ignore_errors=True)
        seconds = time.perf_counter() - start
        size = dir_bytes(tmp)
        (tmp / META).write_text(json.dumps({"source": layout, "seconds": seconds, "bytes": size}, indent=1),
                                encoding="utf-8")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"seconds": seconds, "bytes": size, "cached": False}


def write_portable(directory: Path, model: dict[str, torch.Tensor], state: StateByName,
                   scheduler: dict[str, Any]) -> None:
    """Write a portable form into ``directory`` from one process (full tensors, keyed by name)."""
    import torch.distributed.checkpoint as dcp

    with warnings_off():
        dcp.save({"model": model, "optim": {"state": state}}, checkpoint_id=str(Path(directory) / "dcp"),
                 no_dist=True)
    torch.save(scheduler, Path(directory) / "scheduler.pt")


@contextlib.contextmanager
def warnings_off():
    """DCP warns that it "assumes the intent is to save in a single process": that is the intent here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        yield


def read_portable(portable: Path) -> tuple[dict[str, torch.Tensor], StateByName, dict[str, Any]]:
    """Every tensor of a portable form, full, in this process (no collective): ``(model state dict, optimizer
    state by parameter name, scheduler state dict)``. For strategies that set full values themselves (DeepSpeed's
    ``safe_set_full_*``, the sharded scratch-ddp); memory: the whole model and optimizer state, on every rank.

    Raises:
        CheckpointError: a missing or unreadable portable form.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    portable = Path(portable)
    try:
        reader = dcp.FileSystemReader(str(portable / "dcp"))
        metadata = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - any reason: one line naming the directory
        raise CheckpointError(f"{portable / 'dcp'}: not a readable DCP checkpoint ({type(e).__name__}: {e})") from None
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and k.startswith(("model.", "optim.state."))}
    with warnings_off():
        dcp.load(flat, storage_reader=reader, no_dist=True)
    model: dict[str, torch.Tensor] = {}
    state: StateByName = {}
    for key, value in flat.items():
        if key.startswith("model."):
            model[key[len("model."):]] = value
        else:
            name, _, item = key[len("optim.state."):].rpartition(".")
            state.setdefault(name, {})[item] = value
    return model, state, safe_load(portable / "scheduler.pt")


def load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer, portable: Path) -> None:
    """Load a portable form's model and optimizer state into ``model`` (plain, DDP or FSDP2) and its ``optimizer``
    (a ``torch.optim`` optimizer over its parameters). Collective: every rank calls it; DCP reads only the slices
    a rank's (sharded) tensors need. The optimizer keeps its own hyperparameters (param groups)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # initialises an empty optimizer state (a step, lr 0)
    state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    with warnings_off():
        dcp.load(state, checkpoint_id=str(Path(portable) / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": optim_sd["param_groups"]})


def load_schedule(optimizer: Any, scheduler: Any, state: dict[str, Any]) -> None:
    """Restore the LR scheduler and put its current learning rates into the optimizer's groups (where a native
    optimizer load would have put the saved ones)."""
    scheduler.load_state_dict(state)
    for group, lr, base in zip(optimizer.param_groups, scheduler.get_last_lr(), scheduler.base_lrs):
        group["lr"] = lr
        group["initial_lr"] = base


# ---------------------------------------------------------------------------------------------------------------
# The formats
# ---------------------------------------------------------------------------------------------------------------


def _by_name(optim_state: dict[Any, dict[str, Any]], index_to_name: dict[int, str], where: Path,
             model: dict[str, torch.Tensor]) -> StateByName:
    out: StateByName = {}
    for index, entry in optim_state.items():
        name = index_to_name.get(int(index))
        if name is None:
            raise CheckpointError(f"{where}: optimizer state of parameter #{index}, but the model has "
                                  f"{len(index_to_name)} parameters")
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and name in model and value.shape != model[name].shape:
                raise CheckpointError(f"{where}: {key} of {name} has shape {tuple(value.shape)}, the parameter "
                                      f"{tuple(model[name].shape)}")
        out[name] = {k: v if torch.is_tensor(v) else torch.tensor(float(v)) for k, v in entry.items()}
    return out


def _from_torch(ckpt_dir: Path, param_names: list[str], work: Path):
    model = safe_load(ckpt_dir / "model.pt")
    saved = safe_load(ckpt_dir / "optim.pt")
    optimizer = saved["optimizer"]
    order = [i for g in optimizer["param_groups"] for i in g["params"]]
    if len(order) != len(param_names):
        raise CheckpointError(f"{ckpt_dir / 'optim.pt'}: {len(order)} parameters, the model has {len(param_names)}")
    index_to_name = {int(i): param_names[k] for k, i in enumerate(order)}
    return model, _by_name(optimizer["state"], index_to_name, ckpt_dir / "optim.pt", model), saved["scheduler"]


def _from_torch_sharded(ckpt_dir: Path, param_names: list[str], work: Path):
    model = safe_load(ckpt_dir / "model.pt")
    state: StateByName = {}
    scheduler = None
    shards = sorted(ckpt_dir.glob("optim-rank*.pt"))
    for path in shards:
        shard = safe_load(path)
        owned = shard.get("owned")
        if owned is None:
            raise CheckpointError(f"{path}: no list of owned parameters (written before cross-strategy resume "
                                  f"existed): resume with the same strategy and world size")
        inner = shard["optimizer"]["inner"]
        order = [i for g in inner["param_groups"] for i in g["params"]]
        index_to_name = {int(i): param_names[owned[k]] for k, i in enumerate(order)}
        state.update(_by_name(inner["state"], index_to_name, path, model))
        scheduler = scheduler or shard["scheduler"]
    if scheduler is None:
        raise CheckpointError(f"{ckpt_dir}: no optim-rank*.pt files")
    return model, state, scheduler


def _shard_files(ckpt_dir: Path) -> list[dict[str, Any]]:
    """scratch-fsdp's ``shard-rank<R>.pt`` files, read in rank order."""
    files = sorted(ckpt_dir.glob("shard-rank*.pt"), key=lambda f: int(f.stem[len("shard-rank"):]))
    if not files:
        raise CheckpointError(f"{ckpt_dir}: no shard-rank*.pt files")
    shards = [safe_load(f) for f in files]
    if shards[0]["world_size"] != len(shards):
        raise CheckpointError(f"{ckpt_dir}: {len(shards)} shard files, written by {shards[0]['world_size']} ranks")
    return shards


def _from_param_sharded(ckpt_dir: Path, param_names: list[str], work: Path):
    """scratch-fsdp: rank r's file holds, per parameter, rows ``[start, start + len)`` of dim 0 of the weights,
    ``exp_avg`` and ``exp_avg_sq`` (trainable ones only), so the ranks' rows concatenated are the full tensors."""
    shards = _shard_files(ckpt_dir)
    model: dict[str, torch.Tensor] = dict(shards[0]["buffers"])
    state: StateByName = {}
    for name, entry in shards[0]["params"].items():
        def joined(key: str) -> torch.Tensor:
            return torch.cat([shard["params"][name][key] for shard in shards]).reshape(entry["shape"]).clone()

        model[name] = joined("shard")
        if "step" in entry:
            state[name] = {"step": entry["step"].clone(), **{k: joined(k) for k in ("exp_avg", "exp_avg_sq")}}
    for key, name in shards[0]["aliases"].items():
        model[key] = model[name]
    return model, state, shards[0]["scheduler"]


def _from_flat_sharded(ckpt_dir: Path, param_names: list[str], work: Path):
    """scratch-fsdp: rank r's file holds elements ``r * padded / N : (r + 1) * padded / N`` of each unit's flat
    vector (parameters end to end, then zero padding) of the weights, ``exp_avg`` and ``exp_avg_sq``."""
    shards = _shard_files(ckpt_dir)
    model: dict[str, torch.Tensor] = dict(shards[0]["buffers"])
    state: StateByName = {}
    for i, unit in enumerate(shards[0]["units"]):
        def joined(key: str) -> torch.Tensor:
            return torch.cat([shard["units"][i][key] for shard in shards])[:unit["numel"]]

        master = joined("master")
        moments = {key: joined(key) for key in ("exp_avg", "exp_avg_sq") if key in unit}
        offset = 0
        for name, shape in zip(unit["params"], unit["shapes"]):
            n = torch.Size(shape).numel()
            model[name] = master[offset:offset + n].reshape(shape).clone()
            if moments:
                state[name] = {"step": unit["step"].clone(),
                               **{k: v[offset:offset + n].reshape(shape).clone() for k, v in moments.items()}}
            offset += n
    for key, name in shards[0]["aliases"].items():
        model[key] = model[name]
    return model, state, shards[0]["scheduler"]


def deepspeed_safe_globals() -> list[Any]:
    """The plain data classes DeepSpeed pickles into its checkpoints (nothing callable with side effects): what
    :func:`torch_handle.checkpoint.store.verify_weights_only` must allow before DeepSpeed unpickles them itself."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _ds_load(path: Path) -> Any:
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        return safe_load(path)


def _from_deepspeed(ckpt_dir: Path, param_names: list[str], work: Path):
    """DeepSpeed's ``ds_to_universal`` (its offline converter, run in-process with one worker), then the mapping
    of its per-parameter files to names; ZeRO-0 (no partitioned optimizer files) is read directly."""
    ds_dir = ckpt_dir / "ds"
    files = sorted(ds_dir.rglob("*.pt"))
    verify_weights_only(files, deepspeed_safe_globals())  # ds_to_universal unpickles with weights_only=False
    model_files = sorted(ds_dir.glob("*model_states.pt"))
    if not model_files:
        raise CheckpointError(f"{ds_dir}: no DeepSpeed model-states file")
    states = _ds_load(model_files[0])
    module = states["module"]
    shared = states.get("shared_params") or {}
    if not list(ds_dir.glob("*optim_states.pt")):  # ZeRO-0: the optimizer state is in the model-states file
        return _from_deepspeed_zero0(model_files[0], states, param_names)

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    universal = work / "work" / "ds"
    args = argparse.Namespace(input_folder=str(ds_dir), output_folder=str(universal), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # universal_checkpoint_info: we never wrote one
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        ds_to_universal(args)
    log.info("ds_to_universal: %s", " | ".join(ln.strip() for ln in output.getvalue().splitlines()
                                                if ln.startswith("***")))
    steps: list[Any] = []
    zero3 = list(ds_dir.glob("zero_pp_rank_*_model_states.pt"))
    if zero3:  # ZeRO-3's universal files carry no step: take each sub-group's from the optimizer file
        optim = _ds_load(min(ds_dir.glob("*optim_states.pt")))["optimizer_state_dict"]
        steps = [s.get("step") for s in optim["optimizer_state_dict"]["state"].values()]
    model: dict[str, torch.Tensor] = {}
    state: StateByName = {}
    for group, shapes in enumerate(states["param_shapes"]):
        for name, shape in shapes.items():
            folder = universal / "zero" / name
            entry = {}
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                value = safe_load(folder / f"{key}.pt")
                value = value["param"] if isinstance(value, dict) else value
                if value.numel() != torch.Size(shape).numel():
                    raise CheckpointError(f"{folder / key}.pt: {value.numel()} elements, {name} has shape "
                                          f"{tuple(shape)}")
                entry[key] = value.reshape(shape).clone()
            step = safe_load(folder / "step.pt") if (folder / "step.pt").is_file() else (
                steps[group] if group < len(steps) else None)
            if step is None:
                raise CheckpointError(f"{folder}: no optimizer step count")
            model[name] = entry.pop("fp32")
            state[name] = {"step": torch.as_tensor(step, dtype=torch.float32).reshape(()), **entry}
    for name, value in module.items():  # buffers, and the second name of shared (tied) parameters
        if name not in model:
            model[name] = model[shared[name]] if name in shared else value
    return model, state, states["lr_scheduler"]


def _from_deepspeed_zero0(path: Path, states: dict[str, Any], param_names: list[str]):
    """ZeRO-0: ``optimizer`` in the model-states file is torch AdamW's state dict (fp32), or (fp16/bf16) DeepSpeed's
    FP16 optimizer's, which wraps it with the fp32 master weights: per parameter (``fp32_groups``, unfused) or one
    flat tensor per group (``fp32_groups_flat``, fused, over the group's parameters in order)."""
    module = dict(states["module"])
    optimizer = states.get("optimizer")
    if not isinstance(optimizer, dict):
        raise CheckpointError(f"{path}: no optimizer state")
    if "state" in optimizer:  # fp32: the torch optimizer itself, over the module's parameters
        inner, masters = optimizer, None
    elif "optimizer_state_dict" in optimizer:
        inner = optimizer["optimizer_state_dict"]
        if "fp32_groups" in optimizer:
            masters = [t for group in optimizer["fp32_groups"] for t in group]
        elif "fp32_groups_flat" in optimizer:
            masters = []
        else:
            raise CheckpointError(f"{path}: DeepSpeed's FP16 optimizer state without fp32 master weights")
    else:
        raise CheckpointError(f"{path}: an optimizer state of unknown layout (keys {sorted(optimizer)[:5]})")
    shapes = [module[name].shape for name in param_names]
    if masters == []:  # fused: one flat master (and one optimizer state entry) per group: split it by parameter
        if len(inner["param_groups"]) != 1:
            raise CheckpointError(f"{path}: {len(inner['param_groups'])} fused parameter groups (one is convertible)")
        flat = optimizer["fp32_groups_flat"][0]
        entry = inner["state"].get(inner["param_groups"][0]["params"][0], {})
        if flat.numel() != sum(shape.numel() for shape in shapes):
            raise CheckpointError(f"{path}: {flat.numel()} fp32 master elements, the model has "
                                  f"{sum(shape.numel() for shape in shapes)}")
        split: dict[int, dict[str, Any]] = {}
        offset = 0
        for k, shape in enumerate(shapes):
            masters.append(flat.narrow(0, offset, shape.numel()))
            split[k] = {key: v.narrow(0, offset, shape.numel()).reshape(shape) if torch.is_tensor(v) and v.dim()
                        else v for key, v in entry.items()}
            offset += shape.numel()
        inner = {"state": split, "param_groups": [{"params": list(range(len(shapes)))}]}
    order = [i for g in inner["param_groups"] for i in g["params"]]
    if len(order) != len(param_names) or (masters is not None and len(masters) != len(param_names)):
        raise CheckpointError(f"{path}: {len(order)} parameters in the optimizer state, the model has "
                              f"{len(param_names)}")
    if masters is not None:  # the fp32 masters, not the module's 16-bit weights
        # tied parameters: names whose tensor shares the storage of a parameter's (torch.save keeps the sharing)
        tied = {name: source for name in module for source in param_names
                if name != source and name not in param_names and module[name].data_ptr() == module[source].data_ptr()}
        tied.update(states.get("shared_params") or {})
        for name, master in zip(param_names, masters):
            module[name] = master.reshape(module[name].shape).float()
        for name, source in tied.items():
            module[name] = module[source]
    index_to_name = {int(i): param_names[k] for k, i in enumerate(order)}
    return module, _by_name(inner["state"], index_to_name, path, module), states["lr_scheduler"]

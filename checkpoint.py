"""Training checkpoints (megatron-core dist_checkpointing plus a JSON run state) and the run directory's files.

    <checkpoint.dir>/step_<N>/        a complete checkpoint after optimizer step N
        model_optim/                  model and distributed-optimizer shards (`dp_reshardable`: reshards over DP only)
        run_state.json                `RunState`: step, δ, sampler, scheduler, config, W&B id, checksums, digests
        rng/rank_<r>.pt               the RNG states of rank r
    <checkpoint.dir>/step_<N>.tmp/    a save in progress, renamed to step_<N> once every rank has written
    <checkpoint.dir>/.lock            the run using the directory (`lock_run_dir`); config.json: its resolved config

`save` writes a step (collective); a resume reads its run state (`read_run_state`), checks the config (`check_resume`,
RESUME_RULES) and restores it (`load`, after `check_complete`). Details and reasons: docs/DESIGN.md, "Checkpoints".
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import math
import os
import random
import re
import shutil
import socket
import sys
import traceback
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import config as config_mod
import distributed
import model_hub
from backend import megatron_patches

try:  # a dependency of wandb (requirements.txt); zlib's crc32 where it is absent
    import xxhash
except ImportError:
    xxhash = None

STEP_RE = re.compile(r"^step_(\d+)$")
TMP_RE = re.compile(r"^step_(\d+)\.tmp$")
OLD_RE = re.compile(r"^step_(\d+)\.old$")  # a checkpoint being replaced by a save of the same step
SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # model_optim/__<rank>_<i>.distcp: the shard files rank <rank> wrote
RUN_STATE_FILE = "run_state.json"
MODEL_OPTIM_DIR = "model_optim"
MEGATRON_METADATA_FILE = "metadata.json"  # megatron-core dist_checkpointing's config file in model_optim/
RNG_DIR = "rng"
LOCK_FILE = ".lock"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}  # docs/DESIGN.md, "Optimizer format"
EXPORT_INFO_FILE = "omni_mpo_export.json"  # an export's provenance; marks OUT_DIR as one a later export may replace
CHECKSUM_ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"
FULL_BYTES = 1 << 20  # free space below which a file system counts as full (a failed write is then ENOSPC)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or restored."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(value) -> list:
    """Every rank's `value`, in rank order."""
    if _world() == 1:
        return [value]
    out: list = [None] * _world()
    dist.all_gather_object(out, value)
    return out


# ---- Directory layout and lock ----------
def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step}"


def _step_folders(ckpt_dir: str | Path) -> list[tuple[int, Path, bool]]:
    """Every `step_<N>` folder in `ckpt_dir`: ascending (step, path, complete: it holds run_state.json and
    model_optim/). An incomplete one is damaged: a save is renamed from step_<N>.tmp only once complete."""
    root = Path(ckpt_dir)
    return sorted((int(m.group(1)), p, (p / RUN_STATE_FILE).is_file() and (p / MODEL_OPTIM_DIR).is_dir())
                  for p in (root.iterdir() if root.is_dir() else []) if (m := STEP_RE.match(p.name)) and p.is_dir())


def list_checkpoints(ckpt_dir: str | Path, report: bool = True) -> list[tuple[int, Path]]:
    """Complete checkpoints in `ckpt_dir`: ascending (step, path); with `report`, one line per damaged folder."""
    found = []
    for n, p, complete in _step_folders(ckpt_dir):
        if complete:
            found.append((n, p))
        elif report:
            print(f"checkpoint: ignoring {p}: no {RUN_STATE_FILE} or {MODEL_OPTIM_DIR}/ (damaged)", file=sys.stderr)
    return found


def move_away(path: str | Path) -> str:
    """The way out of a damaged checkpoint `path`, naming the previous complete checkpoint when there is one."""
    m = STEP_RE.match(Path(path).name)
    older = [p for n, p in list_checkpoints(Path(path).parent, report=False) if m and n < int(m.group(1))]
    if not older:
        return f"move {path} away (e.g. to {path}.damaged); with no earlier complete checkpoint the run starts afresh"
    return f"move {path} away (e.g. to {path}.damaged) to resume from the previous checkpoint, {older[-1]}"


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The highest complete `step_<N>` in `ckpt_dir`, or None; rank 0's answer on every rank. A damaged `step_<N>`
    above it is a CheckpointError (resuming below it, or afresh, would write over it); one below it is reported."""
    found, error = [], None
    if _rank() == 0:
        folders = _step_folders(ckpt_dir)
        if folders and not folders[-1][2]:
            bad = folders[-1][1]
            error = f"{bad} has no {RUN_STATE_FILE} or no {MODEL_OPTIM_DIR}/ (a damaged checkpoint): {move_away(bad)}"
        else:
            found = list_checkpoints(ckpt_dir)
    path, error = distributed.from_rank0((str(found[-1][1]) if found else None, error))
    if error is not None:
        raise CheckpointError(error)
    return Path(path) if path is not None else None


def resume_path(ckpt_dir: str | Path, resume: bool) -> Path | None:
    """The checkpoint to resume from, or None; refuses an existing one when `resume` is False."""
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None and not resume:
        raise CheckpointError(f"checkpoint.dir = {ckpt_dir} holds {latest.name} and checkpoint.resume = false: use "
                              "another checkpoint.dir, or checkpoint.resume=true")  # fmt: skip
    return latest


def prune(ckpt_dir: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the `keep_last` newest complete checkpoints (0 keeps all); return the removed paths."""
    old = [p for _, p in list_checkpoints(ckpt_dir)[:-keep_last]] if keep_last > 0 else []
    for p in old:
        shutil.rmtree(p)
    return old


_held_lock: tuple[Path, int] | None = None  # (run dir, open fd) of this process's lock: kept open until it exits
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}  # file systems without flock support


def _lock_holder(lock: Path) -> str:
    """The holder of `lock` in words, from the JSON it wrote there."""
    try:
        info = json.loads(lock.read_text())
        job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
        return f"pid {info['pid']} on host {info['host']}{job}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):  # being written, or not by this code
        return "holder unknown"


def _take_lock(root: Path) -> str | None:
    """Rank 0's part of `lock_run_dir`: the error line, or None once the lock is held."""
    global _held_lock
    if _held_lock is not None and _held_lock[0] == root.resolve():
        return None
    lock, fd = root / LOCK_FILE, None
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's content stays readable
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if fd is None or e.errno not in _NO_FLOCK:
            if fd is not None:
                os.close(fd)
            if isinstance(e, BlockingIOError):
                return (f"checkpoint.dir = {root} is in use by another run ({_lock_holder(lock)}; lock file {lock}): "
                        "wait until it ends, or use another checkpoint.dir")  # fmt: skip
            return f"checkpoint.dir = {root}: cannot lock {lock}: {e.strerror}"
        print(f"checkpoint: the file system of {root} does not support file locks ({e.strerror}): nothing stops a "
              "second run from using this checkpoint.dir at the same time", file=sys.stderr)  # fmt: skip
    info = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}  # fmt: skip
    with contextlib.suppress(OSError):  # e.g. a full disk: the lock holds without its description
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    if _held_lock is not None:  # another run dir before (a tool driving several runs): let that one go
        os.close(_held_lock[1])
    _held_lock = (root.resolve(), fd)
    return None


def lock_run_dir(ckpt_dir: str | Path) -> None:
    """Claim `ckpt_dir` (collective): rank 0 flocks <ckpt_dir>/.lock until exit, then `remove_unfinished_saves`."""
    root, error = Path(ckpt_dir), None
    if _rank() == 0 and (error := _take_lock(root)) is None:
        try:
            remove_unfinished_saves(root)
        except OSError as e:
            error = f"checkpoint.dir = {root}: cannot remove an unfinished save: {e}"
    if (error := distributed.from_rank0(error)) is not None:
        raise CheckpointError(error)


def remove_unfinished_saves(ckpt_dir: str | Path) -> list[Path]:
    """After a run killed in `save` (lock held): `step_<N>.old` back to a missing step_<N>, then remove .tmp / .old."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    restored = []
    for p in sorted(root.iterdir()):
        m = OLD_RE.match(p.name)
        if m and p.is_dir() and not step_dir(root, int(m.group(1))).exists():
            p.rename(step_dir(root, int(m.group(1))))
            restored.append(p.name)
    if restored:
        print(f"checkpoint: restored {len(restored)} checkpoint(s) that a replacing save of an earlier run left "
              f"renamed in {root}: {', '.join(restored)}", file=sys.stderr)  # fmt: skip
    stale = sorted(p for p in root.iterdir() if (TMP_RE.match(p.name) or OLD_RE.match(p.name)) and p.is_dir())
    for p in stale:
        shutil.rmtree(p)
    if stale:
        print(f"checkpoint: removed {len(stale)} unfinished save(s) of an earlier run in {root}: "
              f"{', '.join(p.name for p in stale)}", file=sys.stderr)  # fmt: skip
    return stale


# ---- RNG states and state dicts ----------
def rng_state() -> dict[str, Any]:
    """This rank's RNG states (python, numpy, torch, CUDA, megatron's tracker) in `weights_only` loadable types."""
    from megatron.core import tensor_parallel

    np_state = np.random.get_state()
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                             "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
                             "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()` output (CUDA only where CUDA is available and was when saved)."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["megatron_tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    if "cuda" in state and torch.cuda.is_available():
        for i, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):  # the devices this node has
            torch.cuda.set_rng_state(cuda_state, i)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under megatron-core's DDP / Float16Module wrappers (their keys would gain a `module.` prefix)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(model, (DistributedDataParallel, Float16Module)):
        model = model.module
    return model


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))  # a ChainedOptimizer's, or [optimizer]


def model_sharded_state_dict(model: torch.nn.Module) -> dict:
    """megatron-core sharded state dict of `model`; for a plain module (omni_model.OmniModel), its children's; with
    LoRA adapters only theirs (lora.sharded_state_dict: the base weights are model.hf_path's, read at every start)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import sharded_state_dict_default

    import lora

    module = unwrap(model)
    if lora.has_adapters(module):
        return lora.sharded_state_dict(module)
    if hasattr(module, "sharded_state_dict"):
        return module.sharded_state_dict()
    assert all("." in k for k in module.state_dict(keep_vars=True)), "tensors outside the child modules"
    out: dict = {}
    for name, child in module.named_children():
        # plain modules (the sound encoder) are replicated over TP: their replica ids need the TP group, which
        # megatron-core 0.19.2 does not default to (every TP rank would claim replica 0)
        out.update(sharded_state_dict_default(child, prefix=f"{name}.",
                                              tp_group=parallel_state.get_tensor_model_parallel_group()))
    return out


def load_model_state(model: torch.nn.Module, state: dict) -> None:
    """`state` (a loaded model part) into `model`: every tensor of it, or with LoRA every adapter tensor (the base
    weights stay as loaded from model.hf_path)."""
    import lora

    module = unwrap(model)
    if not lora.has_adapters(module):
        module.load_state_dict(state)
        return
    result = module.load_state_dict(state, strict=False)
    adapters = {n for n, p in module.named_parameters() if p.requires_grad}
    assert not result.unexpected_keys and adapters <= set(state), (result.unexpected_keys, adapters - set(state))


def _sharded_state_dict(model, optimizer, is_loading: bool) -> dict:
    model_sd = model_sharded_state_dict(model)
    out = {"model": model_sd}
    if optimizer is not None:
        out["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return out


# ---- Save ----------
def write_atomic(path: str | Path, data: bytes) -> None:
    """`data` to `path` through the temporary `.<name>.tmp` beside it, synced and renamed once complete: a reader
    never sees half of it; on an OSError (a full disk) the temporary file is removed and the error raised."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def free_space(directory: str | Path) -> str:
    """`N bytes free on DIRECTORY`, with `: the file system is full` below FULL_BYTES."""
    try:
        n = shutil.disk_usage(directory).free
    except OSError:
        return f"free space on {directory} unknown"
    return f"{n} bytes free on {directory}" + (": the file system is full" if n < FULL_BYTES else "")


RESOLVED_CONFIG_FILE = "config.json"  # the run's resolved config, beside its step_<N>/ folders


def write_resolved_config(cfg, rank: int, previous: tuple[int, dict] | None = None) -> Path:
    """Rank 0 writes <checkpoint.dir>/config.json, first `previous` = (N, step_N's config) to config.step_<N>.json;
    each with `write_atomic` (never a partial file). Collective: a failed write (a full disk) is a CheckpointError on
    every rank. Returns the path."""
    path = Path(cfg.checkpoint.dir) / RESOLVED_CONFIG_FILE
    files = [(path, config_mod.to_dict(cfg))]
    if previous is not None:
        files.insert(0, (path.with_name(f"config.step_{previous[0]}.json"), previous[1]))
    failed = None
    if rank == 0:
        for target, content in files:
            try:
                write_atomic(target, (json.dumps(content, indent=1) + "\n").encode())
            except OSError as e:
                failed = (f"cannot write {target}: {type(e).__name__}: {e} ({free_space(path.parent)}); "
                          "make room, then start the run again")  # fmt: skip
                break
    if failed := distributed.from_rank0(failed):
        raise CheckpointError(failed)
    return path


def write_failure(e: BaseException, directory: str | Path) -> OSError | None:
    """The OSError behind a failed write `e` into `directory` (also safetensors' and torch's zip writer's), or None."""
    while e.__cause__ is not None:
        e = e.__cause__
    if isinstance(e, OSError):
        return e
    if type(e).__name__ == "SafetensorError" and (m := re.search(r"\(os error (\d+)\)", str(e))):
        return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    if isinstance(e, RuntimeError) and "inline_container.cc" in str(e):
        if free_space(directory).endswith("full"):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return OSError(f"torch's file writer failed ({str(e).splitlines()[0][:200]})")
    return None


def file_checksum(path: str | Path, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Hex digest of the file at `path`: "xxh3_64" (xxhash) or "crc32" (zlib), read in 16 MiB blocks."""
    h = xxhash.xxh3_64() if algorithm == "xxh3_64" else None
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(min(os.fstat(f.fileno()).st_size + 1, 1 << 24))  # small files: no 16 MiB to zero
        view = memoryview(buf)
        while n := f.readinto(buf):
            if h is not None:
                h.update(view[:n])
            else:
                crc = zlib.crc32(view[:n], crc)
    return h.hexdigest() if h is not None else f"{crc:08x}"


def _own_files(tmp: Path) -> list[str]:
    """The files of the save `tmp` this rank wrote: its shards and RNG file (rank 0: megatron's other files too)."""
    r = _rank()
    names = [f"{RNG_DIR}/rank_{r:05d}.pt"]
    for p in sorted((tmp / MODEL_OPTIM_DIR).iterdir()):
        m = SHARD_RE.match(p.name)
        if p.is_file() and (int(m.group(1)) == r if m else r == 0):
            names.append(f"{MODEL_OPTIM_DIR}/{p.name}")
    return names


def _raise_if_failed(error: BaseException | None, step: int, ckpt_dir, tmp: Path, sums: dict | None = None) -> dict:
    """Collective: when a rank failed, remove `tmp` and raise one CheckpointError on every rank; else merge `sums`.
    A failed write (`write_failure`: a full disk, a quota) is named first; the others' errors follow from it (a peer's
    failure as seen by megatron or gloo). Only when no rank failed to write, a rank's own error is a bug: it prints
    its traceback."""
    written = None
    if error is not None:
        written = write_failure(error, ckpt_dir)
        error = written or error
        while error.__cause__ is not None:
            error = error.__cause__
    gathered = _gather((None if error is None else f"{type(error).__name__}: {error}", written is not None, sums or {}))
    failed = [(r, m, w) for r, (m, w, _) in enumerate(gathered) if m is not None]
    if not failed:
        return {k: v for _, _, rank_sums in gathered for k, v in rank_sums.items()}
    if error is not None and written is None and not any(w for _, _, w in failed):
        print(f"checkpoint: rank {_rank()}: saving step {step} failed with an unexpected error:", file=sys.stderr)
        traceback.print_exception(error, file=sys.stderr)
    free = free_space(ckpt_dir)  # before the .tmp goes: the space the failed save saw
    _barrier()
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    rank, message, _ = min(failed, key=lambda f: (not f[2], f[1].startswith("CheckpointException"), f[0]))
    who = f"rank {rank}: " if _world() > 1 else ""
    raise CheckpointError(f"saving step {step} to {tmp} failed: {who}{message} ({free}); {tmp.name} was removed, the "
                          "complete checkpoints are untouched")  # fmt: skip


def save(ckpt_dir: str | Path, step: int, model, optimizer, scheduler, run_state: dict, keep_last: int = 0) -> Path:
    """Write step `step` to `<ckpt_dir>/step_<step>` (collective): the shards, the RNG files and rank 0's `run_state`
    (plus step, world_size, scheduler, checksums) go to `step_<step>.tmp`, renamed when complete; then `prune`."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    final, tmp = step_dir(ckpt_dir, step), Path(ckpt_dir) / f"step_{step}.tmp"
    state = dict(run_state, step=step, world_size=_world(), parameter_digest=parameter_digest(model))
    if scheduler is not None:  # megatron's scheduler state, plus the warmup start (init_lr) it does not save
        state["scheduler"] = dict(scheduler.state_dict(), init_lr=scheduler.init_lr)
    json.dumps(state)  # not JSON-serialisable: a TypeError before anything is written

    error = None
    if _rank() == 0:
        try:
            if tmp.exists():  # a save of this step that died before; its content is unknown
                shutil.rmtree(tmp)
            (tmp / MODEL_OPTIM_DIR).mkdir(parents=True)
            (tmp / RNG_DIR).mkdir()
        except OSError as e:
            error = e
    _raise_if_failed(error, step, ckpt_dir, tmp)

    megatron_patches.use_in_process_write_queue()
    megatron_patches.CHECKPOINT_WRITE_ERRORS.clear()
    sums: dict[str, str] = {}
    try:
        with megatron_patches.checkpoint_writer_log_quiet():
            dist_checkpointing.save(_sharded_state_dict(model, optimizer, is_loading=False), str(tmp / MODEL_OPTIM_DIR))
        torch.save(rng_state(), tmp / RNG_DIR / f"rank_{_rank():05d}.pt")
        sums = {name: file_checksum(tmp / name) for name in _own_files(tmp)}  # still in the page cache
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failed write: reported on every rank below
        error = e
    written = megatron_patches.CHECKPOINT_WRITE_ERRORS
    error = written[0] if written else error  # a writer's own error (megatron raises only its summary)
    sums = _raise_if_failed(error, step, ckpt_dir, tmp, sums)

    if _rank() == 0:
        try:
            for p in sorted(tmp.rglob("*")):  # a file no rank claimed (another megatron-core naming): hashed here
                if p.is_file() and p.relative_to(tmp).as_posix() not in sums:
                    sums[p.relative_to(tmp).as_posix()] = file_checksum(p)
            state["checksums"] = {"algorithm": CHECKSUM_ALGORITHM, "files": dict(sorted(sums.items()))}
            with open(tmp / RUN_STATE_FILE, "w") as f:
                f.write(json.dumps(state, indent=1))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            error = e
    _raise_if_failed(error, step, ckpt_dir, tmp)

    if _rank() == 0:
        replace_dir(tmp, final)  # the same step saved again (a stop signal right after a periodic save)
        fd = os.open(final.parent, os.O_RDONLY)  # the rename is durable before older checkpoints are deleted
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        prune(ckpt_dir, keep_last)
    _barrier()
    return final


def replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` goes to `<dst>.old` first, removed after."""
    old = dst.with_name(dst.name + ".old")
    if dst.exists():
        dst.rename(old)
    src.rename(dst)
    if old.exists():
        shutil.rmtree(old)


# ---- Resume: the run state, the resume rules, the checks of the files, the load ----------
@dataclasses.dataclass(frozen=True)
class RunState:
    """A checkpoint's run_state.json (written by `save`), read and checked once by `read_run_state`."""

    path: Path  # the step_<N> folder
    step: int  # optimizer steps done
    world_size: int
    consumed_pairs: int
    reward_shift: float  # δ of the next step
    reward_shift_num_updates: int  # optimizer steps that moved δ (a diagnostic; training does not read it)
    sampler: dict  # mmpr_data.PairSampler.state_dict() after step `step`
    scheduler: dict  # the LR scheduler's state_dict() and init_lr after step `step`
    config: dict  # the resolved config (config.to_dict) the steps up to `step` ran with
    wandb_run_id: str | None = None
    checksums: dict | None = None  # {"algorithm", "files": {path relative to `path`: hex digest}}
    parameter_digest: str | None = None  # `parameter_digest` of the saved model (None: saved before it was written)
    model_files: str | None = None  # `model_files` of model.hf_path when the run (segment) started
    base_model_digest: str | None = None  # LoRA: `base_model_digest` of model.hf_path (the checkpoint holds no base)
    model_snapshot: dict | None = None  # a hub id's snapshot {"id", "revision", "path"} (model_hub.resolve_model)


# The fields that run_state.json must hold, with their JSON types (an int counts as a float).
_RUN_STATE_TYPES = {f.name: {"int": int, "float": float, "dict": dict}[f.type] for f in dataclasses.fields(RunState)
                    if f.default is dataclasses.MISSING and f.name != "path"}


def read_run_state(path: str | Path) -> RunState:
    """The run state of checkpoint `path`; CheckpointError naming each missing, mistyped or out-of-range field."""
    path = Path(path)
    try:
        raw = json.loads((path / RUN_STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / RUN_STATE_FILE} cannot be read: {type(e).__name__}: {e}") from None
    problems = [] if isinstance(raw, dict) else [f"a JSON {type(raw).__name__}, not an object"]
    for k, kind in _RUN_STATE_TYPES.items() if not problems else ():
        v = raw.get(k)
        if k not in raw:
            problems.append(f"no {k!r}")
        elif not isinstance(v, (int, float) if kind is float else kind) or isinstance(v, bool):
            problems.append(f"{k!r} = {v!r} is not a JSON {'number' if kind is float else kind.__name__}")
        elif (k == "step" and v < 0) or (k == "reward_shift" and not math.isfinite(v)):
            problems.append(f"{k!r} = {v} is out of range")
    if problems:
        raise CheckpointError(f"{path / RUN_STATE_FILE} is damaged or was edited: {'; '.join(problems)}; "
                              f"{move_away(path)}")  # fmt: skip
    digest = raw.get("parameter_digest", raw.get("parameter_layout"))  # "parameter_layout": the key's earlier name
    return RunState(path=path, **{k: raw[k] for k in _RUN_STATE_TYPES}, wandb_run_id=raw.get("wandb_run_id"),
                    checksums=raw.get("checksums"), parameter_digest=digest,
                    model_files=raw.get("model_files"), base_model_digest=raw.get("base_model_digest"),
                    model_snapshot=raw.get("model_snapshot"))  # fmt: skip


# A changed saved setting on resume (`check_resume`): refused for the reason given, or NOTICE: applies from the next
# step (the saved config is kept as config.step_<N>.json). Settings not listed may change silently.
LAYOUT = "the saved optimizer state loads only with the saved layout (it reshards over DP only)"
REWARD_UNITS = "δ is an EMA of the BCO rewards β·L in the saved units"
SCHEDULE = "the segments of a run follow one LR / weight-decay schedule"
ADAPTERS = "the saved LoRA adapters (and their optimizer state) belong to the saved [lora] setting"
NOTICE = "notice"
RESUME_RULES = {
    **dict.fromkeys(["model.params_dtype",  # the optimizer's param groups and fp32 master copies
                     "parallel.tensor_model_parallel_size", "parallel.context_parallel_size",
                     "parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size",
                     "optimizer.use_distributed_optimizer", "model.freeze_vision_encoder",  # frozen: no gradient bucket
                     "model.freeze_vision_projector", "model.freeze_language_model", "model.freeze_sound_encoder",
                     "model.freeze_sound_projector"], LAYOUT),
    **dict.fromkeys(["lora.rank", "lora.targets", "lora.language_model", "lora.shared_expert", "lora.routed_experts",
                     "lora.vision_tower", "lora.projector", "lora.sound_projector"], ADAPTERS),
    "lora.alpha": ADAPTERS,  # the saved B·A were trained at the saved scale alpha / rank
    **dict.fromkeys(["mpo.reference_policy_kl_penalty",  # β
                     "mpo.quality_average_log_probs"], REWARD_UNITS),  # L a sum or a per-token mean
    **dict.fromkeys(["optimizer.lr", "optimizer.min_lr", "optimizer.weight_decay", "scheduler.lr_warmup_init",
                     "scheduler.lr_warmup_steps", "scheduler.lr_decay_style", "mpo.max_num_steps"], SCHEDULE),
    **dict.fromkeys(["model.hf_path",  # the frozen reference is read from it at every start; the policy continues
                     "policy.train_global_batch_size", "mpo.preference_loss_weight", "mpo.bco_loss_weight",
                     "mpo.sft_loss_weight", "mpo.reward_shift_momentum",
                     "mpo.reward_shift",  # a fresh start's δ only: a resume carries the saved δ
                     "mpo.preference_average_log_probs", "mpo.sft_average_log_probs", "packing.shared_prompt",
                     "optimizer.grad_reduce_in_fp32",  # buffers start at 0 every step (`name_grad_dtype`)
                     "lora.dropout"], NOTICE),  # acts in the forward only: nothing saved depends on it
    # the saved master converted (int16 remainders <-> fp32, `_read_as_saved`), the saved fp32 moments cast
    **dict.fromkeys(["optimizer.use_precision_aware_optimizer", "optimizer.store_param_remainders",
                     "optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype"], NOTICE),
}  # fmt: skip


def check_resume(saved: RunState, cfg) -> dict[str, tuple[Any, Any]]:
    """The changed NOTICE settings of `cfg` against checkpoint `saved`, {key: (saved, now)}; CheckpointError listing
    every refused change (RESUME_RULES). A key the saved config lacks, or a path to the same file, is no change; the
    same model.hf_path with other files (`model_files`) is a change."""
    now, changed = config_mod.to_dict(cfg), {}
    for key in RESUME_RULES:
        section, name = key.split(".")
        if name not in saved.config.get(section, {}) or saved.config[section][name] == now[section][name]:
            continue
        a, b = saved.config[section][name], now[section][name]
        if not (key in config_mod.PATH_KEYS and a and b and os.path.realpath(a) == os.path.realpath(b)):
            changed[key] = (a, b)
    hf_path, folder = cfg.model.hf_path, model_hub.model_dir(cfg.model)  # an id or a path; its local folder
    files = model_hub.model_files(folder) if "model.hf_path" not in changed and saved.model_files else None
    if files is not None and files != saved.model_files:
        changed["model.hf_path"] = (f"{hf_path} (files {saved.model_files})", f"{hf_path} (files {files})")
    digest = model_hub.base_model_digest(folder) if cfg.lora.rank and saved.base_model_digest else None
    if digest is not None and digest != saved.base_model_digest:
        raise CheckpointError(f"cannot resume {saved.path}: its LoRA adapters were trained on base weights with digest "
                              f"{saved.base_model_digest}, model.hf_path = {hf_path} holds other weights (digest "
                              f"{digest}); set model.hf_path to the run's base model")
    if refused := [k for k in changed if RESUME_RULES[k] != NOTICE]:
        why = "; ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}: {RESUME_RULES[k]}" for k in refused)
        raise CheckpointError(f"cannot resume {saved.path} with changed settings ({why}). Set the saved values back, "
                              f"or export the policy (python hf_export.py {saved.path.parent} OUT) and start a "
                              "new run in another checkpoint.dir with model.hf_path=OUT")
    return {k: v for k, v in changed.items() if RESUME_RULES[k] == NOTICE}


def why_damaged(path: Path, world_size: int | None) -> str | None:
    """Why `path` cannot load, or None: bad metadata, a missing file (RNG ones with `world_size`), a short shard."""
    from torch.distributed.checkpoint import FileSystemReader

    shards, need, name = path / MODEL_OPTIM_DIR, {}, f"{MODEL_OPTIM_DIR}/{MEGATRON_METADATA_FILE}"
    try:
        if (path / name).is_file():
            config = json.loads((path / name).read_text())
            if not (isinstance(config, dict) and "sharded_backend" in config):
                raise ValueError("not megatron-core's dist_checkpointing config")
        name = f"{MODEL_OPTIM_DIR}/.metadata"
        if (path / name).is_file():
            for info in (FileSystemReader(str(shards)).read_metadata().storage_data or {}).values():
                need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 - whatever torch raises on a damaged .metadata
        return f"{name} cannot be read ({type(e).__name__}: {e})"
    files = [f"{MODEL_OPTIM_DIR}/{n}" for n in (MEGATRON_METADATA_FILE, ".metadata", *sorted(need))]
    missing = [n for n in files + [f"{RNG_DIR}/rank_{r:05d}.pt" for r in range(world_size or 0)]
               if not (path / n).is_file()]  # fmt: skip
    short = [f"{MODEL_OPTIM_DIR}/{n} has {(shards / n).stat().st_size} bytes, .metadata needs {k}"
             for n, k in sorted(need.items()) if not missing and (shards / n).stat().st_size < k]  # fmt: skip
    return f"missing {', '.join(missing)}" if missing else "; ".join(short) or None


def _checksum_mismatches(state: RunState, world_size: int | None) -> list[str]:
    """Collective: the files of `state.path` unlike their saved checksum (RNG files only with `world_size`)."""
    saved = state.checksums if isinstance(state.checksums, dict) else {}
    algorithm, files = saved.get("algorithm"), saved.get("files")
    if not isinstance(files, dict):
        notice = f"{state.path} holds no checksums (saved before they were written)"
    elif algorithm not in ("crc32", "xxh3_64") or (algorithm == "xxh3_64" and xxhash is None):
        notice = f"the checksums of {state.path} are {algorithm}, which this environment cannot compute (xxhash)"
    else:
        names = sorted(n for n in files if not n.startswith(f"{RNG_DIR}/") or world_size)
        bad = []
        for name in names[_rank() :: _world()]:
            with contextlib.suppress(OSError):  # missing (an RNG file nobody reads) or unreadable: the load says which
                if file_checksum(state.path / name, algorithm) != files[name]:
                    bad.append(name)
        return sorted(n for rank_bad in _gather(bad) for n in rank_bad)
    if _rank() == 0:
        print(f"checkpoint: {notice}: its files are not verified", file=sys.stderr)
    return []


def check_complete(state: RunState, world_size: int | None) -> None:
    """Refuse a damaged checkpoint (`why_damaged`, then the checksums) on every rank, before any collective load."""
    path = state.path
    damage = distributed.from_rank0(why_damaged(path, world_size) if _rank() == 0 else None)
    if damage is None and (bad := _checksum_mismatches(state, world_size)):
        damage = f"{', '.join(bad)} {'does' if len(bad) == 1 else 'do'} not match the checksum saved with it"
    if damage is not None:
        raise CheckpointError(f"checkpoint {path.name} ({path}) is damaged: {damage}; {move_away(path)}")


def parameter_digest(model: torch.nn.Module) -> str:
    """A digest of the trainable parameters' names, shapes and dtypes in order: the distributed optimizer's
    `dp_reshardable` state is stored in that order, so it loads only into a model with the same digest."""
    return model_hub.short_digest([f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in unwrap(model).named_parameters()
                                   if p.requires_grad])


def check_parameter_digest(state: RunState, model: torch.nn.Module) -> None:
    """Refuse on every rank an optimizer state saved for another `parameter_digest`, or saved before the digest (with
    per-expert weights) for a model with GroupedExperts' 3-D weights; other checkpoints without it get a notice."""
    path = state.path
    if state.parameter_digest is None:
        from backend import local_spec

        if not any(isinstance(m, local_spec.GroupedExperts) for m in unwrap(model).modules()):
            if _rank() == 0:
                print(f"checkpoint: {path} records no parameter digest (saved before it was written): not verified",
                      file=sys.stderr)
            return
        saved = "saved before digests were recorded, with per-expert weights"
    else:
        here = parameter_digest(model)
        if all(d == state.parameter_digest for d in _gather(here)):
            return
        saved = f"saved for parameter digest {state.parameter_digest}, this model's is {here}"
    raise CheckpointError(f"cannot resume {path}: its optimizer state ({saved}) would load into the wrong parameters "
                          f"(another spec, expert module or model.hf_path architecture). Export the policy (python "
                          f"hf_export.py {path.parent} OUT) and start a new run with model.hf_path=OUT")


def _read_as_saved(tree, shards: Path) -> None:
    """Give each optimizer tensor of the sharded state dict `tree` the dtype it was saved in, in place: the master
    is int16 remainders after a precision-aware run with store_param_remainders, fp32 values otherwise; the optimizer
    converts it to the form it keeps (precision_adam.PrecisionAwareAdam.set_scaled_state,
    megatron_patches._master_as_kept)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    saved = {k: getattr(getattr(m, "properties", None), "dtype", None)
             for k, m in FileSystemReader(str(shards)).read_metadata().state_dict_metadata.items()}  # fmt: skip

    def walk(node) -> None:
        for v in node.values() if isinstance(node, dict) else node:
            if isinstance(v, ShardedTensor) and saved.get(v.key) not in (None, v.data.dtype):
                v.data, v.dtype = torch.empty_like(v.data, dtype=saved[v.key]), saved[v.key]
            elif isinstance(v, (dict, list)):
                walk(v)

    walk(tree)


def load(ckpt: RunState | str | Path, model: torch.nn.Module, optimizer=None, scheduler=None) -> RunState:
    """Restore `ckpt` (RunState or folder) into a fresh model / optimizer / scheduler (collective); RNG at one world."""
    from megatron.core import dist_checkpointing

    state = ckpt if isinstance(ckpt, RunState) else read_run_state(ckpt)
    path, same_world = state.path, state.world_size == _world()
    check_complete(state, state.world_size if same_world else None)
    if optimizer is not None:
        check_parameter_digest(state, model)
        for opt in _inner_optimizers(optimizer):  # the distributed optimizer loads into existing state tensors
            if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                opt._init_optimizer_states_with_dummy_values()
    sharded = _sharded_state_dict(model, optimizer, is_loading=True)
    if optimizer is not None:  # the gradient-buffer dtype as saved (fp32 before the setting existed), then as now
        saved_fp32 = state.config.get("optimizer", {}).get("grad_reduce_in_fp32", True)
        megatron_patches.name_grad_dtype(sharded["optimizer"], saved_fp32)
        _read_as_saved(sharded["optimizer"], path / MODEL_OPTIM_DIR)
    loaded = dist_checkpointing.load(sharded, str(path / MODEL_OPTIM_DIR))
    load_model_state(model, loaded["model"])
    if optimizer is not None:
        megatron_patches.name_grad_dtype(loaded["optimizer"], model.ddp_config.grad_reduce_in_fp32)  # megatron DDP
        with torch.no_grad():  # fp32 main params can be views of leaf parameters (in-place copy under autograd fails)
            optimizer.load_state_dict(loaded["optimizer"])
        megatron_patches.restore_adam_steps(optimizer)
    if scheduler is not None:
        scheduler.num_steps = 0
        scheduler.load_state_dict(state.scheduler)

    if same_world:  # every rank's file is there (check_complete)
        rng_file, rng, error = path / RNG_DIR / f"rank_{_rank():05d}.pt", None, None
        try:
            rng = torch.load(rng_file, weights_only=True)
        except Exception as e:  # noqa: BLE001 - a truncated zip (RuntimeError) or garbage (UnpicklingError)
            error = f"{rng_file}: damaged RNG state file ({type(e).__name__})"
        if error := next((e for e in _gather(error) if e is not None), None):  # every rank stops, none waits below
            raise CheckpointError(f"{error}; {move_away(path)}")
        set_rng_state(rng)
    elif _rank() == 0:
        print(f"checkpoint: RNG states not restored: saved with world size {state.world_size}, now {_world()}",
              file=sys.stderr)  # fmt: skip
    _barrier()
    return state

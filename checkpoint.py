"""Resumable training checkpoints (megatron-core dist_checkpointing plus a JSON run state) and the HF export.

    <checkpoint.dir>/step_<N>/        a complete checkpoint after optimizer step N
        model_optim/                  model and distributed-optimizer shards (`dp_reshardable`: reshards over DP only)
        run_state.json                `RunState`: step, δ, sampler, scheduler, resolved config, W&B id, file checksums
        rng/rank_<r>.pt               the RNG states of rank r
    <checkpoint.dir>/step_<N>.tmp/    a save in progress, renamed to step_<N> once every rank has written
    <checkpoint.dir>/.lock            the run using the directory (`lock_run_dir`)

`save` writes a step (collective). A resume reads the run state once (`read_run_state`), checks the config against
it (`check_resume`, the table RESUME_RULES) and restores the step (`load`, after `check_complete`: missing, short or
changed files). `export` (`python checkpoint.py export RUN_DIR OUT_DIR`) writes the policy as an HF checkpoint.
Why this optimizer format, the Adam-step repair and the `.old` swap: docs/DESIGN.md. Tests: tests/test_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import math
import os
import queue
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

try:  # a dependency of wandb (requirements.txt); zlib's crc32 where it is absent
    import xxhash
except ImportError:
    xxhash = None

STEP_RE = re.compile(r"^step_(\d+)$")
RUN_STATE_FILE = "run_state.json"
MODEL_OPTIM_DIR = "model_optim"
MEGATRON_METADATA_FILE = "metadata.json"  # megatron-core dist_checkpointing's config file in model_optim/
RNG_DIR = "rng"
# The distributed optimizer's checkpoint format, a choice on its merits (module docstring); megatron-core 0.19.2's
# default (`fully_sharded_model_space`) also raises "flattened_range is not supported" without TE/Apex.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
# Written into every export's OUT_DIR (provenance: source checkpoint, step, base model.hf_path, date, complete): marks
# the directory as an export that a later export may overwrite (`check_export_dir`); transformers ignores it.
EXPORT_INFO_FILE = "omni_mpo_export.json"
# The hash of the per-file checksums in run_state.json ("checksums": {"algorithm", "files": {relative path: hex}}).
CHECKSUM_ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"
SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # model_optim/__<rank>_<i>.distcp: the shard files rank <rank> wrote
FULL_BYTES = 1 << 20  # free space below which a file system counts as full (a failed write is then ENOSPC)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or restored; the message names the directory and the reason."""


# ----------------------------------------------------------------------------------------------------------------------
# Directory layout


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    """The directory of the complete checkpoint after optimizer step `step`: `<ckpt_dir>/step_<step>`."""
    return Path(ckpt_dir) / f"step_{step}"


def list_checkpoints(ckpt_dir: str | Path, report: bool = True) -> list[tuple[int, Path]]:
    """Complete checkpoints in `ckpt_dir` as (step, path), ascending: `step_<N>` folders holding run_state.json
    and model_optim/. Another `step_<N>` is reported on stderr (`report`) and skipped."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if not m or not p.is_dir():
            continue
        if (p / RUN_STATE_FILE).is_file() and (p / MODEL_OPTIM_DIR).is_dir():
            found.append((int(m.group(1)), p))
        else:
            if report:
                print(f"checkpoint: ignoring {p}: no {RUN_STATE_FILE} or {MODEL_OPTIM_DIR}/ (incomplete)",
                      file=sys.stderr)  # fmt: skip
    return sorted(found)


def previous_checkpoint(path: str | Path) -> Path | None:
    """The complete checkpoint before `path` (a step_<N>) in its run directory: the highest step below N, or None."""
    m = STEP_RE.match(Path(path).name)
    older = [p for n, p in list_checkpoints(Path(path).parent, report=False) if m and n < int(m.group(1))]
    return older[-1] if older else None


def move_away(path: str | Path) -> str:
    """The way out of a damaged checkpoint `path`: `move PATH away (e.g. to PATH.damaged) to resume from the previous
    checkpoint`, naming that checkpoint when the run directory holds one."""
    prev = previous_checkpoint(path)
    return (f"move {path} away (e.g. to {path}.damaged) to resume from the previous checkpoint"
            + (f", {prev}" if prev else ""))  # fmt: skip


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The highest complete `step_<N>` in `ckpt_dir`, or None; rank 0 decides and broadcasts (a rename seen late
    on another node cannot split the ranks)."""
    found = list_checkpoints(ckpt_dir) if _rank() == 0 else []
    path = [str(found[-1][1]) if found else None]
    if _world() > 1:
        dist.broadcast_object_list(path, src=0)
    return Path(path[0]) if path[0] is not None else None


def resume_path(ckpt_dir: str | Path, resume: bool) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start.

    Raises:
        CheckpointError: `resume` is False and `ckpt_dir` holds a complete checkpoint.
    """
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None and not resume:
        raise CheckpointError(
            f"checkpoint.dir = {ckpt_dir} already holds a checkpoint ({latest.name}) and checkpoint.resume = false: "
            "refusing to start over it. Use another checkpoint.dir, or checkpoint.resume=true to continue that run."
        )
    return latest


def prune(ckpt_dir: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the `keep_last` newest complete checkpoints (0 keeps all); return the removed paths."""
    if keep_last <= 0:
        return []
    old = [p for _, p in list_checkpoints(ckpt_dir)[:-keep_last]]
    for p in old:
        shutil.rmtree(p)
    return old


LOCK_FILE = ".lock"
TMP_RE = re.compile(r"^step_(\d+)\.tmp$")
OLD_RE = re.compile(r"^step_(\d+)\.old$")  # a checkpoint being replaced by a save of the same step
_held_lock: tuple[Path, int] | None = None  # (run dir, open fd) of this process's lock: kept open until it exits
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}  # file systems without flock support


def _lock_holder(lock: Path) -> str:
    """The holder of `lock` in words, from the JSON its holder wrote (host, pid, Slurm job, start time)."""
    try:
        info = json.loads(lock.read_text())
        who = f"pid {info['pid']} on host {info['host']}"
        if info.get("slurm_job_id"):
            who += f", Slurm job {info['slurm_job_id']}"
        return f"{who}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):  # written at this moment, or not by this code
        return "holder unknown"


def _take_lock(root: Path) -> str | None:
    """Rank 0's part of `lock_run_dir`: create `root`, take the lock, write who holds it. Returns the error line, or
    None when the lock is held (or the file system has no flock: one notice on stderr)."""
    global _held_lock
    if _held_lock is not None and _held_lock[0] == root.resolve():
        return None  # this process holds it already
    lock = root / LOCK_FILE
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's content stays readable
    except OSError as e:
        return f"checkpoint.dir = {root}: cannot create its lock file {lock}: {e.strerror}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return (
            f"checkpoint.dir = {root} is in use by another run ({_lock_holder(lock)}; lock file {lock}): wait until "
            "it ends, or use another checkpoint.dir"
        )
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            os.close(fd)
            return f"checkpoint.dir = {root}: cannot lock {lock}: {e.strerror}"
        print(
            f"checkpoint: the file system of {root} does not support file locks ({e.strerror}): nothing stops a "
            "second run from using this checkpoint.dir at the same time",
            file=sys.stderr,
        )
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except OSError:  # e.g. a full disk: the lock holds without its description (a second run reads "holder unknown")
        pass
    if _held_lock is not None:  # another run dir before (a tool driving several runs): let that one go
        os.close(_held_lock[1])
    _held_lock = (root.resolve(), fd)
    return None


def lock_run_dir(ckpt_dir: str | Path) -> None:
    """Claim `ckpt_dir` for this run (collective, before anything is written there): rank 0 takes a
    non-blocking `fcntl.flock` on `<ckpt_dir>/.lock`, held until the process exits (any exit releases it), writes its
    host, pid, Slurm job and start time there, then `remove_unfinished_saves`; the outcome is broadcast.

    Raises:
        CheckpointError: another process holds the lock (named from the lock file); the lock or a clean-up fails.
    """
    root = Path(ckpt_dir)
    out: list[str | None] = [None]
    if _rank() == 0:
        out[0] = _take_lock(root)
        if out[0] is None:
            try:
                remove_unfinished_saves(root)
            except OSError as e:
                out[0] = f"checkpoint.dir = {root}: cannot remove an unfinished save: {e}"
    if _world() > 1:
        dist.broadcast_object_list(out, src=0)
    if out[0] is not None:
        raise CheckpointError(out[0])


def remove_unfinished_saves(ckpt_dir: str | Path) -> list[Path]:
    """Clean up after a run killed inside `save` (call while holding the lock: a running save is a `.tmp`
    too): `step_<N>.tmp` is removed; `step_<N>.old` is renamed back to `step_<N>` when that is missing (the run died
    between the two renames of a second save of step N), else removed. One notice line per action; returns the
    directories removed."""
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
        names = ", ".join(p.name for p in stale)
        print(f"checkpoint: removed {len(stale)} unfinished save(s) of an earlier run in {root}: {names}",
              file=sys.stderr)  # fmt: skip
    return stale


# ----------------------------------------------------------------------------------------------------------------------
# RNG states (per rank)


def rng_state() -> dict[str, Any]:
    """This rank's RNG states (python, numpy, torch CPU, each CUDA device, megatron's tracker) as tensors,
    tuples, ints and strings, which `torch.load(weights_only=True)` reads."""
    from megatron.core import tensor_parallel

    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()` output (the CUDA part only when CUDA is available here and was when saved)."""
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


# ----------------------------------------------------------------------------------------------------------------------
# Save and load


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under megatron-core's DDP / Float16Module wrappers (their keys would gain a `module.` prefix)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(model, (DistributedDataParallel, Float16Module)):
        model = model.module
    return model


def _inner_optimizers(optimizer) -> list:
    """The megatron optimizers inside a ChainedOptimizer (or [optimizer])."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def model_sharded_state_dict(model: torch.nn.Module) -> dict:
    """megatron-core sharded state dict of `model` (DDP / Float16Module unwrapped). A plain module holding
    megatron modules (omni_model.OmniModel) gets the union of its children's, prefixed by the child's name, so the keys
    equal its own `state_dict` keys."""
    from megatron.core.transformer.utils import sharded_state_dict_default

    module = _unwrap(model)
    if hasattr(module, "sharded_state_dict"):
        return module.sharded_state_dict()
    out: dict = {}
    for name, child in module.named_children():
        out.update(sharded_state_dict_default(child, prefix=f"{name}."))
    own = {k: v for k, v in module.state_dict(keep_vars=True).items() if "." not in k}
    if own:
        raise CheckpointError(f"{type(module).__name__} has tensors outside its child modules: {sorted(own)}")
    return out


def _sharded_state_dict(model, optimizer, is_loading: bool) -> dict:
    model_sd = model_sharded_state_dict(model)
    out = {"model": model_sd}
    if optimizer is not None:
        out["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return out


_WRITE_ERRORS: list[BaseException] = []  # the shard writers' exceptions of the save in progress


def _use_in_process_write_queue() -> None:
    """Give dist_checkpointing's synchronous save an in-process results queue (megatron-core otherwise spawns
    a `multiprocessing.Manager`, ~9 s per run) and record a shard writer's exception for `save` to name.
    SHIM(megatron-core 0.19.2): megatron/core/dist_checkpointing/strategies/filesystem_async.py:65"""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
    # megatron-core logs a shard writer's exception (e.g. OSError ENOSPC) and raises only "Worker failure: ... <class
    # 'OSError'>"; remember the exception itself so that a failed save can name it. And the coordinator's write of
    # .metadata (`finish`) raising would leave the other ranks in the broadcast that follows it: record that error
    # instead, and `save` raises it on every rank (private names, 0.19.2).
    writer = filesystem_async.FileSystemWriterAsync
    if not getattr(writer.write_preloaded_data, "_omni_mpo_records", False):
        write, finish = writer.write_preloaded_data, writer.finish

        def recording(*args, **kwargs):
            out = write(*args, **kwargs)
            if out is not None and isinstance(out[1], BaseException):
                _WRITE_ERRORS.append(out[1])
            return out

        def recording_finish(self, *args, **kwargs):
            try:
                return finish(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - raised by `save` on every rank, after megatron's broadcast
                _WRITE_ERRORS.append(e)

        recording._omni_mpo_records = True
        writer.write_preloaded_data = staticmethod(recording)
        writer.finish = recording_finish


def _innermost(e: BaseException) -> BaseException:
    """The innermost cause of `e` (megatron-core and torch wrap the OSError of a failed write)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _free_bytes(directory: str | Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def free_space(directory: str | Path) -> str:
    """`N bytes free on DIRECTORY`, with `: the file system is full` below FULL_BYTES (or why it is unknown)."""
    n = _free_bytes(directory)
    if n is None:
        return f"free space on {directory} unknown"
    return f"{n} bytes free on {directory}" + (": the file system is full" if n < FULL_BYTES else "")


def write_failure(e: BaseException, directory: str | Path) -> OSError | None:
    """The OSError behind `e` when `e` is a failed write into `directory` (full disk, quota, I/O), else None:
    the innermost OSError, safetensors' "(os error N)", or torch's zip-writer "unexpected pos" (ENOSPC when
    `directory` has less than FULL_BYTES free)."""
    inner = _innermost(e)
    if isinstance(inner, OSError):
        return inner
    text = str(inner)
    if type(inner).__name__ == "SafetensorError" and (m := re.search(r"\(os error (\d+)\)", text)):
        return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    if isinstance(inner, RuntimeError) and "inline_container.cc" in text:
        n = _free_bytes(directory)
        if n is not None and n < FULL_BYTES:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return OSError(f"torch's file writer failed ({text.splitlines()[0][:200]})")
    return None


def _describe(e: BaseException, directory: str | Path) -> str:
    """`Type: message` of the write failure behind `e` (`write_failure`), else of its innermost cause."""
    e = write_failure(e, directory) or _innermost(e)
    return f"{type(e).__name__}: {e}"


def _report_unexpected(e: BaseException, step: int, directory: str | Path) -> None:
    """Print the traceback of a save error on this rank's stderr unless it is a failed write (`write_failure`),
    which the one-line CheckpointError says in full."""
    if write_failure(e, directory) is None:
        print(f"checkpoint: rank {_rank()}: saving step {step} failed with an unexpected error:", file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)


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
    """The files of the save in progress `tmp` this rank wrote, relative to it: its shards and RNG file; on
    rank 0 also megatron's other model_optim/ files."""
    r = _rank()
    names = [f"{RNG_DIR}/rank_{r:05d}.pt"]
    for p in sorted((tmp / MODEL_OPTIM_DIR).iterdir()):
        m = SHARD_RE.match(p.name)
        if p.is_file() and (int(m.group(1)) == r if m else r == 0):
            names.append(f"{MODEL_OPTIM_DIR}/{p.name}")
    return names


def _raise_if_failed(
    error: BaseException | None, step: int, ckpt_dir: str | Path, tmp: Path, sums: dict[str, str] | None = None
) -> dict[str, str]:
    """Collective: when any rank failed, rank 0 removes `tmp` and every rank raises the same CheckpointError
    (the first failing rank's error and the free space). Returns every rank's `sums` merged."""
    mine = (None if error is None else _describe(error, ckpt_dir), sums or {})
    gathered = [mine]
    if _world() > 1:
        gathered = [None] * _world()
        dist.all_gather_object(gathered, mine)
    failed = [(r, m) for r, (m, _) in enumerate(gathered) if m is not None]
    if not failed:
        return {k: v for _, rank_sums in gathered for k, v in rank_sums.items()}
    free = free_space(ckpt_dir)  # before the .tmp goes: the space the failed save saw
    _barrier()
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    rank, message = next(((r, m) for r, m in failed if not m.startswith("CheckpointException")), failed[0])
    who = f"rank {rank}: " if _world() > 1 else ""
    raise CheckpointError(
        f"saving step {step} to {tmp} failed: {who}{message} ({free}); {tmp.name} was removed, the "
        "complete checkpoints are untouched"
    )


def save(
    ckpt_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    run_state: dict[str, Any],
    keep_last: int = 0,
) -> Path:
    """Write the checkpoint of optimizer step `step` to `<ckpt_dir>/step_<step>` (collective).

    `run_state` (JSON-serialisable, from rank 0) gets `step`, `world_size`, `scheduler` (`schedule_state`) and
    `checksums` (every file's hash, computed by the rank that wrote it) and becomes run_state.json, written last into
    `step_<N>.tmp`, which is then renamed. `keep_last` > 0 keeps that many complete checkpoints (`prune`).

    Raises:
        CheckpointError: run_state not JSON-serialisable (before any write); a write failed on any rank (disk full,
            quota, I/O: `write_failure`): one line on every rank naming the step, the error and the free space, the
            `.tmp` removed and the complete checkpoints untouched.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    final, tmp = step_dir(ckpt_dir, step), Path(ckpt_dir) / f"step_{step}.tmp"
    state = dict(run_state, step=step, world_size=_world())
    if scheduler is not None:
        state["scheduler"] = schedule_state(scheduler)
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"run state of step {step} is not JSON-serialisable: {e}") from None

    error = None
    if _rank() == 0:
        try:
            if tmp.exists():  # a save of this step that died before; its content is unknown
                shutil.rmtree(tmp)
            (tmp / MODEL_OPTIM_DIR).mkdir(parents=True)
            (tmp / RNG_DIR).mkdir()
        except OSError as e:
            error = e
    _raise_if_failed(error, step, ckpt_dir, tmp)  # collective: the outcome of every rank

    _use_in_process_write_queue()
    _WRITE_ERRORS.clear()
    sums: dict[str, str] = {}
    try:
        dist_checkpointing.save(_sharded_state_dict(model, optimizer, is_loading=False), str(tmp / MODEL_OPTIM_DIR))
        torch.save(rng_state(), tmp / RNG_DIR / f"rank_{_rank():05d}.pt")
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failed write: reported on every rank below
        error = _WRITE_ERRORS[0] if _WRITE_ERRORS else e  # the shard writer's own error (megatron logs it only)
    if error is None and _WRITE_ERRORS:  # the .metadata write failed (rank 0; megatron's save returned)
        error = _WRITE_ERRORS[0]
    if error is None:
        try:  # right after the writes: the files are still in the page cache
            sums = {name: file_checksum(tmp / name) for name in _own_files(tmp)}
        except OSError as e:
            error = e
    if error is not None:
        _report_unexpected(error, step, ckpt_dir)
    sums = _raise_if_failed(error, step, ckpt_dir, tmp, sums)  # every rank's shards and RNG file are on disk
    if _rank() == 0:
        try:
            for p in sorted(tmp.rglob("*")):  # a file no rank claimed (another megatron-core naming): hashed here
                name = p.relative_to(tmp).as_posix()
                if p.is_file() and name not in sums:
                    sums[name] = file_checksum(p)
            state["checksums"] = {"algorithm": CHECKSUM_ALGORITHM, "files": dict(sorted(sums.items()))}
            with open(tmp / RUN_STATE_FILE, "w") as f:
                f.write(json.dumps(state, indent=1))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            error = e
    _raise_if_failed(error, step, ckpt_dir, tmp)

    if _rank() == 0:
        _replace_dir(tmp, final)  # the same step saved again (e.g. a signal right after a periodic save) is replaced
        fd = os.open(final.parent, os.O_RDONLY)  # make the rename durable before older checkpoints are deleted
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        prune(ckpt_dir, keep_last)
    _barrier()
    return final


def _restore_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam `step` tensor equal to the loaded param-group step (in place).

    SHIM(megatron-core 0.19.2): megatron/core/optimizer/distrib_optimizer.py:1032 (docs/DESIGN.md, Checkpoints).

    Raises:
        CheckpointError: the param groups carry different steps.
    """
    steps = set()
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                st = inner.state.get(p)
                if st is not None and "step" in st:
                    old = st["step"]
                    st["step"] = torch.tensor(float(group["step"]), dtype=old.dtype, device=old.device)
                    steps.add(float(group["step"]))
    if len(steps) > 1:
        raise CheckpointError(f"optimizer param groups carry different Adam steps {sorted(steps)}")


def schedule_state(scheduler) -> dict[str, Any]:
    """megatron-core `OptimizerParamScheduler.state_dict()` plus its `init_lr` (the warmup start, which megatron does
    not save): what run_state.json stores under "scheduler"."""
    return dict(scheduler.state_dict(), init_lr=scheduler.init_lr)


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
    scheduler: dict  # schedule_state() after step `step`
    config: dict  # the resolved config (config.to_dict) the steps up to `step` ran with
    wandb_run_id: str | None = None
    checksums: dict | None = None  # {"algorithm", "files": {path relative to `path`: hex digest}}


# The fields of RunState that run_state.json must hold, with their JSON types (an int counts as a float).
_RUN_STATE_TYPES = {f.name: {"int": int, "float": float, "dict": dict}[f.type] for f in dataclasses.fields(RunState)
                    if f.default is dataclasses.MISSING and f.name != "path"}


def read_run_state(path: str | Path) -> RunState:
    """The run state of checkpoint `path` (a step_<N> folder), checked: each field of _RUN_STATE_TYPES present
    with its JSON type, step >= 0, δ finite.

    Raises:
        CheckpointError: unreadable, or one line naming the file, every problem and the way out (`move_away`).
    """
    path = Path(path)
    try:
        raw = json.loads((path / RUN_STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / RUN_STATE_FILE} cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(raw, dict):
        problems = [f"a JSON {type(raw).__name__}, not an object"]
    else:
        problems = [f"no {k!r}" for k in _RUN_STATE_TYPES if k not in raw]
        for k, kind in _RUN_STATE_TYPES.items():
            ok = isinstance(raw.get(k), (int, float) if kind is float else kind) and not isinstance(raw.get(k), bool)
            if k in raw and not ok:
                problems.append(f"{k!r} = {raw[k]!r} is not a JSON {'number' if kind is float else kind.__name__}")
        if isinstance(raw.get("step"), int) and raw["step"] < 0:
            problems.append(f"'step' = {raw['step']} is negative")
        if isinstance(raw.get("reward_shift"), float) and not math.isfinite(raw["reward_shift"]):
            problems.append(f"'reward_shift' = {raw['reward_shift']} is not finite")
    if problems:
        raise CheckpointError(f"{path / RUN_STATE_FILE} is damaged or was edited: {'; '.join(problems)}; "
                              f"{move_away(path)}")  # fmt: skip
    return RunState(path=path, **{k: raw[k] for k in _RUN_STATE_TYPES}, wandb_run_id=raw.get("wandb_run_id"),
                    checksums=raw.get("checksums"))  # fmt: skip


# What a resume does when this run's config changes a setting saved with the checkpoint (`check_resume`): refuse it,
# for the reason given, or NOTICE: the new value applies from the next step (train.resume prints one `resume:` line
# and keeps the saved config as config.step_<N>.json). A setting not listed may change silently (e.g. data paths,
# logging, checkpoint.save_period); the data-parallel size is no setting (it follows from the world size).
LAYOUT = "the saved optimizer state loads only with the saved layout (it reshards over DP only)"
REWARD_UNITS = "δ is an EMA of the BCO rewards β·L in the saved units"
SCHEDULE = "the segments of a run follow one LR / weight-decay schedule"
NOTICE = "notice"
RESUME_RULES = {
    "model.params_dtype": LAYOUT,  # the optimizer's param groups and fp32 master copies
    "parallel.tensor_model_parallel_size": LAYOUT,
    "parallel.context_parallel_size": LAYOUT,
    "parallel.expert_model_parallel_size": LAYOUT,
    "parallel.expert_tensor_parallel_size": LAYOUT,
    "optimizer.use_distributed_optimizer": LAYOUT,
    "model.freeze_vision_encoder": LAYOUT,  # a frozen parameter has no gradient bucket
    "model.freeze_vision_projector": LAYOUT,
    "model.freeze_language_model": LAYOUT,
    "mpo.reference_policy_kl_penalty": REWARD_UNITS,  # β
    "mpo.quality_average_log_probs": REWARD_UNITS,  # L a sum or a per-token mean
    "optimizer.lr": SCHEDULE,
    "optimizer.min_lr": SCHEDULE,
    "optimizer.weight_decay": SCHEDULE,
    "scheduler.lr_warmup_init": SCHEDULE,
    "scheduler.lr_warmup_steps": SCHEDULE,
    "scheduler.lr_decay_style": SCHEDULE,
    "mpo.max_num_steps": SCHEDULE,  # the horizon
    "model.hf_path": NOTICE,  # the frozen reference is read from it at every start; the policy continues
    "policy.train_global_batch_size": NOTICE,
    "mpo.preference_loss_weight": NOTICE,
    "mpo.bco_loss_weight": NOTICE,
    "mpo.sft_loss_weight": NOTICE,
    "mpo.reward_shift_momentum": NOTICE,
    "mpo.reward_shift": NOTICE,  # a fresh start's δ only: a resume carries the saved δ
    "mpo.preference_average_log_probs": NOTICE,
    "mpo.sft_average_log_probs": NOTICE,
    "packing.shared_prompt": NOTICE,
}


def changed_settings(saved: dict, cfg, keys) -> dict[str, tuple[Any, Any]]:
    """{key: (saved, now)} for the settings of `keys` ("section.name") whose value in the saved resolved
    config `saved` (config.to_dict form) differs from `cfg`, in the order of `keys`. A key the saved config lacks counts
    as unchanged, as does a path (config.PATH_KEYS) naming the same file from the working directory."""
    import config as config_mod

    now = config_mod.to_dict(cfg)
    diff = {}
    for key in keys:
        section, name = key.split(".")
        if name not in saved.get(section, {}) or saved[section][name] == now[section][name]:
            continue
        a, b = saved[section][name], now[section][name]
        if key in config_mod.PATH_KEYS and a and b and os.path.realpath(a) == os.path.realpath(b):
            continue
        diff[key] = (a, b)
    return diff


def check_resume(saved: RunState, cfg) -> dict[str, tuple[Any, Any]]:
    """Whether config `cfg` may continue checkpoint `saved` (RESUME_RULES); returns the changed NOTICE
    settings, {key: (saved, now)}.

    Raises:
        CheckpointError: one line with every refused change (saved -> now) under its reason, and the way out.
    """
    changed = changed_settings(saved.config, cfg, RESUME_RULES)
    refused = {k: v for k, v in changed.items() if RESUME_RULES[k] != NOTICE}
    if refused:
        why = "; ".join(reason + ": " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in refused.items()
                                                  if RESUME_RULES[k] == reason)
                        for reason in dict.fromkeys(RESUME_RULES[k] for k in refused))  # fmt: skip
        raise CheckpointError(
            f"cannot resume {saved.path} with changed settings ({why}). Set the saved values back, or export the "
            f"policy (python checkpoint.py export {saved.path.parent} OUT) and start a new run in another "
            "checkpoint.dir with model.hf_path=OUT"
        )
    return {k: v for k, v in changed.items() if RESUME_RULES[k] == NOTICE}


def _load_shards(sharded_state_dict: dict, ckpt_dir: Path) -> dict:
    """megatron-core's dist_checkpointing.load of `ckpt_dir` (a model_optim/).

    Raises:
        CheckpointError: a shard file shorter than its metadata says, or another EOFError / UnpicklingError, naming
            the directory. Other errors propagate.
    """
    import pickle

    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    unreadable = (EOFError, pickle.UnpicklingError)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(ckpt_dir))
    except (*unreadable, CheckpointException) as e:
        inner = list(e.failures.values()) if isinstance(e, CheckpointException) else [e]
        short = _truncated_files(ckpt_dir)
        if not short and not any(isinstance(x, unreadable) for x in inner):
            raise
        cause = next((x for x in inner if isinstance(x, unreadable)), inner[0])
        what = _short_files(short) or f"a shard file cannot be read ({type(cause).__name__}: {cause})"
        raise CheckpointError(
            f"{ckpt_dir}: damaged checkpoint: {what}; copy the step again or resume from another step_<N>"
        ) from None


def _short_files(short: list[tuple[Path, int, int]]) -> str:
    return "; ".join(f"{f} has {have} bytes, its metadata needs {need}" for f, have, need in short)


def _truncated_files(ckpt_dir: Path) -> list[tuple[Path, int, int]]:
    """The shard files of a torch.distributed.checkpoint directory shorter than its .metadata says, as
    (path, size in bytes, bytes needed); [] when the metadata cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(ckpt_dir)).read_metadata().storage_data or {}
    except Exception:  # noqa: BLE001 - a diagnosis on top of an error already raised: fall back to the generic line
        return []
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    out = []
    for name, n in sorted(need.items()):
        f = ckpt_dir / name
        have = f.stat().st_size if f.is_file() else 0
        if have < n:
            out.append((f, have, n))
    return out


def missing_files(path: str | Path, world_size: int | None) -> list[str]:
    """The files a complete checkpoint `path` lacks, relative to it: model_optim/metadata.json, .metadata,
    each shard file .metadata references and, with `world_size`, rng/rank_<r>.pt of every rank.

    Raises:
        CheckpointError: metadata.json or .metadata cannot be read.
    """
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    shards = path / MODEL_OPTIM_DIR

    def unreadable(name: str, e: Exception) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path.name} ({path}) is damaged: {MODEL_OPTIM_DIR}/{name} cannot be read "
            f"({type(e).__name__}: {e}); {move_away(path)}"
        )

    missing = []
    if not (shards / MEGATRON_METADATA_FILE).is_file():
        missing.append(f"{MODEL_OPTIM_DIR}/{MEGATRON_METADATA_FILE}")
    else:
        try:
            config = json.loads((shards / MEGATRON_METADATA_FILE).read_text())
        except (OSError, ValueError) as e:
            raise unreadable(MEGATRON_METADATA_FILE, e) from None
        if not isinstance(config, dict) or "sharded_backend" not in config:
            raise unreadable(MEGATRON_METADATA_FILE, ValueError(
                f"not megatron-core's dist_checkpointing config (a JSON object with sharded_backend): "
                f"{json.dumps(config)[:80]}"))
    if not (shards / ".metadata").is_file():
        missing.append(f"{MODEL_OPTIM_DIR}/.metadata")
    else:
        try:
            storage = FileSystemReader(str(shards)).read_metadata().storage_data or {}
        except Exception as e:  # noqa: BLE001 - an unreadable metadata file is a damaged checkpoint like a missing one
            raise unreadable(".metadata", e) from None
        names = sorted({info.relative_path for info in storage.values()})
        missing += [f"{MODEL_OPTIM_DIR}/{n}" for n in names if not (shards / n).is_file()]
    for r in range(world_size or 0):
        if not (path / RNG_DIR / f"rank_{r:05d}.pt").is_file():
            missing.append(f"{RNG_DIR}/rank_{r:05d}.pt")
    return missing


def _checksum_mismatches(state: RunState, world_size: int | None) -> tuple[list[str], str | None]:
    """Collective: the files of `state.path` whose hash differs from the one saved in its run state (sorted), and a
    notice when nothing can be verified (no checksums saved, or xxh3_64 without xxhash). Each rank hashes every
    world-th file a load reads (the RNG files only with `world_size`)."""
    path, saved = state.path, state.checksums
    if not isinstance(saved, dict) or not isinstance(saved.get("files"), dict):
        return [], f"checkpoint: {path} holds no checksums (saved before they were written): its files are not verified"
    algorithm = saved.get("algorithm")
    if algorithm not in ("crc32", "xxh3_64") or (algorithm == "xxh3_64" and xxhash is None):
        return [], (f"checkpoint: the checksums of {path} are {algorithm}, which this environment cannot compute "
                    "(xxh3_64 needs the xxhash package): its files are not verified")  # fmt: skip
    names = sorted(n for n in saved["files"] if not n.startswith(f"{RNG_DIR}/") or world_size)
    bad = []
    for name in names[_rank() :: _world()]:
        try:
            if file_checksum(path / name, algorithm) != saved["files"][name]:
                bad.append(name)
        except OSError:  # missing (at another world size, an RNG file nobody reads) or unreadable: the load says which
            pass
    if _world() > 1:
        every: list = [None] * _world()
        dist.all_gather_object(every, bad)
        bad = sorted(n for rank_bad in every for n in rank_bad)
    return bad, None


def check_complete(state: RunState, world_size: int | None) -> None:
    """Refuse a damaged checkpoint (`state.path`) before any collective load, identically on every rank:
    `missing_files`, shard files shorter than the metadata says, files whose checksum differs (`_checksum_mismatches`).

    Raises:
        CheckpointError: one line naming the step and the files, and the way out (`move_away`).
    """
    path = state.path
    out: list[str | None] = [None]
    if _rank() == 0:
        try:
            missing = missing_files(path, world_size)
        except CheckpointError as e:
            out[0] = str(e)
        else:
            short = [] if missing else _truncated_files(path / MODEL_OPTIM_DIR)
            if missing:
                out[0] = f"checkpoint {path.name} ({path}) is damaged: missing {', '.join(missing)}; {move_away(path)}"
            elif short:  # the line `_load_shards` gives, but before the load and on every rank
                out[0] = (
                    f"{path / MODEL_OPTIM_DIR}: damaged checkpoint: {_short_files(short)}; copy the step again or "
                    "resume from another step_<N>"
                )
    if _world() > 1:
        dist.broadcast_object_list(out, src=0)
    if out[0] is not None:
        raise CheckpointError(out[0])
    bad, notice = _checksum_mismatches(state, world_size)
    if notice and _rank() == 0:
        print(notice, file=sys.stderr)
    if bad:
        raise CheckpointError(
            f"checkpoint {path.name} ({path}) is damaged: {', '.join(bad)} "
            f"{'does' if len(bad) == 1 else 'do'} not match the checksum saved with it; {move_away(path)}"
        )


def load(ckpt: RunState | str | Path, model: torch.nn.Module, optimizer=None, scheduler=None) -> RunState:
    """Restore checkpoint `ckpt` (its RunState or folder) into a freshly built model / optimizer / scheduler
    (collective, after `check_complete`; train.py runs `check_resume` first) and return its RunState. RNG states are
    restored at the saved world size only (else one note).

    Raises:
        CheckpointError: `read_run_state`'s, `check_complete`'s, a truncated shard (`_load_shards`), a damaged RNG file.
    """
    state = ckpt if isinstance(ckpt, RunState) else read_run_state(ckpt)
    path, same_world = state.path, state.world_size == _world()
    check_complete(state, state.world_size if same_world else None)  # before any collective load

    if optimizer is not None:
        for opt in _inner_optimizers(optimizer):  # the distributed optimizer loads into existing state tensors
            if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                opt._init_optimizer_states_with_dummy_values()
    loaded = _load_shards(_sharded_state_dict(model, optimizer, is_loading=True), path / MODEL_OPTIM_DIR)
    _unwrap(model).load_state_dict(loaded["model"])
    if optimizer is not None:
        with torch.no_grad():  # fp32 main params can be views of leaf parameters (in-place copy under autograd fails)
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    if scheduler is not None:
        scheduler.num_steps = 0
        scheduler.load_state_dict(state.scheduler)

    rng_file = path / RNG_DIR / f"rank_{_rank():05d}.pt"
    if same_world:  # every rank's file is there (check_complete)
        rng, error = None, None
        try:
            rng = torch.load(rng_file, weights_only=True)
        except Exception as e:  # noqa: BLE001 - truncated (RuntimeError from the zip reader), garbage (UnpicklingError)
            # torch's own advice for an unpickling failure (load with weights_only=False) does not apply to a damaged
            # file: then only the error's name
            why = "" if "weights_only" in str(e) else f": {str(e).splitlines()[0][:200]}" if str(e) else ""
            error = f"{rng_file}: damaged RNG state file ({type(e).__name__}{why})"
        if _world() > 1:  # every rank learns a damaged file of any rank: none waits in the barrier below
            errors: list[str | None] = [None] * _world()
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise CheckpointError(f"{error}; copy the step again or move {path} away to resume from the previous one")
        set_rng_state(rng)
    elif _rank() == 0:
        print(
            f"checkpoint: RNG states not restored: saved with world size {state.world_size}, now {_world()}",
            file=sys.stderr,
        )
    _barrier()
    return state


# ----------------------------------------------------------------------------------------------------------------------
# Export to a Hugging Face checkpoint


def check_export_dir(out_dir: str | Path, source: str | Path, hf_path: str | Path | None = None) -> None:
    """Refuse an export directory that would overwrite something: the checkpoint `source` or a folder in it,
    a directory holding a run (its own included: the HF config.json would replace the run's), the run's
    `model.hf_path` (`hf_path`), a file, or a non-empty directory that is not an earlier export (EXPORT_INFO_FILE).
    Symlinks are resolved first.

    Raises:
        CheckpointError: one line naming the directory and what it holds.
    """
    out, src = Path(out_dir).resolve(), Path(source).resolve()
    if hf_path is not None and out == Path(hf_path).resolve():
        raise CheckpointError(
            f"export directory {out_dir} is the run's model.hf_path ({hf_path}: the source of its reference weights "
            "and of every resume); choose another OUT_DIR"
        )
    if out == src or src in out.parents:
        raise CheckpointError(
            f"export directory {out_dir} is the checkpoint it exports ({src.name}) or inside it; choose another OUT_DIR"
        )
    if out == src.parent:
        raise CheckpointError(
            f"export directory {out_dir} is the run directory of the checkpoint it exports (its config.json would be "
            "overwritten); choose another OUT_DIR, e.g. a new directory inside it"
        )
    if out.is_dir() and (out / "config.json").is_file():
        held = [p.name for p in out.iterdir() if p.name == "metrics.jsonl" or (STEP_RE.match(p.name) and p.is_dir())]
        if held:
            raise CheckpointError(
                f"export directory {out_dir} holds a training run (config.json, {', '.join(sorted(held))}); the "
                "export would overwrite its config.json; choose another OUT_DIR"
            )
    if out.exists() and not out.is_dir():
        raise CheckpointError(
            f"export directory {out_dir} is an existing file, not a directory; choose another OUT_DIR"
        )
    if out.is_dir() and not (out / EXPORT_INFO_FILE).is_file():
        names = sorted(p.name for p in out.iterdir())
        if names:
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} entries)" if len(names) > 3 else "")
            raise CheckpointError(
                f"export directory {out_dir} is not empty ({shown}) and not an earlier export (no {EXPORT_INFO_FILE}); "
                "the export would overwrite files there: choose a new or empty OUT_DIR"
            )


def export(ckpt: str | Path, out_dir: str | Path) -> Path:
    """Write the policy of checkpoint `ckpt` (a run directory: its latest step; or a step_<N>) as an HF checkpoint
    in `out_dir`, from one process: built at TP = CP = EP = 1 from the saved config, written to `<OUT_DIR>.tmp`
    (hf_weights.export_hf, then EXPORT_INFO_FILE) and renamed to OUT_DIR when complete.

    Raises:
        CheckpointError: no complete checkpoint; a saved config this version cannot load (naming the key); the saved
            model.hf_path without config.json; those of read_run_state, check_export_dir, check_complete; a failed
            write (the free space; OUT_DIR as it was).
    """
    import config as config_mod
    import distributed
    import hf_weights
    import omni_model

    ckpt = Path(ckpt)
    path = ckpt if (ckpt / RUN_STATE_FILE).is_file() else latest_checkpoint(ckpt)
    if path is None:
        raise CheckpointError(f"{ckpt}: no complete checkpoint (step_<N>/ with {RUN_STATE_FILE})")
    state = read_run_state(path)
    try:
        cfg = config_mod.from_dict(state.config)
    except config_mod.ConfigError as e:
        raise CheckpointError(f"{path / RUN_STATE_FILE}: its config does not load in this version: {e}") from None
    check_export_dir(out_dir, path, cfg.model.hf_path)
    if not (Path(cfg.model.hf_path) / "config.json").is_file():  # the architecture and the files copied to out_dir
        raise CheckpointError(
            f"{path / RUN_STATE_FILE}: its model.hf_path = {cfg.model.hf_path!r} has no config.json seen from "
            f"{os.getcwd()}; run the export from the directory the training ran in"
        )
    check_complete(state, None)  # a missing or truncated shard file, before the model is built (no RNG file needed)
    out, staging = Path(out_dir), _export_staging(out_dir)
    info = {"source": os.path.abspath(path), "step": state.step,
            "model.hf_path": os.path.abspath(cfg.model.hf_path),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "complete": False}
    _write_export_info(staging, info, out_dir)  # before the model is built: an unwritable directory fails here
    for k in ("tensor_model_parallel_size", "context_parallel_size", "expert_model_parallel_size"):
        setattr(cfg.parallel, k, 1)
    cfg.parallel.sequence_parallel = False

    from megatron.core import tensor_parallel

    # a world of one on the device the model is built on (build_model: the GPU when there is one; nccl there, as in
    # training, gloo on the CPU); CUDA_VISIBLE_DEVICES= exports on the CPU (e.g. beside a job holding the GPUs)
    distributed.init_distributed(device=distributed.local_device())
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.mpo.seed)  # megatron's init needs its RNG tracker
    model = omni_model.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
    _use_in_process_write_queue()
    model_sd = model_sharded_state_dict(model)
    loaded = _load_shards({"model": model_sd}, path / MODEL_OPTIM_DIR)
    _unwrap(model).load_state_dict(loaded["model"])
    try:
        hf_weights.export_hf(model, staging, cfg.model.hf_path)
    except Exception as e:
        shutil.rmtree(staging, ignore_errors=True)
        failure = write_failure(e, staging.parent)
        if failure is None:
            raise
        free = free_space(staging.parent)
        raise CheckpointError(
            f"exporting {path} to {out_dir} failed: {type(failure).__name__}: {failure} ({free}); the partial export "
            f"{staging.name} was removed, {out_dir} is as it was"
        ) from None
    _write_export_info(staging, info | {"complete": True}, out_dir)  # after export_hf, which copies source files
    _replace_dir(staging, out)  # an earlier export or an empty directory (check_export_dir): replaced only now
    return out


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename the finished folder `src` to `dst`; an existing `dst` is first renamed to `<dst>.old`, removed after (a
    crash in between leaves `.old`, which the next run restores or removes)."""
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        dst.rename(old)
        src.rename(dst)
        shutil.rmtree(old)
    else:
        src.rename(dst)


def _export_staging(out_dir: str | Path) -> Path:
    """`<OUT_DIR>.tmp`, where an export is written before it replaces OUT_DIR; an interrupted export's
    `.tmp` and `.old` are removed first.

    Raises:
        CheckpointError: `<OUT_DIR>.tmp` or `<OUT_DIR>.old` exists and is not an export's.
    """
    out = Path(out_dir)
    for p in (out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")):
        if p.is_dir() and (p / EXPORT_INFO_FILE).is_file():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            raise CheckpointError(
                f"{p} exists and is not an interrupted export (no {EXPORT_INFO_FILE}); the export writes there "
                f"before it replaces {out_dir}: move it away or choose another OUT_DIR"
            )
    return out.with_name(out.name + ".tmp")


def _write_export_info(staging: Path, info: dict[str, Any], out_dir: str | Path) -> None:
    """Create `staging` (with its parents) and write EXPORT_INFO_FILE there.

    Raises:
        CheckpointError: a failed write (the reason and the free space); `staging` is removed.
    """
    try:
        staging.mkdir(parents=True, exist_ok=True)
        (staging / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        where = staging.parent if staging.parent.is_dir() else None
        free = f" ({free_space(where)})" if where else ""
        raise CheckpointError(f"export directory {out_dir} cannot be written: {e.strerror or e}{free}") from None


def main(argv: list[str] | None = None) -> int:
    """`python checkpoint.py export RUN_DIR OUT_DIR`: `export`, then `exported OUT_DIR` (exit 0), or one `error: ...`
    line on stderr (exit 1); a wrong command line gets argparse's usage and error (exit 2), `--help` the usage."""
    import argparse

    ap = argparse.ArgumentParser(prog="python checkpoint.py", description="Checkpoint tools of omni-mpo.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="export")
    ex = sub.add_parser(
        "export",
        help="write a checkpoint's policy as an HF checkpoint",
        description="Write the policy of a training checkpoint as an HF checkpoint that transformers loads "
        "(safetensors plus the config, tokenizer and processor files of the run's model.hf_path). Run it from the "
        "directory the training ran in: a relative model.hf_path is relative to it. Single process; the HF tensors are "
        "assembled in CPU memory.",
    )
    ex.add_argument("ckpt", metavar="RUN_DIR", help="a run directory (checkpoint.dir: its latest step_<N>) or one "
                    "step_<N>")  # fmt: skip
    ex.add_argument("out_dir", metavar="OUT_DIR", help="where to write the HF checkpoint: a new or empty directory, "
                    f"or an earlier export (it holds {EXPORT_INFO_FILE}); not the run, nor one holding a run, nor the "
                    "run's model.hf_path")  # fmt: skip
    args = ap.parse_args(argv)
    import config as config_mod

    config_mod.quiet_known_warnings()  # OMNI_MPO_SHOW_WARNINGS=1 shows them
    ckpt, out_dir = (os.path.expanduser(p) for p in (args.ckpt, args.out_dir))  # a quoted `~`, as config paths
    try:
        print(f"exported {export(ckpt, out_dir)}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torch.distributed and megatron-core's parallel state, set up once (`init_distributed`), the run's seeds, and
`agreed`, a load whose DataError on one rank stops every rank, and the stop signals: `StopSignal` (a rank finishes its
step, saves and exits 0, every rank after the same step) and the rule for the processes a rank forks (a stop is the
rank's: a worker, StepLoader's DataLoader workers or mmpr_index's pool, ignores the stop signals except its parent's
SIGTERM, which ends it).

    ctx = init_distributed(cfg, local_device(), num_experts)   # train.py; a tool: init_distributed()"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import config as config_mod
from mmpr_records import DataError


@dataclass
class Ctx:
    """This process's config, device and data / tensor / context-parallel groups, sizes and ranks."""

    cfg: Any  # config.Config
    device: torch.device
    dp: int  # data-parallel size
    dp_rank: int
    dp_group: Any
    tp_group: Any
    cp: int  # context-parallel size
    cp_rank: int
    cp_group: Any

    @classmethod
    def current(cls, cfg, device: torch.device) -> Ctx:
        from megatron.core import parallel_state as ps

        return cls(cfg=cfg, device=device, dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                   dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
                   cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                   cp_group=ps.get_context_parallel_group())


def local_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU (ConfigError: LOCAL_RANK has no GPU)."""
    if torch.cuda.is_available():
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= count:
            raise config_mod.ConfigError(
                f"LOCAL_RANK {local_rank}, but this node has {count} CUDA device(s): start one process per GPU at most "
                f"(torchrun --nproc-per-node {count}), or hide the GPUs (CUDA_VISIBLE_DEVICES=) for a CPU run")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_rank_size(group) -> tuple[int, int]:
    """(rank in `group`, its size); (0, 1) for None."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def from_rank0(value):
    """Rank 0's `value` on every rank (a broadcast of one picklable object; itself outside a process group)."""
    out = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(out, src=0)
    return out[0]


def init_distributed(cfg=None, device: torch.device | None = None, num_experts: int | None = None,
                     kernels=None) -> Ctx:
    """Process group (nccl on CUDA, else gloo; outside torchrun a world of one) and megatron-core's
    parallel state for `cfg.parallel` (sizes 1 without cfg); idempotent. ConfigError: config.validate_parallel.
    kernels: the process's kernel_selection.Kernels for megatron_patches.apply (None: probed there)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from backend import megatron_patches

    device = torch.device("cpu") if device is None else torch.device(device)
    if cfg is not None:
        config_mod.validate_parallel(cfg, int(os.environ.get("WORLD_SIZE", "1")), num_experts)
    megatron_patches.apply(kernels)
    if not dist.is_initialized():
        init = (
            {}
            if "RANK" in os.environ
            else {"init_method": f"tcp://127.0.0.1:{free_port()}", "rank": 0, "world_size": 1}
        )
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, **init)
        else:
            dist.init_process_group("gloo", **init)
    if not parallel_state.model_parallel_is_initialized():
        p = cfg.parallel if cfg is not None else config_mod.ParallelConfig()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        )
        model_parallel_cuda_manual_seed(0)
    return Ctx.current(cfg, device)


def seed_everything(seed: int) -> None:
    """Seed Python, numpy, torch and megatron-core's RNG tracker."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# Environment that deterministic mode needs (set by `set_deterministic` when unset; docs/DESIGN.md).
DETERMINISTIC_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),  # cuBLAS's reproducible workspaces
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),  # Transformer Engine's attention
    "MAMBA_DETERMINISTIC": ("1",),  # mamba-ssm's Triton kernels: no autotuning, deterministic backward
}


def check_deterministic_env(enabled: bool) -> None:
    """ConfigError when deterministic mode is on and a DETERMINISTIC_ENV variable disagrees."""
    if not enabled:
        return
    for name, good in DETERMINISTIC_ENV.items():
        value = os.environ.get(name)
        if value is not None and value not in good:
            raise config_mod.ConfigError(
                f"model.deterministic_mode = true but {name}={value!r} in the environment: unset it or set it to "
                + " or ".join(repr(g) for g in good)
            )


def set_deterministic(enabled: bool) -> None:
    """Set the unset DETERMINISTIC_ENV variables and torch's deterministic algorithms (warn_only);
    call before the first CUDA work."""
    if not enabled:
        return
    check_deterministic_env(enabled)
    late = "mamba_ssm" in sys.modules and "MAMBA_DETERMINISTIC" not in os.environ
    for name, good in DETERMINISTIC_ENV.items():
        os.environ.setdefault(name, good[0])
    torch.use_deterministic_algorithms(True, warn_only=True)
    if late and os.environ.get("RANK", "0") == "0":  # before init_distributed: torchrun's rank
        print("note: model.deterministic_mode: mamba-ssm was imported (with megatron-core's Mamba mixer) before the "
              "config was read, so its Triton kernels still autotune among several configs; export "
              "MAMBA_DETERMINISTIC=1 before the job starts for one fixed config each", file=sys.stderr)


def destroy_distributed() -> None:
    """Barrier, then tear down the parallel state and the process group."""
    if dist.is_initialized():
        from megatron.core import parallel_state

        dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def agreed(load, ctx: Ctx, errors: tuple[type[Exception], ...] = (DataError,)):
    """`load()` on every rank (collective): its result, or the error (one of `errors`, DataError by default) of the
    lowest failing rank, raised on every rank, so that none waits in a collective for a rank that stopped."""
    try:
        result, error = load(), None
    except errors as e:  # e.g. an image changed since the index was built
        result, error = None, e
    flag = torch.tensor([0 if error is None else 1], dtype=torch.long, device=ctx.device)
    dist.all_reduce(flag)
    if int(flag.item()) == 0:
        return result
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    raise next(e for e in errors if e is not None)


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}  # what ends a run (StopSignal)


@contextlib.contextmanager
def workers_start_deaf():
    """Fork data workers inside this block: the stop signals stay pending until `ignore_stop_signals`."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_stop_signals(*_) -> None:
    """A data worker's start (worker_init_fn, the index pool's initializer): ignore the stop signals (the rank's),
    except a SIGTERM from the parent, which ends the worker."""
    for sig in STOP_SIGNALS - {signal.SIGTERM}:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, {signal.SIGTERM})  # threads started from here on inherit the mask

    def exit_on_parents_sigterm() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != os.getppid():
            pass
        os._exit(0)

    threading.Thread(target=exit_on_parents_sigterm, name="parent_sigterm", daemon=True).start()


class StopSignal:
    """Remembers SIGTERM / SIGUSR1 / SIGINT / SIGHUP (repeats ignored) and, under torchrun, a launcher gone: the loop
    finishes the step, saves, exits 0. `should_stop()` is collective: every rank stops after the same step."""

    SIGNALS = tuple(sorted(STOP_SIGNALS))  # SIGHUP, SIGINT, SIGUSR1, SIGTERM (data workers ignore them)

    def __init__(self) -> None:
        self.received: int | None = None
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
        self.launcher = os.getppid() if under_torchrun else None  # its pid; a re-parented rank sees another
        for sig in self.SIGNALS:
            if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN:  # started under nohup: kept ignored
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum
        signal.signal(signum, signal.SIG_IGN)

    def launcher_gone(self) -> bool:
        """Whether this rank's torchrun is gone (re-parented); LOCAL_RANK 0 says so once on stderr."""
        if self.launcher is None or os.getppid() == self.launcher:
            return False
        if self.received is None and os.environ.get("LOCAL_RANK", "0") == "0":
            rank = os.environ.get("RANK", "0")  # torchrun's global rank
            print(f"rank {rank}: the launcher (pid {self.launcher}) is gone: the ranks of this node save after the "
                  "current step and stop", file=sys.stderr, flush=True)
        self.received = signal.SIGTERM  # the stop path of SIGTERM from here on
        return True

    def should_stop(self, device: torch.device) -> bool:
        """Whether any rank received a stop signal or lost its launcher (collective, after every step)."""
        return self._any_rank(self.launcher_gone() or self.received is not None, device)

    def interrupted(self, device: torch.device) -> bool:
        """Whether any rank received a Ctrl-C so far (collective; train.py asks once, before the first step)."""
        return self._any_rank(self.received == signal.SIGINT, device)

    @staticmethod
    def _any_rank(mine: bool, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if mine else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

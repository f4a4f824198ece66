"""The one distributed initialisation: torch.distributed and megatron-core's parallel state, for training (under
torchrun) and for everything that builds a model in a single process (checkpoint.py export, bench.py, tests).

    ctx = init_distributed(cfg, local_device(), num_experts)   # train.py: the layout of cfg.parallel
    init_distributed(device=torch.device("cpu"))               # a tool: a world of one, TP = CP = EP = PP = 1

Under torchrun the world comes from its environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); without it (plain
`python`, an in-process test) the world is one rank on a free local port. The backend follows the device: nccl for a
CUDA device, gloo for the CPU. Other modules read process groups from megatron-core's `parallel_state` (or from `Ctx`).

Tests: `pytest tests/test_train.py tests/test_checkpoint.py -k export`.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import config as config_mod


@dataclass
class Ctx:
    """What every step needs: the config, the step's device and the data/tensor/context-parallel groups, sizes and
    ranks of this process (read from megatron-core's parallel state by `Ctx.current`)."""

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
        """The Ctx of the initialised parallel state (after `init_distributed`)."""
        from megatron.core import parallel_state as ps

        return cls(
            cfg=cfg,
            device=device,
            dp=ps.get_data_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_group=ps.get_data_parallel_group(),
            tp_group=ps.get_tensor_model_parallel_group(),
            cp=ps.get_context_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_group=ps.get_context_parallel_group(),
        )


def local_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available (LOCAL_RANK 0 outside torchrun), else the CPU.

    Raises config.ConfigError when LOCAL_RANK names no CUDA device of this node (more processes per node than GPUs,
    e.g. the README's 2-rank CPU command on a one-GPU machine), before any process group or CUDA context exists.
    """
    if torch.cuda.is_available():
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= count:
            raise config_mod.ConfigError(
                f"LOCAL_RANK {local_rank}, but this node has {count} CUDA device(s): start one process per GPU at most "
                f"(torchrun --nproc-per-node {count}), or hide the GPUs (CUDA_VISIBLE_DEVICES=) for a CPU run")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reported free a moment ago (another process may still take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_rank_size(group) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size); (0, 1) for None (no process group: a world of one)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def init_distributed(cfg=None, device: torch.device | None = None, num_experts: int | None = None) -> Ctx:
    """torch.distributed and megatron-core parallel state for `cfg.parallel` (all sizes 1 when `cfg` is None) on
    `device` (None: the CPU); returns the `Ctx` of this process.

    The world is torchrun's (environment variables) or, without torchrun, one rank on a free local port. The backend
    is nccl for a CUDA device (which becomes the current device), gloo otherwise. cpu_compat's stand-ins for what this
    process lacks (TE, mamba-ssm, CUDA) are applied first. Idempotent: an existing process group or parallel state is
    kept. A parallel state created here seeds megatron's RNG tracker with 0 (seed_everything reseeds it).

    Raises:
        config.ConfigError: (with `cfg`) world size != TP·CP·DP, ETP·EP not dividing it, EP not dividing
            `num_experts`, or the global batch not divisible by DP (config.validate_parallel), before any process
            group exists.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import cpu_compat

    device = torch.device("cpu") if device is None else torch.device(device)
    if cfg is not None:
        config_mod.validate_parallel(cfg, int(os.environ.get("WORLD_SIZE", "1")), num_experts)
    cpu_compat.apply()
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
    """Python, numpy, torch and megatron-core's model-parallel RNG tracker (dropout is off; kept for any randomness)."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# The values of the environment variables that deterministic mode needs (set by `set_deterministic` when unset).
DETERMINISTIC_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),  # cuBLAS's reproducible workspaces (CUDA docs, "Results
    # reproducibility"); torch's deterministic mode needs one of them
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),  # Transformer Engine's attention; megatron-core's deterministic_mode
    # refuses to build TE attention without it
    "MAMBA_DETERMINISTIC": ("1",),  # mamba-ssm's Triton kernels: one fixed config each (no autotuning, whose choice
    # can vary between runs) and deterministic backward accumulation; read when mamba_ssm is imported
}


def check_deterministic_env(enabled: bool) -> None:
    """Refuse an environment that contradicts `model.deterministic_mode = true` (before any work).

    Raises:
        config.ConfigError: a variable of DETERMINISTIC_ENV is set to a value deterministic mode cannot run with.
    """
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
    """Deterministic kernels for this process when `enabled` (model.deterministic_mode); nothing otherwise.

    Sets the variables of DETERMINISTIC_ENV that are unset (before the first CUDA matmul and the model build: call it
    before `init_distributed`) and `torch.use_deterministic_algorithms(True, warn_only=True)`, which mamba-ssm's
    Triton kernels also read at run time. mamba-ssm fixes its autotuning configs when imported, which train.py does
    before reading the config: when it is imported already and MAMBA_DETERMINISTIC was not exported, one note line on
    stderr says to export it. megatron-core's own switch is TransformerConfig.deterministic_mode (omni_model). PyTorch's
    reproducibility notes (docs/source/notes/randomness.rst) list the ops it changes; on the CPU every kernel this job
    uses is deterministic already, and the switch only fills new uninitialised tensors (torch.empty) with NaN.

    Raises:
        config.ConfigError: `check_deterministic_env`.
    """
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
    """Wait for every rank, then tear down megatron-core's parallel state and the process group (no-op without one)."""
    if dist.is_initialized():
        from megatron.core import parallel_state

        dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

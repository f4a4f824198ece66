"""The one distributed initialisation: torch.distributed and megatron-core's parallel state, for training under
torchrun and for tools that build a model in one process (export, bench.py, tests).

    ctx = init_distributed(cfg, local_device(), num_experts)   # train.py: the layout of cfg.parallel
    init_distributed(device=torch.device("cpu"))               # a tool: a world of one

Without torchrun the world is one rank on a free local port. Other modules read the process groups from
megatron-core's `parallel_state` or from `Ctx`. Tests: tests/test_train.py, tests/test_checkpoint.py -k export.
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

    Raises:
        config.ConfigError: LOCAL_RANK names no CUDA device of this node (more ranks per node than GPUs).
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
    """torch.distributed and megatron-core's parallel state for `cfg.parallel` (all sizes 1 when `cfg` is None)
    on `device` (None: the CPU); returns this process's `Ctx`. nccl for CUDA, gloo otherwise; the CPU patches are
    applied first. Idempotent. A parallel state created here seeds megatron's RNG tracker with 0.

    Raises:
        config.ConfigError: (with `cfg`) config.validate_parallel's rules, before any process group exists.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import megatron_patches

    device = torch.device("cpu") if device is None else torch.device(device)
    if cfg is not None:
        config_mod.validate_parallel(cfg, int(os.environ.get("WORLD_SIZE", "1")), num_experts)
    megatron_patches.apply()
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
    """With `enabled` (model.deterministic_mode): set the unset variables of DETERMINISTIC_ENV (call before
    `init_distributed`: before the first CUDA matmul) and `torch.use_deterministic_algorithms(True, warn_only=True)`,
    which mamba-ssm's Triton kernels read too. mamba-ssm fixes its autotuning when imported: imported already without
    MAMBA_DETERMINISTIC exported, one note on stderr says to export it.

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

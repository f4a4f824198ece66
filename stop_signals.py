"""The stop signals of a run: `StopSignal` (a rank finishes its step, saves and exits 0) and the rule for the processes
a rank forks: a stop is the rank's, so a worker (StepLoader's DataLoader workers, mmpr_index's pool) ignores the stop
signals, except its parent's SIGTERM, which ends it. Tests: tests/test_mmpr_data.py, tests/test_checkpoint.py."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

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

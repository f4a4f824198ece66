"""The stop signals of a run and the rule for the worker processes a rank forks: a stop is the rank's to handle
(monitor.StopSignal), so a worker (mmpr_data.StepLoader's DataLoader workers, mmpr_index's index pool) ignores them,
except a SIGTERM from its parent, which ends it. Tests: tests/test_mmpr_data.py."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}  # what ends a run (monitor.StopSignal)


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

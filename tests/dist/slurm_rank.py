"""A stand-in for train.py under the real slurm/train.sbatch launcher (tests/test_slurm.py copies it to a fake repo's
train.py; train.sbatch starts it through srun -> run_node -> torchrun on two CPU ranks).

It keeps train.py's SIGUSR1 contract: SIGUSR1 is ignored during start-up (RANK_STARTUP_S seconds: imports, model
build), then noted once and ignored when repeated; the rank writes `ready<RANK>` into argv[1] (the run's CONFIG
argument, here a directory) once its handler is installed, and `saved<RANK>` holding the number of SIGUSR1 it noted
when it stops (exit 0), or after 60 s without one (exit 3).
"""

import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
time.sleep(float(os.environ.get("RANK_STARTUP_S", "0")))  # imports, model build: SIGUSR1 is still SIG_IGN here
got = []


def on_usr1(signum, frame):  # the contract for train.py: note it, then ignore repeats (a second USR1 can arrive
    got.append(signum)  # during interpreter shutdown, when Python has restored the default action: death)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


signal.signal(signal.SIGUSR1, on_usr1)
(out / f"ready{os.environ['RANK']}").write_text("")
deadline = time.time() + 60
while not got and time.time() < deadline:
    time.sleep(0.05)
(out / f"saved{os.environ['RANK']}").write_text(str(len(got)))
sys.exit(0 if got else 3)

"""2-rank check that a failed wandb.init stops every rank (run by tests/test_train.py through the `torchrun` fixture).

wandb.init is replaced by one that raises wandb's CommError (what a node without internet gets, after retrying, from
a real W&B). Only rank 0 calls it; monitor.MetricsLog broadcasts the outcome, so rank 1 raises the same ConfigError
instead of waiting in the next collective. Each rank reports the message it raised and how often it called wandb.init;
a barrier after the expected error proves no rank is left behind in a collective.

Environment: RUN_DIR (checkpoint.dir).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import report  # noqa: E402  (tests/dist/report.py, beside this file)
import torch.distributed as dist  # noqa: E402
import wandb  # noqa: E402

import config as config_mod  # noqa: E402
import monitor  # noqa: E402

CALLS = []


def failing_init(**kwargs):
    CALLS.append(kwargs["mode"])
    raise wandb.errors.CommError("Failed to get resume status for run x2lafkpm: context deadline exceeded\n(more)")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a rank left waiting fails the launch in 60 s
    wandb.init = failing_init
    cfg = config_mod.load_config(None, [f"checkpoint.dir={os.environ['RUN_DIR']}", "logging.wandb=online"])
    try:
        monitor.MetricsLog(cfg, None, resumed_step=0, rank=dist.get_rank())
        err = None
    except config_mod.ConfigError as e:
        err = str(e)
    dist.barrier()
    report.write({"err": err, "calls": CALLS})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

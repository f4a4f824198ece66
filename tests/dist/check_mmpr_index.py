"""2-rank check of mmpr_index's rank-0 index build (run by tests/test_mmpr_data.py through the `torchrun` fixture).

Environment: MODEL (the processor's directory), META (a good meta.json), BAD_META (one whose only row is dropped),
HF_DATASETS_CACHE (the shared index cache, empty at start). Rank 0 builds the index and every other rank reads rank 0's
cache; each rank reports (tests/dist/report.py) its cache status, pair count, chosen lengths, the sampler's global
order, and the DataError a strict build of BAD_META raised on it (rank 0's own, the others' naming rank 0's failure).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import report  # noqa: E402  (tests/dist/report.py, beside this file)
import torch.distributed as dist  # noqa: E402
from transformers import AutoProcessor  # noqa: E402

import mmpr_data as md  # noqa: E402
import mmpr_index as mi  # noqa: E402
from config import Config  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    p = AutoProcessor.from_pretrained(os.environ["MODEL"])
    cfg = Config()
    index = mi.build_index(os.environ["META"], p, cfg.data)
    sampler = md.PairSampler(list(range(len(index))), seed=cfg.data.train.seed)
    order = sampler.take(len(index)) + sampler.take(3)
    cfg.data.strict = True
    try:
        mi.build_index(os.environ["BAD_META"], p, cfg.data)
        err = None
    except mi.DataError as e:
        err = str(e)
    # one report per rank: two ranks printing long lines to one pipe can interleave them
    report.write({"rank": rank, "status": index.cache_status, "n": len(index), "order": order,
                  "lens": index.chosen_len.tolist(), "err": err})  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

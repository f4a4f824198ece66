"""The result channel of the multi-rank workers in tests/dist/: each rank writes one JSON document.

`write(obj)` stores `obj` (JSON-serialisable) as rank<r>.json in the directory the `torchrun` fixture of
tests/conftest.py names in OMNI_MPO_TEST_RESULT_DIR; the fixture returns it as `Launch.ranks[r]` (rank 0's as
`Launch.result`). Run by hand (no such variable), the document is printed instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULT_DIR_ENV = "OMNI_MPO_TEST_RESULT_DIR"


def write(obj, rank: int | None = None) -> None:
    """Report `obj` for `rank` (default: this process's RANK from torchrun, 0 without one)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    text = json.dumps(obj, indent=1)
    out = os.environ.get(RESULT_DIR_ENV)
    if out is None:
        print(f"rank {rank}: {text}", flush=True)
        return
    tmp = Path(out) / f".rank{rank}.json.tmp"
    tmp.write_text(text)
    tmp.rename(Path(out) / f"rank{rank}.json")  # complete or absent

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


def failure(error: Exception) -> dict:
    """A layout's failure as its result ({"error": "Type: message"}), its traceback printed and megatron-core's
    parallel state torn down so the worker's next layout can initialise its own."""
    import traceback

    from megatron.core import parallel_state

    traceback.print_exc()
    parallel_state.destroy_model_parallel()
    return {"error": f"{type(error).__name__}: {error}"}

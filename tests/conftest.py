"""Shared pytest setup: CPU-only runs, no torch.compile, repo root importable."""

import os
import sys
from pathlib import Path

# megatron-core compiles router helpers with torch.compile: seconds per first call on CPU
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

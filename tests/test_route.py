"""docs/DESIGN.md's table of one training step is what docs/route.py measures now (two traced tiny runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_design_md_route_table_is_the_route_scripts():
    """docs/DESIGN.md's table of one step is what `python docs/route.py` prints now (two traced tiny runs, about a
    minute each): the numbers are reported there, not targeted here."""
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "route.py")], capture_output=True, text=True, cwd=ROOT,
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout.strip()
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    assert table in design, f"docs/DESIGN.md's route table is stale; `python docs/route.py` prints:\n{table}"

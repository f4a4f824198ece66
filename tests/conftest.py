"""Shared pytest setup: CPU-only runs, no torch.compile, repo root importable, and the one multi-rank harness.

The `torchrun` fixture is how every test starts more than one process: `torchrun(script, *args, nproc=2)` runs
`python -m torch.distributed.run --standalone --nproc-per-node N script args` from the repo root and returns a
`Launch`. A worker (tests/dist/*.py) reports through tests/dist/report.py: each rank's `report.write(obj)` lands as
JSON in `Launch.ranks[rank]`, rank 0's also in `Launch.result`. train.py launches report through the run's own
metrics.jsonl and checkpoints.

`raises_naming(ErrorType, *names)` is how a test expects an error: its type, and the keys / paths / rows / values its
one-line message names (what the user fixes), not the prose around them; `warns_naming` the same for a warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# megatron-core compiles router helpers with torch.compile: seconds per first call on CPU
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")  # it overrides logging.wandb: a W&B-mode test sets or unsets it
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test reaches the hub: hub ids resolve from a prepared cache

ROOT = Path(__file__).resolve().parents[1]
DIST = Path(__file__).resolve().parent / "dist"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULT_DIR_ENV = "OMNI_MPO_TEST_RESULT_DIR"  # where tests/dist/report.py writes rank<r>.json


@contextmanager
def raises_naming(error: type[BaseException], *names: object) -> Iterator[pytest.ExceptionInfo]:
    """`pytest.raises(error)` whose message also names each of `names` (a config key, a file path, a row, a value:
    `str(name)` found in it); yields the ExceptionInfo. An error of another type, or about another key, fails."""
    assert names, "name at least one key, path or value the error must name"
    with pytest.raises(error) as info:
        yield info
    text = str(info.value)
    missing = [str(n) for n in names if str(n) not in text]
    assert not missing, f"{type(info.value).__name__} does not name {missing}: {text!r}"


@contextmanager
def warns_naming(category: type[Warning], *names: object) -> Iterator[list]:
    """`pytest.warns(category)` where one warning of that category names each of `names` (as `raises_naming`)."""
    assert names, "name at least one key, path or value the warning must name"
    with pytest.warns(category) as record:
        yield record
    texts = [str(w.message) for w in record if issubclass(w.category, category)]
    assert any(all(str(n) in t for n in names) for t in texts), f"no {category.__name__} names all of {names}: {texts}"


HUB_ID = "omni-mpo-test/tiny-omni"  # a hub id (no such local folder) served from `make_hub_cache`
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(cache: Path, src: Path = ROOT / "assets" / "tiny-omni", repo_id: str = HUB_ID,
                   revision: str = HUB_REVISION) -> Path:
    """The files of `src` in a hub cache `cache` laid out as huggingface_hub writes it: models--org--name/blobs/
    <hash> (sha256 for *.safetensors as for LFS files, git's blob sha1 for the others), snapshots/<revision>/<name>
    symlinks to ../../blobs/<hash>, refs/main; returns the snapshot folder."""
    import hashlib

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / revision
    for d in (repo / "blobs", snap, repo / "refs"):
        d.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        data = f.read_bytes()
        lfs = f.suffix == ".safetensors"
        blob = hashlib.sha256(data) if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data)
        (repo / "blobs" / blob.hexdigest()).write_bytes(data)
        (snap / f.name).symlink_to(f"../../blobs/{blob.hexdigest()}")
    return snap


@dataclass
class Launch:
    """One finished torchrun launch: exit status, the whole stdout / stderr, and the workers' JSON reports."""

    returncode: int
    stdout: str
    stderr: str
    ranks: dict[int, object] = field(default_factory=dict)  # rank -> what that rank passed to report.write

    @property
    def result(self):
        """Rank 0's report (KeyError naming the launch's output when rank 0 wrote none)."""
        if 0 not in self.ranks:
            raise KeyError(f"rank 0 wrote no report; stdout tail:\n{self.stdout[-3000:]}\nstderr tail:\n"
                           f"{self.stderr[-6000:]}")
        return self.ranks[0]


class Torchrun:
    """The multi-rank launcher behind the `torchrun` fixture (one per session; each call is its own launch)."""

    def __init__(self, tmp_root: Path):
        self._tmp_root = tmp_root
        self._count = 0

    @staticmethod
    def argv(script: str | Path, *args: str, nproc: int = 2) -> list[str]:
        """The command line: `script` relative to the repo root (train.py) or absolute (a tests/dist worker)."""
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                str(script), *map(str, args)]  # fmt: skip

    @staticmethod
    def env(extra: dict[str, str | None] | None = None) -> dict[str, str]:
        """The launch environment: this one, no torch.compile, wandb off and no API key, plus `extra` (a None value
        removes the variable)."""
        e = dict(os.environ, TORCHDYNAMO_DISABLE="1", WANDB_MODE="disabled")
        e.pop("WANDB_API_KEY", None)
        for k, v in (extra or {}).items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = v
        return e

    def start(self, script: str | Path, *args: str, nproc: int = 2,
              env: dict[str, str | None] | None = None) -> subprocess.Popen:  # fmt: skip
        """The same launch without waiting, in a session of its own (so a test can signal the whole process group as
        a terminal's Ctrl-C does); stdout / stderr are text pipes. No report directory: signal tests read the run."""
        return subprocess.Popen(self.argv(script, *args, nproc=nproc), cwd=ROOT, env=self.env(env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip

    def __call__(self, script: str | Path, *args: str, nproc: int = 2, env: dict[str, str | None] | None = None,
                 timeout: int = 300, check: bool = True) -> Launch:  # fmt: skip
        """Run `script` on `nproc` ranks and wait; with `check`, a non-zero exit fails the test with the output tails.

        `env` is added to `Torchrun.env()`; a worker's report directory is set in it (OMNI_MPO_TEST_RESULT_DIR).
        """
        self._count += 1
        result_dir = self._tmp_root / f"launch{self._count}"
        result_dir.mkdir(parents=True)
        proc = subprocess.run(self.argv(script, *args, nproc=nproc), cwd=ROOT,
                              env=self.env({**(env or {}), RESULT_DIR_ENV: str(result_dir)}), capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in result_dir.glob("rank*.json")}
        launch = Launch(proc.returncode, proc.stdout, proc.stderr, ranks)
        if check:
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return launch


@pytest.fixture(scope="session")
def torchrun(tmp_path_factory) -> Torchrun:
    """`torchrun(script, *args, nproc=2, env=None, timeout=300, check=True) -> Launch`, `torchrun.start(...)` ->
    Popen; see `Torchrun`."""
    return Torchrun(tmp_path_factory.mktemp("torchrun"))

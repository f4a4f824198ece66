"""model.hf_path's files: a local directory, or a Hugging Face hub id resolved in the hub cache (`resolve_model`,
then `model_dir` is the folder every reader opens), and the model's identity wherever its files live (`model_files`).
Errors are one ConfigError line naming the id. docs/RUNNING.md, "The real model"; docs/DESIGN.md, "Model files".
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from config import ConfigError, ModelConfig

HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")  # org/name
# the files a job reads from a model (train.py, plan.py, hf_export.py, mmpr_index.py): all that is downloaded
MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "processor_config.json", "preprocessor_config.json", "chat_template.jinja",
               "chat_template.json")
SMALL_MODEL_FILES = tuple(p for p in MODEL_FILES if "safetensors" not in p)  # plan.py's: no weights
HUB_WAIT_ENV = "OMNI_MPO_HUB_WAIT_S"  # seconds a process waits for another one downloading the same id


@dataclass(frozen=True)
class Snapshot:
    """A hub model resolved in the local cache: its id, the commit of the revision, the snapshot directory."""

    id: str
    revision: str
    path: str


_snapshots: dict[tuple[str, str], Snapshot] = {}  # (id, revision asked) -> Snapshot, once a process


def is_hub_id(hf_path: str) -> bool:
    """True when `hf_path` has the form org/name and neither it nor its org is a local directory (a path then)."""
    return bool(HUB_ID_RE.match(hf_path)) and ".." not in hf_path and not Path(hf_path.split("/")[0]).is_dir()


def resolve_model(cfg, files: tuple[str, ...] = MODEL_FILES, local_only: bool = False) -> Snapshot | None:
    """Resolve a hub id in model.hf_path (`hub_snapshot`), pin cfg.model.hf_revision to its commit in place and print
    the snapshot once (RANK 0); None for a local directory or a path (model.hf_path is then used as is)."""
    m = cfg.model
    if not is_hub_id(m.hf_path):
        return None
    if (snap := _snapshots.get((m.hf_path, m.hf_revision))) is not None:
        return snap
    snap = hub_snapshot(m.hf_path, m.hf_revision, files, local_only)
    if os.environ.get("RANK", "0") == "0":
        print(f"model.hf_path = {snap.id}: hub snapshot {snap.revision} in {snap.path}", flush=True)
    _snapshots[(m.hf_path, m.hf_revision)] = _snapshots[(m.hf_path, snap.revision)] = snap
    m.hf_revision = snap.revision
    return snap


def model_dir(m: ModelConfig) -> str:
    """The local directory of model.hf_path: itself, or its hub snapshot (resolved with `resolve_model` first)."""
    if not is_hub_id(m.hf_path):
        return m.hf_path
    snap = _snapshots.get((m.hf_path, m.hf_revision))
    return (snap or hub_snapshot(m.hf_path, m.hf_revision)).path


def hub_snapshot(repo_id: str, revision: str = "", files: tuple[str, ...] = MODEL_FILES, local_only: bool = False,
                 key: str = "model.hf_path") -> Snapshot:
    """huggingface_hub's snapshot_download of `files` of `repo_id` at `revision` ("" = main) into the hub cache
    (HF_HUB_CACHE, else HF_HOME/hub; HF_TOKEN, HF_HUB_OFFLINE honoured), with its progress bars. Under torchrun
    LOCAL_RANK 0 downloads and the node's other ranks wait for its commit (`_node_marker`), then read the cache; one
    process at a time per cache (a file lock). Each wait lasts up to OMNI_MPO_HUB_WAIT_S seconds. ConfigError: one
    line naming `key`, the id and what to do."""
    import filelock
    from huggingface_hub import constants
    from huggingface_hub import errors as hub_errors

    key, cache = f"{key} = {repo_id!r}", Path(constants.HF_HUB_CACHE)
    wait = float(os.environ.get(HUB_WAIT_ENV, 4 * 3600))
    marker = _node_marker(repo_id)
    if marker is not None and os.environ["LOCAL_RANK"] != "0":  # LOCAL_RANK 0 resolves: its commit, from the cache
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
        deadline = time.monotonic() + wait
        while not marker.is_file():
            if time.monotonic() > deadline:
                raise ConfigError(f"{key}: waited {wait:.0f} s for local rank 0 downloading it into {cache}; raise "
                                  f"{HUB_WAIT_ENV} for a slow download")
            time.sleep(0.5)
        if (revision := json.loads(marker.read_text())) is None:
            raise ConfigError(f"{key}: local rank 0 could not resolve it (its error line says why)")
        local_only = True
    lock = filelock.FileLock(cache / ".locks" / f"omni-mpo--{repo_id.replace('/', '--')}.lock")
    path = None
    try:
        (cache / ".locks").mkdir(parents=True, exist_ok=True)
        with lock.acquire(timeout=wait):
            path = _download(repo_id, revision, files, local_only)
    except filelock.Timeout:
        raise ConfigError(f"{key}: waited {wait:.0f} s for another process downloading it into {cache} (lock "
                          f"{lock.lock_file}); raise {HUB_WAIT_ENV}, or remove the lock if no download runs") from None
    except hub_errors.GatedRepoError:
        raise ConfigError(f"{key} is a gated model: accept its terms at https://huggingface.co/{repo_id} and set "
                          "HF_TOKEN (or run `hf auth login`)") from None
    except hub_errors.RevisionNotFoundError:
        raise ConfigError(f"{key}: model.hf_revision = {revision!r} is not a branch, tag or commit of it") from None
    except hub_errors.RepositoryNotFoundError:
        raise ConfigError(f"{key} is neither a local directory (relative to {os.getcwd()}) nor a model on the "
                          "Hugging Face hub (a private one needs HF_TOKEN): check the path or the id") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.IncompleteSnapshotError) as e:
        why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        what = "no complete" if isinstance(e, hub_errors.IncompleteSnapshotError) else "no"
        raise ConfigError(f"{key}: {what} copy of revision {revision or 'main'} in the hub cache {cache} and {why}: "
                          f"download it where the hub is reachable (`hf download {repo_id}` with the same HF_HOME) "
                          "or set model.hf_path to a local directory") from None
    except hub_errors.HfHubHTTPError as e:
        raise ConfigError(f"{key}: the hub refused the download ({' '.join(str(e).split())[:200]})") from None
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise ConfigError(f"{key}: no space left in the hub cache {cache} while downloading it: free space there, or "
                          "set HF_HUB_CACHE (or HF_HOME) to a larger disk") from None
    finally:
        if marker is not None and os.environ["LOCAL_RANK"] == "0":  # the node's other ranks wait for it
            with contextlib.suppress(OSError):
                marker.write_text(json.dumps(Path(path).name if path else None))
    return Snapshot(repo_id, Path(path).name, path)


def _download(repo_id: str, revision: str, files: tuple[str, ...], local_only: bool) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision or None, allow_patterns=list(files),
                             local_files_only=local_only)


def _node_marker(repo_id: str) -> Path | None:
    """Under torchrun, the node-local file where LOCAL_RANK 0 puts the commit it resolved `repo_id` to (JSON; null
    when it failed): named by the torchrun agent's pid, the parent of every rank of the node. None outside torchrun."""
    if "LOCAL_RANK" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    import tempfile

    name = f"omni-mpo-hub-{os.getuid()}-{os.getppid()}-{repo_id.replace('/', '--')}.json"
    return Path(tempfile.gettempdir()) / name


# -- the model's identity: what a resume, a LoRA base and the stored reference values compare

def short_digest(rows: list[str]) -> str:
    """16 hex digits of the sha256 of `rows`, one per line."""
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_model_hashes: dict[tuple, dict[str, str]] = {}  # (folder, names, sizes, times) -> model_file_hashes, once a process


def content_sha256(path: Path) -> str:
    """sha256 of the file at `path`; the hub's own where it recorded one (the name of an LFS file's blob in the hub
    cache, its etag; the etag `hf download --local-dir` stores beside a file not changed since), else read."""
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs" and SHA256_RE.match(real.name):
        return real.name
    if (path.parent / ".cache" / "huggingface" / "download" / f"{path.name}.metadata").is_file():
        with contextlib.suppress(Exception):  # a damaged or foreign record: the content is read
            from huggingface_hub._local_folder import read_download_metadata

            meta = read_download_metadata(path.parent, path.name, lock=False)
            if meta is not None and SHA256_RE.match(meta.etag):
                return meta.etag
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_file_hashes(hf_path: str | Path) -> dict[str, str]:
    """{file name: "<bytes>:<sha256>"} of the files a job reads in the model folder `hf_path` (MODEL_FILES):
    the model's identity, the same for a hub snapshot (symlinks into blobs/) and its files copied anywhere; other
    files (a README) do not count. Rank 0 reads, every rank gets its answer (collective); once a process while the
    files' sizes and times stay."""
    files = sorted(p for p in Path(hf_path).iterdir()
                   if p.is_file() and any(fnmatch(p.name, pat) for pat in MODEL_FILES))
    key = (os.path.realpath(hf_path), *((p.name, s.st_size, s.st_mtime_ns) for p in files for s in [p.stat()]))
    if key not in _model_hashes:
        import torch.distributed as dist  # here: model_hub stays stdlib-only for slurm/train.sbatch's submit check

        import distributed

        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        rows = {p.name: f"{p.stat().st_size}:{content_sha256(p)}" for p in files} if rank0 else None
        _model_hashes[key] = distributed.from_rank0(rows)
    return _model_hashes[key]


def model_files(hf_path: str | Path) -> str:
    """16 hex digits over `model_file_hashes`: the model the frozen reference is read from (collective)."""
    return short_digest([f"{n}:{v}" for n, v in sorted(model_file_hashes(hf_path).items())])


def base_model_digest(hf_path: str | Path) -> str:
    """16 hex digits over `model_file_hashes` of model.hf_path's *.safetensors and config.json: the base weights a
    LoRA checkpoint's adapters belong to, wherever the files live. Collective."""
    return short_digest([f"{n}:{v}" for n, v in sorted(model_file_hashes(hf_path).items())
                         if n.endswith(".safetensors") or n == "config.json"])

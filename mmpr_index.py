"""The MMPR index: every record of a meta-recipe checked once (mmpr_records.checked_records), its lengths cached, the
splits, and the pre-flight report.

`build_index(meta_path, processor, cfg.data) -> MMPRIndex` keeps per pair its source (subset, file, line, byte offset),
its image paths and grids, and the token lengths of its prompt and sequences: enough for pack.py to plan bins without
opening an image. Dropped records are counted by reason (mmpr_records.DROP_REASONS). The index is cached under the HF
datasets cache in a folder named by a fingerprint of the meta file, the annotation files (size, mtime), the processor
and the settings that change it; under torch.distributed global rank 0 builds it while the others wait.
`load_splits(processor, cfg.data)` gives the train and validation `Split`s.

    python mmpr_index.py data/mmpr_sample/MMPR-sample/meta.json --model assets/tiny-omni [--max-samples N] [--json]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distributed import ignore_stop_signals, workers_start_deaf
from mmpr_data import MMPRIndex
from mmpr_media import apply_video_settings, fill_video_norm
from mmpr_records import (
    DataError,
    DataWarning,
    Subset,
    apply_repeat_time,
    begin_record_checks,
    checked_records,
    data_warnings,
    end_record_checks,
    plural,
    read_meta,
)

logger = logging.getLogger("omni_mpo.mmpr_index")

CACHE_VERSION = 7  # bump when the index layout or the validation rules change: old caches are then ignored
CACHE_PREFIX = "omni_mpo_mmpr_"
# How long the other ranks wait for rank 0's build: hours over a full MMPR release (NCCL's default is 10 minutes).
INDEX_BUILD_TIMEOUT = timedelta(hours=24)

# ---- Fingerprint and cache folder ----------
def _cache_root() -> Path:
    """HF datasets' cache folder: $HF_DATASETS_CACHE, else $HF_HOME/datasets, else ~/.cache/huggingface/datasets."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "datasets"
    return Path("~/.cache/huggingface/datasets").expanduser()


def load_processor(model_dir: str | Path, key: str):
    """The model's transformers processor; DataError naming `key` when `model_dir` has none or no config.json."""
    if not (Path(model_dir) / "config.json").is_file():
        raise DataError(f"{key} {str(model_dir)!r}: no config.json there (a local model directory with the tokenizer, "
                        f"chat template and processor; relative paths are relative to {os.getcwd()})")
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_dir)
        fill_video_norm(processor)  # a property of the loaded processor, not of data.video's settings
        # the model's EVS rate: a record holds the video tokens the model keeps (mmpr_media.expand_video)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        processor.video_pruning_rate = float(config.get("video_pruning_rate") or 0.0)
        return processor
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())
        raise DataError(f"{key} {str(model_dir)!r}: transformers cannot load its processor: {reason}") from None


def processor_identity(processor) -> str:
    """sha256 of what the index depends on in the processor: tokenizer (vocab, merges, added tokens), chat template,
    image- and video-processor config and the model's video_pruning_rate; by content, so a copied model folder hits
    the same cache and an edited one misses."""
    tok = processor.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    h = hashlib.sha256()
    h.update((backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))).encode())
    h.update(str(processor.chat_template).encode())
    h.update(processor.image_processor.to_json_string().encode())
    h.update(processor.video_processor.to_json_string().encode())  # with data.video's settings on it
    h.update(repr(getattr(processor, "video_pruning_rate", 0.0)).encode())  # EVS: the video tokens a record keeps
    if getattr(processor, "feature_extractor", None) is not None:  # mel features and audio token counts
        h.update(processor.feature_extractor.to_json_string().encode())
        h.update(json.dumps([getattr(processor, k, None) for k in ("audio_sampling_rate", "audio_hop_length",
                                                                   "audio_subsampling_factor")]).encode())
    h.update(type(processor).__name__.encode())
    return h.hexdigest()


def index_fingerprint(meta_path: str | Path, subsets: Sequence[Subset], processor, settings: dict) -> str:
    """sha256 of the meta file, each annotation's path, size and mtime, each root's mtime, the processor, `settings`."""
    h = hashlib.sha256()
    h.update(Path(meta_path).read_bytes())
    for s in subsets:
        st = s.annotation.stat()
        root_mtime = s.root.stat().st_mtime_ns if s.root is not None else None
        h.update(f"|{s.name}|{s.annotation}|{st.st_size}|{st.st_mtime_ns}|{s.root}|{root_mtime}".encode())
    h.update(processor_identity(processor).encode())
    h.update(json.dumps({**settings, "cache_version": CACHE_VERSION}, sort_keys=True).encode())
    return h.hexdigest()


# ---- Build, cache, load ----------
def not_jsonl_hint(annotation: str | Path, st: dict) -> str | None:
    """Why `annotation` (a subset with stats `st`) is not JSON Lines, or None: some records are invalid_json and its
    first line opens a JSON array (a `json.dump(records, indent=...)` export), or all records are."""
    bad, records = st.get("dropped", {}).get("invalid_json", 0), st.get("rows_read", 0)
    if not bad:
        return None
    with open(annotation, "rb") as f:
        first = next((raw for raw in f if raw.strip()), b"").removeprefix(b"\xef\xbb\xbf").strip()
    try:
        json.loads(first)
        opens_array = False
    except (json.JSONDecodeError, UnicodeDecodeError):
        opens_array = first.startswith(b"[")
    if opens_array:
        why = "its first line opens a JSON array"
    elif bad == records:
        why = f"none of its {records} non-blank lines is a JSON object"
    else:
        return None
    example = st.get("drop_examples", {}).get("invalid_json", ["?"])[0]
    return (f"{annotation} is not JSON Lines ({why}): an annotation file must be JSONL, one JSON object per line "
            f"(e.g. {example})")


def _build(meta_path: Path, subsets: list[Subset], processor, data, max_samples: int, fingerprint: str) -> MMPRIndex:
    """Check every record of every subset (see build_index)."""
    t0 = time.perf_counter()
    begin_record_checks(processor, data.train.max_images_per_row, data.max_seq_length, data.video.max_frames,
                     data.train.max_audio_seconds)
    image_paths: list[str] = []
    path_ids: dict[str, int] = {}
    cols: dict[str, list] = collections.defaultdict(list)  # per-pair columns
    img_cols: dict[str, list] = collections.defaultdict(list)  # per-image columns
    audio_cols: dict[str, list] = collections.defaultdict(list)  # per-clip columns
    audio_paths: list[str] = []
    audio_ids: dict[str, int] = {}
    video_cols: dict[str, list] = collections.defaultdict(list)  # per-video-file columns
    video_paths: list[str] = []
    video_ids: dict[str, int] = {}
    stats: dict[str, dict] = {}
    first_seen: dict[str, tuple[str, str]] = {}  # a valid record's content digest -> (subset, "file:line") of its first
    pool = None
    if data.num_workers >= 2:  # forked workers inherit the processor (no pickling); rendering is CPU bound
        import multiprocessing

        with workers_start_deaf():  # a stop is the rank's
            pool = concurrent.futures.ProcessPoolExecutor(data.num_workers, initializer=ignore_stop_signals,
                                                        mp_context=multiprocessing.get_context("fork"))
            pool.submit(int).result()  # forks every worker now (a fork pool starts them all at its first task)

    def drop(st: dict, where: str, reason: str, detail: str) -> None:
        if data.strict:
            raise DataError(f"{where}: record dropped ({reason}: {detail}) and data.strict = true")
        st["dropped"][reason] = st["dropped"].get(reason, 0) + 1
        st.setdefault("first_drop", {"where": where, "reason": reason, "detail": detail})
        ex = st["drop_examples"].setdefault(reason, [])
        if len(ex) < 3:
            ex.append(f"{where}: {detail}")

    def new_stats(sub: Subset, **more) -> dict:
        return {"rows_read": 0, "valid": 0, "pairs": 0, "dropped": {}, "drop_examples": {},
                "repeat_time": sub.repeat_time, **more}

    try:
        for sid, sub in enumerate(subsets):
            st = stats[sub.name] = new_stats(sub)
            exact = sub.repeat_time == 1.0  # records map 1:1 to pairs: reading can stop at max_samples
            valid: list[dict] = []
            stopped_early = False
            records = checked_records(pool, data.num_workers, str(sub.root or ""), sub.annotation, sub.name)
            for lineno, offset, res in records:  # settled in file order, so stats stop exactly where reading stops
                st["rows_read"] += 1
                if isinstance(res, tuple):
                    drop(st, f"{sub.annotation}:{lineno}", *res)
                    continue
                valid.append({**res, "line": lineno, "offset": offset})
                where = f"{sub.annotation}:{lineno}"
                if (first := first_seen.setdefault(res["digest"], (sub.name, where))) != (sub.name, where):
                    st["repeats"] = st.get("repeats", 0) + 1
                    other = "" if first[0] == sub.name else f" of subset {first[0]!r}"
                    st.setdefault("first_repeat", f"{where} repeats {first[1]}{other}")
                if exact and max_samples and len(cols["line"]) + len(valid) >= max_samples:
                    stopped_early = True
                    records.close()
                    break
            notes = []  # kept in the index's stats, so that a cache hit repeats them (build_index warns them)
            where, n_read = f"{meta_path}: subset {sub.name!r}", st["rows_read"]
            if (hint := not_jsonl_hint(sub.annotation, st)) is not None:  # its drops say invalid_json, not why
                notes.append(hint)
            if sub.length is not None and sub.length != n_read and not stopped_early:
                notes.append(f"{where}: the meta says length = {sub.length} but {sub.annotation} has {n_read} records")
            elif n_read == 0:  # an empty file (or blank lines only)
                notes.append(f"{where}: {sub.annotation} holds no records, so the subset adds no pair")
            if n_read and not valid and hint is None:
                notes.append(f"{where}: all {n_read} records of {sub.annotation} were dropped ({st['dropped']}), "
                             "so the subset adds no pair")
            if st.get("repeats"):  # e.g. a file listed under two subsets, or records copied within a file
                verb = "repeats" if st["repeats"] == 1 else "repeat"
                notes.append(f"{where}: {plural(st['repeats'], 'record')} {verb} an earlier record word for word (e.g. "
                             f"{st['first_repeat']}): each copy is its own pair, and a validation split of these "
                             "pairs can hold copies of training pairs")
            st["valid"] = len(valid)
            keep = apply_repeat_time(len(valid), sub.repeat_time, data.train.seed, sub.name)
            if valid and not keep:
                notes.append(f"{where}: repeat_time = {sub.repeat_time} keeps none of its {len(valid)} valid records "
                             f"(floor({len(valid)} x {sub.repeat_time}) = 0)")
            if notes:
                st["notes"] = notes
            if max_samples:
                keep = keep[: max(0, max_samples - len(cols["line"]))]
            # valid record -> its first per-image / per-clip / per-video-file slot (repeats share it)
            first_image, first_audio, first_video = {}, {}, {}
            for k in keep:
                v = valid[k]
                if k not in first_image:
                    first_image[k] = len(img_cols["count"])
                    for p, g, n in zip(v["imgs"], v["grids"], v["counts"], strict=True):
                        if p not in path_ids:
                            path_ids[p] = len(image_paths)
                            image_paths.append(p)
                        img_cols["path_id"].append(path_ids[p])
                        img_cols["grid"].append(list(g))
                        img_cols["count"].append(n)
                    first_audio[k] = len(audio_cols["count"])
                    for p, n_samples, n in zip(v["clips"], v["samples"], v["audio_counts"], strict=True):
                        audio_cols["path_id"].append(audio_ids.setdefault(p, len(audio_paths)))
                        if audio_cols["path_id"][-1] == len(audio_paths):
                            audio_paths.append(p)
                        audio_cols["samples"].append(n_samples)
                        audio_cols["count"].append(n)
                    first_video[k] = len(video_cols["path_id"])
                    for p in v["video_files"]:
                        video_cols["path_id"].append(video_ids.setdefault(p, len(video_paths)))
                        if video_cols["path_id"][-1] == len(video_paths):
                            video_paths.append(p)
                for key in ("line", "offset", "prompt_len", "chosen_len", "rejected_len"):
                    cols[key].append(v[key])
                cols["subset_id"].append(sid)
                cols["image_tokens"].append(sum(v["counts"]))
                cols["video"].append(v["video"])  # [frames, gh, gw, tokens]
                cols["image_start"].append(first_image[k])
                cols["num_images"].append(len(v["imgs"]))
                cols["audio_tokens"].append(sum(v["audio_counts"]))
                cols["audio_start"].append(first_audio[k])
                cols["num_audio"].append(len(v["clips"]))
                cols["video_file_start"].append(first_video[k])
                cols["num_video_files"].append(len(v["video_files"]))
            st["pairs"] = len(keep)
            if max_samples and len(cols["line"]) >= max_samples:
                for later in subsets[sid + 1:]:
                    stats[later.name] = new_stats(later, not_read="max_samples reached")
                break
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        end_record_checks()

    def t(key, src=cols):
        return torch.tensor(src[key], dtype=torch.int64)

    video = t("video").reshape(-1, 4)

    return MMPRIndex(
        meta_path=str(meta_path), fingerprint=fingerprint, subsets=[s.name for s in subsets],
        annotation_files=[str(s.annotation) for s in subsets], image_roots=[str(s.root or "") for s in subsets],
        image_paths=image_paths,
        subset_id=t("subset_id"), line=t("line"), offset=t("offset"), prompt_len=t("prompt_len"),
        chosen_len=t("chosen_len"), rejected_len=t("rejected_len"), image_tokens=t("image_tokens"),
        image_start=t("image_start"), num_images=t("num_images"), image_path_id=t("path_id", img_cols),
        image_grid_hw=t("grid", img_cols).reshape(-1, 2), image_token_counts=t("count", img_cols),
        video_frames=video[:, 0].contiguous(), video_grid_hw=video[:, 1:3].contiguous(),
        video_tokens=video[:, 3].contiguous(), stats=stats,
        build_seconds=time.perf_counter() - t0, audio_paths=audio_paths, audio_tokens=t("audio_tokens"),
        audio_start=t("audio_start"), num_audio=t("num_audio"), audio_path_id=t("path_id", audio_cols),
        audio_samples=t("samples", audio_cols), audio_token_counts=t("count", audio_cols),
        video_paths=video_paths, video_file_start=t("video_file_start"), num_video_files=t("num_video_files"),
        video_path_id=t("path_id", video_cols),
    )


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load_cache(folder: Path, fingerprint: str) -> MMPRIndex:
    """Read a cached index; raises (any exception) when it is missing, partial, corrupt or for another fingerprint."""
    manifest = json.loads((folder / "index.json").read_text())
    if manifest.get("fingerprint") != fingerprint or manifest.get("cache_version") != CACHE_VERSION:
        raise ValueError("fingerprint or cache version differs")
    if _sha256_file(folder / "index.pt") != manifest["sha256"]:
        raise ValueError("index.pt checksum mismatch")
    state = torch.load(folder / "index.pt", weights_only=True)
    index = MMPRIndex(**state)
    if len(index) != manifest["num_pairs"]:
        raise ValueError(f"{len(index)} pairs, manifest says {manifest['num_pairs']}")
    return index


def _write_cache(folder: Path, index: MMPRIndex) -> None:
    """Write index.pt + index.json to a temporary folder renamed into place; a failure is only logged."""
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        torch.save(index.state(), tmp / "index.pt")
        manifest = {"fingerprint": index.fingerprint, "cache_version": CACHE_VERSION, "num_pairs": len(index),
                    "sha256": _sha256_file(tmp / "index.pt"), "meta_path": index.meta_path}
        (tmp / "index.json").write_text(json.dumps(manifest, indent=1))
        os.rename(tmp, folder)  # fails if another process renamed its (identical) copy first: keep that one
    except OSError as e:
        if not (folder / "index.json").is_file():
            logger.warning("could not write the MMPR index cache %s: %s", folder, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_or_build(meta_path, subsets, processor, data, max_samples, fingerprint, folder, use_cache, write):
    if not use_cache:
        return _build(meta_path, subsets, processor, data, max_samples, fingerprint)
    status = "built"
    if folder.exists():
        try:
            index = _load_cache(folder, fingerprint)
            index.cache_status, index.cache_dir = "hit", str(folder)
            return index
        except Exception as e:  # a partial or corrupt cache must never stop a run: report, remove, rebuild
            status = f"rebuilt: the cache was unreadable ({type(e).__name__}: {e})"
            warnings.warn(f"MMPR index cache {folder} is corrupt or partial ({type(e).__name__}: {e}); rebuilding",
                          DataWarning, stacklevel=3)
            aside = folder.parent / f".{folder.name}.corrupt-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(OSError):  # another rank moved it already
                os.rename(folder, aside)
                shutil.rmtree(aside, ignore_errors=True)
    index = _build(meta_path, subsets, processor, data, max_samples, fingerprint)
    if write:
        _write_cache(folder, index)
    index.cache_status, index.cache_dir = status, str(folder)
    return index


def build_index(meta_path: str | Path, processor, data, *, max_samples: int | None = None,
                use_cache: bool = True) -> MMPRIndex:
    """The validated, cached index of `meta_path` for `data` (cfg.data), built by rank 0 while others wait;
    `max_samples`: the first N valid pairs (default data.train.max_samples, 0 = all). DataError: bad meta, no pair."""
    meta_path = Path(meta_path)
    max_samples = data.train.max_samples if max_samples is None else max_samples
    subsets = read_meta(meta_path, data.train.data_root)
    apply_video_settings(processor, data.video)  # the processor holds them for the dataset too
    # the seed changes the index only through a fractional repeat_time (apply_repeat_time's random records)
    sampled = any(s.repeat_time != math.floor(s.repeat_time) for s in subsets)
    settings = {"max_samples": max_samples, "max_seq_length": data.max_seq_length,
                "seed": data.train.seed if sampled else None, "max_images_per_row": data.train.max_images_per_row,
                "max_audio_seconds": data.train.max_audio_seconds,
                "data_root": data.train.data_root, "max_frames": data.video.max_frames}
    fingerprint = index_fingerprint(meta_path, subsets, processor, settings)
    folder = _cache_root() / f"{CACHE_PREFIX}{fingerprint[:16]}"
    args = (meta_path, subsets, processor, data, max_samples, fingerprint, folder, use_cache)
    dist = torch.distributed
    if use_cache and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # rank 0 builds and broadcasts its outcome (or its error, so that no rank waits for a failed build)
        wait = dist.new_group(backend="gloo", timeout=INDEX_BUILD_TIMEOUT)
        msg: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                index = _load_or_build(*args, write=True)
            except Exception as e:
                msg[0] = f"{type(e).__name__}: {e}"
                raise
            finally:
                dist.broadcast_object_list(msg, src=0, group=wait)
        else:
            dist.broadcast_object_list(msg, src=0, group=wait)
            if msg[0] is not None:
                raise DataError(f"rank 0 failed to build the MMPR index: {msg[0]}")
            index = _load_or_build(*args, write=False)
        dist.destroy_process_group(wait)
    else:
        index = _load_or_build(*args, write=True)
    for st in index.stats.values():  # the subsets' notices, on a build and on a cache hit alike
        for note in st.get("notes", ()):
            warnings.warn(note, DataWarning, stacklevel=2)
    if data.strict:  # a cached index keeps its drops: strict must fail on a cache hit as on a build
        first = next((st["first_drop"] for st in index.stats.values() if "first_drop" in st), None)
        if first is not None:
            raise DataError(f"{first['where']}: record dropped ({first['reason']}: {first['detail']}) and "
                            f"data.strict = true (cached index {index.cache_dir})")
    if len(index) == 0:
        emptied = {name: st for name, st in index.stats.items() if st.get("valid")}
        if emptied:  # valid records, but repeat_time < 1 kept none of them
            what = ", ".join(f"{name!r}: repeat_time {st['repeat_time']} x {st['valid']} valid records -> 0 pairs"
                             for name, st in emptied.items())
            raise DataError(f"{meta_path}: no preference pair: repeat_time kept none of the valid records ({what}); "
                            f"drops: {summary_drops(index)}")
        empty = [name for name, st in index.stats.items() if st["rows_read"] == 0 and "not_read" not in st]
        hint = f"; no records in subset(s) {', '.join(repr(n) for n in empty)}" if empty else ""
        for name, ann in zip(index.subsets, index.annotation_files, strict=True):
            if (not_jsonl := not_jsonl_hint(ann, index.stats.get(name, {}))) is not None:
                hint += f"; {not_jsonl}"
        raise DataError(f"{meta_path}: no valid preference pair; drops: {summary_drops(index)}{hint}")
    return index


def summary_drops(index: MMPRIndex) -> dict[str, int]:
    """Total drop counts by reason over all subsets."""
    total: collections.Counter = collections.Counter()
    for st in index.stats.values():
        total.update(st["dropped"])
    return dict(total)


# ---- Splits ----------
def split_validation(index: MMPRIndex, size: float, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, validation ids): `size` (< 1: a fraction, else a count) random pairs; repeats stay together."""
    groups: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for i, key in enumerate(zip(index.subset_id.tolist(), index.line.tolist(), strict=True)):
        groups[key].append(i)
    keys = list(groups)
    order = np.random.default_rng([seed, 1]).permutation(len(keys))
    target = int(size) if size >= 1 else math.floor(size * len(index))
    val: list[int] = []
    for j in order:
        if len(val) >= target:
            break
        val.extend(groups[keys[j]])
    if len(val) >= len(index) and target > 0:
        raise DataError(f"data.train.split_validation_size = {size} leaves no training pairs of {len(index)}")
    taken = set(val)
    return [i for i in range(len(index)) if i not in taken], sorted(val)


@dataclass
class Split:
    """The index a split draws from and its pair ids; `dropped_oversized`: pairs preflight.check_splits removed."""

    index: MMPRIndex
    pair_ids: list[int]
    dropped_oversized: int = 0


def load_splits(processor, data) -> tuple[Split, Split | None]:
    """(train, validation or None): from data.validation.data_path, else data.train.split_validation_size pairs."""
    train = build_index(data.train.data_path, processor, data)
    if data.validation.data_path:
        if data.train.split_validation_size:
            warnings.warn("data.validation.data_path is set: data.train.split_validation_size is ignored",
                          DataWarning, stacklevel=2)
        val = build_index(data.validation.data_path, processor, data, max_samples=data.validation.max_samples)
        return Split(train, list(range(len(train)))), Split(val, list(range(len(val))))
    if data.validation.max_samples:
        warnings.warn(f"data.validation.max_samples = {data.validation.max_samples} is ignored without "
                      "data.validation.data_path (a validation split of the training data has "
                      "data.train.split_validation_size pairs)", DataWarning, stacklevel=2)
    if data.train.split_validation_size:
        tr, va = split_validation(train, data.train.split_validation_size, data.train.seed)
        return Split(train, tr), Split(train, va)
    return Split(train, list(range(len(train)))), None


# ---- Report ----------
def _percentiles(x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {}
    xf = x.double()
    q = torch.quantile(xf, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"min": int(x.min()), "p50": q[0], "p90": q[1], "p99": q[2], "max": int(x.max()),
            "mean": round(float(xf.mean()), 2)}


def report(index: MMPRIndex) -> dict:
    """Per subset and in total: records read, valid, pairs, drops by reason and token-length percentiles
    (JSON-ready)."""
    audio = (("audio_tokens", "audio_tokens"),) if bool(index.audio_tokens.any()) else ()  # data with audio only

    def lengths(mask):
        return {k: _percentiles(getattr(index, col)[mask]) for k, col in
                (("prompt", "prompt_len"), ("image_tokens", "image_tokens"), ("video_tokens", "video_tokens"), *audio,
                 ("chosen", "chosen_len"),
                 ("rejected", "rejected_len"))}

    subsets = {}
    for sid, name in enumerate(index.subsets):
        st = index.stats.get(name, {})
        subsets[name] = {**st, "lengths": lengths(index.subset_id == sid)}
    total = {"rows_read": sum(s.get("rows_read", 0) for s in index.stats.values()),
             "valid": sum(s.get("valid", 0) for s in index.stats.values()), "pairs": len(index),
             "dropped": summary_drops(index), "lengths": lengths(torch.ones(len(index), dtype=torch.bool))}
    return {"meta_path": index.meta_path, "num_pairs": len(index), "cache": index.cache_status,
            "cache_dir": index.cache_dir, "build_seconds": round(index.build_seconds, 3), "subsets": subsets,
            "total": total}


def format_report(rep: dict) -> str:
    """The `report` as text: a table of counts, then length percentiles and drop examples per subset."""
    lines = [f"MMPR index {rep['meta_path']}: {rep['num_pairs']} pairs (cache {rep['cache']}"
             + (f", {rep['cache_dir']}" if rep["cache_dir"] else "") + ")",
             f"{'subset':<56} {'records':>7} {'valid':>7} {'pairs':>7} {'dropped':>8}"]
    for name, s in [*rep["subsets"].items(), ("TOTAL", rep["total"])]:
        lines.append(f"{name[:56]:<56} {s.get('rows_read', 0):>7} {s.get('valid', 0):>7} {s.get('pairs', 0):>7} "
                     f"{sum(s.get('dropped', {}).values()):>8}" + (f"  ({s['not_read']})" if "not_read" in s else ""))
        for reason, n in sorted(s.get("dropped", {}).items()):
            ex = s.get("drop_examples", {}).get(reason, [])
            lines.append(f"    dropped {reason}: {n}" + (f"  e.g. {ex[0]}" if ex else ""))
        for k, p in s.get("lengths", {}).items():
            if p and (k != "audio_tokens" or p["max"]):  # the audio line only for data with audio
                lines.append(f"    {k:<12} min {p['min']:>6}  p50 {p['p50']:>8.1f}  p90 {p['p90']:>8.1f}  "
                             f"p99 {p['p99']:>8.1f}  max {p['max']:>6}")
    return "\n".join(lines)


CLI_FLAGS = {"data.train.data_root": "--data-root", "data.max_seq_length": "--max-seq-length",
             "data.train.max_samples": "--max-samples", "data.train.max_images_per_row": "--max-images-per-row",
             "data.train.seed": "--seed", "data.video.max_frames": "--video-max-frames",
             "data.train.max_audio_seconds": "--max-audio-seconds"}


def cli_text(text: str) -> str:
    """`text` with the config keys of CLI_FLAGS named by this command's flags."""
    for key, flag in CLI_FLAGS.items():
        text = text.replace(key, flag)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    import model_hub
    from config import Config, ConfigError

    ap = argparse.ArgumentParser(description="Validate an MMPR meta-recipe for a model and print the pre-flight "
                                             "report (records, pairs, drops by reason, length percentiles).")
    ap.add_argument("meta", help="MMPR meta-recipe JSON")
    ap.add_argument("--model", required=True, help="model directory (tokenizer, chat template, processor) or hub id "
                    "(its config, tokenizer and processor: from the hub cache, downloaded when missing)")
    d = Config().data
    ap.add_argument("--max-samples", type=int, default=0, help="keep the first N valid pairs (default 0 = all)")
    ap.add_argument("--max-seq-length", type=int, default=d.max_seq_length,
                    help="data.max_seq_length: longer records are dropped as too_long (default %(default)s)")
    ap.add_argument("--max-images-per-row", type=int, default=d.train.max_images_per_row,
                    help="data.train.max_images_per_row: more is too_many_images (default %(default)s)")
    ap.add_argument("--max-audio-seconds", type=float, default=d.train.max_audio_seconds,
                    help="data.train.max_audio_seconds: a longer clip is audio_too_long; 0 = no limit (default "
                         "%(default)s)")
    ap.add_argument("--seed", type=int, default=d.train.seed,
                    help="data.train.seed: a fractional repeat_time's record sample (default %(default)s)")
    ap.add_argument("--data-root", default="",
                    help="data.train.data_root (default: the meta file's grandparent, then its folder)")
    v = d.video
    ap.add_argument("--video-num-frames", type=int, default=v.num_frames,
                    help="data.video.num_frames: frames sampled per video file (default 0 = the processor's)")
    ap.add_argument("--video-fps", type=float, default=v.fps,
                    help="data.video.fps: else frames per second (default 0 = the processor's; neither: all)")
    ap.add_argument("--video-max-frames", type=int, default=v.max_frames,
                    help="data.video.max_frames: more is too_many_frames (default %(default)s)")
    ap.add_argument("--video-target-num-patches", type=int, default=v.target_num_patches,
                    help="data.video.target_num_patches: patches per frame tile (default 0 = the processor's)")
    ap.add_argument("--num-workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes checking records; < 2 = in-process (default %(default)s = min(8, CPUs))")
    ap.add_argument("--no-cache", action="store_true", help="neither read nor write the index cache")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # a drop example can quote a record's lone surrogate (e.g. in an image path)
        sys.stdout.reconfigure(errors="backslashreplace")
    for flag, value, least in (("--max-samples", args.max_samples, 0), ("--max-seq-length", args.max_seq_length, 1),
                               ("--max-images-per-row", args.max_images_per_row, 1),
                               ("--video-num-frames", args.video_num_frames, 0), ("--video-fps", args.video_fps, 0),
                               ("--video-max-frames", args.video_max_frames, 1),
                               ("--video-target-num-patches", args.video_target_num_patches, 0)):
        if not (math.isfinite(value) and value >= least):  # argparse's float() takes nan and inf
            raise DataError(f"{flag} = {value} must be >= {least}" + (" (0 = all)" if least == 0 else ""))
    if not (math.isfinite(args.max_audio_seconds) and args.max_audio_seconds >= 0):
        raise DataError(f"--max-audio-seconds = {args.max_audio_seconds} must be >= 0 (0 = no limit)")
    if args.video_num_frames and args.video_fps:
        raise DataError("--video-num-frames and --video-fps: set one (frames per video, or frames per second)")
    model = args.model
    if model_hub.is_hub_id(model):  # a local directory of the same name wins
        try:
            model = model_hub.hub_snapshot(model, files=model_hub.SMALL_MODEL_FILES, key="--model").path
        except ConfigError as e:
            raise DataError(str(e)) from None
    processor = load_processor(model, "--model")
    v.num_frames, v.fps, v.max_frames = args.video_num_frames, args.video_fps, args.video_max_frames
    v.target_num_patches = args.video_target_num_patches
    d.max_seq_length, d.num_workers = args.max_seq_length, args.num_workers
    d.train.data_root, d.train.seed, d.train.max_images_per_row = args.data_root, args.seed, args.max_images_per_row
    d.train.max_audio_seconds = args.max_audio_seconds
    with data_warnings([]) as warned:
        index = build_index(args.meta, processor, d, max_samples=args.max_samples, use_cache=not args.no_cache)
    for note in warned:
        print(f"warning: {cli_text(str(note))}", file=sys.stderr)
    rep = report(index)
    print(json.dumps(rep, indent=1) if args.json else cli_text(format_report(rep)))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    import config as config_mod

    config_mod.quiet_known_warnings()  # OMNI_MPO_SHOW_WARNINGS=1 shows them
    try:
        config_mod.exit_cli(main)
    except DataError as e:  # a bad meta-recipe or path: the message names the file; a traceback would bury it
        sys.exit(f"error: {cli_text(str(e))}")

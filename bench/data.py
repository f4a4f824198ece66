"""Item 5, data: mmpr_index.build_index of the sample repeated to ~5,000 records (fresh build vs cache load) and
pairs/s of image decoding + processing (PairDataset) through a DataLoader with 0 and 2 workers."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.common import SAMPLE_META, TINY, _processor


def _repeated_meta(folder: Path, repeat: int) -> Path:
    """A copy of the sample's meta-recipe whose annotations hold every record `repeat` times (absolute image roots)."""
    import mmpr_records

    meta = json.loads(SAMPLE_META.read_text())
    subsets = {s.name: s for s in mmpr_records.read_meta(SAMPLE_META)}
    for name, entry in meta.items():
        s = subsets[name]
        lines = [ln for ln in s.annotation.read_text().splitlines() if ln.strip()]
        ann = folder / f"{name}.jsonl"
        ann.write_text("\n".join(lines * repeat) + "\n")
        entry.update(root=str(s.root), annotation=str(ann), length=len(lines) * repeat)
    path = folder / "meta.json"
    path.write_text(json.dumps(meta, indent=1))
    return path


def bench_data(quick: bool) -> dict:
    """Index build (no cache) vs cache load of the sample repeated to ~5,000 records; pairs/s with 0 and 2 workers."""
    import mmpr_data
    import mmpr_index
    from config import Config

    repeat, n_decode = (15, 64) if quick else (148, 256)
    proc = _processor(TINY)
    cfg = Config()
    saved = os.environ.get("HF_DATASETS_CACHE")
    with tempfile.TemporaryDirectory(prefix="omni_bench_data_") as d:
        os.environ["HF_DATASETS_CACHE"] = str(Path(d) / "cache")
        try:
            meta = _repeated_meta(Path(d), repeat)
            t = time.perf_counter()
            built = mmpr_index.build_index(meta, proc, cfg.data)
            t_build = time.perf_counter() - t
            t = time.perf_counter()
            loaded = mmpr_index.build_index(meta, proc, cfg.data)
            t_load = time.perf_counter() - t
        finally:
            if saved is None:
                os.environ.pop("HF_DATASETS_CACHE", None)
            else:
                os.environ["HF_DATASETS_CACHE"] = saved
        assert (built.cache_status, loaded.cache_status) == ("built", "hit"), (built.cache_status, loaded.cache_status)
        assert built.lengths() == loaded.lengths(), "data: the cached index differs from the built one"
        ds = mmpr_data.PairDataset(loaded, proc)
        rates = {}
        for workers in (0, 2):
            loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=range(n_decode), num_workers=workers,
                                                 collate_fn=mmpr_data._collate_pairs)
            t = time.perf_counter()
            n = sum(len(b) for b in loader)
            rates[workers] = n / (time.perf_counter() - t)
    return {"rows": len(built), "build_s": t_build, "cache_load_s": t_load, "build_over_load": t_build / t_load,
            "decode_pairs": n_decode, "pairs_per_s_workers0": rates[0], "pairs_per_s_workers2": rates[2],
            "workers2_over_workers0": rates[2] / rates[0]}

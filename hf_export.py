"""Export of a training checkpoint's policy as a Hugging Face checkpoint: `python hf_export.py RUN_DIR OUT_DIR`.

`export` builds the model at TP = CP = EP = 1, loads the checkpoint's model shards (any saved layout) and writes the
HF files through `<OUT_DIR>.tmp`, renamed once complete. A LoRA run's checkpoint holds the adapters: the base weights
are read from its model.hf_path (refused when their digest is not the run's), the adapters loaded over them, and the
export is the merged model W + (alpha / rank)·B·A; with `--adapter` (`adapter=True`) the adapters alone in the PEFT
format instead (lora.save_peft: adapter_config.json + adapter_model.safetensors, for peft.PeftModel.from_pretrained
over the base model). `check_export_dir` refuses an OUT_DIR that is the run, holds
one, is the run's `model.hf_path`, a file or a non-empty directory that is not an earlier export (EXPORT_INFO_FILE,
the export's provenance).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from backend import megatron_patches
from checkpoint import (
    EXPORT_INFO_FILE,
    MODEL_OPTIM_DIR,
    RUN_STATE_FILE,
    STEP_RE,
    CheckpointError,
    check_complete,
    free_space,
    latest_checkpoint,
    load_model_state,
    model_sharded_state_dict,
    read_run_state,
    replace_dir,
    why_damaged,
    write_failure,
)


def check_export_dir(out_dir: str | Path, source: str | Path, hf_path: str | Path | None = None) -> None:
    """Refuse an export directory that is the run's `model.hf_path`, in the checkpoint `source`, a run directory or
    inside the checkpoint's, a file, or a non-empty directory that is not an earlier export (EXPORT_INFO_FILE)."""
    out, src = Path(out_dir).resolve(), Path(source).resolve()
    if hf_path is not None and out == Path(hf_path).resolve():
        what = f"the run's model.hf_path ({hf_path}: the source of its reference weights and of every resume)"
    elif out == src or src in out.parents:
        what = f"the checkpoint it exports ({src.name}) or inside it"
    elif out == src.parent:
        what = "the run directory of the checkpoint it exports (its config.json would be overwritten)"
    elif src.parent in out.parents:  # e.g. RUN/step_9: a folder the run's resume would read as a damaged checkpoint
        what = f"inside the run directory of the checkpoint it exports ({src.parent})"
    elif out.is_dir() and (out / "config.json").is_file() and (held := sorted(
            p.name for p in out.iterdir() if p.name == "metrics.jsonl" or (STEP_RE.match(p.name) and p.is_dir()))):
        what = f"a directory that holds a training run (config.json, {', '.join(held)})"
    elif out.exists() and not out.is_dir():
        what = "an existing file, not a directory"
    elif out.is_dir() and not (out / EXPORT_INFO_FILE).is_file() and (names := sorted(p.name for p in out.iterdir())):
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} entries)" if len(names) > 3 else "")
        what = f"not empty ({shown}) and not an earlier export (no {EXPORT_INFO_FILE})"
    else:
        return
    raise CheckpointError(f"export directory {out_dir} is {what}; choose a new or empty OUT_DIR")


def _export_staging(out_dir: str | Path) -> Path:
    """`<OUT_DIR>.tmp`, where an export is written; an interrupted export's `.tmp` and `.old` are removed first."""
    out = Path(out_dir)
    for p in (out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")):
        if p.is_dir() and (p / EXPORT_INFO_FILE).is_file():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            raise CheckpointError(f"{p} exists and is not an interrupted export (no {EXPORT_INFO_FILE}): move it away "
                                  "or choose another OUT_DIR")  # fmt: skip
    return out.with_name(out.name + ".tmp")


def _write_export_info(staging: Path, info: dict[str, Any], out_dir: str | Path) -> None:
    """Create `staging` and write EXPORT_INFO_FILE there; on a failure remove it."""
    try:
        staging.mkdir(parents=True, exist_ok=True)
        (staging / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        free = f" ({free_space(staging.parent)})" if staging.parent.is_dir() else ""
        raise CheckpointError(f"export directory {out_dir} cannot be written: {e.strerror or e}{free}") from None


def export(ckpt: str | Path, out_dir: str | Path, adapter: bool = False) -> Path:
    """Write the policy of `ckpt` (a run's latest step, or a step_<N>) as an HF checkpoint via `<OUT_DIR>.tmp`; with
    `adapter`, a LoRA run's adapters as a PEFT adapter."""
    import config as config_mod
    import distributed
    import hf_weights
    import lora
    import model_hub
    import omni_model
    from backend import kernel_selection

    if (world := int(os.environ.get("WORLD_SIZE", "1"))) > 1:  # every process would write and rename OUT_DIR
        raise CheckpointError(f"export runs as one process (python hf_export.py), not {world} (torchrun)")
    ckpt = Path(ckpt)
    path = ckpt if (ckpt / RUN_STATE_FILE).is_file() else latest_checkpoint(ckpt)
    if path is None:
        raise CheckpointError(f"{ckpt}: no complete checkpoint (step_<N>/ with {RUN_STATE_FILE})")
    state = read_run_state(path)
    try:
        cfg = config_mod.from_dict(state.config)
    except config_mod.ConfigError as e:
        raise CheckpointError(f"{path / RUN_STATE_FILE}: its config does not load in this version: {e}") from None
    if state.model_snapshot is None and not cfg.model.hf_revision:  # the run read a local folder: a path, not an id
        snapshot, folder = None, cfg.model.hf_path
    else:
        try:  # a hub id: the snapshot of the commit the run recorded, from the hub cache (downloaded when missing)
            snapshot = model_hub.resolve_model(cfg)
        except config_mod.ConfigError as e:
            raise CheckpointError(f"{path / RUN_STATE_FILE}: {e}") from None
        folder = model_hub.model_dir(cfg.model)
    check_export_dir(out_dir, path, folder)
    if not (Path(folder) / "config.json").is_file():  # the architecture and the files copied to out_dir
        raise CheckpointError(f"{path / RUN_STATE_FILE}: its model.hf_path = {cfg.model.hf_path!r} has no config.json "
                              f"seen from {os.getcwd()}; run the export from the directory the training ran in")
    if adapter and not cfg.lora.rank:
        raise CheckpointError(f"{path} is not a LoRA run (lora.rank = 0): it has no adapter to export; export it "
                              "without --adapter")
    unmapped = [f"lora.{k}" for k in ("routed_experts", "vision_tower", "projector") if getattr(cfg.lora, k)]
    if adapter and cfg.lora.rank and unmapped:
        raise CheckpointError(f"{path}: the PEFT adapter format here covers the language model's linears, the "
                              f"shared expert and the sound projection, not {', '.join(unmapped)} = true; export the "
                              "merged model (without --adapter)")
    if cfg.lora.rank and state.base_model_digest and (digest := model_hub.base_model_digest(folder)) != \
            state.base_model_digest:
        raise CheckpointError(f"{path}: its LoRA adapters were trained on base weights with digest "
                              f"{state.base_model_digest}, model.hf_path = {cfg.model.hf_path} holds other weights "
                              f"(digest {digest}); export from the directory and base model the run used")
    check_complete(state, None)  # before the model is built (no RNG file needed)
    out, staging = Path(out_dir), _export_staging(out_dir)
    info = {"source": os.path.abspath(path), "step": state.step,
            "model.hf_path": cfg.model.hf_path if snapshot else os.path.abspath(folder),
            "model_snapshot": dataclasses.asdict(snapshot) if snapshot else None,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "complete": False}
    _write_export_info(staging, info, out_dir)  # before the model is built: an unwritable directory fails here
    for k in ("tensor_model_parallel_size", "context_parallel_size", "expert_model_parallel_size"):
        setattr(cfg.parallel, k, 1)
    cfg.parallel.sequence_parallel = False

    from megatron.core import dist_checkpointing, tensor_parallel

    try:
        # a world of one on the device the model is built on; CUDA_VISIBLE_DEVICES= exports on the CPU
        kernels = kernel_selection.select_kernels(dtype=omni_model.torch_dtype(cfg.model.params_dtype))
        distributed.init_distributed(device=distributed.local_device(), kernels=kernels)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.mpo.seed)  # megatron's init needs its RNG tracker
        model = omni_model.build_model(folder, cfg.model, cfg.parallel, kernels=kernels)
        if cfg.lora.rank:  # the checkpoint holds the adapters: the base weights are model.hf_path's
            hf_weights.load_hf_weights(model, folder)
            lora.apply_lora(model, cfg.lora, seed=cfg.mpo.seed)
        megatron_patches.use_in_process_write_queue()
        loaded = dist_checkpointing.load({"model": model_sharded_state_dict(model)}, str(path / MODEL_OPTIM_DIR))
        load_model_state(model, loaded["model"])
        if adapter:
            lora.save_peft(model, staging, folder, cfg.lora)
        else:
            if cfg.lora.rank:
                lora.merge(model)  # W + (alpha / rank)·B·A: a plain model of model.hf_path's architecture
            hf_weights.export_hf(model, staging, folder)
    except Exception as e:
        shutil.rmtree(staging, ignore_errors=True)
        if not (path / RUN_STATE_FILE).is_file() or why_damaged(path, None):  # e.g. pruned by a running job meanwhile
            raise CheckpointError(f"{path} was removed or changed while it was exported (a running job keeps only "
                                  "its checkpoint.keep_last newest steps); export again") from None
        if (failure := write_failure(e, staging.parent)) is None:
            raise
        raise CheckpointError(f"exporting {path} to {out_dir} failed: {type(failure).__name__}: {failure} "
                              f"({free_space(staging.parent)}); the partial export {staging.name} was removed, "
                              f"{out_dir} is as it was") from None  # fmt: skip
    _write_export_info(staging, info | {"complete": True}, out_dir)  # after export_hf, which copies source files
    replace_dir(staging, out)  # an earlier export or an empty directory (check_export_dir): replaced only now
    return out


def main(argv: list[str] | None = None) -> int:
    """`python hf_export.py RUN_DIR OUT_DIR` (`export`); exit 1 with one `error: ...` line."""
    import argparse

    import config as config_mod

    ap = argparse.ArgumentParser(prog="python hf_export.py", description="Write the policy of a checkpoint as an HF "
                                 "checkpoint, from the directory the training ran in.")
    ap.add_argument("ckpt", metavar="RUN_DIR", help="a run directory (checkpoint.dir: its latest step_<N>) or one "
                    "step_<N>")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="a new or empty directory, or an earlier export (it holds "
                    f"{EXPORT_INFO_FILE}); not the run, nor one holding a run, nor the run's model.hf_path")
    ap.add_argument("--adapter", action="store_true", help="a LoRA run: write its adapters alone as a PEFT adapter "
                    "(adapter_config.json + adapter_model.safetensors) instead of the merged model")
    args = ap.parse_args(argv)
    config_mod.quiet_known_warnings()  # OMNI_MPO_SHOW_WARNINGS=1 shows them
    ckpt, out_dir = (os.path.expanduser(p) for p in (args.ckpt, args.out_dir))  # a quoted `~`, as config paths
    try:
        print(f"exported {export(ckpt, out_dir, adapter=args.adapter)}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

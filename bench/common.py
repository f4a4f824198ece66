"""What every item of the benchmark shares: paths and tolerances, interleaved timing, sections recorded as they end,
the small Omni checkpoints of the CPU items with the shipped sample's pairs, and the device's memory counters."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-omni"
SAMPLE_META = ROOT / "data" / "mmpr_sample" / "MMPR-sample" / "meta.json"

VALUE_TOL = 1e-5  # the benchmark's acceptance: log-probs, vision-once-per-pair logits and gradients

# This process's state: "write" (writes the results file; set by cli.main), "tmp" (the temporary folder of bench
# checkpoints), "ckpt_<name>" (small_checkpoint's folders). `cleanup` removes the folder and empties it.
_STATE: dict = {}

# The small Omni config of the CPU items vision, train and shared: every layer kind (M Mamba-2, * attention, E MoE,
# - dense MLP).
SMALL_LLM = dict(hidden_size=256, hybrid_override_pattern="M*EM-M*E", num_attention_heads=8, num_key_value_heads=2,
                 head_dim=32, mamba_num_heads=16, mamba_head_dim=32, ssm_state_size=32, n_groups=2, chunk_size=64,
                 intermediate_size=768, moe_intermediate_size=256, moe_shared_expert_intermediate_size=512,
                 n_routed_experts=8, num_experts_per_tok=2)
SMALL_VIT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
SMALL_PROJECTOR_HIDDEN = 512


def interleaved_times(fns: dict, reps: int, clock=time.perf_counter) -> dict[str, dict[str, float]]:
    """Times in seconds by `clock` (wall time by default) of each fn over `reps` rounds, the fns called in turn within
    a round so that load from other processes hits all of them alike. Returns {name: {"min", "median"}}; ratios use
    the minimum, the estimate least inflated by contention on a shared machine."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # GPU work is asynchronous
    for _ in range(reps):
        for k, fn in fns.items():
            sync()
            t = clock()
            fn()
            sync()
            times[k].append(clock() - t)
    return {k: {"min": min(v), "median": statistics.median(v)} for k, v in times.items()}


def error_record(e: BaseException) -> dict:
    """How a failed section or kernel is recorded: {"error": "Type: first line of the message"} (<= 300 characters)."""
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}


def run_section(out: dict, key: str, fn, *args, **kwargs) -> bool:
    """out[key] = fn(*args, **kwargs) with its "bench_seconds", or, when fn raises, error_record (joined to what fn
    left in out[key]; the traceback on stderr). Then the results file is written (`write_results`):
    a later time limit or failure keeps this section. Returns whether fn returned."""
    t = time.perf_counter()
    try:
        out[key] = fn(*args, **kwargs)
        ok = True
    except Exception as e:  # noqa: BLE001 - recorded; the later sections still run and the exit status says it
        traceback.print_exc()
        out[key] = {**out.get(key, {}), **error_record(e)}
        ok = False
    out[key]["bench_seconds"] = round(time.perf_counter() - t, 2)
    print(f"[bench] {key}: {out[key]['bench_seconds']} s{'' if ok else ', ' + out[key]['error']}", file=sys.stderr,
          flush=True)
    write_results()
    return ok


def write_results() -> None:
    """Write the results file as it stands (`_STATE["write"]`, set by cli.main; nothing outside it): a later time
    limit or failure keeps what was recorded."""
    if "write" in _STATE:
        _STATE["write"]()


def _make_tiny_module():
    spec = importlib.util.spec_from_file_location("make_tiny_omni", ROOT / "assets" / "make_tiny_omni.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars ("Writing model shards", "Loading weights") off inside the block: the benchmark's
    output is its table."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _tmp() -> Path:
    """This process's temporary folder of bench checkpoints (made on first use; `cleanup` removes it)."""
    if "tmp" not in _STATE:
        _STATE["tmp"] = Path(tempfile.mkdtemp(prefix="omni_bench_"))
    return _STATE["tmp"]


def cleanup() -> None:
    """Remove this process's temporary folder and forget its state: a later call in this process makes new ones."""
    if "tmp" in _STATE:
        shutil.rmtree(_STATE["tmp"], ignore_errors=True)
    _STATE.clear()


def small_checkpoint(name: str, seed: int) -> Path:
    """A hub-layout checkpoint folder of the small bench config (random weights from transformers' init, `seed`),
    with the tiny asset's tokenizer, chat template and processor. Written once per process into a temporary folder."""
    key = f"ckpt_{name}"
    if key in _STATE:
        return _STATE[key]
    out = _tmp() / name
    out.mkdir()
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["llm_config"].update(SMALL_LLM)
    cfg["vision_config"].update(SMALL_VIT)
    cfg["vit_hidden_size"] = SMALL_VIT["hidden_size"]
    cfg["projector_hidden_size"] = SMALL_PROJECTOR_HIDDEN
    from safetensors.torch import save_file

    with no_progress_bars():  # build_weights writes the model with save_pretrained
        sd = _make_tiny_module().build_weights(cfg, seed)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
             "weight_map": {k: "model.safetensors" for k in sd}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in TINY.iterdir():
        if f.name not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    _STATE[key] = out
    return out


def _processor(path: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def sample_pairs(model_dir: Path, n: int) -> tuple[dict, dict]:
    """The first n pairs of the shipped sample as pack.PreferencePair (decoded once), and {image, pad} token ids."""
    import mmpr_data
    import mmpr_index
    from config import Config

    proc = _processor(model_dir)
    cfg = Config()
    cfg.data.train.data_path = str(SAMPLE_META)
    index = mmpr_index.build_index(SAMPLE_META, proc, cfg.data, use_cache=False)
    if len(index) < n:
        raise ValueError(f"the sample has {len(index)} pairs, fewer than the {n} asked for")
    ds = mmpr_data.PairDataset(index, proc)
    ids = {"image": json.loads((model_dir / "config.json").read_text())["img_context_token_id"],
           "pad": proc.tokenizer.pad_token_id or 0}
    return {i: ds[i] for i in range(n)}, ids


def _build_ours(model_dir: Path):
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    m = om.build_model(model_dir, ModelConfig(), ParallelConfig())
    hf_weights.load_hf_weights(m, model_dir)
    return m


def _device() -> torch.device:
    """The device the small-config items run on: the current CUDA device when there is one (where build_model puts the
    model), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _bench_cfg(model_dir: Path, n_pairs: int):
    from config import Config

    cfg = Config()
    cfg.model.hf_path = str(model_dir)
    cfg.mpo.sft_loss_weight = 1.0  # the MPO paper's weights 0.8 / 0.2 / 1.0: every term of the loss is exercised
    cfg.policy.train_global_batch_size = n_pairs
    cfg.policy.logprob_chunk_size = 1024
    # the config's packing defaults: one pair (~300 tokens here) per packed microbatch (bench_train also times 8)
    cfg.packing.max_tokens_per_bin = 8192
    cfg.packing.max_sequences_per_bin = 1
    cfg.packing.shared_prompt = False  # separate sequences; the shared-prompt format is timed apart (bench_shared)
    cfg.scheduler.lr_warmup_steps = 0  # a real update from step 1 on (megatron: step 1 uses lr_warmup_init otherwise)
    cfg.mpo.max_num_steps = 100
    return cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _held_memory(device: torch.device, name: str) -> dict:
    """Beside `_peak_memory`: the caching allocator's peak reserve and the device's used memory (total - free of
    cudaMemGetInfo: the CUDA context, NCCL and other processes included), bytes; {} on the CPU. plan.py's reserve is
    calibrated against them."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {f"peak_reserved_bytes_{name}": torch.cuda.max_memory_reserved(device),
            f"device_used_bytes_{name}": total - free}


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _release(device: torch.device) -> None:
    """Free what a finished system left (its objects are gone with its function's frame) before the next starts."""
    import gc

    gc.collect()
    _reset_peak(device)


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f} MiB"


def machine() -> str:
    """One line: CPU model, cores, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, Python {platform.python_version()}"

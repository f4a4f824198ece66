"""What a training run reports, beside train.py's loop: one-line errors (`exit_in_one_line`), step metrics
(`speed_metrics`, `MetricsLog`: metrics.jsonl and W&B) and the console lines.
Tests: `pytest tests/test_train.py tests/test_console.py`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import config as config_mod
import distributed
import mmpr_index
import mmpr_records
import pack


# ---- The console and errors ----------
class Console:
    """sys.stdout / stderr that survive a lost console (EIO, EPIPE) by writing to /dev/null: the rank still saves."""

    GONE = (errno.EIO, errno.EPIPE)

    def __init__(self, stream) -> None:
        self._stream = stream

    @classmethod
    def install(cls) -> None:
        for name in ("stdout", "stderr"):
            if not isinstance(getattr(sys, name), cls):
                setattr(sys, name, cls(getattr(sys, name)))

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            if e.errno not in self.GONE:
                raise
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
            return fn(*args)  # what is still buffered goes to /dev/null

    def write(self, text: str) -> int:
        return self._guard(self._stream.write, text)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def report_error(e: Exception) -> str:
    """Print `error: <type>: <message>` (rank 0) and write it to TORCHELASTIC_ERROR_FILE (every rank); returns it."""
    msg = f"error: {type(e).__name__}: {e}"
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's ProcessFailure format
        data = {"message": {"message": msg, "extraInfo": {"timestamp": str(int(time.time()))}}}
        Path(error_file).write_text(json.dumps(data))
    if global_rank() == 0:
        print(msg, file=sys.stderr, flush=True)
    return msg


def exit_in_one_line(run, known: tuple):
    """`run()`'s exit code; a `known` error, a lost peer or an early Ctrl-C exits with one line, not tracebacks."""
    try:
        return run()
    except known as e:
        report_error(e)
        if global_rank() != 0:  # the same check fails on every rank: let rank 0 print before torchrun stops it
            time.sleep(5)
        sys.exit(1)
    except RuntimeError as e:
        if (reason := lost_peer(e)) is None:  # a bug: its traceback
            raise
        # each rank that saw it says so (rank 0 may be the one gone)
        print(f"error: rank {global_rank()}: {type(e).__name__}: {reason}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C before the loop installed its handler: nothing to save yet
        if global_rank() == 0:
            print("interrupted before the first step: nothing saved", file=sys.stderr)
        sys.exit(130)


def last_saved(saved_step: int, cfg) -> str:
    """`the latest checkpoint is <dir>/step_N` or `no checkpoint was saved`, for an error that stops the run."""
    if saved_step <= 0:
        return "no checkpoint was saved"
    return f"the latest checkpoint is {checkpoint.step_dir(cfg.checkpoint.dir, saved_step)}"


def diverged_message(e: Exception, step: int, resumed_from, saved_step: int, cfg) -> str:
    """The line of a non-finite step: after a resume (`resumed_from`) the previous checkpoint, else a lower LR."""
    if resumed_from is not None:
        return (f"step {step}: {e}: the first step after resuming from {resumed_from}, so its saved state gives "
                "non-finite values (a damaged file that no checksum caught, or a run that was already diverging: "
                f"check its logged loss); {checkpoint.move_away(resumed_from)}")
    far_off = ", whose weights may already be far off: check its logged loss" if saved_step else ""
    saved = last_saved(saved_step, cfg) + far_off
    return (f"step {step}: {e}: the run diverged ({saved}); start a new run with a lower optimizer.lr in another "
            "checkpoint.dir, from model.hf_path or from an export of a good step; if the LR is already small, look at "
            "extreme loss settings (a very large mpo.reference_policy_kl_penalty or mpo.reward_shift)")


def lost_peer(e: BaseException) -> str | None:
    """Why `e` says another process died (a gloo connection closed or reset, a DataLoader worker killed), else None."""
    msg = str(e).strip()
    if gloo := re.match(r"\[[^\]]*gloo/transport/[^\]]*\] (.+?)(?:\. |\.?$)", msg):
        return f"{gloo.group(1)} (another rank died or stopped: its lines and torchrun's report say why)"
    if msg.startswith("DataLoader worker (pid"):
        return msg.splitlines()[0]
    return None


def global_rank() -> int:
    """torchrun's RANK (0 outside torchrun): usable before and after the process group exists."""
    return int(os.environ.get("RANK", "0"))


# ---- Step metrics: DP reduction, throughput, MFU, metrics.jsonl and W&B ----------
def global_tokens(batches, dp_group, device: torch.device) -> int:
    """Tokens the LM computes in the step (cu_seqlens[-1] of this rank's microbatches, no padding), summed over DP."""
    tokens = torch.tensor([sum(int(pack.host_view(b).cu_seqlens[-1]) for b in batches)], device=device)
    dist.all_reduce(tokens, group=dp_group)
    return int(tokens.item())


def speed_metrics(tokens: int, seconds: float, pairs: int, n_active: int, world: int,
                  reference_forward: bool = True) -> dict:
    """A step's throughput metrics: tokens (`global_tokens`), step_time (s), pairs_per_s, tokens_per_s, mfu."""
    return {"tokens": tokens, "step_time": seconds, "pairs_per_s": pairs / seconds, "tokens_per_s": tokens / seconds,
            "mfu": mfu(tokens, seconds, n_active, world, reference_forward)}


def active_params(model, hf) -> int:
    """The N of `mfu`: language-model parameters with matmul FLOPs per token, global over TP/EP (no input embedding
    unless tied; routed experts times top_k / n_routed; no ViT or projector)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    lm = model.language_model
    lookup = set() if lm.share_embeddings_and_output_weights else {id(p) for p in lm.embedding.parameters()}
    routed = {id(p) for m in lm.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
    dense = expert = 0
    for p in lm.parameters():
        split = getattr(p, "tensor_model_parallel", False)
        if id(p) in routed:
            expert += p.numel() * ep * (etp if split else 1)
        elif id(p) not in lookup:
            dense += p.numel() * (tp if split else 1)
    n_exp = getattr(hf.text, "n_routed_experts", 0) or 0
    top_k = getattr(hf.text, "num_experts_per_tok", 0) or 0
    return int(dense + (expert * top_k / n_exp if n_exp else expert))


PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12}  # dense, per GPU


def mfu(tokens: int, seconds: float, n_active: int, world: int, reference_forward: bool = True) -> float | None:
    """MFU: 8·N·tokens (policy fwd+bwd, ref fwd; 6·N with reference.logprobs = "precomputed": no reference forward)
    / (seconds · world · peak bf16), N = `active_params`; None on CPU."""
    if not torch.cuda.is_available() or seconds <= 0:
        return None
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    flops_per_token = (8.0 if reference_forward else 6.0) * n_active
    return None if peak is None else flops_per_token * tokens / (seconds * world * peak)


def wandb_failed(cfg, e: Exception) -> str:
    """The one-line message for a failed wandb.init (`e`, a wandb.errors.Error), with the remedy."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return (f"logging.wandb = {cfg.logging.wandb!r}: wandb.init failed ({type(e).__name__}: {first}); on a machine "
            f"without access to W&B use logging.wandb=offline (or WANDB_MODE=offline), then upload the run later with "
            f"`wandb sync {Path(cfg.checkpoint.dir) / 'wandb'}/offline-run-*`")


def _line_step(line: str) -> float:
    """The "step" of one metrics.jsonl line; -inf (kept by any resume) for a line without an integer step."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError, IndexError):
        return -math.inf
    return step if isinstance(step, int) and not isinstance(step, bool) else -math.inf


class MetricsError(RuntimeError):
    """metrics.jsonl or config.json cannot be written (a full disk, a quota): one line naming the file and the free
    space."""


class MetricsLog:
    """`<checkpoint.dir>/metrics.jsonl` (one object per step) and W&B, written by rank 0; the first `log` moves an
    earlier file to `metrics.<n>.jsonl` or drops its lines after `resumed_step`. A failed wandb.init: ConfigError."""

    def __init__(self, cfg, run_id: str | None, resumed_step: int, rank: int) -> None:
        self.rank, self.run, self.run_id = rank, None, run_id
        self.path = Path(cfg.checkpoint.dir) / "metrics.jsonl"
        self._tidy_after: int | None = resumed_step  # the resumed step until the first `log` has tidied the file
        failed, error = None, None
        if rank == 0:
            try:
                failed = self._start(cfg)
            except Exception as e:  # told to the other ranks first, then raised as it is
                failed, error = f"rank 0 could not start the metrics log: {type(e).__name__}: {e}", e
        failed = distributed.from_rank0(failed)  # no rank waits on a rank 0 that stopped
        if error is not None:
            raise error
        if failed:
            raise config_mod.ConfigError(failed)

    def _start(self, cfg) -> str | None:
        """Rank 0: start the W&B run; returns the W&B failure's message (or None)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.logging.wandb != "disabled":
            import wandb

            try:
                self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or cfg.logging.wandb_project,
                                      entity=os.environ.get("WANDB_ENTITY") or None,
                                      name=os.environ.get("WANDB_NAME") or None,
                                      id=self.run_id or os.environ.get("WANDB_RUN_ID") or None, resume="allow",
                                      mode=cfg.logging.wandb, dir=str(self.path.parent), config=config_mod.to_dict(cfg))
            except wandb.errors.Error as e:  # CommError (no network, a timeout, a rejected key), UsageError, ...
                return wandb_failed(cfg, e)
            self.run_id = self.run.id
        return None

    def _tidy(self, resumed_step: int) -> None:
        """Rank 0, at the first `log`: move an earlier run's metrics.jsonl aside or drop its lines after the resume."""
        # surrogateescape: bytes that are not UTF-8 (a damaged or hand-edited file) are kept as they are
        text = self.path.read_text(errors="surrogateescape") if self.path.exists() else ""
        lines = [r for r in text.splitlines() if r.strip()]
        # a last line without its newline that is not JSON: a cut-off write, which the next line would merge into
        torn = bool(lines) and not text.endswith("\n") and _line_step(lines[-1]) == -math.inf
        if lines and resumed_step == 0:  # a run that saved no checkpoint here: keep its lines in a file of their own
            n = 1
            while (old := self.path.with_name(f"metrics.{n}.jsonl")).exists():
                n += 1
            self.path.rename(old)
            print(f"metrics: {self.path} held {mmpr_records.plural(len(lines), 'line')} of an earlier run without a "
                  f"checkpoint; moved to {old.name}, this run starts a new {self.path.name}")
        elif lines:  # lines after the resumed step belong to a segment that died before saving
            keep = [r for r in lines[: len(lines) - torn] if _line_step(r) <= resumed_step]
            after = len(lines) - torn - len(keep)
            if after or torn or not text.endswith("\n"):
                self.path.write_text("".join(r + "\n" for r in keep), errors="surrogateescape")
            if after:
                print(f"metrics: dropped {mmpr_records.plural(after, 'line')} after step {resumed_step} "
                      f"from {self.path} (logged after the checkpoint this run resumes from: a "
                      "segment that stopped before saving them, or a later checkpoint moved away)")
            if torn:
                print(f"metrics: dropped the cut-off last line of {self.path} (a write that did not finish): "
                      f"{lines[-1][:80]!r}")

    def log(self, step: int, metrics: dict, split: str = "train") -> None:
        """Rank 0 appends {"step", "split", **metrics} to metrics.jsonl and W&B (`<split>/<name>`); collective."""
        failed = None
        if self.rank == 0:
            try:
                if self._tidy_after is not None:
                    self._tidy(self._tidy_after)
                    self._tidy_after = None
                with open(self.path, "a") as f:
                    f.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")
            except OSError as e:  # a line cut off by it is dropped by the next resume (`_tidy`)
                failed = (f"cannot write step {step} to {self.path}: {type(e).__name__}: {e} "
                          f"({checkpoint.free_space(self.path.parent)}); the run stopped without saving step {step}: "
                          "make room, then resume from the latest checkpoint")  # fmt: skip
            if failed is None and self.run is not None:
                self.run.log({f"{split}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if failed := distributed.from_rank0(failed):
            raise MetricsError(failed)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


# ---- Console lines (rank 0) ----------
def print_layout(ctx, world: int, kernels, pair_format: str) -> None:
    """The kernels line and the parallel layout line ending in `pair_format` (shared_prompt.resolve's)."""
    p = ctx.cfg.parallel
    print(kernels.line())
    print(f"world {world}: TP {p.tensor_model_parallel_size} CP {p.context_parallel_size} DP {ctx.dp} "
          f"EP {p.expert_model_parallel_size} on {ctx.device.type}; pairs: {pair_format}")
    if ctx.cfg.reference.offload and ctx.device.type != "cuda":
        print("reference.offload = true is ignored on the CPU: the reference model is in CPU memory already")


def print_data(train_split, val_split, notes: list[str], rank: int) -> None:
    """The data lines (rank 0): pairs per split, the index's cache status, records dropped by reason, the notes."""
    if rank != 0:
        return
    status = train_split.index.cache_status.split(":")[0]
    status = {"hit": "cached", "disabled": "not cached"}.get(status, status)
    print(f"data: {len(train_split.pair_ids)} train pairs, {len(val_split.pair_ids) if val_split else 0} "
          f"validation pairs (index {status}), dropped records {mmpr_index.summary_drops(train_split.index)}")
    if val_split is not None and val_split.index is not train_split.index:
        print(f"validation data: dropped records {mmpr_index.summary_drops(val_split.index)}")
    for note in notes:
        print(note)


def print_resume(saved, notices: dict, data_changed: str | None, rank: int) -> None:
    """The resume lines (rank 0): the step, changed data, changed settings (`notices`: {key: (saved, now)})."""
    if rank != 0:
        return
    print(f"resumed from {saved.path} (step {saved.step}, reward_shift {saved.reward_shift!r})")
    if data_changed:
        print(f"resume: the training data changed since step {saved.step} ({data_changed})")
    if notices:
        lora_run = (saved.config.get("lora") or {}).get("rank", 0) > 0
        note = {"mpo.reward_shift": " (a fresh start's δ only: a resume carries the saved δ)",
                "model.hf_path": " (the base model under the adapters, the same weights: its digest is checked; the "
                                 "reference is that base with the adapters off)" if lora_run else
                                 " (the frozen reference model; the policy continues from the checkpoint)"}
        changes = ", ".join(f"{k} {a!r} -> {b!r}{note.get(k, '')}" for k, (a, b) in notices.items())
        print(f"resume: changed settings from step {saved.step + 1} on: {changes}; the settings of steps "
              f"up to {saved.step}: config.step_{saved.step}.json")


def progress_bar(cfg, step: int, rank: int):
    """A tqdm bar over mpo.max_num_steps starting at `step` on rank 0 when stdout is a terminal, else None."""
    if rank != 0 or not sys.stdout.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.mpo.max_num_steps, initial=step, unit="step")


def print_step(bar, step: int, cfg, metrics: dict, rank: int) -> None:
    """The console line every logging.log_period steps (rank 0, through the bar if any); advances the bar."""
    if rank == 0 and step % cfg.logging.log_period == 0:
        (bar.write if bar else print)(format_line(step, cfg, metrics))
    if bar:
        bar.update(1)


def format_line(step: int, cfg, m: dict) -> str:
    """The per-step console line (rank 0)."""
    mx = cfg.mpo.max_num_steps
    speed = f"{m['pairs_per_s']:.2f} pairs/s {m['tokens_per_s']:.0f} tok/s"
    if m.get("mfu") is not None:
        speed += f" mfu {100 * m['mfu']:.3g}%"  # significant digits: a tiny model's MFU is far below 0.1%
    return (f"step {step}/{mx} | loss {m['loss']:.4f} (pref {m['preference_loss']:.4f} bco {m['bco_loss']:.4f} "
            f"sft {m['sft_loss']:.4f}) | acc {m['accuracy']:.3f} margin {m['rewards/margin']:.4f} | "
            f"δ {m['reward_shift']:.3e} | lr {m['lr']:.3e} | gnorm {m['grad_norm']:.3f} | {speed} | "
            f"{m['step_time']:.2f} s/step | eta {_duration(m['eta_s'])}")


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def print_validation(step: int, vm: dict, rank: int) -> None:
    """The console line of a validation (rank 0)."""
    if rank == 0:
        print(f"validation step {step}: loss {vm['loss']:.4f} acc {vm['accuracy']:.3f} "
              f"margin {vm['rewards/margin']:.4f} ({mmpr_records.plural(vm['val_batches'], 'batch')})")

"""Multi-rank checkpoint checks (torchrun, gloo, CPU), driven by tests/test_checkpoint.py.

    torchrun --standalone --nproc-per-node 2 tests/dist/check_checkpoint.py WORK_DIR

A small megatron-core GPT model (2 layers, hidden 32) under megatron DDP with Adam, for both the distributed and the
plain megatron optimizer, on DP = 2:
  * 4 steps straight vs 2 steps, save, fresh build, resume, 2 steps: losses, grad norms, lr, final weights and
    every optimizer state tensor (Adam moments and per-parameter `step`) compared bit for bit;
  * the megatron-core Adam-step trap: what the upstream loader alone restores (step 1 / a shared tensor) vs `load`;
  * a leftover `step_3.tmp` is ignored, keep_last prunes, the run state (reward_shift) round-trips exactly;
  * a save whose shard write fails on one rank (OSError ENOSPC) raises the same CheckpointError on both ranks and
    removes its `.tmp`;
  * the model part reloads into TP = 2 (resharded) and gives the TP = 1 loss;
  * a flipped bit in rank 1's shard is one CheckpointError on both ranks (checksums verified by both), and a
    metrics.jsonl that rank 0 cannot write is one MetricsError on both ranks.
The checkpoints go under WORK_DIR; rank 0 reports the result (tests/dist/report.py), the pytest side asserts on it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import report  # noqa: E402  (tests/dist/report.py, beside this file)
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

import checkpoint  # noqa: E402
import config as config_mod  # noqa: E402
from backend import megatron_patches  # noqa: E402
import monitor  # noqa: E402

VOCAB, SEQ = 64, 16


def build(tp: int, distributed_optimizer: bool, max_steps: int = 4, lr: float = 1e-2, min_lr: float = 1e-3):
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, calculate_per_token_loss=True,
    )  # fmt: skip
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)  # fmt: skip
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer),
                                  model)  # fmt: skip
    ocfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=0.1, clip_grad=1.0,
                           use_distributed_optimizer=distributed_optimizer)  # fmt: skip
    opt = get_megatron_optimizer(ocfg, [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=1,
                                    lr_decay_steps=max_steps, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=max_steps, wd_incr_style="constant")  # fmt: skip
    return ddp, opt, sched


def batch(step: int, same_on_all_ranks: bool = False):
    rank = 0 if same_on_all_ranks else dist.get_rank()
    g = torch.Generator().manual_seed(100 + 10 * step + rank)  # different data per DP rank
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return ids, torch.arange(SEQ).expand(2, SEQ)


def train_step(ddp, opt, sched, step: int) -> dict:
    ids, pos = batch(step)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(ids, pos, None, labels=ids).float().mean() / dist.get_world_size()
    loss.backward()
    finalize_model_grads([ddp])
    lr = opt.param_groups[0]["lr"]
    ok, grad_norm, _ = opt.step()
    sched.step(1)
    return {"loss": loss.item(), "grad_norm": grad_norm, "lr": lr}


def opt_tensors(opt) -> list[torch.Tensor]:
    out = []
    for o in checkpoint._inner_optimizers(opt):
        for g in o.optimizer.param_groups:
            for p in g["params"]:
                out.append(p.detach().clone())
                for k in sorted(o.optimizer.state[p]):
                    out.append(o.optimizer.state[p][k].detach().clone())
    return out


def adam_steps(opt) -> tuple[list[float], int]:
    """Per-parameter Adam step values and how many distinct tensor objects hold them."""
    vals, ids = [], set()
    for o in checkpoint._inner_optimizers(opt):
        for g in o.optimizer.param_groups:
            for p in g["params"]:
                s = o.optimizer.state[p]["step"]
                vals.append(float(s))
                ids.add(id(s))
    return vals, len(ids)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


def eval_loss(ddp) -> float:
    ids, pos = batch(99, same_on_all_ranks=True)  # TP ranks must see the same tokens
    with torch.no_grad():
        return ddp(ids, pos, None, labels=ids).float().mean().item()


def scenario(out: Path, distributed_optimizer: bool) -> dict:
    rank = dist.get_rank()
    run_dir = out / f"run_dopt{int(distributed_optimizer)}"
    res: dict = {}
    ddp, opt, sched = build(1, distributed_optimizer)
    straight = [train_step(ddp, opt, sched, s) for s in range(1, 5)]
    final_straight = opt_tensors(opt) + [p.detach().clone() for p in ddp.module.parameters()]

    ddp, opt, sched = build(1, distributed_optimizer)
    first = [train_step(ddp, opt, sched, s) for s in range(1, 3)]
    run_state = {"consumed_pairs": 8, "reward_shift": 0.1 + 1e-17 * 3 + 2 / 3, "reward_shift_num_updates": 2,
                 "sampler": {"epoch": 0, "offset": 8}, "wandb_run_id": "abc123", "config": {}}  # fmt: skip
    checkpoint.save(run_dir, 1, ddp, opt, sched, dict(run_state), keep_last=1)  # pruned by the next save
    checkpoint.save(run_dir, 2, ddp, opt, sched, dict(run_state), keep_last=1)
    saved_steps, _ = adam_steps(opt)
    if rank == 0:
        (run_dir / "step_3.tmp" / checkpoint.MODEL_OPTIM_DIR).mkdir(parents=True)  # a save killed mid-way
        (run_dir / "step_3.tmp" / checkpoint.RUN_STATE_FILE).write_text("{")
    dist.barrier()
    res["dirs"] = sorted(p.name for p in run_dir.iterdir())

    # A failed write (one rank's shard writer finds the disk full: rank 1, whose distributed-optimizer shards are its
    # own; rank 0 with the plain optimizer, whose replicated state only rank 0 writes) is one CheckpointError on every
    # rank, no rank waits in a collective, and the step's .tmp is removed.
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def failed_save(owner, name: str, failing: bool) -> list:
        """Every rank's CheckpointError text (None: saved) of a step-3 save with `owner.name` failing on this rank."""
        original = getattr(owner, name)
        if failing:
            setattr(owner, name, disk_full)
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:  # the lines a rank prints besides the error
                checkpoint.save(run_dir, 3, ddp, opt, sched, dict(run_state))
            error = None
        except checkpoint.CheckpointError as e:
            error = str(e)
        finally:
            setattr(owner, name, original)
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, (error, err.getvalue()))
        return errors

    res["failed_rank"] = int(distributed_optimizer)
    res["failed_save_errors"] = failed_save(filesystem_async, "_write_item", rank == res["failed_rank"])
    res["run_dir"] = str(run_dir)
    res["failed_save_dirs"] = sorted(p.name for p in run_dir.iterdir())
    # The coordinator's write of .metadata fails (after every shard was written): the same, no rank left waiting in
    # megatron-core's broadcast after it.
    base = filesystem_async.FileSystemWriterAsync.__mro__[1]  # torch's FileSystemWriter: `super().finish`
    res["failed_metadata_errors"] = failed_save(base, "finish", rank == 0)
    res["failed_metadata_dirs"] = sorted(p.name for p in run_dir.iterdir())

    # A second save of step 2 (a signal right after a periodic save) killed between its two renames on rank 0
    # (step_2 -> step_2.old done, step_2.tmp -> step_2 not): the next run's clean-up renames step_2.old back, and the
    # resume below loads that restored checkpoint.
    class Killed(BaseException):
        pass

    renames = []
    real_rename = Path.rename

    def killed_on_second_rename(self, target):  # torch's writer renames its .metadata.tmp too: not counted
        if self.parent == run_dir:
            renames.append(self.name)
            if len(renames) == 2:
                raise Killed
        return real_rename(self, target)

    Path.rename = killed_on_second_rename
    try:
        checkpoint.save(run_dir, 2, ddp, opt, sched, dict(run_state), keep_last=1)
    except Killed:
        dist.barrier()  # the barrier that ends `save` on the other ranks
    finally:
        Path.rename = real_rename
    res["killed_renames"] = renames
    res["killed_dirs"] = sorted(p.name for p in run_dir.iterdir())
    if rank == 0:
        checkpoint.remove_unfinished_saves(run_dir)  # what the next run's lock_run_dir does
    dist.barrier()
    res["restored_dirs"] = sorted(p.name for p in run_dir.iterdir())

    # The upstream loader alone (what `load` corrects): build fresh, load without the step repair.
    ddp, opt, sched = build(1, distributed_optimizer)
    restore = megatron_patches.restore_adam_steps
    megatron_patches.restore_adam_steps = lambda o: None
    checkpoint.load(checkpoint.latest_checkpoint(run_dir), ddp, opt, sched)
    megatron_patches.restore_adam_steps = restore
    res["upstream_steps"], res["upstream_step_tensors"] = adam_steps(opt)

    ddp, opt, sched = build(1, distributed_optimizer)
    latest = checkpoint.resume_path(run_dir, resume=True)
    state = checkpoint.load(latest, ddp, opt, sched)
    res["latest"] = latest.name
    res["state"] = {k: getattr(state, k) for k in ("step", "reward_shift", "consumed_pairs", "sampler", "wandb_run_id")}
    res["reward_shift_expected"] = run_state["reward_shift"]
    res["saved_steps"] = saved_steps
    res["loaded_steps"], res["loaded_step_tensors"] = adam_steps(opt)
    res["num_params"] = len(res["loaded_steps"])
    res["sched_num_steps"] = sched.num_steps
    resumed = [train_step(ddp, opt, sched, s) for s in range(3, 5)]
    final_resumed = opt_tensors(opt) + [p.detach().clone() for p in ddp.module.parameters()]
    res["straight"], res["first"], res["resumed"] = straight, first, resumed
    res["final_max_diff"] = max_diff(final_straight, final_resumed)
    res["final_count"] = len(final_straight)

    return res


def reshard(out: Path) -> dict:
    """Model saved at TP = 1 (DP = 2) reloads at TP = 2 (DP = 1) with the same loss."""
    run_dir = out / "run_dopt1"
    ddp, opt, sched = build(1, True)
    checkpoint.load(checkpoint.latest_checkpoint(run_dir), ddp, None, None)
    tp1 = eval_loss(ddp)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    ddp, opt, sched = build(2, True)
    fresh = eval_loss(ddp)
    checkpoint.load(checkpoint.latest_checkpoint(run_dir), ddp, None, None)
    return {"tp1": tp1, "tp2": eval_loss(ddp), "tp2_fresh": fresh}


def damaged_and_full(out: Path) -> dict:
    """A bit flipped in rank 1's shard of a copy of step_2 (beside an intact copy as step_1), verified on both ranks;
    metrics.jsonl on a full disk (rank 0's write fails). Every rank's error text (None: no error)."""
    rank, res = dist.get_rank(), {}
    step = checkpoint.latest_checkpoint(out / "run_dopt1")
    copy = out / "flipped" / step.name
    if rank == 0:
        shutil.copytree(step, out / "flipped" / "step_1")
        shutil.copytree(step, copy)
        shard = copy / checkpoint.MODEL_OPTIM_DIR / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        res["checksum_files"] = sorted(json.loads((step / checkpoint.RUN_STATE_FILE).read_text())["checksums"]["files"])
    dist.barrier()
    res["flipped_path"], res["flipped_previous"] = str(copy), str(out / "flipped" / "step_1")
    flipped = checkpoint.read_run_state(copy)
    res["flipped_errors"] = every_rank_error(lambda: checkpoint.check_complete(flipped, 2), checkpoint.CheckpointError)

    cfg = config_mod.load_config(None, [f"checkpoint.dir={out / 'metrics'}", "logging.wandb=disabled"])
    log = monitor.MetricsLog(cfg, None, 0, rank)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank == 0:
        monitor.open = disk_full  # module global before the builtin
    res["metrics_errors"] = every_rank_error(lambda: log.log(1, {"loss": 0.5}), monitor.MetricsError)
    if rank == 0:
        del monitor.open
    res["metrics_path"] = str(log.path)
    return res


def every_rank_error(call, kind) -> list:
    try:
        call()
        error = None
    except kind as e:
        error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def main() -> None:
    out = Path(sys.argv[1])
    megatron_patches.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    result = {"dopt1": scenario(out, True), "dopt0": scenario(out, False), "reshard": reshard(out)}
    result["damaged"] = damaged_and_full(out)
    if dist.get_rank() == 0:
        report.write(result)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    main()

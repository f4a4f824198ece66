"""MPO training of Nemotron-3-Nano-Omni with torchrun: the whole job, read top to bottom.

    torchrun --standalone --nproc-per-node 2 train.py configs/tiny.toml                     # CPU (gloo), ~1 min
    torchrun --standalone --nproc-per-node 8 train.py configs/nano.toml \
        model.hf_path=/ckpt/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16 data.train.data_path=/data/MMPR-v1.2/meta.json

`main(cfg)` runs the job in sections: config, distributed init, data, reference, policy, optimizer, resume, loop,
teardown. One step (`train_step`): this DP rank's bins, the step's valid pairs, the reference's sums, policy forward +
MPO loss + backward per microbatch, DP gradient sum, `check_finite`, Adam and LR step, δ update; every tensor on
`Ctx.device` (docs/DESIGN.md). Validation every `mpo.val_period` steps; the job stops at `mpo.max_num_steps`,
`mpo.stop_after_step` or a stop signal (save, exit 0) and resumes from its run directory. Tests: tests/test_train.py.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

# one CUDA work queue per device: megatron-core's TP/SP overlap and DDP bucketing assume it (docs/DESIGN.md)
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
if not {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & os.environ.keys():  # the user's allocator setting wins
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # less fragmentation: plan.py's reserve


def _interrupted_while_importing(signum, frame) -> None:  # Ctrl-C in the imports below: one line, not a traceback
    if os.environ.get("RANK", "0") == "0":
        print("interrupted while starting: nothing saved", file=sys.stderr, flush=True)
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_while_importing)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import checkpoint  # noqa: E402
import config as config_mod  # noqa: E402

config_mod.quiet_known_warnings()  # before megatron-core is imported (mpo_loss); OMNI_MPO_SHOW_WARNINGS=1 shows all
import distributed  # noqa: E402
import hf_weights  # noqa: E402
import lora  # noqa: E402
import mmpr_data  # noqa: E402
import mmpr_index  # noqa: E402
import mmpr_records  # noqa: E402
import model_hub  # noqa: E402
import monitor  # noqa: E402
import mpo_loss  # noqa: E402
import omni_model  # noqa: E402
import pack  # noqa: E402
import preflight  # noqa: E402
import reference_logprobs  # noqa: E402
from backend import kernel_selection, megatron_patches, shared_prompt  # noqa: E402
from distributed import Ctx  # noqa: E402

# ======================================================================================================================
# The job


def main(cfg) -> int:
    """Run (or resume) the training job described by `cfg`; returns the exit code (0 also for a segment stop)."""
    # -- config: every check that needs no process group ------------------------------------------------------------
    kernels = kernel_selection.select_kernels(dtype=omni_model.torch_dtype(cfg.model.params_dtype))
    cfg.packing.shared_prompt, pair_format = shared_prompt.resolve(cfg, kernels)  # "auto" -> a bool
    hf = preflight.check_inputs(cfg)  # model.hf_path's config.json: preflight.read_model_config
    preflight.check_model_config(cfg, hf, kernels)

    # -- distributed initialisation, seeds, the run directory -------------------------------------------------------
    distributed.set_deterministic(cfg.model.deterministic_mode)  # before the first CUDA work
    ctx = distributed.init_distributed(cfg, distributed.local_device(), getattr(hf.text, "n_routed_experts", None),
                                       kernels)  # megatron_patches.apply(kernels): no second probe
    rank, world = dist.get_rank(), dist.get_world_size()
    check_one_model_revision(cfg, world)
    distributed.seed_everything(cfg.mpo.seed)
    if rank == 0:
        monitor.print_layout(ctx, world, kernels, pair_format)
    checkpoint.lock_run_dir(cfg.checkpoint.dir)  # one run per checkpoint.dir; removes unfinished step_<N>.tmp saves
    resume_from = checkpoint.resume_path(cfg.checkpoint.dir, cfg.checkpoint.resume)
    saved = checkpoint.read_run_state(resume_from) if resume_from else None  # None: a fresh start
    notices = checkpoint.check_resume(saved, cfg) if saved else {}  # refuses another layout, β or LR schedule
    last = cfg.mpo.stop_after_step or cfg.mpo.max_num_steps
    if saved and saved.step >= last:  # a finished run (or segment): nothing is built, no W&B run is opened
        if rank == 0:
            print(f"nothing to do: step {saved.step} already reached the stop step {last}")
        return 0
    # metrics.jsonl and W&B before the data and the models: a W&B that cannot start fails in seconds, on every rank
    log = monitor.MetricsLog(cfg, saved.wandb_run_id if saved else None, saved.step if saved else 0, rank)
    stopper = distributed.StopSignal()
    monitor.Console.install()  # a hung-up terminal or a closed pipe no longer kills a rank before the stop's save

    # -- data -------------------------------------------------------------------------------------------------------
    data = load_data(cfg, hf, rank)

    # -- the frozen reference: a model beside the policy, or its log-probs computed once before it (the pass) -------
    if cfg.reference.logprobs == "precomputed":  # the pass holds only the reference, freed before the policy is built
        stored = reference_logprobs.precompute(cfg, ctx, kernels, data, stopper)
        if stored is None:  # a stop signal during the pass: its shards are kept, the next start continues
            log.finish()
            return 0
        ref_train, ref_val = stored
    elif not cfg.lora.rank:  # with LoRA the reference is the policy with its adapters off (below)
        ref_train = ref_val = reference_logprobs.build_reference(cfg, ctx, kernels)

    # -- policy (the reference's initial weights); LoRA: adapters added, every base weight frozen --------------------
    policy = hf_weights.build_from_hf(cfg, kernels)
    if cfg.lora.rank:
        lora.apply_lora(policy, cfg.lora, seed=cfg.mpo.seed)
        if cfg.reference.logprobs == "online":
            ref_train = ref_val = reference_logprobs.build_reference(cfg, ctx, kernels, policy)
    n_active = monitor.active_params(policy, hf)

    # -- optimizer: megatron DDP + (distributed) Adam, LR schedule --------------------------------------------------
    ddp, optimizer, scheduler = build_optimizer(policy, cfg)

    # -- resume: the run state (step, δ, data position, W&B id) -----------------------------------------------------
    run_state = resume(saved, notices, ddp, optimizer, scheduler, data.sampler, cfg, rank)
    run_state["wandb_run_id"] = log.run_id
    planner = functools.partial(plan_bins_and_select, data.train_split.index, ctx)
    loader = iter(mmpr_data.StepLoader(data.train_set, data.sampler, cfg.policy.train_global_batch_size, planner,
                                       cfg.data.num_workers))
    if stopper.interrupted(ctx.device):  # a Ctrl-C while the data and models loaded: stop before any step
        if rank == 0:
            print("interrupted before the first step: nothing saved", file=sys.stderr)
        log.finish()
        return 130

    # -- the loop: one optimizer step, its metrics, validation, checkpoint, stop ------------------------------------
    bar, t_start, start = monitor.progress_bar(cfg, run_state["step"], rank), time.perf_counter(), run_state["step"]
    saved_step = start  # the step of the latest checkpoint (0: none yet)
    ddp.train()
    try:
        while True:
            t0 = time.perf_counter()
            step_data = distributed.agreed(lambda: next(loader), ctx)  # a DataError of one rank stops every rank
            batches = pack.load_bins(step_data.plan, step_data.pairs, ctx, data.ids["image"], data.ids["pad"])
            metrics, new_shift = train_step(ddp, ref_train, optimizer, scheduler, batches, ctx,
                                            run_state["reward_shift"])
            advance_run_state(run_state, step_data, metrics, new_shift)
            step = run_state["step"]
            tokens, dt = monitor.global_tokens(batches, ctx.dp_group, ctx.device), time.perf_counter() - t0
            metrics.update(monitor.speed_metrics(tokens, dt, len(step_data.pair_ids), n_active, world,
                                                 reference_forward=cfg.reference.logprobs == "online"))
            metrics.update(dropped_oversized=data.train_split.dropped_oversized,
                           consumed_pairs=run_state["consumed_pairs"],
                           eta_s=(time.perf_counter() - t_start) / (step - start) * (last - step))
            log.log(step, metrics)
            monitor.print_step(bar, step, cfg, metrics, rank)
            at_end = step >= cfg.mpo.max_num_steps
            if data.val_split is not None and (cfg.mpo.val_period and step % cfg.mpo.val_period == 0
                                               or at_end and cfg.mpo.val_at_end):
                vm = run_validation(ddp, ref_val, data.val_split, data.val_set, ctx, run_state["reward_shift"],
                                    data.ids)
                log.log(step, vm, split="validation")
                monitor.print_validation(step, vm, rank)
            stop = stopper.should_stop(ctx.device)
            segment_end = cfg.mpo.stop_after_step and step == cfg.mpo.stop_after_step
            if at_end or segment_end or stop or (cfg.checkpoint.save_period and step % cfg.checkpoint.save_period == 0):
                save_checkpoint(run_state, ddp, optimizer, scheduler, cfg, rank)
                saved_step = step
            if at_end or segment_end or stop:
                break
    except mmpr_records.DataError as e:  # raised on every rank (distributed.agreed): keep the finished steps, then stop
        if run_state["step"] > saved_step:
            save_checkpoint(run_state, ddp, optimizer, scheduler, cfg, rank)
        # saved now or before
        where = f"before step {run_state['step'] + 1}; {monitor.last_saved(run_state['step'], cfg)}"
        raise mmpr_records.DataError(f"{e} ({where})") from None
    except RuntimeError as e:
        if not (isinstance(e, DivergedError) or str(e) == NOT_FINITE):  # NOT_FINITE: check_finite's assertion
            raise
        # the first step after a resume: its state is suspect
        first = resume_from if run_state["step"] == start else None
        raise DivergedError(monitor.diverged_message(e, run_state["step"] + 1, first, saved_step, cfg)) from None

    # -- teardown ---------------------------------------------------------------------------------------------------
    if rank == 0:
        why = "max_num_steps" if step >= cfg.mpo.max_num_steps else "stop_after_step" if segment_end else "signal"
        print(f"stopped after step {step} ({why})")
    if bar:
        bar.close()
    log.finish()
    return 0


# ======================================================================================================================
# Set-up: data, models, optimizer, run state


@dataclass
class Data:
    """The training and validation splits, their datasets, the training sampler and the special token ids."""

    train_split: mmpr_index.Split
    val_split: mmpr_index.Split | None
    train_set: mmpr_data.PairDataset
    val_set: mmpr_data.PairDataset | None
    sampler: mmpr_data.PairSampler
    ids: dict  # {"image": image token id, "pad": pad token id}


def load_data(cfg, hf, rank: int) -> Data:
    """Load and check the splits (preflight.check_splits); rank 0 prints the data lines and warnings, once."""
    processor = mmpr_index.load_processor(model_hub.model_dir(cfg.model), "model.hf_path")
    with mmpr_records.data_warnings([]) as warned:
        train_split, val_split = mmpr_index.load_splits(processor, cfg.data)
    train_split, val_split, notes = preflight.check_splits(train_split, val_split, cfg)
    monitor.print_data(train_split, val_split, warned + notes, rank)
    val_set = mmpr_data.PairDataset(val_split.index, processor) if val_split is not None else None
    sampler = mmpr_data.PairSampler(train_split.pair_ids, cfg.data.train.seed, cfg.data.train.shuffle,
                                    train_split.index.fingerprint)
    return Data(train_split, val_split, mmpr_data.PairDataset(train_split.index, processor), val_set, sampler,
                ids={"image": hf.image_token_id, "pad": processor.tokenizer.pad_token_id or 0})


def check_one_model_revision(cfg, world: int) -> None:
    """Collective: every rank resolved a hub id in model.hf_path to one commit (nodes resolve it apart: a branch that
    moves between them would train two models); ConfigError naming the commits otherwise."""
    revisions: list = [None] * world
    dist.all_gather_object(revisions, cfg.model.hf_revision)
    if len(set(revisions)) > 1:
        raise config_mod.ConfigError(f"model.hf_path = {cfg.model.hf_path!r} resolved to other commits on other ranks "
                                     f"({', '.join(sorted(set(revisions)))}): set model.hf_revision to one of them")


def build_scheduler(optimizer, cfg):
    """megatron-core's OptimizerParamScheduler: warmup from lr_warmup_init to optimizer.lr, then `lr_decay_style` to
    min_lr at mpo.max_num_steps (the horizon of every segment). Schedule step n's lr is used by optimizer step n + 1."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s, o, horizon = cfg.scheduler, cfg.optimizer, cfg.mpo.max_num_steps
    return OptimizerParamScheduler(
        optimizer, init_lr=s.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=horizon, lr_decay_style=s.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=horizon, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,  # a schedule change between segments: checkpoint.check_resume
    )  # fmt: skip


def build_optimizer(policy, cfg):
    """(ddp, optimizer, scheduler): megatron-core DDP around the policy (gradients summed over microbatches, DP and
    CP: mpo_loss's denominator contract; in fp32 or, optimizer.grad_reduce_in_fp32=false, model.params_dtype), its
    Adam (distributed by default; bf16 params keep fp32 master weights, or with use_precision_aware_optimizer the
    optimizer updates them itself: megatron_patches.precision_aware_adam). Both see only the parameters that require a
    gradient: with LoRA the adapters (no gradient buffer, optimizer state or master copy for a frozen base weight)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optimizer
    ddp_model_cfg = copy.copy(policy.lm_config)
    ddp_model_cfg.calculate_per_token_loss = True  # DDP: gradient scaling 1 and a SUM reduction
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=o.grad_reduce_in_fp32,
                                            use_distributed_optimizer=o.use_distributed_optimizer)
    ddp = DistributedDataParallel(ddp_model_cfg, ddp_cfg, policy)
    bf16 = cfg.model.params_dtype == "bfloat16"
    moments = {"fp32": torch.float32, "bf16": torch.bfloat16}
    precision = dict(use_precision_aware_optimizer=o.use_precision_aware_optimizer,
                     store_param_remainders=o.store_param_remainders, exp_avg_dtype=moments[o.exp_avg_dtype],
                     exp_avg_sq_dtype=moments[o.exp_avg_sq_dtype])  # fmt: skip
    optim_cfg = megatron_patches.optimizer_config(
        OptimizerConfig, precision, optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=o.use_distributed_optimizer,
    )  # fmt: skip
    with megatron_patches.precision_aware_adam(optim_cfg):
        optimizer = get_megatron_optimizer(optim_cfg, [ddp])
    return ddp, optimizer, build_scheduler(optimizer, cfg)


def resume(saved, notices: dict, ddp, optimizer, scheduler, sampler: mmpr_data.PairSampler, cfg, rank: int) -> dict:
    """The run state (run_state.json's keys): fresh (`saved` None) or loaded, with the model, optimizer, scheduler and
    sampler, from `saved` (checkpoint.RunState); reward_shift is δ for the next step. Rank 0 writes the config.
    Collective (LoRA: the base model's digest)."""
    folder = model_hub.model_dir(cfg.model)
    snapshot = model_hub.resolve_model(cfg)  # a hub id's snapshot (resolved by preflight), None for a folder
    run_state = {"step": 0, "consumed_pairs": 0, "sampler": None, "reward_shift": cfg.mpo.reward_shift,
           "reward_shift_num_updates": 0, "wandb_run_id": None, "model_files": model_hub.model_files(folder),
           "model_snapshot": dataclasses.asdict(snapshot) if snapshot else None}  # fmt: skip
    if cfg.lora.rank:  # the checkpoints hold only the adapters: the base weights they belong to
        run_state["base_model_digest"] = model_hub.base_model_digest(folder)
    if saved is not None:
        checkpoint.load(saved, ddp, optimizer, scheduler)
        run_state.update({k: getattr(saved, k) for k in ("step", "consumed_pairs", "reward_shift",
                                                         "reward_shift_num_updates", "wandb_run_id")})  # fmt: skip
        data_changed = sampler.load_state_dict(saved.sampler)  # a note when the data changed, same pair count
        monitor.print_resume(saved, notices, data_changed, rank)
    run_state["sampler"] = sampler.state_dict()
    # after a successful resume: a refused config never replaces the run's
    path = checkpoint.write_resolved_config(cfg, rank, (saved.step, saved.config) if notices else None)
    if rank == 0:
        print(f"config: {path}")
    return run_state


def advance_run_state(run_state: dict, step_data: mmpr_data.StepData, metrics: dict, new_shift: float) -> None:
    """The run state after a finished optimizer step (what a checkpoint written now must hold)."""
    run_state["step"] += 1
    run_state["reward_shift"] = new_shift
    run_state["reward_shift_num_updates"] += int(metrics["bco/reward_count"] > 0)
    run_state["consumed_pairs"] += len(step_data.pair_ids)
    run_state["sampler"] = step_data.sampler_state


def save_checkpoint(run_state: dict, ddp, optimizer, scheduler, cfg, rank: int) -> None:
    """Checkpoint step run_state["step"] (collective) with the run state and the resolved config; prints the path."""
    state = {k: v for k, v in run_state.items() if k != "step"} | {"config": config_mod.to_dict(cfg)}
    path = checkpoint.save(cfg.checkpoint.dir, run_state["step"], ddp, optimizer, scheduler, state,
                           cfg.checkpoint.keep_last)
    if rank == 0:
        print(f"saved {path}")


# ======================================================================================================================
# Errors that stop the run: a non-finite step (bad data on one rank: distributed.agreed)


class DivergedError(RuntimeError):
    """The loss or the gradients of a step are not finite: the optimizer step is not taken."""


NOT_FINITE = "the loss or the gradients are not finite (NaN or inf); the weights were not updated"


def check_finite(ddp, local: dict, reward_sum, ctx: Ctx) -> None:
    """Collective, before the optimizer step: one device-side assertion that the losses (`local`), δ's reward sum
    and the gradients are finite on every rank; RuntimeError(NOT_FINITE) on the CPU, a device-side assert on a GPU."""
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=ctx.device).reshape(())
                          for v in (*local.values(), reward_sum)])
    bad = torch.zeros(1, dtype=torch.long, device=ctx.device)
    bad |= (~torch.isfinite(values)).any()
    chunk = 1 << 26  # isfinite's bool temporary: 64 MiB at most, not one byte per gradient element of the buffer
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        if buffer.grad_data is not None:
            flat = buffer.grad_data.view(-1)
            for i in range(0, flat.numel(), chunk):
                bad |= (~torch.isfinite(flat[i : i + chunk])).any()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # on every rank: a shard's NaN stops them all
    torch._assert_async(bad[0] == 0, NOT_FINITE)


# ======================================================================================================================
# One microbatch, one step, one validation


def plan_bins_and_select(index: mmpr_data.MMPRIndex, ctx: Ctx, pair_ids: list[int]) -> tuple[pack.BinPlan, list[int]]:
    """(the step's bin plan over all DP ranks, the pair ids this DP rank loads): mmpr_data.StepLoader's plan_fn."""
    plan = pack.plan_step(index.lengths(pair_ids), ctx.cfg.packing, ctx.dp, index.shared_lengths(pair_ids))
    return plan, [p for b in plan.ranks[ctx.dp_rank] for p in b.pair_ids]


def policy_forward_backward(batches, ref_logprobs, policy, ctx: Ctx, reward_shift: float, num_global_pairs: int,
                            backward: bool, read: bool = True):
    """Policy forward + MPO loss per microbatch, and its backward when `backward` (gradients accumulate in megatron
    DDP's main_grad buffers). Returns this rank's summed metrics, reward_sum, reward_count: floats, or with read=False
    0-d float64 tensors on the step's device (no wait for the GPU; train_step reads them after the update)."""
    per_mb = []
    for b, ref in zip(batches, ref_logprobs, strict=True):
        host = pack.host_view(b)  # the pair metadata on the host: mpo_loss matches the pairs there
        with torch.set_grad_enabled(backward):
            logprobs, num_response_tokens = mpo_loss.forward_logprobs(policy, b, ctx)
            loss, metrics, (s, c) = mpo_loss.mpo_loss(logprobs, ref, num_response_tokens, host.pair_index,
                                                      host.is_chosen, host.sample_mask, ctx.cfg.mpo, reward_shift,
                                                      num_global_pairs)
        if backward:
            loss.backward()  # megatron DDP accumulates into its main_grad buffers
        per_mb.append({**metrics, "bco/reward_sum": s, "bco/reward_count": c})
    local = mpo_loss.combine_metrics(per_mb, read=read)
    return local, local.pop("bco/reward_sum"), local.pop("bco/reward_count")


def train_step(ddp, reference, optimizer, scheduler, batches, ctx: Ctx, reward_shift: float):
    """One optimizer step over this rank's microbatches; returns (the step's metrics over all DP ranks, the new δ).
    `reference`: the frozen model or the stored sums (reference_logprobs.sums). The device is read twice: the pair
    count and the metrics after the update."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    num_global_pairs = mpo_loss.count_global_pairs(batches, ctx)
    ref = reference_logprobs.sums(reference, batches, ctx)
    # MoE auxiliary loss scaled as megatron-core's schedules do: a mean over microbatches, DP and CP ranks (our DP
    # reduction sums); a 0-d tensor, the shape megatron's backward gives the class-level scale
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((), 1.0 / (len(batches) * ctx.dp * ctx.cp), device=ctx.device))
    local, r_sum, r_count = policy_forward_backward(batches, ref, ddp, ctx, reward_shift, num_global_pairs,
                                                    backward=True, read=False)
    finalize_model_grads([ddp])  # DP (+CP) gradient sum, sequence-parallel norm grads
    check_finite(ddp, local, r_sum, ctx)  # before the update: a diverged step never reaches the weights
    lr = optimizer.param_groups[0]["lr"]  # the lr this update uses
    _, grad_norm, _ = optimizer.step()
    if not math.isfinite(grad_norm):  # finite gradients whose squares overflowed the norm (fp32: |g| > ~1e19)
        raise DivergedError(f"the gradient norm is {grad_norm} (finite gradients, whose norm overflowed)")
    scheduler.step(increment=1)
    # the step's one read of its metrics, after the update: δ's statistics ride in the same all-reduce
    metrics = mpo_loss.reduce_metrics({**local, "bco/reward_sum": r_sum, "bco/reward_count": r_count}, ctx.dp_group,
                                     ctx.device)
    new_shift = mpo_loss.update_reward_shift(reward_shift, metrics["bco/reward_sum"], metrics["bco/reward_count"],
                                             ctx.cfg.mpo.reward_shift_momentum)
    # reward_shift: δ after this update (the next step's); reward_shift_used: the exact δ this step's loss used
    metrics.update(lr=lr, grad_norm=float(grad_norm), num_global_pairs=num_global_pairs, reward_shift=new_shift,
                   reward_shift_used=reward_shift)
    return metrics, new_shift


def run_validation(policy, reference, val: mmpr_index.Split, dataset, ctx: Ctx, reward_shift: float,
                   ids: dict) -> dict:
    """The MPO losses and metrics on up to mpo.val_batches batches of mpo.val_global_batch_size pairs of the
    validation split, in split order; no gradient, δ fixed. Metrics are pair-weighted means over batches."""
    cfg, n, total, pairs_seen = ctx.cfg, ctx.cfg.mpo.val_global_batch_size, {}, 0
    chunks = [val.pair_ids[i : i + n] for i in range(0, len(val.pair_ids), n)][: cfg.mpo.val_batches]
    policy.eval()
    for chunk in chunks:
        plan = pack.plan_step(val.index.lengths(chunk), cfg.packing, ctx.dp, val.index.shared_lengths(chunk))
        pairs = distributed.agreed(lambda: {p: dataset[p] for b in plan.ranks[ctx.dp_rank] for p in b.pair_ids},  # noqa: B023
                                   ctx)
        batches = pack.load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
        num_global_pairs = mpo_loss.count_global_pairs(batches, ctx)
        ref = reference_logprobs.sums(reference, batches, ctx)
        local, _, _ = policy_forward_backward(batches, ref, policy, ctx, reward_shift, num_global_pairs, backward=False)
        m = mpo_loss.reduce_metrics(local, ctx.dp_group, ctx.device)
        for k, v in m.items():
            if mpo_loss.METRIC_REDUCTION.get(k, "mean") == "mean":
                total[k] = total.get(k, 0.0) + v * num_global_pairs
            elif mpo_loss.METRIC_REDUCTION.get(k) == "count":
                total[k] = total.get(k, 0) + v  # an int (mpo_loss.reduce_metrics)
        pairs_seen += num_global_pairs
    policy.train()
    mean = {k for k in total if mpo_loss.METRIC_REDUCTION.get(k, "mean") == "mean"}
    out = {k: (v / max(pairs_seen, 1) if k in mean else v) for k, v in total.items()}
    out["val_batches"] = len(chunks)
    return out


# ======================================================================================================================

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # imports done: KeyboardInterrupt from here on
    path, overrides = config_mod.parse_cli(None, "torchrun --standalone --nproc-per-node N train.py",
                                           "MPO training (README.md).")
    known = (config_mod.ConfigError, mmpr_records.DataError, checkpoint.CheckpointError, DivergedError,
             monitor.MetricsError)  # a bad setting, input or run directory: one line says what to change
    code = monitor.exit_in_one_line(lambda: main(config_mod.load_config(path, overrides)), known)
    distributed.destroy_distributed()
    sys.exit(code)

"""2-rank checks of omni_model (run by tests/test_omni_model.py through the `torchrun` fixture; by hand:
`torchrun --standalone --nproc-per-node 2 tests/dist/check_omni_model.py`).

In ONE launch, for each layout (TP=1 reference, TP=2 with sequence parallelism, EP=2, CP=2, DP=2): set up
megatron-core's parallel_state, build the model, load the weights from the same HF files (assets/tiny-omni), run one
packed pair (an image, a 3-frame video, a clip and text, padded THD) forward and backward, gather the logits to the
full [T, V] in packed order and the gradient of a fixed scalar loss w.r.t. a few parameters, and report the max-abs
differences to the reference and each layout's monitor.active_params (rank 0, tests/dist/report.py). DP=2: rank r
runs pair r of two such pairs; the reference runs both one after the other, its gradients and expert token counts
their sums (what the DP all-reduce of finalize_model_grads gives), its logits each pair's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: omni_model_cases
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, first


def run_layout(tp: int, ep: int, cp: int, sp: bool, batch: dict, dp: int = 1):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from omni_model_cases import TINY

    import hf_weights
    import monitor
    import omni_model as om
    from config import ModelConfig, ParallelConfig
    from pack import cp_partition_index

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    pcfg = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, expert_model_parallel_size=ep,
                          sequence_parallel=sp)
    model = om.build_model(TINY, ModelConfig(), pcfg)
    # EVS on (the tiny asset has none, the hub checkpoint 0.7): make_pair_batch's video keeps 6 of its 12 tokens, in a
    # layout the model moves before the CP slice
    model.hf.video_pruning_rate = 0.5
    hf_weights.load_hf_weights(model, TINY)
    logits = model(batch)  # [T/CP, V/TP]
    # a fixed scalar loss of the full logits, so every layout's gradients must agree
    T = batch["input_ids"].numel()
    V = model.hf.text.vocab_size
    w = torch.randn(T, V, generator=torch.Generator().manual_seed(7))
    cu_pad = batch["cu_seqlens_padded"]
    if cp > 1:
        idx = cp_partition_index(cu_pad, cp, parallel_state.get_context_parallel_rank())
    else:
        idx = torch.arange(T)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    vs = V // tp
    loss = (logits * w[idx][:, tp_rank * vs:(tp_rank + 1) * vs]).sum()
    loss.backward()
    # full logits: gather vocab over TP, then sequence over CP
    full = logits.detach()
    if tp > 1:
        parts = [torch.empty_like(full) for _ in range(tp)]
        dist.all_gather(parts, full.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        full = torch.cat(parts, dim=1)
    if cp > 1:
        parts = [torch.empty_like(full) for _ in range(cp)]
        dist.all_gather(parts, full.contiguous(), group=parallel_state.get_context_parallel_group())
        order = torch.cat([cp_partition_index(cu_pad, cp, r) for r in range(cp)])
        out = torch.empty_like(full.new_zeros(T, full.shape[1]))
        out[order] = torch.cat(parts)
        full = out
    if dp > 1:  # each DP rank's pair: [dp, T, V]
        parts = [torch.empty_like(full) for _ in range(dp)]
        dist.all_gather(parts, full.contiguous(), group=parallel_state.get_data_parallel_group())
        full = torch.stack(parts)
    # gradients of replicated parameters (summed over CP ranks, as megatron's grad reduction does over DP x CP)
    grads = {}
    for name in ("vision_model.class_token", "vision_projection.encoder.linear_fc1.layer_norm_weight",
                 "language_model.decoder.final_norm.weight", "language_model.decoder.layers.2.mlp.router.weight",
                 "sound_encoder.encoder.subsampling.linear.weight",
                 "sound_projection.encoder.linear_fc1.layer_norm_weight"):
        p = dict(model.named_parameters())[name]
        g = p.grad.detach().clone()
        if tp > 1 and getattr(p, "sequence_parallel", False):  # what finalize_model_grads does for SP params
            dist.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
        if cp > 1:
            dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
        if dp > 1:
            dist.all_reduce(g, group=parallel_state.get_data_parallel_group())
        grads[name] = g
    # MoE routing statistics (expert-bias token counts) summed over the ranks that split the tokens (TP under SP,
    # CP), as finalize_model_grads does: only real tokens count, whatever the layout
    counts = torch.stack([m.local_tokens_per_expert for m in model.language_model.modules()
                          if hasattr(m, "expert_bias")])
    if tp > 1 and sp:
        dist.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
    if cp > 1:
        dist.all_reduce(counts, group=parallel_state.get_context_parallel_group())
    if dp > 1:
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    grads["tokens_per_expert"] = counts
    grads["active_params"] = monitor.active_params(model, model.hf)  # global count: the same in every layout
    destroy_moe_metrics_tracker()
    parallel_state.destroy_model_parallel()
    return full, grads


def main() -> None:
    import report
    import torch
    import torch.distributed as dist
    from omni_model_cases import make_pair_batch, with_audio

    from backend import megatron_patches

    megatron_patches.apply()
    dist.init_process_group("gloo")
    # all media; the second pair (DP rank 1's) has other tokens, pixels and row lengths
    batches = [with_audio(make_pair_batch(seed=3 + i, lens=lens, divisible_by=8, video=True), start=20)
               for i, lens in enumerate(((32, 40), (40, 32)))]
    one = [run_layout(1, 1, 1, False, b) for b in batches]
    ref_active = [g.pop("active_params") for _, g in one][0]
    result = {}
    for name, (tp, ep, cp, sp, dp) in {"tp2_sp": (2, 1, 1, True, 1), "ep2": (1, 2, 1, False, 1),
                                       "cp2": (1, 1, 2, False, 1), "dp2": (1, 1, 1, False, 2)}.items():
        # the reference: pair 0, or under DP both pairs (logits each, gradients and counts summed)
        ref = one[0][0] if dp == 1 else torch.stack([logits for logits, _ in one])
        ref_grads = {k: sum(g[k] for _, g in one[:dp]) for k in one[0][1]}
        ref_counts = ref_grads.pop("tokens_per_expert")
        try:
            full, grads = run_layout(tp, ep, cp, sp, batches[dist.get_rank()] if dp > 1 else batches[0], dp)
            counts = grads.pop("tokens_per_expert")
            active = grads.pop("active_params")
            result[name] = {"logits": (full - ref).abs().max().item(),
                            "grads_rel": {k: ((grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()).item()
                                          for k in grads},
                            "tokens_per_expert": counts.tolist(), "ref_tokens_per_expert": ref_counts.tolist(),
                            "logit_scale": ref.abs().max().item(),
                            "active_params": active, "ref_active_params": ref_active}
        except Exception as e:  # reported, and the test fails on it
            result[name] = report.failure(e)
    if dist.get_rank() == 0:
        report.write(result)
        print(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    torch.set_num_threads(1)


if __name__ == "__main__":
    main()

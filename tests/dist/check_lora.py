"""2-rank check of lora (run by tests/test_lora.py through the `torchrun` fixture; by hand:
`torchrun --standalone --nproc-per-node 2 tests/dist/check_lora.py`).

In ONE launch: the TP=1 reference (each rank alone) gets adapters on every component but the routed experts, its B
drawn at random, and runs one packed image + clip + text pair forward and backward; the adapters in HF layout
(lora.hf_adapter_state) go to the TP=2 layout with sequence parallelism (MoE with TP needs SP). The language
model's adapters take the SP paths (u all-gathered / reduce-scattered over the sequence), the ViT's and the two
projectors', which run without SP in the same forward, the others (u copied / all-reduced).
Reported (rank 0): max-abs logits difference, the largest relative difference of the adapters' gradients in HF
layout (replicated gradients of SP-tagged adapters summed over TP first, as finalize_model_grads does), and how far
the adapters move the logits from the base model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: omni_model_cases
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, first

LORA = dict(rank=4, alpha=8.0, vision_tower=True, projector=True, sound_projector=True)


def run_layout(tp: int, sp: bool, batch: dict, state: dict | None):
    """(full logits [T, V], adapter grads in HF layout, adapters in HF layout, base logits max-abs change)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from omni_model_cases import TINY

    import hf_weights
    import lora
    import omni_model as om
    from config import LoraConfig, ModelConfig, ParallelConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    model = om.build_model(TINY, ModelConfig(), ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp))
    hf_weights.load_hf_weights(model, TINY)
    lora.apply_lora(model, LoraConfig(**LORA))
    if state is None:  # the reference draws B
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, _, ad in lora.adapted(model):
                ad.B.copy_(torch.randn(ad.B.shape, generator=g) * 0.1)
    else:
        lora.set_hf_adapter_state(model, state)
    state = lora.hf_adapter_state(model, TINY)
    group = parallel_state.get_tensor_model_parallel_group()
    T, V = batch["input_ids"].numel(), model.hf.text.vocab_size
    logits = model(batch)  # [T, V/TP]
    with torch.no_grad(), lora.adapters_disabled(model):
        base = model(batch)
    w = torch.randn(T, V, generator=torch.Generator().manual_seed(7))
    rank, vs = parallel_state.get_tensor_model_parallel_rank(), V // tp
    (logits * w[:, rank * vs:(rank + 1) * vs]).sum().backward()
    for _, _, ad in lora.adapted(model):  # finalize_model_grads: SP-tagged replicated grads summed over TP
        for p in (ad.A, ad.B):
            if tp > 1 and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=group)
    grads = lora.hf_adapter_state(model, TINY, grads=True)

    def gather(t):
        if tp == 1:
            return t.detach()
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
        return torch.cat(parts, dim=1)

    full, full_base = gather(logits), gather(base)
    destroy_moe_metrics_tracker()
    parallel_state.destroy_model_parallel()
    return full, grads, state, (full - full_base).abs().max().item()


def main() -> None:
    import report
    import torch.distributed as dist
    from omni_model_cases import make_pair_batch, with_audio

    from backend import megatron_patches

    megatron_patches.apply()
    dist.init_process_group("gloo")
    batch = with_audio(make_pair_batch(seed=3, lens=(21, 30), divisible_by=8))
    ref, ref_grads, state, changed = run_layout(1, False, batch, None)
    result = {}
    for name, (tp, sp) in {"tp2_sp": (2, True)}.items():
        try:
            full, grads, _, changed = run_layout(tp, sp, batch, state)
            rel = max(((grads[k][i] - ref_grads[k][i]).abs().max() / ref_grads[k][i].abs().max().clamp_min(1e-30))
                      .item() for k in ref_grads for i in (0, 1))
            result[name] = {"logits": (full - ref).abs().max().item(), "adapter_grads_rel": rel,
                            "logits_changed": changed, "adapted_weights": len(ref_grads)}
        except Exception as e:  # reported, and the test fails on it
            result[name] = report.failure(e)
    if dist.get_rank() == 0:
        report.write(result)
        print(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

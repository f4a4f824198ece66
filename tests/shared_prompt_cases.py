"""Shared code of the shared-prompt model checks (tests/test_shared_prompt_model.py in process, and the TP = 2 / DP = 2
worker tests/dist/check_shared_prompt.py): synthetic preference pairs for assets/tiny-omni and one MPO
forward/backward of the same bins in either format through train.py's own functions.

Not a test module itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-omni"
DIST_WORKER = ROOT / "tests" / "dist" / "check_shared_prompt.py"
IMAGE, IMG_START, IMG_END = 18, 21, 22  # assets/tiny-omni/config.json: img_context / img_start / img_end token ids

# (prompt tokens, images, chosen response tokens, rejected response tokens). The tiny model's Mamba chunk is 16: no
# prompt is a multiple of it; two pairs carry an image (grid 4 x 6 -> 6 `<image>` tokens), two are text only; one
# response is shorter than the conv window (4).
PAIR_SPECS = [(19, 1, 9, 14), (13, 0, 22, 3), (37, 1, 5, 11), (6, 0, 17, 30)]


def make_pairs(specs=PAIR_SPECS, seed: int = 0):
    """pack.PreferencePair per spec: the prompt [1, 5, (<img> <image>*6 </img>), random text], chosen and rejected
    responses of random ids whose first tokens differ (loss mask True on the response tokens)."""
    import pack

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n_prompt, n_images, n_c, n_r) in enumerate(specs):
        prompt = torch.randint(32, 1000, (n_prompt,), generator=g)
        prompt[:2] = torch.tensor([1, 5])
        grid = torch.zeros(0, 2, dtype=torch.int64)
        counts = torch.zeros(0, dtype=torch.int64)
        pixels = torch.zeros(0, 3 * 16 * 16)
        if n_images:
            gh, gw = 4, 6
            n_img = gh * gw // 4
            prompt[2], prompt[3:3 + n_img], prompt[3 + n_img] = IMG_START, IMAGE, IMG_END
            grid, counts = torch.tensor([[gh, gw]]), torch.tensor([n_img])
            pixels = torch.randn(gh * gw, 3 * 16 * 16, generator=g)
        chosen = torch.randint(32, 1000, (n_c,), generator=g)
        rejected = torch.randint(32, 1000, (n_r,), generator=g)
        rejected[0] = chosen[0] + 1
        rows = [torch.cat([prompt, r]) for r in (chosen, rejected)]
        masks = [torch.cat([torch.zeros(n_prompt, dtype=torch.bool), torch.ones(r.numel(), dtype=torch.bool)])
                 for r in (chosen, rejected)]
        out.append(pack.PreferencePair(pair_id=i, chosen_ids=rows[0], rejected_ids=rows[1],
                                       chosen_loss_mask=masks[0], rejected_loss_mask=masks[1], pixel_values=pixels,
                                       image_grid_hw=grid, image_token_counts=counts))
    return out


def mpo_step(model, ctx, bins, shared: bool, divisible_by: int = 8, reward_shift: float = 0.1) -> dict:
    """Pack `bins` (lists of pairs) in one format (pack.pack or pack.pack_shared_prompt), then what train.train_step
    does before its gradient reduction: count_global_pairs, reference_logprobs.sums (the same model, no grad), the
    policy's forward_logprobs + MPO loss + backward (policy_forward_backward). Returns logprobs (the policy's
    per-response sums, bins concatenated, [2 * pairs] float64), num_response_tokens, metrics (combined), grads
    ({name: float64 grad}) and tokens (packed real tokens, cu_seqlens[-1] summed)."""
    import mpo_loss
    import pack
    import reference_logprobs
    import train

    fn = pack.pack_shared_prompt if shared else pack.pack
    batches = [fn(b, divisible_by, IMAGE) for b in bins]
    for b in batches:
        assert b.shared_prompt == shared
    model.zero_grad(set_to_none=True)
    n_pairs = mpo_loss.count_global_pairs(batches, ctx)
    ref = reference_logprobs.sums(model, batches, ctx)
    logprobs, counts = [], []
    with torch.no_grad():
        for b in batches:
            lp, n = mpo_loss.forward_logprobs(model, b, ctx)
            logprobs.append(lp.double())
            counts.append(n)
    metrics, _, _ = train.policy_forward_backward(batches, ref, model, ctx, reward_shift, n_pairs, backward=True)
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(logprobs=torch.cat(logprobs), num_response_tokens=torch.cat(counts), metrics=metrics, grads=grads,
                num_global_pairs=n_pairs, tokens=sum(int(b.cu_seqlens[-1]) for b in batches))


def max_differences(a: dict, b: dict) -> dict:
    """Max-abs differences of two mpo_step results: logprobs, every metric (by name), the largest over all gradients
    (and the parameter it is on), and the grads' names in either but not both."""
    grad = max(((a["grads"][n] - b["grads"][n]).abs().max().item(), n) for n in a["grads"] if n in b["grads"])
    return dict(
        logprobs=(a["logprobs"] - b["logprobs"]).abs().max().item(),
        num_response_tokens_equal=bool(torch.equal(a["num_response_tokens"], b["num_response_tokens"])),
        metrics={k: abs(a["metrics"][k] - b["metrics"][k]) for k in a["metrics"]},
        grad=grad[0], grad_param=grad[1], n_grads=len(a["grads"]),
        grad_names_differ=sorted(set(a["grads"]) ^ set(b["grads"])),
        grad_scale=max(g.abs().max().item() for g in a["grads"].values()),
        loss=a["metrics"]["loss"],
    )

"""The conventional MPO step, the baseline of train_step.py and gpu_step.py: padded pairs, log_softmax, torch Adam."""

from __future__ import annotations

import torch


def _conventional_mpo_loss(pol: torch.Tensor, ref: torch.Tensor, n_tok: torch.Tensor, m) -> torch.Tensor:
    """MPO of one pair written out (arXiv 2411.10442, δ = 0 at step 1): pol/ref [2] log-prob sums, n_tok [2] counts."""
    import torch.nn.functional as F

    ratio = pol - ref
    avg = ratio / n_tok
    lp = avg if m.preference_average_log_probs else ratio
    lq = avg if m.quality_average_log_probs else ratio
    beta, delta = m.reference_policy_kl_penalty, m.reward_shift
    pref = -F.logsigmoid(beta * (lp[0] - lp[1]))
    bco = -F.logsigmoid(beta * lq[0] - delta) - F.logsigmoid(-(beta * lq[1] - delta))
    sft = -(pol[0] / n_tok[0] if m.sft_average_log_probs else pol[0])
    return m.preference_loss_weight * pref + m.bco_loss_weight * bco + m.sft_loss_weight * sft


def _row_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive per-sequence response log-prob sums from [B, L, V] logits: log_softmax + gather, the usual way."""
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:]
    return torch.where(m, lp, torch.zeros((), dtype=lp.dtype)).sum(1), m.sum(1)


def _padded_pair(p, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pair's sequences right-padded to [2, L]: (input_ids int64, attention_mask int64, response mask bool)."""
    seqs, masks = (p.chosen_ids, p.rejected_ids), (p.chosen_loss_mask, p.rejected_loss_mask)
    L = max(r.numel() for r in seqs)
    input_ids = torch.full((2, L), pad_id, dtype=torch.int64)
    attn = torch.zeros(2, L, dtype=torch.int64)
    resp = torch.zeros(2, L, dtype=torch.bool)
    for j, (r, m) in enumerate(zip(seqs, masks, strict=True)):
        input_ids[j, :r.numel()], attn[j, :r.numel()], resp[j, :r.numel()] = r, 1, m
    return input_ids.to(device), attn.to(device), resp.to(device)


def _torch_adam(params, o) -> torch.optim.Adam:
    """The baselines' optimizer: torch Adam with `o` (config.OptimizerConfig)'s lr, betas, eps and weight decay."""
    return torch.optim.Adam(params, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay)

"""The local (non-Transformer-Engine) spec: the modules and layer specs used on CPU and on GPUs without Transformer
Engine (cpu_compat.select_kernels decides; omni_model.build_model picks the spec).

megatron-core's own non-TE modules (ColumnParallelLinear, RowParallelLinear, SelfAttention, MLP, the MoE layer,
MambaMixer) plus the project modules that stand in for Transformer Engine ones:
- `LocalNorm`: RMSNorm / LayerNorm in fp32 (as transformers' NemotronH RMSNorm), usable under sequence parallelism.
- `LocalNormColumnParallelLinear`: the non-TE twin of `TELayerNormColumnParallelLinear`, with the same parameter
  names, so a checkpoint is the same whichever spec built the model.
- `ThdDotProductAttention`: THD `cu_seqlens` attention within each sequence (causal or not) through torch's SDPA per
  sequence, or on CUDA in bf16/fp16 through ONE call of torch's varlen FlashAttention (`varlen_attention`); context
  parallelism by all-gathering K/V; the shared-prompt layout (`shared_prompt_attention`, when
  cpu_compat.SHARED_PROMPT_SEGMENTS is set by the model's forward).
- `GroupedExperts`: megatron-core's SequentialMLP (same parameters and checkpoint keys) computed with one torch grouped
  GEMM per projection instead of a loop over the experts.
The specs take what differs per model as arguments (the Mamba mixer class and its parameters, the expert count), so
this module imports only megatron-core, torch, pack and cpu_compat (the per-forward layout state).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mappings
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)
from torch import nn

import cpu_compat
from pack import cp_partition_index
from shared_prompt import spans as shared_prompt_spans

# ======================================================================================================================
# Modules with Transformer Engine's parameter names


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, kind: str) -> torch.Tensor:
    """RMSNorm / LayerNorm over the last dim, computed in fp32 and cast back (as transformers' NemotronH RMSNorm)."""
    shape = (x.shape[-1],)
    xf = x.float()
    if kind == "RMSNorm":
        y = F.rms_norm(xf, shape, weight.float(), eps)
    else:
        y = F.layer_norm(xf, shape, weight.float(), None if bias is None else bias.float(), eps)
    return y.to(x.dtype)


class LocalNorm(nn.Module):
    """Non-TE norm (RMSNorm or LayerNorm after `config.normalization`), usable under sequence parallelism: its
    parameters are tagged `sequence_parallel` so megatron all-reduces their gradients over TP.

    SHIM(megatron-core 0.19.2): megatron/core/transformer/torch_norm.py:50 (megatron's non-TE norm refuses sequence
    parallelism; this one computes in fp32 and casts back, as the TE norm and transformers' NemotronH RMSNorm do)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.kind, self.eps = config.normalization, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype)) if self.kind == "LayerNorm" \
            else None
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, self.weight, self.bias, self.eps, self.kind)


_COLUMN_PARALLEL_ARGS = frozenset(inspect.signature(ColumnParallelLinear.__init__).parameters)


class LocalNormColumnParallelLinear(ColumnParallelLinear):
    """Pre-norm + ColumnParallelLinear: the non-TE equivalent of TELayerNormColumnParallelLinear, with the same
    parameter names (`layer_norm_weight`, `layer_norm_bias` for LayerNorm, `weight`, `bias`). The norm runs on the
    local sequence shard before the linear's sequence-parallel all-gather (it is per token). Keyword arguments that
    ColumnParallelLinear does not take (TE-only ones a spec may pass) are dropped.

    SHIM(megatron-core 0.19.2): megatron/core/extensions/transformer_engine.py:1122 (the fused norm + linear exists
    only as a Transformer Engine module; megatron-core has no non-TE one).
    """

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config,
                         **{k: v for k, v in kwargs.items() if k in _COLUMN_PARALLEL_ARGS})
        self.norm_kind, self.norm_eps = config.normalization, config.layernorm_epsilon
        self.layer_norm_weight = nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        norm_params = [self.layer_norm_weight]
        if self.norm_kind == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            norm_params.append(self.layer_norm_bias)
        else:
            self.layer_norm_bias = None
        for p in norm_params:
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        """input_ [s, b, input_size] (this rank's sequence shard under SP) -> (output, bias) as ColumnParallelLinear."""
        x = _norm(input_, self.layer_norm_weight, self.layer_norm_bias, self.norm_eps, self.norm_kind)
        return super().forward(x, weight=weight, runtime_gather_output=runtime_gather_output)


# ======================================================================================================================
# Routed experts: one grouped GEMM per projection


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM, a [T, K] row-major x b [E, K, N] -> [T, N]: rows offs[e-1]:offs[e] of `a` times b[e]
    (offs: int32 [E], cumulative, offs[-1] = T; empty groups allowed). `torch.nn.functional.grouped_mm` (torch >=
    2.10), else `torch._grouped_mm`. The output's gradient is made contiguous (a tensor hook, a no-op when it already
    is): torch's CUTLASS kernel (aten/src/ATen/native/cuda/GroupMMCommon.cuh, prepare_grouped_gemm_data) needs group
    sizes that are multiples of 16 bytes and non-zero only when the weight-gradient GEMM gets a column-major output
    gradient; with a row-major `a`, a column-major `b` and a contiguous gradient every group size runs, zero included
    (so groups are not padded; checked on an H200 with torch 2.11)."""
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    out = fn(a, b, offs=offs)
    if out.requires_grad:
        out.register_hook(torch.Tensor.contiguous)
    return out


class GroupedExperts(SequentialMLP):
    """megatron-core's SequentialMLP computed with one grouped GEMM per projection (`grouped_mm`) instead of a Python
    loop over the experts: the local spec's routed experts on CUDA (cpu_compat.Kernels.experts = "grouped").

    The parameters, their names (`local_experts.N.linear_fc1.weight`, `...linear_fc2.weight`), `state_dict`,
    `sharded_state_dict` (per-expert keys) and hf_weights' key map are SequentialMLP's: a checkpoint saved with either
    module loads into the other. The forward is SequentialMLP's arithmetic per token (MLP.forward's unfused path:
    fc1, the activation - gated or not -, the routing probabilities `permuted_probs` multiplied in and cast back to the
    activation's dtype, fc2), so on the CPU (torch's grouped GEMM there is a loop of matmuls) it equals SequentialMLP
    bit for bit, forward and backward (tests/test_experts.py).

    Cost: each forward stacks the per-expert weights into [E, out, in] (torch.stack: a copy of the layer's expert
    weights, 2·E·hidden·moe_ffn elements; for Nemotron-3-Nano ≈ 1.3e9 per layer, ~2.6 GB in bf16) and the backward
    splits the stacked gradient back per expert; bench.py --gpu --profile measures it.

    Supported: expert tensor parallelism 1 (build_model's requirement), no linear biases, no FP8/FP4, megatron's
    unfused activation (no `bias_activation_fusion`, no TE activation), no MoE latent projection. Other settings raise
    ValueError at construction (SequentialMLP supports them).
    """

    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None, name: str | None = None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        c = self.config
        unsupported = {"expert tensor parallel size > 1": self.tp_group.size() > 1,
                       "add_bias_linear": c.add_bias_linear, "fp8 / fp4": bool(c.fp8 or c.fp4),
                       "bias_activation_fusion": c.bias_activation_fusion,
                       "use_te_activation_func": c.use_te_activation_func,
                       "moe_latent_size": c.moe_latent_size is not None}
        if any(unsupported.values()):
            raise ValueError(f"GroupedExperts does not support {[k for k, v in unsupported.items() if v]}; "
                             "use SequentialMLP (cpu_compat.Kernels.experts = 'sequential')")

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """fc1's output h [T, ffn (x2 gated)] through the activation, times probs [T], in h's dtype: the unfused path
        of megatron/core/transformer/mlp.py MLP.forward (megatron-core 0.19.2)."""
        c = self.config
        if c.gated_linear_unit:
            x_glu, x_linear = torch.chunk(h, 2, dim=-1)
            if (val := c.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            a = c.activation_func(x_glu) * (x_linear + c.glu_linear_offset)
        else:
            a = c.activation_func(h)
        return (a * probs.unsqueeze(-1)).to(a.dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """permuted_local_hidden_states [T, hidden], the tokens sorted by local expert; tokens_per_expert int [E] (any
        device); permuted_probs [T]. Returns (output [T, hidden] in the input's dtype, None), as SequentialMLP."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP.forward
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        offs = tokens_per_expert.to(device=x.device).cumsum(0).to(torch.int32)
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, ffn, hidden] (x2 ffn gated)
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, hidden, ffn]
        h = grouped_mm(x.contiguous(), w1.transpose(1, 2), offs)
        h = self._activation(h, probs)
        return grouped_mm(h.contiguous(), w2.transpose(1, 2), offs), None


# ======================================================================================================================
# Core attention


def _query_runs(cu: list[int], total: int, cp: int, cp_rank: int) -> list[tuple[int, int, int, int, int]]:
    """Contiguous runs of this rank's queries, each within one sequence of the packed row.

    cu: cumulative (padded) sequence lengths as ints; total: packed length (all CP ranks); positions past cu[-1]
    form one more sequence (trailing padding, CP = 1 only). Without CP a run is a whole sequence; under CP a
    sequence of padded length L gives two runs of L/(2·CP) queries, chunks cp_rank and 2·CP−1−cp_rank (the layout of
    pack.cp_partition_index, so local query order matches it). Returns (local query start, query count, sequence
    start, sequence end, query offset within the sequence) per run, in local order.
    Raises ValueError when CP > 1 and the row extends past cu[-1].
    """
    bounds = list(zip(cu[:-1], cu[1:], strict=True))
    if total > cu[-1]:
        if cp > 1:
            raise ValueError(f"under CP the packed length {total} must equal cu_seqlens_padded[-1] = {cu[-1]}")
        bounds.append((cu[-1], total))
    runs, local = [], 0
    for start, end in bounds:
        length = end - start
        if length <= 0:
            continue
        chunk = length // (2 * cp) if cp > 1 else length
        for j in ((cp_rank, 2 * cp - 1 - cp_rank) if cp > 1 else (0,)):
            runs.append((local, chunk, start, end, j * chunk))
            local += chunk
    return runs


def bottom_right_causal_mask(n_q: int, n_kv: int, device) -> torch.Tensor:
    """bool [n_q, n_kv], True where query j may attend key i: i <= n_kv - n_q + j, the causal mask aligned bottom-right
    (TE's "causal_bottom_right"; the last query sees every key). For n_q == n_kv it is the plain causal mask."""
    return torch.arange(n_kv, device=device)[None, :] <= torch.arange(n_q, device=device)[:, None] + (n_kv - n_q)


def shared_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            segment_cu_seqlens_padded: torch.Tensor, scale: float | None = None,
                            dropout_p: float = 0.0) -> torch.Tensor:
    """Causal self-attention of a shared-prompt THD row (shared_prompt.pack; ThdDotProductAttention's path when
    cpu_compat.SHARED_PROMPT_SEGMENTS is set): prompt and chosen tokens attend causally within [prompt | chosen];
    rejected tokens attend to the whole prompt and causally to earlier rejected tokens, never to the chosen segment.

    Two torch SDPA calls per pair, no [T, T] mask: [prompt | chosen] with is_causal, and the rejected queries against
    the keys [prompt | rejected] with a bottom-right causal mask [r, k + r] (query j sees keys 0 .. k + j). Tokens
    after the last pair (bin padding) attend causally among themselves. The Transformer Engine path is ONE
    variable-length call of the same masks (`shared_prompt_varlen_layout`, `shared_prompt_varlen_attention`: keys and
    values gathered into [prompt | chosen], [prompt | rejected] per pair, mask type padding_causal_bottom_right).

    Args:
        query: [T, heads, d]; key, value: [T, groups, d] (megatron's THD core-attention inputs; GQA: heads is a
            multiple of groups, group j serves heads j*heads/groups ...).
        segment_cu_seqlens_padded: int [3P+1] (`pack.PackedBatch.segment_cu_seqlens_padded`).
        scale: softmax scale (default 1/sqrt(d)); dropout_p: attention dropout.
    Returns:
        [T, heads * d] in query's dtype (megatron's core-attention output layout).
    Raises:
        ValueError: bad offsets (`shared_prompt.spans`) or heads not a multiple of groups.
    """
    T, h, d = query.shape
    if key.shape[0] != T or key.shape != value.shape or h % key.shape[1]:
        raise ValueError(f"query [T, heads, d] {tuple(query.shape)} and key/value [T, groups, d] "
                         f"{tuple(key.shape)}/{tuple(value.shape)} do not match")
    spans = shared_prompt_spans(segment_cu_seqlens_padded, T)
    rep = h // key.shape[1]
    q = query.permute(1, 0, 2)  # [h, T, d]
    k = key.permute(1, 0, 2).repeat_interleave(rep, dim=0)
    v = value.permute(1, 0, 2).repeat_interleave(rep, dim=0)
    # Views by torch.split, not slices: the backward of a split is one concatenation, where every slice's backward
    # writes a zero-filled full-row gradient (O(pairs · T) per layer, the largest overhead in the shared-prompt
    # layout's CPU profile).
    # Query runs: per pair [prompt | chosen], [rejected]; then the tail. Keys: the segments prompt, chosen, rejected.
    end = spans[-1][3] if spans else 0
    runs = [n for a, c0, r0, e in spans for n in (r0 - a, e - r0)] + [T - end]
    segs = [n for a, c0, r0, e in spans for n in (c0 - a, r0 - c0, e - r0)] + [T - end]
    q_runs = q.split(runs, dim=1)
    k_runs, v_runs = k.split(runs, dim=1), v.split(runs, dim=1)
    k_segs, v_segs = k.split(segs, dim=1), v.split(segs, dim=1)
    outs = []

    def sdpa(qs, ks, vs, mask=None):  # as [1, h, n, d]: torch's fused kernels (flash, memory-efficient) take 4-D only
        return torch.nn.functional.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask,
                                                                dropout_p=dropout_p, is_causal=mask is None,
                                                                scale=scale)[0]

    for i, (a, c0, r0, e) in enumerate(spans):
        if r0 > a:
            outs.append(sdpa(q_runs[2 * i], k_runs[2 * i], v_runs[2 * i]))
        if e > r0:
            n_p, n_r = c0 - a, e - r0
            keys = torch.cat([k_segs[3 * i], k_segs[3 * i + 2]], dim=1)
            vals = torch.cat([v_segs[3 * i], v_segs[3 * i + 2]], dim=1)
            mask = bottom_right_causal_mask(n_r, n_p + n_r, q.device)
            outs.append(sdpa(q_runs[2 * i + 1], keys, vals, mask))
    if end < T:
        outs.append(sdpa(q_runs[-1], k_runs[-1], v_runs[-1]))
    out = torch.cat(outs, dim=1) if outs else q.new_zeros(h, 0, d)
    return out.permute(1, 0, 2).reshape(T, h * d)


def shared_prompt_varlen_layout(segment_cu_seqlens_padded: torch.Tensor, total_tokens: int) -> dict:
    """The shared-prompt THD row as ONE variable-length attention call (the Transformer Engine path of
    `shared_prompt_attention`): query sequences per pair [prompt | chosen] then [rejected], then the bin's trailing
    padding as a sequence of its own; key/value sequences [prompt | chosen], [prompt | rejected] (the prompt's keys and
    values gathered twice), then the padding. Every sequence takes a causal mask aligned bottom-right (TE's
    attn_mask_type "padding_causal_bottom_right"): query j of a sequence with n_q queries and n_kv keys sees keys
    0 .. n_kv - n_q + j, which is plain causal where n_q == n_kv ([prompt | chosen], padding) and "all of the prompt,
    then causal" for the rejected queries. Empty query sequences (an empty response) are left out.

    The query sequences are the row in its own order, so the call's output is already in row order (no scatter).

    Args:
        segment_cu_seqlens_padded: int [3P+1] (`pack.PackedBatch.segment_cu_seqlens_padded`).
        total_tokens: T, the row length (tokens after the last pair form the padding sequence).
    Returns:
        dict with kv_index (int64 [T_kv], the row position of every key/value token, on the offsets' device),
        cu_seqlens_q / cu_seqlens_kv (int32 [S+1], same device), max_seqlen_q / max_seqlen_kv (int).
    Raises:
        ValueError: bad offsets (`shared_prompt.spans`).
    """
    spans = shared_prompt_spans(segment_cu_seqlens_padded, total_tokens)
    q_lens, kv_parts = [], []  # kv_parts: per sequence, the row ranges of its keys
    for a, c0, r0, e in spans:
        if r0 > a:
            q_lens.append(r0 - a)
            kv_parts.append([(a, r0)])
        if e > r0:
            q_lens.append(e - r0)
            kv_parts.append([(a, c0), (r0, e)])
    end = spans[-1][3] if spans else 0
    if end < total_tokens:
        q_lens.append(total_tokens - end)
        kv_parts.append([(end, total_tokens)])
    kv_lens = [sum(hi - lo for lo, hi in parts) for parts in kv_parts]
    device = segment_cu_seqlens_padded.device
    ranges = [torch.arange(lo, hi, device=device) for parts in kv_parts for lo, hi in parts]
    cu = [torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32) for lens in (q_lens, kv_lens)]
    return {"kv_index": torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.int64, device=device),
            "cu_seqlens_q": cu[0], "cu_seqlens_kv": cu[1],
            "max_seqlen_q": max(q_lens, default=0), "max_seqlen_kv": max(kv_lens, default=0)}


def varlen_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, scale: float | None = None,
                dropout_p: float = 0.0) -> torch.Tensor:
    """Reference variable-length attention with bottom-right-aligned causal masks (TE's qkv_format "thd" with
    attn_mask_type "padding_causal_bottom_right"): torch SDPA once per sequence, query j of a sequence of n_q queries
    and n_kv keys sees keys 0 .. n_kv - n_q + j. The CPU backend of `shared_prompt_varlen_attention`.

    Args:
        query: [T_q, heads, d]; key, value: [T_kv, groups, d] (heads a multiple of groups).
        cu_seqlens_q, cu_seqlens_kv: int [S+1] cumulative lengths (equal counts S, n_q <= n_kv per sequence, the last
            entries equal T_q and T_kv); max_seqlen_q / max_seqlen_kv: unused (TE's signature).
        scale: softmax scale (default 1/sqrt(d)); dropout_p: attention dropout.
    Returns:
        [T_q, heads * d] in query's dtype.
    Raises:
        ValueError: offsets that do not cover the tensors, or a sequence with more queries than keys.
    """
    cq, ckv = [int(v) for v in cu_seqlens_q.tolist()], [int(v) for v in cu_seqlens_kv.tolist()]
    lq = [b - a for a, b in zip(cq[:-1], cq[1:], strict=True)]
    lkv = [b - a for a, b in zip(ckv[:-1], ckv[1:], strict=True)]
    if len(lq) != len(lkv) or cq[-1] != query.shape[0] or ckv[-1] != key.shape[0] or \
            any(n < m for m, n in zip(lq, lkv, strict=True)):
        raise ValueError(f"cu_seqlens_q {cq} / cu_seqlens_kv {ckv} do not describe query [{query.shape[0]}] and "
                         f"key [{key.shape[0]}] sequences with n_q <= n_kv")
    h, d = query.shape[1], query.shape[2]
    rep = h // key.shape[1]
    q = query.permute(1, 0, 2)
    k = key.permute(1, 0, 2).repeat_interleave(rep, dim=0)
    v = value.permute(1, 0, 2).repeat_interleave(rep, dim=0)
    outs = []
    for qs, ks, vs in zip(q.split(lq, dim=1), k.split(lkv, dim=1), v.split(lkv, dim=1), strict=True):
        n_q, n_kv = qs.shape[1], ks.shape[1]
        if n_q == 0:
            continue
        mask = None
        if n_kv != n_q:
            mask = bottom_right_causal_mask(n_q, n_kv, q.device)
        outs.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, dropout_p=dropout_p,
                                                   is_causal=mask is None, scale=scale)[0])  # 4-D: fused kernels
    out = torch.cat(outs, dim=1) if outs else q.new_zeros(h, 0, d)
    return out.permute(1, 0, 2).reshape(query.shape[0], h * d)


# Devices whose THD attention ThdDotProductAttention(attention="varlen") sends to `varlen_attention` (torch's
# FlashAttention: CUDA). The CPU tests add "cpu" with a stand-in varlen_attn.
VARLEN_DEVICE_TYPES = frozenset({"cuda"})


@functools.lru_cache(maxsize=8)
def _parameter_names(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, causal: bool = True,
                     scale: float | None = None) -> torch.Tensor:
    """Attention of packed variable-length sequences in ONE call of torch's `torch.nn.attention.varlen.varlen_attn`
    (FlashAttention-2: CUDA sm80+, bf16/fp16; cpu_compat.have_varlen_attn): the same masks as `varlen_sdpa`, causal
    aligned bottom-right (query j of a sequence of n_q queries and n_kv keys sees keys 0 .. n_kv - n_q + j:
    FlashAttention's convention, plain causal where n_q == n_kv) or none.

    The arguments follow the installed signature: causal as window_size=(-1, 0) where it has `window_size` (torch >=
    2.11), else is_causal=True; GQA by enable_gqa=True where it has `enable_gqa` (torch >= 2.12), else the K/V heads
    repeated (torch 2.11's call refuses fewer K/V heads than query heads).

    Args:
        query: [T_q, heads, d]; key, value: [T_kv, groups, d] (heads a multiple of groups).
        cu_seqlens_q, cu_seqlens_kv: int32 [S+1] cumulative lengths on the tensors' device; max_seqlen_q,
            max_seqlen_kv: the longest sequence (int). scale: softmax scale (default 1/sqrt(d)).
    Returns:
        [T_q, heads * d] in query's dtype (also the `attention_fn` of `shared_prompt_varlen_attention`).
    """
    from torch.nn.attention.varlen import varlen_attn

    names = _parameter_names(varlen_attn)
    kw = {"scale": scale}
    if causal:
        kw.update({"window_size": (-1, 0)} if "window_size" in names else {"is_causal": True})
    h, g = query.shape[1], key.shape[1]
    if h != g and "enable_gqa" in names:
        kw["enable_gqa"] = True
    elif h != g:
        key, value = key.repeat_interleave(h // g, dim=1), value.repeat_interleave(h // g, dim=1)
    out = varlen_attn(query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, **kw)
    return out.reshape(query.shape[0], h * query.shape[2])


def shared_prompt_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                   segment_cu_seqlens_padded: torch.Tensor, attention_fn=None) -> torch.Tensor:
    """`shared_prompt_attention` as one variable-length attention call (`shared_prompt_varlen_layout`): the keys and
    values are gathered into [prompt | chosen], [prompt | rejected] per pair (+ the padding), the queries stay in row
    order, and `attention_fn` runs every sequence with a bottom-right-aligned causal mask.

    The backend is the argument: on a GPU with Transformer Engine, omni_model's TE attention module passes a call of
    transformer_engine.pytorch.DotProductAttention.forward (qkv_format "thd", attn_mask_type
    "padding_causal_bottom_right"); the local spec's varlen backend passes `varlen_attention` (torch's varlen
    FlashAttention); the default is `varlen_sdpa` (torch, any device), against which the tests check the layout.
    tests/test_gpu.py checks both GPU backends against `shared_prompt_attention`.

    Args:
        query: [T, heads, d]; key, value: [T, groups, d] (megatron's THD core-attention inputs).
        segment_cu_seqlens_padded: int [3P+1] (`pack.PackedBatch.segment_cu_seqlens_padded`).
        attention_fn: callable (query [T, heads, d], key [T_kv, groups, d], value, cu_seqlens_q, cu_seqlens_kv,
            max_seqlen_q, max_seqlen_kv) -> [T, heads * d]; default `varlen_sdpa` (scale 1/sqrt(d), no dropout).
    Returns:
        [T, heads * d] in row order, as `shared_prompt_attention` (equal up to rounding).
    Raises:
        ValueError: bad offsets, or query / key / value shapes that do not match.
    """
    T, h, _ = query.shape
    if key.shape[0] != T or key.shape != value.shape or h % key.shape[1]:
        raise ValueError(f"query [T, heads, d] {tuple(query.shape)} and key/value [T, groups, d] "
                         f"{tuple(key.shape)}/{tuple(value.shape)} do not match")
    lay = shared_prompt_varlen_layout(segment_cu_seqlens_padded.to(query.device), T)
    fn = attention_fn or varlen_sdpa
    return fn(query, key.index_select(0, lay["kv_index"]), value.index_select(0, lay["kv_index"]),
              lay["cu_seqlens_q"], lay["cu_seqlens_kv"], lay["max_seqlen_q"], lay["max_seqlen_kv"])


class ThdDotProductAttention(nn.Module):
    """Core attention (softmax(QK^T * scale) V) for the local spec that honours THD packing and context parallelism.

    Inputs as megatron's SelfAttention hands them to core attention: BSHD-style `[s, b, heads, d]`, or with THD
    `packed_seq_params` `[t, heads, d]`. Keys attend only within their own sequence (segments from
    `cu_seqlens_q_padded`, else `cu_seqlens_q`), and only to earlier-or-equal positions when the mask type is causal.
    Under CP (`config.context_parallel_size > 1`) each rank holds the load-balanced slice of every sequence; K and V
    are all-gathered over the CP group (gradient: reduce-scatter) and the causal mask uses the global positions.
    GQA: K/V groups are repeated to the query heads.

    Shared-prompt layout (cpu_compat.SHARED_PROMPT_SEGMENTS set, THD): `shared_prompt_attention` over the segments
    (rejected tokens see the prompt, never the chosen response).

    attention="varlen" (cpu_compat.Kernels.attention, on CUDA): a THD call in bf16/fp16 without context parallelism
    or dropout runs every sequence of the row in ONE `varlen_attention` call (torch's varlen FlashAttention; the
    shared-prompt layout through `shared_prompt_varlen_attention`, keys gathered per sequence); anything else (fp32,
    CP, dropout, BSHD) stays on the SDPA path below, the reference (tests/test_gpu.py compares the two on CUDA).

    Cost: torch's scaled_dot_product_attention once per contiguous run of queries within one sequence (a whole
    sequence without CP, two chunks per sequence under CP), so work and memory grow with Σ L_i², never with the
    square of the packed row. A run that starts at offset o > 0 of its sequence (CP) sees keys [0, o + len) under a
    bottom-right-aligned causal mask of [len, o + len]. The TE spec is the production path.

    SHIM(megatron-core 0.19.2): megatron/core/transformer/dot_product_attention.py:153 (megatron's non-TE
    DotProductAttention asserts "Packed sequence is not supported by DotProductAttention").
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, attention: str = "sdpa", **unused):
        super().__init__()
        assert attention in ("sdpa", "varlen"), attention
        self.attention = attention
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.config = config
        self.causal = attn_mask_type == AttnMaskType.causal
        self.cp_group = getattr(pg_collection, "cp", None)
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _varlen(self, query: torch.Tensor, thd: bool) -> bool:
        """True when this call runs `varlen_attention`: the varlen backend, THD, a non-empty bf16/fp16 CUDA query, no
        context parallelism, no attention dropout in training (FlashAttention-2's domain; the rest stays SDPA)."""
        return (self.attention == "varlen" and thd and query.device.type in VARLEN_DEVICE_TYPES and query.shape[0] > 0
                and query.dtype in (torch.bfloat16, torch.float16) and self.config.context_parallel_size == 1
                and not (self.training and self.dropout > 0))

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [s, b, heads, d] (or [t, heads, d] with THD packed_seq_params), key/value with query groups.

        attention_mask: megatron's bool [b, 1, s, s_total], True where attention is not allowed (non-THD only).
        Returns [s, b, heads·d] (or [t, heads·d]) in the input dtype.
        Raises ValueError for an attention_bias, or under CP for a row longer than cu_seqlens_padded[-1].
        """
        if attention_bias is not None:
            raise ValueError("ThdDotProductAttention does not take an attention_bias")
        causal = self.causal if attn_mask_type is None else attn_mask_type == AttnMaskType.causal
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        segments = cpu_compat.SHARED_PROMPT_SEGMENTS.get()
        varlen = self._varlen(query, thd)
        if segments is not None and thd:  # shared-prompt row (CP is refused at start: pack.validate_packing_config)
            if not causal or self.config.context_parallel_size > 1:
                raise ValueError("the shared-prompt layout needs causal attention without context parallelism")
            if varlen:
                return shared_prompt_varlen_attention(query, key, value, segments,
                                                      attention_fn=partial(varlen_attention, scale=self.scale))
            return shared_prompt_attention(query, key, value, segments, scale=self.scale,
                                           dropout_p=self.dropout if self.training else 0.0)
        if varlen:  # one call over the row's sequences (those of _query_runs without CP: whole, in row order)
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            host = getattr(packed_seq_params, "cu_seqlens_padded_host", None)  # pack.thd_packed_seq_params' copy
            lens = [b - a for a, b in itertools.pairwise(host)] if host is not None else []
            if lens and host[-1] == query.shape[0] and min(lens) > 0:
                # the padded offsets tile the row without empty sequences: they are the call's offsets as they are
                return varlen_attention(query, key, value, cu, cu, max(lens), max(lens), causal=causal,
                                        scale=self.scale)
            lens = [n for _, n, _, _, _ in _query_runs([int(c) for c in cu.tolist()], query.shape[0], 1, 0)]
            cu_lens = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=query.device)
            return varlen_attention(query, key, value, cu_lens, cu_lens, max(lens), max(lens), causal=causal,
                                    scale=self.scale)
        if thd:  # [t, h, d] -> [t, 1, h, d]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        s_local, b = query.shape[0], query.shape[1]
        # the ViT shares megatron's process groups but is replicated over CP (its config says CP = 1)
        cp = self.cp_group.size() if self.cp_group is not None and self.config.context_parallel_size > 1 else 1
        if cp > 1:
            key = mappings.gather_from_sequence_parallel_region(key.contiguous(), True, group=self.cp_group)
            value = mappings.gather_from_sequence_parallel_region(value.contiguous(), True, group=self.cp_group)
        s_total = key.shape[0]
        device = query.device
        if thd:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        else:
            cu = torch.tensor([0, s_total])
        host = getattr(packed_seq_params, "cu_seqlens_padded_host", None) if thd else None
        offsets = list(host) if host is not None and host[-1] == s_total else [int(c) for c in cu.tolist()]
        runs = _query_runs(offsets, s_total, cp, self.cp_group.rank() if cp > 1 else 0)
        if cp > 1:
            # the gathered K/V are rank-major slices: put them back in packed order
            cu = cu.to(device)
            order = torch.cat([cp_partition_index(cu, cp, r) for r in range(cp)]).to(device)
            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.numel(), device=device)
            key, value = key.index_select(0, inv), value.index_select(0, inv)
        q = query.permute(1, 2, 0, 3)  # [b, h, s, d]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if self.heads != k.shape[1]:
            rep = self.heads // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        dropout = self.dropout if self.training else 0.0
        outs = []
        # Without CP every run is a whole sequence and the runs tile the row: take them as torch.split views (one
        # concatenation in backward) rather than slices (a zero-filled full-row gradient per slice and tensor).
        parts = None
        if cp == 1 and sum(n for _, n, _, _, _ in runs) == s_total:
            lens = [n for _, n, _, _, _ in runs]
            parts = list(zip(q.split(lens, dim=2), k.split(lens, dim=2), v.split(lens, dim=2), strict=True))
        for i, (q0, n, start, end, off) in enumerate(runs):
            k_end = start + off + n if causal else end
            mask, is_causal = None, False
            if causal and off > 0:  # bottom-right aligned: query i (position off + i) sees keys 0 .. off + i
                mask = bottom_right_causal_mask(n, off + n, device)
            elif causal:
                is_causal = True
            if attention_mask is not None and not thd:
                # megatron masks are True where attention is *not* allowed, [b, 1, sq, sk]
                allowed = ~attention_mask[..., q0:q0 + n, start:k_end].to(torch.bool)
                if is_causal:
                    mask = torch.ones(n, k_end - start, dtype=torch.bool, device=device).tril()
                mask = allowed if mask is None else allowed & mask
                is_causal = False
            qs, ks, vs = parts[i] if parts is not None else \
                (q[:, :, q0:q0 + n], k[:, :, start:k_end], v[:, :, start:k_end])
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout,
                                                       is_causal=is_causal, scale=self.scale))
        out = torch.cat(outs, dim=2) if outs else q.new_zeros(b, self.heads, 0, self.head_dim)  # [b, h, s, d]
        out = out.permute(2, 0, 1, 3).reshape(s_local, b, self.heads * self.head_dim)
        return out.squeeze(1) if thd else out


# ======================================================================================================================
# Layer specs


def _core_attention_spec(attention: str):
    """ThdDotProductAttention with `attention` ("sdpa" or "varlen", cpu_compat.Kernels.attention).
    Raises ValueError for another name."""
    if attention not in ("sdpa", "varlen"):
        raise ValueError(f"attention {attention!r}: 'sdpa' or 'varlen'")
    return ThdDotProductAttention if attention == "sdpa" else \
        ModuleSpec(module=ThdDotProductAttention, params={"attention": attention})


def local_hybrid_stack_spec(mamba_mixer: type, mamba_params: dict, num_experts: int, experts: str = "sequential",
                            attention: str = "sdpa") -> ModuleSpec:
    """HybridStack spec of megatron-core's non-TE modules plus this module's norm-linear and THD attention.

    Args: mamba_mixer: the MambaMixer class of every `M` layer (omni_model.OmniMambaMixer); mamba_params: its keyword
        arguments (conv kernel, chunk size, dt settings); num_experts: routed experts of every `E` layer (>= 1);
        experts: "sequential" (megatron-core's SequentialMLP) or "grouped" (`GroupedExperts`); attention: "sdpa" or
        "varlen" (ThdDotProductAttention's backend) - cpu_compat.Kernels' fields.
    Raises ValueError for another experts or attention name.
    """
    norm_linear = LocalNormColumnParallelLinear
    moe = get_moe_module_spec(use_te=False, num_experts=num_experts,
                              moe_grouped_gemm=False)
    if experts not in ("sequential", "grouped"):
        raise ValueError(f"experts {experts!r}: 'sequential' or 'grouped'")
    if experts == "grouped":  # the same submodules (parameter names), the grouped forward
        seq = moe.keywords["submodules"].experts  # moe: partial(MoELayer, submodules=MoESubmodules(...))
        assert seq.func is SequentialMLP, seq
        moe.keywords["submodules"].experts = partial(GroupedExperts, *seq.args, **seq.keywords)
    core_attention = _core_attention_spec(attention)
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    mixer=ModuleSpec(
                        module=mamba_mixer,
                        params=mamba_params,
                        submodules=MambaMixerSubmodules(in_proj=norm_linear, out_proj=RowParallelLinear),
                    ),
                    mamba_bda=get_bias_dropout_add,
                ),
            ),
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    self_attention=ModuleSpec(
                        module=SelfAttention,
                        params={"attn_mask_type": AttnMaskType.causal},
                        submodules=SelfAttentionSubmodules(
                            linear_qkv=norm_linear, core_attention=core_attention, linear_proj=RowParallelLinear,
                        ),
                    ),
                    self_attn_bda=get_bias_dropout_add,
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    mlp=partial(MLP.as_mlp_submodule,
                                submodules=MLPSubmodules(linear_fc1=norm_linear, linear_fc2=RowParallelLinear)),
                    mlp_bda=get_bias_dropout_add,
                ),
            ),
            moe_layer=ModuleSpec(
                module=MoETransformerLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=LocalNorm, mlp=moe, mlp_bda=get_bias_dropout_add),
            ),
        ),
    )



def local_vit_layer_spec(attention: str = "sdpa") -> ModuleSpec:
    """Pre-LN ViT layer of non-TE modules (LayerNorm fused into qkv / fc1 like TE's ViT spec), non-causal THD
    attention (each image attends only to itself) with `attention` ("sdpa" or "varlen", cpu_compat.Kernels')."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=LocalNormColumnParallelLinear, core_attention=_core_attention_spec(attention),
                    linear_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=LocalNormColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


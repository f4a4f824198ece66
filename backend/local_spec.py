"""The local (non-Transformer-Engine) spec, used on the CPU and on GPUs without TE.

- `LocalNorm`, `LocalNormColumnParallelLinear`: fp32 norms, alone or before a column-parallel linear (TE's names).
- `GroupedExperts`: the routed experts as 3-D weights, one grouped GEMM per projection.
- `ThdDotProductAttention`: THD-packed core attention (SDPA per sequence or one varlen call), CP; a shared-prompt
  row goes to shared_prompt.attention.
- `local_hybrid_stack_spec`, `local_vit_layer_spec`: the specs built of these modules."""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)
from torch import nn

from backend import shared_prompt
from pack import cp_partition_index

# ======================================================================================================================
# Modules with Transformer Engine's parameter names


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, kind: str) -> torch.Tensor:
    """RMSNorm / LayerNorm over the last dim in fp32, cast back to x's dtype."""
    shape = (x.shape[-1],)
    xf = x.float()
    if kind == "RMSNorm":
        y = F.rms_norm(xf, shape, weight.float(), eps)
    else:
        y = F.layer_norm(xf, shape, weight.float(), None if bias is None else bias.float(), eps)
    return y.to(x.dtype)


class LocalNorm(nn.Module):
    """Non-TE norm in fp32 whose parameters are tagged `sequence_parallel` (megatron all-reduces their
    gradients over TP)."""
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/torch_norm.py:50 (refuses sequence parallelism)

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
    """Pre-norm + ColumnParallelLinear with TELayerNormColumnParallelLinear's parameter
    names (`layer_norm_weight`, `layer_norm_bias`, `weight`, `bias`); the norm runs before the SP all-gather."""
    # SHIM(megatron-core 0.19.2): megatron/core/extensions/transformer_engine.py:1122 (TE-only)

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config,
                         **{k: v for k, v in kwargs.items() if k in _COLUMN_PARALLEL_ARGS})
        self.norm_kind, self.norm_eps = config.normalization, config.layernorm_epsilon
        self.layer_norm_weight = nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_bias = nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype)) \
            if self.norm_kind == "LayerNorm" else None
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        """input_ [s, b, input_size] -> (output, bias), as ColumnParallelLinear."""
        x = _norm(input_, self.layer_norm_weight, self.layer_norm_bias, self.norm_eps, self.norm_kind)
        return super().forward(x, weight=weight, runtime_gather_output=runtime_gather_output)


# ======================================================================================================================
# Routed experts: one grouped GEMM per projection


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [T, K] x b [E, K, N] -> [T, N], rows offs[e-1]:offs[e] times b[e] (offs int32 [E], cumulative).
    The hook makes the output's gradient contiguous, so every group size runs, zero included (docs/DESIGN.md)."""
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm  # F.grouped_mm from torch 2.10
    out = fn(a, b, offs=offs)
    if out.requires_grad:
        out.register_hook(torch.Tensor.contiguous)
    return out


class GroupedExperts(MegatronModule):
    """The routed experts as two 3-D weights, one grouped GEMM per projection (`grouped_mm`).
    weight1 [E, ffn (x2 gated), hidden] and weight2 [E, hidden, ffn]: expert e's matrices are SequentialMLP's
    local_experts.e.linear_fc1/fc2.weight, under SequentialMLP's distributed-checkpoint keys (`sharded_state_dict`).
    Bit-equal to SequentialMLP on the CPU (tests/test_experts.py)."""

    def __init__(self, num_local_experts: int, config, submodules=None, *, pg_collection, name: str | None = None):
        """megatron-core's expert-module signature (MoELayer builds it); submodules and name are unused."""
        super().__init__(config=config)
        c = self.config
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        unsupported = {"expert tensor parallel size > 1": self.tp_group.size() > 1,
                       "add_bias_linear": c.add_bias_linear, "fp8 / fp4": bool(c.fp8 or c.fp4),
                       "bias_activation_fusion": c.bias_activation_fusion,
                       "use_te_activation_func": c.use_te_activation_func,
                       "moe_latent_size": c.moe_latent_size is not None}
        assert not any(unsupported.values()), [k for k, v in unsupported.items() if v]
        ffn, h = c.moe_ffn_hidden_size, c.hidden_size
        fc1_rows = 2 * ffn if c.gated_linear_unit else ffn
        device = None if c.use_cpu_initialization else torch.cuda.current_device()
        self.weight1 = nn.Parameter(torch.empty(num_local_experts, fc1_rows, h, dtype=c.params_dtype, device=device))
        self.weight2 = nn.Parameter(torch.empty(num_local_experts, h, ffn, dtype=c.params_dtype, device=device))
        # megatron's expert linears: reduced over expert DP when EP > 1 or ETP != TP; distinct on every TP rank
        expert_dp = c.expert_model_parallel_size > 1 or c.expert_tensor_parallel_size != c.tensor_model_parallel_size
        for w, dim in ((self.weight1, 1), (self.weight2, 2)):
            set_tensor_model_parallel_attributes(w, is_parallel=True, dim=dim, stride=1)
            w.allreduce = not expert_dp
        if c.perform_initialization:  # SequentialMLP's order and RNG: expert by expert, fc1 then fc2
            for e in range(num_local_experts):
                for w, init in ((self.weight1, c.init_method), (self.weight2, c.output_layer_init_method)):
                    if c.use_cpu_initialization:  # as _initialize_affine_weight_cpu: fp32 master, then cast
                        master = torch.empty(w.shape[1:], dtype=torch.float32)
                        init(master)
                        w.data[e].copy_(master)
                    else:
                        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                            init(w.data[e])

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """SequentialMLP's keys: `{prefix}experts.linear_fc{1,2}.weight`, global shape [E_global, rows, cols], this EP
        rank's experts at rows ep_rank·E of the expert axis; replicated over expert DP."""
        assert not (metadata or {}).get("singleton_local_shards"), "SequentialMLP's per-expert keys are not built"
        n = len(sharded_offsets)
        return {f"{prefix}{name}": ShardedTensor.from_rank_offsets(
            f"{prefix}experts.linear_fc{fc}.weight", w, *sharded_offsets,
            (n, self.ep_group.rank(), self.ep_group.size()), replica_id=(0, 0, self.dp_group.rank()),
            prepend_axis_num=n)
            for name, fc, w in (("weight1", 1, self.weight1), ("weight2", 2, self.weight2))}

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """h [T, ffn (x2 gated)] -> activation(h) · probs [T] in h's dtype (megatron's MLP.forward)."""
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
        """x [T, hidden] sorted by local expert, tokens_per_expert int [E], probs [T] ->
        (out [T, hidden], None)."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP.forward
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        # megatron's dispatcher hands the counts on the CPU (read at its sync point): copied without another wait
        offs = tokens_per_expert.to(device=x.device, non_blocking=True).cumsum(0).to(torch.int32)
        h = grouped_mm(x.contiguous(), self.weight1.transpose(1, 2), offs)
        h = self._activation(h, probs)
        return grouped_mm(h.contiguous(), self.weight2.transpose(1, 2), offs), None


# ======================================================================================================================
# Core attention


def _query_runs(cu: list[int], total: int, cp: int, cp_rank: int) -> list[tuple[int, int, int, int, int]]:
    """This rank's runs of queries within one sequence: (local start, count, sequence start, sequence end,
    offset in the sequence). Under CP a sequence gives chunks cp_rank and 2·CP−1−cp_rank (pack.cp_partition_index)."""
    bounds = list(zip(cu[:-1], cu[1:], strict=True))
    if total > cu[-1]:
        assert cp == 1, (total, cu[-1])
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


# Devices whose THD attention goes to `varlen_attention` (the CPU tests add "cpu" with a stand-in varlen_attn).
VARLEN_DEVICE_TYPES = frozenset({"cuda"})


@functools.lru_cache(maxsize=8)
def _parameter_names(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, causal: bool = True,
                     scale: float | None = None) -> torch.Tensor:
    """`varlen_sdpa` in one call of torch's varlen_attn (FlashAttention-2: CUDA, bf16/fp16). Causal
    is window_size=(-1, 0) from torch 2.11, GQA enable_gqa from torch 2.12 (else K/V heads repeated)."""

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


class ThdDotProductAttention(nn.Module):
    """Core attention over THD-packed sequences (megatron's non-TE one refuses packing).
    query [s, b, heads, d] or [t, heads, d] (THD); each key attends within its sequence, causally if the mask is. Under
    CP, K/V are all-gathered and the masks use global positions. attention="varlen": one `varlen_attention` call."""
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/dot_product_attention.py:153 (no THD)

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
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _varlen(self, query: torch.Tensor, thd: bool) -> bool:
        """True for the varlen backend: THD, bf16/fp16 CUDA, no CP, no training dropout."""
        return (self.attention == "varlen" and thd and query.device.type in VARLEN_DEVICE_TYPES and query.shape[0] > 0
                and query.dtype in (torch.bfloat16, torch.float16) and self.config.context_parallel_size == 1
                and not (self.training and self.dropout > 0))

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [s, b, heads, d] or [t, heads, d]; attention_mask True where not allowed
        (non-THD). Returns [s, b, heads·d] or [t, heads·d]."""
        assert attention_bias is None
        causal = self.causal if attn_mask_type is None else attn_mask_type == AttnMaskType.causal
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        row_spans = shared_prompt.ROW_SPANS.get()
        varlen = self._varlen(query, thd)
        if row_spans is not None and thd:  # a shared-prompt row (CP refused at start: preflight.check_packing)
            assert causal and self.config.context_parallel_size == 1
            if varlen:
                return shared_prompt.varlen_attention(query, key, value, row_spans,
                                                      partial(varlen_attention, scale=self.scale))
            return shared_prompt.attention(query, key, value, row_spans, scale=self.scale,
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
        # Without CP the runs tile the row: torch.split views (one concatenation in backward, not a row per slice)
        parts = None
        if cp == 1 and sum(n for _, n, _, _, _ in runs) == s_total:
            lens = [n for _, n, _, _, _ in runs]
            parts = list(zip(q.split(lens, dim=2), k.split(lens, dim=2), v.split(lens, dim=2), strict=True))
        for i, (q0, n, start, end, off) in enumerate(runs):
            k_end = start + off + n if causal else end
            mask, is_causal = None, False
            if causal and off > 0:  # bottom-right aligned: query i (position off + i) sees keys 0 .. off + i
                mask = shared_prompt.bottom_right_causal_mask(n, off + n, device)
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


def _self_attention(mask_type: AttnMaskType, attention: str) -> ModuleSpec:
    """Norm-fused qkv, ThdDotProductAttention with `attention` ("sdpa" or "varlen"), RowParallelLinear."""
    assert attention in ("sdpa", "varlen"), attention
    core = ThdDotProductAttention if attention == "sdpa" else \
        ModuleSpec(module=ThdDotProductAttention, params={"attention": attention})
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": mask_type}, submodules=SelfAttentionSubmodules(
        linear_qkv=LocalNormColumnParallelLinear, core_attention=core, linear_proj=RowParallelLinear))


def local_hybrid_stack_spec(mamba_mixer: type, mamba_params: dict, num_experts: int, experts: str = "grouped-loop",
                            attention: str = "sdpa") -> ModuleSpec:
    """HybridStack spec of megatron-core's non-TE modules and this module's. experts: "grouped" / "grouped-loop"
    (GroupedExperts) | "sequential" (SequentialMLP); attention: "sdpa" | "varlen" (kernel_selection.Kernels)."""
    norm_linear = LocalNormColumnParallelLinear
    moe = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
    assert experts in ("grouped", "grouped-loop", "sequential"), experts
    if experts != "sequential":  # SequentialMLP's submodules argument, unused by GroupedExperts
        seq = moe.keywords["submodules"].experts  # moe: partial(MoELayer, submodules=MoESubmodules(...))
        assert seq.func is SequentialMLP, seq
        moe.keywords["submodules"].experts = partial(GroupedExperts, *seq.args, **seq.keywords)
    bda = get_bias_dropout_add
    mixer = ModuleSpec(module=mamba_mixer, params=mamba_params,
                       submodules=MambaMixerSubmodules(in_proj=norm_linear, out_proj=RowParallelLinear))
    mlp = partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=norm_linear, linear_fc2=RowParallelLinear))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(mixer=mixer, mamba_bda=bda)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            self_attention=_self_attention(AttnMaskType.causal, attention), self_attn_bda=bda)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(mlp=mlp, mlp_bda=bda)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=LocalNorm, mlp=moe, mlp_bda=bda)),
    ))


def local_vit_layer_spec(attention: str = "sdpa") -> ModuleSpec:
    """Pre-LN ViT layer of non-TE modules, non-causal THD attention (each image to itself)."""
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=_self_attention(AttnMaskType.no_mask, attention), self_attn_bda=get_bias_dropout_add,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=LocalNormColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add,
    ))

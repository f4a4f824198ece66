"""Nemotron-3-Nano-Omni on megatron-core: config mapping, layer specs, packed THD forward, HF import / export.

    distributed.init_distributed()                                     # outside torchrun: a gloo world of one
    model = build_model("assets/tiny-omni", cfg.model, cfg.parallel)   # after parallel_state is initialised
    report = load_hf_weights(model, "assets/tiny-omni")                # each rank reads only its slices
    logits = model(batch)                                              # [T_local, V/TP], one packed THD microbatch
    export_hf(model, "out/", "assets/tiny-omni")                       # exact inverse, untouched keys written back

What is built (facts and names: shared/research/nemotron_omni_arch.md):
- `language_model`: megatron-core `HybridModel`, one layer per pattern letter (`M` Mamba-2, `*` attention without
  positional embedding, `E` MoE with sigmoid router + fp32 expert bias + shared expert, `-` dense MLP), squared-ReLU
  MLPs, RMSNorm pre-norms, final norm, untied vocab-parallel output layer. Logits stay sharded: [T_local, V/TP].
- `vision_model`: megatron-core `RADIOViTModel` (C-RADIO: bias-free 16-px patch embedder, 10 prefix tokens, CPE
  position embeddings interpolated in eval mode as transformers does, pre-LN blocks, no final norm). GELU is the erf
  form, as the checkpoint's config (`hidden_act="gelu"`) and transformers' `RadioModel`; Megatron-Bridge uses the
  tanh approximation instead. Images are packed (THD) and each attends only to itself.
- `vision_projection`: megatron-core `MultimodalProjector` (RMSNorm -> Linear -> squared ReLU -> Linear).
- Two specs chosen at build time: the Transformer Engine spec (megatron's `hybrid_stack_spec`, TE ViT layer spec)
  when transformer_engine imports and CUDA is used, else a local spec of megatron-core's non-TE modules plus two
  project modules:
  `LocalNormColumnParallelLinear` (the non-TE twin of `TELayerNormColumnParallelLinear`: same parameter names, so a
  checkpoint is the same whichever spec built the model) and `ThdDotProductAttention` (THD `cu_seqlens`
  attention within each sequence, causal or not, via torch's SDPA per sequence; context parallelism by
  all-gathering K/V).
- Mamba runs megatron-core's own `MambaMixer`: with mamba-ssm's fused kernels when mamba-ssm and causal-conv1d import
  and CUDA is used, else through the project's pure-torch stand-in (mamba_torch.py, on the model's device, installed by
  cpu_compat.apply(); the choice is cpu_compat.select_kernels()).

Forward (vision once per pair): every image of the microbatch is encoded once; the `<image>` positions of each sequence
take, in order, the features of that sequence's media slot (`media_index`), so the chosen and rejected rows of a pair
share one encoding. Then: embed the full packed sequence, replace `<image>` positions, take this rank's context-parallel
slice (pack.cp_partition_index layout), scatter for sequence parallelism, run the hybrid stack.

Run `python omni_model.py assets/tiny-omni` for a one-rank smoke run that prints the logits' shape.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pack import cp_partition_index, routing_padding_mask, thd_packed_seq_params, token_sequence_ids

IMAGE_PREFIX_DEFAULT = 10

# ======================================================================================================================
# Shims owned by this module (megatron-core 0.19.2). The general CPU shims live in cpu_compat.py.

_DT_LIMIT: contextvars.ContextVar = contextvars.ContextVar("omni_mamba_dt_limit", default=None)


def _install_mamba_dt_limit_hook() -> None:
    """SHIM: let a Mamba mixer pass `dt_limit` to the fused scan (megatron-core calls it with the default (0, inf)).

    transformers clamps softplus(dt + dt_bias) to >= time_step_min (NemotronHMamba2Mixer.time_step_limit); megatron-core
    does not. `OmniMambaMixer` sets `_DT_LIMIT` around its training scan; this wrapper, installed once over the
    function megatron's mamba_mixer module calls (mamba_ssm's kernel on GPU, the torch stand-in on CPU), forwards it.
    """
    from megatron.core.ssm import mamba_mixer

    fn = mamba_mixer.mamba_split_conv1d_scan_combined
    if fn is None or getattr(fn, "_omni_dt_limit", False):
        return

    def scan_with_dt_limit(*args, **kwargs):
        limit = _DT_LIMIT.get()
        if limit is not None and "dt_limit" not in kwargs:
            kwargs["dt_limit"] = limit
        return fn(*args, **kwargs)

    scan_with_dt_limit._omni_dt_limit = True
    scan_with_dt_limit.__wrapped__ = fn
    mamba_mixer.mamba_split_conv1d_scan_combined = scan_with_dt_limit


def _install_mamba_cp_thd_indices() -> None:
    """SHIM: megatron-core's Mamba context parallelism with THD packing asks Transformer Engine for
    `tex.thd_get_partitioned_indices` (mamba_context_parallel.py, `_undo/_redo_attention_load_balancing`). Without TE,
    provide the same load-balanced index (chunk r and 2*CP-1-r of every padded sequence) from `cp_partition_index`."""
    import types

    from megatron.core.ssm import mamba_context_parallel as mcp

    if mcp.tex is not None:
        return

    def thd_get_partitioned_indices(cu_seqlens, total_tokens, cp_size, cp_rank):
        if int(cu_seqlens[-1]) != int(total_tokens):
            raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, total_tokens is {total_tokens}")
        return cp_partition_index(cu_seqlens, cp_size, cp_rank).to(torch.int32)

    mcp.tex = types.SimpleNamespace(thd_get_partitioned_indices=thd_get_partitioned_indices)
    mcp.is_te_min_version = lambda version, *a, **k: True


def _install_router_padding_mask_fix() -> None:
    """SHIM: megatron-core 0.19.2's `TopKRouter._apply_expert_bias` masks the routing map [N, E] with the flattened
    padding mask [N] (`routing_map & ~padding_mask`), which broadcasts along the expert dim and fails (or, with
    N == E, masks the wrong entries). Same update, with the mask applied per token: counts of non-padding tokens
    only, outside evaluation and activation recomputation (grad enabled), as megatron-core intends."""
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter._apply_expert_bias, "_omni_fixed", False):
        return

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias._omni_fixed = True
    TopKRouter._apply_expert_bias = _apply_expert_bias


def _apply_cpu_shims() -> None:
    """Apply cpu_compat's shims for what this process lacks (cpu_compat.shims_for(select_kernels())): the CPU-only ones
    without CUDA, the local-spec norms without Transformer Engine, the torch Mamba without mamba-ssm."""
    import cpu_compat

    cpu_compat.apply()


# ======================================================================================================================
# Config: the checkpoint's config.json -> typed facts -> megatron-core TransformerConfigs

_BLOCK_TO_SYMBOL = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "moe": "E",
                    "mlp": "-"}


@dataclass
class OmniHFConfig:
    """The dimensions this module needs, read from an Omni config.json (hub or transformers-native layout)."""

    text: Any  # transformers NemotronHConfig
    vision: Any  # transformers RadioConfig
    pattern: str  # hybrid layer pattern, one letter per layer (M * E -)
    vision_hidden_size: int
    projector_hidden_size: int
    downsample_ratio: float
    image_token_id: int
    num_prefix_tokens: int  # class + register tokens of RADIO, dropped after the ViT
    raw: dict = field(default_factory=dict)


def read_hf_config(hf_dir: str | os.PathLike) -> OmniHFConfig:
    """Parse `hf_dir/config.json` through transformers' own config classes (which accept the hub's legacy names
    `llm_config`, `vit_hidden_size`, `img_context_token_id`, ... and the native `text_config` layout).

    Raises:
        FileNotFoundError: no config.json. ValueError: a setting this implementation does not support (named).
    """
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config

    path = Path(hf_dir) / "config.json"
    raw = json.loads(path.read_text())
    kw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map", "transformers_version")}
    cfg = NemotronH_Omni_Reasoning_V3_Config(**kw)
    text, vision = cfg.text_config, cfg.vision_config
    pattern = "".join(_BLOCK_TO_SYMBOL[t] for t in text.layers_block_type)
    checks = [
        (getattr(text, "mlp_hidden_act", "relu2") == "relu2", "llm mlp_hidden_act must be relu2"),
        (getattr(text, "mamba_hidden_act", "silu") == "silu", "llm mamba_hidden_act must be silu"),
        (not getattr(text, "attention_bias", False) and not getattr(text, "mlp_bias", False),
         "llm attention/mlp biases are not supported"),
        (not getattr(text, "use_bias", False) and not getattr(text, "mamba_proj_bias", False),
         "Mamba projection biases are not supported (megatron-core asserts bias=False)"),
        (getattr(text, "use_conv_bias", True), "Mamba conv without bias is not supported"),
        ("E" not in pattern or getattr(text, "norm_topk_prob", True), "norm_topk_prob=False is not supported"),
        (getattr(text, "moe_latent_size", None) is None, "moe_latent_size (Nemotron Super) is not supported"),
        (getattr(text, "num_nextn_predict_layers", 0) == 0, "MTP layers are not supported"),
        (raw.get("ps_version", "v2") == "v2", f"ps_version {raw.get('ps_version')!r}: only 'v2' pixel shuffle"),
        (cfg.downsample_ratio == 0.5, f"downsample_ratio {cfg.downsample_ratio}: only the 2x2 pixel shuffle (0.5)"),
        (not getattr(vision, "use_swiglu_ffn", False), "RADIO SwiGLU FFN is not supported"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(f"{path}: {msg}")
    return OmniHFConfig(
        text=text,
        vision=vision,
        pattern=pattern,
        vision_hidden_size=int(cfg.vision_hidden_size),
        projector_hidden_size=int(cfg.projector_hidden_size),
        downsample_ratio=float(cfg.downsample_ratio),
        image_token_id=int(cfg.image_token_id),
        num_prefix_tokens=int(vision.num_cls_tokens + vision.num_registers),
        raw=raw,
    )


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _common_config_kwargs(model_cfg, parallel_cfg, use_te: bool) -> dict:
    """TransformerConfig settings shared by the language model, the ViT and the projector."""
    dtype = _dtype(model_cfg.params_dtype)
    kw = dict(
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        gated_linear_unit=False,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not torch.cuda.is_available(),
        # fusions that need TE/Apex/CUDA; the TE spec fuses on its own
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    if model_cfg.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif model_cfg.recompute == "selective":
        kw.update(recompute_granularity="selective")
    return kw


def language_config(hf: OmniHFConfig, model_cfg, parallel_cfg, use_te: bool):
    """megatron-core TransformerConfig of the hybrid language model (every dimension from the checkpoint)."""
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import TransformerConfig

    t = hf.text
    kw = _common_config_kwargs(model_cfg, parallel_cfg, use_te)
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    kw.update(
        num_layers=len(hf.pattern),
        hidden_size=t.hidden_size,
        ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads,
        num_query_groups=t.num_key_value_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=t.layer_norm_epsilon,
        activation_func=squared_relu,
        mamba_state_dim=t.ssm_state_size,
        mamba_head_dim=t.mamba_head_dim,
        mamba_num_groups=t.n_groups,
        mamba_num_heads=t.mamba_num_heads,
        context_parallel_size=parallel_cfg.context_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        fp32_residual_connection=bool(getattr(t, "residual_in_fp32", False)),
    )
    if "E" in hf.pattern:
        # The checkpoint's moe_shared_expert_intermediate_size is already the total width of the shared expert(s):
        # transformers' NemotronHMOE builds one shared MLP of that width whatever n_shared_experts says, and so does
        # megatron-core (one SharedExpertMLP of moe_shared_expert_intermediate_size).
        kw.update(
            num_moe_experts=t.n_routed_experts,
            moe_router_topk=t.num_experts_per_tok,
            moe_ffn_hidden_size=t.moe_intermediate_size,
            moe_shared_expert_intermediate_size=t.moe_shared_expert_intermediate_size or None,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            # aux-loss-free balancing: the expert bias moves by ±rate per optimizer step (finalize_model_grads); a
            # frozen language model keeps its routing, so its bias does not move either
            moe_router_bias_update_rate=0.0 if model_cfg.freeze_language_model else
            model_cfg.moe_router_bias_update_rate,
            moe_router_topk_scaling_factor=t.routed_scaling_factor,
            moe_router_dtype="fp32",
            moe_router_num_groups=t.n_group if t.n_group > 1 else None,
            moe_router_group_topk=t.topk_group if t.n_group > 1 else None,
            moe_grouped_gemm=use_te,
            moe_permute_fusion=False,
            moe_token_dispatcher_type=model_cfg.moe_token_dispatcher_type,
            moe_router_load_balancing_type=model_cfg.moe_router_load_balancing_type,
            moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
            expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel_cfg.expert_tensor_parallel_size,
        )
    return TransformerConfig(**kw)


def vision_config(hf: OmniHFConfig, model_cfg, parallel_cfg, use_te: bool):
    """TransformerConfig of the RADIO ViT: replicated over CP, never sequence-parallel (images are short, packed)."""
    from megatron.core.transformer import TransformerConfig

    v = hf.vision
    act = {"gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}.get(v.hidden_act)
    if act is None:
        raise ValueError(f"RADIO hidden_act {v.hidden_act!r} is not supported (gelu, gelu_pytorch_tanh)")
    kw = _common_config_kwargs(model_cfg, parallel_cfg, use_te)
    kw.update(
        num_layers=v.num_hidden_layers,
        hidden_size=v.hidden_size,
        ffn_hidden_size=int(v.hidden_size * v.mlp_ratio),
        num_attention_heads=v.num_attention_heads,
        num_query_groups=v.num_attention_heads,
        kv_channels=v.hidden_size // v.num_attention_heads,
        add_bias_linear=True,
        add_qkv_bias=bool(v.qkv_bias),
        normalization="LayerNorm",
        layernorm_epsilon=v.layer_norm_eps,
        activation_func=act,
        context_parallel_size=1,
        sequence_parallel=False,
    )
    return TransformerConfig(**kw)


def projector_config(hf: OmniHFConfig, model_cfg, parallel_cfg, use_te: bool):
    """TransformerConfig of the mlp1 projector (hidden_size = the language model's; RMSNorm eps 1e-5 as
    transformers' NemotronH_Omni_Reasoning_V3MultiModalProjector)."""
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import TransformerConfig

    kw = _common_config_kwargs(model_cfg, parallel_cfg, use_te)
    kw.update(
        num_layers=1,
        hidden_size=hf.text.hidden_size,
        ffn_hidden_size=hf.projector_hidden_size,
        num_attention_heads=hf.text.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        activation_func=squared_relu,
        context_parallel_size=1,
        sequence_parallel=False,
    )
    return TransformerConfig(**kw)


# ======================================================================================================================
# Local (non-TE) modules with TE's parameter names


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
    parameters are tagged `sequence_parallel` so megatron all-reduces their gradients over TP."""

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


def _column_parallel_linear():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear


class LocalNormColumnParallelLinear(nn.Module):
    """Placeholder replaced at import by `_make_norm_linear()` (a ColumnParallelLinear subclass)."""


def _make_norm_linear():
    """Build the class lazily so importing omni_model does not import megatron-core."""
    import inspect

    base = _column_parallel_linear()
    allowed = set(inspect.signature(base.__init__).parameters)

    class _LocalNormColumnParallelLinear(base):
        """Pre-norm + ColumnParallelLinear: the non-TE equivalent of TELayerNormColumnParallelLinear, with the same
        parameter names (`layer_norm_weight`, `layer_norm_bias` for LayerNorm, `weight`, `bias`). The norm runs on
        the local sequence shard before the linear's sequence-parallel all-gather (it is per token)."""

        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config,
                             **{k: v for k, v in kwargs.items() if k in allowed})
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
            x = _norm(input_, self.layer_norm_weight, self.layer_norm_bias, self.norm_eps, self.norm_kind)
            return super().forward(x, weight=weight, runtime_gather_output=runtime_gather_output)

    _LocalNormColumnParallelLinear.__name__ = "LocalNormColumnParallelLinear"
    return _LocalNormColumnParallelLinear


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


class ThdDotProductAttention(nn.Module):
    """Core attention (softmax(QK^T * scale) V) for the local spec that honours THD packing and context parallelism.

    Inputs as megatron's SelfAttention hands them to core attention: BSHD-style `[s, b, heads, d]`, or with THD
    `packed_seq_params` `[t, heads, d]`. Keys attend only within their own sequence (segments from
    `cu_seqlens_q_padded`, else `cu_seqlens_q`), and only to earlier-or-equal positions when the mask type is causal.
    Under CP (`config.context_parallel_size > 1`) each rank holds the load-balanced slice of every sequence; K and V
    are all-gathered over the CP group (gradient: reduce-scatter) and the causal mask uses the global positions.
    GQA: K/V groups are repeated to the query heads.

    Cost: torch's scaled_dot_product_attention once per contiguous run of queries within one sequence (a whole
    sequence without CP, two chunks per sequence under CP), so work and memory grow with Σ L_i², never with the
    square of the packed row. A run that starts at offset o > 0 of its sequence (CP) sees keys [0, o + len) under a
    bottom-right-aligned causal mask of [len, o + len]. The TE spec is the production path.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **unused):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType

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

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [s, b, heads, d] (or [t, heads, d] with THD packed_seq_params), key/value with query groups.

        attention_mask: megatron's bool [b, 1, s, s_total], True where attention is not allowed (non-THD only).
        Returns [s, b, heads·d] (or [t, heads·d]) in the input dtype.
        Raises ValueError for an attention_bias, or under CP for a row longer than cu_seqlens_padded[-1].
        """
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None:
            raise ValueError("ThdDotProductAttention does not take an attention_bias")
        causal = self.causal if attn_mask_type is None else attn_mask_type == AttnMaskType.causal
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # [t, h, d] -> [t, 1, h, d]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        s_local, b = query.shape[0], query.shape[1]
        # the ViT shares megatron's process groups but is replicated over CP (its config says CP = 1)
        cp = self.cp_group.size() if self.cp_group is not None and self.config.context_parallel_size > 1 else 1
        if cp > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            key = gather_from_sequence_parallel_region(key.contiguous(), True, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value.contiguous(), True, group=self.cp_group)
        s_total = key.shape[0]
        device = query.device
        if thd:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        else:
            cu = torch.tensor([0, s_total])
        runs = _query_runs([int(c) for c in cu.tolist()], s_total, cp, self.cp_group.rank() if cp > 1 else 0)
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
        for q0, n, start, end, off in runs:
            k_end = start + off + n if causal else end
            mask, is_causal = None, False
            if causal and off > 0:  # bottom-right aligned: query i (position off + i) sees keys 0 .. off + i
                kk = torch.arange(off + n, device=device)
                mask = kk[None, :] <= torch.arange(n, device=device)[:, None] + off
            elif causal:
                is_causal = True
            if attention_mask is not None and not thd:
                # megatron masks are True where attention is *not* allowed, [b, 1, sq, sk]
                allowed = ~attention_mask[..., q0:q0 + n, start:k_end].to(torch.bool)
                if is_causal:
                    mask = torch.ones(n, k_end - start, dtype=torch.bool, device=device).tril()
                mask = allowed if mask is None else allowed & mask
                is_causal = False
            outs.append(F.scaled_dot_product_attention(
                q[:, :, q0:q0 + n], k[:, :, start:k_end], v[:, :, start:k_end], attn_mask=mask,
                dropout_p=dropout, is_causal=is_causal, scale=self.scale))
        out = torch.cat(outs, dim=2) if outs else q.new_zeros(b, self.heads, 0, self.head_dim)  # [b, h, s, d]
        out = out.permute(2, 0, 1, 3).reshape(s_local, b, self.heads * self.head_dim)
        return out.squeeze(1) if thd else out


# ======================================================================================================================
# Layer specs


def _mamba_mixer_class():
    from megatron.core.ssm.mamba_mixer import MambaMixer

    class OmniMambaMixer(MambaMixer):
        """megatron-core MambaMixer plus the reference's time-step clamp (`dt_limit`, see
        `_install_mamba_dt_limit_hook`). `dt_clamp_min=None` keeps megatron-core's (0, inf)."""

        def __init__(self, *args, dt_clamp_min: float | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.dt_limit = None if dt_clamp_min is None else (float(dt_clamp_min), float("inf"))

        def _ssm_training(self, zxBCdt, packed_seq_params=None):
            token = _DT_LIMIT.set(self.dt_limit)
            try:
                return super()._ssm_training(zxBCdt, packed_seq_params)
            finally:
                _DT_LIMIT.reset(token)

    return OmniMambaMixer


def _mamba_params(hf: OmniHFConfig, model_cfg) -> dict:
    t = hf.text
    return dict(
        d_conv=t.conv_kernel,
        chunk_size=t.chunk_size,
        dt_min=t.time_step_min,
        dt_max=t.time_step_max,
        dt_init_floor=t.time_step_floor,
        conv_bias=True,
        dt_clamp_min=t.time_step_min if model_cfg.mamba_dt_clamp else None,
    )


def local_hybrid_stack_spec(hf: OmniHFConfig, model_cfg):
    """HybridStack spec of megatron-core's non-TE modules (+ the two project modules above)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    norm_linear = LocalNormColumnParallelLinear
    moe = get_moe_module_spec(use_te=False, num_experts=max(1, getattr(hf.text, "n_routed_experts", 1) or 1),
                              moe_grouped_gemm=False)
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    mixer=ModuleSpec(
                        module=_mamba_mixer_class(),
                        params=_mamba_params(hf, model_cfg),
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
                            linear_qkv=norm_linear, core_attention=ThdDotProductAttention,
                            linear_proj=RowParallelLinear,
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


def te_hybrid_stack_spec(hf: OmniHFConfig, model_cfg):
    """megatron-core's TE `hybrid_stack_spec` with the Mamba mixer swapped for OmniMambaMixer (checkpoint's conv
    kernel, chunk size and dt clamp)."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    spec = copy.deepcopy(hybrid_stack_spec)
    mixer = spec.submodules.mamba_layer.submodules.mixer
    mixer.module = _mamba_mixer_class()
    mixer.params = {**(mixer.params or {}), **_mamba_params(hf, model_cfg)}
    return spec


def local_vit_layer_spec():
    """Pre-LN ViT layer of non-TE modules (LayerNorm fused into qkv / fc1 like TE's ViT spec), non-causal THD
    attention (each image attends only to itself)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=LocalNormColumnParallelLinear, core_attention=ThdDotProductAttention,
                    linear_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=LocalNormColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def have_transformer_engine() -> bool:
    """True when the TE specs are used: transformer_engine's torch extension imports and CUDA is used
    (cpu_compat.select_kernels)."""
    import cpu_compat

    return cpu_compat.select_kernels().spec == "te"


# ======================================================================================================================
# The model


@contextlib.contextmanager
def _routers_without_statistics(module: nn.Module, active: bool):
    """Run the MoE routers of `module` in eval mode while `active` (a row with no real token, e.g. a dummy bin).

    With every token masked, megatron-core's aux loss divides 0 by 0 tokens (NaN); its routers only compute the aux
    losses in training mode, and the expert-bias counts are 0 anyway. The rest of the model stays in training mode.
    """
    routers = [m for m in module.modules() if active and m.training and hasattr(m, "expert_bias")]
    for m in routers:
        m.training = False
    try:
        yield
    finally:
        for m in routers:
            m.training = True


def _get(batch, name: str, default=None):
    if isinstance(batch, dict):
        return batch.get(name, default)
    return getattr(batch, name, default)


class OmniModel(nn.Module):
    """Vision tower + projector + hybrid language model. `forward(batch) -> logits [T_local, V/TP]`.

    `batch` is a pack.PackedBatch or any object / dict with:
        input_ids: int64 [1, T] (or [T]), the full packed row (every CP rank passes the same, unsliced).
        cu_seqlens_padded: int32 [S+1] (optional; default one sequence [0, T]); cu_seqlens: int32 [S+1] (optional,
            default = cu_seqlens_padded); max_seqlen: int (optional).
        pixel_values: float [N_patches, 3*P*P] and image_grid_hw: int64 [N_images, 2] (optional without images).
        media_index: int64 [S] media slot of each sequence, media_image_offsets: int64 [M+1] (images of slot m are
            offsets[m]:offsets[m+1]) (optional: without them all `<image>` tokens take all images' features, in order).
        sample_mask: float [S] (optional): sequences of weight 0 (dummy bins), like each sequence's padding, take no
            part in the MoE routers' statistics (pack.routing_padding_mask).
    T must be divisible by 2*CP (and by TP under sequence parallelism). Returns fp32/bf16 logits [T/CP(/...), V/TP]
    in this CP rank's load-balanced order (see cp_partition_index): the logit at row i predicts the token after the
    position cp_partition_index(...)[i].
    Raises ValueError: `<image>` token count differs from the feature count (both counts in the message), an odd
    image grid, or pixel rows that do not match the grids.
    """

    def __init__(self, hf: OmniHFConfig, model_cfg, parallel_cfg, use_te: bool):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.models.hybrid.hybrid_model import HybridModel
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.models.vision.radio import RADIOViTModel
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel import RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules

        self.hf = hf
        self.use_te = use_te
        self.model_cfg, self.parallel_cfg = model_cfg, parallel_cfg
        self.image_token_id = hf.image_token_id
        self.patch_size = hf.vision.patch_size
        self.num_prefix_tokens = hf.num_prefix_tokens
        tp = parallel_state.get_tensor_model_parallel_world_size()
        vocab = hf.text.vocab_size
        if vocab % tp:
            raise ValueError(f"vocab_size {vocab} is not divisible by TP = {tp} (the output stays vocab-parallel)")
        pg = ProcessGroupCollection.use_mpu_process_groups()
        self.lm_config = language_config(hf, model_cfg, parallel_cfg, use_te)
        spec = te_hybrid_stack_spec(hf, model_cfg) if use_te else local_hybrid_stack_spec(hf, model_cfg)
        self.language_model = HybridModel(
            config=self.lm_config,
            hybrid_stack_spec=spec,
            vocab_size=vocab,
            max_sequence_length=hf.text.max_position_embeddings,
            hybrid_layer_pattern=hf.pattern,
            position_embedding_type="none",
            share_embeddings_and_output_weights=bool(getattr(hf.text, "tie_word_embeddings", False)),
            scatter_embedding_sequence_parallel=False,  # merge images, CP-slice, then scatter (forward)
            parallel_output=True,
            pg_collection=pg,
        )
        self.vit_config = vision_config(hf, model_cfg, parallel_cfg, use_te)
        if use_te:
            from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear, TERowParallelLinear
            from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec

            vit_spec = get_vit_layer_with_transformer_engine_spec()
            fc1, fc2 = TELayerNormColumnParallelLinear, TERowParallelLinear
        else:
            vit_spec, fc1, fc2 = local_vit_layer_spec(), LocalNormColumnParallelLinear, RowParallelLinear
        v = hf.vision
        self.vision_model = RADIOViTModel(
            transformer_config=self.vit_config,
            transformer_layer_spec=vit_spec,
            add_class_token=True,
            class_token_len=self.num_prefix_tokens,
            patch_dim=v.patch_size,
            img_h=v.patch_size * 2,
            img_w=v.patch_size * 2,
            max_img_h=v.max_img_size,
            max_img_w=v.max_img_size,
            has_cpe=True,
            embedder_bias=False,
            dynamic_resolution=True,
            force_cpe_eval_mode=True,  # CPE augmentation off: the same position embeddings in train and eval
            pg_collection=pg,
        )
        self.proj_config = projector_config(hf, model_cfg, parallel_cfg, use_te)
        self.vision_projection = MultimodalProjector(
            config=self.proj_config,
            submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2),
            projector_type="mlp",
            input_size=hf.vision_hidden_size * 4,
            tp_group=pg.tp,
        )
        self.pg = pg
        for flag, module in ((model_cfg.freeze_vision_encoder, self.vision_model),
                             (model_cfg.freeze_vision_projector, self.vision_projection),
                             (model_cfg.freeze_language_model, self.language_model)):
            if flag:
                for p in module.parameters():
                    p.requires_grad_(False)

    # -- vision -------------------------------------------------------------------------------------------------------

    def encode_images(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> list[torch.Tensor]:
        """RADIO + 2x2 pixel shuffle (v2) + projector, every image once.

        Args: pixel_values float [N_patches, 3*P*P] (patches row-major per image, each laid out (c, py, px), already
            normalised by the processor); image_grid_hw int64 [N_images, 2] patch grid (gh, gw), both even.
        Returns: list of [gh*gw/4, H_lm] features, one per image, in the language model's dtype.
        Raises: ValueError on odd grids or a patch count that does not match the grids.
        """
        from megatron.core.packed_seq_params import PackedSeqParams

        grids = [(int(h), int(w)) for h, w in image_grid_hw.tolist()]
        if not grids:
            return []
        n = sum(h * w for h, w in grids)
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patch rows but image_grid_hw {grids} needs {n}")
        for h, w in grids:
            if h % 2 or w % 2:
                raise ValueError(f"image grid {h}x{w} must be even in both sides for the 2x2 pixel shuffle")
        dtype = self.vit_config.params_dtype
        device = pixel_values.device
        lens = torch.tensor([h * w for h, w in grids], device=device)
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                              max_seqlen_q=int(lens.max()), max_seqlen_kv=int(lens.max()))
        sizes = torch.tensor(grids, device=device) * self.patch_size
        x = self.vision_model(pixel_values.to(dtype)[None], imgs_sizes=sizes, packed_seq_params=psp)[0]
        out, start = [], 0
        p = self.num_prefix_tokens
        shuffled = []
        for h, w in grids:
            f = x[start + p:start + p + h * w]  # drop the class/register tokens
            start += p + h * w
            c = f.shape[-1]
            # "v2" pixel shuffle: (h, w, c) -> (h, w/2, 2c) -> (w/2, h, 2c) -> (w/2, h/2, 4c) -> (h/2, w/2, 4c)
            f = f.reshape(h, w // 2, 2 * c).transpose(0, 1).reshape(w // 2, h // 2, 4 * c).transpose(0, 1)
            shuffled.append(f.reshape(-1, 4 * c))
        feats = self.vision_projection(torch.cat(shuffled)[:, None])[:, 0]
        for t in (h * w // 4 for h, w in grids):
            out.append(feats[:t])
            feats = feats[t:]
        return out

    def _image_rows(self, batch, ids: torch.Tensor, cu_pad: torch.Tensor, feats: list[torch.Tensor]):
        """(positions [N] int64, rows [N, H]) of every `<image>` token, rows taken per sequence from its media slot."""
        is_img = ids == self.image_token_id
        positions = torch.nonzero(is_img).flatten()
        media_index = _get(batch, "media_index")
        offsets = _get(batch, "media_image_offsets")
        n_feat = sum(f.shape[0] for f in feats)
        if media_index is None or offsets is None:
            if positions.numel() != n_feat:
                raise ValueError(f"{positions.numel()} <image> tokens (id {self.image_token_id}) but the images give "
                                 f"{n_feat} features")
            return positions, torch.cat(feats) if feats else None
        rows = []
        counts = torch.bincount(token_sequence_ids(cu_pad, ids.numel())[is_img], minlength=cu_pad.numel() - 1)
        offsets = offsets.tolist()
        for s, slot in enumerate(media_index.tolist()):
            slot_feats = feats[offsets[slot]:offsets[slot + 1]]
            n = sum(f.shape[0] for f in slot_feats)
            if int(counts[s]) != n:
                raise ValueError(f"sequence {s}: {int(counts[s])} <image> tokens (id {self.image_token_id}) but its "
                                 f"media slot {slot} gives {n} features")
            rows.extend(slot_feats)
        if int(counts[len(media_index):].sum()):
            raise ValueError(f"{int(counts[len(media_index):].sum())} <image> tokens lie outside every sequence")
        return positions, torch.cat(rows) if rows else None

    # -- forward ------------------------------------------------------------------------------------------------------

    def forward(self, batch) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        input_ids = _get(batch, "input_ids")
        ids = input_ids.reshape(-1)
        T = ids.numel()
        device = ids.device
        cu_pad = _get(batch, "cu_seqlens_padded")
        cu_pad = torch.tensor([0, T], dtype=torch.int32, device=device) if cu_pad is None else cu_pad.to(device)
        cu = _get(batch, "cu_seqlens")
        cu = cu_pad if cu is None else cu.to(device)
        if int(cu_pad[-1]) != T:
            raise ValueError(f"cu_seqlens_padded ends at {int(cu_pad[-1])} but input_ids has {T} tokens")

        emb = self.language_model.embedding(input_ids=ids[None], position_ids=None)  # [T, 1, H], TP-reduced
        pixel_values, grid = _get(batch, "pixel_values"), _get(batch, "image_grid_hw")
        has_images = grid is not None and grid.numel() > 0
        feats = self.encode_images(pixel_values.to(device), grid) if has_images else []
        n_tokens = int((ids == self.image_token_id).sum())
        if n_tokens or feats:
            positions, rows = self._image_rows(batch, ids, cu_pad, feats)
            if rows is not None:
                emb = emb.index_put((positions, torch.zeros_like(positions)), rows.to(emb.dtype)[:, None][:, 0])

        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:
            index = cp_partition_index(cu_pad, cp, parallel_state.get_context_parallel_rank()).to(device)
            emb = emb.index_select(0, index)
        if self.lm_config.sequence_parallel:
            emb = scatter_to_sequence_parallel_region(emb, group=self.pg.tp)
        max_seqlen = _get(batch, "max_seqlen") or int((cu_pad[1:] - cu_pad[:-1]).max())
        psp = thd_packed_seq_params(cu, cu_pad, max_seqlen)
        # Padding and zero-weight (dummy-bin) tokens take no part in the routers' statistics: megatron-core's
        # padding_mask ([1, tokens of this rank], True = padding) reaches every MoE router (expert-bias counts, aux
        # loss, z-loss) on the TE and local specs. It is sliced like the embeddings: CP layout, then this TP rank's
        # contiguous SP chunk (HybridModel, unlike GPTModel, does not scatter it itself).
        pad = routing_padding_mask(cu, cu_pad, T, _get(batch, "sample_mask"))
        no_real_token = bool(pad.all())
        if cp > 1:
            pad = pad[index]
        if self.lm_config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            pad = pad.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
        with _routers_without_statistics(self.language_model, no_real_token and self.training):
            logits = self.language_model(input_ids=None, position_ids=None, attention_mask=None, decoder_input=emb,
                                         packed_seq_params=psp, padding_mask=pad[None])
        return logits[0]


def cast_params_to(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Give every floating-point parameter of `model` the dtype `dtype` (in place; buffers such as the router's fp32
    `expert_bias` are kept); returns the names of the parameters cast.

    megatron-core creates a few parameters in fp32 whatever `params_dtype` says (the Mamba mixer's `A_log` and `D`;
    without Transformer Engine also the hybrid stack's final norm). Megatron-LM's `Float16Module` casts the whole model
    to bf16, and megatron-core's mixed-precision optimizers rely on it: in 0.19.2 both map their fp32 main parameters
    to model parameters by position inside a param group assuming every parameter of the group is 16-bit (the
    distributed optimizer orders the group as [fp32 params, fp32 copies of 16-bit params]; the non-distributed one
    zips the state with its 16-bit params only). A group that mixes fp32 and bf16 parameters trains correctly but its
    optimizer checkpoint maps states to the wrong tensors (`AssertionError: (torch.Size([64]), 6144, 6272)` in
    `sharded_param_state_dp_reshardable`, "Optimizer shape ... does not match model shape" without the distributed
    optimizer). With one dtype the fp32 precision of `A_log` and `D` lives in the optimizer's fp32 main copies, as in
    Megatron-LM and in transformers' bf16 model (where only `e_score_correction_bias` stays fp32).
    """
    cast = []
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            cast.append(name)
    return cast


def build_model(hf_dir: str | os.PathLike, model_cfg, parallel_cfg, use_te: bool | None = None) -> OmniModel:
    """Build the Omni model on this rank (megatron-core parallel_state must be initialised with the sizes in
    `parallel_cfg`). Weights are megatron-core's initialisation until `load_hf_weights`.

    Args: hf_dir: checkpoint directory (config.json). model_cfg: config.ModelConfig. parallel_cfg:
        config.ParallelConfig. use_te: force the TE (True) or local (False) spec; default: TE when it imports with CUDA.
    Raises: ValueError for unsupported checkpoint settings or sizes that do not divide (named in the message).
    """
    from megatron.core import parallel_state

    _apply_cpu_shims()
    _install_mamba_dt_limit_hook()
    _install_router_padding_mask_fix()
    if parallel_cfg.context_parallel_size > 1:
        _install_mamba_cp_thd_indices()
    global LocalNormColumnParallelLinear
    if not issubclass(LocalNormColumnParallelLinear, _column_parallel_linear()):
        LocalNormColumnParallelLinear = _make_norm_linear()
    hf = read_hf_config(hf_dir)
    if use_te is None:
        use_te = have_transformer_engine()
    sizes = {
        "TP": parallel_state.get_tensor_model_parallel_world_size(),
        "CP": parallel_state.get_context_parallel_world_size(),
        "EP": parallel_state.get_expert_model_parallel_world_size(),
        "ETP": parallel_state.get_expert_tensor_parallel_world_size(),
    }
    wanted = {"TP": parallel_cfg.tensor_model_parallel_size, "CP": parallel_cfg.context_parallel_size,
              "EP": parallel_cfg.expert_model_parallel_size, "ETP": parallel_cfg.expert_tensor_parallel_size}
    if sizes != wanted:
        raise ValueError(f"parallel_state has {sizes} but parallel_cfg asks for {wanted}")
    if "E" in hf.pattern and parallel_cfg.expert_tensor_parallel_size != 1:
        raise ValueError(f"expert_tensor_parallel_size = {parallel_cfg.expert_tensor_parallel_size}: only 1 "
                         "(experts whole on their EP rank) is supported")
    model = OmniModel(hf, model_cfg, parallel_cfg, use_te)
    cast_params_to(model, _dtype(model_cfg.params_dtype))
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


# ======================================================================================================================
# HF import / export


@dataclass(frozen=True)
class Segment:
    """A run of `length` rows (dim 0) or columns (dim 1) of HF tensor `key`, starting at `start`."""

    key: str
    start: int
    length: int


@dataclass
class ParamMap:
    """How one megatron-core tensor is made of HF tensors: along `dim`, the local tensor of rank r of `group`
    ("tp", "ep", or None for replicated) is the concatenation of `segments(r, size)`."""

    dim: int
    group: str | None
    segments: Callable[[int, int], list[Segment]]


def _split(key: str, n: int, dim: int = 0, group: str | None = "tp") -> ParamMap:
    return ParamMap(dim, group, lambda r, s: [Segment(key, r * n // s, n // s)])


def _whole(key: str, n: int) -> ParamMap:
    return ParamMap(0, None, lambda r, s: [Segment(key, 0, n)])


def _pieces(parts: list[tuple[str, int, int]], dim: int = 0) -> ParamMap:
    """Concatenated components (key, offset, size), each split evenly over TP (Mamba in_proj z|x|B|C|dt, conv x|B|C)."""
    return ParamMap(dim, "tp", lambda r, s: [Segment(k, off + r * n // s, n // s) for k, off, n in parts])


def hf_param_map(model: OmniModel) -> dict[str, ParamMap]:
    """megatron-core name -> ParamMap for every parameter (and the router expert-bias buffer) of `model`.

    Mapping: shared/research/nemotron_omni_arch.md section 5 (hub key names). Raises ValueError for a megatron
    tensor without an HF source.
    """
    hf, t, v = model.hf, model.hf.text, model.hf.vision
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    di, gn, nh = t.mamba_num_heads * t.mamba_head_dim, t.n_groups * t.ssm_state_size, t.mamba_num_heads
    hpg = t.num_attention_heads // t.num_key_value_heads
    n_exp = getattr(t, "n_routed_experts", 0) or 0
    ep = model.lm_config.expert_model_parallel_size
    local_experts = n_exp // ep if n_exp else 0
    vh, vheads = v.hidden_size, v.num_attention_heads
    vd = vh // vheads
    vffn = int(vh * v.mlp_ratio)
    lm, vm = "language_model.backbone.", "vision_model.radio_model.model."
    maps: dict[str, ParamMap] = {}

    def qkv(layer: int, groups: int) -> ParamMap:
        def seg(r, s):
            out = []
            for g in range(r * groups // s, (r + 1) * groups // s):
                out += [Segment(f"{lm}layers.{layer}.mixer.q_proj.weight", g * hpg * head_dim, hpg * head_dim),
                        Segment(f"{lm}layers.{layer}.mixer.k_proj.weight", g * head_dim, head_dim),
                        Segment(f"{lm}layers.{layer}.mixer.v_proj.weight", g * head_dim, head_dim)]
            return out
        return ParamMap(0, "tp", seg)

    def vit_qkv(key: str) -> ParamMap:
        def seg(r, s):  # timm rows [Q; K; V] -> megatron per head [q_h; k_h; v_h]
            return [Segment(key, part * vh + h * vd, vd)
                    for h in range(r * vheads // s, (r + 1) * vheads // s) for part in range(3)]
        return ParamMap(0, "tp", seg)

    def expert(key_fmt: str, j: int) -> ParamMap:
        return ParamMap(0, "ep", lambda r, s: [Segment(key_fmt.format(e=r * local_experts + j), 0, None)])

    names = list(_model_tensors(model))
    for name in names:
        m = re.match(r"language_model\.decoder\.layers\.(\d+)\.(.+)$", name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            p = f"{lm}layers.{i}."
            kind = hf.pattern[i]
            inp, cw, cb = p + "mixer.in_proj.weight", p + "mixer.conv1d.weight", p + "mixer.conv1d.bias"
            table = {
                "mixer.in_proj.layer_norm_weight": _whole(p + "norm.weight", t.hidden_size),
                "mixer.in_proj.weight": _pieces([(inp, 0, di), (inp, di, di), (inp, 2 * di, gn),
                                                 (inp, 2 * di + gn, gn), (inp, 2 * di + 2 * gn, nh)]),
                "mixer.conv1d_weight": _pieces([(cw, 0, di), (cw, di, gn), (cw, di + gn, gn)]),
                "mixer.conv1d_bias": _pieces([(cb, 0, di), (cb, di, gn), (cb, di + gn, gn)]),
                "mixer.A_log": _split(p + "mixer.A_log", nh),
                "mixer.D": _split(p + "mixer.D", nh),
                "mixer.dt_bias": _split(p + "mixer.dt_bias", nh),
                "mixer.norm.weight": _split(p + "mixer.norm.weight", di),
                "mixer.out_proj.weight": _split(p + "mixer.out_proj.weight", di, dim=1),
                "self_attention.linear_qkv.layer_norm_weight": _whole(p + "norm.weight", t.hidden_size),
                "self_attention.linear_qkv.weight": qkv(i, t.num_key_value_heads),
                "self_attention.linear_proj.weight": _split(p + "mixer.o_proj.weight",
                                                            t.num_attention_heads * head_dim, dim=1),
                "mlp.linear_fc1.layer_norm_weight": _whole(p + "norm.weight", t.hidden_size),
                "mlp.linear_fc1.weight": _split(p + "mixer.up_proj.weight", t.intermediate_size),
                "mlp.linear_fc2.weight": _split(p + "mixer.down_proj.weight", t.intermediate_size, dim=1),
                "pre_mlp_layernorm.weight": _whole(p + "norm.weight", t.hidden_size),
                "mlp.router.weight": _whole(p + "mixer.gate.weight", n_exp),
                "mlp.router.expert_bias": _whole(p + "mixer.gate.e_score_correction_bias", n_exp),
            }
            if kind == "E":
                sh = t.moe_shared_expert_intermediate_size
                table["mlp.shared_experts.linear_fc1.weight"] = _split(p + "mixer.shared_experts.up_proj.weight", sh)
                table["mlp.shared_experts.linear_fc2.weight"] = _split(p + "mixer.shared_experts.down_proj.weight", sh,
                                                                       dim=1)
            e = re.match(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", rest) or \
                re.match(r"mlp\.experts\.linear_fc([12])\.weight(\d+)$", rest)
            if e:
                j, fc = (int(e.group(1)), e.group(2)) if "local_experts" in rest else (int(e.group(2)), e.group(1))
                proj = "up_proj" if fc == "1" else "down_proj"
                maps[name] = expert(p + "mixer.experts.{e}." + proj + ".weight", j)
                continue
            if rest not in table:
                raise ValueError(f"no HF mapping for megatron parameter {name}")
            maps[name] = table[rest]
            continue
        m = re.match(r"vision_model\.decoder\.layers\.(\d+)\.(.+)$", name)
        if m:
            p = f"{vm}blocks.{m.group(1)}."
            table = {
                "self_attention.linear_qkv.layer_norm_weight": _whole(p + "norm1.weight", vh),
                "self_attention.linear_qkv.layer_norm_bias": _whole(p + "norm1.bias", vh),
                "self_attention.linear_qkv.weight": vit_qkv(p + "attn.qkv.weight"),
                "self_attention.linear_qkv.bias": vit_qkv(p + "attn.qkv.bias"),
                "self_attention.linear_proj.weight": _split(p + "attn.proj.weight", vh, dim=1),
                "self_attention.linear_proj.bias": _whole(p + "attn.proj.bias", vh),
                "mlp.linear_fc1.layer_norm_weight": _whole(p + "norm2.weight", vh),
                "mlp.linear_fc1.layer_norm_bias": _whole(p + "norm2.bias", vh),
                "mlp.linear_fc1.weight": _split(p + "mlp.fc1.weight", vffn),
                "mlp.linear_fc1.bias": _split(p + "mlp.fc1.bias", vffn),
                "mlp.linear_fc2.weight": _split(p + "mlp.fc2.weight", vffn, dim=1),
                "mlp.linear_fc2.bias": _whole(p + "mlp.fc2.bias", vh),
            }
            if m.group(2) not in table:
                raise ValueError(f"no HF mapping for megatron parameter {name}")
            maps[name] = table[m.group(2)]
            continue
        table = {
            "language_model.embedding.word_embeddings.weight": _split(f"{lm}embeddings.weight", t.vocab_size),
            "language_model.output_layer.weight": _split("language_model.lm_head.weight", t.vocab_size),
            "language_model.decoder.final_norm.weight": _whole(f"{lm}norm_f.weight", t.hidden_size),
            "vision_model.class_token": _whole(f"{vm}patch_generator.cls_token.token", hf.num_prefix_tokens),
            "vision_model.position_embeddings": _whole(f"{vm}patch_generator.pos_embed", 1),
            "vision_model.embedder.weight": _split(f"{vm}patch_generator.embedder.weight", vh),
            "vision_projection.encoder.linear_fc1.layer_norm_weight": _whole("mlp1.0.weight", 4 * vh),
            "vision_projection.encoder.linear_fc1.weight": _split("mlp1.1.weight", hf.projector_hidden_size),
            "vision_projection.encoder.linear_fc2.weight": _split("mlp1.3.weight", hf.projector_hidden_size, dim=1),
        }
        if name not in table:
            raise ValueError(f"no HF mapping for megatron parameter {name}")
        maps[name] = table[name]
    return maps


# Checkpoint keys of components this project does not train: counted, kept aside, written back on export.
UNTOUCHED_PREFIXES = (
    "sound_encoder.",
    "sound_projection.",
    "vision_model.radio_model.input_conditioner.",  # CLIP normalisation; the processor normalises
    "vision_model.radio_model.summary_idxs",  # RADIO summary heads; unused by the VLM
    "vision_model.radio_model.model.patch_generator.video_embedder.",  # video tubelets (images only here)
)


class HFReader:
    """Lazy access to a safetensors checkpoint (single file or sharded with model.safetensors.index.json); reads
    only the requested slices (safetensors get_slice)."""

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.dir}: no model.safetensors.index.json and no *.safetensors")
            self.weight_map = {}
            for f in files:
                with safe_open(f, "pt") as h:
                    self.weight_map.update({k: f.name for k in h.keys()})
        self._open = safe_open
        self._handles: dict[str, Any] = {}

    def _handle(self, key: str):
        if key not in self.weight_map:
            raise KeyError(f"{self.dir}: checkpoint has no tensor {key!r}")
        fname = self.weight_map[key]
        if fname not in self._handles:
            self._handles[fname] = self._open(self.dir / fname, "pt")
        return self._handles[fname]

    def shape_dtype(self, key: str) -> tuple[list[int], str]:
        sl = self._handle(key).get_slice(key)
        return sl.get_shape(), sl.get_dtype()

    def read(self, key: str, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        sl = self._handle(key).get_slice(key)
        shape = sl.get_shape()
        if length is None:
            return sl[:]
        idx = [slice(None)] * len(shape)
        idx[dim] = slice(start, start + length)
        return sl[tuple(idx)]

    def full(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)


def _group(name: str | None):
    from megatron.core import parallel_state

    if name == "tp":
        return parallel_state.get_tensor_model_parallel_group()
    if name == "ep":
        return parallel_state.get_expert_model_parallel_group()
    return None


def _rank_size(group) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
    return out


def load_hf_weights(model: OmniModel, hf_dir: str | os.PathLike) -> dict:
    """Copy the HF checkpoint's tensors into `model` (this rank's TP / EP slices only, read with get_slice).

    Returns a report: {"params": n megatron tensors loaded, "hf_keys": n checkpoint keys used by the model,
    "untouched": {prefix: count} of keys kept aside (audio, input conditioner, ...)}; the untouched key names are also
    stored on `model.hf_untouched_keys` for export.
    Raises: ValueError listing checkpoint keys that are neither mapped nor a known untouched component, or a shape
    mismatch (named). KeyError for a missing checkpoint key.
    """
    reader = HFReader(hf_dir)
    maps = hf_param_map(model)
    tensors = _model_tensors(model)
    used: set[str] = set()
    for name, pm in maps.items():
        rank, size = _rank_size(_group(pm.group))
        for r in range(size):  # every rank of the group: the keys the whole model covers
            used.update(s.key for s in pm.segments(r, size))
        parts = [reader.read(s.key, pm.dim, s.start, s.length) for s in pm.segments(rank, size)]
        value = torch.cat(parts, dim=pm.dim) if len(parts) > 1 else parts[0]
        target = tensors[name]
        if value.shape != target.shape:
            raise ValueError(f"{name}: megatron shape {tuple(target.shape)} but the checkpoint gives "
                             f"{tuple(value.shape)} from {[s.key for s in pm.segments(rank, size)][:3]}")
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
    untouched = sorted(k for k in reader.weight_map if k not in used)
    unknown = [k for k in untouched if not k.startswith(UNTOUCHED_PREFIXES)]
    if unknown:
        raise ValueError(f"{hf_dir}: {len(unknown)} checkpoint keys have no place in the model and are not a known "
                         f"untrained component: {unknown[:10]}")
    counts: dict[str, int] = {}
    for k in untouched:
        prefix = next(p for p in UNTOUCHED_PREFIXES if k.startswith(p))
        counts[prefix] = counts.get(prefix, 0) + 1
    model.hf_untouched_keys = untouched
    return {"params": len(maps), "hf_keys": len(used), "untouched": counts}


def export_hf(model: OmniModel, out_dir: str | os.PathLike, src_hf_dir: str | os.PathLike) -> dict | None:
    """Write `model` as a complete HF Omni checkpoint in the source's key names, files and dtypes (collective: every
    rank calls it; global rank 0 writes).

    TP / EP shards are all-gathered over their groups and laid back into the HF tensors (the exact inverse of
    load_hf_weights); keys the model does not hold (audio, input conditioner, ...) are copied from `src_hf_dir`
    unchanged; config.json, tokenizer and processor files are copied. Returns {"keys": n, "files": n} on rank 0,
    None elsewhere. Import -> export is bit-identical when the parameters are unchanged.
    """
    import torch.distributed as dist
    from safetensors.torch import save_file

    src = HFReader(src_hf_dir)
    maps = hf_param_map(model)
    tensors = _model_tensors(model)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, pm in maps.items():
        group = _group(pm.group)
        rank, size = _rank_size(group)
        local = tensors[name].detach().contiguous()
        shards = [local]
        if size > 1:
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local, group=group)
        if not is_writer:
            continue
        for r, shard in enumerate(shards):
            off = 0
            for s in pm.segments(r, size):
                if s.key not in out:
                    shape, dtype = src.shape_dtype(s.key)
                    out[s.key] = torch.empty(shape, dtype=_SAFETENSORS_DTYPES[dtype])
                dst = out[s.key]
                n = dst.shape[pm.dim] if s.length is None else s.length
                piece = shard.narrow(pm.dim, off, n)
                target = dst.narrow(pm.dim, s.start, n)
                if piece.shape != target.shape:
                    raise ValueError(f"export {name}: piece {tuple(piece.shape)} does not fit {s.key} "
                                     f"rows {s.start}:{s.start + n} {tuple(target.shape)}")
                target.copy_(piece)
                off += n
    if not is_writer:
        dist.barrier()
        return None
    for key in getattr(model, "hf_untouched_keys", None) or [k for k in src.weight_map if k not in out]:
        out[key] = src.full(key)
    missing = [k for k in src.weight_map if k not in out]
    if missing:
        raise ValueError(f"export would drop {len(missing)} source keys: {missing[:10]}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(src_hf_dir).iterdir():  # config, tokenizer, processor, custom code
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for key, fname in src.weight_map.items():
        files.setdefault(fname, {})[key] = out[key].contiguous()
    for fname, sd in files.items():
        save_file(sd, str(out_dir / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in out.values())},
             "weight_map": dict(sorted(src.weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return {"keys": len(out), "files": len(files)}


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
                       "I32": torch.int32, "F64": torch.float64, "U8": torch.uint8, "BOOL": torch.bool}


# ======================================================================================================================

if __name__ == "__main__":
    import sys

    from config import ModelConfig, ParallelConfig
    from distributed import init_distributed

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    init_distributed()
    hf_dir = sys.argv[1] if len(sys.argv) > 1 else "assets/tiny-omni"
    model = build_model(hf_dir, ModelConfig(hf_path=hf_dir), ParallelConfig())
    print(load_hf_weights(model, hf_dir))
    ids = torch.randint(32, 200, (1, 16))
    print("logits", tuple(model({"input_ids": ids}).shape))

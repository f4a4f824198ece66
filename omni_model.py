"""Nemotron-3-Nano-Omni on megatron-core: config mapping, spec choice, the model (`OmniModel`) and `build_model`.

    distributed.init_distributed()                                     # outside torchrun: a gloo world of one
    model = build_model("assets/tiny-omni", cfg.model, cfg.parallel)   # after parallel_state is initialised
    hf_weights.load_hf_weights(model, "assets/tiny-omni")              # each rank reads only its slices
    logits = model(batch)                                              # [T_local, V/TP], one packed THD microbatch

HF import / export is hf_weights.py; the non-TE modules and specs are local_spec.py; every megatron-core workaround
(including the four this model needs on every platform, cpu_compat.MODEL_SHIMS: the Mamba scan hook - time-step
clamp and shared-prompt scan -, activation recomputation in the forward's context, the MoE routers' padding mask and
their evaluation mode on a row without real tokens) is
cpu_compat.py, installed by cpu_compat.apply() (build_model calls it). megatron-core is imported at the top: it imports
on CPU before any shim is applied (the shims patch names megatron looks up at call time).

What is built:
- `language_model`: megatron-core `HybridModel`, one layer per pattern letter (`M` Mamba-2, `*` attention without
  positional embedding, `E` MoE with sigmoid router + fp32 expert bias + shared expert, `-` dense MLP), squared-ReLU
  MLPs, RMSNorm pre-norms, final norm, untied vocab-parallel output layer. Logits stay sharded: [T_local, V/TP].
- `vision_model`: megatron-core `RADIOViTModel` (C-RADIO: bias-free 16-px patch embedder, 10 prefix tokens, CPE
  position embeddings interpolated in eval mode as transformers does, pre-LN blocks, no final norm). GELU is the erf
  form, as the checkpoint's config (`hidden_act="gelu"`) and transformers' `RadioModel`; Megatron-Bridge uses the
  tanh approximation instead. Images are packed (THD) and each attends only to itself.
- `vision_projection`: megatron-core `MultimodalProjector` (RMSNorm -> Linear -> squared ReLU -> Linear).
- Two specs chosen at build time: the Transformer Engine spec (megatron's `hybrid_stack_spec`, TE ViT layer spec)
  when transformer_engine imports and CUDA is used, else local_spec.py's (megatron-core's non-TE modules plus
  `LocalNormColumnParallelLinear`, with TE's parameter names so a checkpoint does not depend on the spec, and
  `ThdDotProductAttention`, torch SDPA per packed sequence or torch's varlen FlashAttention, and the routed experts
  as megatron-core's `SequentialMLP` or `GroupedExperts`, chosen by cpu_compat.select_kernels). Both use
  `OmniMambaMixer` for the `M` layers.
- Mamba runs megatron-core's own `MambaMixer`: with mamba-ssm's fused kernels when mamba-ssm and causal-conv1d import
  and CUDA is used, else through the project's pure-torch stand-in (mamba_torch.py, on the model's device, installed by
  cpu_compat.apply(); the choice is cpu_compat.select_kernels()).

Forward (vision once per pair): every image of the microbatch is encoded once; the `<image>` positions of each sequence
take, in order, the features of that sequence's media slot (`media_index`), so the chosen and rejected rows of a pair
share one encoding. Then: embed the full packed sequence, replace `<image>` positions, take this rank's context-parallel
slice (pack.cp_partition_index layout), scatter for sequence parallelism, run the hybrid stack.
Shared-prompt batches (shared_prompt.pack, `packing.shared_prompt`; no CP): the sequences are the pair spans
[prompt | chosen | rejected] (one media slot each); the forward sets cpu_compat.SHARED_PROMPT_SEGMENTS to the batch's
segment_cu_seqlens_padded around the language model, so the core attention (local spec: ThdDotProductAttention ->
local_spec.shared_prompt_attention; TE spec: `shared_prompt_te_attention`, one TE varlen call, not yet run on a GPU)
and the Mamba layers (mamba_torch.mamba_split_conv1d_scan_shared_prompt, through cpu_compat's Mamba hook) keep each
rejected response off the chosen one; the routers' padding mask is per span.

Run `python omni_model.py assets/tiny-omni` for a one-rank smoke run that prints the logits' shape.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.activations import squared_relu
from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear, TERowParallelLinear
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.radio import RADIOViTModel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.tensor_parallel import RowParallelLinear, scatter_to_sequence_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from torch import nn

import cpu_compat
import mamba_triton
from local_spec import LocalNormColumnParallelLinear, local_hybrid_stack_spec, local_vit_layer_spec
from pack import (
    cp_partition_index,
    host_view,
    routing_padding_mask,
    thd_packed_seq_params,
    to_device,
    token_sequence_ids,
)

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


def _common_config_kwargs(model_cfg, parallel_cfg) -> dict:
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
        deterministic_mode=model_cfg.deterministic_mode,  # e.g. embedding lookups by indexing (deterministic backward)
    )
    if model_cfg.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif model_cfg.recompute == "selective":
        kw.update(recompute_granularity="selective")
    return kw


def language_config(hf: OmniHFConfig, model_cfg, parallel_cfg, use_te: bool):
    """megatron-core TransformerConfig of the hybrid language model (every dimension from the checkpoint); `use_te`
    (the TE spec) turns on megatron's grouped-GEMM experts."""
    t = hf.text
    kw = _common_config_kwargs(model_cfg, parallel_cfg)
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


def vision_config(hf: OmniHFConfig, model_cfg, parallel_cfg):
    """TransformerConfig of the RADIO ViT: replicated over CP, never sequence-parallel (images are short, packed)."""
    v = hf.vision
    act = {"gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}.get(v.hidden_act)
    if act is None:
        raise ValueError(f"RADIO hidden_act {v.hidden_act!r} is not supported (gelu, gelu_pytorch_tanh)")
    kw = _common_config_kwargs(model_cfg, parallel_cfg)
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


def projector_config(hf: OmniHFConfig, model_cfg, parallel_cfg):
    """TransformerConfig of the mlp1 projector (hidden_size = the language model's; RMSNorm eps 1e-5 as
    transformers' NemotronH_Omni_Reasoning_V3MultiModalProjector)."""
    kw = _common_config_kwargs(model_cfg, parallel_cfg)
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
# Layer specs


class OmniMambaMixer(MambaMixer):
    """megatron-core MambaMixer plus the reference's time-step clamp: transformers clamps softplus(dt + dt_bias) to
    >= time_step_min (NemotronHMamba2Mixer.time_step_limit), megatron-core does not. The mixer sets
    `cpu_compat.MAMBA_DT_LIMIT` around its training scan, which cpu_compat's dt-limit shim forwards to the fused scan
    as `dt_limit`. `dt_clamp_min=None` keeps megatron-core's (0, inf)."""

    def __init__(self, *args, dt_clamp_min: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.dt_limit = None if dt_clamp_min is None else (float(dt_clamp_min), float("inf"))

    def _ssm_training(self, zxBCdt, packed_seq_params=None):
        token = cpu_compat.MAMBA_DT_LIMIT.set(self.dt_limit)
        try:
            return super()._ssm_training(zxBCdt, packed_seq_params)
        finally:
            cpu_compat.MAMBA_DT_LIMIT.reset(token)


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

def te_hybrid_stack_spec(hf: OmniHFConfig, model_cfg):
    """megatron-core's TE `hybrid_stack_spec` with the Mamba mixer swapped for OmniMambaMixer (checkpoint's conv
    kernel, chunk size and dt clamp) and the language model's core attention for `shared_prompt_te_attention` of
    megatron's TEDotProductAttention (the same module, plus the shared-prompt layout)."""
    spec = copy.deepcopy(hybrid_stack_spec)
    mixer = spec.submodules.mamba_layer.submodules.mixer
    mixer.module = OmniMambaMixer
    mixer.params = {**(mixer.params or {}), **_mamba_params(hf, model_cfg)}
    attention = spec.submodules.attention_layer.submodules.self_attention.submodules
    attention.core_attention = shared_prompt_te_attention(attention.core_attention)
    return spec


def shared_prompt_te_attention(base: type) -> type:
    """A subclass of `base` (megatron-core's TEDotProductAttention, itself a transformer_engine.pytorch
    DotProductAttention) that also runs the shared-prompt layout (shared_prompt.pack; `packing.shared_prompt`).

    While cpu_compat.SHARED_PROMPT_SEGMENTS is set (OmniModel.forward, language model only) a THD forward becomes ONE
    variable-length Transformer Engine call of local_spec.shared_prompt_varlen_attention: queries in row order, the
    keys/values gathered into [prompt | chosen], [prompt | rejected] per pair, `cu_seqlens_q` / `cu_seqlens_kv` (and
    the same as `*_padded`: no tokens between sequences), `max_seqlen_q` / `max_seqlen_kv`, qkv_format "thd" and
    attn_mask_type "padding_causal_bottom_right". TE's own forward is called directly (the class after `base` in the
    MRO): megatron's forward maps AttnMaskType, which has no padding_causal_bottom_right, and the packed_seq_params of
    the pair spans. Any other forward is `base`'s unchanged.

    The call runs with TE's attention_type "cross" (on the module and its flash / fused / unfused backends, restored
    afterwards), as TE itself does for its KV-cache path, where queries are also fewer than keys under a bottom-right
    causal mask: with "self", TE's unfused backend (the one it picks for float32, or when the other two are disabled)
    builds the key padding mask from the query lengths (transformer_engine/pytorch/attention/dot_product_attention:
    utils.get_padding_mask / get_full_mask; read in TE 2.20's sources), which is wrong when the key sequences are
    longer. The flash and fused backends and the backend choice read attention_type only for BSHD/SBHD inputs there.

    Status: the argument set is checked on CPU against a stand-in of TE (tests/test_shared_prompt_te.py) and the
    layout against local_spec.shared_prompt_attention; the call itself has NOT run on a GPU yet
    (tests/test_gpu.py::test_te_shared_prompt_attention_equals_local is its check, float32 included).

    Raises (forward, shared-prompt layout): ValueError for an attention bias, a non-causal mask, or context parallelism
    (refused at start by pack.validate_packing_config).
    """
    from local_spec import shared_prompt_varlen_attention

    class SharedPromptTEDotProductAttention(base):
        def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            """As `base.forward`; with the shared-prompt layout: query [t, heads, d], key/value [t, groups, d]
            -> [t, heads * d] in row order."""
            segments = cpu_compat.SHARED_PROMPT_SEGMENTS.get()
            if segments is None or packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                return super().forward(query, key, value, attention_mask, attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
            if attention_bias is not None or attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal) \
                    or self.config.context_parallel_size > 1:
                raise ValueError("the shared-prompt layout needs causal attention without an attention bias or "
                                 "context parallelism")
            te_forward = super(base, self).forward  # transformer_engine.pytorch.DotProductAttention.forward

            def attend(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv):
                return te_forward(q, k, v, None, qkv_format="thd", cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q,
                                  cu_seqlens_kv_padded=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                                  max_seqlen_kv=max_seqlen_kv, attn_mask_type="padding_causal_bottom_right")

            # queries and keys of different lengths: TE's cross-attention masks (see the docstring)
            modules = [self] + [m for m in (getattr(self, n, None) for n in
                                            ("flash_attention", "fused_attention", "unfused_attention"))
                                if m is not None]
            saved = [m.attention_type for m in modules]
            for m in modules:
                m.attention_type = "cross"
            try:
                return shared_prompt_varlen_attention(query, key, value, segments, attend)
            finally:
                for m, kind in zip(modules, saved, strict=True):
                    m.attention_type = kind

    return SharedPromptTEDotProductAttention



def have_transformer_engine() -> bool:
    """True when the TE specs are used: transformer_engine's torch extension imports and CUDA is used
    (cpu_compat.select_kernels)."""
    return cpu_compat.select_kernels().spec == "te"


# ======================================================================================================================
# The model


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
        segment_cu_seqlens_padded: int32 [3P+1] (optional): the shared-prompt layout (pack.PackedBatch); then the
            S = P sequences above are the pair spans and sample_mask is per response [2P].
    T must be divisible by 2*CP (and by TP under sequence parallelism). Returns logits [T/CP, V/TP] in the parameters'
    dtype (fp32 or bf16; sequence parallelism gathers the sequence back before the output layer), the rows in this CP
    rank's load-balanced order (see cp_partition_index): the logit at row i predicts the token after the
    position cp_partition_index(...)[i].
    Raises ValueError: `<image>` token count differs from the feature count (both counts in the message), an odd
    image grid, or pixel rows that do not match the grids; a shared-prompt batch under CP.
    """

    def __init__(self, hf: OmniHFConfig, model_cfg, parallel_cfg, use_te: bool, kernels=None):
        super().__init__()
        experts, attention = (kernels.experts, kernels.attention) if kernels is not None and not use_te else \
            ("sequential", "sdpa")
        self.hf = hf
        self.use_te = use_te
        self.mamba_kernels = kernels.mamba if kernels is not None else "torch"
        self.image_token_id = hf.image_token_id
        self.patch_size = hf.vision.patch_size
        self.num_prefix_tokens = hf.num_prefix_tokens
        tp = parallel_state.get_tensor_model_parallel_world_size()
        vocab = hf.text.vocab_size
        if vocab % tp:
            raise ValueError(f"vocab_size {vocab} is not divisible by TP = {tp} (the output stays vocab-parallel)")
        pg = ProcessGroupCollection.use_mpu_process_groups()
        self.lm_config = language_config(hf, model_cfg, parallel_cfg, use_te)
        if use_te:
            spec = te_hybrid_stack_spec(hf, model_cfg)
        else:
            n_experts = max(1, getattr(hf.text, "n_routed_experts", 1) or 1)
            spec = local_hybrid_stack_spec(OmniMambaMixer, _mamba_params(hf, model_cfg), n_experts, experts=experts,
                                           attention=attention)
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
        self.vit_config = vision_config(hf, model_cfg, parallel_cfg)
        if use_te:
            vit_spec = get_vit_layer_with_transformer_engine_spec()
            fc1, fc2 = TELayerNormColumnParallelLinear, TERowParallelLinear
        else:
            vit_spec, fc1, fc2 = local_vit_layer_spec(attention), LocalNormColumnParallelLinear, RowParallelLinear
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
        self.proj_config = projector_config(hf, model_cfg, parallel_cfg)
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
            normalised by the processor); image_grid_hw int64 [N_images, 2] patch grid (gh, gw), both even (read on
            the host: pass the batch's CPU copy).
        Returns: list of [gh*gw/4, H_lm] features, one per image, in the language model's dtype.
        Raises: ValueError on odd grids or a patch count that does not match the grids.
        """
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
        lens = [h * w for h, w in grids]
        cu_h = [0, *itertools.accumulate(lens)]
        cu = to_device(torch.tensor(cu_h, dtype=torch.int32, device="cpu"), device)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                              max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        # the offsets the ViT's attention sees, for local_spec's varlen attention to read on the host: RADIO puts
        # num_prefix_tokens class / register tokens before each image's patches (it shifts the device offsets itself)
        psp.cu_seqlens_padded_host = tuple(itertools.accumulate([0] + [n + self.num_prefix_tokens for n in lens]))
        sizes = to_device(torch.tensor(grids, device="cpu") * self.patch_size, device)
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
        """(positions [N] int64 on the host, rows [N, H]) of every `<image>` token, rows taken per sequence from its
        media slot. batch, ids [T], cu_pad [S+1]: the host copies (every read here is of host numbers)."""
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
        """batch: a pack.PackedBatch on the step's device (or a dict of its fields); the numbers the forward needs on
        the host (offsets, image grids and positions, whether any token is real) are read from its CPU copy
        (pack.host_view), so nothing is read back from the GPU. Returns logits [T_local, V/TP]."""
        host = host_view(batch)
        input_ids = _get(batch, "input_ids")
        ids, ids_h = input_ids.reshape(-1), _get(host, "input_ids").reshape(-1)
        T = ids.numel()
        device = ids.device
        cu_pad, cu = _get(batch, "cu_seqlens_padded"), _get(batch, "cu_seqlens")
        cu_pad_h, cu_h = _get(host, "cu_seqlens_padded"), _get(host, "cu_seqlens")
        if cu_pad is None:
            cu_pad_h = cu_pad = torch.tensor([0, T], dtype=torch.int32, device="cpu")
        cu, cu_h = (cu_pad, cu_pad_h) if cu is None else (cu, cu_h)
        cu_pad, cu = to_device(cu_pad, device), to_device(cu, device)
        if int(cu_pad_h[-1]) != T:
            raise ValueError(f"cu_seqlens_padded ends at {int(cu_pad_h[-1])} but input_ids has {T} tokens")

        emb = self.language_model.embedding(input_ids=ids[None], position_ids=None)  # [T, 1, H], TP-reduced
        pixel_values, grid = _get(batch, "pixel_values"), _get(host, "image_grid_hw")
        has_images = grid is not None and grid.numel() > 0
        feats = self.encode_images(pixel_values.to(device), grid) if has_images else []
        n_tokens = int((ids_h == self.image_token_id).sum())
        if n_tokens or feats:
            positions, rows = self._image_rows(host, ids_h, cu_pad_h, feats)
            if rows is not None:
                positions = to_device(positions, device)
                emb = emb.index_put((positions, torch.zeros_like(positions)), rows.to(emb.dtype)[:, None][:, 0])

        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:
            index = cp_partition_index(cu_pad, cp, parallel_state.get_context_parallel_rank()).to(device)
            emb = emb.index_select(0, index)
        if self.lm_config.sequence_parallel:
            emb = scatter_to_sequence_parallel_region(emb, group=self.pg.tp)
        max_seqlen = _get(batch, "max_seqlen") or int((cu_pad_h[1:] - cu_pad_h[:-1]).max())
        psp = thd_packed_seq_params(cu, cu_pad, max_seqlen, host=(cu_h.tolist(), cu_pad_h.tolist()))
        # Padding and zero-weight (dummy-bin) tokens take no part in the routers' statistics: megatron-core's
        # padding_mask ([1, tokens of this rank], True = padding) reaches every MoE router (expert-bias counts, aux
        # loss, z-loss) on the TE and local specs. It is sliced like the embeddings: CP layout, then this TP rank's
        # contiguous SP chunk (HybridModel, unlike GPTModel, does not scatter it itself).
        segments = _get(batch, "segment_cu_seqlens_padded")  # the shared-prompt layout (shared_prompt.pack)
        sample_mask = _get(batch, "sample_mask")
        if segments is not None:
            if cp > 1:
                raise ValueError("a shared-prompt batch (packing.shared_prompt) needs context parallelism 1 (refused "
                                 "at start by pack.validate_packing_config)")
            segments = segments.to(device)
            if sample_mask is not None:  # per response [2P] -> per pair span [P] (both rows of a pair share it)
                sample_mask = sample_mask.view(-1, 2).amax(dim=1)
        pad = routing_padding_mask(cu, cu_pad, T, sample_mask)
        sample_mask_h = _get(host, "sample_mask")
        if segments is not None and sample_mask_h is not None:
            sample_mask_h = sample_mask_h.view(-1, 2).amax(dim=1)
        no_real_token = bool(routing_padding_mask(cu_h, cu_pad_h, T, sample_mask_h).all())  # on the host
        if cp > 1:
            pad = pad[index]
        if self.lm_config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            pad = pad.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
        token = cpu_compat.SHARED_PROMPT_SEGMENTS.set(segments)  # the Mamba and attention layers read it
        conv = mamba_triton.CONV_OFFSETS.set(self._conv_offsets(psp, cu_pad, device))
        try:
            with cpu_compat.routers_without_statistics(no_real_token and self.training):
                logits = self.language_model(input_ids=None, position_ids=None, attention_mask=None,
                                             decoder_input=emb, packed_seq_params=psp, padding_mask=pad[None])
        finally:
            mamba_triton.CONV_OFFSETS.reset(conv)
            cpu_compat.SHARED_PROMPT_SEGMENTS.reset(token)
        return logits[0]

    def _conv_offsets(self, psp, cu_pad: torch.Tensor, device):
        """mamba_triton.CONV_OFFSETS of this row for the `mamba triton` set (its conv then reads no offsets back
        from the GPU): (psp.seq_idx, cu_seqlens_padded, fla's chunk indices); None with the other kernel sets."""
        if self.mamba_kernels != "triton":
            return None
        chunks = mamba_triton.conv_chunk_indices(list(psp.cu_seqlens_padded_host))
        return psp.seq_idx, cu_pad, to_device(chunks, device)


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


def build_model(hf_dir: str | os.PathLike, model_cfg, parallel_cfg, use_te: bool | None = None,
                kernels: cpu_compat.Kernels | None = None) -> OmniModel:
    """Build the Omni model on this rank (megatron-core parallel_state must be initialised with the sizes in
    `parallel_cfg`). Weights are megatron-core's initialisation until `load_hf_weights`.

    Args: hf_dir: checkpoint directory (config.json). model_cfg: config.ModelConfig. parallel_cfg:
        config.ParallelConfig. use_te: force the TE (True) or local (False) spec; default: TE when it imports with CUDA.
        kernels: the local spec's experts and attention (cpu_compat.Kernels); default
        cpu_compat.select_kernels(te=use_te), the start-up line's choice.
    Raises: ValueError for unsupported checkpoint settings or sizes that do not divide (named in the message).
    """
    cpu_compat.apply()
    if parallel_cfg.context_parallel_size > 1:
        cpu_compat.install_mamba_cp_thd_indices(cp_partition_index)
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
    model = OmniModel(hf, model_cfg, parallel_cfg, use_te, cpu_compat.select_kernels(te=use_te) if kernels is None
                      else kernels)
    cast_params_to(model, _dtype(model_cfg.params_dtype))
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


# ======================================================================================================================
# Smoke run


def smoke_cli(prog: str, description: str) -> str:
    """The command line of a one-rank smoke run (`python omni_model.py`, `python hf_weights.py`): [HF_DIR] (default
    assets/tiny-omni). Returns it; argparse's usage error (exit 2) for a directory without config.json, before any
    process group or model exists."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("hf_dir", nargs="?", default="assets/tiny-omni",
                    help="the HF checkpoint directory (default: %(default)s)")  # fmt: skip
    hf_dir = ap.parse_args().hf_dir
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        ap.error(f"{hf_dir}: no config.json (not an HF checkpoint directory)")
    return hf_dir


# ======================================================================================================================

if __name__ == "__main__":
    hf_dir = smoke_cli(
        "python omni_model.py",
        "Smoke run: build the Omni model of an HF checkpoint directory on one rank (on the GPU when there is one) and "
        "print the logits' shape for 16 random tokens (random weights: see hf_weights.py for loading).",
    )
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import config as config_mod
    from distributed import init_distributed, local_device

    init_distributed(device=local_device())  # build_model puts the model on the GPU when there is one
    model = build_model(hf_dir, config_mod.ModelConfig(hf_path=hf_dir), config_mod.ParallelConfig())
    ids = torch.randint(32, 200, (1, 16), device=next(model.parameters()).device)
    print("logits", tuple(model({"input_ids": ids}).shape))

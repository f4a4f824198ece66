"""Nemotron-3-Nano-Omni on megatron-core: the config mapping, the spec choice, `OmniModel` and `build_model`.

    distributed.init_distributed()                                     # outside torchrun: a gloo world of one
    model = build_model("assets/tiny-omni", cfg.model, cfg.parallel)   # after parallel_state is initialised
    hf_weights.load_hf_weights(model, "assets/tiny-omni")              # each rank reads only its slices
    logits = model(batch)                                              # [T_local, V/TP], one packed THD microbatch

`OmniModel` = RADIO ViT (`vision_model`, images and video tubelets) + projector (`vision_projection`) + Parakeet
`sound_encoder` + its `sound_projection` + megatron-core `HybridModel` (`language_model`: Mamba-2 `M`, attention `*`,
MoE `E`, MLP `-`). The forward encodes each image, video and clip once, puts the features at the `<image>` /
`<so_embedding>` tokens of its media slot's sequences, takes this rank's CP slice, scatters for SP, runs the hybrid
stack (vocab-parallel logits). Spec: TE's when it imports with CUDA, else local_spec.py's (kernel_selection)."""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
from dataclasses import dataclass
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
from megatron.core.transformer.mlp import MLPSubmodules
from torch import nn

from backend import kernel_selection, mamba_triton, megatron_patches, shared_prompt
from backend.local_spec import LocalNormColumnParallelLinear, local_hybrid_stack_spec, local_vit_layer_spec
from pack import (
    cp_partition_index,
    host_view,
    routing_padding_mask,
    thd_packed_seq_params,
    to_device,
    token_sequence_ids,
    video_sequence_tokens,
)

# ======================================================================================================================
# Config: the checkpoint's config.json -> typed facts -> megatron-core TransformerConfigs

_BLOCK_TO_SYMBOL = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "moe": "E",
                    "mlp": "-"}


@dataclass
class OmniHFConfig:
    """The dimensions this module needs, read from an Omni config.json (hub or transformers layout)."""

    text: Any  # transformers NemotronHConfig
    vision: Any  # transformers RadioConfig
    pattern: str  # hybrid layer pattern, one letter per layer (M * E -)
    vision_hidden_size: int
    projector_hidden_size: int
    image_token_id: int
    num_prefix_tokens: int  # class + register tokens of RADIO, dropped after the ViT
    video_temporal_patch_size: int = 1  # frames per tubelet of the ViT's video embedder (1: no video embedder)
    video_pruning_rate: float = 0.0  # EVS: the share of video tokens transformers drops after the ViT
    sound: Any = None  # transformers ParakeetEncoderConfig of the sound encoder (hub `sound_config`); None: no audio
    sound_token_id: int | None = None  # `<so_embedding>` (hub `sound_context_token_id`)


MODEL_TYPES = ("NemotronH_Nano_Omni_Reasoning_V3", "nemotron_h_omni")  # config.json's model_type: hub, transformers


def read_hf_config(hf_dir: str | os.PathLike) -> OmniHFConfig:
    """Parse `hf_dir/config.json` with transformers' config classes (hub legacy names or `text_config`).
    Raises ValueError naming a setting this implementation does not support (the checks of the file itself:
    `preflight.read_model_config`)."""
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
        (0 <= (cfg.video_pruning_rate or 0) <= 1, f"video_pruning_rate {cfg.video_pruning_rate}: EVS drops this share "
                                                  "of a video's tokens, in [0, 1]"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(f"{path}: {msg}")
    sound = cfg.audio_config
    if sound is not None and not (sound.hidden_act == "silu" and sound.subsampling_conv_stride == 2):
        raise ValueError(f"{path}: sound_config: only silu and stride-2 conv subsampling (the processor's token count)")
    return OmniHFConfig(text=text, vision=vision, pattern=pattern, vision_hidden_size=int(cfg.vision_hidden_size),
                        projector_hidden_size=int(cfg.projector_hidden_size), image_token_id=int(cfg.image_token_id),
                        num_prefix_tokens=int(vision.num_cls_tokens + vision.num_registers),
                        video_temporal_patch_size=int(getattr(vision, "video_temporal_patch_size", None) or 1),
                        video_pruning_rate=float(cfg.video_pruning_rate or 0.0), sound=sound,
                        sound_token_id=None if sound is None else int(cfg.audio_token_id))


def torch_dtype(name: str) -> torch.dtype:
    """model.params_dtype's torch dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _common_config_kwargs(model_cfg, parallel_cfg) -> dict:
    """TransformerConfig settings shared by the language model, the ViT and the projector."""
    dtype = torch_dtype(model_cfg.params_dtype)
    kw = dict(
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, pipeline_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, gated_linear_unit=False, apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True, use_cpu_initialization=not torch.cuda.is_available(),
        # fusions that need TE/Apex/CUDA; the TE spec fuses on its own
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        deterministic_mode=model_cfg.deterministic_mode,  # e.g. embedding lookups by indexing (deterministic backward)
    )
    if model_cfg.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif model_cfg.recompute == "selective":
        kw.update(recompute_granularity="selective")
    return kw


def language_config(hf: OmniHFConfig, model_cfg, parallel_cfg, use_te: bool):
    """TransformerConfig of the hybrid language model; `use_te`: TE's modules (TEGroupedMLP for the experts)."""
    t = hf.text
    kw = _common_config_kwargs(model_cfg, parallel_cfg)
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    kw.update(
        num_layers=len(hf.pattern), hidden_size=t.hidden_size, ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads, num_query_groups=t.num_key_value_heads, kv_channels=head_dim,
        normalization="RMSNorm", layernorm_epsilon=t.layer_norm_epsilon, activation_func=squared_relu,
        mamba_state_dim=t.ssm_state_size, mamba_head_dim=t.mamba_head_dim, mamba_num_groups=t.n_groups,
        mamba_num_heads=t.mamba_num_heads, context_parallel_size=parallel_cfg.context_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        fp32_residual_connection=bool(getattr(t, "residual_in_fp32", False)),
    )
    if "E" in hf.pattern:
        kw.update(
            num_moe_experts=t.n_routed_experts, moe_router_topk=t.num_experts_per_tok,
            moe_ffn_hidden_size=t.moe_intermediate_size,
            # the total width of the one shared MLP (transformers and megatron alike)
            moe_shared_expert_intermediate_size=t.moe_shared_expert_intermediate_size or None,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            # aux-loss-free balancing: the expert bias moves ±rate per step; a frozen language model keeps it
            moe_router_bias_update_rate=0.0 if model_cfg.freeze_language_model else
            model_cfg.moe_router_bias_update_rate,
            moe_router_topk_scaling_factor=t.routed_scaling_factor, moe_router_dtype="fp32",
            moe_router_num_groups=t.n_group if t.n_group > 1 else None,
            moe_router_group_topk=t.topk_group if t.n_group > 1 else None,
            moe_grouped_gemm=use_te, moe_permute_fusion=False,
            moe_token_dispatcher_type=model_cfg.moe_token_dispatcher_type,
            moe_router_load_balancing_type=model_cfg.moe_router_load_balancing_type,
            moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
            expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel_cfg.expert_tensor_parallel_size,
        )
    return TransformerConfig(**kw)


def vision_config(hf: OmniHFConfig, model_cfg, parallel_cfg):
    """TransformerConfig of the RADIO ViT (replicated over CP, no SP)."""
    v = hf.vision
    act = {"gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}.get(v.hidden_act)
    if act is None:
        raise ValueError(f"RADIO hidden_act {v.hidden_act!r} is not supported (gelu, gelu_pytorch_tanh)")
    kw = _common_config_kwargs(model_cfg, parallel_cfg)
    kw.update(
        num_layers=v.num_hidden_layers, hidden_size=v.hidden_size, ffn_hidden_size=int(v.hidden_size * v.mlp_ratio),
        num_attention_heads=v.num_attention_heads, num_query_groups=v.num_attention_heads,
        kv_channels=v.hidden_size // v.num_attention_heads, add_bias_linear=True, add_qkv_bias=bool(v.qkv_bias),
        normalization="LayerNorm", layernorm_epsilon=v.layer_norm_eps, activation_func=act,
        context_parallel_size=1, sequence_parallel=False,
    )
    return TransformerConfig(**kw)


def projector_config(hf: OmniHFConfig, model_cfg, parallel_cfg, ffn_hidden_size: int | None = None):
    """TransformerConfig of the mlp1 projector (RMSNorm eps 1e-5, as transformers'); `ffn_hidden_size`: the sound
    projection's (same layout, `sound_config.projection_hidden_size`)."""
    kw = _common_config_kwargs(model_cfg, parallel_cfg)
    kw.update(
        num_layers=1, hidden_size=hf.text.hidden_size, ffn_hidden_size=ffn_hidden_size or hf.projector_hidden_size,
        num_attention_heads=hf.text.num_attention_heads, normalization="RMSNorm", layernorm_epsilon=1e-5,
        activation_func=squared_relu, context_parallel_size=1, sequence_parallel=False,
    )
    return TransformerConfig(**kw)


# ======================================================================================================================
# Layer specs


class OmniMambaMixer(MambaMixer):
    """MambaMixer with transformers' time-step clamp softplus(dt + dt_bias) >= time_step_min
    (NemotronHMamba2Mixer.time_step_limit), passed to the scan through megatron_patches.MAMBA_DT_LIMIT."""

    def __init__(self, *args, dt_clamp_min: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.dt_limit = None if dt_clamp_min is None else (float(dt_clamp_min), float("inf"))

    def _ssm_training(self, zxBCdt, packed_seq_params=None):
        token = megatron_patches.MAMBA_DT_LIMIT.set(self.dt_limit)
        try:
            return super()._ssm_training(zxBCdt, packed_seq_params)
        finally:
            megatron_patches.MAMBA_DT_LIMIT.reset(token)


def _mamba_params(hf: OmniHFConfig, model_cfg) -> dict:
    t = hf.text
    return dict(d_conv=t.conv_kernel, chunk_size=t.chunk_size, dt_min=t.time_step_min, dt_max=t.time_step_max,
                dt_init_floor=t.time_step_floor, conv_bias=True,
                dt_clamp_min=t.time_step_min if model_cfg.mamba_dt_clamp else None)


def te_hybrid_stack_spec(hf: OmniHFConfig, model_cfg):
    """megatron-core's TE `hybrid_stack_spec` with OmniMambaMixer and `shared_prompt.te_attention`."""
    spec = copy.deepcopy(hybrid_stack_spec)
    mixer = spec.submodules.mamba_layer.submodules.mixer
    mixer.module = OmniMambaMixer
    mixer.params = {**(mixer.params or {}), **_mamba_params(hf, model_cfg)}
    attention = spec.submodules.attention_layer.submodules.self_attention.submodules
    attention.core_attention = shared_prompt.te_attention(attention.core_attention)
    return spec


def uses_te_spec() -> bool:
    """True when the TE spec is used (kernel_selection.select_kernels)."""
    return kernel_selection.select_kernels().spec == "te"


# ======================================================================================================================
# The model


class OmniRADIOViT(RADIOViTModel):
    """megatron-core's RADIOViTModel whose tubelet grouping keeps this module's packed-attention conventions: the
    grouped items' host offsets (class tokens included) for local_spec's varlen attention and int max lengths."""

    host_grids: list = []  # (gh, gw) patches of each frame, in order: set by the caller beside the device sizes

    def _apply_temporal_grouping(self, x, imgs_sizes, num_frames, *args, **kwargs):
        x, sizes, frames, psp, is_image = super()._apply_temporal_grouping(x, imgs_sizes, num_frames, *args, **kwargs)
        lens, i = [], 0  # each image one item, each video ceil(frames / T) tubelets of its frame size
        for nf in num_frames:
            gh, gw = self.host_grids[i]
            lens += [gh * gw] * (1 if nf == 1 else math.ceil(nf / self.temporal_patch_dim))
            i += nf
        psp.max_seqlen_q = psp.max_seqlen_kv = max(lens)
        psp.cu_seqlens_padded_host = tuple(itertools.accumulate([0] + [n + self.class_token_len for n in lens]))
        return x, sizes, frames, psp, is_image


def _get(batch, name: str, default=None):
    if isinstance(batch, dict):
        return batch.get(name, default)
    return getattr(batch, name, default)


def evs_keep(feats: torch.Tensor, tubelets: int, pruning_rate: float) -> torch.Tensor:
    """EVS (Efficient Video Sampling) of one video: the indices int64 [R] (ascending; R = pack.video_sequence_tokens) of
    its projected features feats [T·n, H] (tubelet-major, n per tubelet) that stay. transformers' compute_retention_mask
    on the real grid (thw = (T, n); it assumes h = w = sqrt(n)): the first tubelet's tokens score 255, token i of
    tubelet t > 0 scores 1 - cos(feats[t, i], feats[t - 1, i]); the R highest stay, a tie to the earlier token."""
    n = feats.shape[0] // tubelets
    x = feats.detach().reshape(tubelets, n, -1)
    score = torch.cat([torch.full_like(x[:1, :, 0], 255), 1 - F.cosine_similarity(x[1:], x[:-1], dim=-1)])
    order = torch.argsort(score.flatten(), descending=True, stable=True)
    return order[:video_sequence_tokens(tubelets, n, pruning_rate)].sort().values


class SoundEncoder(nn.Module):
    """transformers' `ParakeetEncoder` (hub `sound_encoder.encoder.*`), replicated on every rank, always in eval mode:
    its BatchNorm uses the checkpoint's running statistics (a batch's statistics would make a row's logits depend on
    the other clips of its microbatch and move the statistics every forward); dropout and layerdrop are off."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.parakeet.modeling_parakeet import ParakeetEncoder

        config = copy.deepcopy(config)
        for name in ("dropout", "dropout_positions", "layerdrop", "activation_dropout", "attention_dropout"):
            setattr(config, name, 0.0)
        self.encoder = ParakeetEncoder(config)
        self.encoder.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        self.encoder.eval()
        return self

    def forward(self, features: torch.Tensor, valid_frames: int) -> torch.Tensor:
        """features float [F, n_mels] of one clip (the processor's `input_features`), its first `valid_frames` real
        (the processor's `input_features_mask`) -> [ceil-subsampled F, hidden] (every output frame is kept, as
        transformers' get_audio_features)."""
        mask = (torch.arange(features.shape[0], device=features.device) < valid_frames)[None]
        return self.encoder(input_features=features[None], attention_mask=mask).last_hidden_state[0]


class OmniModel(nn.Module):
    """Vision tower + projector + hybrid language model (+ sound encoder + projection when the checkpoint has a
    `sound_config`); `forward(batch) -> logits [T/CP, V/TP]`.

    `batch` is a pack.PackedBatch (or a dict of its fields): input_ids int64 [1, T] (the full packed row on every CP
    rank); optional cu_seqlens_padded / cu_seqlens int32 [S+1], max_seqlen, pixel_values float [N_patches, 3·P·P] with
    image_grid_hw int64 [N_images, 2], pixel_values_videos float [N_video_patches, 3·P·P] with video_grid_thw int64
    [N_videos, 3] (encode_media), media_index int64 [S] with media_image_offsets / media_video_offsets int64 [M+1],
    sample_mask [S]
    ([2P] per response in the shared format; weight-0 sequences leave the routers' statistics),
    span_cu_seqlens_padded int32 [3P+1] (shared prompt); audio: audio_features float [N_frames, n_mels] with
    audio_lens int64 [N_clips, 2] (mel frames, valid frames) and media_audio_offsets int64 [M+1].
    T divides by 2·CP (and TP under SP). The logits' rows are in this CP rank's order (pack.cp_partition_index).
    EVS (config.json's video_pruning_rate > 0): a video's sequences hold the `<image>` tokens transformers keeps
    (pack.video_sequence_tokens), laid out before the CP slice as its pruning leaves them (`_evs_layout`).
    Raises ValueError when the `<image>` tokens and the image features do not match."""

    def __init__(self, hf: OmniHFConfig, model_cfg, parallel_cfg, use_te: bool, kernels=None):
        super().__init__()
        experts, attention = (kernels.experts, kernels.attention) if kernels is not None and not use_te else \
            ("grouped-loop", "sdpa")
        self.hf = hf
        self.use_te = use_te
        self.mamba_kernels = kernels.mamba if kernels is not None else "torch"
        self.image_token_id = hf.image_token_id
        self.patch_size = hf.vision.patch_size
        self.num_prefix_tokens = hf.num_prefix_tokens
        vocab = hf.text.vocab_size
        assert vocab % parallel_state.get_tensor_model_parallel_world_size() == 0  # preflight.check_model_config
        pg = ProcessGroupCollection.use_mpu_process_groups()
        self.lm_config = language_config(hf, model_cfg, parallel_cfg, use_te)
        if use_te:
            spec = te_hybrid_stack_spec(hf, model_cfg)
        else:
            n_experts = max(1, getattr(hf.text, "n_routed_experts", 1) or 1)
            spec = local_hybrid_stack_spec(OmniMambaMixer, _mamba_params(hf, model_cfg), n_experts, experts=experts,
                                           attention=attention)
        self.language_model = HybridModel(
            config=self.lm_config, hybrid_stack_spec=spec, vocab_size=vocab,
            max_sequence_length=hf.text.max_position_embeddings, hybrid_layer_pattern=hf.pattern,
            position_embedding_type="none",
            share_embeddings_and_output_weights=bool(getattr(hf.text, "tie_word_embeddings", False)),
            scatter_embedding_sequence_parallel=False,  # merge images, CP-slice, then scatter (forward)
            parallel_output=True, pg_collection=pg,
        )
        self.vit_config = vision_config(hf, model_cfg, parallel_cfg)
        if use_te:
            vit_spec = get_vit_layer_with_transformer_engine_spec()
            fc1, fc2 = TELayerNormColumnParallelLinear, TERowParallelLinear
        else:
            vit_spec, fc1, fc2 = local_vit_layer_spec(attention), LocalNormColumnParallelLinear, RowParallelLinear
        v = hf.vision
        self.temporal_patch = hf.video_temporal_patch_size
        self.vision_model = OmniRADIOViT(
            transformer_config=self.vit_config, transformer_layer_spec=vit_spec, add_class_token=True,
            class_token_len=self.num_prefix_tokens, patch_dim=v.patch_size, img_h=v.patch_size * 2,
            img_w=v.patch_size * 2, max_img_h=v.max_img_size, max_img_w=v.max_img_size, has_cpe=True,
            embedder_bias=False, dynamic_resolution=True,
            force_cpe_eval_mode=True,  # CPE augmentation off: the same position embeddings in train and eval
            # video: frames grouped into tubelets of `temporal_patch` through the ViT's own `video_embedder`
            temporal_patch_dim=self.temporal_patch, separate_video_embedder=self.temporal_patch > 1,
            pg_collection=pg,
        )
        self.proj_config = projector_config(hf, model_cfg, parallel_cfg)
        self.vision_projection = MultimodalProjector(
            config=self.proj_config, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2), projector_type="mlp",
            input_size=hf.vision_hidden_size * 4, tp_group=pg.tp,
        )
        self.pg = pg
        self.sound_encoder = self.sound_projection = None
        self.sound_token_id = hf.sound_token_id
        if hf.sound is not None:
            self.sound_encoder = SoundEncoder(hf.sound)
            self.sound_proj_config = projector_config(hf, model_cfg, parallel_cfg, hf.sound.projection_hidden_size)
            self.sound_projection = MultimodalProjector(
                config=self.sound_proj_config, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2),
                projector_type="mlp", input_size=hf.sound.hidden_size, tp_group=pg.tp,
            )
        for flag, module in ((model_cfg.freeze_vision_encoder, self.vision_model),
                             (model_cfg.freeze_vision_projector, self.vision_projection),
                             (model_cfg.freeze_sound_encoder, self.sound_encoder),
                             (model_cfg.freeze_sound_projector, self.sound_projection),
                             (model_cfg.freeze_language_model, self.language_model)):
            if flag and module is not None:
                for p in module.parameters():
                    p.requires_grad_(False)

    # -- vision -------------------------------------------------------------------------------------------------------

    def encode_images(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> list[torch.Tensor]:
        """RADIO + "v2" 2x2 pixel shuffle + projector, every image once. pixel_values float
        [N_patches, 3·P·P]; image_grid_hw int64 [N_images, 2] (even sides, on the host). Returns [gh·gw/4, H] each."""
        return self.encode_media(pixel_values, image_grid_hw)[0]

    def encode_media(self, pixel_values: torch.Tensor | None, image_grid_hw: torch.Tensor | None,
                     pixel_values_videos: torch.Tensor | None = None,
                     video_grid_thw: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The images and videos through one ViT call: (image features [gh·gw/4, H] each, video features
        [ceil(F/t)·gh·gw/4, H] each, t = video_temporal_patch_size). Videos: pixel_values_videos float
        [sum F·gh·gw, 3·P·P] (each frame's patches as an image's), video_grid_thw int64 [N_videos, 3] (F, gh, gw) on the
        host; the last frame repeats up to a multiple of t and each t frames are one tubelet through the video
        embedder (transformers' get_video_features)."""
        grids = [] if image_grid_hw is None else [(int(h), int(w)) for h, w in image_grid_hw.tolist()]
        videos = [] if video_grid_thw is None else [(int(f), int(h), int(w)) for f, h, w in video_grid_thw.tolist()]
        if not grids and not videos:
            return [], []
        t = self.temporal_patch
        if videos and t < 2:
            raise ValueError("video input needs a ViT video embedder (vision_config.video_temporal_patch_size >= 2)")
        parts = []
        for name, values, items in (("pixel_values", pixel_values, [(1, h, w) for h, w in grids]),
                                    ("pixel_values_videos", pixel_values_videos, videos)):
            n = sum(f * h * w for f, h, w in items)
            if items and values.shape[0] != n:
                raise ValueError(f"{name} has {values.shape[0]} patch rows but its grids {items} need {n}")
            for f, h, w in items:
                if h % 2 or w % 2 or f < 1:
                    grid = f"image grid {h}x{w}" if name == "pixel_values" else f"video grid {f}x{h}x{w}"
                    raise ValueError(f"{grid} must have frames and even sides for the 2x2 pixel shuffle")
            if items:
                parts.append(values)
        # each video's frames padded to whole tubelets by repeating its last frame
        frames, start = [], sum(h * w for h, w in grids)
        x = torch.cat(parts).to(self.vit_config.params_dtype)
        pieces = [x[:start]]
        for f, h, w in videos:
            video = x[start:start + f * h * w]
            start += f * h * w
            pad = -f % t
            pieces.append(torch.cat([video, video[-h * w:].repeat(pad, 1)]) if pad else video)
            frames.append(f + pad)
        x = torch.cat(pieces)
        frame_grids = grids + [(h, w) for (_, h, w), fp in zip(videos, frames, strict=True) for _ in range(fp)]
        lens = [h * w for h, w in frame_grids]
        cu_h = [0, *itertools.accumulate(lens)]
        cu = to_device(torch.tensor(cu_h, dtype=torch.int32, device="cpu"), x.device)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                              max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        # the offsets the ViT's attention sees, for local_spec's varlen attention to read on the host: RADIO puts
        # num_prefix_tokens class / register tokens before each image's patches (it shifts the device offsets itself)
        psp.cu_seqlens_padded_host = tuple(itertools.accumulate([0] + [n + self.num_prefix_tokens for n in lens]))
        sizes = to_device(torch.tensor(frame_grids, device="cpu") * self.patch_size, x.device)
        kw = {"num_frames": [1] * len(grids) + frames} if t > 1 else {}
        self.vision_model.host_grids = [tuple(g) for g in frame_grids]
        out = self.vision_model(x[None], imgs_sizes=sizes, packed_seq_params=psp, **kw)
        x = (out[0] if t > 1 else out)[0]
        # the ViT's items: each image, then each video's tubelets
        items = grids + [(h, w) for (_, h, w), fp in zip(videos, frames, strict=True) for _ in range(fp // t)]
        start, p, shuffled = 0, self.num_prefix_tokens, []
        for h, w in items:
            f = x[start + p:start + p + h * w]  # drop the class/register tokens
            start += p + h * w
            c = f.shape[-1]
            # "v2" pixel shuffle: (h, w, c) -> (h, w/2, 2c) -> (w/2, h, 2c) -> (w/2, h/2, 4c) -> (h/2, w/2, 4c)
            f = f.reshape(h, w // 2, 2 * c).transpose(0, 1).reshape(w // 2, h // 2, 4 * c).transpose(0, 1)
            shuffled.append(f.reshape(-1, 4 * c))
        feats = self.vision_projection(torch.cat(shuffled)[:, None])[:, 0]
        counts = [h * w // 4 for h, w in grids] + [fp // t * h * w // 4 for (_, h, w), fp in
                                                   zip(videos, frames, strict=True)]
        split = list(feats.split(counts))
        return split[:len(grids)], split[len(grids):]

    def _image_rows(self, batch, ids: torch.Tensor, cu_pad: torch.Tensor, feats: list[torch.Tensor],
                    video_feats: list[torch.Tensor] = ()):
        """(positions int64 [N] on the host, rows [N, H], video starts) of the `<image>` tokens, each sequence's
        rows from its media slot: its images, then its videos (video tokens are `<image>` tokens too, as the
        processor expands them); video starts: (index into positions, video) of each video's first token.
        batch, ids [T], cu_pad [S+1]: host copies."""
        is_img = ids == self.image_token_id
        positions = torch.nonzero(is_img).flatten()
        media_index = _get(batch, "media_index")
        offsets = _get(batch, "media_image_offsets")
        video_offsets = _get(batch, "media_video_offsets")
        n_feat = sum(f.shape[0] for f in (*feats, *video_feats))
        if media_index is None or offsets is None:
            if positions.numel() != n_feat:
                raise ValueError(f"{positions.numel()} <image> tokens (id {self.image_token_id}) but the images give "
                                 f"{n_feat} features")
            rows = [*feats, *video_feats]
            starts = list(itertools.accumulate([f.shape[0] for f in rows], initial=0))[len(feats):len(rows)]
            return positions, torch.cat(rows) if rows else None, list(zip(starts, range(len(video_feats)), strict=True))
        if video_feats and video_offsets is None:
            raise ValueError("a batch with videos and media slots needs media_video_offsets")
        rows, starts, start = [], [], 0
        counts = torch.bincount(token_sequence_ids(cu_pad, ids.numel())[is_img], minlength=cu_pad.numel() - 1)
        offsets = offsets.tolist()
        video_offsets = [0] * len(offsets) if video_offsets is None else video_offsets.tolist()
        for s, slot in enumerate(media_index.tolist()):
            slot_feats = [*feats[offsets[slot]:offsets[slot + 1]],
                          *video_feats[video_offsets[slot]:video_offsets[slot + 1]]]
            n = sum(f.shape[0] for f in slot_feats)
            if int(counts[s]) != n:
                raise ValueError(f"sequence {s}: {int(counts[s])} <image> tokens (id {self.image_token_id}) but its "
                                 f"media slot {slot} gives {n} features")
            start += sum(f.shape[0] for f in feats[offsets[slot]:offsets[slot + 1]])
            for v in range(video_offsets[slot], video_offsets[slot + 1]):
                starts.append((start, v))
                start += video_feats[v].shape[0]
            rows.extend(slot_feats)
        if int(counts[len(media_index):].sum()):
            raise ValueError(f"{int(counts[len(media_index):].sum())} <image> tokens lie outside every sequence")
        return positions, torch.cat(rows) if rows else None, starts

    def _evs_layout(self, ids: torch.Tensor, ids_h: torch.Tensor, cu_pad_h: torch.Tensor, positions: torch.Tensor,
                    starts: list, kept: list[torch.Tensor], tubelets: list[int], per: list[int]):
        """(ids [T] on the device, positions [N] on the device) with each pruned video's span in the layout
        transformers' EVS leaves: tubelet t's chunk `<img>` then its k_t kept tokens. The row holds a video's R kept
        `<image>` tokens in its T `<img>` chunks in any split with the first chunk non-empty
        (pack.video_sequence_tokens; the data reader fills the first chunks), so the row's length is known before the
        forward; the text between chunks keeps its order. positions, starts: _image_rows' (host); kept: evs_keep of each
        video (device)."""
        img, device = self.image_token_id, ids.device
        pos_h, ids, positions = positions, ids.clone(), to_device(positions, device).clone()
        bounds = cu_pad_h.tolist()
        for c0, v in starts:
            first, n_tub, n, keep = int(pos_h[c0]), tubelets[v], per[v], kept[v]
            s = max(i for i, b in enumerate(bounds[:-1]) if b <= first)
            a1, seg = first - 1, ids_h[max(first - 1, 0):bounds[s + 1]]
            opens = torch.nonzero(seg == seg[0]).flatten()[:n_tub]
            tail = torch.nonzero(seg[int(opens[-1]) + 1:] != img).flatten()  # after the last chunk's <image> run
            region = seg[:int(opens[-1]) + 1 + int(tail[0])] if tail.numel() else seg
            is_ph = region == img
            if a1 < bounds[s] or int(seg[0]) == img or opens.numel() < n_tub or int(is_ph.sum()) != keep.numel():
                raise ValueError(f"sequence {s}: video {v} needs {n_tub} chunks holding its {keep.numel()} <image> "
                                 f"tokens (EVS, video_pruning_rate {self.hf.video_pruning_rate}), each opened by the "
                                 "<img> token before its first <image>")
            text = torch.nonzero(~is_ph).flatten()
            is_open = region[text] == seg[0]
            tub = is_open.cumsum(0) - 1  # the chunk of each text token
            g = torch.nonzero(is_open).flatten() + 1  # text tokens up to each chunk's opening, itself included
            k = torch.zeros(n_tub * n, dtype=torch.int64, device=device).index_fill_(0, keep, 1).view(n_tub, n).sum(1)
            k_incl = k.cumsum(0)
            tub_d, is_open_d = to_device(tub, device), to_device(is_open, device)
            new_text = a1 + torch.arange(text.numel(), device=device) + torch.where(
                is_open_d, (k_incl - k)[tub_d], k_incl[tub_d])
            new_ph = a1 + to_device(g, device)[keep // n] + torch.arange(keep.numel(), device=device)
            ids[new_text] = to_device(region[text], device)
            ids[new_ph] = img
            positions[c0:c0 + keep.numel()] = new_ph
        return ids, positions

    # -- sound --------------------------------------------------------------------------------------------------------

    def encode_sounds(self, features: torch.Tensor, audio_lens: torch.Tensor) -> list[torch.Tensor]:
        """Parakeet encoder + projection, every clip once (its own length: no padding between clips). features
        float [N_frames, n_mels]; audio_lens int64 [N_clips, 2] (frames, valid frames; on the host). Returns
        [n_tokens_j, H] each."""
        lens = [(int(f), int(v)) for f, v in audio_lens.tolist()]
        if not lens:
            return []
        if self.sound_encoder is None:
            raise ValueError(f"{len(lens)} audio clips but the checkpoint has no sound_config")
        if features.shape[0] != sum(f for f, _ in lens):
            raise ValueError(f"audio_features has {features.shape[0]} frames but audio_lens {lens} needs "
                             f"{sum(f for f, _ in lens)}")
        features = features.to(next(self.sound_encoder.parameters()).dtype)
        outs, start = [], 0
        for f, v in lens:
            outs.append(self.sound_encoder(features[start:start + f], v))
            start += f
        feats = self.sound_projection(torch.cat(outs)[:, None])[:, 0]
        return list(feats.split([o.shape[0] for o in outs]))

    def _sound_rows(self, batch, ids: torch.Tensor, cu_pad: torch.Tensor, feats: list[torch.Tensor]):
        """(positions int64 [N] on the host, rows [N, H]) of the `<so_embedding>` tokens, each sequence's rows from
        its media slot's clips. batch, ids [T], cu_pad [S+1]: host copies."""
        is_snd = ids == self.sound_token_id
        positions = torch.nonzero(is_snd).flatten()
        media_index, offsets = _get(batch, "media_index"), _get(batch, "media_audio_offsets")
        if media_index is None or offsets is None:
            n_feat = sum(f.shape[0] for f in feats)
            if positions.numel() != n_feat:
                raise ValueError(f"{positions.numel()} <so_embedding> tokens (id {self.sound_token_id}) but the audio "
                                 f"clips give {n_feat} features")
            return positions, torch.cat(feats) if feats else None
        counts = torch.bincount(token_sequence_ids(cu_pad, ids.numel())[is_snd], minlength=cu_pad.numel() - 1)
        offsets, rows = offsets.tolist(), []
        for s, slot in enumerate(media_index.tolist()):
            slot_feats = feats[offsets[slot]:offsets[slot + 1]]
            if int(counts[s]) != sum(f.shape[0] for f in slot_feats):
                raise ValueError(f"sequence {s}: {int(counts[s])} <so_embedding> tokens (id {self.sound_token_id}) "
                                 f"but its media slot {slot} gives {sum(f.shape[0] for f in slot_feats)} features")
            rows.extend(slot_feats)
        if int(counts[len(media_index):].sum()):
            raise ValueError(f"{int(counts[len(media_index):].sum())} <so_embedding> tokens lie outside every sequence")
        return positions, torch.cat(rows) if rows else None

    def _merge_sounds(self, batch, host, emb: torch.Tensor, ids_h: torch.Tensor, cu_pad_h: torch.Tensor):
        """`emb` [T, 1, H] with the audio clips' features at their `<so_embedding>` tokens."""
        audio_lens = _get(host, "audio_lens")
        has_audio = audio_lens is not None and audio_lens.numel() > 0
        n_tokens = 0 if self.sound_token_id is None else int((ids_h == self.sound_token_id).sum())
        if not (has_audio or n_tokens):
            return emb
        if self.sound_encoder is None:
            raise ValueError("the batch has audio but the checkpoint has no sound_config")
        feats = self.encode_sounds(_get(batch, "audio_features").to(emb.device), audio_lens) if has_audio else []
        positions, rows = self._sound_rows(host, ids_h, cu_pad_h, feats)
        if rows is None:
            return emb
        positions = to_device(positions, emb.device)
        return emb.index_put((positions, torch.zeros_like(positions)), rows.to(emb.dtype))

    # -- forward ------------------------------------------------------------------------------------------------------

    def forward(self, batch) -> torch.Tensor:
        """batch on the step's device (host numbers read from pack.host_view's CPU copy).
        Returns logits [T_local, V/TP]."""
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
        assert int(cu_pad_h[-1]) == T, (int(cu_pad_h[-1]), T)

        pixel_values, grid = _get(batch, "pixel_values"), _get(host, "image_grid_hw")
        videos, video_grid = _get(batch, "pixel_values_videos"), _get(host, "video_grid_thw")
        grid = grid if grid is not None and grid.numel() else None
        video_grid = video_grid if video_grid is not None and video_grid.numel() else None
        feats, video_feats = self.encode_media(None if grid is None else pixel_values.to(device), grid,
                                               None if video_grid is None else videos.to(device), video_grid)
        kept = []
        if video_feats and (rate := self.hf.video_pruning_rate) > 0:  # EVS: each video's kept features, in order
            tubelets = [-(-f // self.temporal_patch) for f, _, _ in video_grid.tolist()]
            per = [h * w // 4 for _, h, w in video_grid.tolist()]
            kept = [evs_keep(f, t, rate) for f, t in zip(video_feats, tubelets, strict=True)]
            video_feats = [f[k] for f, k in zip(video_feats, kept, strict=True)]
        n_tokens = int((ids_h == self.image_token_id).sum())
        positions = rows = None
        if n_tokens or feats or video_feats:
            positions, rows, starts = self._image_rows(host, ids_h, cu_pad_h, feats, video_feats)
            if kept and rows is not None:
                ids, positions = self._evs_layout(ids, ids_h, cu_pad_h, positions, starts, kept, tubelets, per)
        emb = self.language_model.embedding(input_ids=ids[None], position_ids=None)  # [T, 1, H], TP-reduced
        if rows is not None:
            positions = to_device(positions, device)
            emb = emb.index_put((positions, torch.zeros_like(positions)), rows.to(emb.dtype))
        emb = self._merge_sounds(batch, host, emb, ids_h, cu_pad_h)

        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:
            index = cp_partition_index(cu_pad, cp, parallel_state.get_context_parallel_rank()).to(device)
            emb = emb.index_select(0, index)
        if self.lm_config.sequence_parallel:
            emb = scatter_to_sequence_parallel_region(emb, group=self.pg.tp)
        max_seqlen = _get(batch, "max_seqlen") or int((cu_pad_h[1:] - cu_pad_h[:-1]).max())
        psp = thd_packed_seq_params(cu, cu_pad, max_seqlen, host=(cu_h.tolist(), cu_pad_h.tolist()))
        # Padding and weight-0 tokens leave the routers' statistics: megatron's padding_mask [1, rank tokens], True =
        # padding, sliced like the embeddings (CP order, then this rank's SP chunk: HybridModel does not scatter it).
        sample_mask, sample_mask_h = _get(batch, "sample_mask"), _get(host, "sample_mask")
        row_spans = _get(host, "span_cu_seqlens_padded")  # a shared-prompt row (pack.pack_shared_prompt)
        if row_spans is not None:
            assert cp == 1  # preflight.check_packing
            row_spans = shared_prompt.RowSpans(row_spans, T, device, (psp.seq_idx, psp.cu_seqlens_padded_host))
            sample_mask, sample_mask_h = map(shared_prompt.span_sample_mask, (sample_mask, sample_mask_h))
        pad = routing_padding_mask(cu, cu_pad, T, sample_mask)
        no_real_token = bool(routing_padding_mask(cu_h, cu_pad_h, T, sample_mask_h).all())  # on the host
        if cp > 1:
            pad = pad[index]
        if self.lm_config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            pad = pad.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
        conv = mamba_triton.CONV_OFFSETS.set(self._conv_offsets(psp, cu_pad, device))
        spans = shared_prompt.ROW_SPANS.set(row_spans)  # for the Mamba and attention layers; None: separate sequences
        try:
            with megatron_patches.routers_without_statistics(no_real_token and self.training):
                logits = self.language_model(input_ids=None, position_ids=None, attention_mask=None,
                                             decoder_input=emb, packed_seq_params=psp, padding_mask=pad[None])
        finally:
            shared_prompt.ROW_SPANS.reset(spans)
            mamba_triton.CONV_OFFSETS.reset(conv)
        return logits[0]

    def _conv_offsets(self, psp, cu_pad: torch.Tensor, device):
        """mamba_triton.CONV_OFFSETS of this packed row for the triton set, else None."""
        if self.mamba_kernels != "triton":
            return None
        chunks = mamba_triton.conv_chunk_indices(list(psp.cu_seqlens_padded_host))
        return psp.seq_idx, cu_pad, to_device(chunks, device)


def cast_params_to(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Give every floating-point parameter of `model` the dtype `dtype` in place (buffers kept);
    returns the names cast. megatron-core's optimizers need one dtype per param group (docs/DESIGN.md)."""
    cast = []
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            cast.append(name)
    return cast


def build_model(hf_dir: str | os.PathLike, model_cfg, parallel_cfg, use_te: bool | None = None,
                kernels: kernel_selection.Kernels | None = None) -> OmniModel:
    """The Omni model on this rank (parallel_state initialised with `parallel_cfg`'s sizes), with
    megatron-core's initialisation until `load_hf_weights`. use_te: force the TE / local spec (default: `kernels`'
    spec); kernels: default kernel_selection.select_kernels at `model_cfg`'s dtype."""
    megatron_patches.apply()
    if parallel_cfg.context_parallel_size > 1:
        megatron_patches.install_mamba_cp_thd_indices(cp_partition_index)
    hf = read_hf_config(hf_dir)
    if use_te is None:
        use_te = uses_te_spec() if kernels is None else kernels.spec == "te"
    p = parallel_cfg
    assert (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size()) == (
        p.tensor_model_parallel_size, p.context_parallel_size, p.expert_model_parallel_size,
        p.expert_tensor_parallel_size)
    assert "E" not in hf.pattern or p.expert_tensor_parallel_size == 1  # preflight.check_model_config
    if kernels is None:
        kernels = kernel_selection.select_kernels(te=use_te, dtype=torch_dtype(model_cfg.params_dtype))
    model = OmniModel(hf, model_cfg, parallel_cfg, use_te, kernels)
    cast_params_to(model, torch_dtype(model_cfg.params_dtype))
    if model.sound_encoder is not None:  # BatchNorm's statistics in the input's dtype (torch's CPU kernel asks it)
        model.sound_encoder.to(torch_dtype(model_cfg.params_dtype))
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model

"""Generate `assets/tiny-omni/`: a tiny, random-weight Nemotron-3-Nano-Omni checkpoint in the hub's on-disk layout.

    python assets/make_tiny_omni.py [--out assets/tiny-omni]

What it writes (deterministic for a given seed, torch and transformers version, up to the CPU's vectorised math: on
another CPU the Mamba `A_log` = log(1..n) of transformers' initialisation can differ in its last bit; the committed
output is the reference that the tests' golden numbers were recorded on):
- `config.json` in the *hub* layout of `nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16`: `llm_config` with
  `hybrid_override_pattern`, `vision_config` with RADIO `args`, `vit_hidden_size`, `projector_hidden_size`,
  `downsample_ratio`, `ps_version`, and the legacy token-id names (`img_context_token_id`, ...). Dimensions are tiny,
  every layer kind is present (`M` Mamba-2, `*` attention, `E` MoE, `-` dense MLP).
- `model.safetensors` + `model.safetensors.index.json` with the hub key names (`language_model.backbone.layers.N...`,
  `vision_model.radio_model.model.blocks.L.attn.qkv.weight`, `mlp1.1.weight`, ...), weights drawn by transformers' own
  `NemotronH_Omni_Reasoning_V3` initialisation from a fixed seed, written back by transformers' `save_pretrained`
  (which reverses its load-time renames) and then adjusted to the hub layout: RADIO layer-scale tensors (identity in
  C-RADIO, absent from the hub checkpoint) are removed, the input-conditioner buffers the hub stores are added.
  The sound encoder (`sound_encoder.encoder.*`, transformers' `ParakeetEncoder`) and its projection
  (`sound_projection.{norm,linear1,linear2}`) are drawn after, from seed + 1, so every other tensor stays as it was.
- A byte-level BPE `tokenizer.json` trained on the shipped MMPR sample, with the Omni special tokens at the real ids
  (`<|im_start|>`=10, `<|im_end|>`=11, `<think>`=12, `</think>`=13, `<image>`=18, `<img>`=21, `</img>`=22,
  `<so_embedding>`=27), the chat template (`chat_template.jinja`, ChatML with the Omni reasoning rules), and the
  processor / image-processor configs with a small patch budget (16-64 image tokens per image) and the Parakeet
  feature extractor (128 mel bins, 16 kHz, hop 160: one `<so_embedding>` per 80 ms).

Facts about the real layout come from the hub checkpoint's config.json and chat template (numbers only; no code copied).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "mmpr_sample" / "MMPR-sample"

# Special tokens at the ids of the real Omni tokenizer; unused slots get reserved fillers so the ids line up.
SPECIAL_IDS = {
    0: "<unk>", 1: "<s>", 2: "</s>", 10: "<|im_start|>", 11: "<|im_end|>", 12: "<think>", 13: "</think>",
    14: "<tool_call>", 15: "</tool_call>", 16: "<tool_response>", 17: "</tool_response>",
    18: "<image>", 19: "<video>", 21: "<img>", 22: "</img>", 25: "<so_start>", 26: "<so_end>", 27: "<so_embedding>",
}
NUM_SPECIAL = 32
VOCAB_SIZE = 1024

# Tiny dimensions. Pattern covers every layer kind; 2 Mamba groups, GQA 4 heads / 2 KV heads, 4 experts top-2 + shared.
LLM = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    hybrid_override_pattern="M*EM-E",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    expand=2,
    intermediate_size=96,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    mlp_hidden_act="relu2",
    mamba_hidden_act="silu",
    layer_norm_epsilon=1e-5,
    time_step_min=0.001,
    time_step_max=0.1,
    time_step_floor=1e-4,
    use_conv_bias=True,
    mamba_proj_bias=False,
    use_bias=False,
    attention_bias=False,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=11,
    pad_token_id=0,
)
VIT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    mlp_ratio=4.0,
    patch_size=16,
    max_img_size=256,  # the stored position-embedding grid: 256 px / 16 = 16 x 16
    num_cls_tokens=3,
    num_registers=7,  # 10 prefix tokens, as C-RADIO
    layer_norm_eps=1e-6,
    hidden_act="gelu",
    qkv_bias=True,
)
PROJECTOR_HIDDEN = 96
# Parakeet / FastConformer sound encoder (hub: 24 layers, d 1024, 128 mel bins, 8x conv subsampling, no conv bias).
SOUND = dict(
    model_type="parakeet_encoder",
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    conv_kernel_size=9,
    subsampling_factor=8,
    subsampling_conv_channels=16,
    num_mel_bins=128,
    projection_hidden_size=48,
    projection_bias=False,
    convolution_bias=False,
)
# Image processor budget: 64..256 patches of 16 px, i.e. 16..64 `<image>` tokens after the 2x2 pixel shuffle.
IMAGE_PROC = dict(min_num_patches=64, max_num_patches=256, max_model_len=68, patch_size=16, downsample_ratio=0.5)

# ChatML with the Omni reasoning rules (the hub chat template's): the system turn is always
# emitted (empty when absent); an assistant turn renders `<think>\n{reasoning}\n</think>\n{content}` when it has
# reasoning and `<think></think>{content}` otherwise; reasoning of turns before the last user message is dropped;
# images in list-style content become an `<image>\n` prefix (numbered when several) unless the text already holds
# `<image>`, then audio parts become one `<so_embedding>\n` each unless the text already holds `<so_embedding>`;
# `/think` and `/no_think` in a system or user message toggle the generation prompt and are stripped.
CHAT_TEMPLATE = r"""{%- set ns = namespace(think=true, last_user=-1, system='') -%}
{%- if enable_thinking is defined and enable_thinking is false -%}{%- set ns.think = false -%}{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
  {%- if m.role in ['system', 'user'] and m.content is string -%}
    {%- if '/no_think' in m.content -%}{%- set ns.think = false -%}{%- elif '/think' in m.content -%}{%- set ns.think = true -%}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- macro text_of(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- else -%}
    {%- set imgs = content | selectattr('type', 'equalto', 'image') | list -%}
    {%- set auds = content | selectattr('type', 'equalto', 'audio') | list -%}
    {%- set txt = content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
    {%- if '<image>' not in txt -%}
      {%- if imgs | length == 1 -%}{{- '<image>\n' -}}
      {%- elif imgs | length > 1 -%}
        {%- for i in imgs -%}{{- '<image ' ~ loop.index ~ '><image>' -}}{%- if not loop.last -%}{{- ' ' -}}{%- endif -%}{%- endfor -%}{{- '\n' -}}
      {%- endif -%}
    {%- endif -%}
    {%- if '<so_embedding>' not in txt -%}{%- for a in auds -%}{{- '<so_embedding>\n' -}}{%- endfor -%}{%- endif -%}
    {{- txt -}}
  {%- endif -%}
{%- endmacro -%}
{%- macro clean(s) -%}{{- s | replace('/no_think', '') | replace('/think', '') | trim -}}{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}{%- set ns.system = clean(text_of(messages[0].content)) -%}{%- endif -%}
{{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
    {{- '<|im_start|>user\n' + clean(text_of(m.content)) + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set content = text_of(m.content) -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content is string else '' -%}
    {%- if '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if reasoning and loop.index0 > ns.last_user -%}
      {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n' + content + '<|im_end|>\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n<think></think>' + content + '<|im_end|>\n' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {%- if ns.think -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- else -%}{{- '<|im_start|>assistant\n<think></think>' -}}{%- endif -%}
{%- endif -%}
"""


def special_tokens() -> list[str]:
    return [SPECIAL_IDS.get(i, f"<SPECIAL_{i}>") for i in range(NUM_SPECIAL)]


def build_tokenizer():
    """Train a byte-level BPE (vocab 1024) on the sample's text; special tokens occupy ids 0..31."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = []
    for f in sorted((SAMPLE / "annotations").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            corpus += [row["question"], row["chosen"], row["rejected"]]
    # the chat template's own words, so role headers become a few tokens rather than one per byte
    corpus += ["system user assistant\n You are a helpful assistant. Describe the image. Answer step by step."] * 8
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special_tokens(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    for i, t in SPECIAL_IDS.items():
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    return tok


def hub_config() -> dict:
    """The hub-layout config.json (legacy names: llm_config, vit_hidden_size, img_context_token_id, ...)."""
    llm = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", **LLM}
    vit = {
        "model_type": "radio",
        "version": "c-radio_v4-tiny",
        "args": {"min_num_patches": IMAGE_PROC["min_num_patches"], "max_num_patches": IMAGE_PROC["max_num_patches"]},
        "video_temporal_patch_size": 2,
        **VIT,
    }
    return {
        "architectures": ["NemotronH_Nano_Omni_Reasoning_V3"],
        "model_type": "NemotronH_Nano_Omni_Reasoning_V3",
        "llm_config": llm,
        "vision_config": vit,
        "vit_hidden_size": VIT["hidden_size"],
        "projector_hidden_size": PROJECTOR_HIDDEN,
        "downsample_ratio": 0.5,
        "ps_version": "v2",
        "patch_size": 16,
        "img_context_token_id": 18,
        "img_start_token_id": 21,
        "img_end_token_id": 22,
        "video_context_token_id": 19,
        "sound_context_token_id": 27,
        "video_temporal_patch_size": 2,
        "sound_config": SOUND,
        "max_sequence_length": 4096,
        "torch_dtype": "float32",
    }


def build_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights from transformers' own init, returned under the hub's key names."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    torch.manual_seed(seed)
    # the model without its sound branch: the random stream, and so every vision / language tensor, is that of the
    # asset before the sound encoder was added (tests/golden/ was recorded on it)
    model = NemotronH_Omni_Reasoning_V3(NemotronH_Omni_Reasoning_V3_Config(
        **{k: v for k, v in cfg.items() if k != "sound_config"}))
    with torch.no_grad():  # transformers' init leaves these at constants; random values make parity tests bite
        for name, p in model.named_parameters():
            if name.endswith(("mixer.D", "mixer.dt_bias", "e_score_correction_bias")) or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)  # writes the original (hub) key names
        sd = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            sd.update(load_file(f))
    # C-RADIO has no layer-scale (transformers' lambda1 is identity at 1.0); the hub checkpoint does not store it.
    for k in [k for k in sd if ".layer_scale" in k]:
        assert torch.all(sd[k] == 1.0), k
        del sd[k]
    # The hub stores the CLIP input conditioner (the processor normalises, so the model treats it as identity).
    mean = torch.tensor(cfg["vision_config"].get("norm_mean", [0.48145466, 0.4578275, 0.40821073]))
    std = torch.tensor(cfg["vision_config"].get("norm_std", [0.26862954, 0.26130258, 0.27577711]))
    sd["vision_model.radio_model.input_conditioner.norm_mean"] = mean.view(3, 1, 1).float()
    sd["vision_model.radio_model.input_conditioner.norm_std"] = std.view(3, 1, 1).float()
    sd.update(build_sound_weights(cfg, seed + 1))
    return {k: v.contiguous() for k, v in sorted(sd.items())}


def build_sound_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """The sound encoder + projection from transformers' init (norms, attention position biases and BatchNorm
    statistics randomised), under the hub's key names (transformers' conversion map, reversed)."""
    from transformers import ParakeetFeatureExtractor
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3MultiModalProjector,
    )
    from transformers.models.parakeet.modeling_parakeet import ParakeetEncoder

    torch.manual_seed(seed)
    full = NemotronH_Omni_Reasoning_V3_Config(**cfg)
    sc = full.audio_config
    encoder = ParakeetEncoder(sc)
    projection = NemotronH_Omni_Reasoning_V3MultiModalProjector(
        sc.hidden_size, sc.projection_hidden_size, full.text_config.hidden_size, bias=sc.projection_bias)
    with torch.no_grad():
        for name, t in [*encoder.named_parameters(), *encoder.named_buffers(), *projection.named_parameters()]:
            if "norm" in name and name.endswith(("weight", "bias", "running_mean")) or name.endswith("bias_u") or \
                    name.endswith("bias_v"):
                t.add_(0.1 * torch.randn_like(t))
            elif name.endswith("running_var"):
                t.add_(0.5 * torch.rand_like(t))
    sd = {f"sound_encoder.encoder.{k}": v for k, v in encoder.state_dict().items()}
    names = {"layer_norm": "norm", "linear_1": "linear1", "linear_2": "linear2"}
    sd.update({"sound_projection." + ".".join([names[k.split(".")[0]], *k.split(".")[1:]]): v
               for k, v in projection.state_dict().items()})
    # The hub also stores NeMo's mel featurizer buffers (the processor computes the mels; models ignore them).
    fe = ParakeetFeatureExtractor(feature_size=sc.num_mel_bins)
    sd["sound_encoder.encoder.feature_extractor.featurizer.fb"] = fe.mel_filters.float()[None].contiguous()
    sd["sound_encoder.encoder.feature_extractor.featurizer.window"] = torch.hann_window(fe.win_length,
                                                                                       periodic=False)
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "assets" / "tiny-omni"))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    from transformers import ParakeetFeatureExtractor, PreTrainedTokenizerFast
    from transformers.models.nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3ImageProcessor,
        NemotronH_Omni_Reasoning_V3Processor,
        NemotronH_Omni_Reasoning_V3VideoProcessor,
    )

    cfg = hub_config()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    sd = build_weights(cfg, args.seed)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
        "weight_map": {k: "model.safetensors" for k in sd},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<unk>",  # Megatron's nemotron6-moe convention: <unk> pads
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
    processor = NemotronH_Omni_Reasoning_V3Processor(
        image_processor=NemotronH_Omni_Reasoning_V3ImageProcessor(**IMAGE_PROC),
        video_processor=NemotronH_Omni_Reasoning_V3VideoProcessor(),
        tokenizer=tok,
        feature_extractor=ParakeetFeatureExtractor(feature_size=SOUND["num_mel_bins"]),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    print(f"wrote {out}: {len(sd)} tensors, {sum(v.numel() for v in sd.values()):,} parameters")


if __name__ == "__main__":
    main()

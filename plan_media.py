"""What a bin's media put on a GPU, for plan.py: the ViT's image and video tokens, the video frames and audio clips of
a bin (`media_inputs`: the training data's index, else plan.py's flags) and the sound encoder's activations
(`sound_activations`: transformers' ParakeetEncoder's saved tensors on the meta device). Token counts are the
checkpoint processor's; a model folder without processor files is planned with transformers' processor defaults."""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch


@dataclass
class MediaInputs:
    """The media the plan puts in a bin: the ViT's tokens (`image_tokens` + `video_tokens`), the video frames they
    come from, the audio clips (samples each, at `sampling_rate`) and their `<so_embedding>` tokens."""

    image_tokens: int
    source: str  # where the ViT's tokens come from
    min_bin_tokens: int = 0  # the smallest packing.max_tokens_per_bin train.py accepts for the data (0: any)
    min_bin_source: str = ""
    video_frames: int = 0
    video_tokens: int = 0  # of the ViT's tokens, the video tubelets'
    audio_samples: list[int] = field(default_factory=list)
    audio_tokens: int = 0
    sampling_rate: int = 16000
    hop_length: int = 160  # samples per mel frame
    media_source: str = ""  # where the video frames and the audio come from

    @property
    def vit_tokens(self) -> int:
        return self.image_tokens + self.video_tokens

    @property
    def audio_seconds(self) -> float:
        return sum(self.audio_samples) / self.sampling_rate


def _processor(cfg):
    """The checkpoint's processor (mmpr_index.load_processor), or None without its files."""
    if not (Path(cfg.model.hf_path) / "processor_config.json").is_file():
        return None
    import mmpr_index

    return mmpr_index.load_processor(cfg.model.hf_path, "model.hf_path")


def tubelet_tokens(processor, cfg, hf) -> tuple[int, int]:
    """(frames per tubelet, `<image>` tokens per tubelet of a square frame): the video processor's tile
    (`_compute_target_patches`, data.video.target_num_patches over its own) / downsample², transformers' defaults
    without processor files."""
    if processor is None:
        from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3VideoProcessor

        vp, t = NemotronH_Omni_Reasoning_V3VideoProcessor(), hf.video_temporal_patch_size
    else:
        vp, t = copy.copy(processor.video_processor), processor.video_temporal_patch_dim
    if cfg.data.video.target_num_patches:
        vp.video_target_num_patches = int(cfg.data.video.target_num_patches)
    wp, hp = vp._compute_target_patches(1, 1)
    return t, wp * hp // round(1 / vp.downsample_ratio) ** 2


def audio_layout(processor) -> tuple[int, int, Callable[[int], int]]:
    """(sampling rate, mel hop in samples, samples -> `<so_embedding>` tokens): the processor's (mmpr_media's
    audio_token_count), else the defaults of transformers' processor."""
    if processor is not None:
        from mmpr_media import audio_token_count

        fe = processor.feature_extractor
        return fe.sampling_rate, processor.audio_hop_length, lambda n: audio_token_count(processor, n)
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3Processor as P

    d = {k: v.default for k, v in inspect.signature(P.__init__).parameters.items()}
    defaults = SimpleNamespace(audio_hop_length=d["audio_hop_length"],
                               audio_subsampling_factor=d["audio_subsampling_factor"])
    return d["audio_sampling_rate"], d["audio_hop_length"], lambda n: max(1, P._estimate_audio_num_embeddings(
        defaults, n))


def media_inputs(cfg, hf, image_tokens: int | None = None, video_frames: int | None = None,
                 audio_seconds: float | None = None) -> MediaInputs:
    """The `packing.max_sequences_per_bin` pairs with the most image and video tokens in the training data's index
    (data.train.data_path a file, the processor in model.hf_path; their tokens and frames), as many pairs with the most
    audio (their clips), the largest pair's bin (preflight.check_splits; the smallest with drop_oversized_pairs).
    Without an index: that many pairs of one image at the processor's most patches (vision_config.args
    max_num_patches / 4). A flag replaces its count: `image_tokens` (then no index is read), `video_frames` (one video
    per bin) and `audio_seconds` (one clip per bin: the encoder's attention grows with a clip's length squared)."""
    import mmpr_records
    import pack

    k = cfg.packing.max_sequences_per_bin
    data_path = cfg.data.train.data_path
    from_index = image_tokens is None and Path(data_path).is_file()  # --image-tokens: the flags alone, as before
    processor = _processor(cfg) if from_index or video_frames is not None or audio_seconds is not None else None
    rate, hop, _ = audio_layout(processor)
    if from_index and processor is not None:
        import mmpr_index

        with mmpr_records.data_warnings([]):
            train_split, _ = mmpr_index.load_splits(processor, cfg.data)
        ix, ids = train_split.index, train_split.pair_ids
        rows = torch.as_tensor(ids, dtype=torch.long)
        # the ViT encodes every tubelet (2 frames, 2x2 pixel shuffle); EVS (video_pruning_rate) drops tokens after it
        vit_video = ix.video_grid_hw.prod(-1) // 4 * -(-ix.video_frames // 2)
        top = rows[(ix.image_tokens[rows] + vit_video[rows]).topk(min(k, len(rows))).indices]
        got = MediaInputs(int(ix.image_tokens[top].sum()), f"the {k} pair(s) with the most image tokens in {data_path}",
                          video_frames=int(ix.video_frames[top].sum()), video_tokens=int(vit_video[top].sum()),
                          sampling_rate=rate, hop_length=hop, media_source=f"the training data's index ({data_path})")
        if ix.num_audio.numel() and len(rows):  # the pairs with the most audio samples, and their clips
            n = ix.num_audio
            owner = torch.repeat_interleave(torch.arange(len(ix)), n)
            slots = ix.audio_start[owner] + torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)
            per_pair = torch.zeros(len(ix), dtype=torch.int64).index_add_(0, owner, ix.audio_samples[slots])
            loud = set(rows[per_pair[rows].topk(min(k, len(rows))).indices].tolist())
            clips = slots[torch.tensor([int(o) in loud for o in owner], dtype=torch.bool)]
            got.audio_samples = ix.audio_samples[clips].tolist()
            got.audio_tokens = int(ix.audio_token_counts[clips].sum())
        pk = cfg.packing
        shared = ix.shared_lengths(ids) if pack.shared_prompt_on(pk) else None
        sizes = pack.pair_bin_tokens(ix.lengths(ids), pk.make_sequence_length_divisible_by, shared).values()
        got.min_bin_tokens = (min if pk.drop_oversized_pairs else max)(sizes, default=0)
        got.min_bin_source = f"{'the smallest' if pk.drop_oversized_pairs else 'the largest'} pair of {data_path}"
    else:
        patches = (getattr(hf.vision, "args", None) or {}).get("max_num_patches", 0)
        one = int(patches * 0.25)  # the 2x2 pixel shuffle (omni_model.read_hf_config refuses other ratios)
        got = MediaInputs(k * one, f"{k} pair(s) of one image of {patches} patches (the processor's most; no data "
                          "index)", one, f"a pair of one image of {patches} patches", sampling_rate=rate,
                          hop_length=hop)
    if image_tokens is not None:
        got.image_tokens, got.source = image_tokens, "--image-tokens"
    if video_frames is not None:
        t, per = tubelet_tokens(processor, cfg, hf)
        got.video_frames, got.video_tokens = video_frames, math.ceil(video_frames / t) * per
    if audio_seconds is not None:
        _, _, tokens = audio_layout(processor)
        got.audio_samples = [round(audio_seconds * rate)] if audio_seconds else []
        got.audio_tokens = sum(tokens(n) for n in got.audio_samples)
    if video_frames is not None or audio_seconds is not None:
        flags = [f for f, v in (("--video-frames", video_frames), ("--audio-seconds", audio_seconds)) if v is not None]
        got.media_source = " and ".join(flags) + (f"; the rest from {got.media_source}" if got.media_source else "")
    return got


def sound_saved_bytes(sound_config, dtype: torch.dtype, mel_frames: int, layers: int) -> int:
    """Bytes autograd saves for the backward in a forward of transformers' ParakeetEncoder of `layers` layers over one
    clip of `mel_frames` mel frames in `dtype` (weights and buffers apart; saved-tensor hooks on the meta device)."""
    from transformers.models.parakeet.modeling_parakeet import ParakeetEncoder

    c = copy.deepcopy(sound_config)
    c.num_hidden_layers = layers
    for name in ("dropout", "dropout_positions", "layerdrop", "activation_dropout", "attention_dropout"):
        setattr(c, name, 0.0)  # as omni_model.SoundEncoder
    with torch.device("meta"):
        encoder = ParakeetEncoder(c).to(dtype).eval()
        x = torch.empty(1, mel_frames, c.num_mel_bins, dtype=dtype)
        mask = torch.ones(1, mel_frames, dtype=torch.bool)
    own = {t.untyped_storage()._cdata for t in [*encoder.parameters(), *encoder.buffers()]}
    storages: dict[int, int] = {}

    def keep(t):
        s = t.untyped_storage()
        if s._cdata not in own:
            storages[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        encoder(input_features=x, attention_mask=mask)
    return sum(storages.values())


def sound_activations(cfg, hf, dtype: torch.dtype, clips: list[int], tokens: int, hop: int) -> tuple[float, float]:
    """(bytes a training step keeps for the sound towers' backward, bytes a forward without gradients holds at once)
    for a bin of `clips` (samples each; the encoder takes them one by one, replicated on every rank) and `tokens`
    `<so_embedding>` tokens. A trained encoder keeps every layer's saved tensors: per clip of 1 + samples // hop mel
    frames, S(1) + (L - 1)·(S(2) - S(1)) with S(l) = `sound_saved_bytes` of l layers; a frozen one saves none, and its
    forward's S(1) at most is counted. The projection, trained or feeding a trained encoder, keeps per token its input
    and norm output (2·h_s) and fc1's output and activation (2·f/TP) in b bytes."""
    if hf.sound is None or not clips:
        return 0.0, 0.0
    one = {n: sound_saved_bytes(hf.sound, dtype, 1 + n // hop, 1) for n in set(clips)}
    working = max(one.values())
    m = cfg.model
    if not m.freeze_sound_encoder:
        layer = {n: sound_saved_bytes(hf.sound, dtype, 1 + n // hop, 2) - one[n] for n in one}
        kept = sum(one[n] + (hf.sound.num_hidden_layers - 1) * layer[n] for n in clips)
    else:  # nothing saved; its forward's working set, an upper bound as forward_only counts the ViT's
        kept = working
    if not (m.freeze_sound_encoder and m.freeze_sound_projector):
        b, tp = torch.finfo(dtype).bits // 8, cfg.parallel.tensor_model_parallel_size
        kept += tokens * (2 * hf.sound.hidden_size + 2 * hf.sound.projection_hidden_size / tp) * b
    return kept, working

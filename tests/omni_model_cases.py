"""Shared inputs and helpers of the omni_model tests (pytest module and the 2-rank torchrun script).

Not a test module itself: `make_pair_batch` builds a packed THD microbatch of one preference pair (chosen and rejected
rows sharing one image, pack.py's PackedBatch fields), deterministic from a seed; `logits_and_grads` runs a model's
forward and backward on it for equality checks.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-omni"


def make_pair_batch(seed: int = 0, grid=(4, 6), lens=(21, 30), divisible_by: int = 8, image_token_id: int = 18,
                    duplicate_media: bool = False, video: bool = False) -> dict:
    """One pair: two rows (chosen, rejected) of lengths `lens`, each `<img> <image>*N </img>` after a short prefix,
    padded to `divisible_by`; one image of patch grid `grid`. With duplicate_media=True each row gets its own copy of
    the image (media_index [0, 1]) instead of sharing it (media_index [0, 0]). With video=True the slot also holds a
    5-frame video of 4x4-patch frames (3 tubelets x 4 tokens) for a model at video_pruning_rate 0.5: the 6 tokens EVS
    keeps in its chunks as the data reader fills them, `<img> <image>*4 <img> <image>*2 <img>` at row positions 11..19
    (after the image's; each chunk opened by its `<img>`, the closing `</img>`s left out)."""
    g = torch.Generator().manual_seed(seed)
    gh, gw = grid
    n_img = gh * gw // 4
    rows = []
    for n in lens:
        body = torch.randint(32, 1000, (n,), generator=g)
        body[3] = 21
        body[4:4 + n_img] = image_token_id
        body[4 + n_img] = 22
        if video:
            assert 4 + n_img < 11 and n >= 21 and not duplicate_media
            body[11:20] = torch.tensor([21] + [image_token_id] * 4 + [21] + [image_token_id] * 2 + [21])
        rows.append(body)
    ids, cu, cu_pad = [], [0], [0]
    for r in rows:
        n_pad = -(-r.numel() // divisible_by) * divisible_by
        ids.append(torch.cat([r, torch.zeros(n_pad - r.numel(), dtype=torch.int64)]))
        cu.append(cu[-1] + r.numel())
        cu_pad.append(cu_pad[-1] + n_pad)
    pixel = torch.randn(gh * gw, 3 * 16 * 16, generator=g)
    grid_t = torch.tensor([[gh, gw]])
    batch = {
        "input_ids": torch.cat(ids)[None],
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32),
        "pixel_values": pixel,
        "image_grid_hw": grid_t,
        "image_token_counts": torch.tensor([n_img]),
        "media_index": torch.tensor([0, 0]),
        "media_image_offsets": torch.tensor([0, 1]),
    }
    if video:
        frames = torch.randn(5, 3, 64, 64, generator=g)
        batch.update(pixel_values_videos=video_patch_rows(frames), video_grid_thw=torch.tensor([[5, 4, 4]]),
                     media_video_offsets=torch.tensor([0, 1]))
    if duplicate_media:
        batch.update(pixel_values=torch.cat([pixel, pixel]), image_grid_hw=torch.cat([grid_t, grid_t]),
                     image_token_counts=torch.tensor([n_img, n_img]), media_index=torch.tensor([0, 1]),
                     media_image_offsets=torch.tensor([0, 1, 2]))
    return batch


def image_text_inputs() -> dict:
    """The tiny processor's inputs for one chart image + a short chat (input_ids, pixel_values, image_grid_hw, ...)."""
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(TINY)
    img = Image.open(ROOT / "data" / "mmpr_sample" / "MMPR-sample" / "images" / "ChartQA" / "chart_000.png")
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which is highest?"}]},
         {"role": "assistant", "content": "Figs."}], tokenize=False)
    return proc(images=[img], text=text, return_tensors="pt")


def tone(seconds: float, hz: float, seed: int = 0, rate: int = 16000):
    """float32 [seconds·rate] mono clip: a sine of `hz` at amplitude 0.3 plus seeded white noise (0.05)."""
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * noise).astype(np.float32)


def media_text_inputs(n_audio: int = 1, image: bool = False, video_frames: int = 0) -> dict:
    """The tiny processor's inputs for `n_audio` tones (0.5 s, 0.7 s, ...), optionally the chart image and a random
    `video_frames`-frame video (as video_text_inputs') + a short chat, in the prompt order image, clips, video
    (input_ids, input_features [n, F, 128], input_features_mask [n, F], pixel_values, pixel_values_videos, ...; with a
    video also ours: video_patches and video_grid_thw)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(TINY)
    clips = [tone(0.5 + 0.2 * j, 300.0 + 200 * j, seed=j) for j in range(n_audio)]
    imgs = [Image.open(ROOT / "data" / "mmpr_sample" / "MMPR-sample" / "images" / "ChartQA" / "chart_000.png")] \
        if image else []
    videos = [np.random.default_rng(0).integers(0, 256, (video_frames, 40, 56, 3), dtype=np.uint8)] \
        if video_frames else []
    vp, ip = proc.video_processor, proc.image_processor
    vp.video_target_num_patches, vp.norm_mean, vp.norm_std = 24, list(ip.image_mean), list(ip.image_std)
    # the template has no video item: the `<video>` placeholder in the text (as data rows carry it)
    content = [{"type": "image"}] * len(imgs) + [{"type": "audio"}] * n_audio + \
        [{"type": "text", "text": "<video>\n" * len(videos) + "What?"}]
    text = proc.apply_chat_template([{"role": "user", "content": content}, {"role": "assistant", "content": "A."}],
                                    tokenize=False)
    out = proc(images=imgs or None, videos=videos or None, audio=clips, text=text, return_tensors="pt")
    if videos:
        f, _, h, w = out["pixel_values_videos"].shape
        out["video_patches"] = video_patch_rows(out["pixel_values_videos"])
        out["video_grid_thw"] = torch.tensor([[f, h // 16, w // 16]])
    return out


def audio_batch_fields(inputs: dict) -> dict:
    """OmniModel's audio fields of processor outputs: every clip's frames (its own length, no batch padding)."""
    feats, mask = inputs["input_features"], inputs["input_features_mask"]
    frames = [int(mask[j].sum()) + 1 for j in range(feats.shape[0])]  # the processor's 1 + L // hop frames
    return {"audio_features": torch.cat([feats[j, :f] for j, f in enumerate(frames)]),
            "audio_lens": torch.tensor([[f, int(mask[j].sum())] for j, f in enumerate(frames)])}


def with_audio(batch: dict, seconds: float = 0.5, start: int = 12) -> dict:
    """`batch` (make_pair_batch's) with one clip shared by both rows: its `<so_start>` + n x `<so_embedding>` +
    `<so_end>` written over each row's tokens from `start` (after the image), its mel features from the tiny
    processor (a 0.5 s tone: n = 7)."""
    from transformers import AutoProcessor

    fe = AutoProcessor.from_pretrained(TINY).feature_extractor
    out = fe([tone(seconds, 523.0, seed=5)], sampling_rate=16000, return_tensors="pt")
    frames, valid = out["input_features"].shape[1], int(out["attention_mask"].sum())
    n = {0.5: 7}[seconds]
    ids = batch["input_ids"].clone()
    for a in batch["cu_seqlens_padded"][:-1].tolist():
        ids[0, a + start], ids[0, a + start + 1:a + start + 1 + n], ids[0, a + start + 1 + n] = 25, 27, 26
    return {**batch, "input_ids": ids, "audio_features": out["input_features"][0],
            "audio_lens": torch.tensor([[frames, valid]]), "media_audio_offsets": torch.tensor([0, 1])}


def logits_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`model(batch)`'s logits and every parameter's gradient of a fixed random weighting of them (seed 11), the
    model's gradients cleared before and after."""
    model.zero_grad(set_to_none=True)
    logits = model(batch)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(11))
    (logits * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def video_text_inputs(frames: int = 3, seed: int = 0, size: tuple[int, int] = (40, 56), patches: int = 24) -> dict:
    """The tiny processor's inputs for one random `frames`-frame video (uint8, `size` px, by default resized to a
    4x6-patch tile: video_target_num_patches `patches`) + a short chat: input_ids with `Frame k ...: <img>
    <image>*6 </img>` per tubelet, pixel_values_videos [F, 3, 64, 96]; plus ours: the frames as patch rows [F·24, 768]
    and video_grid_thw [[F, 4, 6]]. (64, 64) px at 16 patches: a 4x4 tile, 4 tokens per tubelet.
    The tiny asset's video processor has no norm_mean / norm_std: the image processor's (the one RADIO conditioner)."""
    import numpy as np
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(TINY)
    rng = np.random.default_rng(seed)
    video = rng.integers(0, 256, (frames, *size, 3), dtype=np.uint8)
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "<video>\nWhat moves?"}]},
         {"role": "assistant", "content": "Dots."}], tokenize=False)
    vp, ip = proc.video_processor, proc.image_processor
    vp.video_target_num_patches, vp.norm_mean, vp.norm_std = patches, list(ip.image_mean), list(ip.image_std)
    out = proc(videos=[video], text=text, return_tensors="pt")
    f, c, h, w = out["pixel_values_videos"].shape
    out["video_patches"] = video_patch_rows(out["pixel_values_videos"])
    out["video_grid_thw"] = torch.tensor([[f, h // 16, w // 16]])
    return out


def video_patch_rows(frames: torch.Tensor, patch: int = 16) -> torch.Tensor:
    """[F, C, H, W] frames -> [F·(H/P)·(W/P), C·P·P] patch rows, channel-major (c, py, px) as the image processor's."""
    f, c, h, w = frames.shape
    x = frames.reshape(f, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(f * (h // patch) * (w // patch), c * patch * patch)

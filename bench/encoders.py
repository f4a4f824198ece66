"""Item encoders: the encoders' share of a training step at the small bench width (bench.common's small Omni with the
tiny asset's sound encoder): one pair whose prompt holds a chart of the shipped sample, a 4-frame clip of the video
sample (the processor's 1024-patch tile) and a generated 10-s tone;
the ViT on the image, the ViT on the video, the ViT on both in one call (as the step runs it) and the sound encoder +
projection, each forward + backward alone, against the pair's whole forward + backward, as ratios of minimum times
from one interleaved run; on the CPU its process time at one thread (what a shared machine's load changes least)."""

from __future__ import annotations

import json
import time

import torch

import pack
from bench.common import ROOT, _build_ours, _device, _processor, _tmp, interleaved_times, small_checkpoint

VIDEO_MEDIA = ROOT / "data" / "mmpr_video_sample" / "MMPR-video-sample" / "media"
CHART = ROOT / "data" / "mmpr_sample" / "MMPR-sample" / "images" / "ChartQA" / "chart_000.png"
TONE_SECONDS, RATE = 10, 16000


def mixed_pair(model_dir):
    """(the pair of one row with the chart, the clip and the tone, decoded by mmpr_data; {image, pad} ids; the tone's
    seconds)."""
    import numpy as np
    import soundfile

    import mmpr_data
    import mmpr_index
    from config import Config

    folder = _tmp() / "encoders_data"
    folder.mkdir(exist_ok=True)
    t = np.arange(TONE_SECONDS * RATE) / RATE
    soundfile.write(folder / "tone.wav", (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), RATE)
    row = {"image": str(CHART), "video": str(VIDEO_MEDIA / "clips" / "clip_0.mp4"), "audio": str(folder / "tone.wav"),
           "question": "Describe the chart, the square's motion in the video and the sound.",
           "chosen": "A bar chart; the yellow square moves right; a steady tone.",
           "rejected": "A pie chart; the square moves left; a sweep."}
    (folder / "mixed.jsonl").write_text(json.dumps(row) + "\n")
    (folder / "meta.json").write_text(json.dumps({"mixed": {"root": "", "annotation": str(folder / "mixed.jsonl"),
                                                            "repeat_time": 1}}))
    proc = _processor(model_dir)
    cfg = Config()
    index = mmpr_index.build_index(folder / "meta.json", proc, cfg.data, use_cache=False)
    assert len(index) == 1, mmpr_index.summary_drops(index)
    ids = {"image": json.loads((model_dir / "config.json").read_text())["img_context_token_id"],
           "pad": proc.tokenizer.pad_token_id or 0}
    seconds = int(index.audio_samples.sum()) / proc.feature_extractor.sampling_rate
    return mmpr_data.PairDataset(index, proc)[0], ids, seconds


def bench_encoders(quick: bool) -> dict:
    """Minimum fwd+bwd seconds of each encoder and of the whole pair, the shares and the media token counts."""
    import distributed

    device = _device()
    distributed.init_distributed(device=device)
    model_dir = small_checkpoint("policy", seed=1234)
    pair, ids, seconds = mixed_pair(model_dir)
    model = _build_ours(model_dir).train()
    batch = pack.pack([pair], 8, ids["image"], ids["pad"]).to(device)
    w = None

    def step():
        nonlocal w
        model.zero_grad(set_to_none=True)
        logits = model(batch)
        if w is None:
            w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(11)).to(logits.device)
        (logits * w).sum().backward()

    def backward(feats):
        torch.cat(feats).float().sum().backward()

    image = (pair.pixel_values.to(device), pair.image_grid_hw)
    video = (pair.pixel_values_videos.to(device), pair.video_grid_thw)

    def vit(with_image: bool, with_video: bool):
        model.zero_grad(set_to_none=True)
        i, v = model.encode_media(*(image if with_image else (None, None)), *(video if with_video else (None, None)))
        backward(i + v)

    def sound():
        model.zero_grad(set_to_none=True)
        backward(model.encode_sounds(pair.audio_features.to(device), pair.audio_lens))

    fns = {"step": step, "vit_images": lambda: vit(True, False), "vit_video": lambda: vit(False, True),
           "vit": lambda: vit(True, True), "sound": sound}
    threads = torch.get_num_threads()
    cpu = device.type == "cpu"
    torch.set_num_threads(1 if cpu else threads)
    try:
        for fn in fns.values():  # warm-up
            fn()
        times = interleaved_times(fns, 2 if quick else 10, time.process_time if cpu else time.perf_counter)
    finally:
        torch.set_num_threads(threads)
    t = {k: v["min"] for k, v in times.items()}
    return {"clock": "process time, 1 thread" if cpu else "wall time", "pair_tokens": int(batch.cu_seqlens[-1]),
            "image_tokens": int(pair.image_token_counts.sum()),
            "video_frames": int(pair.video_grid_thw[0, 0]), "video_tokens": int(pair.video_token_counts.sum()),
            "audio_tokens": int(pair.audio_token_counts.sum()), "audio_seconds": seconds,
            **{f"{k}_fwd_bwd_s": v for k, v in t.items()},
            **{f"{k}_share": t[k] / t["step"] for k in ("vit_images", "vit_video", "vit", "sound")},
            "encoders_share": (t["vit"] + t["sound"]) / t["step"]}

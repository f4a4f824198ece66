"""The MMPR data reader's video rules: a row's `video` (a video file, or a list of frame images) decoded to RGB frames
as the checkpoint's processor samples them (`load_frames`, PyAV through transformers.video_utils.load_video), the
processor's tile and token counts (`video_layout`), its prompt text (`expand_video`) and pixel rows (`video_pixels`).
`apply_video_settings` puts data.video's settings on the processor. Failures raise `VideoDrop` (VIDEO_DROP_REASONS).
The text a video becomes: docs/RUNNING.md, "Video rows"."""

from __future__ import annotations

import math
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

VIDEO_DROP_REASONS = (
    "video_missing",  # the video file (not a frame image: image_missing) does not exist
    "video_unreadable",  # PyAV cannot decode it, it has no frame (zero-length), or its frames differ in size
    "too_many_frames",  # more frames sampled (or listed) than data.video.max_frames
)


class VideoDrop(Exception):
    """A row's video rejected for `reason` (one of VIDEO_DROP_REASONS)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def apply_video_settings(processor, video_cfg) -> None:
    """Set data.video's non-zero num_frames / fps / target_num_patches on `processor.video_processor`."""
    vp = processor.video_processor
    fill_video_norm(processor)
    if video_cfg.num_frames:
        vp.num_frames, vp.fps = int(video_cfg.num_frames), None
    if video_cfg.fps:
        vp.fps, vp.num_frames = float(video_cfg.fps), None
    if video_cfg.target_num_patches:
        vp.video_target_num_patches = int(video_cfg.target_num_patches)


def fill_video_norm(processor) -> None:
    """The image processor's mean and std on a video processor that has none (RADIO has one input conditioner)."""
    vp, ip = getattr(processor, "video_processor", None), processor.image_processor
    if vp is not None and (vp.norm_mean is None or vp.norm_std is None):
        vp.norm_mean, vp.norm_std = list(ip.image_mean), list(ip.image_std)


def _sampler(num_frames: int | None, fps: float | None) -> Callable:
    """transformers' default_sample_indices_fn, num_frames capped at the clip's frame count (a short clip: all)."""
    from transformers.video_utils import default_sample_indices_fn

    def sample(metadata, **kwargs):
        n = min(num_frames, metadata.total_num_frames) if num_frames else None
        return default_sample_indices_fn(metadata, num_frames=n, fps=None if n else fps)

    return sample


def load_frames(video: str | Sequence[str], processor, max_frames: int,
                load_image: Callable) -> tuple[np.ndarray, Any]:
    """(frames uint8 [F, H, W, 3], VideoMetadata or None for a frame list): a file sampled at the video processor's
    num_frames, else its fps, else every frame; a frame list whole (`load_image` raises its own image drops)."""
    if not isinstance(video, str):
        if len(video) > max_frames:
            raise VideoDrop("too_many_frames", f"{len(video)} frames > data.video.max_frames = {max_frames}")
        frames = [np.asarray(load_image(p)) for p in video]
        if len({f.shape for f in frames}) > 1:
            raise VideoDrop("video_unreadable", f"frames {video[0]!r}...: sizes differ "
                                                f"{sorted({f.shape[:2] for f in frames})}")
        return np.stack(frames), None
    from transformers.video_utils import load_video

    path = Path(video)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError, ValueError):
        raise VideoDrop("video_missing", f"{path} does not exist") from None
    except OSError as e:
        raise VideoDrop("video_unreadable", f"{path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise VideoDrop("video_missing" if stat.S_ISDIR(mode) else "video_unreadable",
                        f"{path} is not a regular file")
    vp = processor.video_processor
    try:
        frames, metadata = load_video(str(path), backend="pyav",
                                      sample_indices_fn=_sampler(getattr(vp, "num_frames", None),
                                                                 getattr(vp, "fps", None)))
    except IndexError:  # read_video_pyav's indices[-1] of a stream without frames
        raise VideoDrop("video_unreadable", f"{path}: zero-length (no frame)") from None
    except Exception as e:  # PyAV raises av.error.* (OSError subclasses), ValueError, ...
        raise VideoDrop("video_unreadable", f"{path}: {type(e).__name__}: {e}") from None
    if len(frames) == 0:
        raise VideoDrop("video_unreadable", f"{path}: zero-length (no frame)")
    if len(frames) > max_frames:
        raise VideoDrop("too_many_frames", f"{path}: {len(frames)} frames sampled > data.video.max_frames = "
                                           f"{max_frames}")
    return frames, metadata


def video_layout(processor, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(gh, gw, tokens per tubelet, tubelets) of `num_frames` frames of height x width px: the video processor's tile
    (its _compute_target_patches) and t = the processor's video_temporal_patch_dim."""
    vp = processor.video_processor
    wp, hp = vp._compute_target_patches(height, width)
    merge = round(1 / vp.downsample_ratio)
    return hp, wp, hp * wp // merge**2, math.ceil(num_frames / processor.video_temporal_patch_dim)


def expand_video(processor, prompt: str, num_frames: int, tokens_per_tubelet: int, metadata) -> str:
    """`prompt` with its one `<video>` replaced as the processor does (replace_video_token: a labelled
    `<img>...</img>` chunk per tubelet, timestamps when the file gives its fps)."""
    text = processor.replace_video_token({"num_tokens": [tokens_per_tubelet]}, 0, num_frames=num_frames,
                                         video_metadata=metadata)
    return processor.get_text_with_replacements([prompt], videos_replacements=[text])[0][0]


def video_pixels(processor, frames: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(pixel rows float32 [F·gh·gw, 3·P·P] channel-major per patch as the image processor's, video_grid_thw int64
    [1, 3] = (F, gh, gw), tokens per tubelet) of the frames, resized and normalised by the video processor."""
    vp = processor.video_processor
    out = vp(videos=[frames], do_sample_frames=False, return_tensors="pt")
    x = out["pixel_values_videos"].float()  # [F, 3, H, W]
    f, c, h, w = x.shape
    p = vp.patch_size
    rows = x.reshape(f, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(f * (h // p) * (w // p), c * p * p)
    return rows, torch.tensor([[f, h // p, w // p]], dtype=torch.int64), int(out["num_tokens"][0])

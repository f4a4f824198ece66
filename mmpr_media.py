"""The media of a record, decoded and counted as the checkpoint's processor does: images (`load_image`, `image_grids`),
video (`load_frames`: a file sampled through PyAV, or a list of frame images; `video_layout`, `expand_video`,
`video_pixels`, `apply_video_settings` for data.video), audio clips (`audio_samples`, `load_audio`,
`audio_token_count`). A file that fails raises `Drop` naming one of mmpr_records.DROP_REASONS. The text each becomes:
docs/RUNNING.md, "Video records"."""

from __future__ import annotations

import errno
import math
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pack import video_sequence_tokens


class Drop(Exception):
    """A record rejected for `reason` (one of mmpr_records.DROP_REASONS), `detail` naming the file or the numbers."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# ---- Images ----------
def load_image(path: str | Path):
    """An image decoded as 8-bit RGB (PIL.Image): EXIF orientation applied, palette and alpha composited onto white
    (transformers' `convert_to_rgb`), 16-bit grayscale scaled to 8 bits."""
    from PIL import Image, ImageOps
    from transformers.image_transforms import convert_to_rgb

    path = Path(path)
    try:
        mode = path.stat().st_mode  # follows symbolic links
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL or a lone surrogate in the name
        raise Drop("image_missing", f"{path} does not exist") from None
    except OSError as e:  # a symbolic link loop, a name too long, no permission
        raise Drop("image_unreadable", f"{path}: " + ("a symbolic link loop" if e.errno == errno.ELOOP
                                                       else e.strerror or str(e))) from None
    if stat.S_ISDIR(mode):
        raise Drop("image_missing", f"{path} is a directory")
    if not stat.S_ISREG(mode):  # a FIFO would block the reader
        raise Drop("image_unreadable", f"{path} is not a regular file")
    try:
        with Image.open(path) as im:
            im.load()
            im = ImageOps.exif_transpose(im)  # a transposed copy; the file handle can close
        if im.mode.startswith("I"):  # 16/32-bit integer grayscale: 0..65535 -> 0..255 (PIL's own clips at 255)
            a = np.asarray(im, dtype=np.float64) / 257.0
            im = Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), mode="L")
        elif im.mode == "F":
            im = Image.fromarray(np.clip(np.rint(np.asarray(im)), 0, 255).astype(np.uint8), mode="L")
        return Image.fromarray(convert_to_rgb(im, return_numpy=True))
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        if "truncated" in str(e):
            raise Drop("image_truncated", f"{path}: {e}") from None
        raise Drop("image_unreadable", f"{path}: {type(e).__name__}: {e}") from None


def image_patch_budget(image_processor, n_images: int) -> int:
    """Most 16-px patches per image when `n_images` images are processed in one call (transformers' Omni image
    processor): clamp(max((max_model_len - 4) * m^2, min_num_patches * n), min, max), m = 1/downsample_ratio."""
    ip = image_processor
    merge = round(1 / ip.downsample_ratio)
    budget = max((ip.max_model_len - 4) * merge**2, ip.min_num_patches * n_images)
    if ip.max_num_patches:
        budget = min(budget, ip.max_num_patches)
    return max(budget, ip.min_num_patches)


def image_grids(image_processor, sizes: Sequence[tuple[int, int]],
                paths: Sequence[str] = ()) -> list[tuple[int, int]]:
    """Patch grids (gh, gw) of images of `sizes` [(h, w) px] processed together (transformers' get_patch_grid_size)."""
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import get_patch_grid_size

    ip = image_processor
    budget = image_patch_budget(ip, len(sizes))
    merge = round(1 / ip.downsample_ratio)
    grids = []
    for j, (h, w) in enumerate(sizes):
        try:  # only this image's arithmetic: any other error is a bug and stays visible
            grid = get_patch_grid_size(h, w, ip.patch_size, merge, ip.min_num_patches, budget)
        except ZeroDivisionError:
            grid = (0, 0)
        if min(grid) < 1:
            name = paths[j] if j < len(paths) else f"image {j + 1}"
            raise Drop("image_unprocessable", f"{name}: {w}x{h} px, in {ip.patch_size}-px patches one side more "
                                               f"than {budget} times the other: the image processor cannot size it")
        grids.append(grid)
    return grids



# ---- Video ----------
VIDEO_DROP_REASONS = (
    "video_missing",  # the video file (not a frame image: image_missing) does not exist
    "video_unreadable",  # PyAV cannot decode it, it has no frame (zero-length), or its frames differ in size
    "too_many_frames",  # more frames sampled (or listed) than data.video.max_frames
)


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


def _sampler(num_frames: int | None, fps: float | None, max_frames: int, path: Path) -> Callable:
    """transformers' default_sample_indices_fn, its frame count (num_frames, or fps' int(frames / clip fps * fps) >= 1)
    capped at the clip's frame count (a short clip: all); more than `max_frames` is a Drop here, from the container's
    frame count, before a frame is decoded."""
    from transformers.video_utils import default_sample_indices_fn

    def sample(metadata, **kwargs):
        total = metadata.total_num_frames
        if total < 1:  # PyAV's stream.frames is 0 where the container does not store it (Matroska, WebM)
            raise Drop("video_unreadable", f"{path}: the container gives no frame count; re-mux it as MP4")
        n = num_frames or (max(1, int(min(total, total / metadata.fps * fps))) if fps and metadata.fps else None)
        indices = default_sample_indices_fn(metadata, num_frames=min(n, total) if n else None, fps=None if n else fps)
        if len(indices) > max_frames:
            raise Drop("too_many_frames", f"{path}: {len(indices)} frames sampled > data.video.max_frames = "
                                          f"{max_frames}")
        return indices

    return sample


def load_frames(video: str | Sequence[str], processor, max_frames: int) -> tuple[np.ndarray, Any]:
    """(frames uint8 [F, H, W, 3], VideoMetadata or None for a frame list): a file sampled at the video processor's
    num_frames, else its fps, else every frame; a frame list whole (each frame through
    `load_image`, with its image drops)."""
    if not isinstance(video, str):
        if len(video) > max_frames:
            raise Drop("too_many_frames", f"{len(video)} frames > data.video.max_frames = {max_frames}")
        frames = [np.asarray(load_image(p)) for p in video]
        if len({f.shape for f in frames}) > 1:
            raise Drop("video_unreadable", f"frames {video[0]!r}...: sizes differ "
                                                f"{sorted({f.shape[:2] for f in frames})}")
        return np.stack(frames), None
    from transformers.video_utils import load_video

    path = Path(video)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError, ValueError):
        raise Drop("video_missing", f"{path} does not exist") from None
    except OSError as e:
        raise Drop("video_unreadable", f"{path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise Drop("video_missing" if stat.S_ISDIR(mode) else "video_unreadable",
                        f"{path} is not a regular file")
    vp = processor.video_processor
    try:
        frames, metadata = load_video(str(path), backend="pyav",
                                      sample_indices_fn=_sampler(getattr(vp, "num_frames", None),
                                                                 getattr(vp, "fps", None), max_frames, path))
    except Drop:
        raise
    except IndexError:  # read_video_pyav's streams.video[0] of a file without a video stream
        raise Drop("video_unreadable", f"{path}: no video stream") from None
    except Exception as e:  # PyAV raises av.error.* (OSError subclasses), ValueError, ...
        raise Drop("video_unreadable", f"{path}: {type(e).__name__}: {e}") from None
    return frames, metadata


def video_layout(processor, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(gh, gw, tokens per tubelet, tubelets) of `num_frames` frames of height x width px: the video processor's tile
    (its _compute_target_patches) and t = the processor's video_temporal_patch_dim."""
    vp = processor.video_processor
    wp, hp = vp._compute_target_patches(height, width)
    merge = round(1 / vp.downsample_ratio)
    return hp, wp, hp * wp // merge**2, math.ceil(num_frames / processor.video_temporal_patch_dim)


def expand_video(processor, prompt: str, num_frames: int, tokens_per_tubelet: int, metadata) -> tuple[str, int]:
    """(`prompt` with its one `<video>` replaced as the processor does (replace_video_token: a labelled
    `<img>...</img>` chunk per tubelet, timestamps when the file gives its fps), the video's `<image>` tokens in it).
    Under EVS (the checkpoint's video_pruning_rate, on the processor by mmpr_index.load_processor) the chunks hold the
    kept count (pack.video_sequence_tokens), filling the first ones; omni_model moves them where EVS keeps them."""
    n, tubelets = tokens_per_tubelet, math.ceil(num_frames / processor.video_temporal_patch_dim)
    kept = video_sequence_tokens(tubelets, n, getattr(processor, "video_pruning_rate", 0.0))
    text = processor.replace_video_token({"num_tokens": [n]}, 0, num_frames=num_frames, video_metadata=metadata)
    if kept < tubelets * n:
        chunk = lambda c: processor.image_start_token + processor.image_token * c + processor.image_end_token  # noqa: E731
        labels = text.split(chunk(n))
        assert len(labels) == tubelets + 1, (len(labels), tubelets)
        text = labels[0] + "".join(chunk(min(n, max(kept - t * n, 0))) + label for t, label in enumerate(labels[1:]))
    return processor.get_text_with_replacements([prompt], videos_replacements=[text])[0][0], kept


def video_pixels(processor, frames: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(pixel rows float32 [F·gh·gw, 3·P·P] channel-major per patch as the image processor's, video_grid_thw int64
    [1, 3] = (F, gh, gw), tokens per tubelet) of the frames, resized and normalised by the video processor."""
    vp = processor.video_processor
    out = vp(videos=[frames], do_sample_frames=False, return_tensors="pt")
    x = out["pixel_values_videos"].float()  # [F, 3, H, W]
    f, c, h, w = x.shape
    p = vp.patch_size
    pixels = x.reshape(f, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(f * (h // p) * (w // p), c * p * p)
    return pixels, torch.tensor([[f, h // p, w // p]], dtype=torch.int64), int(out["num_tokens"][0])


def video_counts(processor, prompt: str, loaded: tuple[np.ndarray, Any] | None) -> tuple[str, list[int]]:
    """(prompt with its `<video>` expanded, [frames, gh, gw, video tokens]) of a record's decoded video (load_frames'
    frames and metadata; None: no video, [0, 0, 0, 0])."""
    if loaded is None:
        return prompt, [0, 0, 0, 0]
    frames, metadata = loaded
    f, h, w = frames.shape[:3]
    gh, gw, per, _ = video_layout(processor, f, h, w)
    text, tokens = expand_video(processor, prompt, f, per, metadata)
    return text, [f, gh, gw, tokens]


# ---- Audio ----------
def _audio_file(path: str | Path) -> Path:
    """`path` as a Path, or a Drop unless it is a regular file (audio_missing / audio_unreadable)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError, ValueError):
        raise Drop("audio_missing", f"{path} does not exist") from None
    except OSError as e:
        raise Drop("audio_unreadable", f"{path}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise Drop("audio_missing", f"{path} is a directory")
    if not stat.S_ISREG(mode):
        raise Drop("audio_unreadable", f"{path} is not a regular file")
    return path


def audio_samples(path: str | Path, sampling_rate: int) -> int:
    """Samples `load_audio` gives (at `sampling_rate` Hz) from the file's header, nothing decoded: its frames, or
    ceil(frames * sampling_rate / file rate) resampled (transformers' soundfile backend)."""
    import soundfile

    path = _audio_file(path)
    try:
        info = soundfile.info(str(path))
    except Exception as e:  # soundfile's LibsndfileError (a format it cannot read), RuntimeError, ...
        raise Drop("audio_unreadable", f"{path}: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if info.samplerate == sampling_rate:
        return int(info.frames)
    return math.ceil(info.frames * sampling_rate / info.samplerate)


def load_audio(path: str | Path, sampling_rate: int) -> np.ndarray:
    """A clip decoded as transformers' processor does (audio_utils.load_audio, soundfile backend: channels averaged,
    resampled with soxr to `sampling_rate` Hz): float32 [samples]."""
    from transformers.audio_utils import load_audio as hf_load_audio

    path = _audio_file(path)
    try:
        wave = hf_load_audio(str(path), sampling_rate=sampling_rate, backend="soundfile")
    except Exception as e:  # soundfile's LibsndfileError, RuntimeError (a container soundfile cannot read), ...
        raise Drop("audio_unreadable", f"{path}: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if wave.size == 0:
        raise Drop("audio_empty", f"{path} holds no samples")
    if not np.isfinite(wave).all():
        raise Drop("audio_unreadable", f"{path}: NaN or infinite samples")
    return wave


def audio_token_count(processor, samples: int) -> int:
    """`<so_embedding>` tokens of a clip of `samples` samples: the processor's own estimate (the mel frames
    1 + samples // hop through the encoder's conv subsampling, at least 1)."""
    return max(1, int(processor._estimate_audio_num_embeddings(samples)))

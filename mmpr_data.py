"""MMPR rows -> preference pairs: the meta-recipe (`read_meta`), the row rules (`checked_rows`; a failed rule is a
counted drop named in DROP_REASONS), `PairDataset` (a pair's token rows, loss masks and image tensors, from the model's
own processor) and the step's sampling (`PairSampler`, `StepLoader`). The index over all rows is mmpr_index.py.

A row rendered by the Omni chat template (the hub checkpoint's chat_template.jinja):

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{images + question}<|im_end|>\\n      <- prompt
    <|im_start|>assistant\\n<think></think>                                                        <- prompt
    {response}<|im_end|>                                                           <- loss mask True
    \\n                                                                             <- row end, mask False

The loss mask covers what the model generates after the generation prompt. The row rules and where they follow
InternVL or NeMo-RL: docs/DESIGN.md. Tests: tests/test_mmpr_data.py.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import errno
import hashlib
import json
import math
import os
import random
import re
import signal
import stat
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pack import PreferencePair

# Every reason a row can be dropped for, in the order the checks run (the first failing check names the drop).
DROP_REASONS = (
    "invalid_json",  # the line is not a JSON object of Unicode text (non-UTF-8 bytes; a lone \ud800-\udfff escape)
    "missing_field",  # question / chosen / rejected missing or not a string; image not a string or list of strings
    "video_unsupported",  # a `video` field or a <video> placeholder: video preference pairs are not supported yet
    "too_many_images",  # more images than data.train.max_images_per_row
    "placeholder_mismatch",  # <image> / <image_N> placeholders in the question, but not one per image
    "stray_media_token",  # a special-token string (<image>, <img>, <|im_end|>, ...) beyond the real placeholders
    "unterminated_reasoning",  # a response opens <think> and never closes it (a generation cut off while reasoning)
    "malformed_reasoning",  # a response with several reasoning blocks, or text before its <think>
    "empty_response",  # chosen or rejected is empty after stripping (or after its </think>)
    # chosen and rejected are the same text after stripping surrounding whitespace, or (checked when rendering, after
    # the image checks) render to the same text, e.g. an empty <think></think> on one side only: no preference signal
    "identical_responses",
    "no_image_root",  # relative image paths in a subset whose meta entry has no root (null or missing)
    "image_outside_root",  # a relative image path whose `..` parts leave the subset's root
    "image_missing",  # an image file does not exist
    "image_unreadable",  # it cannot be opened (a symbolic link loop, no permission) or PIL cannot decode it
    "image_truncated",  # the file ends before the image data does
    "image_unprocessable",  # the image processor cannot size it: too thin or too wide for the patch budget
    "template_rewrites_text",  # the chat template would change the question, system or response text
    "too_long",  # a row is longer than data.max_seq_length tokens, expanded image tokens included
)
# Special tokens a row's text may contain: the reasoning delimiters (tokenised as the reasoning tokens, as at
# inference).
REASONING_TOKENS = ("<think>", "</think>")
# Reasoning switches the Omni chat template removes from system / user text wherever they occur (inside a word, a URL
# or `</think>` too) and obeys. In a row they are text: the renderer hides them from the template (TextRenderer.render).
TEMPLATE_DIRECTIVES = ("/no_think", "/think")
# A UTF-16 surrogate code point on its own: JSON's "\ud83d" escape decodes to one, which is not Unicode text.
_SURROGATE = re.compile("[\ud800-\udfff]")
# NeMo-RL's numbered image placeholder; `<image_N>` stands for the N-th image of the row (1-based).
NUMBERED_IMAGE = re.compile(r"<image_(\d+)>")


def plural(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless n == 1: plural(1, "image") = "1 image", plural(2, "image") = "2 images",
    plural(2, "microbatch") = "2 microbatches" (-es after s, x, ch, sh)."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "x", "ch", "sh")) else f"{n} {noun}s"


class DataWarning(UserWarning):
    """A data notice that does not stop the run (an unsupported meta key, a meta length that does not match its file,
    a subset repeat_time empties, a rebuilt cache, an ignored setting). train.load_data prints each once, on rank 0, as
    one plain line with the start-up notes; `python mmpr_index.py` prints them as `warning: ...` lines."""


@contextlib.contextmanager
def data_warnings(notes: list[str]) -> Iterator[list[str]]:
    """Within the block, DataWarning messages are appended to `notes` (each text once, in order) instead of printed as
    UserWarnings with a source line; other warnings print as usual after the block. Yields `notes`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DataWarning)
        yield notes
    for w in caught:
        if issubclass(w.category, DataWarning):
            if str(w.message) not in notes:
                notes.append(str(w.message))
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


class DataError(ValueError):
    """Bad meta-recipe, annotation path, or (with data.strict) a dropped row; the message names the file/line."""


class _Drop(Exception):
    """Internal: row rejected for `reason` (one of DROP_REASONS)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# ======================================================================================================================
# Meta-recipe


@dataclass(frozen=True)
class Subset:
    """One meta-recipe entry with its paths resolved. repeat_time follows InternVL (see `apply_repeat_time`)."""

    name: str
    root: Path | None  # image folder; relative row image paths are relative to it (None: no root in the meta)
    annotation: Path  # JSONL file
    repeat_time: float = 1.0
    length: int | None = None  # row count the meta claims (informational, as in InternVL)


def resolve_path(path: str, meta_path: str | Path, data_root: str = "", want_dir: bool = False) -> Path:
    """Resolve a meta-recipe `root` / `annotation` path: absolute as is; relative against `data_root` when set,
    else the first that exists of the meta file's grandparent (the layout `<dir>/MMPR-v1.2/meta.json` with paths
    `MMPR-v1.2/images/...`) and its own folder.

    Raises:
        DataError: no candidate exists (listing the paths tried), or a directory where a file is wanted (or reverse).
    """
    p = Path(path).expanduser()
    meta = Path(meta_path).resolve()
    if p.is_absolute():
        candidates = [p]
    elif data_root:
        candidates = [Path(data_root).expanduser().resolve() / p]
    else:
        candidates = [meta.parent.parent / p, meta.parent / p]
    for c in candidates:
        if (c.is_dir() if want_dir else c.is_file()):
            return c
    kind = "folder" if want_dir else "file"
    wrong = next((c for c in candidates if c.exists()), None)
    if wrong is not None:
        what = "a file, not a folder" if want_dir else "a directory, not a file"
        raise DataError(f"{meta}: {kind} {path!r}: {wrong} is {what}")
    tried = "\n  ".join(str(c) for c in candidates)
    raise DataError(f"{meta}: {kind} {path!r} not found; tried:\n  {tried}\n(set data.train.data_root to its base)")


def _is_row(value: Any) -> bool:
    """True for an MMPR annotation row (or its JSON text): an object with chosen and rejected responses."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return False
    return isinstance(value, dict) and any(k in value for k in ("chosen", "chosen_response")) and any(
        k in value for k in ("rejected", "rejected_response"))


# Keys a meta-recipe subset may hold: the ones read here (annotation, root, repeat_time, length, data_augment) and
# the other keys InternVL's dataset builders read (internvl_chat_finetune.py and its MPO / KTO variants), which have
# no effect here (the Omni processor decides the image tiling). Any other key warns (a typo such as repeat_times).
META_KEYS = ("annotation", "root", "repeat_time", "length", "data_augment", "max_dynamic_patch", "min_dynamic_patch",
             "dynamic_image_size", "max_num_image", "min_num_image", "is_chinese", "sampling_method")


def read_meta(meta_path: str | Path, data_root: str = "") -> list[Subset]:
    """Parse a meta-recipe JSON into `Subset`s, in file order, paths resolved (`resolve_path`): `annotation`
    required; `root` optional or null (text-only subsets); `repeat_time` >= 0 (default 1); `length` compared with the
    rows read later; `data_augment: true` and unknown keys warn (DataWarning, naming the closest known key).

    Raises:
        DataError: one line naming the file and the problem (not a meta-recipe, not UTF-8, invalid JSON with its
            line, a name given twice, a missing annotation, a bad root or repeat_time, a path not found).
    """
    if not str(meta_path).strip():
        raise DataError("the meta-recipe path is empty: give an MMPR meta-recipe JSON "
                        "{subset: {root, annotation, ...}}")
    meta_path = Path(meta_path)
    try:
        raw = meta_path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read the meta-recipe {meta_path}: {e}") from None
    not_meta = (f"{meta_path}: not a meta-recipe JSON object {{subset: {{root, annotation, ...}}}} but what looks like "
                "an annotation file (JSON Lines, one preference row per line); pass the meta-recipe that names it")
    try:
        text = raw.decode("utf-8-sig")  # JSON is UTF-8 (RFC 8259); a byte-order mark is tolerated
    except UnicodeDecodeError as e:
        if _is_row(raw.partition(b"\n")[0].decode("utf-8", errors="replace")):  # a JSONL with a non-UTF-8 row
            raise DataError(not_meta) from None
        raise DataError(f"{meta_path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); a meta-recipe "
                        "is a UTF-8 JSON file (one saved as UTF-16, e.g. by a Windows editor, must be converted)"
                        ) from None
    duplicates: list[list[str]] = []  # per JSON object, innermost first: the top-level object's comes last

    def keep_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        seen: set[str] = set()
        duplicates.append([k for k, _ in pairs if k in seen or seen.add(k)])
        return dict(pairs)

    try:
        meta = json.loads(text, object_pairs_hook=keep_duplicates)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and _is_row(text.partition("\n")[0]):
            raise DataError(not_meta) from None
        raise DataError(f"{meta_path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if _is_row(meta):
        raise DataError(not_meta)
    if not isinstance(meta, dict) or not meta:
        raise DataError(f"{meta_path}: expected a non-empty JSON object {{subset: {{root, annotation, ...}}}}")
    if duplicates[-1]:  # json keeps the last of equal keys: a subset would vanish without a word
        raise DataError(f"{meta_path}: subset {duplicates[-1][0]!r} appears more than once (JSON keeps only the "
                        "last); give each subset its own name")
    nested = [k for d in duplicates[:-1] for k in d]
    if nested:
        raise DataError(f"{meta_path}: key {nested[0]!r} appears more than once in one object (JSON keeps only the "
                        "last)")
    subsets = []
    for name, spec in meta.items():
        if not isinstance(spec, dict):
            raise DataError(f"{meta_path}: subset {name!r} must be an object, got {type(spec).__name__}")
        unknown = [k for k in spec if k not in META_KEYS]
        if unknown:
            hints = {k: difflib.get_close_matches(k, META_KEYS, n=1) for k in unknown}
            listed = ", ".join(f"{k!r}" + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in unknown)
            warnings.warn(f"{meta_path}: subset {name!r}: unknown keys ignored: {listed}", DataWarning, stacklevel=2)
        if not isinstance(spec.get("annotation"), str):
            raise DataError(f"{meta_path}: subset {name!r} has no 'annotation' string (required: annotation)")
        if not isinstance(spec.get("root"), (str, type(None))):
            raise DataError(f"{meta_path}: subset {name!r}: root = {spec['root']!r} must be a folder path or null")
        r = spec.get("repeat_time", 1)
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
            raise DataError(f"{meta_path}: subset {name!r}: repeat_time = {r!r} must be a number >= 0")
        if spec.get("data_augment"):
            warnings.warn(f"{meta_path}: subset {name!r}: data_augment is not supported; images are not augmented",
                          DataWarning, stacklevel=2)
        length = spec.get("length")
        subsets.append(Subset(
            name=name,
            root=None if spec.get("root") is None else resolve_path(spec["root"], meta_path, data_root, want_dir=True),
            annotation=resolve_path(spec["annotation"], meta_path, data_root),
            repeat_time=float(r),
            length=length if isinstance(length, int) and not isinstance(length, bool) else None,
        ))
    return subsets


def apply_repeat_time(n: int, repeat_time: float, seed: int, name: str) -> list[int]:
    """Row positions 0..n-1 a subset contributes, as InternVL's `repeat_time` does, in file order.

    r < 1 keeps a seeded random subset of floor(n*r) rows; r >= 1 keeps floor(r) full copies plus a seeded random
    floor(n*(r - floor(r))) rows. The RNG is seeded by (seed, subset name), so it is the same on every rank and run.
    """
    whole = math.floor(repeat_time)
    extra = math.floor(n * (repeat_time - whole) + 1e-9)
    rng = random.Random(f"{seed}:{name}")  # str seeds hash deterministically (not PYTHONHASHSEED dependent)
    return list(range(n)) * whole + sorted(rng.sample(range(n), extra))


# ======================================================================================================================
# Images


def load_image(path: str | Path):
    """Decode an image fully: EXIF orientation applied, converted to 8-bit RGB (PIL.Image, mode "RGB").

    Palette and alpha images are composited onto white (transformers' `convert_to_rgb`); 16-bit grayscale ("I;16",
    "I") is scaled to 8 bits (PIL's own conversion clips it at 255); CMYK and grayscale convert directly.

    Raises:
        _Drop: image_missing, image_truncated or image_unreadable.
    """
    from PIL import Image, ImageOps
    from transformers.image_transforms import convert_to_rgb

    path = Path(path)
    try:
        mode = path.stat().st_mode  # follows symbolic links
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL or a lone surrogate in the name
        raise _Drop("image_missing", f"{path} does not exist") from None
    except OSError as e:  # a symbolic link loop, a name longer than the file system allows, no permission
        what = "a symbolic link loop" if e.errno == errno.ELOOP else e.strerror or e
        raise _Drop("image_unreadable", f"{path}: {what}") from None
    if stat.S_ISDIR(mode):
        raise _Drop("image_missing", f"{path} is a directory")
    if not stat.S_ISREG(mode):  # a FIFO would block the reader
        raise _Drop("image_unreadable", f"{path} is not a regular file")
    try:
        with Image.open(path) as im:
            im.load()
            im = ImageOps.exif_transpose(im)  # a transposed copy; the file handle can close
        if im.mode.startswith("I"):  # 16/32-bit integer grayscale: 0..65535 -> 0..255
            a = np.asarray(im, dtype=np.float64) / 257.0
            im = Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), mode="L")
        elif im.mode == "F":
            im = Image.fromarray(np.clip(np.rint(np.asarray(im)), 0, 255).astype(np.uint8), mode="L")
        return Image.fromarray(convert_to_rgb(im, return_numpy=True))
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        if "truncated" in str(e):
            raise _Drop("image_truncated", f"{path}: {e}") from None
        raise _Drop("image_unreadable", f"{path}: {type(e).__name__}: {e}") from None


def image_patch_budget(image_processor, n_images: int) -> int:
    """Most 16-px patches per image when `n_images` images are processed in one call.

    The budget rule of transformers' (5.23.0) NemotronH_Omni_Reasoning_V3ImageProcessor:
    clamp(max((max_model_len - 4) * m^2, min_num_patches * n), min, max), m = 1/ratio.
    Tested against the processor; used to size images at index time without resizing them.
    """
    ip = image_processor
    merge = round(1 / ip.downsample_ratio)
    budget = max((ip.max_model_len - 4) * merge**2, ip.min_num_patches * n_images)
    if ip.max_num_patches:
        budget = min(budget, ip.max_num_patches)
    return max(budget, ip.min_num_patches)


def image_grids(image_processor, sizes: Sequence[tuple[int, int]],
                paths: Sequence[str] = ()) -> list[tuple[int, int]]:
    """Patch grids (gh, gw) the image processor gives images of `sizes` [(height, width) px] processed together:
    transformers' `get_patch_grid_size` (5.23.0, image_processing_nemotron_h_omni.py) with the per-image budget
    B = `image_patch_budget(image_processor, len(sizes))`. An image whose own grid is more than B times longer on one
    side than the other (tiny asset: B = 256) would make the processor divide by zero, in training too.

    Raises:
        _Drop: image_unprocessable, naming the image, its size and the budget.
    """
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import get_patch_grid_size

    ip = image_processor
    budget = image_patch_budget(ip, len(sizes))
    merge = round(1 / ip.downsample_ratio)
    grids = []
    for j, (h, w) in enumerate(sizes):
        # only this image's arithmetic is inside the try: any other error is a bug and stays visible
        try:
            grid = get_patch_grid_size(h, w, ip.patch_size, merge, ip.min_num_patches, budget)
            cause = f"gives it a {grid[0]}x{grid[1]} patch grid"
        except ZeroDivisionError as e:
            grid, cause = (0, 0), f"raises ZeroDivisionError ({e}) in transformers' get_patch_grid_size"
        if min(grid) < 1:
            own_h, own_w = round(h / ip.patch_size + 0.5), round(w / ip.patch_size + 0.5)  # get_patch_grid_size's
            name = paths[j] if j < len(paths) else f"image {j + 1}"
            raise _Drop("image_unprocessable",
                        f"{name}: the image processor cannot resize a {w}x{h} px image (width x height): in "
                        f"{ip.patch_size}-px patches it is {own_w}x{own_h}, a long side more than {budget} times the "
                        f"short one ({budget} = the patch budget per image), so the short side shrinks to 0 "
                        f"patches; the processor {cause}")
        grids.append(grid)
    return grids


# ======================================================================================================================
# Text: validation, chat-template rendering, tokenisation


@dataclass
class RowText:
    """A validated row's text. `prompt` is the rendered prompt with one `<image>` per image (not yet expanded);
    `chosen` / `rejected` are the rendered responses, each `... <|im_end|>\\n`."""

    prompt: str
    chosen: str
    rejected: str
    images: list[str]  # resolved image paths, in placeholder order


def _as_str(row: dict, *keys: str) -> str | None:
    for k in keys:
        if k in row:
            v = row[k]
            return v if isinstance(v, str) else None
    return None


def check_reasoning(name: str, response: str) -> None:
    """Raise _Drop unless the stripped response has no reasoning token or one block the template renders
    (`<think>` reasoning `</think>` answer, or the opening `<think>` left to the generation prompt): `<think>` never
    closed is unterminated_reasoning, anything else (a second block, text before it) malformed_reasoning."""
    opens, closes = response.count("<think>"), response.count("</think>")
    if opens and not closes:
        raise _Drop("unterminated_reasoning", f"{name} opens <think> but never closes it with </think>")
    if closes > 1 or opens > 1:
        raise _Drop("malformed_reasoning", f"{name} has {opens} <think> and {closes} </think>; one reasoning "
                                           "block at the start of the response is allowed")
    if opens and not response.startswith("<think>"):
        raise _Drop("malformed_reasoning", f"{name} has text before its <think>; one reasoning block at the start "
                                           "of the response is allowed")


class TextRenderer:
    """Validates a row's fields and renders them with the processor's chat template (one instance per processor)."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token = processor.image_token  # "<image>"
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.video_token = getattr(processor, "video_token", None) or "<video>"
        specials = {t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special}
        # Any special-token string inside the data would be tokenised as that token and shift or fake structure
        # (an extra <image> takes an image feature); only the reasoning delimiters and real placeholders may appear.
        self.forbidden = sorted(specials - set(REASONING_TOKENS) - {self.image_token}, key=len, reverse=True)
        # a character that neither the template nor (checked per row) the data contains: stands in for the '/' of a
        # directive while the template renders, so that the template neither strips nor obeys it
        template = str(processor.chat_template)
        self._marks = [chr(c) for c in range(0xE000, 0xF900) if chr(c) not in template][:64]

    def _stray(self, text: str, allow_image: bool) -> str | None:
        for t in self.forbidden:
            if t in text:
                return t
        return None if allow_image or self.image_token not in text else self.image_token

    def parse(self, row: Any, root: Path | None, max_images: int,
              subset: str = "") -> tuple[str, str, str, str, list[str]]:
        """Check a JSON row; return (system, question, chosen, rejected, image paths in placeholder order).

        Responses come back stripped (identical after the strip: `identical_responses`); `<image_N>` placeholders
        become `<image>` with the N-th image there; relative image paths are joined to `root` and must stay inside it
        (`root` None: dropped, naming `subset`). Raises _Drop (DROP_REASONS).
        """
        if not isinstance(row, dict):
            raise _Drop("invalid_json", f"expected a JSON object, got {type(row).__name__}")
        question = _as_str(row, "question")
        chosen = _as_str(row, "chosen", "chosen_response")
        rejected = _as_str(row, "rejected", "rejected_response")
        system = row.get("system_prompt", row.get("system"))
        system = "" if system is None else system if isinstance(system, str) else None  # null = no system turn
        for name, v in (("question", question), ("chosen", chosen), ("rejected", rejected), ("system", system)):
            if v is None:
                raise _Drop("missing_field", f"{name!r} is missing or not a string")
            if (m := _SURROGATE.search(v)) is not None:  # valid JSON, not text: no tokenizer takes it
                raise _Drop("invalid_json", f"{name!r} holds the lone surrogate escape {ascii(m.group())} at "
                                            f"character {m.start()}: not Unicode text (decoded with surrogateescape?)")
        image = row.get("image")
        # InternVL: an image row is `'image' in row and len(row['image']) != 0`; "" and [] are text-only rows
        images = [] if image is None or image == "" else [image] if isinstance(image, str) else image
        if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
            raise _Drop("missing_field", f"'image' must be a path or a list of paths, got {image!r}")
        if row.get("video") is not None:
            raise _Drop("video_unsupported", f"the row has a video ({row['video']!r}); video preference pairs are "
                                             "not supported yet")
        for name, text in (("question", question), ("system", system)):
            if self.video_token in text:
                raise _Drop("video_unsupported", f"{name} has a {self.video_token} placeholder; video preference "
                                                 "pairs are not supported yet")
        if len(images) > max_images:
            raise _Drop("too_many_images", f"{plural(len(images), 'image')} > data.train.max_images_per_row = "
                                           f"{max_images}")
        question, images = self._numbered_placeholders(question, images)
        n_ph = question.count(self.image_token)
        if n_ph and n_ph != len(images):
            raise _Drop("placeholder_mismatch", f"{plural(n_ph, self.image_token + ' placeholder')} for "
                                                f"{plural(len(images), 'image')}")
        for name, text, allow in (("question", question, True), ("system", system, False),
                                  ("chosen", chosen, False), ("rejected", rejected, False)):
            if (t := self._stray(text, allow)) is not None:
                raise _Drop("stray_media_token", f"{name} contains the special-token string {t!r}")
        chosen, rejected = chosen.strip(), rejected.strip()
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            check_reasoning(name, text)
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            if not text.split("</think>")[-1].strip():
                raise _Drop("empty_response", f"{name} is empty")
        if chosen == rejected:  # both already stripped: the rows would be the same tokens, the pair has no preference
            raise _Drop("identical_responses", "chosen and rejected are the same text (after stripping surrounding "
                                               "whitespace)")
        if root is None and (rel := [p for p in images if not Path(p).is_absolute()]):
            raise _Drop("no_image_root", f"subset {subset!r} has no root in the meta-recipe, so the relative image "
                                         f"path {rel[0]!r} cannot be resolved")
        for p in images:
            if not Path(p).is_absolute() and os.path.normpath(p).split(os.sep)[0] == os.pardir:
                raise _Drop("image_outside_root", f"the image path {p!r} leaves the subset's root {str(root)!r}")
        return system, question, chosen, rejected, [p if root is None else str(root / p) for p in images]

    def _numbered_placeholders(self, question: str, images: list[str]) -> tuple[str, list[str]]:
        """`<image_N>` (NeMo-RL's placeholder, N = 1..n) -> `<image>`, images reordered to placeholder order.

        Raises _Drop(placeholder_mismatch) when `<image_N>` and `<image>` are mixed or the numbers are not each of
        1..len(images) once."""
        numbers = [int(m) for m in NUMBERED_IMAGE.findall(question)]
        if not numbers:
            return question, images
        if self.image_token in question:
            raise _Drop("placeholder_mismatch", f"the question mixes {self.image_token} and <image_N> placeholders")
        if sorted(numbers) != list(range(1, len(images) + 1)):
            raise _Drop("placeholder_mismatch", f"placeholders <image_{'>, <image_'.join(map(str, numbers))}> for "
                                                f"{plural(len(images), 'image')}: expected each of <image_1>..<image_"
                                                f"{len(images)}> once")
        return NUMBERED_IMAGE.sub(self.image_token, question), [images[n - 1] for n in numbers]

    def render(self, system: str, question: str, n_images: int, chosen: str, rejected: str) -> tuple[str, str, str]:
        """Render (prompt, chosen, rejected) with the chat template: the prompt is the template's generation prompt
        the rendered conversation starts with, each response the rest (`... <|im_end|>\\n`). When one side reasons and
        the other not, the prompt stops at `<|im_start|>assistant\\n` and each response opens its own `<think>` block.
        `/think` and `/no_think` (TEMPLATE_DIRECTIVES) are hidden from the template while it renders, so the text
        stays as written.

        Raises:
            _Drop: template_rewrites_text (the rendering lacks some text as written) or identical_responses.
            DataError: the template does not render a generation prompt + response.
        """
        texts = (system, question, chosen, rejected)
        mark = "/"  # the identity, unless the row has a directive to hide
        if any(d in t for d in TEMPLATE_DIRECTIVES for t in texts):
            mark = next((m for m in self._marks if not any(m in t for t in texts)), "")
            if not mark:
                raise _Drop("template_rewrites_text", "the row uses every private-use character this renderer could "
                                                      "hide its /think and /no_think from the chat template with")

        def hide(text: str, keep_think_end: bool) -> str:
            # "/no_think" does not contain "/think": the order does not matter
            for d in TEMPLATE_DIRECTIVES if mark != "/" else ():
                text = (re.sub(f"(?<!<){re.escape(d)}", mark + d[1:], text) if keep_think_end
                        else text.replace(d, mark + d[1:]))
            return text

        user = {"role": "user", "content": [{"type": "image"}] * n_images
                + [{"type": "text", "text": hide(question, False)}]}
        msgs = ([{"role": "system", "content": hide(system, False)}] if system else []) + [user]
        apply = self.processor.apply_chat_template
        prompts: dict[bool, str] = {}  # rendered lazily: most MMPR responses need only the thinking-off prompt

        def prompt_of(full: str) -> str | None:
            for thinking in (False, True):
                if thinking not in prompts:
                    prompts[thinking] = apply(msgs, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=thinking)
                if full.startswith(prompts[thinking]):
                    return prompts[thinking]
            return None

        out = []
        for response in (chosen, rejected):
            # a response keeps its reasoning delimiter </think>: the template splits the reasoning off at it
            full = apply(msgs + [{"role": "assistant", "content": hide(response, True)}], tokenize=False)
            prompt = prompt_of(full)
            if prompt is None or not full.endswith("<|im_end|>\n"):
                raise DataError(f"the chat template does not render {full!r} as one of its generation prompts "
                                f"{list(prompts.values())!r} followed by the response and '<|im_end|>\\n'")
            out.append((prompt.replace(mark, "/"), full[len(prompt):].replace(mark, "/")))
        prompt = out[0][0]
        if out[1][0] != prompt:  # one side reasons, the other not: share the prompt up to the reasoning switch
            prompt = os.path.commonprefix([out[0][0], out[1][0]])
            prompt = prompt[: len(prompt) - len("<think>")] if prompt.endswith("<think>") else prompt
            out = [(prompt, p[len(prompt):] + r) for p, r in out]
        if prompt.count(self.image_token) != n_images:
            raise DataError(f"the rendered prompt has {prompt.count(self.image_token)} {self.image_token} "
                            f"for {plural(n_images, 'image')}: {prompt!r}")
        for name, text in (("system", system), ("question", question)):
            if text.strip() and text.strip() not in prompt:
                raise _Drop("template_rewrites_text", f"the chat template changes the {name} text: {prompt!r}")
        for (_, rendered), (name, response) in zip(out, (("chosen", chosen), ("rejected", rejected)), strict=True):
            parts = response.split("</think>")
            for part in (parts[0].split("<think>")[-1].strip(), parts[-1].strip()) if len(parts) > 1 else parts:
                if part not in rendered:
                    raise _Drop("template_rewrites_text", f"the chat template changes the {name} text: {rendered!r}")
        if out[0][1] == out[1][1]:  # e.g. "<think></think>A cat." and "A cat.": the template drops empty reasoning
            raise _Drop("identical_responses", f"chosen and rejected render to the same text {out[0][1]!r}")
        return prompt, out[0][1], out[1][1]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS: the Omni processor tokenises with add_special_tokens=False)."""
        # verbose=False: no "Token indices sequence length is longer than the specified maximum sequence length"
        # warning from transformers (model_max_length); a row's length is checked against data.max_seq_length here
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def response_ids(self, response: str) -> tuple[list[int], list[bool]]:
        """Token ids of a rendered response and its loss mask: True up to and including the last <|im_end|>."""
        ids = self.encode(response)
        if self.eos_id not in ids:
            raise DataError(f"rendered response has no <|im_end|> token: {response!r}")
        end = len(ids) - 1 - ids[::-1].index(self.eos_id)
        return ids, [True] * (end + 1) + [False] * (len(ids) - end - 1)


# ======================================================================================================================
# The index


@dataclass
class PairIndex:
    """Validated pairs, columnar; pair ids are positions 0..N-1 (a repeated row appears under several ids).

    Per pair ([N] int64): `subset_id`, `line` (1-based), `offset` (bytes) in the subset's annotation file,
    `prompt_len`, `chosen_len`, `rejected_len` (tokens, image tokens included), `image_tokens`, `image_start` /
    `num_images` (a slice of the per-image arrays). Per image ([M]): `image_path_id`, `image_grid_hw` [M, 2] (16-px
    patches), `image_token_counts`. `stats[subset]`: rows read, valid, pairs, drops by reason with examples.
    `cache_status` and `cache_dir`: where it came from.
    """

    meta_path: str
    fingerprint: str
    subsets: list[str]
    annotation_files: list[str]
    image_roots: list[str]  # "" for a subset without root
    image_paths: list[str]
    subset_id: torch.Tensor
    line: torch.Tensor
    offset: torch.Tensor
    prompt_len: torch.Tensor
    chosen_len: torch.Tensor
    rejected_len: torch.Tensor
    image_tokens: torch.Tensor
    image_start: torch.Tensor
    num_images: torch.Tensor
    image_path_id: torch.Tensor
    image_grid_hw: torch.Tensor
    image_token_counts: torch.Tensor
    stats: dict[str, dict]
    build_seconds: float = 0.0
    cache_status: str = "disabled"
    cache_dir: str = ""

    _SAVED = ("meta_path", "fingerprint", "subsets", "annotation_files", "image_roots", "image_paths", "subset_id",
              "line", "offset", "prompt_len", "chosen_len", "rejected_len", "image_tokens", "image_start", "num_images",
              "image_path_id", "image_grid_hw", "image_token_counts", "stats", "build_seconds")

    def __len__(self) -> int:
        return int(self.line.numel())

    def lengths(self, pair_ids: Sequence[int] | None = None) -> dict[int, tuple[int, int]]:
        """{pair_id: (chosen tokens, rejected tokens)}: the input of pack.plan_bins / plan_step."""
        ids = range(len(self)) if pair_ids is None else pair_ids
        c, r = self.chosen_len.tolist(), self.rejected_len.tolist()
        return {int(i): (c[i], r[i]) for i in ids}

    def shared_lengths(self, pair_ids: Sequence[int] | None = None) -> dict[int, int]:
        """{pair_id: prompt tokens - 1}: the tokens the shared-prompt layout stores once per pair (shared_prompt.pack's
        k = shared_prompt.prefix_length is at least this: the last prompt token starts both responses), the
        `shared_lengths` of pack.plan_bins / plan_step; sizes planned with it are upper bounds of the packed spans."""
        if pair_ids is None:
            return {i: n - 1 for i, n in enumerate(self.prompt_len.tolist())}
        ids = [int(i) for i in pair_ids]
        return dict(zip(ids, (self.prompt_len[ids] - 1).tolist(), strict=True))

    def source(self, i: int) -> str:
        """'annotation.jsonl:line' of pair i (for messages)."""
        return f"{self.annotation_files[int(self.subset_id[i])]}:{int(self.line[i])}"

    def images(self, i: int) -> list[str]:
        s, n = int(self.image_start[i]), int(self.num_images[i])
        return [self.image_paths[j] for j in self.image_path_id[s:s + n].tolist()]

    def state(self) -> dict:
        return {k: getattr(self, k) for k in self._SAVED}


# ======================================================================================================================
# Row checks (used by mmpr_index.build_index)


# Row checking runs in forked worker processes (data.num_workers >= 2) or in-process; this is what they share
# (set by `begin_row_checks` before the workers fork, so nothing is pickled).
_CHUNK_CTX: dict[str, Any] = {}
CHUNK_ROWS = 256  # rows per task: large enough to amortise inter-process transfer, small enough to stop early


def begin_row_checks(processor, max_images: int, max_len: int) -> None:
    """Set what `checked_rows` checks rows with: the model's processor (chat template, tokenizer, image processor),
    data.train.max_images_per_row and data.max_seq_length. Call it before forking the checking processes and
    `end_row_checks` after them."""
    _CHUNK_CTX.clear()
    _CHUNK_CTX.update(text=TextRenderer(processor), ip=processor.image_processor, max_images=max_images,
                      max_len=max_len)


def end_row_checks() -> None:
    """Forget the checking context and the memoised image sizes of `begin_row_checks`."""
    _CHUNK_CTX.clear()


def _probe(path: str) -> tuple[int, int] | tuple[str, str]:
    """(height, width) of a decodable image, or (drop reason, detail); memoised per process."""
    cache = _CHUNK_CTX.setdefault("sizes", {})
    if path not in cache:
        try:
            im = load_image(path)
            cache[path] = (im.height, im.width)
        except _Drop as d:
            cache[path] = (d.reason, d.detail)
    return cache[path]


def _check_chunk(root: str, lines: list[tuple[int, int, bytes]],
                 subset: str = "") -> list[tuple[int, int, dict | tuple[str, str]]]:
    """Validate rows [(line number, byte offset, raw line)] of `subset` (image root `root`, "" = none); return
    (line, offset, lengths dict or (reason, detail))."""
    text, ip = _CHUNK_CTX["text"], _CHUNK_CTX["ip"]
    max_images, max_len = _CHUNK_CTX["max_images"], _CHUNK_CTX["max_len"]
    merge = round(1 / ip.downsample_ratio)
    out = []
    for lineno, offset, raw in lines:
        try:
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _Drop("invalid_json", str(e)) from None
            system, question, chosen, rejected, imgs = text.parse(row, Path(root) if root else None, max_images,
                                                                  subset)
            sizes = [_probe(p) for p in imgs]
            bad = next((s for s in sizes if isinstance(s[0], str)), None)
            if bad is not None:
                raise _Drop(*bad)
            grids = image_grids(ip, sizes, imgs)  # before rendering: the order of DROP_REASONS
            prompt, r_c, r_r = text.render(system, question, len(imgs), chosen, rejected)
            counts = [gh * gw // merge**2 for gh, gw in grids]
            # each <image> placeholder (1 token) becomes <img> + n x <image> + </img> (n + 2 tokens)
            p_len = len(text.encode(prompt)) + sum(n + 1 for n in counts)
            c_len, r_len = p_len + len(text.encode(r_c)), p_len + len(text.encode(r_r))
            if max(c_len, r_len) > max_len:
                raise _Drop("too_long", f"chosen {c_len} / rejected {r_len} tokens > data.max_seq_length = {max_len}")
            # the row's content as trained (not its JSON formatting): mmpr_index notes rows that repeat another
            digest = hashlib.blake2b(json.dumps([system, question, chosen, rejected, imgs]).encode(),
                                     digest_size=8).hexdigest()
            out.append((lineno, offset, dict(prompt_len=p_len, chosen_len=c_len, rejected_len=r_len, imgs=imgs,
                                             grids=grids, counts=counts, digest=digest)))
        except _Drop as d:  # returned as a plain tuple: it crosses the process boundary
            out.append((lineno, offset, (d.reason, d.detail)))
    return out


def _read_chunks(path: Path) -> Iterator[list[tuple[int, int, bytes]]]:
    """Non-blank lines of a JSONL file as (1-based line number, byte offset, bytes), CHUNK_ROWS at a time."""
    chunk, offset = [], 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                chunk.append((lineno, offset, raw))
                if len(chunk) == CHUNK_ROWS:
                    yield chunk
                    chunk = []
            offset += len(raw)
    if chunk:
        yield chunk


def checked_rows(pool, workers: int, root: str, path: Path,
                 subset: str = "") -> Iterator[tuple[int, int, dict | tuple[str, str]]]:
    """Every non-blank row of annotation file `path` (of `subset`; image `root`, "" = none) checked, in file
    order: (line, byte offset, lengths or (drop reason, detail)); lengths holds prompt_len, chosen_len, rejected_len
    (tokens), imgs, grids and counts. `pool` (fork-context ProcessPoolExecutor of `workers`, or None: in-process)
    checks CHUNK_ROWS rows per task. Needs `begin_row_checks` first."""
    if pool is None:
        for chunk in _read_chunks(path):
            yield from _check_chunk(root, chunk, subset)
        return
    window: collections.deque = collections.deque()
    chunks = _read_chunks(path)
    try:
        for chunk in chunks:
            window.append(pool.submit(_check_chunk, root, chunk, subset))
            if len(window) >= 2 * workers:
                yield from window.popleft().result()
        while window:
            yield from window.popleft().result()
    finally:  # stopped early (max_samples) or failed: drop the chunks not yet started
        for fut in window:
            fut.cancel()



# ======================================================================================================================
# Dataset


def changed_remedy(ix: PairIndex) -> str:
    """What to do when a row no longer matches the index `ix` (a file changed after the index was built): put the
    file back and resume, or re-index and start a new run: a re-indexed data set has other pairs, and a resume refuses
    another pair count (PairSampler.load_state_dict)."""
    return (f"restore it and resume, or delete {ix.cache_dir or 'the index cache'} to re-index and start a new run "
            "in another checkpoint.dir (a resume needs the same pairs)")


class PairDataset(torch.utils.data.Dataset):
    """`dataset[pair_id] -> PreferencePair` for the pairs of a `PairIndex`: the row re-read and rendered as the
    index did, its images decoded once (`pixel_values` [sum gh*gw, 768] float32, `image_grid_hw` [n, 2],
    `image_token_counts` [n]), each `<image>` expanded by the processor (`<img>` + n x `<image>` + `</img>`), both rows
    tokenised ([L] int64; loss masks [L] bool, True on the response and its `<|im_end|>`).

    Raises:
        DataError: the row or an image changed since the index was built (naming the file, line and the cache).
    """

    def __init__(self, index: PairIndex, processor):
        self.index = index
        self.processor = processor
        self.text = TextRenderer(processor)
        self.max_images = max([int(index.num_images.max())] if len(index) else [0])
        self.patch_dim = 3 * processor.image_processor.patch_size ** 2

    def __len__(self) -> int:
        return len(self.index)

    def _row_text(self, i: int) -> RowText:
        ix = self.index
        sub = int(ix.subset_id[i])
        with open(ix.annotation_files[sub], "rb") as f:
            f.seek(int(ix.offset[i]))
            raw = f.readline()
        images = ix.images(i)
        try:
            root = ix.image_roots[sub]
            system, question, chosen, rejected, imgs = self.text.parse(
                json.loads(raw), Path(root) if root else None, self.max_images, ix.subsets[sub])
            if imgs != images:
                raise _Drop("image_missing", f"row images {imgs} differ from the index's {images}")
            prompt, r_c, r_r = self.text.render(system, question, len(imgs), chosen, rejected)
        except (_Drop, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{ix.source(i)}: the row no longer validates ({e}); the annotation changed since the "
                            f"index was built: {changed_remedy(ix)}") from None
        return RowText(prompt, r_c, r_r, images)

    def __getitem__(self, i: int) -> PreferencePair:
        i = int(i)
        ix, row = self.index, self._row_text(i)
        if row.images:
            try:
                pil = [load_image(p) for p in row.images]
                # the grids the processor is about to compute: an image replaced since the index was built (same
                # path, so the same fingerprint) by one too thin for it is this one-line error, not the processor's
                # ZeroDivisionError inside a DataLoader worker
                image_grids(self.processor.image_processor, [(im.height, im.width) for im in pil], row.images)
            except _Drop as d:
                raise DataError(f"{ix.source(i)}: {d}; the image changed since the index was built: "
                                f"{changed_remedy(ix)}") from None
            media = self.processor.image_processor(images=pil, return_tensors="pt")
            pixel_values, grid = media["pixel_values"].float(), media["image_grid_hw"].long()
            reps = [self.processor.replace_image_token(media, j) for j in range(len(pil))]
            prompt = self.processor.get_text_with_replacements([row.prompt], images_replacements=reps)[0][0]
        else:
            pixel_values, grid = torch.zeros(0, self.patch_dim), torch.zeros(0, 2, dtype=torch.long)
            prompt = row.prompt
        merge = round(1 / self.processor.image_processor.downsample_ratio)
        counts = grid.prod(dim=-1) // merge**2
        prompt_ids = self.text.encode(prompt)
        rows = {}
        for side, response in (("chosen", row.chosen), ("rejected", row.rejected)):
            r_ids, r_mask = self.text.response_ids(response)
            rows[side] = (torch.tensor(prompt_ids + r_ids, dtype=torch.int64),
                          torch.tensor([False] * len(prompt_ids) + r_mask, dtype=torch.bool))
        s, n = int(ix.image_start[i]), int(ix.num_images[i])
        expect = (int(ix.prompt_len[i]), int(ix.chosen_len[i]), int(ix.rejected_len[i]),
                  ix.image_token_counts[s:s + n].tolist())
        got = (len(prompt_ids), rows["chosen"][0].numel(), rows["rejected"][0].numel(), counts.tolist())
        if got != expect:
            raise DataError(f"{ix.source(i)}: (prompt, chosen, rejected, image tokens) = {got} but the index says "
                            f"{expect}; the data or processor changed since it was built: {changed_remedy(ix)}")
        return PreferencePair(
            pair_index=i, chosen_ids=rows["chosen"][0], rejected_ids=rows["rejected"][0],
            chosen_loss_mask=rows["chosen"][1], rejected_loss_mask=rows["rejected"][1],
            pixel_values=pixel_values, image_grid_hw=grid, image_token_counts=counts,
        )


# ======================================================================================================================
# Sampling and loading


class PairSampler:
    """The global pair order: a seeded shuffle per epoch (numpy PCG64 seeded with (seed, epoch)), identical on
    every rank; resumable. `take(n)` returns the next n pair ids, continuing into the next epoch, never the same pair
    twice in a step (a pair drawn again across an epoch boundary opens the next step instead). `state_dict()` =
    {epoch, offset, deferred, num_pairs, seed, shuffle, fingerprint (of the PairIndex; "" = unknown)}.
    """

    def __init__(self, pair_ids: Sequence[int], seed: int, shuffle: bool = True, fingerprint: str = ""):
        if not len(pair_ids):
            raise DataError("PairSampler: no pairs to sample from")
        self.pair_ids = list(pair_ids)
        self.seed, self.shuffle, self.fingerprint = seed, shuffle, fingerprint
        self.epoch, self.offset = 0, 0
        self.deferred: list[int] = []
        self._order_epoch, self._order = -1, []

    def epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.pair_ids))
                self._order = [self.pair_ids[j] for j in perm]
            else:
                self._order = list(self.pair_ids)
            self._order_epoch = epoch
        return self._order

    def take(self, n: int) -> list[int]:
        """The next n distinct pair ids (the deferred repeats of the previous take first).

        Raises DataError when n exceeds the number of pairs (a step cannot hold n distinct pairs)."""
        if n > len(self.pair_ids):
            raise DataError(f"PairSampler: {n} distinct pairs per step but only {len(self.pair_ids)} pairs")
        out, self.deferred = self.deferred, []
        seen = set(out)
        while len(out) < n:
            order = self.epoch_order(self.epoch)
            k = min(n - len(out), len(order) - self.offset)
            for pid in order[self.offset:self.offset + k]:
                if pid in seen:
                    self.deferred.append(pid)
                else:
                    out.append(pid)
                    seen.add(pid)
            self.offset += k
            if self.offset == len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.take(1)[0]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "deferred": list(self.deferred),
                "num_pairs": len(self.pair_ids), "seed": self.seed, "shuffle": self.shuffle,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> str | None:
        """Continue from a saved position; returns a note for a `resume:` line when the data changed with the same
        pair count (both fingerprints known and different), else None.

        Raises:
            DataError: the pair count, seed or shuffle differ from the saved run's.
        """
        why = {"num_pairs": "the training pairs changed (the data, or a data setting that selects them)",
               "seed": "data.train.seed changed: set it back", "shuffle": "data.train.shuffle changed: set it back"}
        for k, mine in (("num_pairs", len(self.pair_ids)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[k] != mine:
                raise DataError(f"sampler state has {k} = {state[k]} but this run has {mine}: the saved position "
                                f"does not apply ({why[k]})")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.deferred = [int(p) for p in state.get("deferred", [])]
        saved = state.get("fingerprint") or ""
        if saved and self.fingerprint and saved != self.fingerprint:
            return (f"index fingerprint {saved[:12]} -> {self.fingerprint[:12]}: the meta-recipe, an annotation "
                    f"file (size or mtime), an image folder, the processor or a data setting differs; the same "
                    f"{len(self.pair_ids)} pairs, so the run continues from the saved position")
        return None


def _collate_pairs(pairs: list[PreferencePair | DataError]) -> list[PreferencePair | DataError]:
    return pairs


class _ReturnDataErrors(torch.utils.data.Dataset):
    """`dataset[i]`, or the DataError it raised, returned as the item: StepLoader raises it in the training process
    with its own one-line message (file:line: reason). Raised inside a DataLoader worker, torch would re-raise it as
    "Caught DataError in DataLoader worker process 0." with the worker's traceback in the message."""

    def __init__(self, dataset: torch.utils.data.Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> PreferencePair | DataError:
        try:
            return self.dataset[i]
        except DataError as e:
            return e


class _BatchIds:
    """A re-iterable wrapper so that a generator can serve as a DataLoader batch_sampler."""

    def __init__(self, make: Callable[[], Iterator[list[int]]]):
        self.make = make

    def __iter__(self):
        return self.make()


@dataclass
class StepData:
    """One optimizer step as this rank sees it.

    pair_ids: the step's global pairs (sampler order, the same on every rank); plan: what `plan_fn` returned;
    pairs: {pair_id: PreferencePair} for the ids `plan_fn` asked this rank to load; sampler_state: the sampler
    position after this step, the value to checkpoint (the sampler object itself runs ahead, prefetching).
    """

    pair_ids: list[int]
    plan: Any
    pairs: dict[int, PreferencePair]
    sampler_state: dict = field(default_factory=dict)


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}  # a run's (monitor.StopSignal.SIGNALS)


@contextlib.contextmanager
def workers_start_deaf():
    """Fork data workers inside this block: they start with the stop signals blocked (pending, not lost), so
    none reaches a worker before `ignore_stop_signals` (torch's worker handler re-raises a SIGTERM from elsewhere)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_stop_signals(*_) -> None:
    """A data worker's start (DataLoader's worker_init_fn, the index pool's initializer): the stop signals are
    its rank's (monitor.StopSignal), so SIGINT / SIGHUP / SIGUSR1 are ignored and SIGTERM ends the worker only when its
    parent sends it (the DataLoader's clean-up); torchrun and scancel signal every process of a rank's group."""
    for sig in STOP_SIGNALS - {signal.SIGTERM}:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, {signal.SIGTERM})  # threads started from here on inherit the mask

    def exit_on_parents_sigterm() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != os.getppid():
            pass
        os._exit(0)

    threading.Thread(target=exit_on_parents_sigterm, name="parent_sigterm", daemon=True).start()


class StepLoader:
    """Steps of `global_batch_size` pairs, endless: `plan_fn(global_pair_ids) -> (plan, ids_to_load)` runs in the
    main process on every rank (e.g. pack.plan_step and this rank's bins), and `num_workers` DataLoader workers decode
    only `ids_to_load`."""

    def __init__(self, dataset: PairDataset, sampler: PairSampler, global_batch_size: int,
                 plan_fn: Callable[[list[int]], tuple[Any, Sequence[int]]], num_workers: int = 0):
        self.dataset, self.sampler, self.global_batch_size = dataset, sampler, global_batch_size
        self.plan_fn, self.num_workers = plan_fn, num_workers

    def __iter__(self) -> Iterator[StepData]:
        pending: collections.deque = collections.deque()

        def steps() -> Iterator[list[int]]:
            while True:
                ids = self.sampler.take(self.global_batch_size)
                plan, load = self.plan_fn(ids)
                load = list(dict.fromkeys(int(i) for i in load))  # dummy bins repeat a pair: load it once
                pending.append((ids, plan, self.sampler.state_dict()))
                yield load

        loader = torch.utils.data.DataLoader(
            _ReturnDataErrors(self.dataset), batch_sampler=_BatchIds(steps), collate_fn=_collate_pairs,
            num_workers=self.num_workers, worker_init_fn=ignore_stop_signals,
        )
        with workers_start_deaf():
            batches = iter(loader)
        while True:  # endless; batches come back in order, so they match `pending` first-in first-out
            pairs = next(batches)
            error = next((p for p in pairs if isinstance(p, DataError)), None)
            if error is not None:
                del batches  # stop the workers now (the iterator's last reference), not while the process exits
                raise DataError(str(error)) from None
            ids, plan, state = pending.popleft()
            yield StepData(ids, plan, {p.pair_index: p for p in pairs}, state)


if __name__ == "__main__":  # the data report lives in mmpr_index.py (python mmpr_index.py)
    raise SystemExit("mmpr_data.py has no command line; the data report is: "
                     "python mmpr_index.py META_JSON --model MODEL_DIR")

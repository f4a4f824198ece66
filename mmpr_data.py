"""MMPR meta-recipe -> validated, cached, processor-expanded preference pairs for MPO.

Reads the InternVL / MMPR meta-recipe JSON (`{subset: {"root", "annotation", "repeat_time", ...}}`, the format of the
public MMPR v1.0-v1.2 releases on the HF hub, OpenGVLab/MMPR*) and produces, per preference pair, the chosen and
rejected token rows with their loss masks and the pair's image tensors, expanded by the model's own processor
(transformers `AutoProcessor` of the model directory: chat template, tokenizer, dynamic-resolution image processor).

Two stages:

1. `build_index(meta_path, processor, cfg.data) -> PairIndex`: reads every subset, validates every row (text, images,
   rendered template, lengths) and keeps, per pair, its source (subset, file, line, byte offset), its resolved image
   paths and grids, and the token lengths of prompt / chosen / rejected rows and image tokens: enough for pack.py to
   plan bins without opening an image. Dropped rows are counted by reason (`DROP_REASONS`); `data.strict` turns a
   drop into an error naming the file and line. Rows are checked in chunks by `data.num_workers` forked processes
   (rendering and image decoding are CPU bound) and settled in file order. The index is cached under
   `$HF_DATASETS_CACHE` (else `$HF_HOME/datasets`, else `~/.cache/huggingface/datasets`) in a folder named by a
   fingerprint of the meta file, the annotation files (size, mtime), the tokenizer / template / image processor, and
   the settings that change the index; written atomically, checksummed, rebuilt (with a warning) when corrupt.
2. `PairDataset(index, processor)[pair_id] -> pack.PreferencePair`: re-reads that row, decodes its images once (EXIF
   orientation, RGB), runs the image processor and tokenises both rows; the lengths are checked against the index.

Sampling: `PairSampler` (seeded per-epoch shuffle, identical on every rank, `state_dict()` = epoch + offset) and
`StepLoader` (a torch DataLoader with `data.num_workers` workers that decodes only the pairs of this rank's bins and
hands back the sampler state of each step for checkpoints). `load_splits(processor, cfg.data)` gives the train and
validation splits.

Text layout of a row (the Omni chat template, chat_template.jinja of the hub checkpoint):

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{images + question}<|im_end|>\\n      <- prompt
    <|im_start|>assistant\\n<think></think>                                                        <- prompt
    {response}<|im_end|>                                                           <- loss mask True
    \\n                                                                             <- row end, mask False

The prompt is exactly the template's generation prompt (thinking off for a response without reasoning, on for one
with `<think>...</think>`); the loss mask covers what the model generates after it: the response and `<|im_end|>`.

Row rules, where InternVL's loader (the MMPR authors', template-agnostic: its models have no reasoning tokens) and
NeMo-RL's (NVIDIA's MPO loader for this checkpoint, nemo_rl/data/processors.py::vlm_preference_preprocessor) differ,
and what is done here:

- Text as written. The Omni template removes `/think` and `/no_think` from system and user text wherever they occur
  (in `</think>`, a word, a URL: `https://x.com/thinking` becomes `https://x.coming`) and switches reasoning on or off
  for them; NeMo-RL trains on that rewritten text, InternVL on the text as written. Here the text is rendered as
  written (InternVL): the template never sees these substrings (`TextRenderer.render`), so MMPR-v1.2's R1 prompt
  ("...within <think> and </think> tags.") keeps its `</think>`, and a pair's reasoning mode comes from its responses
  only, never from a directive in its text. `<think>` / `</think>` in a question are tokenised as the reasoning tokens,
  as a tokenizer does at inference. Any other change a template makes to the system, question or response text is a
  counted drop (`template_rewrites_text`).
- One side reasons, the other not: kept (NeMo-RL; InternVL has no reasoning blocks). The two rows share the prompt up
  to `<|im_start|>assistant\\n`; the reasoning side continues `<think>\\n...\\n</think>\\n`, the plain side
  `<think></think>`, each the template's own rendering of its conversation, and the loss covers that opening too.
- A reasoning block is one block at the start of a response (or closed by `</think>` after the generation prompt
  opened it). `<think>` never closed (a generation cut off while reasoning, which both loaders keep and the template
  renders as a second `<think>` after a thinking-off prompt) is dropped as `unterminated_reasoning`: trained as a
  chosen response it teaches to stop mid-thought. Several blocks or text before `<think>` (the template silently keeps
  only its first block and the text after the last `</think>`) are `malformed_reasoning`.
- `<image_N>` (NeMo-RL) is the N-th image's placeholder, N = 1..n each once; `<image>` and no placeholder as before.
- `"root": null` or no root (InternVL's text-only subsets) is accepted; a row with a relative image path in such a
  subset is dropped as `no_image_root`, naming the subset.
- Video rows (a `video` field or a `<video>` placeholder) are dropped as `video_unsupported`: video preference pairs
  are not supported yet (NeMo-RL drops every row without exactly one image).
- `repeat_time` as InternVL (NeMo-RL ignores it); a subset it empties is a warning, an index it empties an error that
  says so.

Run the pre-flight report (rows read, pairs kept, drops by reason, length percentiles, per subset):

    python mmpr_data.py data/mmpr_sample/MMPR-sample/meta.json --model assets/tiny-omni [--max-samples N] [--json]

Tests: `pytest tests/test_mmpr_data.py`.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pack import PreferencePair

logger = logging.getLogger("omni_mpo.mmpr_data")

CACHE_VERSION = 2  # bump when the index layout or the validation rules change: old caches are then ignored
CACHE_PREFIX = "omni_mpo_mmpr_"

# Every reason a row can be dropped for, in the order the checks run (the first failing check names the drop).
DROP_REASONS = (
    "invalid_json",  # the line is not a JSON object
    "missing_field",  # question / chosen / rejected missing or not a string; image not a string or list of strings
    "video_unsupported",  # a `video` field or a <video> placeholder: video preference pairs are not supported yet
    "too_many_images",  # more images than data.train.max_images_per_row
    "placeholder_mismatch",  # <image> / <image_N> placeholders in the question, but not one per image
    "stray_media_token",  # a special-token string (<image>, <img>, <|im_end|>, ...) beyond the real placeholders
    "unterminated_reasoning",  # a response opens <think> and never closes it (a generation cut off while reasoning)
    "malformed_reasoning",  # a response with several reasoning blocks, or text before its <think>
    "empty_response",  # chosen or rejected is empty after stripping (or after its </think>)
    "no_image_root",  # relative image paths in a subset whose meta entry has no root (null or missing)
    "image_missing",  # an image file does not exist
    "image_unreadable",  # PIL cannot open or decode it
    "image_truncated",  # the file ends before the image data does
    "template_rewrites_text",  # the chat template would change the question, system or response text
    "too_long",  # a row is longer than data.max_seq_length tokens, expanded image tokens included
)
# Special tokens a row's text may contain: the reasoning delimiters (tokenised as the reasoning tokens, as at
# inference).
REASONING_TOKENS = ("<think>", "</think>")
# Reasoning switches the Omni chat template removes from system / user text wherever they occur (inside a word, a URL
# or `</think>` too) and obeys. In a row they are text: the renderer hides them from the template (TextRenderer.render).
TEMPLATE_DIRECTIVES = ("/no_think", "/think")
# NeMo-RL's numbered image placeholder; `<image_N>` stands for the N-th image of the row (1-based).
NUMBERED_IMAGE = re.compile(r"<image_(\d+)>")


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
    """Resolve a meta-recipe `root` / `annotation` path.

    Absolute paths are used as they are. A relative path is resolved against `data_root` when it is set; otherwise
    against the meta file's grandparent (the official layout `<dir>/MMPR-v1.2/meta.json` with paths
    `MMPR-v1.2/images/...`), then the meta file's own folder; the first that exists wins.

    Raises:
        DataError: no candidate exists; the message lists every path tried.
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
    tried = "\n  ".join(str(c) for c in candidates)
    raise DataError(f"{meta}: {kind} {path!r} not found; tried:\n  {tried}\n(set data.train.data_root to its base)")


def read_meta(meta_path: str | Path, data_root: str = "") -> list[Subset]:
    """Parse a meta-recipe JSON into `Subset`s, in file order, paths resolved (`resolve_path`).

    Required key per subset: `annotation`. `root` may be null or missing, as InternVL allows for text-only subsets:
    rows with relative image paths are then dropped (no_image_root). `repeat_time` (float >= 0, default 1) is
    honoured; `length` is compared with the rows read later; `data_augment: true` warns (not supported); other keys
    are ignored.

    Raises:
        DataError: invalid JSON (with file, line and column), a missing annotation, a root that is neither a string
            nor null, a bad repeat_time, a path not found.
    """
    meta_path = Path(meta_path)
    try:
        text = meta_path.read_text()
    except OSError as e:
        raise DataError(f"cannot read the meta-recipe {meta_path}: {e}") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(meta, dict) or not meta:
        raise DataError(f"{meta_path}: expected a non-empty JSON object {{subset: {{root, annotation, ...}}}}")
    subsets = []
    for name, spec in meta.items():
        if not isinstance(spec, dict):
            raise DataError(f"{meta_path}: subset {name!r} must be an object, got {type(spec).__name__}")
        if not isinstance(spec.get("annotation"), str):
            raise DataError(f"{meta_path}: subset {name!r} has no 'annotation' string (required: annotation)")
        if not isinstance(spec.get("root"), (str, type(None))):
            raise DataError(f"{meta_path}: subset {name!r}: root = {spec['root']!r} must be a folder path or null")
        r = spec.get("repeat_time", 1)
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
            raise DataError(f"{meta_path}: subset {name!r}: repeat_time = {r!r} must be a number >= 0")
        if spec.get("data_augment"):
            warnings.warn(f"{meta_path}: subset {name!r}: data_augment is not supported; images are not augmented",
                          stacklevel=2)
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
    if not path.is_file():
        raise _Drop("image_missing", f"{path} does not exist")
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


def image_grids(image_processor, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Patch grids (gh, gw) the image processor gives images of `sizes` [(height, width)] processed together."""
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import get_patch_grid_size

    ip = image_processor
    budget = image_patch_budget(ip, len(sizes))
    merge = round(1 / ip.downsample_ratio)
    return [get_patch_grid_size(h, w, ip.patch_size, merge, ip.min_num_patches, budget) for h, w in sizes]


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
    """Check the reasoning block of a stripped response; raises _Drop when it is not one block the template renders.

    Allowed: no reasoning token; `<think>` at the start, reasoning, one `</think>`, the answer; or reasoning, one
    `</think>`, the answer (the block opened by the thinking-on generation prompt). `<think>` without `</think>` is
    unterminated_reasoning (a generation cut off while reasoning); anything else (a second block, text before
    `<think>`) is malformed_reasoning: the template would silently drop the text outside its one block.
    """
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

        `<image_N>` placeholders become `<image>` with the N-th image at that place; relative image paths are joined
        to `root` (None: the subset `subset` has no root, so such a row is dropped). Raises _Drop (DROP_REASONS).
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
        image = row.get("image")
        images = [] if image is None else [image] if isinstance(image, str) else image
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
            raise _Drop("too_many_images", f"{len(images)} images > data.train.max_images_per_row = {max_images}")
        question, images = self._numbered_placeholders(question, images)
        n_ph = question.count(self.image_token)
        if n_ph and n_ph != len(images):
            raise _Drop("placeholder_mismatch", f"{n_ph} {self.image_token} placeholders for {len(images)} images")
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
        if root is None and (rel := [p for p in images if not Path(p).is_absolute()]):
            raise _Drop("no_image_root", f"subset {subset!r} has no root in the meta-recipe, so the relative image "
                                         f"path {rel[0]!r} cannot be resolved")
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
                                                f"{len(images)} images: expected each of <image_1>..<image_"
                                                f"{len(images)}> once")
        return NUMBERED_IMAGE.sub(self.image_token, question), [images[n - 1] for n in numbers]

    def render(self, system: str, question: str, n_images: int, chosen: str, rejected: str) -> tuple[str, str, str]:
        """Render the prompt and both responses with the chat template. Returns (prompt, chosen, rejected) strings.

        The prompt is the template's own generation prompt (thinking off / on) that the full rendered conversation
        starts with; the response string is the rest (`... <|im_end|>\\n`). When one response reasons and the other
        does not, the prompt is the part both generation prompts share (up to `<|im_start|>assistant\\n`) and each
        response starts with its own `<think>\\n` or `<think></think>` (NeMo-RL's rule).

        The row's text is rendered as written: `/think` and `/no_think` (TEMPLATE_DIRECTIVES) anywhere in it are
        hidden from the template while it renders (their '/' replaced by a character found in neither the row nor
        the template, put back afterwards), so the template neither removes them nor switches reasoning on or off
        for them; the reasoning mode of a pair comes from its responses only.

        Raises:
            _Drop: template_rewrites_text when the rendering lacks the system / question text or a response's
                reasoning or answer, as written.
            DataError: the template does not render a conversation as a generation prompt + response.
        """
        texts = (system, question, chosen, rejected)
        mark = "/"  # the identity, unless the row has a directive to hide
        if any(d in t for d in TEMPLATE_DIRECTIVES for t in texts):
            mark = next((m for m in self._marks if not any(m in t for t in texts)), "")
            if not mark:
                raise _Drop("template_rewrites_text", "the row uses every private-use character this renderer could "
                                                      "hide its /think and /no_think from the chat template with")

        def hide(text: str, keep_think_end: bool) -> str:
            for d in TEMPLATE_DIRECTIVES if mark != "/" else ():  # "/no_think" does not contain "/think": the order does not matter
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
                            f"for {n_images} images: {prompt!r}")
        for name, text in (("system", system), ("question", question)):
            if text.strip() and text.strip() not in prompt:
                raise _Drop("template_rewrites_text", f"the chat template changes the {name} text: {prompt!r}")
        for (_, rendered), (name, response) in zip(out, (("chosen", chosen), ("rejected", rejected)), strict=True):
            parts = response.split("</think>")
            for part in (parts[0].split("<think>")[-1].strip(), parts[-1].strip()) if len(parts) > 1 else parts:
                if part not in rendered:
                    raise _Drop("template_rewrites_text", f"the chat template changes the {name} text: {rendered!r}")
        return prompt, out[0][1], out[1][1]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS: the Omni processor tokenises with add_special_tokens=False)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

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
    """Validated pairs, columnar. Pair ids are positions 0..N-1 (a repeated row appears under several ids).

    Per pair ([N] int64 tensors): `subset_id` (into `subsets`), `line` (1-based line in the subset's annotation file),
    `offset` (its byte offset), `prompt_len` (tokens, expanded image tokens included; identical in both rows),
    `chosen_len` / `rejected_len` (full rows: prompt + response + trailing newline), `image_tokens` (sum of the
    pair's `<image>` tokens), `image_start` / `num_images` (a slice of the per-image arrays).
    Per image ([M]): `image_path_id` (into `image_paths`), `image_grid_hw` [M, 2] (16-px patches), `image_token_counts`.
    `stats[subset]`: rows_read, valid, pairs (kept after repeat_time and max_samples), dropped {reason: count},
    drop_examples {reason: ["file:line: detail", ...]} (first 3), first_drop {where, reason, detail} (if any),
    repeat_time; subsets after the one that reached max_samples have not_read set.
    `cache_status` ("hit", "built", "rebuilt: ...", "disabled") and `cache_dir` describe where it came from.
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
        """{pair_id: prompt tokens - 1}: the tokens the shared-prompt layout stores once per pair (pack.pack_shared's
        k = pack.shared_prefix_length is at least this: the last prompt token starts both responses), the
        `shared_lengths` of pack.plan_bins / plan_step; sizes planned with it are upper bounds of the packed spans."""
        if pair_ids is None:
            return {i: n - 1 for i, n in enumerate(self.prompt_len.tolist())}
        ids = [int(i) for i in pair_ids]
        return dict(zip(ids, (self.prompt_len[ids] - 1).tolist()))

    def source(self, i: int) -> str:
        """'annotation.jsonl:line' of pair i (for messages)."""
        return f"{self.annotation_files[int(self.subset_id[i])]}:{int(self.line[i])}"

    def images(self, i: int) -> list[str]:
        s, n = int(self.image_start[i]), int(self.num_images[i])
        return [self.image_paths[j] for j in self.image_path_id[s:s + n].tolist()]

    def state(self) -> dict:
        return {k: getattr(self, k) for k in self._SAVED}


def _cache_root() -> Path:
    """HF datasets' cache folder: $HF_DATASETS_CACHE, else $HF_HOME/datasets, else ~/.cache/huggingface/datasets."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "datasets"
    return Path("~/.cache/huggingface/datasets").expanduser()


def processor_identity(processor) -> str:
    """sha256 of what the index depends on in the processor: tokenizer (vocab, merges, added tokens), chat template
    and image-processor config; by content, so a copied model folder hits the same cache and an edited one misses."""
    tok = processor.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    h = hashlib.sha256()
    h.update((backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))).encode())
    h.update(str(processor.chat_template).encode())
    h.update(processor.image_processor.to_json_string().encode())
    h.update(type(processor).__name__.encode())
    return h.hexdigest()


def index_fingerprint(meta_path: str | Path, subsets: Sequence[Subset], processor, settings: dict) -> str:
    """sha256 of the meta file's content, each annotation file's path, size and mtime, each image root's mtime, the
    processor identity, the settings that change the index and CACHE_VERSION."""
    h = hashlib.sha256()
    h.update(Path(meta_path).read_bytes())
    for s in subsets:
        st = s.annotation.stat()
        root_mtime = s.root.stat().st_mtime_ns if s.root is not None else None
        h.update(f"|{s.name}|{s.annotation}|{st.st_size}|{st.st_mtime_ns}|{s.root}|{root_mtime}".encode())
    h.update(processor_identity(processor).encode())
    h.update(json.dumps({**settings, "cache_version": CACHE_VERSION}, sort_keys=True).encode())
    return h.hexdigest()


# Row checking runs in forked worker processes (data.num_workers >= 2) or in-process; this is what they share.
_CHUNK_CTX: dict[str, Any] = {}
CHUNK_ROWS = 256  # rows per task: large enough to amortise inter-process transfer, small enough to stop early


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
            prompt, r_c, r_r = text.render(system, question, len(imgs), chosen, rejected)
            grids = image_grids(ip, sizes)
            counts = [gh * gw // merge**2 for gh, gw in grids]
            # each <image> placeholder (1 token) becomes <img> + n x <image> + </img> (n + 2 tokens)
            p_len = len(text.encode(prompt)) + sum(n + 1 for n in counts)
            c_len, r_len = p_len + len(text.encode(r_c)), p_len + len(text.encode(r_r))
            if max(c_len, r_len) > max_len:
                raise _Drop("too_long", f"chosen {c_len} / rejected {r_len} tokens > data.max_seq_length = {max_len}")
            out.append((lineno, offset, dict(prompt_len=p_len, chosen_len=c_len, rejected_len=r_len, imgs=imgs,
                                             grids=grids, counts=counts)))
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


def _checked_rows(pool, workers: int, root: str, path: Path,
                  subset: str = "") -> Iterator[tuple[int, int, dict | tuple[str, str]]]:
    """`_check_chunk` results of a file in file order; a pool keeps 2 chunks per worker in flight."""
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


def _build(meta_path: Path, subsets: list[Subset], processor, data, max_samples: int, fingerprint: str) -> PairIndex:
    """Scan every subset, validate rows and compute lengths (see build_index)."""
    t0 = time.perf_counter()
    _CHUNK_CTX.clear()
    _CHUNK_CTX.update(text=TextRenderer(processor), ip=processor.image_processor,
                      max_images=data.train.max_images_per_row, max_len=data.max_seq_length)
    image_paths: list[str] = []
    path_ids: dict[str, int] = {}
    cols: dict[str, list] = collections.defaultdict(list)  # per-pair columns
    img_cols: dict[str, list] = collections.defaultdict(list)  # per-image columns
    stats: dict[str, dict] = {}
    pool = None
    if data.num_workers >= 2:  # forked workers inherit the processor (no pickling); rendering is CPU bound
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(data.num_workers, mp_context=multiprocessing.get_context("fork"))

    def drop(st: dict, where: str, reason: str, detail: str) -> None:
        if data.strict:
            raise DataError(f"{where}: row dropped ({reason}: {detail}) and data.strict = true")
        st["dropped"][reason] = st["dropped"].get(reason, 0) + 1
        st.setdefault("first_drop", {"where": where, "reason": reason, "detail": detail})
        ex = st["drop_examples"].setdefault(reason, [])
        if len(ex) < 3:
            ex.append(f"{where}: {detail}")

    try:
        for sid, sub in enumerate(subsets):
            st = {"rows_read": 0, "valid": 0, "pairs": 0, "dropped": {}, "drop_examples": {},
                  "repeat_time": sub.repeat_time}
            stats[sub.name] = st
            exact = sub.repeat_time == 1.0  # rows map 1:1 to pairs: reading can stop at max_samples
            valid: list[dict] = []
            stopped_early = False
            rows = _checked_rows(pool, data.num_workers, str(sub.root or ""), sub.annotation, sub.name)
            for lineno, offset, res in rows:  # settled in file order, so stats stop exactly where reading stops
                st["rows_read"] += 1
                if isinstance(res, tuple):
                    drop(st, f"{sub.annotation}:{lineno}", *res)
                    continue
                valid.append({**res, "line": lineno, "offset": offset})
                if exact and max_samples and len(cols["line"]) + len(valid) >= max_samples:
                    stopped_early = True
                    rows.close()
                    break
            if sub.length is not None and sub.length != st["rows_read"] and not stopped_early:
                warnings.warn(f"subset {sub.name!r}: the meta says length = {sub.length} but {sub.annotation} has "
                              f"{st['rows_read']} rows", stacklevel=3)
            st["valid"] = len(valid)
            keep = apply_repeat_time(len(valid), sub.repeat_time, data.train.seed, sub.name)
            if valid and not keep:
                warnings.warn(f"subset {sub.name!r}: repeat_time = {sub.repeat_time} keeps none of its {len(valid)} "
                              f"valid rows (floor({len(valid)} x {sub.repeat_time}) = 0)", stacklevel=3)
            if max_samples:
                keep = keep[: max(0, max_samples - len(cols["line"]))]
            first_image = {}  # valid row -> its first per-image slot (repeats share the slots)
            for k in keep:
                v = valid[k]
                if k not in first_image:
                    first_image[k] = len(img_cols["count"])
                    for p, g, n in zip(v["imgs"], v["grids"], v["counts"], strict=True):
                        if p not in path_ids:
                            path_ids[p] = len(image_paths)
                            image_paths.append(p)
                        img_cols["path_id"].append(path_ids[p])
                        img_cols["grid"].append(list(g))
                        img_cols["count"].append(n)
                for key in ("line", "offset", "prompt_len", "chosen_len", "rejected_len"):
                    cols[key].append(v[key])
                cols["subset_id"].append(sid)
                cols["image_tokens"].append(sum(v["counts"]))
                cols["image_start"].append(first_image[k])
                cols["num_images"].append(len(v["imgs"]))
            st["pairs"] = len(keep)
            if max_samples and len(cols["line"]) >= max_samples:
                for later in subsets[sid + 1:]:
                    stats[later.name] = {"rows_read": 0, "valid": 0, "pairs": 0, "dropped": {}, "drop_examples": {},
                                         "repeat_time": later.repeat_time, "not_read": "max_samples reached"}
                break
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        _CHUNK_CTX.clear()

    def t(key, src=cols):
        return torch.tensor(src[key], dtype=torch.int64)

    return PairIndex(
        meta_path=str(meta_path), fingerprint=fingerprint, subsets=[s.name for s in subsets],
        annotation_files=[str(s.annotation) for s in subsets], image_roots=[str(s.root or "") for s in subsets],
        image_paths=image_paths,
        subset_id=t("subset_id"), line=t("line"), offset=t("offset"), prompt_len=t("prompt_len"),
        chosen_len=t("chosen_len"), rejected_len=t("rejected_len"), image_tokens=t("image_tokens"),
        image_start=t("image_start"), num_images=t("num_images"), image_path_id=t("path_id", img_cols),
        image_grid_hw=t("grid", img_cols).reshape(-1, 2), image_token_counts=t("count", img_cols), stats=stats,
        build_seconds=time.perf_counter() - t0,
    )


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load_cache(folder: Path, fingerprint: str) -> PairIndex:
    """Read a cached index; raises (any exception) when it is missing, partial, corrupt or for another fingerprint."""
    manifest = json.loads((folder / "index.json").read_text())
    if manifest.get("fingerprint") != fingerprint or manifest.get("cache_version") != CACHE_VERSION:
        raise ValueError("fingerprint or cache version differs")
    if _sha256_file(folder / "index.pt") != manifest["sha256"]:
        raise ValueError("index.pt checksum mismatch")
    state = torch.load(folder / "index.pt", weights_only=True)
    index = PairIndex(**state)
    if len(index) != manifest["num_pairs"]:
        raise ValueError(f"{len(index)} pairs, manifest says {manifest['num_pairs']}")
    return index


def _write_cache(folder: Path, index: PairIndex) -> None:
    """Write index.pt + index.json into a temporary folder, then rename it into place (atomic on POSIX)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        torch.save(index.state(), tmp / "index.pt")
        manifest = {"fingerprint": index.fingerprint, "cache_version": CACHE_VERSION, "num_pairs": len(index),
                    "sha256": _sha256_file(tmp / "index.pt"), "meta_path": index.meta_path}
        (tmp / "index.json").write_text(json.dumps(manifest, indent=1))
        os.rename(tmp, folder)  # fails if another process renamed its (identical) copy first: keep that one
    except OSError as e:
        if not (folder / "index.json").is_file():
            logger.warning("could not write the MMPR index cache %s: %s", folder, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_or_build(meta_path, subsets, processor, data, max_samples, fingerprint, folder, use_cache, write):
    if not use_cache:
        return _build(meta_path, subsets, processor, data, max_samples, fingerprint)
    status = "built"
    if folder.exists():
        try:
            index = _load_cache(folder, fingerprint)
            index.cache_status, index.cache_dir = "hit", str(folder)
            return index
        except Exception as e:  # a partial or corrupt cache must never stop a run: report, remove, rebuild
            status = f"rebuilt: the cache was unreadable ({type(e).__name__}: {e})"
            warnings.warn(f"MMPR index cache {folder} is corrupt or partial ({type(e).__name__}: {e}); rebuilding",
                          stacklevel=3)
            aside = folder.parent / f".{folder.name}.corrupt-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(folder, aside)
                shutil.rmtree(aside, ignore_errors=True)
            except OSError:
                pass  # another rank moved it already
    index = _build(meta_path, subsets, processor, data, max_samples, fingerprint)
    if write:
        _write_cache(folder, index)
    index.cache_status, index.cache_dir = status, str(folder)
    return index


def build_index(meta_path: str | Path, processor, data, *, max_samples: int | None = None,
                use_cache: bool = True) -> PairIndex:
    """Validated, cached index of the pairs of a meta-recipe (see the module docstring).

    Args:
        meta_path: the MMPR meta-recipe JSON.
        processor: the model's transformers processor (`AutoProcessor.from_pretrained(model_dir)`).
        data: the config's data section (config.DataConfig, `cfg.data`): max_seq_length, strict, num_workers (>= 2:
            forked processes that check rows while indexing), train.data_root / seed / max_images_per_row /
            max_samples.
        max_samples: keep the first N valid pairs in meta/file order (after repeat_time): a quick first light, not a
            random sample. Default data.train.max_samples; 0 = all.
        use_cache: read / write the cache (see `_cache_root`).

    With torch.distributed initialised, global rank 0 builds and writes the cache while the others wait, then read
    it (or build it themselves when the cache folder is not shared with rank 0).

    Raises:
        DataError: meta-recipe problems (invalid JSON with line and column, missing keys, paths not found with every
            path tried), no valid pair left, or with data.strict the first dropped row (file and line).
    """
    meta_path = Path(meta_path)
    max_samples = data.train.max_samples if max_samples is None else max_samples
    subsets = read_meta(meta_path, data.train.data_root)
    settings = {"max_samples": max_samples, "max_seq_length": data.max_seq_length, "seed": data.train.seed,
                "max_images_per_row": data.train.max_images_per_row, "data_root": data.train.data_root}
    fingerprint = index_fingerprint(meta_path, subsets, processor, settings)
    folder = _cache_root() / f"{CACHE_PREFIX}{fingerprint[:16]}"
    args = (meta_path, subsets, processor, data, max_samples, fingerprint, folder, use_cache)
    dist = torch.distributed
    if use_cache and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # rank 0 builds; its outcome (or its error) is broadcast so that no rank waits forever on a failed build
        msg: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                index = _load_or_build(*args, write=True)
            except Exception as e:
                msg[0] = f"{type(e).__name__}: {e}"
                dist.broadcast_object_list(msg, src=0)
                raise
            dist.broadcast_object_list(msg, src=0)
        else:
            dist.broadcast_object_list(msg, src=0)
            if msg[0] is not None:
                raise DataError(f"rank 0 failed to build the MMPR index: {msg[0]}")
            index = _load_or_build(*args, write=False)
    else:
        index = _load_or_build(*args, write=True)
    if data.strict:  # a cached index keeps its drops: strict must fail on a cache hit as on a build
        first = next((st["first_drop"] for st in index.stats.values() if "first_drop" in st), None)
        if first is not None:
            raise DataError(f"{first['where']}: row dropped ({first['reason']}: {first['detail']}) and "
                            f"data.strict = true (cached index {index.cache_dir})")
    if len(index) == 0:
        emptied = {name: st for name, st in index.stats.items() if st.get("valid")}
        if emptied:  # valid rows, but repeat_time < 1 kept none of them
            what = ", ".join(f"{name!r}: repeat_time {st['repeat_time']} x {st['valid']} valid rows -> 0 pairs"
                             for name, st in emptied.items())
            raise DataError(f"{meta_path}: no preference pair: repeat_time kept none of the valid rows ({what}); "
                            f"drops: {summary_drops(index)}")
        raise DataError(f"{meta_path}: no valid preference pair; drops: {summary_drops(index)}")
    return index


def summary_drops(index: PairIndex) -> dict[str, int]:
    """Total drop counts by reason over all subsets."""
    total: collections.Counter = collections.Counter()
    for st in index.stats.values():
        total.update(st["dropped"])
    return dict(total)


# ======================================================================================================================
# Splits


def split_validation(index: PairIndex, size: float, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, validation ids): `size` a fraction (< 1) or a pair count (>= 1) taken at random (seed).

    Repeats of one annotation row (repeat_time > 1) go to the same side, so validation never sees a training row.
    """
    groups: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for i, key in enumerate(zip(index.subset_id.tolist(), index.line.tolist(), strict=True)):
        groups[key].append(i)
    keys = list(groups)
    order = np.random.default_rng([seed, 1]).permutation(len(keys))
    target = int(size) if size >= 1 else math.floor(size * len(index))
    val: list[int] = []
    for j in order:
        if len(val) >= target:
            break
        val.extend(groups[keys[j]])
    if len(val) >= len(index) and target > 0:
        raise DataError(f"data.train.split_validation_size = {size} leaves no training pairs of {len(index)}")
    taken = set(val)
    return [i for i in range(len(index)) if i not in taken], sorted(val)


@dataclass
class Split:
    """A split: the index it draws from and its pair ids (a subset of 0..len(index)-1)."""

    index: PairIndex
    pair_ids: list[int]


def load_splits(processor, data) -> tuple[Split, Split | None]:
    """The train split and the validation split (None when neither source is configured) of the data section `data`
    (config.DataConfig, `cfg.data`).

    Validation comes from data.validation.data_path (its own meta, data.validation.max_samples) when set, else from
    data.train.split_validation_size pairs of the train index (seed data.train.seed).
    """
    train = build_index(data.train.data_path, processor, data)
    if data.validation.data_path:
        if data.train.split_validation_size:
            warnings.warn("data.validation.data_path is set: data.train.split_validation_size is ignored",
                          stacklevel=2)
        val = build_index(data.validation.data_path, processor, data, max_samples=data.validation.max_samples)
        return Split(train, list(range(len(train)))), Split(val, list(range(len(val))))
    if data.train.split_validation_size:
        tr, va = split_validation(train, data.train.split_validation_size, data.train.seed)
        return Split(train, tr), Split(train, va)
    return Split(train, list(range(len(train)))), None


# ======================================================================================================================
# Dataset


class PairDataset(torch.utils.data.Dataset):
    """`dataset[pair_id] -> PreferencePair` for the pairs of a `PairIndex` (pair_id in 0..len(index)-1).

    Re-reads the row from its annotation file, renders it exactly as the index did, decodes the images once per pair
    and runs the model's image processor on them (`pixel_values` [sum gh*gw, 768] float32, `image_grid_hw` [n, 2]
    int64, `image_token_counts` [n] int64), expands each `<image>` with the processor (`<img>` + n x `<image>` +
    `</img>`) and tokenises. chosen_ids / rejected_ids: [L] int64 (prompt + response + newline); loss masks: [L] bool,
    True on the response and its `<|im_end|>`.

    Raises:
        DataError: the row no longer matches the index (annotation or image changed since the index was built; the
            message names the file and line and the cache folder to delete).
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
                            f"index was built: delete {ix.cache_dir or 'the cache'} and restart") from None
        return RowText(prompt, r_c, r_r, images)

    def __getitem__(self, i: int) -> PreferencePair:
        i = int(i)
        ix, row = self.index, self._row_text(i)
        if row.images:
            try:
                pil = [load_image(p) for p in row.images]
            except _Drop as d:
                raise DataError(f"{ix.source(i)}: {d}; the image changed since the index was built") from None
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
                            f"{expect}; the data or processor changed since it was built: delete "
                            f"{ix.cache_dir or 'the cache'} and restart")
        return PreferencePair(
            pair_index=i, chosen_ids=rows["chosen"][0], rejected_ids=rows["rejected"][0],
            chosen_loss_mask=rows["chosen"][1], rejected_loss_mask=rows["rejected"][1],
            pixel_values=pixel_values, image_grid_hw=grid, image_token_counts=counts,
        )


# ======================================================================================================================
# Sampling and loading


class PairSampler:
    """The global pair order: a seeded shuffle per epoch, identical on every rank; resumable.

    Epoch e is `pair_ids` permuted by numpy's PCG64 seeded with (seed, e) (or kept in order with shuffle=False).
    `take(n)` returns the next n pair ids, continuing into the next epoch when one ends, and never the same pair twice:
    a step straddling an epoch boundary would otherwise draw a pair at the end of one epoch and again at the start of
    the next, and the step is planned and trained by pair id (one pair, one pair_index). Such a repeat is deferred: it
    opens the next step instead (still once per epoch pass, one step late), so every step trains n distinct pairs.
    `state_dict()` = {epoch, offset (pairs of the epoch already taken), deferred (pair ids waiting for the next step),
    num_pairs, seed, shuffle}; `load_state_dict` continues from there.
    """

    def __init__(self, pair_ids: Sequence[int], seed: int, shuffle: bool = True):
        if not len(pair_ids):
            raise DataError("PairSampler: no pairs to sample from")
        self.pair_ids = list(pair_ids)
        self.seed, self.shuffle = seed, shuffle
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
                "num_pairs": len(self.pair_ids), "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position. Raises DataError if the data or seed differ from the saved run's."""
        for k, mine in (("num_pairs", len(self.pair_ids)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[k] != mine:
                raise DataError(f"sampler state has {k} = {state[k]} but this run has {mine}: the data or "
                                "data.train.seed changed, so the saved position does not apply")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.deferred = [int(p) for p in state.get("deferred", [])]


def _collate_pairs(pairs: list[PreferencePair]) -> list[PreferencePair]:
    return pairs


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


def _ignore_sigint(worker_id: int) -> None:
    """DataLoader workers ignore SIGINT: a Ctrl-C reaches the whole process group, and the training process, not its
    workers, decides to finish the step and save (monitor.StopSignal)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


class StepLoader:
    """Steps of `global_batch_size` pairs; each rank decodes only the pairs of its own bins, in DataLoader workers.

    plan_fn(global_pair_ids) -> (plan, ids_to_load) runs in the main process on every rank with the same input:
    typically `plan = pack.plan_step(index.lengths(ids), cfg.packing, dp)` and ids_to_load = the pair ids of
    plan.ranks[dp_rank]. The DataLoader (num_workers workers, prefetching) loads those ids with `dataset`.
    Iterating is endless (epochs continue); stop after the last step.
    """

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
            self.dataset, batch_sampler=_BatchIds(steps), collate_fn=_collate_pairs, num_workers=self.num_workers,
            worker_init_fn=_ignore_sigint,
        )
        for pairs in loader:  # batches come back in order, so they match `pending` first-in first-out
            ids, plan, state = pending.popleft()
            yield StepData(ids, plan, {p.pair_index: p for p in pairs}, state)


# ======================================================================================================================
# Report


def _percentiles(x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {}
    xf = x.double()
    q = torch.quantile(xf, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"min": int(x.min()), "p50": q[0], "p90": q[1], "p99": q[2], "max": int(x.max()),
            "mean": round(float(xf.mean()), 2)}


def report(index: PairIndex) -> dict:
    """Per subset and in total: rows read, valid rows, pairs kept, drops by reason (with examples) and length
    percentiles in tokens (prompt, image tokens, chosen row, rejected row). JSON-serialisable."""
    def lengths(mask):
        return {k: _percentiles(getattr(index, col)[mask]) for k, col in
                (("prompt", "prompt_len"), ("image_tokens", "image_tokens"), ("chosen", "chosen_len"),
                 ("rejected", "rejected_len"))}

    subsets = {}
    for sid, name in enumerate(index.subsets):
        st = index.stats.get(name, {})
        subsets[name] = {**st, "lengths": lengths(index.subset_id == sid)}
    total = {"rows_read": sum(s.get("rows_read", 0) for s in index.stats.values()),
             "valid": sum(s.get("valid", 0) for s in index.stats.values()), "pairs": len(index),
             "dropped": summary_drops(index), "lengths": lengths(torch.ones(len(index), dtype=torch.bool))}
    return {"meta_path": index.meta_path, "num_pairs": len(index), "cache": index.cache_status,
            "cache_dir": index.cache_dir, "build_seconds": round(index.build_seconds, 3), "subsets": subsets,
            "total": total}


def format_report(rep: dict) -> str:
    """The `report` as text: a table of counts, then length percentiles and drop examples per subset."""
    lines = [f"MMPR index {rep['meta_path']}: {rep['num_pairs']} pairs (cache {rep['cache']}"
             + (f", {rep['cache_dir']}" if rep["cache_dir"] else "") + ")",
             f"{'subset':<56} {'rows':>7} {'valid':>7} {'pairs':>7} {'dropped':>8}"]
    for name, s in [*rep["subsets"].items(), ("TOTAL", rep["total"])]:
        lines.append(f"{name[:56]:<56} {s.get('rows_read', 0):>7} {s.get('valid', 0):>7} {s.get('pairs', 0):>7} "
                     f"{sum(s.get('dropped', {}).values()):>8}" + (f"  ({s['not_read']})" if "not_read" in s else ""))
        for reason, n in sorted(s.get("dropped", {}).items()):
            ex = s.get("drop_examples", {}).get(reason, [])
            lines.append(f"    dropped {reason}: {n}" + (f"  e.g. {ex[0]}" if ex else ""))
        for k, p in s.get("lengths", {}).items():
            if p:
                lines.append(f"    {k:<12} min {p['min']:>6}  p50 {p['p50']:>8.1f}  p90 {p['p90']:>8.1f}  "
                             f"p99 {p['p99']:>8.1f}  max {p['max']:>6}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from config import Config

    ap = argparse.ArgumentParser(description="Validate an MMPR meta-recipe for a model and print the pre-flight "
                                             "report (rows, pairs, drops by reason, length percentiles).")
    ap.add_argument("meta", help="MMPR meta-recipe JSON")
    ap.add_argument("--model", required=True, help="model directory (tokenizer, chat template, processor)")
    ap.add_argument("--max-samples", type=int, default=0, help="keep the first N valid pairs (0 = all)")
    ap.add_argument("--max-seq-length", type=int, default=Config().data.max_seq_length, help="tokens per row")
    ap.add_argument("--data-root", default="", help="base of relative root/annotation paths")
    ap.add_argument("--num-workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes checking rows (render, tokenise, decode images); < 2 = in-process")
    ap.add_argument("--no-cache", action="store_true", help="neither read nor write the index cache")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():  # else transformers takes it for a hub id and retries
        raise DataError(
            f"--model {args.model!r}: no config.json there (a local model directory with the tokenizer, "
            f"chat template and processor; relative paths are relative to {os.getcwd()})"
        )
    from transformers import AutoProcessor

    data = Config().data
    data.max_seq_length, data.num_workers = args.max_seq_length, args.num_workers
    data.train.data_root = args.data_root
    processor = AutoProcessor.from_pretrained(args.model)
    index = build_index(args.meta, processor, data, max_samples=args.max_samples, use_cache=not args.no_cache)
    rep = report(index)
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    import config as config_mod

    config_mod.quiet_known_warnings()  # OMNI_MPO_SHOW_WARNINGS=1 shows them
    try:
        sys.exit(main())
    except DataError as e:  # a bad meta-recipe or path: the message names the file; a traceback would bury it
        sys.exit(f"error: {e}")

"""The MMPR data reader's rules: the meta-recipe (`read_meta`), a record's fields (`TextRenderer.parse`, `parse_audio`),
its rendering (`TextRenderer.render`); `checked_records` applies them to a file, with each image, video and clip decoded
and counted by mmpr_media.py. A failing record is a counted drop (DROP_REASONS), a bad meta-recipe a DataError.
Why each rule is as it is: docs/DESIGN.md, "Data: the record rules".

A record rendered by the Omni chat template (the hub checkpoint's chat_template.jinja):

    <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{images + question}<|im_end|>\n      <- prompt
    <|im_start|>assistant\n<think></think>                                                        <- prompt
    {response}<|im_end|>                                                           <- loss mask True
    \n                                                                             <- sequence end, mask False
"""

from __future__ import annotations

import collections
import concurrent.futures.process
import contextlib
import difflib
import hashlib
import json
import math
import os
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmpr_media import (
    VIDEO_DROP_REASONS,
    Drop,
    audio_samples,
    audio_token_count,
    image_grids,
    load_audio,
    load_frames,
    load_image,
    video_counts,
)

# Every reason a record can be dropped for, in the order the checks run (the first failing check names the drop).
DROP_REASONS = (
    "invalid_json",  # not a JSON object of Unicode text (non-UTF-8 bytes; a lone \ud800-\udfff escape)
    "missing_field",  # question / chosen / rejected missing or not a string; image, video or audio not a path or paths
    # (or under a key this reader does not read: images, videos, audios)
    "too_many_images",  # more images than data.train.max_images_per_row
    "placeholder_mismatch",  # <image> / <image_N> (<audio>) placeholders, but not one per image (clip); <video> not
    # one per video, or before an <image>, or missing beside <image> placeholders
    "stray_media_token",  # a special-token string (<image>, <img>, <|im_end|>, ...) beyond the real placeholders, or
    # <audio> outside the question
    "unterminated_reasoning",  # a response opens <think> and never closes it
    "malformed_reasoning",  # several reasoning blocks, or text before <think>
    "empty_response",  # chosen or rejected is empty after stripping (or after its </think>)
    "identical_responses",  # the same text after stripping, or (checked when rendering) the same rendered text
    "no_image_root",  # relative image paths in a subset whose meta entry has no root
    "image_outside_root",  # a relative image path whose `..` parts leave the subset's root
    "image_missing",  # an image file does not exist
    "image_unreadable",  # it cannot be opened (a symbolic link loop, no permission) or PIL cannot decode it
    "image_truncated",  # the file ends before the image data does
    "image_unprocessable",  # the image processor cannot size it: too thin or too wide for the patch budget
    *VIDEO_DROP_REASONS,  # video_missing, video_unreadable, too_many_frames (mmpr_media.py)
    "no_audio_root",  # relative audio paths in a subset whose meta entry has no root
    "audio_outside_root",  # a relative audio path whose `..` parts leave the subset's root
    "audio_missing",  # an audio file does not exist
    "audio_unreadable",  # it cannot be opened or decoded (soundfile; e.g. a video container), or holds NaN / inf
    "audio_empty",  # it decodes to zero samples
    "audio_too_long",  # longer than data.train.max_audio_seconds, or its tokens alone > data.max_seq_length (from
    # the file's header, before decoding)
    "template_rewrites_text",  # the chat template would change the question, system or response text
    "too_long",  # a sequence is longer than data.max_seq_length tokens, expanded image and audio tokens included
)
REASONING_TOKENS = ("<think>", "</think>")  # special tokens a record's text may contain
TEMPLATE_DIRECTIVES = ("/no_think", "/think")  # what the Omni template strips and obeys; hidden from it here
_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone UTF-16 surrogate: valid JSON ("\ud83d"), not Unicode text
NUMBERED_IMAGE = re.compile(r"<image_(\d+)>")  # NeMo-RL's placeholder for the N-th image (1-based)
OTHER_MEDIA_KEYS = ("images", "videos", "audios")  # other formats' media keys (e.g. ms-swift's): a drop, not ignored
AUDIO_PLACEHOLDER = "<audio>"  # a record's placeholder for its next clip; rendered as the processor's `<so_embedding>`
# A subset's keys: those read here and InternVL's other ones (no effect here); any other key warns (e.g. repeat_times).
META_KEYS = ("annotation", "root", "repeat_time", "length", "data_augment", "max_dynamic_patch", "min_dynamic_patch",
             "dynamic_image_size", "max_num_image", "min_num_image", "is_chinese", "sampling_method")


def plural(n: int, noun: str) -> str:
    """plural(1, "image") = "1 image", plural(2, "image") = "2 images", plural(2, "microbatch") = "2 microbatches"."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "x", "ch", "sh")) else f"{n} {noun}s"


class DataWarning(UserWarning):
    """A data notice that does not stop the run (an unknown meta key, a subset that adds no pair, a rebuilt cache)."""


@contextlib.contextmanager
def data_warnings(notes: list[str]) -> Iterator[list[str]]:
    """Within the block, DataWarning texts are appended to `notes` (each once) instead of printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DataWarning)
        yield notes
    for w in caught:
        if not issubclass(w.category, DataWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        elif str(w.message) not in notes:
            notes.append(str(w.message))


class DataError(ValueError):
    """Bad meta-recipe, path or model directory, or (with data.strict) a dropped record; the message names the file."""


# ---- Meta-recipe ----------
@dataclass(frozen=True)
class Subset:
    """One meta-recipe entry with its paths resolved."""

    name: str
    root: Path | None  # image folder; relative record image paths are relative to it (None: no root in the meta)
    annotation: Path  # JSONL file
    repeat_time: float = 1.0
    length: int | None = None  # record count the meta claims (informational, as in InternVL)


def resolve_path(path: str, meta_path: str | Path, data_root: str = "", want_dir: bool = False) -> Path:
    """A meta-recipe path: absolute as is; relative to `data_root` when set, else to the first that exists of the meta
    file's grandparent (`<dir>/MMPR-v1.2/meta.json` naming `MMPR-v1.2/images`) and its folder."""
    p = Path(path).expanduser()
    meta = Path(meta_path).resolve()
    if p.is_absolute():
        candidates = [p]
    elif data_root:
        candidates = [Path(data_root).expanduser().resolve() / p]
    else:
        candidates = [meta.parent.parent / p, meta.parent / p]
    for c in candidates:
        if c.is_dir() if want_dir else c.is_file():
            return c
    kind = "folder" if want_dir else "file"
    if (wrong := next((c for c in candidates if c.exists()), None)) is not None:
        raise DataError(f"{meta}: {kind} {path!r}: {wrong} is " + ("a file" if want_dir else "a directory"))
    tried = ", ".join(str(c) for c in candidates)
    raise DataError(f"{meta}: {kind} {path!r} not found (tried {tried}; set data.train.data_root to its base)")


def _is_record(value: Any) -> bool:
    """True for an annotation record (or its JSON text): an object with chosen and rejected responses."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return False
    return isinstance(value, dict) and any(k in value for k in ("chosen", "chosen_response")) and any(
        k in value for k in ("rejected", "rejected_response"))


def read_meta(meta_path: str | Path, data_root: str = "") -> list[Subset]:
    """The meta-recipe JSON {subset: {annotation, root, repeat_time, ...}} as `Subset`s in file order, resolved."""
    if not str(meta_path).strip():
        raise DataError("the meta-recipe path is empty: set data.train.data_path (or mmpr_index.py's META) to one")
    meta_path = Path(meta_path)
    try:
        raw = meta_path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read the meta-recipe {meta_path}: {e}") from None
    duplicates: list[str] = []  # JSON keeps the last of equal keys: a subset would vanish without a word

    def keep_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        seen: set[str] = set()
        duplicates.extend(k for k, _ in pairs if k in seen or seen.add(k))
        return dict(pairs)

    meta, error = None, None
    try:
        meta = json.loads(raw.decode("utf-8-sig"), object_pairs_hook=keep_duplicates)  # a byte-order mark is tolerated
    except ValueError as e:  # UnicodeDecodeError, json.JSONDecodeError
        error = e
    if _is_record(meta) or error is not None and _is_record(raw.partition(b"\n")[0].decode("utf-8-sig", "replace")):
        raise DataError(f"{meta_path}: an annotation file (JSON Lines), not a meta-recipe: pass the meta-recipe")
    if isinstance(error, UnicodeDecodeError):
        raise DataError(f"{meta_path}: not UTF-8 (byte 0x{raw[error.start]:02x} at offset {error.start})")
    if isinstance(error, json.JSONDecodeError):
        raise DataError(f"{meta_path}:{error.lineno}:{error.colno}: invalid JSON: {error.msg}")
    if not isinstance(meta, dict) or not meta:
        raise DataError(f"{meta_path}: expected a non-empty JSON object {{subset: {{root, annotation, ...}}}}")
    if duplicates:
        raise DataError(f"{meta_path}: key {duplicates[0]!r} appears more than once")
    subsets = []
    for name, spec in meta.items():
        where = f"{meta_path}: subset {name!r}"
        if not isinstance(spec, dict):
            raise DataError(f"{where}: must be an object, got {type(spec).__name__}")
        if unknown := [k for k in spec if k not in META_KEYS]:
            hints = {k: difflib.get_close_matches(k, META_KEYS, n=1) for k in unknown}
            listed = ", ".join(f"{k!r}" + (f" (did you mean {hints[k][0]!r}?)" if hints[k] else "") for k in unknown)
            warnings.warn(f"{where}: unknown keys ignored: {listed}", DataWarning, stacklevel=2)
        r = spec.get("repeat_time", 1)
        for key, ok, want in (
                ("annotation", isinstance(spec.get("annotation"), str), "a file path"),
                ("root", isinstance(spec.get("root"), (str, type(None))), "a folder path or null"),
                ("repeat_time", not isinstance(r, bool) and isinstance(r, (int, float)) and math.isfinite(r) and r >= 0,
                 "a number >= 0")):
            if not ok:
                raise DataError(f"{where}: {key} = {spec.get(key)!r} must be {want}")
        if spec.get("data_augment"):
            warnings.warn(f"{where}: data_augment is not supported; images are not augmented", DataWarning,
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
    """Record positions 0..n-1 a subset contributes, as InternVL's `repeat_time`, in file order: floor(r) full copies
    plus a random floor(n*(r - floor(r))) records, seeded by (seed, subset name), so the same on every rank and run."""
    whole = math.floor(repeat_time)
    extra = math.floor(n * (repeat_time - whole) + 1e-9)
    rng = random.Random(f"{seed}:{name}")  # str seeds hash deterministically (not PYTHONHASHSEED dependent)
    return list(range(n)) * whole + sorted(rng.sample(range(n), extra))


# ---- Text: validation, chat-template rendering, tokenisation ----------
def _as_str(record: dict, *keys: str) -> str | None:
    k = next((k for k in keys if k in record), None)
    return record[k] if k is not None and isinstance(record[k], str) else None


def check_reasoning(name: str, response: str) -> None:
    """Drop unless `response` has no reasoning block or one at its start (a lone `</think>`: the prompt opened it)."""
    opens, closes = response.count("<think>"), response.count("</think>")
    if opens and not closes:
        raise Drop("unterminated_reasoning", f"{name} opens <think> and never closes it")
    if closes > 1 or opens > 1 or opens and not response.startswith("<think>"):
        raise Drop("malformed_reasoning", f"{name}: {opens} <think> and {closes} </think>, not one block at its start")


class TextRenderer:
    """Validates a record's fields and renders them with the processor's chat template (one instance per processor)."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token = processor.image_token  # "<image>"
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.video_token = getattr(processor, "video_token", None) or "<video>"
        self.audio_token = getattr(processor, "audio_token", None) or "<so_embedding>"
        specials = {t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special}
        self.forbidden = sorted(specials - set(REASONING_TOKENS) - {self.image_token}, key=len, reverse=True)
        # characters absent from the template, to stand in for a directive's '/' while the template renders
        template = str(processor.chat_template)
        self._marks = [chr(c) for c in range(0xE000, 0xF900) if chr(c) not in template][:64]

    def _stray(self, text: str, allow_image: bool) -> str | None:
        for t in self.forbidden:
            if t in text and not (allow_image and t == self.video_token):
                return t
        return None if allow_image else next((t for t in (self.image_token, AUDIO_PLACEHOLDER) if t in text), None)

    def parse(self, record: Any, root: Path | None, max_images: int,
              subset: str = "") -> tuple[str, str, str, str, list[str], str | list[str] | None]:
        """Check a JSON record: (system, question, chosen, rejected, image paths in placeholder order, video: a file
        path, a list of frame paths or None), the responses stripped, `<image_N>` turned into `<image>`, relative paths
        joined to `root`, the question's placeholders completed for a video (`_place_video`)."""
        if not isinstance(record, dict):
            raise Drop("invalid_json", f"expected a JSON object, got {type(record).__name__}")
        system = record.get("system_prompt", record.get("system"))
        fields = {"question": _as_str(record, "question"), "chosen": _as_str(record, "chosen", "chosen_response"),
                  "rejected": _as_str(record, "rejected", "rejected_response"),
                  "system": "" if system is None else system if isinstance(system, str) else None}
        for name, v in fields.items():
            if v is None:
                raise Drop("missing_field", f"{name!r} is missing or not a string")
            if (m := _SURROGATE.search(v)) is not None:
                raise Drop("invalid_json", f"{name!r}: lone surrogate {ascii(m.group())} at character {m.start()}")
        question, chosen, rejected, system = fields.values()
        if (key := next((k for k in OTHER_MEDIA_KEYS if k in record), None)) is not None:  # else silently text-only
            raise Drop("missing_field", f"{key!r} is not read: name the field {key[:-1]!r}")
        image = record.get("image")
        images = [] if image is None or image == "" else [image] if isinstance(image, str) else image
        if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
            raise Drop("missing_field", f"'image' must be a path or a list of paths, got {image!r}")
        video = record.get("video")
        video = None if video in (None, "", []) else video
        if video is not None and not (isinstance(video, str) or isinstance(video, list) and all(
                isinstance(v, str) and v for v in video)):
            raise Drop("missing_field", f"'video' must be a path or a list of frame paths, got {video!r}")
        if len(images) > max_images:
            raise Drop("too_many_images", f"{plural(len(images), 'image')} > data.train.max_images_per_row = "
                                           f"{max_images}")
        question, images = self._numbered_placeholders(question, images)
        n_ph = question.count(self.image_token)
        if n_ph and n_ph != len(images):
            raise Drop("placeholder_mismatch", f"{plural(n_ph, self.image_token + ' placeholder')} for "
                                                f"{plural(len(images), 'image')}")
        question = self._place_video(question, len(images), video is not None)
        for name, text in (("question", question), ("system", system), ("chosen", chosen), ("rejected", rejected)):
            if (t := self._stray(text, name == "question")) is not None:
                raise Drop("stray_media_token", f"{name} contains {t!r}")
        chosen, rejected = chosen.strip(), rejected.strip()
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            check_reasoning(name, text)
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            if not text.split("</think>")[-1].strip():
                raise Drop("empty_response", f"{name} is empty")
        if chosen == rejected:
            raise Drop("identical_responses", "chosen and rejected are the same text")
        frames = [] if video is None else [video] if isinstance(video, str) else video
        if root is None and (rel := [p for p in images + frames if not Path(p).is_absolute()]):
            raise Drop("no_image_root", f"subset {subset!r} has no root for {rel[0]!r}")
        for p in images + frames:
            if not Path(p).is_absolute() and os.path.normpath(p).split(os.sep)[0] == os.pardir:
                raise Drop("image_outside_root", f"{p!r} leaves the root {str(root)!r}")
        if root is not None and video is not None:
            video = str(root / video) if isinstance(video, str) else [str(root / p) for p in video]
        return system, question, chosen, rejected, [p if root is None else str(root / p) for p in images], video

    def _place_video(self, question: str, n_images: int, has_video: bool) -> str:
        """The question with one `<video>` after the images: as written, or prepended (`<video>\\n`) when it has no
        placeholder; then images without placeholders get the hub template's prefix before it (`<image>\\n`, or
        `<image 1><image> <image 2><image> ...\\n`), which the template then leaves as it is."""
        n_video, v = question.count(self.video_token), self.video_token
        if n_video > int(has_video):
            raise Drop("placeholder_mismatch", f"{plural(n_video, v + ' placeholder')} for "
                                                f"{plural(int(has_video), 'video')}")
        if not has_video:
            return question
        has_image_ph = self.image_token in question
        if n_video and has_image_ph and question.rindex(self.image_token) > question.index(v):
            raise Drop("placeholder_mismatch", f"an {self.image_token} placeholder after the {v}: the video's "
                                                "features follow the images'")
        if not n_video and has_image_ph:
            raise Drop("placeholder_mismatch", f"{self.image_token} placeholders but no {v} for the video")
        question = question if n_video else f"{v}\n{question}"
        if n_images and not has_image_ph:
            prefix = (f"{self.image_token}\n" if n_images == 1 else " ".join(
                f"<image {j}>{self.image_token}" for j in range(1, n_images + 1)) + "\n")
            question = prefix + question
        return question

    def parse_audio(self, record: dict, question: str, root: Path | None, subset: str = "") -> tuple[str, list[str]]:
        """The record's `audio` (a path or a list of paths; absent: none): (question with `<audio>` as the processor's
        audio token, clip paths joined to `root`). Run after `parse`, on its question."""
        audio = record.get("audio")
        clips = [] if audio is None or audio == "" else [audio] if isinstance(audio, str) else audio
        if not isinstance(clips, list) or not all(isinstance(a, str) and a for a in clips):
            raise Drop("missing_field", f"'audio' must be a path or a list of paths, got {audio!r}")
        n_ph = question.count(AUDIO_PLACEHOLDER)
        if n_ph and n_ph != len(clips):
            raise Drop("placeholder_mismatch", f"{plural(n_ph, AUDIO_PLACEHOLDER + ' placeholder')} for "
                                                f"{plural(len(clips), 'audio clip')}")
        if root is None and (rel := [p for p in clips if not Path(p).is_absolute()]):
            raise Drop("no_audio_root", f"subset {subset!r} has no root for {rel[0]!r}")
        for p in clips:
            if not Path(p).is_absolute() and os.path.normpath(p).split(os.sep)[0] == os.pardir:
                raise Drop("audio_outside_root", f"{p!r} leaves the root {str(root)!r}")
        return (question.replace(AUDIO_PLACEHOLDER, self.audio_token),
                [p if root is None else str(root / p) for p in clips])

    def _numbered_placeholders(self, question: str, images: list[str]) -> tuple[str, list[str]]:
        """`<image_N>` (N = 1..n, each once) -> `<image>`, the images in placeholder order."""
        if not (numbers := [int(m) for m in NUMBERED_IMAGE.findall(question)]):
            return question, images
        if self.image_token in question or sorted(numbers) != list(range(1, len(images) + 1)):
            mixed = f" and {self.image_token}" if self.image_token in question else ""
            raise Drop("placeholder_mismatch", f"<image_N> placeholders {numbers}{mixed} for "
                                                f"{plural(len(images), 'image')}")
        return NUMBERED_IMAGE.sub(self.image_token, question), [images[n - 1] for n in numbers]

    def render(self, system: str, question: str, n_images: int, chosen: str, rejected: str,
               n_audio: int = 0) -> tuple[str, str, str]:
        """(prompt, chosen, rejected) rendered by the chat template: the generation prompt both start with (up to
        `<|im_start|>assistant\\n` when only one side reasons), then each response (`... <|im_end|>\\n`). The
        template places the images' and clips' tokens unless the question holds them."""
        texts = (system, question, chosen, rejected)
        mark = "/"  # the identity, unless the record has a directive to hide
        if any(d in t for d in TEMPLATE_DIRECTIVES for t in texts):
            if not (mark := next((m for m in self._marks if not any(m in t for t in texts)), "")):
                raise Drop("template_rewrites_text", "no free character left to hide /think from the template")

        def hide(text: str, keep_think_end: bool) -> str:
            for d in TEMPLATE_DIRECTIVES if mark != "/" else ():
                text = (re.sub(f"(?<!<){re.escape(d)}", mark + d[1:], text) if keep_think_end
                        else text.replace(d, mark + d[1:]))
            return text

        user = {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "audio"}] * n_audio
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
                raise DataError(f"the chat template renders {full!r}, not a generation prompt + response + "
                                "'<|im_end|>\\n'")
            out.append((prompt.replace(mark, "/"), full[len(prompt):].replace(mark, "/")))
        prompt = out[0][0]
        if out[1][0] != prompt:  # one side reasons, the other not: share the prompt up to the reasoning switch
            prompt = os.path.commonprefix([out[0][0], out[1][0]])
            prompt = prompt[: len(prompt) - len("<think>")] if prompt.endswith("<think>") else prompt
            out = [(prompt, p[len(prompt):] + r) for p, r in out]
        if prompt.count(self.image_token) != n_images:
            raise DataError(f"the chat template renders {prompt.count(self.image_token)} {self.image_token} for "
                            f"{plural(n_images, 'image')}: {prompt!r}")
        if prompt.count(self.audio_token) != n_audio:
            raise DataError(f"the chat template renders {prompt.count(self.audio_token)} {self.audio_token} for "
                            f"{plural(n_audio, 'audio clip')}: {prompt!r}")
        for name, text in (("system", system), ("question", question)):
            if text.strip() and text.strip() not in prompt:
                raise Drop("template_rewrites_text", f"the chat template changes the {name} text: {prompt!r}")
        for (_, rendered), (name, response) in zip(out, (("chosen", chosen), ("rejected", rejected)), strict=True):
            parts = response.split("</think>")
            for part in (parts[0].split("<think>")[-1].strip(), parts[-1].strip()) if len(parts) > 1 else parts:
                if part not in rendered:
                    raise Drop("template_rewrites_text", f"the chat template changes the {name} text: {rendered!r}")
        if out[0][1] == out[1][1]:  # e.g. "<think></think>A cat." and "A cat.": the template drops empty reasoning
            raise Drop("identical_responses", f"chosen and rejected render to the same text {out[0][1]!r}")
        return prompt, out[0][1], out[1][1]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS, as the Omni processor; no model_max_length warning)."""
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def response_ids(self, response: str) -> tuple[list[int], list[bool]]:
        """Token ids of a rendered response and its loss mask: True up to and including the last <|im_end|>."""
        ids = self.encode(response)
        assert self.eos_id in ids, response  # render() checked that it ends with <|im_end|>\n
        end = len(ids) - 1 - ids[::-1].index(self.eos_id)
        return ids, [True] * (end + 1) + [False] * (len(ids) - end - 1)


# ---- Checking the records of an annotation file (mmpr_index.build_index) ----------
# What the checking processes share, set by `begin_record_checks` before they fork (so nothing is pickled).
_CHUNK_CTX: dict[str, Any] = {}
CHUNK_RECORDS = 256  # records per task: large enough to amortise inter-process transfer, small enough to stop early


def begin_record_checks(processor, max_images: int, max_len: int, max_frames: int = 32,
                     max_audio_seconds: float = 0.0) -> None:
    """Set what `checked_records` checks with: the processor, data.train.max_images_per_row, data.max_seq_length,
    data.video.max_frames and data.train.max_audio_seconds (0: no limit)."""
    _CHUNK_CTX.clear()
    _CHUNK_CTX.update(text=TextRenderer(processor), ip=processor.image_processor, max_images=max_images,
                      max_len=max_len, max_frames=max_frames, processor=processor, max_audio_seconds=max_audio_seconds)


def end_record_checks() -> None:
    _CHUNK_CTX.clear()


def _probe(path: str) -> tuple[int, int] | tuple[str, str]:
    """(height, width) of a decodable image, or (drop reason, detail); memoised per process."""
    cache = _CHUNK_CTX.setdefault("sizes", {})
    if path not in cache:
        try:
            im = load_image(path)
            cache[path] = (im.height, im.width)
        except Drop as d:
            cache[path] = (d.reason, d.detail)
    return cache[path]


def _probe_audio(path: str) -> int | tuple[str, str]:
    """Samples of a decodable clip at the processor's rate, or (drop reason, detail); memoised per process. The
    length limits apply to the header's count, before decoding: a long clip is not decoded just to be dropped."""
    cache = _CHUNK_CTX.setdefault("audio", {})
    if path not in cache:
        proc, limit, max_len = _CHUNK_CTX["processor"], _CHUNK_CTX["max_audio_seconds"], _CHUNK_CTX["max_len"]
        rate = proc.feature_extractor.sampling_rate
        try:
            n = audio_samples(path, rate)
            if limit and n > limit * rate:
                raise Drop("audio_too_long", f"{path}: {n / rate:.2f} s > data.train.max_audio_seconds = {limit}")
            if (tokens := audio_token_count(proc, n)) > max_len:
                raise Drop("audio_too_long", f"{path}: {n / rate:.2f} s = {tokens} audio tokens > "
                                             f"data.max_seq_length = {max_len}")
            cache[path] = int(load_audio(path, rate).size)
        except Drop as d:
            cache[path] = (d.reason, d.detail)
    return cache[path]


def _check_chunk(root: str, lines: list[tuple[int, int, bytes]],
                 subset: str = "") -> list[tuple[int, int, dict | tuple[str, str]]]:
    """[(line, offset, lengths dict or (drop reason, detail))] of records [(line, byte offset, raw line)]."""
    text, ip = _CHUNK_CTX["text"], _CHUNK_CTX["ip"]
    max_images, max_len = _CHUNK_CTX["max_images"], _CHUNK_CTX["max_len"]
    merge = round(1 / ip.downsample_ratio)
    out = []
    for lineno, offset, raw in lines:
        try:
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise Drop("invalid_json", str(e)) from None
            system, question, chosen, rejected, imgs, video = text.parse(record, Path(root) if root else None,
                                                                         max_images, subset)
            question, clips = text.parse_audio(record, question, Path(root) if root else None, subset)
            sizes = [_probe(p) for p in imgs]
            if (bad := next((s for s in sizes if isinstance(s[0], str)), None)) is not None:
                raise Drop(*bad)
            grids = image_grids(ip, sizes, imgs)  # before rendering: the order of DROP_REASONS
            # the video decoded before rendering (the order of DROP_REASONS), expanded after; then the clips
            loaded = None if video is None else load_frames(video, text.processor, _CHUNK_CTX["max_frames"])
            samples = [_probe_audio(p) for p in clips]
            if (bad := next((n for n in samples if isinstance(n, tuple)), None)) is not None:
                raise Drop(*bad)
            prompt, r_c, r_r = text.render(system, question, len(imgs), chosen, rejected, len(clips))
            video_prompt, video_sizes = video_counts(text.processor, prompt, loaded)
            counts = [gh * gw // merge**2 for gh, gw in grids]
            audio_counts = [audio_token_count(_CHUNK_CTX["processor"], n) for n in samples]
            # each <image> placeholder (1 token) becomes <img> + n x <image> + </img> (n + 2 tokens), each audio one
            # <so_start> + n x <so_embedding> + <so_end>
            p_len = len(text.encode(video_prompt)) + sum(n + 1 for n in counts) + sum(n + 1 for n in audio_counts)
            c_len, r_len = p_len + len(text.encode(r_c)), p_len + len(text.encode(r_r))
            if max(c_len, r_len) > max_len:
                raise Drop("too_long", f"chosen {c_len} / rejected {r_len} tokens > data.max_seq_length = {max_len}")
            # the record's content as trained, not its JSON text: mmpr_index notes records that repeat another
            fields = [system, question, chosen, rejected, imgs, video] + ([clips] if clips else [])
            digest = hashlib.blake2b(json.dumps(fields).encode(), digest_size=8).hexdigest()
            out.append((lineno, offset, dict(prompt_len=p_len, chosen_len=c_len, rejected_len=r_len, imgs=imgs,
                                             grids=grids, counts=counts, digest=digest, video=video_sizes,
                                             clips=clips, samples=samples, audio_counts=audio_counts,
                                             video_files=[] if video is None else [video] if isinstance(video, str)
                                             else video)))
        except Drop as d:  # a plain tuple: it crosses the process boundary
            out.append((lineno, offset, (d.reason, d.detail)))
    return out


def _read_chunks(path: Path) -> Iterator[list[tuple[int, int, bytes]]]:
    """Non-blank lines of a JSONL file as (1-based line number, byte offset, bytes), CHUNK_RECORDS at a time."""
    chunk, offset = [], 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                chunk.append((lineno, offset, raw))
                if len(chunk) == CHUNK_RECORDS:
                    yield chunk
                    chunk = []
            offset += len(raw)
    if chunk:
        yield chunk


def checked_records(pool, workers: int, root: str, path: Path,
                 subset: str = "") -> Iterator[tuple[int, int, dict | tuple[str, str]]]:
    """(line, byte offset, lengths or (drop reason, detail)) of each record of `path` in order; `pool`: forked or
    None."""
    if pool is None:
        for chunk in _read_chunks(path):
            yield from _check_chunk(root, chunk, subset)
        return
    window: collections.deque = collections.deque()  # (future, first line, last line) of each chunk in flight

    def settle() -> list:
        fut, first, last = window.popleft()
        try:
            return fut.result()
        except concurrent.futures.process.BrokenProcessPool:  # a worker killed (out of memory) or crashed (a decoder)
            last = window[-1][2] if window else last
            raise DataError(f"{path}: lines {first}-{last}: a row-checking process died (killed, e.g. out of memory, "
                            "or a decoder crashed); data.num_workers = 0 (--num-workers 0) checks in-process") from None

    try:
        for chunk in _read_chunks(path):
            window.append((pool.submit(_check_chunk, root, chunk, subset), chunk[0][0], chunk[-1][0]))
            if len(window) >= 2 * workers:
                yield from settle()
        while window:
            yield from settle()
    finally:  # stopped early (max_samples) or failed: drop the chunks not yet started
        for fut, _, _ in window:
            fut.cancel()

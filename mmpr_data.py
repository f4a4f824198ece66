"""Pairs for the training step: `MMPRIndex` (the validated pairs' lengths and images, built by mmpr_index.py),
`PairDataset` (pair id -> pack.PreferencePair),
`PairSampler` (the seeded, resumable global pair order) and `StepLoader` (a step's pairs, decoded by DataLoader
workers, deaf to the stop signals: distributed.py)."""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distributed import ignore_stop_signals, workers_start_deaf
from mmpr_media import (
    Drop,
    audio_samples,
    audio_token_count,
    expand_video,
    image_grids,
    load_audio,
    load_frames,
    load_image,
    video_pixels,
)
from mmpr_records import DataError, TextRenderer
from pack import PreferencePair

# ======================================================================================================================
# Dataset


# ---- The index: what a step reads of it ----------
@dataclass
class MMPRIndex:
    """Validated pairs, columnar; pair ids are positions 0..N-1 (a repeated record appears under several ids).

    Per pair ([N] int64): `subset_id`, `line` (1-based), `offset` (bytes) in the subset's annotation file,
    `prompt_len`, `chosen_len`, `rejected_len` (tokens, image tokens included), `image_tokens`, `image_start` /
    `num_images` (a slice of the per-image arrays). Per image ([M]): `image_path_id`, `image_grid_hw` [M, 2] (16-px
    patches), `image_token_counts`. Per pair, its video: `video_frames`, `video_grid_hw` [N, 2], `video_tokens`.
    `stats[subset]`: records read, valid, pairs, drops by reason with examples."""

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
    video_frames: torch.Tensor  # [N] frames of the pair's video (0: none)
    video_grid_hw: torch.Tensor  # [N, 2] its frame tile in 16-px patches
    video_tokens: torch.Tensor  # [N] its <image> tokens (all tubelets)
    stats: dict[str, dict]
    build_seconds: float = 0.0
    cache_status: str = "disabled"
    cache_dir: str = ""
    # audio: per pair ([N] int64) `audio_tokens`, `audio_start` / `num_audio` (a slice of the per-clip arrays); per
    # clip ([K]) `audio_path_id`, `audio_samples` (at the processor's sampling rate), `audio_token_counts`
    audio_paths: list[str] = field(default_factory=list)
    audio_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    audio_start: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    num_audio: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    audio_path_id: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    audio_samples: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    audio_token_counts: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    # the video's files: per pair ([N] int64) `video_file_start` / `num_video_files` (a slice of `video_path_id` [V],
    # ids into `video_paths`): one video file, or the frame images of a frame list
    video_paths: list[str] = field(default_factory=list)
    video_file_start: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    num_video_files: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    video_path_id: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def __len__(self) -> int:
        return int(self.line.numel())

    def lengths(self, pair_ids: Sequence[int] | None = None) -> dict[int, tuple[int, int]]:
        """{pair_id: (chosen tokens, rejected tokens)}: the input of pack.plan_bins / plan_step."""
        ids = list(range(len(self))) if pair_ids is None else [int(i) for i in pair_ids]
        c, r = self.chosen_len[ids].tolist(), self.rejected_len[ids].tolist()
        return {i: (a, b) for i, a, b in zip(ids, c, r, strict=True)}

    def shared_lengths(self, pair_ids: Sequence[int] | None = None) -> dict[int, int]:
        """{pair_id: prompt tokens - 1}: the tokens the shared-prompt format stores once (pack.plan_bins')."""
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

    def audio(self, i: int) -> list[str]:
        """Pair i's audio clip paths (none for an index without audio)."""
        if not self.num_audio.numel():
            return []
        s, n = int(self.audio_start[i]), int(self.num_audio[i])
        return [self.audio_paths[j] for j in self.audio_path_id[s:s + n].tolist()]

    def videos(self, i: int) -> list[str]:
        """Pair i's video files: [the video file], the frame images of a frame list, or [] (no video)."""
        if not self.num_video_files.numel():
            return []
        s, n = int(self.video_file_start[i]), int(self.num_video_files[i])
        return [self.video_paths[j] for j in self.video_path_id[s:s + n].tolist()]

    def media(self, i: int) -> list[str]:
        """Pair i's media files: images, video files, audio clips (what its stored reference values' stamps cover)."""
        return self.images(i) + self.videos(i) + self.audio(i)

    def state(self) -> dict:
        """The fields the cache saves: all but cache_status and cache_dir."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("cache_")}


def _changed(ix: MMPRIndex, i: int, what: str) -> DataError:
    return DataError(f"{ix.source(i)}: {what}; changed since the index was built: restore it and resume, or delete "
                     f"{ix.cache_dir or 'the index cache'} to re-index and start a new run in another checkpoint.dir")


class PairDataset(torch.utils.data.Dataset):
    """`dataset[pair_id] -> PreferencePair`: the record rendered as the index did, its images decoded (`pixel_values`
    [sum gh*gw, 768] float32, `image_grid_hw` [n, 2], `image_token_counts` [n]) and expanded (`<img>` + n x `<image>`
    + `</img>`), both sequences tokenised ([L] int64; loss masks [L] bool, True on the response and its
    `<|im_end|>`)."""

    def __init__(self, index: MMPRIndex, processor):
        self.index = index
        self.processor = processor
        self.text = TextRenderer(processor)
        self.max_images = max([int(index.num_images.max())] if len(index) else [0])
        self.patch_dim = 3 * processor.image_processor.patch_size ** 2

    def __len__(self) -> int:
        return len(self.index)

    def _record_text(self, i: int) -> tuple[str, str, str, list[str], str | list[str] | None, list[str]]:
        """(prompt, chosen, rejected) rendered as the index did (the prompt's `<image>` / `<video>` / `<so_embedding>`
        not yet expanded), images, video (TextRenderer.parse's), audio clips."""
        ix = self.index
        sub = int(ix.subset_id[i])
        with open(ix.annotation_files[sub], "rb") as f:
            f.seek(int(ix.offset[i]))
            raw = f.readline()
        images = ix.images(i)
        try:
            root = ix.image_roots[sub]
            system, question, chosen, rejected, imgs, video = self.text.parse(
                json.loads(raw), Path(root) if root else None, self.max_images, ix.subsets[sub])
            if imgs != images:
                raise Drop("image_missing", f"record images {imgs} differ from the index's {images}")
            files = [] if video is None else [video] if isinstance(video, str) else video
            if files != ix.videos(i):
                raise Drop("video_missing", f"record video {files} differs from the index's {ix.videos(i)}")
            question, clips = self.text.parse_audio(json.loads(raw), question, Path(root) if root else None,
                                                    ix.subsets[sub])
            if clips != ix.audio(i):
                raise Drop("audio_missing", f"record audio {clips} differs from the index's {ix.audio(i)}")
            prompt, r_c, r_r = self.text.render(system, question, len(imgs), chosen, rejected, len(clips))
        except (Drop, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _changed(ix, i, f"the record no longer validates ({e})") from None
        return prompt, r_c, r_r, images, video, clips

    def _video(self, i: int, prompt: str, video) -> tuple[str, dict]:
        """The prompt with the record's video expanded and PreferencePair's video fields ({}: no video)."""
        if video is None:
            return prompt, {}
        try:
            frames, metadata = load_frames(video, self.processor, max(int(self.index.video_frames[i]), 1))
        except Drop as d:
            raise _changed(self.index, i, str(d)) from None
        pixels, thw, per = video_pixels(self.processor, frames)
        prompt, tokens = expand_video(self.processor, prompt, int(thw[0, 0]), per, metadata)
        return prompt, dict(pixel_values_videos=pixels, video_grid_thw=thw,
                            video_token_counts=torch.tensor([tokens], dtype=torch.int64))

    def __getitem__(self, i: int) -> PreferencePair:
        i = int(i)
        ix = self.index
        prompt, chosen, rejected, images, video, clips = self._record_text(i)
        if images:
            try:
                pil = [load_image(p) for p in images]
                # an image replaced by one too thin for the processor: this error, not its ZeroDivisionError
                image_grids(self.processor.image_processor, [(im.height, im.width) for im in pil], images)
            except Drop as d:
                raise _changed(ix, i, str(d)) from None
            media = self.processor.image_processor(images=pil, return_tensors="pt")
            pixel_values, grid = media["pixel_values"].float(), media["image_grid_hw"].long()
            reps = [self.processor.replace_image_token(media, j) for j in range(len(pil))]
            prompt = self.processor.get_text_with_replacements([prompt], images_replacements=reps)[0][0]
        else:
            pixel_values, grid = torch.zeros(0, self.patch_dim), torch.zeros(0, 2, dtype=torch.long)
        prompt, videos = self._video(i, prompt, video)  # after the images: their <image> placeholders come first
        merge = round(1 / self.processor.image_processor.downsample_ratio)
        counts = grid.prod(dim=-1) // merge**2
        audio = self._audio(i, clips)
        if clips:
            reps = [self.processor.replace_audio_token({"num_tokens": audio["audio_token_counts"].tolist()}, j)
                    for j in range(len(clips))]
            prompt = self.processor.get_text_with_replacements([prompt], audio_replacements=reps)[0][0]
        prompt_ids = self.text.encode(prompt)
        seqs = {}
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            r_ids, r_mask = self.text.response_ids(response)
            seqs[side] = (torch.tensor(prompt_ids + r_ids, dtype=torch.int64),
                          torch.tensor([False] * len(prompt_ids) + r_mask, dtype=torch.bool))
        s, n = int(ix.image_start[i]), int(ix.num_images[i])
        a0, na = (int(ix.audio_start[i]), int(ix.num_audio[i])) if clips else (0, 0)
        expect = (int(ix.prompt_len[i]), int(ix.chosen_len[i]), int(ix.rejected_len[i]),
                  ix.image_token_counts[s:s + n].tolist(), int(ix.video_frames[i]), int(ix.video_tokens[i]),
                  ix.audio_token_counts[a0:a0 + na].tolist())
        video_counts = (int(videos["video_grid_thw"][0, 0]), int(videos["video_token_counts"][0])) if videos else (0, 0)
        got = (len(prompt_ids), seqs["chosen"][0].numel(), seqs["rejected"][0].numel(), counts.tolist(), *video_counts,
               audio["audio_token_counts"].tolist() if audio else [])
        if got != expect:
            raise _changed(ix, i, f"(prompt, chosen, rejected, image tokens, video frames, video tokens, audio "
                                  f"tokens) = {got}, the index says {expect}")
        return PreferencePair(
            pair_id=i, chosen_ids=seqs["chosen"][0], rejected_ids=seqs["rejected"][0],
            chosen_loss_mask=seqs["chosen"][1], rejected_loss_mask=seqs["rejected"][1],
            pixel_values=pixel_values, image_grid_hw=grid, image_token_counts=counts, **videos, **audio,
        )

    def _audio(self, i: int, clips: list[str]) -> dict[str, torch.Tensor]:
        """PreferencePair's audio fields of pair i's clips: each decoded and turned into mel features by the
        processor's feature extractor alone (its own length), with its `<so_embedding>` count."""
        if not clips:
            return {}
        fe = self.processor.feature_extractor
        feats, lens, counts = [], [], []
        a0 = int(self.index.audio_start[i])
        for path, indexed in zip(clips, self.index.audio_samples[a0:a0 + len(clips)].tolist(), strict=True):
            try:  # the header first: a clip grown since the index is not decoded
                if (n := audio_samples(path, fe.sampling_rate)) != indexed:
                    raise _changed(self.index, i, f"{path}: {n} audio samples, the index has {indexed}")
                wave = load_audio(path, fe.sampling_rate)
            except Drop as d:
                raise _changed(self.index, i, str(d)) from None
            out = fe([wave], sampling_rate=fe.sampling_rate, return_tensors="pt")
            feats.append(out["input_features"][0].float())
            lens.append([feats[-1].shape[0], int(out["attention_mask"].sum())])
            counts.append(audio_token_count(self.processor, wave.size))
        return dict(audio_features=torch.cat(feats), audio_lens=torch.tensor(lens, dtype=torch.int64),
                    audio_token_counts=torch.tensor(counts, dtype=torch.int64))


# ======================================================================================================================
# Sampling and loading


class PairSampler:
    """The global pair order: a shuffle per epoch (numpy PCG64 seeded with (seed, epoch)), the same on every rank;
    resumable (`state_dict`, `load_state_dict`; `fingerprint`: the MMPRIndex's, "" = unknown)."""

    def __init__(self, pair_ids: Sequence[int], seed: int, shuffle: bool = True, fingerprint: str = ""):
        assert len(pair_ids), "no pairs"  # build_index and split_validation refuse an empty split
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
        """The next n distinct pair ids; a pair drawn again across an epoch boundary opens the next take instead."""
        assert n <= len(self.pair_ids), (n, len(self.pair_ids))  # preflight.check_splits: batch <= training pairs
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

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "deferred": list(self.deferred),
                "num_pairs": len(self.pair_ids), "seed": self.seed, "shuffle": self.shuffle,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> str | None:
        """Continue from a saved position; returns a note when the index fingerprint changed (same pair count)."""
        for k, what, mine in (("num_pairs", "the training pairs", len(self.pair_ids)),
                              ("seed", "data.train.seed", self.seed), ("shuffle", "data.train.shuffle", self.shuffle)):
            if state[k] != mine:
                raise DataError(f"sampler state: {k} {state[k]} -> {mine}: {what} changed, the saved position does "
                                "not apply")
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
    """`dataset[i]`, or the DataError it raised (torch would re-raise it with the worker's traceback)."""

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
    """A generator function as a DataLoader batch_sampler (re-iterable)."""

    def __init__(self, make: Callable[[], Iterator[list[int]]]):
        self.make = make

    def __iter__(self):
        return self.make()


@dataclass
class StepData:
    """One optimizer step as this rank sees it."""

    pair_ids: list[int]  # the step's global pairs, the same on every rank
    plan: Any  # what `plan_fn` returned
    pairs: dict[int, PreferencePair]  # the ids `plan_fn` asked this rank to load
    sampler_state: dict = field(default_factory=dict)  # the position after this step (the sampler runs ahead)


class StepLoader:
    """Endless steps of `global_batch_size` pairs: `plan_fn(global_pair_ids) -> (plan, ids_to_load)` runs in the main
    process on every rank, and `num_workers` DataLoader workers decode only `ids_to_load`."""

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
                pending.append((ids, plan, self.sampler.state_dict(), load))
                yield load

        loader = torch.utils.data.DataLoader(
            _ReturnDataErrors(self.dataset), batch_sampler=_BatchIds(steps), collate_fn=_collate_pairs,
            num_workers=self.num_workers, worker_init_fn=ignore_stop_signals,
            generator=torch.Generator(),  # its workers' base seed: not drawn from the training RNG (dropout's)
        )
        with workers_start_deaf():
            batches = iter(loader)
        while True:  # endless; batches come back in order, so they match `pending` first-in first-out
            try:
                pairs = next(batches)
            except RuntimeError as e:  # torch's own line for a worker that died: killed (out of memory), a crash
                if not str(e).startswith("DataLoader worker (pid"):
                    raise
                del batches
                loading = [self.dataset.index.source(i) for _, _, _, load in pending for i in load]
                more = f" and {len(loading) - 4} more" if len(loading) > 4 else ""
                raise DataError(f"{', '.join(loading[:4])}{more}: a DataLoader worker died loading these pairs "
                                f"({e}); data.num_workers = 0 loads them in-process") from None
            error = next((p for p in pairs if isinstance(p, DataError)), None)
            if error is not None:
                del batches  # stop the workers now (the iterator's last reference), not while the process exits
                raise DataError(str(error)) from None
            ids, plan, state, _ = pending.popleft()
            yield StepData(ids, plan, {p.pair_id: p for p in pairs}, state)

"""Pair-atomic THD packing (separate sequences, or one span per pair with a shared prompt), CP slicing, DP balancing.

- Planning: `plan_step` / `plan_bins` bin a step's pairs (both sequences together) first-fit-decreasing and deal the
  bins to DP ranks by cost (`deal_greedy`); every rank computes the same `BinPlan`.
- Packing: `pack` -> `PackedBatch`, one packed row [1, T] (THD); `thd_packed_seq_params` for megatron-core; `load_bins`,
  a DP rank's bins of a bin plan on its device.
- Shared-prompt format (`packing.shared_prompt`, switch `shared_prompt_on`): each pair one THD span
  [prompt | chosen | rejected], the prompt stored once (`prefix_length`, `pack_shared_prompt`; offsets `pair_spans`,
  `response_sequence_ids`); its layers are shared_prompt.py's.
- Context parallelism: `cp_partition_index`, the tokens a CP rank keeps.
Reasons: docs/DESIGN.md, "Packing". Tests: tests/test_pack.py, tests/test_shared_prompt.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

IGNORE_INDEX = -100  # label of positions that predict nothing (sequence ends, padding); torch cross_entropy's default

# Cost of a sequence of L tokens in LM-token units: L + L^2 / ATTENTION_QUADRATIC_TOKENS (Nemotron-3-Nano's linear
# FLOPs per token over its attention layers' quadratic FLOPs; derivation in docs/DESIGN.md, "Packing").
ATTENTION_QUADRATIC_TOKENS = 145_000.0


def padded_length(length: int, divisible_by: int) -> int:
    """`length` rounded up to a multiple of `divisible_by` (tokens)."""
    return -(-length // divisible_by) * divisible_by


# ======================================================================================================================
# Planning: pairs -> bins -> DP ranks (pure Python)


def sequence_cost(padded_len: int) -> float:
    """Cost of one sequence of `padded_len` tokens in LM-token units: L + L^2 / ATTENTION_QUADRATIC_TOKENS."""
    return padded_len + padded_len * padded_len / ATTENTION_QUADRATIC_TOKENS


@dataclass(frozen=True)
class Bin:
    """One microbatch: pair ids in packing order, padded `tokens`, real tokens `useful`, `cost`."""

    pair_ids: tuple[int, ...]
    tokens: int
    useful: int
    cost: float
    dummy: bool = False  # repeats the step's smallest pair with sample_mask 0: equal microbatch counts on DP ranks


@dataclass
class BinPlan:
    """One step's microbatches: ranks[r][m] is microbatch m of DP rank r; `dropped`: oversized pairs dropped."""

    ranks: list[list[Bin]]
    num_microbatches: int
    dropped: list[int] = field(default_factory=list)


def _pair_sizes(lens: tuple[int, int], divisible_by: int, cost_fn: Callable[[int], float]) -> tuple[int, int, float]:
    pc, pr = padded_length(lens[0], divisible_by), padded_length(lens[1], divisible_by)
    return pc + pr, lens[0] + lens[1], cost_fn(pc) + cost_fn(pr)


def _sizes(lengths: Mapping[int, tuple[int, int]], divisible_by: int, cost_fn: Callable[[int], float],
           shared_lengths: Mapping[int, int] | None) -> dict[int, tuple[int, int, float]]:
    """Pair id -> (padded tokens, real tokens, cost): two sequences, or one span with `shared_lengths`."""
    if shared_lengths is not None:
        return _span_sizes(lengths, shared_lengths, divisible_by, cost_fn)
    return {pid: _pair_sizes(tuple(lens), divisible_by, cost_fn) for pid, lens in lengths.items()}


def _span_sizes(lengths: Mapping[int, tuple[int, int]], shared_lengths: Mapping[int, int], divisible_by: int,
                cost_fn: Callable[[int], float]) -> dict[int, tuple[int, int, float]]:
    """Pair id -> (padded tokens, real tokens, cost) of its span, the prompt's `shared` tokens counted once."""
    out = {}
    for pid, (c, r) in lengths.items():
        shared = shared_lengths.get(pid, -1)
        assert 0 <= shared < min(c, r)
        real = c + r - shared
        padded = padded_length(real, divisible_by)
        out[pid] = padded, real, cost_fn(c) + cost_fn(r + padded - real) - cost_fn(shared)
    return out


def pair_bin_tokens(
    lengths: Mapping[int, tuple[int, int]], divisible_by: int, shared_lengths: Mapping[int, int] | None = None
) -> dict[int, int]:
    """Pair id -> tokens it takes in a bin (separate sequences, or a span with `shared_lengths`)."""
    return {pid: v[0] for pid, v in _sizes(lengths, divisible_by, float, shared_lengths).items()}  # float: no cost


def first_fit_decreasing(
    sizes: Mapping[int, int], max_tokens_per_bin: int, max_sequences_per_bin: int
) -> list[list[int]]:
    """Bins of item ids (id -> tokens), largest first (ties: smaller id) into the first bin with room."""
    order = sorted(sizes, key=lambda i: (-sizes[i], i))
    smallest = sizes[order[-1]] if order else 0
    bins: list[list[int]] = []
    loads: list[int] = []
    # Bins that can still take an item, in opening order: full bins are skipped, so one pair per bin is O(n).
    open_bins: list[int] = []
    for i in order:
        k = next((k for k, b in enumerate(open_bins) if loads[b] + sizes[i] <= max_tokens_per_bin), None)
        if k is not None:
            b = open_bins[k]
        else:
            k, b = len(open_bins), len(bins)
            bins.append([])
            loads.append(0)
            open_bins.append(b)
        bins[b].append(i)
        loads[b] += sizes[i]
        if len(bins[b]) == max_sequences_per_bin or loads[b] + smallest > max_tokens_per_bin:
            del open_bins[k]
    return bins


def deal_greedy(bins: Sequence[Bin], dp_size: int) -> list[list[Bin]]:
    """Bins to DP ranks, largest cost first to the least-loaded rank with a free slot (equal counts)."""
    assert len(bins) % dp_size == 0
    per_rank = len(bins) // dp_size
    order = sorted(range(len(bins)), key=lambda i: (-bins[i].cost, i))
    ranks: list[list[Bin]] = [[] for _ in range(dp_size)]
    heap = [(0.0, r) for r in range(dp_size)]  # (load, rank) of ranks with a free slot; ties -> lower rank
    for i in order:
        load, r = heapq.heappop(heap)
        ranks[r].append(bins[i])
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + bins[i].cost, r))
    return ranks


def _split_bins_to_multiple(bins: list[list[int]], sizes: Mapping[int, int], multiple: int) -> list[list[int]]:
    """Split the heaviest multi-pair bin in two until the bin count is a multiple of `multiple`."""
    bins = [list(b) for b in bins]
    while len(bins) % multiple:
        cand = [i for i, b in enumerate(bins) if len(b) >= 2]
        if not cand:
            break
        i = max(cand, key=lambda i: (sum(sizes[p] for p in bins[i]), -i))
        a: list[int] = []
        b: list[int] = []
        for p in sorted(bins[i], key=lambda p: (-sizes[p], p)):
            (a if sum(sizes[q] for q in a) <= sum(sizes[q] for q in b) else b).append(p)
        bins[i] = a
        bins.append(b)
    return bins


def plan_bins(
    lengths: Mapping[int, tuple[int, int]],
    max_tokens_per_bin: int,
    max_sequences_per_bin: int,
    dp_size: int,
    divisible_by: int = 1,
    drop_oversized: bool = False,
    shared_lengths: Mapping[int, int] | None = None,
) -> BinPlan:
    """Plan one step's microbatches. lengths: pair id -> (chosen, rejected) sequence tokens, unpadded; shared_lengths:
    pair id -> prompt tokens stored once (shared-prompt format). ValueError: an oversized pair (unless drop_oversized).
    """
    assert min(max_tokens_per_bin, max_sequences_per_bin, dp_size, divisible_by) >= 1  # config.validate
    assert all(len(lens) == 2 and min(lens) >= 1 for lens in lengths.values())
    info = _sizes(lengths, divisible_by, sequence_cost, shared_lengths)
    dropped = []
    for pid in sorted(info):
        if info[pid][0] > max_tokens_per_bin:
            if not drop_oversized:
                raise ValueError(
                    f"pair {pid} needs {info[pid][0]} tokens ({info[pid][1]} real, padded to multiples of "
                    f"{divisible_by}) but packing.max_tokens_per_bin = {max_tokens_per_bin}; raise the limit, "
                    "shorten data.max_seq_length, or set packing.drop_oversized_pairs = true"
                )
            dropped.append(pid)
    dropped_set = set(dropped)
    kept = {pid: v for pid, v in info.items() if pid not in dropped_set}
    if not kept:
        raise ValueError(f"no pair of this step fits in a bin of packing.max_tokens_per_bin = {max_tokens_per_bin} "
                         f"({len(dropped)} dropped as oversized)")
    sizes = {pid: v[0] for pid, v in kept.items()}
    groups = first_fit_decreasing(sizes, max_tokens_per_bin, max_sequences_per_bin)
    groups = _split_bins_to_multiple(groups, sizes, dp_size)

    def make_bin(ids: Sequence[int], dummy: bool = False) -> Bin:
        return Bin(
            pair_ids=tuple(ids),
            tokens=sum(kept[p][0] for p in ids),
            useful=0 if dummy else sum(kept[p][1] for p in ids),
            cost=sum(kept[p][2] for p in ids),
            dummy=dummy,
        )

    bins = [make_bin(g) for g in groups]
    # Dummy bins copy the smallest pair (ties: smaller id) and run the normal path, so no rank waits in a collective.
    smallest = min(sizes, key=lambda p: (sizes[p], p))
    n_dummy = (-len(bins)) % dp_size
    bins += [make_bin([smallest], dummy=True) for _ in range(n_dummy)]
    return BinPlan(ranks=deal_greedy(bins, dp_size), num_microbatches=len(bins) // dp_size, dropped=dropped)


def shared_prompt_on(packing) -> bool:
    """The resolved `packing.shared_prompt` switch; ValueError while `packing.shared_prompt` is still "auto"."""
    if not isinstance(packing.shared_prompt, bool):
        raise ValueError(f"packing.shared_prompt = {packing.shared_prompt!r} is resolved at start by "
                         "shared_prompt.resolve(cfg, kernel_selection.select_kernels()); call it before planning")
    return packing.shared_prompt


def plan_step(lengths: Mapping[int, tuple[int, int]], packing, dp_size: int,
              shared_lengths: Mapping[int, int] | None = None) -> BinPlan:
    """`plan_bins` with the settings of `packing`; `shared_lengths` counts only if `shared_prompt_on(packing)`."""
    pk = packing
    shared = shared_prompt_on(pk)
    assert shared_lengths is not None or not shared
    return plan_bins(
        lengths,
        pk.max_tokens_per_bin,
        pk.max_sequences_per_bin,
        dp_size,
        divisible_by=pk.make_sequence_length_divisible_by,
        drop_oversized=pk.drop_oversized_pairs,
        shared_lengths=shared_lengths if shared else None,
    )


# ======================================================================================================================
# Packing one bin into THD tensors


def video_sequence_tokens(tubelets: int, tokens_per_tubelet: int, pruning_rate: float) -> int:
    """`<image>` tokens a video of `tubelets` tubelets of `tokens_per_tubelet` (n) tokens takes in a sequence: T·n, or
    under EVS (config.json's video_pruning_rate q > 0) those transformers keeps, max(n, int(T·n·(1 - q)))
    (NemotronH_Omni's compute_retention_mask, the same float expression)."""
    return max(tokens_per_tubelet, int(tubelets * tokens_per_tubelet * (1 - pruning_rate)))


@dataclass
class PreferencePair:
    """One preference pair from the data module (CPU tensors)."""

    pair_id: int
    chosen_ids: torch.Tensor  # [L_c] int64, the full sequence (prompt + response), unpadded
    rejected_ids: torch.Tensor  # [L_r] int64
    chosen_loss_mask: torch.Tensor  # [L_c] bool, True on the response tokens of the last assistant turn; [0] False
    rejected_loss_mask: torch.Tensor  # [L_r] bool
    pixel_values: torch.Tensor  # [sum of gh*gw over the images, 3*16*16] float, shared by both sequences
    image_grid_hw: torch.Tensor  # [n_images, 2] int64, (gh, gw) patches
    image_token_counts: torch.Tensor  # [n_images] int64, <image> tokens of each image in each sequence
    # the pair's videos (omni_model.encode_media), their <image> tokens after the images'; None: no video
    pixel_values_videos: torch.Tensor | None = None  # [sum of F*gh*gw, 3*16*16] float, each frame's patches
    video_grid_thw: torch.Tensor | None = None  # [n_videos, 3] int64, (frames, gh, gw)
    video_token_counts: torch.Tensor | None = None  # [n_videos] int64, <image> tokens of each video in each sequence
    # (video_sequence_tokens: EVS's retained count)
    # audio clips, shared by both sequences: the processor's mel features, each clip at its own length
    audio_features: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))  # [sum of frames, n_mels] float
    audio_lens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))  # [n_clips, 2]
    # (mel frames, valid frames: the processor's input_features_mask sum) of each clip
    audio_token_counts: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [n_clips]


@dataclass
class PackedBatch:
    """One packed THD microbatch: S = 2P sequences (P pairs, chosen then rejected), T tokens. Shared-prompt format:
    S = P spans; pair_index / is_chosen / sample_mask stay per response [2P].
    """

    input_ids: torch.Tensor  # [1, T] int64, the sequences, each padded with pad_token_id to a multiple of divisible_by
    labels: torch.Tensor  # [1, T] int64, input_ids[t + 1] inside a sequence, IGNORE_INDEX at its end and on padding
    loss_mask: torch.Tensor  # [1, T] bool, the response mask shifted by one: loss_mask[t] = seq_loss_mask[t + 1]
    position_ids: torch.Tensor  # [1, T] int64, 0, 1, ... from each sequence start (padding continues the count)
    cu_seqlens: torch.Tensor  # [S+1] int32, cumulative real lengths
    cu_seqlens_padded: torch.Tensor  # [S+1] int32, cumulative padded lengths: sequence s is [cu_pad[s], cu_pad[s+1])
    max_seqlen: int  # the longest padded sequence
    pair_index: torch.Tensor  # [2P] int64, the pair of each response (-1 in a dummy bin)
    is_chosen: torch.Tensor  # [2P] bool
    sample_mask: torch.Tensor  # [2P] float32, 1, or 0 in a dummy bin (no gradient, no count)
    pixel_values: torch.Tensor  # [N_patches, 3*16*16] float, the pairs' patches once per pair, in pair order
    image_grid_hw: torch.Tensor  # [N_images, 2] int64
    image_token_counts: torch.Tensor  # [N_images] int64
    media_index: torch.Tensor  # [S] int64, the media slot (pair position in the bin) of each sequence
    media_image_offsets: torch.Tensor  # [P+1] int64, the images of slot m: image_grid_hw[off[m]:off[m+1]]
    media_patch_offsets: torch.Tensor  # [P+1] int64, the same in rows of pixel_values
    # Shared-prompt format only: [3P+1] int32 cumulative real lengths of the spans prompt_0, chosen_0, rejected_0,
    # prompt_1, ..., and their boundaries in the packed row (a pair's padding belongs to its rejected span).
    span_cu_seqlens: torch.Tensor | None = None
    span_cu_seqlens_padded: torch.Tensor | None = None
    # videos (PreferencePair's), once per pair in pair order; the videos of slot m: video_grid_thw[off[m]:off[m+1]]
    pixel_values_videos: torch.Tensor | None = None  # [N_video_patches, 3*16*16] float
    video_grid_thw: torch.Tensor | None = None  # [N_videos, 3] int64
    video_token_counts: torch.Tensor | None = None  # [N_videos] int64
    media_video_offsets: torch.Tensor | None = None  # [P+1] int64
    # Audio clips (OmniModel's sound step), once per pair in pair order: features [N_frames, n_mels] float, lens
    # [N_clips, 2] int64 (frames, valid frames), token counts [N_clips], media_audio_offsets [P+1] (slot m's clips)
    audio_features: torch.Tensor | None = None
    audio_lens: torch.Tensor | None = None
    audio_token_counts: torch.Tensor | None = None
    media_audio_offsets: torch.Tensor | None = None
    host: PackedBatch | None = field(default=None, repr=False, compare=False)  # the CPU batch, set by `to`

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def shared_prompt(self) -> bool:
        """True for the shared-prompt format."""
        return self.span_cu_seqlens_padded is not None

    @property
    def num_responses(self) -> int:
        """Sequences the loss sees (2 per pair)."""
        return self.pair_index.numel()

    def loss_seq_ids(self) -> torch.Tensor:
        """int64 [T]: each token's response index in pair_index (S on prompts and padding past the last)."""
        T = self.input_ids.shape[1]
        if self.shared_prompt:
            return response_sequence_ids(self.span_cu_seqlens_padded, T)
        return token_sequence_ids(self.cu_seqlens_padded, T, check=False)

    @property
    def num_pairs(self) -> int:
        """P, dummy pairs included."""
        return self.media_image_offsets.numel() - 1

    def to(self, device, non_blocking: bool = False) -> PackedBatch:
        """Copy with every tensor on `device`; `host` keeps the CPU batch for host reads."""
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device, non_blocking=non_blocking, copy=True) if isinstance(v, torch.Tensor) else v
        kw["host"] = self.host if self.host is not None else self
        return PackedBatch(**kw)


def _media_tokens(p: PreferencePair) -> int:
    """<image> tokens of a pair's sequence: its images' and its videos'."""
    videos = 0 if p.video_token_counts is None else int(p.video_token_counts.sum())
    return int(p.image_token_counts.sum()) + videos


def _check_pair(p: PreferencePair, image_token_id: int) -> None:
    n_img = _media_tokens(p)
    for ids, mask in ((p.chosen_ids, p.chosen_loss_mask), (p.rejected_ids, p.rejected_loss_mask)):
        assert ids.dim() == 1 and ids.dtype == torch.int64 and ids.numel() >= 1, f"pair {p.pair_id}: sequence ids"
        assert mask.shape == ids.shape and mask.dtype == torch.bool and not bool(mask[0]), f"pair {p.pair_id}: mask"
        assert int((ids == image_token_id).sum()) == n_img, f"pair {p.pair_id}: <image> tokens"
    grid = p.image_grid_hw
    assert grid.dim() == 2 and grid.shape[1] == 2 and p.image_token_counts.shape == (grid.shape[0],)
    assert p.pixel_values.shape[0] == int(grid.prod(dim=-1).sum()), f"pair {p.pair_id}: pixel_values rows"
    if p.video_grid_thw is not None:
        assert p.pixel_values_videos.shape[0] == int(p.video_grid_thw.prod(dim=-1).sum()), f"pair {p.pair_id}: video"


def _packed_batch(pairs: Sequence[PreferencePair], token_parts: tuple[list, list, list, list], cu: list[int],
                  cu_pad: list[int], pair_index: list[int], is_chosen: list[bool], dummy: bool,
                  media_index: torch.Tensor, **spans: torch.Tensor) -> PackedBatch:
    """The PackedBatch of `pack` / `pack_shared_prompt` from its token pieces, offsets and pair metadata."""
    ids, labels, lmask, pos = (torch.cat(t) for t in token_parts)
    cu_pad_t = torch.tensor(cu_pad, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int64)
    return PackedBatch(
        input_ids=ids[None],
        labels=labels[None],
        loss_mask=lmask[None],
        position_ids=pos.to(torch.int64)[None],
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        cu_seqlens_padded=cu_pad_t,
        max_seqlen=int((cu_pad_t[1:] - cu_pad_t[:-1]).max()),
        pair_index=torch.tensor(pair_index, dtype=torch.int64),
        is_chosen=torch.tensor(is_chosen, dtype=torch.bool),
        sample_mask=torch.full((len(is_chosen),), 0.0 if dummy else 1.0, dtype=torch.float32),
        pixel_values=torch.cat([p.pixel_values for p in pairs], dim=0),
        image_grid_hw=torch.cat([p.image_grid_hw.to(torch.int64) for p in pairs], dim=0),
        image_token_counts=torch.cat([p.image_token_counts.to(torch.int64) for p in pairs], dim=0),
        media_index=media_index,
        media_image_offsets=torch.cat([zero, torch.tensor([p.image_grid_hw.shape[0] for p in pairs]).cumsum(0)]),
        media_patch_offsets=torch.cat([zero, torch.tensor([p.pixel_values.shape[0] for p in pairs]).cumsum(0)]),
        **spans, **_packed_videos(pairs), **_audio_fields(pairs),
    )


def _packed_videos(pairs: Sequence[PreferencePair]) -> dict[str, torch.Tensor]:
    """PackedBatch's video fields of `pairs` ({} when none has a video)."""
    with_video = [p for p in pairs if p.video_grid_thw is not None and p.video_grid_thw.numel()]
    if not with_video:
        return {}
    width = with_video[0].pixel_values_videos.shape[1]
    none = (torch.zeros(0, width), torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    parts = [(p.pixel_values_videos, p.video_grid_thw.to(torch.int64), p.video_token_counts.to(torch.int64))
             if p.video_grid_thw is not None else none for p in pairs]
    counts = torch.tensor([grid.shape[0] for _, grid, _ in parts])
    return {"pixel_values_videos": torch.cat([x for x, _, _ in parts]),
            "video_grid_thw": torch.cat([g for _, g, _ in parts]),
            "video_token_counts": torch.cat([c for _, _, c in parts]),
            "media_video_offsets": torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])}


def _audio_fields(pairs: Sequence[PreferencePair]) -> dict[str, torch.Tensor]:
    """PackedBatch's audio fields of `pairs` (none when no pair has a clip)."""
    if not any(p.audio_lens.numel() for p in pairs):
        return {}
    with_audio = [p.audio_features for p in pairs if p.audio_lens.numel()]
    zero = torch.zeros(1, dtype=torch.int64)
    return dict(audio_features=torch.cat(with_audio), audio_lens=torch.cat([p.audio_lens for p in pairs]),
                audio_token_counts=torch.cat([p.audio_token_counts for p in pairs]),
                media_audio_offsets=torch.cat([zero, torch.tensor([p.audio_lens.shape[0] for p in pairs]).cumsum(0)]))


def pack(
    pairs: Sequence[PreferencePair],
    divisible_by: int,
    image_token_id: int,
    pad_token_id: int = 0,
    dummy: bool = False,
) -> PackedBatch:
    """Pack one bin (see `PackedBatch`): pair 0 chosen, pair 0 rejected, pair 1 chosen, ..., each sequence padded to a
    multiple of `divisible_by`. `dummy=True`: sample_mask 0, pair_index -1.
    """
    assert pairs and divisible_by >= 1
    ids, labels, lmask, pos = [], [], [], []
    cu, cu_pad = [0], [0]
    pair_index, is_chosen = [], []
    for p in pairs:
        _check_pair(p, image_token_id)
        for chosen in (True, False):
            seq = p.chosen_ids if chosen else p.rejected_ids
            rmask = p.chosen_loss_mask if chosen else p.rejected_loss_mask
            n = seq.numel()
            n_pad = padded_length(n, divisible_by)
            seq_ids = torch.full((n_pad,), pad_token_id, dtype=torch.int64)
            seq_ids[:n] = seq
            seq_labels = torch.full((n_pad,), IGNORE_INDEX, dtype=torch.int64)
            seq_labels[: n - 1] = seq[1:]
            seq_mask = torch.zeros(n_pad, dtype=torch.bool)
            seq_mask[: n - 1] = rmask[1:]
            ids.append(seq_ids)
            labels.append(seq_labels)
            lmask.append(seq_mask)
            pos.append(torch.arange(n_pad, dtype=torch.int64))
            cu.append(cu[-1] + n)
            cu_pad.append(cu_pad[-1] + n_pad)
            pair_index.append(-1 if dummy else p.pair_id)
            is_chosen.append(chosen)
    return _packed_batch(pairs, (ids, labels, lmask, pos), cu, cu_pad, pair_index, is_chosen, dummy,
                         media_index=torch.arange(len(is_chosen), dtype=torch.int64) // 2)


def thd_packed_seq_params(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, max_seqlen: int,
                          host: tuple[list[int], list[int]] | None = None):
    """megatron-core `PackedSeqParams` ("thd") of one packed row, plus `total_tokens` (T), `seq_idx` [1, T]
    int32 (the Mamba layers' sequence ids) and `cu_seqlens_padded_host`. host: the offsets as int lists, if known.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, cu_pad = cu_seqlens.to(torch.int32), cu_seqlens_padded.to(torch.int32)
    cu_h, cu_pad_h = host if host is not None else (cu.tolist(), cu_pad.tolist())
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
        pad_between_seqs=cu_h != cu_pad_h,
    )
    psp.total_tokens = cu_pad_h[-1]
    lengths = (cu_pad[1:] - cu_pad[:-1]).long()
    psp.seq_idx = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_pad.device, dtype=torch.int32),
                                          lengths, output_size=cu_pad_h[-1]).unsqueeze(0)
    psp.cu_seqlens_padded_host = tuple(cu_pad_h)
    return psp


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; CPU -> GPU from pinned memory without blocking."""
    device = torch.device(device)
    if t.device == device or device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host_view(batch):
    """The CPU copy of a batch (PackedBatch.host, or the batch itself)."""
    return getattr(batch, "host", None) or batch


def token_sequence_ids(cu_seqlens_padded: torch.Tensor, total_tokens: int, check: bool = True) -> torch.Tensor:
    """int64 [T]: each token's sequence in [0, S] (S past cu_seqlens_padded[-1]); ValueError on bad offsets
    when `check`.
    """
    cu = cu_seqlens_padded.long()
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"cu_seqlens_padded must be a non-empty 1-D tensor; got shape {tuple(cu.shape)}")
    if check and (cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()) or cu[-1] > total_tokens):
        raise ValueError(f"cu_seqlens_padded must rise from 0 to at most T = {total_tokens}; got {cu.tolist()}")
    lengths = torch.cat([cu[1:] - cu[:-1], total_tokens - cu[-1:]])
    return torch.repeat_interleave(torch.arange(cu.numel(), dtype=torch.long, device=cu.device), lengths,
                                   output_size=total_tokens)


def routing_padding_mask(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, total_tokens: int,
                         sample_mask: torch.Tensor | None = None) -> torch.Tensor:
    """bool [T], True where a token is excluded from MoE routing statistics (megatron-core's
    `padding_mask`): sequence padding, the tail past the last sequence, sequences with sample_mask 0.
    """
    seq_ids = token_sequence_ids(cu_seqlens_padded, total_tokens, check=False)
    cu, cu_pad = cu_seqlens.long().to(seq_ids.device), cu_seqlens_padded.long().to(seq_ids.device)
    real = torch.cat([cu[1:] - cu[:-1], cu.new_zeros(1)])  # the trailing run (id S) has no real token
    start = torch.cat([cu_pad[:-1], cu_pad[-1:]])
    pos = torch.arange(total_tokens, device=seq_ids.device) - start[seq_ids]
    pad = pos >= real[seq_ids]
    if sample_mask is not None:
        dead = torch.cat([sample_mask.to(seq_ids.device) == 0, torch.ones(1, dtype=torch.bool, device=seq_ids.device)])
        pad |= dead[seq_ids]
    return pad


# ======================================================================================================================
# The shared-prompt format: one THD span [prompt | chosen | rejected] per pair, the prompt stored once. The rejected
# span attends to the prompt but not to the chosen one (shared_prompt.py's layers), so each response token sees what
# it sees as a separate sequence, with the same labels, loss mask and positions.


def prefix_length(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_loss_mask: torch.Tensor,
                  rejected_loss_mask: torch.Tensor) -> int:
    """k = m - 1, m the sequences' common prefix outside both response masks (seq[k] starts each response)."""
    n = min(chosen_ids.numel(), rejected_ids.numel())
    same = (chosen_ids[:n] == rejected_ids[:n]) & ~chosen_loss_mask[:n] & ~rejected_loss_mask[:n]
    m = int(same.long().cumprod(0).sum())
    return max(m - 1, 0)


def pack_shared_prompt(
    pairs: Sequence[PreferencePair],
    divisible_by: int,
    image_token_id: int,
    pad_token_id: int = 0,
    dummy: bool = False,
) -> PackedBatch:
    """Pack one bin in the shared-prompt format: per pair [seq[:k] | chosen[k:] | rejected[k:] | padding],
    k = `prefix_length`. ValueError: k = 0, or `<image>` past the prompt."""
    assert pairs and divisible_by >= 1
    ids, labels, lmask, pos = [], [], [], []
    cu, cu_pad, seg, seg_pad = [0], [0], [0], [0]
    pair_index, is_chosen = [], []
    for p in pairs:
        _check_pair(p, image_token_id)
        k = prefix_length(p.chosen_ids, p.rejected_ids, p.chosen_loss_mask, p.rejected_loss_mask)
        if k < 1:
            raise ValueError(f"pair {p.pair_id}: the chosen and rejected sequences share no prompt token "
                             "(pack.prefix_length 0); use the separate-sequences format for such data")
        n_img = _media_tokens(p)
        if int((p.chosen_ids[:k] == image_token_id).sum()) != n_img:
            raise ValueError(f"pair {p.pair_id}: {n_img} <image> tokens expected inside the shared prompt "
                             f"(first {k} tokens), found {int((p.chosen_ids[:k] == image_token_id).sum())}")
        seq_c, seq_r = p.chosen_ids, p.rejected_ids
        # Labels and masks of the whole sequences first (pre-rolled as in `pack`), then cut into spans.
        parts = [(seq_c[:k], seq_c[1:k + 1], p.chosen_loss_mask[1:k + 1], torch.arange(k))]
        for seq, rmask in ((seq_c, p.chosen_loss_mask), (seq_r, p.rejected_loss_mask)):
            n = seq.numel()
            lab = torch.full((n - k,), IGNORE_INDEX, dtype=torch.int64)
            lab[: n - k - 1] = seq[k + 1:]
            msk = torch.zeros(n - k, dtype=torch.bool)
            msk[: n - k - 1] = rmask[k + 1:]
            parts.append((seq[k:], lab, msk, torch.arange(k, n)))
        real = sum(t[0].numel() for t in parts)
        n_pad = padded_length(real, divisible_by) - real
        last = seq_r.numel()
        parts.append((torch.full((n_pad,), pad_token_id, dtype=torch.int64),
                      torch.full((n_pad,), IGNORE_INDEX, dtype=torch.int64),
                      torch.zeros(n_pad, dtype=torch.bool), torch.arange(last, last + n_pad)))
        for a, b, c, d in parts:
            ids.append(a)
            labels.append(b)
            lmask.append(c)
            pos.append(d)
        lens = [t[0].numel() for t in parts[:3]]
        for j, n in enumerate(lens):
            seg.append(seg[-1] + n)
            seg_pad.append(seg_pad[-1] + n + (n_pad if j == 2 else 0))
        cu.append(cu[-1] + real)
        cu_pad.append(cu_pad[-1] + real + n_pad)
        pair_index += [-1 if dummy else p.pair_id] * 2
        is_chosen += [True, False]
    return _packed_batch(pairs, (ids, labels, lmask, pos), cu, cu_pad, pair_index, is_chosen, dummy,
                         media_index=torch.arange(len(pairs), dtype=torch.int64),
                         span_cu_seqlens=torch.tensor(seg, dtype=torch.int32),
                         span_cu_seqlens_padded=torch.tensor(seg_pad, dtype=torch.int32))


def pair_spans(span_cu_seqlens_padded: torch.Tensor, total_tokens: int) -> list[tuple[int, int, int, int]]:
    """(prompt, chosen, rejected, end) offsets of each pair; ValueError if malformed."""
    b = [int(v) for v in span_cu_seqlens_padded.flatten().tolist()]
    if len(b) % 3 != 1 or b[0] != 0 or any(y < x for x, y in zip(b[:-1], b[1:], strict=True)) or b[-1] > total_tokens:
        raise ValueError(f"span_cu_seqlens_padded must hold 3P+1 offsets rising from 0 to at most T = "
                         f"{total_tokens}; got {b}")
    return [tuple(b[i:i + 4]) for i in range(0, len(b) - 1, 3)]


def response_sequence_ids(span_cu_seqlens_padded: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """int64 [T]: 2i on pair i's chosen span, 2i+1 on its rejected one, 2P on prompts and the tail."""
    b = span_cu_seqlens_padded.long()
    assert b.dim() == 1 and b.numel() % 3 == 1, b.shape  # 3P+1 (the values: `pair_spans`, on the host)
    n = 2 * ((b.numel() - 1) // 3)
    lengths = torch.cat([b[1:] - b[:-1], total_tokens - b[-1:]])
    role = torch.arange(lengths.numel(), device=b.device)
    ids = torch.where(role % 3 == 0, n, 2 * (role // 3) + (role % 3) - 1)
    ids[-1] = n
    return torch.repeat_interleave(ids, lengths, output_size=total_tokens)


# ======================================================================================================================
# A DP rank's microbatches of a step


def load_bins(plan: BinPlan, pairs: Mapping[int, PreferencePair], ctx, image_token_id: int,
              pad_id: int) -> list[PackedBatch]:
    """This DP rank's packed microbatches of `plan` (`pack`, or `pack_shared_prompt` when `shared_prompt_on`), moved
    to its device once. ctx: distributed.Ctx (cfg, dp_rank, device)."""
    divisible_by = ctx.cfg.packing.make_sequence_length_divisible_by
    pack_fn = pack_shared_prompt if shared_prompt_on(ctx.cfg.packing) else pack
    return [pack_fn([pairs[p] for p in b.pair_ids], divisible_by, image_token_id, pad_id, dummy=b.dummy)
            .to(ctx.device) for b in plan.ranks[ctx.dp_rank]]


# ======================================================================================================================
# Context-parallel slicing


def cp_partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 [T / CP]: the positions CP rank `cp_rank` keeps, chunks r and 2*CP-1-r of each sequence's 2*CP
    chunks (TE's `thd_get_partitioned_indices` order).
    """
    assert 0 <= cp_rank < cp_size, f"cp_rank = {cp_rank}"
    cu = cu_seqlens_padded.to(torch.int64)
    assert cu.numel() > 0 and int(cu[0]) == 0, "cu_seqlens_padded must start at 0"
    lens = cu[1:] - cu[:-1]
    assert not bool((lens % (2 * cp_size)).any()), f"padded lengths not divisible by 2*CP = {2 * cp_size}"
    chunk = lens // (2 * cp_size)
    # Starts of the two kept chunks of every sequence, then each expanded to `chunk` consecutive positions.
    starts = torch.stack([cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk], dim=1).reshape(-1)
    reps = chunk.repeat_interleave(2)
    offsets = torch.arange(int(reps.sum()), device=cu.device) - torch.repeat_interleave(
        torch.cumsum(reps, 0) - reps, reps
    )
    return torch.repeat_interleave(starts, reps) + offsets

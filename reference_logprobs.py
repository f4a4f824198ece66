"""The frozen reference's log-prob sums: a reference model's forward in every step, or computed once and stored.

`reference.logprobs = "online"`: `build_reference` loads a frozen copy of model.hf_path beside the policy (with LoRA
none: the policy with its adapters off, `AdaptersOff`) and `sums` runs it on each microbatch before the policy.
`"precomputed"`: `precompute` runs the reference once over every training and validation pair at the start of the job
(the reference pass), writes each pair's sums under <checkpoint.dir>/reference_logprobs/ as it goes and frees the model;
`sums` looks the values up (a pair whose media files changed is computed again). Either way the step asks
`sums(reference, batches, ctx)`: Σ_t log π_ref over each response's tokens. The pass, its files and their checks:
docs/DESIGN.md, "Reference log-probs computed once".
Tests: tests/test_reference_logprobs.py, and the tiny run in both modes in tests/test_train.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import gc
import hashlib
import io
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import distributed
import hf_weights
import lora
import mmpr_data
import mmpr_records
import model_hub
import mpo_loss
import pack

FOLDER = "reference_logprobs"
MANIFEST = "manifest.json"
FORMAT = 2  # the shard and manifest layout above
SHARD_SECONDS = 60.0  # a rank writes its computed pairs at least this often (wall seconds): what a kill -9 loses
PROGRESS_SECONDS = 30.0  # rank 0 prints a progress line at most this often


class ShardError(ValueError):
    """A shard that cannot be read back whole: truncated, failing its checksum, or not a shard."""


# ======================================================================================================================
# The one question the step asks


@dataclasses.dataclass(eq=False)
class Stored:
    """The stored reference sums of one data index, table row = pair id: `sums` [N, 2] float64 (chosen, rejected; NaN
    not computed) and `tokens` [N, 2] int64 (their response tokens; -1 not computed)."""

    folder: Path
    sums: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def from_scores(cls, folder: Path, num_pairs: int, scores: list) -> Stored:
        """The values of `score`'s output for pair ids in [0, num_pairs) (what the benchmark times without shards)."""
        table = _Table.empty(num_pairs)
        for pair_ids, s, n in scores:
            table.put(pair_ids, s, n)
        return cls(Path(folder), table.sums, table.tokens)

    def lookup(self, batch: pack.PackedBatch, device: torch.device) -> torch.Tensor:
        """Reference sums [S] float32 of one microbatch, on `device` (0 for a dummy bin's sequences), from the host
        copy; DataError when a sequence's stored token count is not the batch's (its tokens changed since the pass)."""
        host = pack.host_view(batch)
        real = host.pair_index >= 0
        table_rows, col = host.pair_index.clamp_min(0), (~host.is_chosen).long()
        tokens = mpo_loss.sequence_sums(host.loss_mask[0].long(), host.loss_seq_ids(), host.num_responses)
        stored = torch.where(real, self.tokens[table_rows, col], tokens)
        if not torch.equal(stored, tokens):
            s = int((stored != tokens).nonzero()[0, 0])
            raise mmpr_records.DataError(
                f"the stored reference log-probs of pair {int(host.pair_index[s])} in {self.folder} cover "
                f"{int(stored[s])} response tokens, the pair has {int(tokens[s])} now (a file changed since the "
                "reference pass): remove that folder to compute them again")
        return pack.to_device(torch.where(real, self.sums[table_rows, col], 0.0).to(torch.float32), device)


@dataclasses.dataclass(eq=False)
class AdaptersOff:
    """The LoRA reference: `policy` (the plain module, adapters attached by lora.apply_lora) run in eval mode with
    every adapter off and no gradients, which is the base model of model.hf_path bit for bit (tests/test_lora.py)."""

    policy: torch.nn.Module

    @contextlib.contextmanager
    def base(self):
        """`policy` as the base model inside the block: eval mode and adapters off, both restored after."""
        was_training = self.policy.training
        self.policy.eval()
        try:
            with lora.adapters_disabled(self.policy):
                yield self.policy
        finally:
            self.policy.train(was_training)


def sums(reference, batches: list[pack.PackedBatch], ctx) -> list[torch.Tensor]:
    """The reference log-prob sums [S] (fp32, on ctx.device) of every microbatch: looked up when `reference` is
    `Stored`, the policy's forward with its adapters off when `AdaptersOff`, else the frozen model's forward; no
    gradients (with `reference.offload` the frozen model visits the GPU here)."""
    if isinstance(reference, Stored):
        return [reference.lookup(b, ctx.device) for b in batches]
    if isinstance(reference, AdaptersOff):
        with torch.no_grad(), reference.base() as model:
            return [mpo_loss.forward_logprobs(model, b, ctx)[0] for b in batches]
    offload = ctx.cfg.reference.offload and ctx.device.type == "cuda"
    if offload:
        reference.to(ctx.device)
    with torch.no_grad():
        out = [mpo_loss.forward_logprobs(reference, b, ctx)[0] for b in batches]
    if offload:
        reference.to("cpu")
    return out


def build_reference(cfg, ctx, kernels, policy: torch.nn.Module | None = None):
    """The online reference: with LoRA (lora.rank > 0) `AdaptersOff(policy)` (`policy` after lora.apply_lora),
    else `load_model`."""
    if cfg.lora.rank > 0:
        assert policy is not None, "LoRA: the reference is the policy with its adapters off"
        return AdaptersOff(policy)
    return load_model(cfg, ctx, kernels)


def load_model(cfg, ctx, kernels):
    """The frozen base model from model.hf_path on `kernels` (eval, no gradients); on the CPU between its passes
    with `reference.offload` on a GPU."""
    model = hf_weights.build_from_hf(cfg, kernels).eval().requires_grad_(False)
    if cfg.reference.offload and ctx.device.type == "cuda":
        model.to("cpu")
    return model


# ======================================================================================================================
# The stored values: identity, manifest, shards


def identity(cfg, train_index, val_index) -> dict:
    """What the stored values belong to, by setting: the model's files (model_hub.model_files), the parameter dtype,
    the Mamba time-step clamp, and each data index's fingerprint (its files, the processor and chat template, and
    the data settings that change tokens: data.max_seq_length, named apart too)."""
    out = {"model.hf_path files": model_hub.model_files(model_hub.model_dir(cfg.model)),
           "model.params_dtype": cfg.model.params_dtype, "model.mamba_dt_clamp": cfg.model.mamba_dt_clamp,
           "data.max_seq_length": cfg.data.max_seq_length,
           "data index of data.train.data_path": train_index.fingerprint}  # fmt: skip
    if val_index is not None and val_index is not train_index:
        out["data index of data.validation.data_path"] = val_index.fingerprint
    return out


def index_key(index) -> str:
    """The key of a data index's values in a shard: its fingerprint's first 16 hex digits."""
    return index.fingerprint[:16]


def check_manifest(folder: Path, ident: dict, info: dict) -> str | None:
    """Rank 0: compare `folder`'s manifest with `ident` (written when the folder holds none); the refusal, or None."""
    path = folder / MANIFEST
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, not the folder of the stored values"
    if not path.exists():
        if any(folder.glob("*.shard")):
            return f"{folder} holds shards but no {MANIFEST}: what they belong to is unknown"
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT, "identity": ident, "info": info}
        checkpoint.write_atomic(path, (json.dumps(manifest, indent=1) + "\n").encode())
        return None
    try:
        saved = json.loads(path.read_text())
        saved_ident, saved_format = saved["identity"], saved["format"]
        if not isinstance(saved_ident, dict):
            raise TypeError("its identity is not a JSON object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path} cannot be read ({type(e).__name__}: {e})"
    if saved_format != FORMAT:
        return f"{path} is of format {saved_format!r}, this version reads format {FORMAT}"
    differ = [f"{k} {saved_ident.get(k)!r} -> {v!r}" for k, v in ident.items() if saved_ident.get(k) != v]
    differ += [f"{k} {v!r} -> None" for k, v in saved_ident.items() if k not in ident]
    return f"{folder} holds the reference log-probs of another run ({'; '.join(differ)})" if differ else None


def write_shard(path: Path, values: dict[str, dict[str, torch.Tensor]]) -> None:
    """One shard (the module docstring's layout) at `path`, atomically."""
    buf = io.BytesIO()
    torch.save(values, buf)
    payload = buf.getvalue()
    header = {"format": FORMAT, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    checkpoint.write_atomic(path, json.dumps(header).encode() + b"\n" + payload)


def read_shard(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The values of the shard at `path`, checked whole against its header; ShardError saying why not."""
    data = path.read_bytes()
    head, _, payload = data.partition(b"\n")
    try:
        header = json.loads(head)
        size, digest = int(header["bytes"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError):
        raise ShardError("no shard header") from None
    if len(payload) != size:
        raise ShardError(f"truncated: {len(payload)} of {size} bytes")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise ShardError("its content differs from its checksum")
    try:
        values = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # noqa: BLE001 - a payload torch cannot read fails with many types (IndexError among them)
        raise ShardError(f"its payload is not a torch file ({type(e).__name__})") from None
    try:
        for v in values.values():
            n = v["pair_ids"].numel()
            ok = v["sums"].shape == v["tokens"].shape == (n, 2) and v["media"].shape == (n,)
            if not ok:
                raise ValueError
    except (AttributeError, KeyError, TypeError, ValueError):
        raise ShardError("its payload is not a table of pair ids, sums and tokens") from None
    return values


@dataclasses.dataclass
class _Table:
    """One data index's values while they are gathered: table rows = pair ids (see `Stored`); `media` [N] int64 the
    pairs' media stamps now (`media_stamps`); a stored value of another stamp is not taken (its pair id goes to
    `stale`)."""

    sums: torch.Tensor
    tokens: torch.Tensor
    media: torch.Tensor | None = None
    stale: set = dataclasses.field(default_factory=set)

    @classmethod
    def empty(cls, num_pairs: int, media: torch.Tensor | None = None) -> _Table:
        return cls(torch.full((num_pairs, 2), float("nan"), dtype=torch.float64),
                   torch.full((num_pairs, 2), -1, dtype=torch.int64), media)

    def put(self, pair_ids: torch.Tensor, sums: torch.Tensor, tokens: torch.Tensor,
            media: torch.Tensor | None = None) -> None:
        if self.media is not None and media is not None:
            same = self.media[pair_ids] == media
            self.stale.update(pair_ids[~same].tolist())
            pair_ids, sums, tokens = pair_ids[same], sums[same], tokens[same]
        self.sums[pair_ids], self.tokens[pair_ids] = sums.double(), tokens.long()

    def missing(self, pair_ids: list[int]) -> list[int]:
        done = (self.tokens[:, 0] >= 0).tolist()
        return [p for p in pair_ids if not done[p]]


def load_shards(folder: Path, tables: dict[str, _Table]) -> list[tuple[Path, str]]:
    """Every readable shard of `folder` into `tables` (by index key); returns the damaged ones (path, why), not read."""
    damaged = []
    for path in sorted(folder.glob("*.shard")):
        try:
            values = read_shard(path)
        except (ShardError, OSError) as e:
            damaged.append((path, str(e).splitlines()[0] if str(e) else type(e).__name__))
            continue
        for key, v in values.items():
            if key in tables:  # the manifest names the indexes; another index's values are not this run's
                tables[key].put(v["pair_ids"], v["sums"], v["tokens"], v["media"])
    return damaged


# ======================================================================================================================
# The reference pass


def precompute(cfg, ctx, kernels, data, stopper) -> tuple[Stored, Stored | None] | None:
    """The stored reference sums of the training and the validation split (None: no validation runs), computing what
    is missing with the reference pass first (collective); None when a stop signal ended the pass (what is done is
    kept). CheckpointError when the folder belongs to another run, another run's pass holds it, or a write fails (a
    full disk: on every rank); `data` is train.Data."""
    folder, rank = Path(cfg.checkpoint.dir) / FOLDER, dist.get_rank()
    splits = [(data.train_split.index, data.train_set, data.train_split.pair_ids)]
    validates = data.val_split is not None and bool(cfg.mpo.val_period or cfg.mpo.val_at_end)
    if validates:  # the pairs run_validation reads: its first mpo.val_batches batches
        n = cfg.mpo.val_batches * cfg.mpo.val_global_batch_size
        splits.append((data.val_split.index, data.val_set, data.val_split.pair_ids[:n]))
    ident = identity(cfg, data.train_split.index, data.val_split.index if data.val_split else None)
    info = {"kernels": kernels.line(), "packing.shared_prompt": cfg.packing.shared_prompt,
            "parallel": dataclasses.asdict(cfg.parallel)}
    refused, lock = None, None
    if rank == 0:
        try:
            refused = check_manifest(folder, ident, info)
            if refused:
                refused += f": remove {folder} to compute them again for this run, or set reference.logprobs=online"
            else:
                lock, refused = _lock(folder)
        except OSError as e:  # a full disk, a read-only file system
            refused = _write_failed(folder / MANIFEST, e)
    if refused := distributed.from_rank0(refused):
        raise checkpoint.CheckpointError(refused)
    try:
        return _precompute(cfg, ctx, kernels, data, stopper, splits, validates, folder)
    finally:
        if lock is not None:
            os.close(lock)


def _lock(folder: Path) -> tuple[int | None, str | None]:
    """Rank 0: flock `folder`/.lock for the pass (one writer per store, also through a symlink): (fd, None), or
    (None, the refusal) while another run holds it; (None, None) on a file system without locks."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if isinstance(e, BlockingIOError):
            return None, (f"{folder.resolve()} is in use by another run's reference pass (lock file "
                          f"{folder / '.lock'}): wait until its pass ends, or give this run a store of its own")
        return None, None
    return fd, None


def _precompute(cfg, ctx, kernels, data, stopper, splits, validates, folder):
    """`precompute` once the store is this run's (the manifest checked, the lock held)."""
    rank = dist.get_rank()
    wanted: dict[str, tuple] = {}  # index key -> (index, the pair ids of every split reading it)
    for index, _, ids in splits:
        wanted[index_key(index)] = (index, [*wanted.get(index_key(index), (None, []))[1], *ids])
    media = {key: media_stamps(index, ids, ctx) for key, (index, ids) in wanted.items()}
    tables = {key: _Table.empty(len(index), media[key]) for key, (index, _) in wanted.items()}
    damaged = load_shards(folder, tables)
    dist.barrier()  # every rank has read the shards before rank 0 moves the damaged ones aside
    if rank == 0:
        for tmp in folder.glob(".*.tmp"):  # a write a kill interrupted: never a shard, never read
            tmp.unlink()
        for path, why in damaged:
            path.rename(path.with_name(path.name + ".damaged"))
            print(f"reference: {path} is damaged ({why}): moved to {path.name}.damaged, its pairs are computed again")
    for key, t in tables.items():
        if rank == 0 and (stale := t.missing(sorted(t.stale))):
            print(f"reference: {len(stale)} pairs read media files changed since their values were stored (e.g. pair "
                  f"{stale[0]}: {', '.join(wanted[key][0].media(stale[0]))}): they are computed again")
    todo = [(index, dataset, missing, media[index_key(index)]) for index, dataset, ids in splits
            if (missing := tables[index_key(index)].missing(ids))]
    total = sum(len(ids) for _, _, ids in splits)
    if todo:
        rng = checkpoint.rng_state()  # the pass (its model's initialisation) leaves the training RNG as it found it
        model = load_model(cfg, ctx, kernels)  # the base model (LoRA: the policy's adapters off, bit for bit)
        try:
            finished = _run_pass(model, todo, total, folder, data.ids, cfg, ctx, stopper)
        finally:
            checkpoint.set_rng_state(rng)
        del model  # the policy is built next: memory holds no reference from here on
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        if not finished:
            return None
        tables = {key: _Table.empty(t.sums.shape[0], t.media) for key, t in tables.items()}  # all ranks' shards
        dist.barrier()  # every rank's shards are written
        if damaged := load_shards(folder, tables):
            raise checkpoint.CheckpointError(f"{damaged[0][0]} was written by this pass and reads back damaged "
                                             f"({damaged[0][1]}): the file system does not keep what is written")
    for index, _, ids in splits:
        if missing := tables[index_key(index)].missing(ids):
            raise checkpoint.CheckpointError(f"{folder} lacks the reference log-probs of {len(missing)} pairs after "
                                             f"the reference pass (e.g. pair {missing[0]})")
    if rank == 0 and not todo:
        print(f"reference: the log-probs of {total} pairs are stored in {folder}; no reference model is built")
    stored = {key: Stored(folder, t.sums, t.tokens) for key, t in tables.items()}
    return stored[index_key(splits[0][0])], (stored[index_key(splits[-1][0])] if validates else None)


def media_stamps(index, pair_ids: list[int], ctx) -> torch.Tensor:
    """[len(index)] int64: for each of `pair_ids` a hash of its image, video (the file, or a frame list's images)
    and audio files' (size, mtime in ns), their kind and order (0 for the other pairs and a pair without them).
    Collective: each rank stats a share of the files."""
    ids = torch.as_tensor(pair_ids, dtype=torch.long)
    out = torch.zeros(len(index), dtype=torch.int64)
    for paths, path_id, start, num, salt in (
            (index.image_paths, index.image_path_id, index.image_start, index.num_images, 0),
            (index.audio_paths, index.audio_path_id, index.audio_start, index.num_audio, 1),
            (index.video_paths, index.video_path_id, index.video_file_start, index.num_video_files, 2)):
        if len(num) == 0:  # an index without audio or video-file columns
            continue
        counts, first = num[ids].long(), start[ids].long()
        owner = torch.repeat_interleave(torch.arange(len(ids)), counts)  # per file: its pair's position in ids
        order = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        files, which = torch.unique(path_id[first[owner] + order].long(), return_inverse=True)
        rank, world = dist.get_rank(), dist.get_world_size()
        stat = torch.zeros(len(files), 2, dtype=torch.int64)
        for j in range(rank, len(files), world):
            try:
                st = os.stat(paths[int(files[j])])
                stat[j, 0], stat[j, 1] = st.st_size, st.st_mtime_ns
            except OSError:  # a missing file: its pair's DataError comes from the loader
                stat[j, 0] = -1
        if world > 1:
            stat = stat.to(ctx.device)
            dist.all_reduce(stat)
            stat = stat.cpu()
        size, mtime = stat[which].unbind(1)
        h = size * 0x5851F42D4C957F2D + mtime * 0x14057B7EF767814F + (order + 1 + salt * 0x10000) * 0x2545F4914F6CDD1D
        h = (h ^ (h >> 29)) * 0x5851F42D4C957F2D  # wraps in int64
        out[ids] += torch.zeros(len(ids), dtype=torch.int64).index_add_(0, owner, h)
    return out


def score(model, batches: list[pack.PackedBatch], ctx) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The reference pass's work on this rank's microbatches: per non-dummy bin (its pair ids [P] int64 ascending,
    sums [P, 2] fp32 and response-token counts [P, 2] int64, chosen then rejected), on the CPU; no gradients."""
    out = []
    for b in batches:
        with torch.no_grad():
            s, n = mpo_loss.forward_logprobs(model, b, ctx)
        host = pack.host_view(b)
        if int(host.pair_index[0]) < 0:  # a dummy bin: its pair is scored where it is real
            continue
        chosen, rejected, pair_ids = mpo_loss.pair_sequences(host.pair_index, host.is_chosen)
        s, n = s.cpu(), n.cpu()
        out.append((pair_ids, torch.stack([s[chosen], s[rejected]], 1), torch.stack([n[chosen], n[rejected]], 1)))
    return out


def _write_failed(path: Path, e: OSError) -> str:
    """The one line of a failed write of the pass (a full disk, a quota), naming the file and the free space."""
    return (f"cannot write {path}: {type(e).__name__}: {e} ({checkpoint.free_space(path.parent)}); make room, then "
            "start the run again (the values written so far are kept)")


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


class _Rounds:
    """A fixed list of rounds of pair ids as the sampler of mmpr_data.StepLoader: `take` gives the next round (past
    the last one the rounds again, which only a DataLoader's read-ahead asks for)."""

    def __init__(self, rounds: list[list[int]]):
        self.rounds, self.taken = rounds, 0

    def take(self, n: int) -> list[int]:
        self.taken += 1
        return self.rounds[(self.taken - 1) % len(self.rounds)]

    def state_dict(self) -> dict:
        return {}


def _run_pass(model, todo, total: int, folder: Path, ids: dict, cfg, ctx, stopper) -> bool:
    """The reference pass over `todo` ([(index, dataset, pair ids)]; `ids`: train.Data.ids): rounds of
    policy.train_global_batch_size pairs planned over the DP ranks in the pass's bins, forward without gradients, this
    DP rank's values written to its shards as it goes. False when a stop signal ended it (after writing what is done).
    """
    from megatron.core import parallel_state

    r = cfg.reference
    pk = cfg.packing
    packing = dataclasses.replace(pk, max_tokens_per_bin=r.max_tokens_per_bin or pk.max_tokens_per_bin,
                                  max_sequences_per_bin=r.max_sequences_per_bin or pk.max_sequences_per_bin)
    writer = parallel_state.get_tensor_model_parallel_rank() == 0 and ctx.cp_rank == 0  # one copy per DP rank
    rank, n_round = dist.get_rank(), cfg.policy.train_global_batch_size
    numbers = [int(p.name.split("-")[1].split(".")[0]) for p in folder.glob(f"rank{rank:05d}-*.shard*")]
    shard = iter(range(max(numbers, default=-1) + 1, 1 << 62))
    buffer: dict[str, list] = {}
    to_do = sum(len(p) for _, _, p, _ in todo)
    if rank == 0:
        print(f"reference pass: {to_do} of {total} pairs to compute ({total - to_do} stored in {folder}), bins of "
              f"{packing.max_tokens_per_bin} tokens")

    def flush() -> None:
        """This rank's computed values to a new shard; a failed write (a full disk) is a CheckpointError."""
        if writer and buffer:
            values = {k: {"pair_ids": torch.cat([b[0] for b in v]), "sums": torch.cat([b[1] for b in v]),
                          "tokens": torch.cat([b[2] for b in v]), "media": torch.cat([b[3] for b in v])}
                      for k, v in buffer.items()}  # fmt: skip
            path = folder / f"rank{rank:05d}-{next(shard):06d}.shard"
            try:
                write_shard(path, values)
            except OSError as e:
                buffer.clear()
                raise checkpoint.CheckpointError(_write_failed(path, e)) from None
        buffer.clear()

    def flush_agreed() -> None:  # collective: one rank's failed write stops every rank in one line
        distributed.agreed(flush, ctx, (checkpoint.CheckpointError,))

    done, t0, last_flush, last_print = 0, time.perf_counter(), time.perf_counter(), 0.0
    try:
        for index, dataset, pair_ids, media in todo:
            def plan(round_ids, index=index):
                p = pack.plan_step(index.lengths(round_ids), packing, ctx.dp, index.shared_lengths(round_ids))
                return p, [q for b in p.ranks[ctx.dp_rank] for q in b.pair_ids]

            rounds = [pair_ids[i : i + n_round] for i in range(0, len(pair_ids), n_round)]
            loader = iter(mmpr_data.StepLoader(dataset, _Rounds(rounds), n_round, plan, cfg.data.num_workers))
            for _ in rounds:
                step = distributed.agreed(functools.partial(next, loader), ctx)  # one rank's DataError stops all
                batches = pack.load_bins(step.plan, step.pairs, ctx, ids["image"], ids["pad"])
                scored = [(p, s, n, media[p]) for p, s, n in score(model, batches, ctx)]
                buffer.setdefault(index_key(index), []).extend(scored)
                done += len(step.pair_ids)
                now = time.perf_counter()
                if distributed.from_rank0(now - last_flush >= SHARD_SECONDS):  # every rank flushes at once
                    flush_agreed()
                    last_flush = now
                if rank == 0 and (now - last_print >= PROGRESS_SECONDS or done == to_do):
                    rate = done / (now - t0)
                    print(f"reference pass: {done}/{to_do} pairs, {rate:.2f} pairs/s, eta "
                          f"{_duration((to_do - done) / rate)}", flush=True)
                    last_print = now
                if stopper.should_stop(ctx.device):
                    flush_agreed()
                    if rank == 0:
                        print(f"reference pass: stopped after {done} of {to_do} pairs (signal); stored in {folder}, "
                              "the next start continues from there", flush=True)
                    return False
            del loader  # its DataLoader workers stop here
        flush_agreed()
    finally:
        with contextlib.suppress(checkpoint.CheckpointError):  # a failed write was raised already
            flush()  # what is computed is kept, whatever ends the pass (a DataError, a bug)
    return True

"""HF import / export of the Omni model: the exact map between megatron-core's tensors and the hub checkpoint.

    report = load_hf_weights(model, "assets/tiny-omni")   # each rank reads only its TP / EP slices
    export_hf(model, "out/", "assets/tiny-omni")           # the exact inverse; untouched keys copied back
    model = build_from_hf(cfg, kernels)                    # build_model + load_hf_weights of model.hf_path

`hf_param_map(model)` gives, for every megatron-core tensor, the rows or columns of HF tensors that make each rank's
shard (`ParamMap` of `HFSlice`s); keys of components not trained here are kept aside (`UNTOUCHED_PREFIXES`).
Smoke run: `python hf_weights.py assets/tiny-omni`."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from distributed import group_rank_size, init_distributed, local_device
from omni_model import OmniModel, build_model


@dataclass(frozen=True)
class HFSlice:
    """A run of `length` rows (dim 0) or columns (dim 1) of HF tensor `key`, starting at `start`; None: all of it."""

    key: str
    start: int
    length: int | None


@dataclass
class ParamMap:
    """A megatron-core tensor from HF tensors: rank r of `group` ("tp", "ep", None) holds slices(r, size) on `dim`."""

    dim: int
    group: str | None
    slices: Callable[[int, int], list[HFSlice]]


# local_spec.GroupedExperts' 3-D weights [E, rows, cols]: group 1 is the projection (1 up, 2 down)
EXPERT_WEIGHTS = re.compile(r"\.experts\.weight([12])$")


def _split(key: str, n: int, dim: int = 0) -> ParamMap:
    return ParamMap(dim, "tp", lambda r, s: [HFSlice(key, r * n // s, n // s)])


def _whole(key: str, n: int) -> ParamMap:
    return ParamMap(0, None, lambda r, s: [HFSlice(key, 0, n)])


def _pieces(parts: list[tuple[str, int, int]], dim: int = 0) -> ParamMap:
    """Concatenated components (key, offset, size), each split evenly over TP (Mamba in_proj, conv)."""
    return ParamMap(dim, "tp", lambda r, s: [HFSlice(k, off + r * n // s, n // s) for k, off, n in parts])


def _rows(slices: list[HFSlice], start: int, length: int) -> list[HFSlice]:
    """Rows [start, start + length) of the concatenation of `slices`, as slices."""
    out, offset = [], 0
    for s in slices:
        lo, hi = max(start, offset), min(start + length, offset + s.length)
        if lo < hi:
            out.append(HFSlice(s.key, s.start + lo - offset, hi - lo))
        offset += s.length
    return out


def hf_param_map(model: OmniModel) -> dict[str, ParamMap]:
    """megatron-core name -> ParamMap for every parameter and router expert-bias buffer of `model`."""
    hf, t, v = model.hf, model.hf.text, model.hf.vision
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    di, gn, nh = t.mamba_num_heads * t.mamba_head_dim, t.n_groups * t.ssm_state_size, t.mamba_num_heads
    hpg = t.num_attention_heads // t.num_key_value_heads
    n_exp = getattr(t, "n_routed_experts", 0) or 0
    ep = model.lm_config.expert_model_parallel_size
    local_experts = n_exp // ep if n_exp else 0
    vh, vheads = v.hidden_size, v.num_attention_heads
    vd, vffn = vh // vheads, int(vh * v.mlp_ratio)
    lm, vm = "language_model.backbone.", "vision_model.radio_model.model."
    maps: dict[str, ParamMap] = {}

    def qkv(layer: int, groups: int) -> ParamMap:
        # megatron's fused rows per query group g: [q heads of g | k_g | v_g]; TP rank r holds the r-th of TP equal
        # row blocks (with fewer groups than TP, part of one group: megatron's attention all-gathers it)
        p = f"{lm}layers.{layer}.mixer."
        rows = [seg for g in range(groups) for seg in (HFSlice(p + "q_proj.weight", g * hpg * head_dim, hpg * head_dim),
                                                         HFSlice(p + "k_proj.weight", g * head_dim, head_dim),
                                                         HFSlice(p + "v_proj.weight", g * head_dim, head_dim))]
        n = groups * (hpg + 2) * head_dim
        return ParamMap(0, "tp", lambda r, s: _rows(rows, r * n // s, n // s))

    def vit_qkv(key: str) -> ParamMap:
        def seg(r, s):  # timm rows [Q; K; V] -> megatron per head [q_h; k_h; v_h]
            return [HFSlice(key, part * vh + h * vd, vd)
                    for h in range(r * vheads // s, (r + 1) * vheads // s) for part in range(3)]
        return ParamMap(0, "tp", seg)

    def expert(key_fmt: str, j: int) -> ParamMap:
        return ParamMap(0, "ep", lambda r, s: [HFSlice(key_fmt.format(e=r * local_experts + j), 0, None)])

    def experts(key_fmt: str) -> ParamMap:  # a 3-D weight: this EP rank's experts, stacked (rows, `_model_tensors`)
        return ParamMap(0, "ep", lambda r, s: [HFSlice(key_fmt.format(e=r * local_experts + j), 0, None)
                                               for j in range(local_experts)])

    for name in _model_tensors(model):
        if m := re.match(r"language_model\.decoder\.layers\.(\d+)\.(.+)$", name):
            i, rest = int(m.group(1)), m.group(2)
            p, kind = f"{lm}layers.{i}.", hf.pattern[i]
            inp, cw, cb = p + "mixer.in_proj.weight", p + "mixer.conv1d.weight", p + "mixer.conv1d.bias"
            table = {
                "mixer.in_proj.layer_norm_weight": _whole(p + "norm.weight", t.hidden_size),
                "mixer.in_proj.weight": _pieces([(inp, 0, di), (inp, di, di), (inp, 2 * di, gn),
                                                 (inp, 2 * di + gn, gn), (inp, 2 * di + 2 * gn, nh)]),
                "mixer.conv1d_weight": _pieces([(cw, 0, di), (cw, di, gn), (cw, di + gn, gn)]),
                "mixer.conv1d_bias": _pieces([(cb, 0, di), (cb, di, gn), (cb, di + gn, gn)]),
                "mixer.A_log": _split(p + "mixer.A_log", nh),
                "mixer.D": _split(p + "mixer.D", nh),
                "mixer.dt_bias": _split(p + "mixer.dt_bias", nh),
                "mixer.norm.weight": _split(p + "mixer.norm.weight", di),
                "mixer.out_proj.weight": _split(p + "mixer.out_proj.weight", di, dim=1),
                "self_attention.linear_qkv.layer_norm_weight": _whole(p + "norm.weight", t.hidden_size),
                "self_attention.linear_qkv.weight": qkv(i, t.num_key_value_heads),
                "self_attention.linear_proj.weight": _split(p + "mixer.o_proj.weight",
                                                            t.num_attention_heads * head_dim, dim=1),
                "mlp.linear_fc1.layer_norm_weight": _whole(p + "norm.weight", t.hidden_size),
                "mlp.linear_fc1.weight": _split(p + "mixer.up_proj.weight", t.intermediate_size),
                "mlp.linear_fc2.weight": _split(p + "mixer.down_proj.weight", t.intermediate_size, dim=1),
                "pre_mlp_layernorm.weight": _whole(p + "norm.weight", t.hidden_size),
                "mlp.router.weight": _whole(p + "mixer.gate.weight", n_exp),
                "mlp.router.expert_bias": _whole(p + "mixer.gate.e_score_correction_bias", n_exp),
            }
            if kind == "E":
                sh, se = t.moe_shared_expert_intermediate_size, p + "mixer.shared_experts."
                table["mlp.shared_experts.linear_fc1.weight"] = _split(se + "up_proj.weight", sh)
                table["mlp.shared_experts.linear_fc2.weight"] = _split(se + "down_proj.weight", sh, dim=1)
            if e := EXPERT_WEIGHTS.search(name):
                maps[name] = experts(p + "mixer.experts.{e}." + ("up_proj" if e.group(1) == "1" else "down_proj")
                                     + ".weight")
                continue
            e = re.match(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", rest) or \
                re.match(r"mlp\.experts\.linear_fc([12])\.weight(\d+)$", rest)
            if e:
                j, fc = (int(e.group(1)), e.group(2)) if "local_experts" in rest else (int(e.group(2)), e.group(1))
                proj = "up_proj" if fc == "1" else "down_proj"
                maps[name] = expert(p + "mixer.experts.{e}." + proj + ".weight", j)
                continue
        elif m := re.match(r"vision_model\.decoder\.layers\.(\d+)\.(.+)$", name):
            p, rest = f"{vm}blocks.{m.group(1)}.", m.group(2)
            table = {
                "self_attention.linear_qkv.layer_norm_weight": _whole(p + "norm1.weight", vh),
                "self_attention.linear_qkv.layer_norm_bias": _whole(p + "norm1.bias", vh),
                "self_attention.linear_qkv.weight": vit_qkv(p + "attn.qkv.weight"),
                "self_attention.linear_qkv.bias": vit_qkv(p + "attn.qkv.bias"),
                "self_attention.linear_proj.weight": _split(p + "attn.proj.weight", vh, dim=1),
                "self_attention.linear_proj.bias": _whole(p + "attn.proj.bias", vh),
                "mlp.linear_fc1.layer_norm_weight": _whole(p + "norm2.weight", vh),
                "mlp.linear_fc1.layer_norm_bias": _whole(p + "norm2.bias", vh),
                "mlp.linear_fc1.weight": _split(p + "mlp.fc1.weight", vffn),
                "mlp.linear_fc1.bias": _split(p + "mlp.fc1.bias", vffn),
                "mlp.linear_fc2.weight": _split(p + "mlp.fc2.weight", vffn, dim=1),
                "mlp.linear_fc2.bias": _whole(p + "mlp.fc2.bias", vh),
            }
        elif name.startswith("sound_encoder.encoder."):  # transformers' ParakeetEncoder: hub names, replicated
            maps[name] = ParamMap(0, None, lambda r, s, key=name: [HFSlice(key, 0, None)])
            continue
        else:
            rest = name
            table = {
                "language_model.embedding.word_embeddings.weight": _split(f"{lm}embeddings.weight", t.vocab_size),
                "language_model.output_layer.weight": _split("language_model.lm_head.weight", t.vocab_size),
                "language_model.decoder.final_norm.weight": _whole(f"{lm}norm_f.weight", t.hidden_size),
                "vision_model.class_token": _whole(f"{vm}patch_generator.cls_token.token", hf.num_prefix_tokens),
                "vision_model.position_embeddings": _whole(f"{vm}patch_generator.pos_embed", 1),
                "vision_model.embedder.weight": _split(f"{vm}patch_generator.embedder.weight", vh),
                "vision_model.video_embedder.weight": _split(f"{vm}patch_generator.video_embedder.weight", vh),
                "vision_projection.encoder.linear_fc1.layer_norm_weight": _whole("mlp1.0.weight", 4 * vh),
                "vision_projection.encoder.linear_fc1.weight": _split("mlp1.1.weight", hf.projector_hidden_size),
                "vision_projection.encoder.linear_fc2.weight": _split("mlp1.3.weight", hf.projector_hidden_size,
                                                                      dim=1),
            }
            if hf.sound is not None:
                sh = hf.sound.projection_hidden_size
                table.update({
                    "sound_projection.encoder.linear_fc1.layer_norm_weight": _whole("sound_projection.norm.weight",
                                                                                    hf.sound.hidden_size),
                    "sound_projection.encoder.linear_fc1.weight": _split("sound_projection.linear1.weight", sh),
                    "sound_projection.encoder.linear_fc2.weight": _split("sound_projection.linear2.weight", sh, dim=1),
                })
        if rest not in table:
            raise ValueError(f"no HF mapping for megatron parameter {name}")
        maps[name] = table[rest]
    return maps


# Checkpoint keys of components this project does not train: counted, kept aside, written back on export.
UNTOUCHED_PREFIXES = ("sound_encoder.encoder.feature_extractor.",  # NeMo's mel featurizer; the processor makes mels
                      "vision_model.radio_model.input_conditioner.",  # CLIP normalisation; the processor normalises
                      "vision_model.radio_model.summary_idxs")  # RADIO summary heads; unused by the VLM


def has_safetensors(hf_dir: str | os.PathLike) -> bool:
    """True when `hf_dir` holds model.safetensors.index.json or a *.safetensors file."""
    d = Path(hf_dir)
    return (d / "model.safetensors.index.json").is_file() or any(d.glob("*.safetensors"))


class HFReader:
    """Lazy reads of a (sharded) safetensors checkpoint, only the requested slices."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        elif not has_safetensors(self.dir):
            raise FileNotFoundError(f"{self.dir}: no model.safetensors.index.json and no *.safetensors")
        else:
            self.weight_map = {}
            for f in sorted(self.dir.glob("*.safetensors")):
                with safe_open(f, "pt") as h:
                    self.weight_map.update({k: f.name for k in h.keys()})
        self._handles: dict[str, Any] = {}

    def _handle(self, key: str):
        if key not in self.weight_map:
            raise KeyError(f"{self.dir}: checkpoint has no tensor {key!r}")
        fname = self.weight_map[key]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.dir / fname, "pt")
        return self._handles[fname]

    def shape_dtype(self, key: str) -> tuple[list[int], str]:
        sl = self._handle(key).get_slice(key)
        return sl.get_shape(), sl.get_dtype()

    def read(self, key: str, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        sl = self._handle(key).get_slice(key)
        if length is None:
            return sl[:] if sl.get_shape() else self.full(key)  # a 0-d tensor (BatchNorm's num_batches_tracked)
        idx = [slice(None)] * len(sl.get_shape())
        idx[dim] = slice(start, start + length)
        return sl[tuple(idx)]

    def full(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)


def _group(name: str | None):
    if name == "tp":
        return parallel_state.get_tensor_model_parallel_group()
    if name == "ep":
        return parallel_state.get_expert_model_parallel_group()
    return None


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor; a 3-D expert weight [E, rows, cols] as its [E·rows, cols] view (E HF matrices stacked); the
    routers' expert biases and the sound encoder's persistent buffers (BatchNorm statistics) included."""
    out = {n: p.flatten(0, 1) if EXPERT_WEIGHTS.search(n) else p for n, p in model.named_parameters()}
    out.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
    if getattr(model, "sound_encoder", None) is not None:
        out.update({f"sound_encoder.{n}": b for n, b in model.sound_encoder.state_dict(keep_vars=True).items()
                    if f"sound_encoder.{n}" not in out})
    return out


def load_hf_weights(model: OmniModel, hf_dir: str | os.PathLike) -> dict:
    """Copy this rank's TP / EP slices of the checkpoint into `model` (untouched keys: `model.hf_untouched_keys`).
    Returns {"params", "hf_keys", "untouched": {prefix: count}}; ValueError for an unknown key or a wrong shape."""
    reader = HFReader(hf_dir)
    maps = hf_param_map(model)
    tensors = _model_tensors(model)
    used: set[str] = set()
    for name, pm in maps.items():
        rank, size = group_rank_size(_group(pm.group))
        for r in range(size):  # every rank of the group: the keys the whole model covers
            used.update(s.key for s in pm.slices(r, size))
        parts = [reader.read(s.key, pm.dim, s.start, s.length) for s in pm.slices(rank, size)]
        value = torch.cat(parts, dim=pm.dim) if len(parts) > 1 else parts[0]
        target = tensors[name]
        if value.shape != target.shape:
            raise ValueError(f"{name}: megatron shape {tuple(target.shape)} but the checkpoint gives "
                             f"{tuple(value.shape)} from {[s.key for s in pm.slices(rank, size)][:3]}")
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
    untouched = sorted(k for k in reader.weight_map if k not in used)
    if unknown := [k for k in untouched if not k.startswith(UNTOUCHED_PREFIXES)]:
        raise ValueError(f"{hf_dir}: {len(unknown)} checkpoint keys have no place in the model and are not a known "
                         f"untrained component: {unknown[:10]}")
    counts = dict(collections.Counter(next(p for p in UNTOUCHED_PREFIXES if k.startswith(p)) for k in untouched))
    model.hf_untouched_keys = untouched
    return {"params": len(maps), "hf_keys": len(used), "untouched": counts}


def build_from_hf(cfg, kernels):
    """The model of model.hf_path with its weights, on `kernels` (kernel_selection.Kernels, the printed line): the
    policy, or the reference."""
    import model_hub

    folder = model_hub.model_dir(cfg.model)
    model = build_model(folder, cfg.model, cfg.parallel, kernels=kernels)
    load_hf_weights(model, folder)
    return model


def export_hf(model: OmniModel, out_dir: str | os.PathLike, src_hf_dir: str | os.PathLike) -> dict | None:
    """Write `model` as an HF checkpoint in `src_hf_dir`'s keys, files and dtypes, its untouched keys and other files
    copied (collective; rank 0 writes, mode 0666 - umask). Returns {"keys", "files"} on rank 0, else None."""
    src = HFReader(src_hf_dir)
    maps = hf_param_map(model)
    tensors = _model_tensors(model)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, pm in maps.items():
        group = _group(pm.group)
        rank, size = group_rank_size(group)
        local = tensors[name].detach().contiguous()
        shards = [local]
        if size > 1:
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local, group=group)
        if not is_writer:
            continue
        for r, shard in enumerate(shards):
            off = 0
            for s in pm.slices(r, size):
                if s.key not in out:
                    shape, dtype = src.shape_dtype(s.key)
                    out[s.key] = torch.empty(shape, dtype=_SAFETENSORS_DTYPES[dtype])
                dst = out[s.key]
                if dst.dim() == 0:
                    dst.copy_(shard)
                    continue
                n = dst.shape[pm.dim] if s.length is None else s.length
                piece, target = shard.narrow(pm.dim, off, n), dst.narrow(pm.dim, s.start, n)
                if piece.shape != target.shape:
                    raise ValueError(f"export {name}: piece {tuple(piece.shape)} does not fit {s.key} "
                                     f"rows {s.start}:{s.start + n} {tuple(target.shape)}")
                target.copy_(piece)
                off += n
    if not is_writer:
        dist.barrier()
        return None
    for key in getattr(model, "hf_untouched_keys", None) or [k for k in src.weight_map if k not in out]:
        out[key] = src.full(key)
    if missing := [k for k in src.weight_map if k not in out]:
        raise ValueError(f"export would drop {len(missing)} source keys: {missing[:10]}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(src_hf_dir).iterdir():  # config, tokenizer, processor, custom code
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for key, fname in src.weight_map.items():
        files.setdefault(fname, {})[key] = out[key].contiguous()
    umask = os.umask(0)  # read it (os has no getter) and put it back at once
    os.umask(umask)
    for fname, sd in files.items():
        save_file(sd, str(out_dir / fname), metadata={"format": "pt"})
        os.chmod(out_dir / fname, 0o666 & ~umask)  # safetensors creates 0600; a file made with open() gets 0666 - umask
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in out.values())},
             "weight_map": dict(sorted(src.weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return {"keys": len(out), "files": len(files)}


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
                       "I32": torch.int32, "F64": torch.float64, "U8": torch.uint8, "BOOL": torch.bool}


def smoke_run() -> None:
    """One-rank smoke run: build the model of [HF_DIR] (default assets/tiny-omni), load its weights, print the load
    report and the logits' shape for 16 random tokens. argparse's error (exit 2) for a directory without config.json,
    before any process group exists."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python hf_weights.py",
        description="Smoke run: build the Omni model of an HF checkpoint directory on one rank (on the GPU when there "
                    "is one), load its weights, print the load report and the logits' shape for 16 random tokens.")
    ap.add_argument("hf_dir", nargs="?", default="assets/tiny-omni",
                    help="the HF checkpoint directory (default: %(default)s)")  # fmt: skip
    hf_dir = ap.parse_args().hf_dir
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        ap.error(f"{hf_dir}: no config.json (not an HF checkpoint directory)")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import config as config_mod

    init_distributed(device=local_device())  # build_model puts the model on the GPU when there is one
    model = build_model(hf_dir, config_mod.ModelConfig(hf_path=hf_dir), config_mod.ParallelConfig())
    print(load_hf_weights(model, hf_dir))
    ids = torch.randint(32, 200, (1, 16), device=next(model.parameters()).device)
    print("logits", tuple(model({"input_ids": ids}).shape))


if __name__ == "__main__":
    smoke_run()

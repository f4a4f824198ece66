"""LoRA adapters on megatron-core's linears: W + (alpha / r)·B·A with the base frozen (Hu et al. 2021, "LoRA").

    adapters = lora.apply_lora(model, cfg.lora)       # after hf_weights.load_hf_weights; freezes every base parameter
    logits = model(batch)                               # the base plus the adapters
    with lora.adapters_disabled(model):                 # the reference: the same model, the adapters off, no copy
        ref_logits = model(batch)
    lora.merge(model); hf_weights.export_hf(model, out, hf_dir)   # W += (alpha / r)·B·A, the adapters removed
    lora.save_peft(model, out, hf_dir, cfg.lora)        # or the adapters alone: adapter_config.json + safetensors

Adapters are `Adapter` children of their base layers (`base_view` hides them); B starts at 0, A is seeded by the
layer's name (every TP / EP layout starts alike). TP, SP and EP (a pair per routed expert): docs/DESIGN.md, "LoRA".
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.extensions.transformer_engine import (
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    TERowParallelLinear,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from backend.local_spec import GroupedExperts, _norm, grouped_mm

# the base linears an adapter wraps (without Transformer Engine megatron-core leaves mocks in TE's class names)
COLUMN = tuple(c for c in (ColumnParallelLinear, TEColumnParallelLinear, TELayerNormColumnParallelLinear)
               if isinstance(c, type))
ROW = tuple(c for c in (RowParallelLinear, TERowParallelLinear) if isinstance(c, type))


class Adapter(nn.Module):
    """One LoRA pair of a base weight `weight_name`: A [r, in] / B [out, r] (this rank's shard; [E, ...] for the
    routed experts), the base's dtype and device; `kind` "column" | "row" | "experts"; adds (alpha / r)·B·(A·x)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float, dropout: float, kind: str, weight_name: str):
        super().__init__()
        self.A, self.B = nn.Parameter(a), nn.Parameter(b)
        self.scale, self.dropout, self.kind, self.weight_name = scale, dropout, kind, weight_name
        self.enabled = True

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """(alpha / r)·B·A in fp32: [out, in] of this rank's shard of W ([E, out, in] for the experts)."""
        return self.scale * (self.B.float() @ self.A.float())


def _tp_comm(base: nn.Module) -> tuple[object | None, bool]:
    """(TP group, sequence parallel) of the base's reduction; (None, False) when it has none (TP 1, expert linears:
    megatron's token dispatcher moves their tokens)."""
    if getattr(base, "explicit_expert_comm", False):
        return None, False
    group = getattr(base, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    if group is None or group.size() == 1:
        return None, False
    return group, bool(getattr(base, "sequence_parallel", False))


def _column_hook(base: nn.Module, args: tuple, output: tuple) -> tuple:
    """Forward hook of a column-parallel base: (out, bias) -> (out + (alpha / r)·(x·Aᵀ)·B_localᵀ, bias)."""
    ad = base.lora
    if not ad.enabled:
        return output
    out, bias = output
    x = args[0]
    if getattr(base, "layer_norm_weight", None) is not None:  # the norm fused into the base: the adapter's input
        c = base.config
        x = _norm(x, base.layer_norm_weight, getattr(base, "layer_norm_bias", None), c.layernorm_epsilon,
                  c.normalization)
    u = F.linear(ad.input(x), ad.A)  # [tokens on this rank, b, r]
    group, sp = _tp_comm(base)
    if group is not None:
        u = mappings.gather_from_sequence_parallel_region(u, True, group=group) if sp else \
            mappings.copy_to_tensor_model_parallel_region(u, group=group)
    return out + F.linear(u, ad.B) * ad.scale, bias


def _row_hook(base: nn.Module, args: tuple, output: tuple) -> tuple:
    """Forward hook of a row-parallel base: (out, bias) -> (out + (alpha / r)·reduce(x_local·A_localᵀ)·Bᵀ, bias)."""
    ad = base.lora
    if not ad.enabled:
        return output
    out, bias = output
    u = F.linear(ad.input(args[0]), ad.A)  # partial sum over this rank's input columns
    group, sp = _tp_comm(base)
    if group is not None:
        u = mappings.reduce_scatter_to_sequence_parallel_region(u, group=group) if sp else \
            mappings.reduce_from_tensor_model_parallel_region(u, group=group)
    return out + F.linear(u, ad.B) * ad.scale, bias


class LoraGroupedExperts(GroupedExperts):
    """GroupedExperts with per-expert adapters `lora_fc1` / `lora_fc2` (either may be absent): h = x·W1[e]ᵀ +
    (alpha / r)·(x·A1[e]ᵀ)·B1[e]ᵀ for the tokens of expert e, the same for fc2. With the adapters off:
    GroupedExperts.forward itself."""

    def _delta(self, name: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor | int:
        ad = getattr(self, name, None)
        if ad is None:
            return 0
        u = grouped_mm(ad.input(x).contiguous(), ad.A.transpose(1, 2), offs)  # [T, r]
        return grouped_mm(u, ad.B.transpose(1, 2), offs) * ad.scale

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not any(a.enabled for a in self.children() if isinstance(a, Adapter)):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x, probs = permuted_local_hidden_states, permuted_probs  # as GroupedExperts.forward, plus the deltas
        if self.config.moe_apply_probs_on_input:
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        offs = tokens_per_expert.to(device=x.device, non_blocking=True).cumsum(0).to(torch.int32)
        h = grouped_mm(x.contiguous(), self.weight1.transpose(1, 2), offs) + self._delta("lora_fc1", x, offs)
        h = self._activation(h, probs)
        return grouped_mm(h.contiguous(), self.weight2.transpose(1, 2), offs) + self._delta("lora_fc2", h, offs), None


# ======================================================================================================================
# Building, switching, merging


def _component(name: str, lcfg) -> bool:
    """Whether module `name` of OmniModel lies in a component that lcfg's flags give adapters."""
    if name.startswith("vision_model."):
        return lcfg.vision_tower
    if name.startswith("vision_projection."):
        return lcfg.projector
    if name.startswith("sound_projection."):
        return lcfg.sound_projector
    if ".mlp.shared_experts." in name:
        return lcfg.shared_expert
    if ".mlp.experts." in name:
        return lcfg.routed_experts
    return name.startswith("language_model.") and lcfg.language_model


def _uniform_a(key: str, shape: tuple[int, ...], fan_in: int, seed: int) -> torch.Tensor:
    """A's fp32 initial value, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform_ with a = sqrt(5)), from a CPU
    generator seeded by (seed, key): the same whole tensor on every rank and layout."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul(1 / math.sqrt(fan_in)).float()


def _tag_like(p: nn.Parameter, w: torch.Tensor, tp_dim: int | None, sequence_parallel: bool) -> None:
    """megatron's attributes: TP-sharded on tp_dim (else replicated), `sequence_parallel`, the expert `allreduce`."""
    if tp_dim is not None:
        set_tensor_model_parallel_attributes(p, is_parallel=True, dim=tp_dim, stride=1)
    if sequence_parallel:
        p.sequence_parallel = True
    if hasattr(w, "allreduce"):
        p.allreduce = w.allreduce


def _linear_adapter(name: str, base: nn.Module, lcfg, seed: int) -> Adapter:
    """The adapter of a column / row parallel base linear, its A drawn whole and sliced to this TP rank."""
    w, r = base.weight, lcfg.rank
    if isinstance(base, ROW):
        assert getattr(base, "input_is_parallel", True), f"{name}: a row-parallel input that is not parallel"
        group, sp = _tp_comm(base)
        tp, rank = (group.size(), group.rank()) if group is not None else (1, 0)
        out, in_local = w.shape
        a = _uniform_a(name, (r, in_local * tp), in_local * tp, seed)[:, rank * in_local:(rank + 1) * in_local]
        ad = Adapter(a.to(w.device, w.dtype), torch.zeros(out, r, dtype=w.dtype, device=w.device),
                     lcfg.alpha / r, lcfg.dropout, "row", "weight")
        _tag_like(ad.A, w, 1 if group is not None else None, False)
        _tag_like(ad.B, w, None, sp)
    else:
        assert not getattr(base, "gather_output", False), f"{name}: a column-parallel output that is gathered"
        group, sp = _tp_comm(base)
        out_local, fan_in = w.shape
        ad = Adapter(_uniform_a(name, (r, fan_in), fan_in, seed).to(w.device, w.dtype),
                     torch.zeros(out_local, r, dtype=w.dtype, device=w.device), lcfg.alpha / r, lcfg.dropout,
                     "column", "weight")
        _tag_like(ad.A, w, None, sp)
        _tag_like(ad.B, w, 0 if group is not None else None, False)
    return ad


def _expert_adapter(name: str, experts: GroupedExperts, fc: int, lcfg, seed: int) -> Adapter:
    """Per-expert adapters of weight{fc} [E_local, out, in]: A from the whole [E, r, in], this EP rank's experts."""
    w, r = getattr(experts, f"weight{fc}"), lcfg.rank
    n, out, fan_in = w.shape
    ep, ep_rank = experts.ep_group.size(), experts.ep_group.rank()
    a = _uniform_a(f"{name}.weight{fc}", (n * ep, r, fan_in), fan_in, seed)[ep_rank * n:(ep_rank + 1) * n]
    ad = Adapter(a.to(w.device, w.dtype), torch.zeros(n, out, r, dtype=w.dtype, device=w.device), lcfg.alpha / r,
                 lcfg.dropout, "experts", f"weight{fc}")
    for p in (ad.A, ad.B):
        _tag_like(p, w, 0, False)
    return ad


def apply_lora(model: nn.Module, lcfg, seed: int = 0) -> list[nn.Parameter]:
    """Freeze every parameter of `model` and add adapters (config.LoraConfig `lcfg`, rank > 0) to the targeted
    layers of the flagged components; returns the adapter parameters (the only ones requiring grad), A before B.
    ValueError when nothing matches; NotImplementedError for a layer kind without an adapter here."""
    assert lcfg.rank > 0, "lora.rank = 0: LoRA is off"
    for p in model.parameters():
        p.requires_grad_(False)
    targets = set(lcfg.targets)
    params: list[nn.Parameter] = []
    for name, module in list(model.named_modules()):
        if isinstance(module, GroupedExperts) and _component(name + ".", lcfg):
            for fc in (1, 2):
                if f"linear_fc{fc}" in targets:
                    module.add_module(f"lora_fc{fc}", _expert_adapter(name, module, fc, lcfg, seed))
                    params += [module.get_submodule(f"lora_fc{fc}").A, module.get_submodule(f"lora_fc{fc}").B]
            if hasattr(module, "lora_fc1") or hasattr(module, "lora_fc2"):
                module.__class__ = LoraGroupedExperts
            continue
        if name.rsplit(".", 1)[-1] not in targets or not _component(name, lcfg):
            continue
        if not isinstance(module, COLUMN + ROW):
            raise NotImplementedError(f"{name}: no LoRA adapter for {type(module).__name__}")
        if getattr(module, "config", None) is not None and getattr(module.config, "layernorm_zero_centered_gamma",
                                                                   False):
            raise NotImplementedError(f"{name}: zero-centred norm weights are not applied to the adapter's input")
        module.lora = _linear_adapter(name, module, lcfg, seed)
        module.lora_hook = module.register_forward_hook(_row_hook if isinstance(module, ROW) else _column_hook)
        params += [module.lora.A, module.lora.B]
    if not params:
        raise ValueError(f"lora.targets = {lcfg.targets} with the component flags of {lcfg} match no layer")
    return params


def adapted(model: nn.Module) -> Iterator[tuple[str, nn.Module, Adapter]]:
    """(base module name, base module, adapter) for every adapter of `model`."""
    for name, module in model.named_modules():
        for child in module.children():
            if isinstance(child, Adapter):
                yield name, module, child


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run `model` as the base model inside the block (every adapter off, restored after; no copy, no grad change)."""
    states = [(ad, ad.enabled) for _, _, ad in adapted(model)]
    for ad, _ in states:
        ad.enabled = False
    try:
        yield model
    finally:
        for ad, state in states:
            ad.enabled = state


@contextlib.contextmanager
def base_view(model: nn.Module):
    """Inside the block the adapters are out of the module tree: named_parameters / state_dict as the base model's
    (hf_weights.hf_param_map, export, a digest of the base). Not for a forward."""
    held = [(module, key, child) for module in model.modules()
            for key, child in list(module._modules.items()) if isinstance(child, Adapter)]
    for module, key, _ in held:
        del module._modules[key]
    try:
        yield model
    finally:
        for module, key, child in held:
            module._modules[key] = child


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{base weight name: W + (alpha / r)·B·A} for every adapted weight, this rank's shard in W's dtype (summed in
    fp32); the model is left unchanged."""
    out = {}
    for name, module, ad in adapted(model):
        w = getattr(module, ad.weight_name)
        out[f"{name}.{ad.weight_name}" if name else ad.weight_name] = (w.float() + ad.delta_weight()).to(w.dtype)
    return out


@torch.no_grad()
def merge(model: nn.Module) -> None:
    """W += (alpha / r)·B·A in place (fp32 sum, W's dtype), then remove every adapter: the model is a plain base
    model again (for hf_weights.export_hf). Parameters' requires_grad are left as apply_lora set them."""
    for name, w in merged_state(model).items():
        model.get_parameter(name).copy_(w)
    for _, module, ad in list(adapted(model)):
        if ad.kind == "experts":
            delattr(module, f"lora_fc{ad.weight_name[-1]}")
            if not any(isinstance(c, Adapter) for c in module.children()):
                module.__class__ = GroupedExperts
        else:
            module.lora_hook.remove()
            del module.lora, module.lora_hook


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, Adapter) for m in model.modules())


def sharded_state_dict(model: nn.Module) -> dict:
    """megatron dist_checkpointing ShardedTensors of every adapter parameter, keyed by its name in `model` (a LoRA
    checkpoint's model part): a TP-sharded one (megatron's `tensor_model_parallel` tag: column B, row A) on its
    `partition_dim` over the base's TP group, replicated ones over TP; the routed experts' A [E, r, in] / B [E, out, r]
    at rows ep_rank·E of the expert axis over EP, replicated over expert DP; the rest replicated over DP (× CP)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.ssm.utils import _split_tensor_factory

    dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_rank = dp.rank() if dp is not None else 0
    out = {}
    for name, module, ad in adapted(model):
        child = next(k for k, c in module.named_children() if c is ad)
        if ad.kind != "experts" and getattr(module, "explicit_expert_comm", False):
            raise NotImplementedError(f"{name}: adapters on SequentialMLP's expert linears have no checkpoint layout")
        group, _ = _tp_comm(module) if ad.kind != "experts" else (None, False)
        tp_rank, tp = (group.rank(), group.size()) if group is not None else (0, 1)
        for x in ("A", "B"):
            key, p = f"{name}.{child}.{x}" if name else f"{child}.{x}", getattr(ad, x)
            if ad.kind == "experts":
                out[key] = ShardedTensor.from_rank_offsets(key, p, (0, module.ep_group.rank(), module.ep_group.size()),
                                                           replica_id=(0, 0, module.dp_group.rank()))
            elif tp > 1 and getattr(p, "tensor_model_parallel", False):
                out[key] = ShardedTensor.from_rank_offsets(key, p, (p.partition_dim, tp_rank, tp),
                                                           replica_id=(0, 0, dp_rank))
            else:
                out[key] = ShardedTensor.from_rank_offsets(key, p, replica_id=(0, tp_rank, dp_rank))
        if isinstance(mixer := model.get_submodule(name.rpartition(".")[0]), MambaMixer) and child == "lora" \
                and module is mixer.in_proj:  # B's rows: this rank's z | x | B | C | dt, as megatron splits W's
            out[key] = _split_tensor_factory(out[key], [mixer.d_inner_local_tp, mixer.d_inner_local_tp,
                                                        mixer.ngroups_local_tp * mixer.d_state,
                                                        mixer.ngroups_local_tp * mixer.d_state, mixer.nheads_local_tp],
                                             ["z", "x", "B", "C", "dt"], 0)
    return out


# ======================================================================================================================
# The adapters in HF names (PEFT)


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    if group is None or group.size() == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


@torch.no_grad()
def hf_adapter_state(model: nn.Module, hf_dir, grads: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF checkpoint key of the base weight: (A [r, in], B [out, r])} in the checkpoint's layout, gathered over TP
    (collective): megatron's fused QKV gives q / k / v entries that share A and split B by hf_weights' rows (GQA as
    the map has it); Mamba in_proj's z / x / B / C / dt pieces rejoin one B. grads: the parameters' .grad instead
    (replicated ones as they stand: reduce them first). Routed experts: NotImplementedError."""
    import hf_weights

    with base_view(model):
        maps = hf_weights.hf_param_map(model)
    reader = hf_weights.HFReader(hf_dir)
    out: dict[str, list[torch.Tensor]] = {}
    for name, _, ad in adapted(model):
        if ad.kind == "experts":
            raise NotImplementedError(f"{name}: per-expert adapters have no PEFT layout here yet")
        a, b = (ad.A.grad, ad.B.grad) if grads else (ad.A, ad.B)
        pm = maps[f"{name}.{ad.weight_name}"]
        group = hf_weights._group(pm.group)
        shards = _gather(b if ad.kind == "column" else a, group)
        for r, shard in enumerate(shards):
            off = 0
            for s in pm.slices(r, len(shards)):
                shape = reader.shape_dtype(s.key)[0]
                if s.key not in out:
                    out[s.key] = [a.float().clone(), torch.zeros(shape[0], a.shape[0])] if ad.kind == "column" else \
                        [torch.zeros(a.shape[0], shape[1]), b.float().clone()]
                n = shape[pm.dim] if s.length is None else s.length
                if ad.kind == "column":
                    out[s.key][1][s.start:s.start + n] = shard[off:off + n].float()
                else:
                    out[s.key][0][:, s.start:s.start + n] = shard[:, off:off + n].float()
                off += n
    return {k: (v[0], v[1]) for k, v in out.items()}


@torch.no_grad()
def set_hf_adapter_state(model: nn.Module, state: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The inverse of `hf_adapter_state`: every (non-expert) adapter's A and B, this rank's shard, from {HF key of the
    base weight: (A [r, in], B [out, r])} (the same full dict on every rank; e.g. a PEFT adapter read back)."""
    import hf_weights

    with base_view(model):
        maps = hf_weights.hf_param_map(model)
    for name, _, ad in adapted(model):
        if ad.kind == "experts":
            raise NotImplementedError(f"{name}: per-expert adapters have no HF layout here yet")
        pm = maps[f"{name}.{ad.weight_name}"]
        rank, size = hf_weights.group_rank_size(hf_weights._group(pm.group))
        segments = pm.slices(rank, size)
        if ad.kind == "column":  # A whole, B's rows from the segments
            ad.A.copy_(state[segments[0].key][0])
            ad.B.copy_(torch.cat([state[s.key][1].narrow(0, s.start, s.length or state[s.key][1].shape[0])
                                  for s in segments]))
        else:  # A's columns from the segments, B whole
            ad.A.copy_(torch.cat([state[s.key][0].narrow(1, s.start, s.length or state[s.key][0].shape[1])
                                  for s in segments], dim=1))
            ad.B.copy_(state[segments[0].key][1])


# checkpoint key prefix -> transformers module (its conversion mapping renames the sound projection)
HF_MODULE_PREFIXES = {"language_model.backbone.": "language_model.model.",
                      "sound_projection.linear1.": "embed_audio.linear_1.",
                      "sound_projection.linear2.": "embed_audio.linear_2."}


def peft_state_dict(model: nn.Module, hf_dir) -> dict[str, torch.Tensor]:
    """PEFT's adapter_model.safetensors keys (`base_model.model.<transformers module>.lora_{A,B}.weight`, fp32) of the
    language model's and the sound projection's adapters (collective); the vision tower / projector:
    NotImplementedError (not mapped yet)."""
    sd = {}
    for key, (a, b) in hf_adapter_state(model, hf_dir).items():
        prefix = next((p for p in HF_MODULE_PREFIXES if key.startswith(p)), None)
        if prefix is None:
            raise NotImplementedError(f"{key}: no PEFT module name mapped for this component yet")
        module = (HF_MODULE_PREFIXES[prefix] + key[len(prefix):]).removesuffix(".weight")
        sd[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        sd[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    return sd


def save_peft(model: nn.Module, out_dir, hf_dir, lcfg) -> dict | None:
    """Write `out_dir`/adapter_config.json + adapter_model.safetensors for peft.PeftModel.from_pretrained over
    transformers' NemotronH_Omni_Reasoning_V3 of `hf_dir` (collective; rank 0 writes). Returns {"modules"} there."""
    from safetensors.torch import save_file

    sd = peft_state_dict(model, hf_dir)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in sd})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = os.path.abspath(hf_dir) if Path(hf_dir).is_dir() else str(hf_dir)  # a local base: loadable from anywhere
    config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base, "r": lcfg.rank,
              "lora_alpha": lcfg.alpha, "lora_dropout": lcfg.dropout, "target_modules": modules, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(sd, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return {"modules": len(modules)}

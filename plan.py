"""Will it fit? Plan a run's per-GPU memory without a GPU and without weights.

    python plan.py configs/nano.toml model.hf_path=assets/nano-omni-config           # 8 ranks (TP 8, EP 8)
    python plan.py configs/nano.toml model.hf_path=/ckpt/Nemotron-3-Nano-Omni-... --gpus 16   # two nodes: DP 2
    python plan.py configs/nano-lora.toml                                            # LoRA on one GPU

`make_plan` builds what train.py builds on each distinct rank on the `meta` device in torch's "fake" process group
and counts weights, gradients, optimizer state and reference; `activation_model` adds a bin's activations;
`format_plan` prints the table against 80 GB and 141 GB GPUs and the largest packing.max_tokens_per_bin that fits.
With lora.rank > 0 the rank's model gets its adapters from lora.apply_lora (base frozen: megatron DDP and the
optimizer hold only the adapters) and no reference model is built (`LoraPlan`)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import config as config_mod  # noqa: E402

config_mod.quiet_known_warnings()  # before megatron-core is imported
import distributed  # noqa: E402
import mmpr_records  # noqa: E402
import model_hub  # noqa: E402
import omni_model  # noqa: E402
import plan_media  # noqa: E402
import preflight  # noqa: E402
from backend import kernel_selection  # noqa: E402

GiB, MiB = 2**30, 2**20
# Usable memory (torch's total capacity) of an 80 GB H100 / A100 and a 141 GB H200 (docs/PERFORMANCE.md).
GPUS = {"80 GB": 79.1 * GiB, "141 GB": 139.8 * GiB}

# What a GPU holds besides the tensors the plan counts (`Reserve`); docs/DESIGN.md, "The memory plan", says why.
CUDA_CONTEXT = 0.75 * GiB  # the CUDA context (lazy module loading) with cuBLAS / cuBLASLt workspaces, per process
NCCL_CHANNELS = 32  # the most channels NCCL opens per communicator (its MAXCHANNELS on Hopper NVLink nodes)
NCCL_CONNECTIONS = 2  # receive connections per channel: ring and tree
# per connection, NCCL's three protocol buffers at their defaults: Simple = NCCL_BUFFSIZE (4 MiB, NCCL's environment
# variable docs); LL128 = 120 x 640 threads x 8 steps x 8 B; LL = 8 x 512 threads x 8 steps x 16 B (NCCL's device.h)
NCCL_CONNECTION_BYTES = 4 * MiB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
FRAGMENTATION = 0.05  # of the allocated bytes: the caching allocator's unused reserve with expandable segments
ALLOC_CONF = "expandable_segments:True"  # PYTORCH_CUDA_ALLOC_CONF that train.py sets unless the user set it
MARGIN = 4 * GiB  # the spare after the reserve below which the verdict is "too tight"
# hub ids whose config.json ships in assets/ (a plan needs no weights): planned from it when model.hf_path is the id
SHIPPED_CONFIGS = {
    "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16": Path(__file__).parent / "assets" / "nano-omni-config"}


# ---- One rank on the meta device ----------
class _MetaAllocations(torch.overrides.TorchFunctionMode):
    """Every tensor factory call makes a meta tensor (even with `device=`), except inside `_plain`."""

    paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _MetaAllocations.paused and func in torch.utils._device._device_constructors():
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _plain(fn):
    def call(*args, **kwargs):
        _MetaAllocations.paused = True
        try:
            return fn(*args, **kwargs)
        finally:
            _MetaAllocations.paused = False

    return call


@contextlib.contextmanager
def fake_rank(cfg, world: int, rank: int, num_experts: int | None, kernels=None):
    """This process as `rank` of `world` in torch's "fake" process group (then init_distributed with `kernels`, the
    run's selection); restored on exit."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    had_world = dist.is_initialized()
    if had_world:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    env = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)  # init_distributed validates the layout against torchrun's world
    gather, new_group = dist.all_gather_object, dist.new_group

    def fake_group(*args, backend=None, **kwargs):  # megatron's gloo side groups (DP > 1): fake ones too
        return new_group(*args, **kwargs)

    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        dist.all_gather_object, dist.new_group = _plain(gather), fake_group
        yield distributed.init_distributed(cfg, torch.device("cpu"), num_experts, kernels=kernels)
    finally:
        dist.all_gather_object, dist.new_group = gather, new_group
        if env is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = env
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        if had_world:
            distributed.init_distributed()


def build_rank(cfg):
    """(policy, reference, ddp, optimizer) as train.main builds them, on the meta device, without weights. With
    lora.rank > 0: the policy with lora.apply_lora's adapters (every base parameter frozen) and reference None (the
    reference is the policy with its adapters off)."""
    import lora
    import train

    with _MetaAllocations():
        reference = None
        if cfg.lora.rank == 0:
            reference = omni_model.build_model(cfg.model.hf_path, cfg.model, cfg.parallel).eval().requires_grad_(False)
        policy = omni_model.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
        if cfg.lora.rank > 0:
            lora.apply_lora(policy, cfg.lora, cfg.mpo.seed)
        ddp, optimizer, _ = train.build_optimizer(policy, cfg)
    return policy, reference, ddp, optimizer


# ---- Counting ----------
COMPONENTS = ("language_model", "vision_model", "vision_projection")
SOUND_COMPONENTS = ("sound_encoder", "sound_projection")  # a checkpoint with a sound_config


def _routed(model) -> set[int]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}


def _global_numel(params, model) -> int:
    """Global element count of this rank's `params` of `model`: TP splits times TP, routed experts times EP."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    routed = _routed(model)
    return sum(p.numel() * (ep if id(p) in routed else tp if getattr(p, "tensor_model_parallel", False) else 1)
               for p in params)


def global_counts(model, hf) -> dict[str, int]:
    """Global parameter counts {component, "total", "active"} from one rank: TP splits times TP, experts times EP;
    the base model's (LoRA adapters apart: `LoraPlan`)."""
    import lora
    import monitor

    out = {}
    with lora.base_view(model):
        names = [n for n in COMPONENTS + SOUND_COMPONENTS if getattr(model, n, None) is not None]
        for name in names:
            out[name] = _global_numel(getattr(model, name).parameters(), model)
        out["total"] = sum(out[n] for n in names)
        out["active"] = monitor.active_params(model, hf)
    return out


def rank_params(model, hf) -> tuple[int, int]:
    """(parameters on this rank, the share a token multiplies with: top_k / n_routed of the routed experts)."""
    routed = _routed(model)
    total = sum(p.numel() for p in model.parameters())
    n_exp = getattr(hf.text, "n_routed_experts", 0) or 0
    share = hf.text.num_experts_per_tok / n_exp if n_exp else 1.0
    experts = sum(p.numel() for p in model.parameters() if id(p) in routed)
    return total, int(total - experts + experts * share)


def _model_bytes(model) -> int:
    tensors = list(model.parameters()) + [b for n, b in model.named_buffers() if n.endswith("expert_bias")]
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_bytes_per_param(cfg) -> tuple[int, int]:
    """(master, Adam moments) bytes per trained parameter as the configured optimizer holds them: bf16 weights' fp32
    master copies (4), with the precision-aware optimizer and store_param_remainders their int16 remainders (2);
    each moment in its dtype (fp32 4, bf16 2)."""
    o = cfg.optimizer
    master = 0 if cfg.model.params_dtype != "bfloat16" else 2 if (o.use_precision_aware_optimizer
                                                                   and o.store_param_remainders) else 4
    return master, sum(4 if d == "fp32" else 2 for d in (o.exp_avg_dtype, o.exp_avg_sq_dtype))


def optimizer_bytes(optimizer, cfg) -> tuple[int, int]:
    """(master, Adam moments) in bytes of this rank's main parameters (its DP shard): `optimizer_bytes_per_param`."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    main = sum(p.numel() for o in optimizers for g in o.optimizer.param_groups for p in g["params"])
    master, moments = optimizer_bytes_per_param(cfg)
    return master * main, moments * main


def step_copy(cfg, fp32_grads: bool, master: int) -> int:
    """Bytes the optimizer step allocates beside the static ones: megatron-core's fp32 copy of bf16 gradient buffers
    (as many bytes as fp32 masters: docs/PERFORMANCE.md, "Gradient buffers"); the precision-aware optimizer reads
    the buffers in place and holds fp32 temporaries for one chunk (precision_adam.STEP_TEMPORARY_BYTES)."""
    from backend import precision_adam

    if cfg.optimizer.use_precision_aware_optimizer:
        return precision_adam.STEP_TEMPORARY_BYTES
    return 0 if fp32_grads else master


# ---- Activations ----------
def mamba_body_bytes_per_token(hf, tp: int, dtype: torch.dtype, tokens: tuple[int, int] = (256, 512)) -> float:
    """Bytes per token mamba_torch's scan saves for backward at this rank's heads (saved-tensor hooks, a slope)."""
    from backend import mamba_torch

    t = hf.text
    nh, hd, ng, ds = t.mamba_num_heads // tp, t.mamba_head_dim, max(t.n_groups // tp, 1), t.ssm_state_size
    di, gn = nh * hd, ng * ds

    def saved(n: int) -> int:
        storages = {}

        def keep(x):
            s = x.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return x

        def leaf(*shape):
            return torch.randn(*shape).to(dtype).requires_grad_()

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
            mamba_torch.mamba_split_conv1d_scan_combined(
                leaf(1, n, 2 * di + 2 * gn + nh), leaf(di + 2 * gn, t.conv_kernel), leaf(di + 2 * gn), leaf(nh),
                -torch.rand(nh).to(dtype).requires_grad_(), leaf(nh), t.chunk_size, rmsnorm_weight=leaf(di),
                rmsnorm_eps=t.layer_norm_epsilon, headdim=hd, ngroups=ng, norm_before_gate=False,
                cu_seqlens=torch.tensor([0, n], dtype=torch.int32))
        return sum(storages.values())

    a, b = tokens
    return (saved(b) - saved(a)) / (b - a)


@dataclass
class ActivationModel:
    """Per-rank activation bytes of one bin: every layer (the layer inputs under "full" recompute), the largest layer
    once more for its backward (twice under "full"), the head, the ViT, the sound towers and the log-prob chunk."""

    per_token: dict[str, float]  # bytes per rank-token of one layer of each kind ("M", "*", "E", "-"), and "head"
    pattern: str
    recompute: str
    cp: int
    input_bytes: float  # bytes per rank-token of a layer's input (what full recompute keeps)
    vit_per_image_token: float  # bytes per image token of the ViT's activations
    vit_layer_per_image_token: float  # bytes per image token of one ViT layer's activations (a forward's working set)
    chunk_bytes: int  # the fused log-prob chunk
    notes: list[str] = field(default_factory=list)
    # LoRA: bytes per rank-token of one layer's adapters of each kind (`adapter_bytes_per_token`), and per image token
    # of every adapter of the ViT and the projector
    adapters: dict[str, float] = field(default_factory=dict)
    vit_adapters_per_image_token: float = 0.0
    # the bin's audio (plan_media.sound_activations): what a step keeps for the sound towers' backward, and what a
    # forward without gradients holds at once
    sound_kept: float = 0.0
    sound_working: float = 0.0

    def layer(self, kind: str, tokens: float) -> float:
        return (self.per_token[kind] + self.adapters.get(kind, 0.0)) * tokens

    def forward_only(self, bin_tokens: int, image_tokens: int = 0) -> float:
        """Peak activation bytes of a forward without gradients (the reference pass; LoRA's reference, the adapters
        off): the residual stream, the largest layer's working set, the head, the ViT and the log-prob chunk; no
        layer keeps anything for later."""
        s = bin_tokens / self.cp
        largest = max(self.per_token[k] * s for k in set(self.pattern))
        vit = self.vit_layer_per_image_token * image_tokens
        return self.input_bytes * s + largest + self.per_token["head"] * s + vit + self.sound_working + self.chunk_bytes

    def __call__(self, bin_tokens: int, image_tokens: int = 0) -> float:
        """Peak activation bytes of a bin of `bin_tokens` tokens (`image_tokens` of them images)."""
        s = bin_tokens / self.cp
        largest = max(self.layer(k, s) for k in set(self.pattern))
        if self.recompute == "full":
            kept = len(self.pattern) * self.input_bytes * s + 2 * largest
        else:
            kept = sum(self.layer(k, s) for k in self.pattern) + largest
        vit = (self.vit_per_image_token + self.vit_adapters_per_image_token) * image_tokens
        return kept + self.per_token["head"] * s + vit + self.sound_kept + self.chunk_bytes


def activation_model(cfg, hf) -> ActivationModel:
    """The activation model of `cfg`'s layout (Korthikanti et al. 2022, section 4; Mamba and MoE terms likewise)."""
    t, v = hf.text, hf.vision
    tp, cp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
    sp = tp if cfg.parallel.sequence_parallel else 1
    dtype = omni_model.torch_dtype(cfg.model.params_dtype)
    b = torch.finfo(dtype).bits // 8
    h = t.hidden_size
    head_dim = getattr(t, "head_dim", None) or h // t.num_attention_heads
    q, kv = t.num_attention_heads * head_dim, t.num_key_value_heads * head_dim
    di = t.mamba_num_heads * t.mamba_head_dim
    n_exp = getattr(t, "n_routed_experts", 0) or 0
    k, f = t.num_experts_per_tok, t.moe_intermediate_size
    f_shared = t.moe_shared_expert_intermediate_size or 0
    # Bytes per rank-token (T/CP tokens; TP shards features, SP the sequence) of one layer of each kind.
    per_token = {
        # norm in / out + the mixer body as mamba_torch saves it (measured) + out_proj's input
        "M": 2 * h / sp * b + mamba_body_bytes_per_token(hf, tp, dtype) + di / tp * b,
        # norm in / out + qkv output + flash-attention output, + fp32 log-sum-exp per head
        "*": (2 * h / sp + (q + 2 * kv) / tp + q / tp) * b + 4 * t.num_attention_heads / tp,
        # norm in / out + k routed copies of (input, fc1 out, act, fc2 out) + shared expert, + fp32 router tensors
        "E": (2 * h / sp + k * (2 * h + 2 * f) / sp + 2 * f_shared / tp) * b + 3 * 4 * n_exp / sp,
        "-": (2 * h / sp + 2 * t.intermediate_size / tp) * b,  # norm in / out + fc1 out, activation
        "head": (3 * h / sp + t.vocab_size / tp) * b,  # final norm in / out, output-layer input, logits
    }
    vh, vlayers = v.hidden_size, v.num_hidden_layers
    # ViT: 4 patches per image token, Korthikanti's 34 h_v bytes per patch and layer at 16 bits (h_v b under "full")
    vit_layer = 4 * vh * 34 * b / 2
    vit = 4 * vlayers * vh * b if cfg.model.recompute == "full" else vlayers * vit_layer
    return ActivationModel(per_token=per_token, pattern=hf.pattern, recompute=cfg.model.recompute,
                           cp=cp, input_bytes=h / sp * b, vit_per_image_token=vit,
                           vit_layer_per_image_token=vit_layer,
                           chunk_bytes=2 * cfg.policy.logprob_chunk_size * (t.vocab_size // tp) * 4)


def adapter_bytes_per_token(model, hf, cfg) -> tuple[dict[str, float], float]:
    """What lora.py's adapters of `model` (this rank, after lora.apply_lora) save for the backward: ({layer kind of
    hf.pattern: bytes per rank-token of the first such layer's adapters}, bytes per image token of every ViT and
    projector adapter). Per adapter, b bytes per element of the base dtype, r the rank, SP the SP factor:
    - column-parallel: u = x·Aᵀ after the SP gather (or TP copy), [tokens, r]: r·b; with the norm fused into the base
      (`layer_norm_weight`) also the adapter's own norm: its fp32 input (4h/SP), normed output (b·h/SP) and fp32
      1/rms (4/SP), h the input width;
    - row-parallel: u reduce-scattered over SP, r·b/SP;
    - routed experts (per-expert pairs): u of fc1 or fc2 for the k routed copies of a token, k·r·b/SP.
    The ViT's and projector's adapters count for each of the 4 patches / 1 token per image token, every layer (an
    upper bound under full recompute). The adapted input x itself is the base layer's, already counted."""
    import lora

    t = hf.text
    sp = cfg.parallel.tensor_model_parallel_size if cfg.parallel.sequence_parallel else 1
    per_kind: dict[str, float] = {}
    first: dict[str, int] = {}
    vit = 0.0
    for name, base, ad in lora.adapted(model):
        r, b = ad.A.shape[-2], ad.A.element_size()
        if ad.kind == "experts":
            nbytes = t.num_experts_per_tok * r * b / sp
        elif ad.kind == "row":
            nbytes = r * b / sp
        else:
            nbytes = r * b
            if getattr(base, "layer_norm_weight", None) is not None:
                nbytes += ((4 + b) * base.layer_norm_weight.shape[0] + 4) / sp
        parts = name.split(".")
        if name.startswith("language_model.decoder.layers."):
            i = int(parts[3])
            kind = hf.pattern[i]
            if first.setdefault(kind, i) == i:
                per_kind[kind] = per_kind.get(kind, 0.0) + nbytes
        elif name.startswith("vision_model."):
            vit += 4 * nbytes
        else:
            vit += nbytes
    return per_kind, vit


# ---- The plan ----------
@dataclass
class RankPlan:
    """One distinct rank's parameters and bytes (a table row)."""

    ranks: list[int]
    params: int
    params_active: int
    reference_params: int
    weights: int
    grads: int
    master: int
    moments: int
    reference: int  # 0 with reference.offload, reference.logprobs = "precomputed" or LoRA (no reference model)
    reference_offloaded: int  # the reference's bytes when it visits the GPU for its passes (reference.offload)
    grads_copy: int  # the optimizer step's temporaries: `step_copy`
    reference_pass: int  # the reference's bytes in the reference pass (reference.logprobs = "precomputed"), else 0
    adapter_params: int = 0  # LoRA: this rank's adapter parameters (`params` counts the base model's)
    adapters: int = 0  # LoRA: their bytes (in `weights` too)

    def static(self) -> int:
        return self.weights + self.grads + self.master + self.moments + self.reference

    def total(self, activations: float) -> float:
        """The peak: the static bytes plus the largest of the policy pass, the reference's visit and the step's copy."""
        return self.static() + max(activations, self.reference_offloaded, self.grads_copy)


def communicators(cfg, world: int) -> list[str]:
    """The NCCL communicators of more than one rank that a training step uses on each GPU: the world (barriers,
    broadcasts), TP (SP gathers, vocab-parallel cross entropy), CP, DP x CP (the gradient sum), EP (token dispatch)
    and the expert DP group (the experts' gradient sum)."""
    p = cfg.parallel
    tp, cp, ep, etp = (p.tensor_model_parallel_size, p.context_parallel_size, p.expert_model_parallel_size,
                       p.expert_tensor_parallel_size)
    sizes = {"world": world, "TP": tp, "CP": cp, "DP x CP": world // tp, "EP": ep, "expert DP": world // (ep * etp)}
    return [name for name, n in sizes.items() if n > 1]


@dataclass
class Reserve:
    """Bytes a GPU holds besides the counted tensors: the CUDA context, NCCL's buffers and the allocator's slack."""

    context: float
    nccl: float
    communicators: list[str]
    fragmentation: float  # a fraction of the allocated bytes

    def total(self, allocated: float) -> float:
        return self.context + self.nccl + self.fragmentation * allocated


def reserve(cfg, world: int) -> Reserve:
    """The stated reserve of `cfg`'s layout (module constants; docs/DESIGN.md, "The memory plan")."""
    comms = communicators(cfg, world)
    return Reserve(context=CUDA_CONTEXT, nccl=len(comms) * NCCL_CHANNELS * NCCL_CONNECTIONS * NCCL_CONNECTION_BYTES,
                   communicators=comms, fragmentation=FRAGMENTATION)


@dataclass
class LoraPlan:
    """A LoRA run's global numbers: the adapters (`lora.apply_lora` on the meta device, global counts: TP shards
    times TP, routed experts' times EP) and the checkpoint sizes. A checkpoint holds per trained parameter its weight
    (params_dtype), with bf16 its fp32 master copy, and Adam's two fp32 moments; the full run trains every parameter
    of `counts["total"]`, the LoRA run only the adapters (the base model is the HF checkpoint, named by its digest)."""

    rank: int
    alpha: float
    targets: list[str]
    components: list[str]
    adapter_params: int  # global
    layers: dict[str, int]  # adapted layers per target name (routed experts: per MoE layer), this rank's model
    bytes_per_param: int  # in a checkpoint: weight + master + moments
    full_params: int

    @property
    def checkpoint_bytes(self) -> int:
        return self.adapter_params * self.bytes_per_param

    @property
    def full_checkpoint_bytes(self) -> int:
        return self.full_params * self.bytes_per_param

    @property
    def checkpoint_ratio(self) -> float:
        return self.checkpoint_bytes / self.full_checkpoint_bytes


LORA_COMPONENTS = ("language_model", "shared_expert", "routed_experts", "vision_tower", "projector")


def lora_plan(model, cfg, counts: dict[str, int]) -> LoraPlan:
    """The LoraPlan of this rank's `model` (after lora.apply_lora) in its fake world."""
    import lora

    adapters = [p for _, _, ad in lora.adapted(model) for p in (ad.A, ad.B)]
    layers: dict[str, int] = {}
    for name, _, ad in lora.adapted(model):
        target = f"linear_fc{ad.weight_name[-1]}" if ad.kind == "experts" else name.rsplit(".", 1)[-1]
        layers[target] = layers.get(target, 0) + 1
    weight = torch.finfo(omni_model.torch_dtype(cfg.model.params_dtype)).bits // 8
    lo = cfg.lora
    return LoraPlan(rank=lo.rank, alpha=lo.alpha, targets=list(lo.targets),
                    components=[c for c in LORA_COMPONENTS if getattr(lo, c)],
                    adapter_params=_global_numel(adapters, model), layers=layers,
                    bytes_per_param=weight + optimizer_bytes_per_param(cfg)[0] + 8,  # moments saved in fp32
                    full_params=counts["total"])


@dataclass
class MemoryPlan:
    world: int
    counts: dict[str, int]
    ranks: list[RankPlan]
    activations: ActivationModel
    bin_tokens: int
    image_tokens: int
    image_source: str  # where image_tokens comes from
    reserve: Reserve
    pass_bin_tokens: int  # the reference pass's bins (reference.max_tokens_per_bin) and their image tokens
    pass_image_tokens: int
    reference_forward: bool = False  # a reference forward in each step (reference.logprobs = "online")
    lora: LoraPlan | None = None
    pairs_image_tokens: int = 0  # the planned pairs' image tokens before the cap at a bin's size
    min_bin_tokens: int = 0  # the smallest packing.max_tokens_per_bin train.py accepts for the data (0: any)
    min_bin_source: str = ""  # what needs min_bin_tokens
    media: plan_media.MediaInputs | None = None  # the bin's media: video frames, audio clips and their tokens

    def step_activations(self, bin_tokens: int | None = None) -> float:
        """Peak activation bytes of a step's bin: the policy's forward and backward, or, when larger, the online
        reference's forward without gradients (`forward_only`; freed before the policy's forward). A bin of another
        size holds the planned pairs' image tokens up to its size."""
        tokens = self.bin_tokens if bin_tokens is None else bin_tokens
        image = self.image_tokens if bin_tokens is None else min(max(self.pairs_image_tokens, self.image_tokens),
                                                                 tokens)
        act = self.activations(tokens, image)
        return max(act, self.activations.forward_only(tokens, image)) if self.reference_forward else act

    def spare(self, capacity: float, bin_tokens: int | None = None) -> float:
        """The least bytes left on any rank's GPU of `capacity` after the plan and the reserve (negative: OOM)."""
        act = self.step_activations(bin_tokens)
        return min(capacity - r.total(act) - self.reserve.total(r.total(act)) for r in self.ranks)

    def pass_total(self) -> float:
        """The reference pass's peak bytes on the largest rank (0 without one): the reference and a forward's
        activations at its bins (`pass_bin_tokens`, `pass_image_tokens`)."""
        act = self.activations.forward_only(self.pass_bin_tokens, self.pass_image_tokens)
        return max((r.reference_pass + act if r.reference_pass else 0) for r in self.ranks)

    def fits(self, capacity: float, bin_tokens: int | None = None) -> bool:
        """At least MARGIN to spare after the reserve, in bins train.py accepts (at least `min_bin_tokens`)."""
        tokens = self.bin_tokens if bin_tokens is None else bin_tokens
        return tokens >= self.min_bin_tokens and self.spare(capacity, bin_tokens) >= MARGIN

    def largest_bin(self, capacity: float, multiple: int) -> int:
        """The largest packing.max_tokens_per_bin (a multiple of `multiple`) that fits `capacity`; 0 if none."""
        lo, hi = 0, 1
        while self.spare(capacity, hi * multiple) >= MARGIN and hi < 2**24:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.spare(capacity, mid * multiple) >= MARGIN else (lo, mid)
        return lo * multiple if lo * multiple >= self.min_bin_tokens else 0


def default_world(cfg) -> int:
    """The smallest world the layout runs on: lcm(TP x CP, ETP x EP)."""
    p = cfg.parallel
    return math.lcm(p.tensor_model_parallel_size * p.context_parallel_size,
                    p.expert_tensor_parallel_size * p.expert_model_parallel_size)


def image_tokens_per_bin(cfg, hf) -> tuple[int, str]:
    """(the ViT's tokens the plan puts in a bin, images' and videos', where the number comes from), at most the bin:
    plan_media.media_inputs'."""
    got = plan_media.media_inputs(cfg, hf)
    return min(got.vit_tokens, cfg.packing.max_tokens_per_bin), got.source


def make_plan(cfg, world: int | None = None, image_tokens: int | None = None, video_frames: int | None = None,
              audio_seconds: float | None = None) -> MemoryPlan:
    """Build and count the first and last rank of `cfg`'s layout on the meta device (others differ only in padding);
    `image_tokens`, `video_frames` and `audio_seconds` per bin (None: plan_media.media_inputs' from the data)."""
    hf = preflight.read_model_config(cfg.model.hf_path)
    media = plan_media.media_inputs(cfg, hf, image_tokens, video_frames, audio_seconds)
    if media.audio_samples and hf.sound is None:
        raise config_mod.ConfigError(f"model.hf_path = {cfg.model.hf_path!r} has no sound_config: a bin of "
                                     f"{media.audio_seconds:g} s of audio ({media.media_source}) cannot be planned")
    image_tokens, image_source = media.vit_tokens, media.source
    need, need_source = media.min_bin_tokens, media.min_bin_source
    world = default_world(cfg) if world is None else world
    preflight.check_packing(cfg)  # train.py's checks in its order, before anything is built
    kernels = kernel_selection.select_kernels(dtype=omni_model.torch_dtype(cfg.model.params_dtype))  # as train.py
    preflight.check_model_config(cfg, hf, kernels)
    config_mod.validate_parallel(cfg, world, getattr(hf.text, "n_routed_experts", None))
    import lora

    table_rows: list[RankPlan] = []
    counts = lplan = None
    adapter_act: tuple[dict[str, float], float] = ({}, 0.0)
    for rank in sorted({0, world - 1}):
        with fake_rank(cfg, world, rank, getattr(hf.text, "n_routed_experts", None), kernels):
            policy, reference, ddp, optimizer = build_rank(cfg)
            if counts is None:
                counts = global_counts(policy, hf)
            adapters = [p for n, p in policy.named_parameters() if p.requires_grad] if reference is None else []
            with lora.base_view(policy):
                total, active = rank_params(policy, hf)
            n_adapter = sum(p.numel() for p in adapters)
            adapter_bytes = sum(p.numel() * p.element_size() for p in adapters)
            if reference is None and lplan is None:
                lplan = lora_plan(policy, cfg, counts)
                adapter_act = adapter_bytes_per_token(policy, hf, cfg)
            master, moments = optimizer_bytes(optimizer, cfg)
            # LoRA: the reference is the policy with the adapters off; the reference pass holds the base model
            ref = _model_bytes(reference) if reference is not None else _model_bytes(policy) - adapter_bytes
            buffers = ddp.buffers + ddp.expert_parallel_buffers
            grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
            fp32_grads = all(b.grad_data.dtype == torch.float32 for b in buffers)
            row = RankPlan(ranks=[rank], params=total, params_active=active,
                           reference_params=sum(p.numel() for p in reference.parameters()) if reference else 0,
                           weights=_model_bytes(policy), grads=grads, master=master, moments=moments,
                           reference=0 if cfg.reference.offload or cfg.reference.logprobs == "precomputed"
                           or reference is None else ref,
                           reference_offloaded=ref if cfg.reference.offload and reference is not None else 0,
                           grads_copy=step_copy(cfg, fp32_grads, master),
                           reference_pass=ref if cfg.reference.logprobs == "precomputed" else 0,
                           adapter_params=n_adapter, adapters=adapter_bytes)
        same = next((r for r in table_rows if {**vars(r), "ranks": 0} == {**vars(row), "ranks": 0}), None)
        if same is not None:
            same.ranks.append(rank)
        else:
            table_rows.append(row)
    pass_bin = cfg.reference.max_tokens_per_bin or cfg.packing.max_tokens_per_bin
    pass_pairs = cfg.reference.max_sequences_per_bin or cfg.packing.max_sequences_per_bin
    activations = activation_model(cfg, hf)
    activations.adapters, activations.vit_adapters_per_image_token = adapter_act
    activations.sound_kept, activations.sound_working = plan_media.sound_activations(
        cfg, hf, omni_model.torch_dtype(cfg.model.params_dtype), media.audio_samples, media.audio_tokens,
        media.hop_length)
    return MemoryPlan(world=world, counts=counts, ranks=table_rows, activations=activations,
                bin_tokens=cfg.packing.max_tokens_per_bin,
                image_tokens=min(image_tokens, cfg.packing.max_tokens_per_bin), image_source=image_source,
                pairs_image_tokens=image_tokens, min_bin_tokens=need, min_bin_source=need_source,
                reserve=reserve(cfg, world), pass_bin_tokens=pass_bin,
                pass_image_tokens=min(pass_bin, image_tokens * pass_pairs // cfg.packing.max_sequences_per_bin),
                reference_forward=cfg.reference.logprobs == "online", lora=lplan, media=media)


# ---- The report ----------
def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def verdict(spare: float) -> str:
    """The plan's word for `spare` bytes left after the plan and the reserve."""
    if spare < 0:
        return f"does NOT fit ({_gib(-spare)} GiB short)"
    if spare < MARGIN:
        return f"too tight ({_gib(spare)} GiB to spare, under the {_gib(MARGIN)} GiB margin)"
    return f"fits, {_gib(spare)} GiB to spare"


def format_plan(plan: MemoryPlan, cfg) -> str:
    """The printed plan: global counts, the per-rank table (GiB), the reserve, the verdict and the largest bin per
    GPU."""
    c, p, res = plan.counts, cfg.parallel, plan.reserve
    dp = plan.world // (p.tensor_model_parallel_size * p.context_parallel_size)
    act = plan.step_activations()
    lines = [
        f"model {cfg.model.hf_path}: language model {_b(c['language_model'])}, vision tower {_b(c['vision_model'])}, "
        f"projector {_b(c['vision_projection'])}"
        + (f", sound encoder {_b(c['sound_encoder'])} + projection {_b(c['sound_projection'])}" if "sound_encoder" in c
           else "") + f"; total {_b(c['total'])}, active per token {_b(c['active'])} "
        "(language model without the input embedding: monitor.active_params)",
        f"layout: {plan.world} GPUs = TP {p.tensor_model_parallel_size} x CP {p.context_parallel_size} x DP {dp} "
        f"(EP {p.expert_model_parallel_size}, SP {p.sequence_parallel}); {cfg.model.params_dtype}, recompute "
        f"{cfg.model.recompute}, reference.offload {cfg.reference.offload}, bins of {plan.bin_tokens} tokens "
        f"({plan.image_tokens} image tokens: {plan.image_source}), log-prob chunk {cfg.policy.logprob_chunk_size}",
        *format_media(plan, cfg),
        "",
        "| ranks | params (policy / reference) | active | weights | grads | master | Adam moments | reference "
        "| activations | total | reserve | 80 GB spare | 141 GB spare |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in plan.ranks:
        total = r.total(act)
        ranks = ", ".join(map(str, r.ranks)) if len(plan.ranks) > 1 else f"all {plan.world}"
        ref = (f"0 (offload; {_gib(r.reference_offloaded)})" if r.reference_offloaded
               else "0 (LoRA: adapters off)" if plan.lora and r.reference_pass == 0
               else "0 (precomputed)" if r.reference_pass else _gib(r.reference))
        params = (f"{_b(r.params)} + {_b(r.adapter_params)} adapters / none" if plan.lora
                  else f"{_b(r.params)} / {_b(r.reference_params)}")
        spare = [_gib(cap - total - res.total(total)) for cap in GPUS.values()]
        at_step = "step temporaries" if cfg.optimizer.use_precision_aware_optimizer else "fp32 at the step"
        grads = _gib(r.grads) + (f" (+{_gib(r.grads_copy)} {at_step})" if r.grads_copy else "")
        lines.append(f"| {ranks} | {params} | {_b(r.params_active)} "
                     f"| {_gib(r.weights)} | {grads} | {_gib(r.master)} | {_gib(r.moments)} | {ref} "
                     f"| {_gib(act)} | {_gib(total)} | {_gib(res.total(total))} | {spare[0]} | {spare[1]} |")
    lines += [
        "",
        f"GiB per GPU. reserve = CUDA context {res.context / GiB:.2f} + NCCL {res.nccl / GiB:.2f} "
        f"({len(res.communicators)} communicator(s): {', '.join(res.communicators) or 'none'}; {NCCL_CHANNELS} "
        f"channels x {NCCL_CONNECTIONS} connections x {NCCL_CONNECTION_BYTES / MiB:.1f} MiB) + allocator slack "
        f"{FRAGMENTATION:.0%} of the total "
        f"(PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF}); a GPU fits with at least {_gib(MARGIN)} GiB to spare after it.",
    ]
    if plan.lora:
        lines += format_lora(plan)
    if pass_total := plan.pass_total():
        verdicts = "; ".join(f"{name}: {verdict(cap - pass_total - res.total(pass_total))}"
                             for name, cap in GPUS.items())
        lines.append(f"The reference pass (reference.logprobs = precomputed; before the policy is built): the "
                     f"reference and a forward without gradients at bins of {plan.pass_bin_tokens} tokens "
                     f"({plan.pass_image_tokens} image tokens), {_gib(pass_total)} GiB per GPU + the reserve: "
                     f"{verdicts}.")
    multiple = cfg.packing.make_sequence_length_divisible_by
    refused = plan.bin_tokens < plan.min_bin_tokens  # train.py's preflight.check_splits
    for name, cap in GPUS.items():
        best = plan.largest_bin(cap, multiple)
        said = (f"train.py refuses these bins ({plan.min_bin_source} needs {plan.min_bin_tokens} tokens)" if refused
                else verdict(plan.spare(cap)))
        none = f"none (no bin leaves {_gib(MARGIN)} GiB to spare)"  # among the bins train.py accepts
        lines.append(f"{name} GPUs ({_gib(cap)} GiB): {said}; the largest packing.max_tokens_per_bin that fits: "
                     + (str(best) if best else none))
    return "\n".join(lines)


def format_media(plan: MemoryPlan, cfg) -> list[str]:
    """The line on a bin's video and audio (none for images alone)."""
    m, act = plan.media, plan.activations
    if m is None or not (m.video_frames or m.audio_samples):
        return []
    said = []
    if m.video_frames:
        said.append(f"{m.video_frames} video frames ({m.video_tokens} of the {plan.image_tokens} image tokens)")
    if m.audio_samples:
        state = ", ".join(f"{n} {'frozen' if getattr(cfg.model, f'freeze_sound_{k}') else 'trained'}"
                          for n, k in (("sound encoder", "encoder"), ("projection", "projector")))
        said.append(f"{m.audio_seconds:.1f} s of audio in {len(m.audio_samples)} clip(s) ({m.audio_tokens} "
                    f"<so_embedding> tokens; {state}: {_gib(act.sound_kept)} GiB of the activations, replicated on "
                    "every rank)")
    return [f"media per bin: {'; '.join(said)} ({m.media_source})"]


def format_lora(plan: MemoryPlan) -> list[str]:
    """The LoRA lines of the printed plan: the adapters, what the table's columns hold, the checkpoint ratio."""
    lp, r = plan.lora, plan.ranks[0]
    act = plan.activations
    with_adapters = act(plan.bin_tokens, plan.image_tokens)
    saved_adapters, saved_vit = act.adapters, act.vit_adapters_per_image_token
    act.adapters, act.vit_adapters_per_image_token = {}, 0.0
    without = act(plan.bin_tokens, plan.image_tokens)
    act.adapters, act.vit_adapters_per_image_token = saved_adapters, saved_vit
    layers = ", ".join(f"{n} x {k}" for k, n in lp.layers.items())
    ref = ("the reference log-probs precomputed: no reference forward in training" if not plan.reference_forward else
           "the reference is a forward of the same model with the adapters off, without gradients "
           f"({_gib(act.forward_only(plan.bin_tokens, plan.image_tokens))} GiB of activations, freed before the "
           "policy's forward)")
    return [
        f"LoRA rank {lp.rank}, alpha {lp.alpha:g} on {', '.join(lp.targets)} of the {', '.join(lp.components)} "
        f"({layers} layers on rank {r.ranks[0]}): {_b(lp.adapter_params)} adapter parameters, "
        f"{_b(r.adapter_params)} on rank {r.ranks[0]} "
        f"({r.adapters / MiB:.1f} MiB in its weights). The base weights are frozen: no gradients, master copies or "
        "Adam moments for them (grads, master and Adam moments above are the adapters'); no reference model "
        f"(no second copy of the weights): {ref}. The adapters' saved x·Aᵀ (and their norm's input where the norm is "
        f"fused into the base) add {(with_adapters - without) / MiB:.1f} MiB to the activations.",
        f"LoRA checkpoint: the adapters and their optimizer state, {lp.checkpoint_bytes / MiB:.1f} MiB "
        f"({lp.bytes_per_param} bytes per parameter: weight, master, Adam moments) against the full run's "
        f"{lp.full_checkpoint_bytes / GiB:.1f} GiB: {lp.checkpoint_ratio:.3%}.",
    ]


def plan_model_dir(cfg) -> str:
    """The folder a plan reads model.hf_path's config.json (and processor) from, never downloading weights: a local
    directory; a hub id's snapshot in the hub cache; the config shipped for it (SHIPPED_CONFIGS); else its config,
    tokenizer and processor downloaded (model_hub.SMALL_MODEL_FILES). ConfigError (model_hub.hub_snapshot's)."""
    if not model_hub.is_hub_id(cfg.model.hf_path):
        return cfg.model.hf_path
    shipped = SHIPPED_CONFIGS.get(cfg.model.hf_path)
    with contextlib.suppress(config_mod.ConfigError):  # not cached: the shipped config, or a download
        return model_hub.resolve_model(cfg, model_hub.SMALL_MODEL_FILES, local_only=True).path
    if shipped is not None:
        print(f"model.hf_path = {cfg.model.hf_path!r} is a hub id not in the hub cache: planning with its config.json "
              f"shipped in {shipped.relative_to(Path(__file__).parent)}", file=sys.stderr)
        return str(shipped)
    return model_hub.resolve_model(cfg, model_hub.SMALL_MODEL_FILES).path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python plan.py", description=__doc__.split("\n")[0])
    ap.add_argument("config", metavar="CONFIG.toml", help="the TOML config, e.g. configs/nano.toml")
    ap.add_argument("overrides", metavar="section.key=value", nargs="*", default=[], help="overrides (config.py)")
    ap.add_argument("--gpus", type=int, help="the world size (default: the smallest the layout runs on)")
    ap.add_argument("--image-tokens", type=int, help="image tokens per bin (default: from the data index, else the "
                    "processor's largest image per pair)")
    ap.add_argument("--video-frames", type=int, help="video frames per bin, as one video (default: from the data "
                    "index, else none)")
    ap.add_argument("--audio-seconds", type=float, help="seconds of audio per bin, as one clip (default: from the "
                    "data index, else none)")
    args = ap.parse_intermixed_args(argv)  # flags before or after the overrides
    try:
        for flag, value, least in (("--gpus", args.gpus, 1), ("--image-tokens", args.image_tokens, 0),
                                   ("--video-frames", args.video_frames, 0),
                                   ("--audio-seconds", args.audio_seconds, 0)):
            if value is not None and not (value >= least and math.isfinite(value)):  # NaN, inf too
                raise config_mod.ConfigError(f"{flag} = {value}: must be at least {least}")
        cfg = config_mod.load_config(args.config, args.overrides)
        cfg.model.hf_path = plan_model_dir(cfg)
        plan = make_plan(cfg, args.gpus, args.image_tokens, args.video_frames, args.audio_seconds)
    except (config_mod.ConfigError, mmpr_records.DataError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_plan(plan, cfg))
    return 0


if __name__ == "__main__":
    config_mod.exit_cli(main)

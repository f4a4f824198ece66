"""Tests of kernel_selection.py and megatron_patches.py: the kernel choice per capability, each patch with the smallest
check that shows it works, and megatron's MambaMixer on the torch Mamba-2 path against transformers'
NemotronHMamba2Mixer with the same weights. In-process on a gloo world of size 1 (TP = EP = 1).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from backend import kernel_selection, megatron_patches

megatron_patches.apply()

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.transformer import TransformerConfig  # noqa: E402

import distributed  # noqa: E402
import omni_model  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def gloo_world():
    """A single-rank gloo process group with megatron's model-parallel groups (TP = PP = EP = 1)."""
    distributed.init_distributed()
    model_parallel_cuda_manual_seed(1234)
    yield


def small_config(**overrides) -> TransformerConfig:
    kw = dict(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
              add_bias_linear=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _shim(name):
    return getattr(megatron_patches, name)


def test_apply_is_idempotent_and_guarded():
    assert not torch.cuda.is_available()
    assert megatron_patches.apply() is True and megatron_patches.apply() is True
    assert torch.cuda.current_device() == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"



def test_apply_refuses_another_megatron_core_version(monkeypatch):
    """The checked version is read: the installed one passes, any other fails apply() with one line naming both."""
    assert megatron_patches.check_megatron_core_version() == megatron_patches.MEGATRON_CORE_VERSION_CHECKED == "0.19.2"
    monkeypatch.setattr(megatron_patches.metadata, "version", lambda name: {"megatron-core": "0.20.0"}[name])
    with pytest.raises(RuntimeError) as err:
        megatron_patches.apply()  # already applied in this process: the check still runs first
    assert "0.20.0" in str(err.value) and "0.19.2" in str(err.value) and "\n" not in str(err.value)


def test_the_chosen_kernels_are_passed_down_not_probed_again(monkeypatch):
    """train.main probes the kernels once and passes them down: apply(kernels), a later apply() (build_model's) and
    preflight.check_model_config(cfg, hf, kernels) use them; none probes again."""
    from pathlib import Path

    import config as config_mod
    import preflight

    def probe(*args, **kwargs):
        raise AssertionError("kernels probed again")

    chosen = kernel_selection.select_kernels()
    monkeypatch.setattr(megatron_patches, "select_kernels", probe)
    monkeypatch.setattr(kernel_selection, "select_kernels", probe)  # omni_model.uses_te_spec's probe
    assert megatron_patches.apply(chosen) is True and megatron_patches.apply() is True
    assert megatron_patches._KERNELS == chosen
    root = Path(__file__).resolve().parents[1]
    cfg = config_mod.load_config(root / "configs" / "tiny.toml")
    assert preflight.check_model_config(cfg, omni_model.read_hf_config(root / cfg.model.hf_path), chosen) is None


def test_every_shim_names_an_upstream_line_that_exists():
    """Every shim apply() installs, and every non-TE stand-in, carries `SHIM(megatron-core 0.19.2): <file:line>`,
    and each named file:line exists in the installed megatron-core (a bump that moves a file shows up here)."""
    import inspect
    from pathlib import Path

    import megatron.core

    from backend import local_spec

    site = Path(megatron.core.__file__).parents[2]
    names = ("_stub_paged_stash_without_triton", *megatron_patches.CPU_ONLY_SHIMS, *megatron_patches.LOCAL_SPEC_SHIMS,
             *megatron_patches.TORCH_MAMBA_SHIMS, *megatron_patches.TRITON_MAMBA_SHIMS, *megatron_patches.MODEL_SHIMS,
             "install_mamba_cp_thd_indices")
    objects = [_shim(n) for n in names] + [local_spec.LocalNorm,
                                           local_spec.LocalNormColumnParallelLinear,
                                           local_spec.ThdDotProductAttention,
                                           megatron_patches.restore_adam_steps,  # called by checkpoint.py
                                           megatron_patches.name_grad_dtype,
                                           megatron_patches.use_in_process_write_queue,
                                           megatron_patches.optimizer_config,  # called by train.build_optimizer
                                           megatron_patches.precision_aware_adam]
    marker = re.compile(r"SHIM\(megatron-core (\S+)\): (megatron/core/\S+\.py):(\d+)")
    for obj in objects:
        found = marker.findall(inspect.getsource(obj))
        assert found, f"{obj.__name__} has no SHIM marker"
        for version, path, line in found:
            assert version == megatron_patches.MEGATRON_CORE_VERSION_CHECKED, (obj.__name__, version)
            lines = (site / path).read_text().splitlines()
            assert int(line) <= len(lines) and lines[int(line) - 1].strip(), (obj.__name__, path, line)
    # the model shims are installed by apply() on every platform
    assert set(megatron_patches.MODEL_SHIMS) <= megatron_patches._INSTALLED


def test_kernel_selection_by_capability():
    """The decision for every combination of (Transformer Engine imports, mamba-ssm + causal-conv1d import, CUDA,
    torch's grouped GEMM kernel, torch's varlen FlashAttention, the Triton Mamba set imports)."""
    from itertools import product

    def sel(**kw):
        return kernel_selection.select_kernels(**{"mamba_triton": False, **kw})

    for te, ms, cuda, gm, va, mt in product((True, False), repeat=6):
        k = sel(te=te, mamba_ssm=ms, cuda=cuda, grouped_mm=gm, varlen_attn=va, mamba_triton=mt)
        local = not (te and cuda)
        assert k == kernel_selection.Kernels(
            spec="local" if local else "te", device="cuda" if cuda else "cpu",
            mamba=("mamba-ssm" if ms else "triton" if mt else "torch") if cuda else "torch",
            attention=("varlen" if va and cuda else "sdpa") if local else "te",
            experts=("grouped" if gm and cuda else "grouped-loop") if local else "te"), \
            (te, ms, cuda, gm, va, mt)
        names = megatron_patches.shims_for(k)
        assert all(callable(_shim(n)) for n in names)
        # CUDA-only workarounds only without CUDA; the TE final-norm swap whenever the local spec is used; the torch
        # Mamba whenever mamba-ssm's kernels are not used
        assert (set(megatron_patches.CPU_ONLY_SHIMS) <= set(names)) == (not cuda)
        assert bool(set(megatron_patches.CPU_ONLY_SHIMS) & set(names)) == (not cuda)
        assert ("_patch_hybrid_final_norm" in names) == (k.spec == "local")
        assert ("install_torch_mamba" in names) == (k.mamba == "torch")
        assert ("install_triton_mamba" in names) == (k.mamba == "triton")
    # the H200 (no TE, no compiled mamba-ssm, torch 2.11): local spec, varlen attention, grouped experts and
    # torch Mamba on CUDA, no CPU shim
    k = sel(te=False, mamba_ssm=False, cuda=True, grouped_mm=True, varlen_attn=True)
    assert k.line() == "kernels: spec local; attention varlen; experts grouped; mamba torch; device cuda"
    assert sel(te=True, mamba_ssm=True, cuda=True, grouped_mm=True, varlen_attn=True).line() == \
        "kernels: spec te; attention te; experts te; mamba mamba-ssm; device cuda"
    # the layers' dtype: varlen FlashAttention and the CUTLASS grouped GEMM in bf16; fp32 stays on the loops
    h200 = dict(te=False, mamba_ssm=False, cuda=True, grouped_mm=True, varlen_attn=True)
    assert sel(**h200, dtype=torch.bfloat16) == k
    assert sel(**h200, dtype=torch.float32).line() == \
        "kernels: spec local; attention sdpa; experts grouped-loop; mamba torch; device cuda"
    assert megatron_patches.shims_for(k) == ("_stub_paged_stash_without_triton", "_patch_torch_norm_sequence_parallel",
                                             "_patch_hybrid_final_norm", "install_torch_mamba")
    # with mamba-ssm's sources and fla-core there (the pip-install GPU path): the Triton Mamba set
    k = sel(te=False, mamba_ssm=False, cuda=True, grouped_mm=True, varlen_attn=True, mamba_triton=True)
    assert k.line() == "kernels: spec local; attention varlen; experts grouped; mamba triton; device cuda"
    assert megatron_patches.shims_for(k)[-1] == "install_triton_mamba"
    assert megatron_patches.shims_for(sel(te=True, mamba_ssm=True, cuda=True, grouped_mm=False, varlen_attn=False)) == \
        ("_stub_paged_stash_without_triton",)
    assert not kernel_selection.have_grouped_mm() and not kernel_selection.have_varlen_attn()  # no CUDA here
    # this machine: probed, and every shim the CPU path always had is installed (CPU behaviour unchanged)
    here = kernel_selection.select_kernels()
    assert here == kernel_selection.Kernels("local", "torch", "cpu", attention="sdpa", experts="grouped-loop")
    assert here.line() == "kernels: spec local; attention sdpa; experts grouped-loop; mamba torch; device cpu"
    assert not omni_model.uses_te_spec() and not kernel_selection.te_importable()
    assert set(megatron_patches.shims_for(here)) == {
        "_stub_paged_stash_without_triton", "_disable_dynamo", "_patch_current_device", "_patch_cuda_streams",
        "_install_cpu_rng_tracker", "_patch_causal_masks", "_patch_torch_norm_sequence_parallel",
        "_patch_hybrid_final_norm", "_patch_moe_split_sizes", "_patch_clip_grads", "_optimizers_in_cpu_mode",
        "install_torch_mamba"}
    assert set(megatron_patches.shims_for(here)) <= megatron_patches._INSTALLED
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.ssm import mamba_mixer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    assert hybrid_block.TENorm is WrappedTorchNorm and mamba_mixer._omni_torch_mamba


def test_local_device_refuses_a_local_rank_without_its_gpu(monkeypatch):
    """LOCAL_RANK n needs CUDA device n: the README's 2-rank command on a one-GPU machine is one ConfigError line naming
    both numbers (before: `CUDA error: invalid device ordinal` from torch.cuda.set_device); without CUDA, the CPU."""
    import config

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.local_device() == torch.device("cpu")  # this machine: no CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(config.ConfigError) as e:
        distributed.local_device()
    names = ("LOCAL_RANK 1", "1 CUDA device(s)", "--nproc-per-node 1", "CUDA_VISIBLE_DEVICES=")  # what to change
    assert all(n in str(e.value) for n in names), str(e.value)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.local_device() == torch.device("cuda", 0)


def test_rng_tracker_forks_the_cpu_generator():
    model_parallel_cuda_manual_seed(77)
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        a = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        b = torch.rand(4)
    # megatron seeds the tensor-parallel state with seed + 2718 + tp_rank; the two forks continue one stream.
    expected = torch.rand(8, generator=torch.Generator().manual_seed(77 + 2718))
    assert torch.equal(torch.cat([a, b]), expected)
    assert torch.equal(torch.get_rng_state(), before)  # the default generator is untouched by forks
    model_parallel_cuda_manual_seed(1234)


def test_causal_mask_norm_with_sequence_parallel_and_hybrid_final_norm():
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer import utils as tutils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    mask = tutils.get_default_causal_mask(3)
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    assert fused_softmax.get_default_causal_mask is tutils.get_default_causal_mask

    cfg = small_config(normalization="RMSNorm")
    cfg.sequence_parallel = True  # set after construction: the config refuses SP with TP = 1; the norm reads the flag
    norm = WrappedTorchNorm(config=cfg, hidden_size=16, eps=1e-5)
    assert cfg.sequence_parallel is True and norm.weight.sequence_parallel is True
    final = hybrid_block.TENorm(config=small_config(normalization="RMSNorm"), hidden_size=16, eps=1e-5)
    x = torch.randn(3, 16)
    with torch.no_grad():
        final.weight.copy_(torch.linspace(0.5, 2.0, 16))
    assert (final(x) - x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * final.weight).abs().max() < 1e-6


def test_moe_alltoall_dispatcher_runs_and_matches_explicit_mixture():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import moe_utils

    arr = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    assert arr.tolist() == [1, 2] and not torch.is_tensor(arr)

    cfg = small_config(num_moe_experts=4, moe_router_topk=2, ffn_hidden_size=8, moe_ffn_hidden_size=8,
                       moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                       moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                       moe_permute_fusion=False, bias_activation_fusion=False)
    spec = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)
    moe = spec(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())  # a partial(MoELayer)
    x = torch.randn(6, 2, 16)
    out, _ = moe(x)
    probs, routing_map = moe.router(x.view(-1, 16))
    assert int(routing_map.sum()) == 12 * 2 and out.shape == x.shape
    flat = x.view(-1, 16)
    expected = torch.zeros_like(flat)
    for e, expert in enumerate(moe.experts.local_experts):
        y_e, _ = expert(flat)
        expected += probs[:, e : e + 1] * routing_map[:, e : e + 1] * y_e
    assert (out.view(-1, 16) - expected).abs().max() < 1e-5
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()


class _Net(torch.nn.Module):
    def __init__(self, cfg):
        from megatron.core.transformer.module import MegatronModule

        super().__init__()
        self.inner = MegatronModule(cfg)
        self.lin = ColumnParallelLinear(8, 6, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                        gather_output=True)
        self.config = cfg

    def forward(self, x):
        return self.lin(x)[0]


@pytest.mark.parametrize("optimizer,distributed", [("adam", True), ("sgd", False)])
def test_megatron_ddp_optimizer_step_matches_torch(optimizer, distributed):
    """One step of megatron DDP + get_megatron_optimizer (+ grad clipping) equals torch's optimizer on a copy."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = small_config(hidden_size=8)
    gen = torch.Generator().manual_seed(0)
    W0, b0, x = torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen), torch.randn(5, 8, generator=gen)
    clip = 0.05
    model = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True),
        _Net(cfg),
    )
    with torch.no_grad():
        model.module.lin.weight.copy_(W0)
        model.module.lin.bias.copy_(b0)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer=optimizer, lr=0.1, weight_decay=0.0, clip_grad=clip, bf16=False,
                        use_distributed_optimizer=distributed),
        [model],
    )
    model.zero_grad_buffer()
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    model.finish_grad_sync()
    ok, grad_norm, _ = opt.step()

    ref = torch.nn.Linear(8, 6)
    with torch.no_grad():
        ref.weight.copy_(W0)
        ref.bias.copy_(b0)
    ref_opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(ref.parameters(), lr=0.1)
    ref(x).pow(2).sum().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ref_opt.step()
    assert ok and math.isclose(grad_norm, float(ref_norm), rel_tol=1e-5)
    assert grad_norm > 10 * clip  # clipping is active
    assert (model.module.lin.weight - ref.weight).abs().max() < 1e-6
    assert (model.module.lin.bias - ref.bias).abs().max() < 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# megatron MambaMixer on the torch path


def _mixers(time_step_min=0.01, **config_overrides):
    """A megatron MambaMixer (local linears) and transformers' NemotronHMamba2Mixer with the same weights."""
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from transformers.models.nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    hidden, heads, headdim, groups, state, chunk = 16, 4, 4, 2, 8, 8
    cfg = small_config(hidden_size=hidden, mamba_state_dim=state, mamba_head_dim=headdim, mamba_num_groups=groups,
                       mamba_num_heads=heads, **config_overrides)
    # megatron's MambaMixer with the project's time-step clamp switch (off until `dt_limit` is set)
    megatron_patches.install_mamba_scan_hook()
    submodules = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    ours = omni_model.OmniMambaMixer(cfg, submodules, d_model=hidden, chunk_size=chunk,
                                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    hf_cfg = NemotronHConfig(hidden_size=hidden, mamba_num_heads=heads, mamba_head_dim=headdim, n_groups=groups,
                             ssm_state_size=state, conv_kernel=4, chunk_size=chunk, hybrid_override_pattern="M",
                             layer_norm_epsilon=1e-5, time_step_min=time_step_min, use_conv_bias=True,
                             use_bias=False, vocab_size=32, num_attention_heads=2, num_key_value_heads=1)
    ref = NemotronHMamba2Mixer(hf_cfg, layer_idx=0)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        ours.dt_bias.copy_(torch.linspace(-7.0, 0.5, heads))  # small softplus(dt): the time-step floor matters
        ours.norm.weight.add_(1.0)
        # The weight mapping is a direct copy (HF conv1d.weight [C, 1, W] = megatron conv1d_weight).
        ref.in_proj.weight.copy_(ours.in_proj.weight)
        ref.conv1d.weight.copy_(ours.conv1d_weight)
        ref.conv1d.bias.copy_(ours.conv1d_bias)
        for name in ("dt_bias", "A_log", "D"):
            getattr(ref, name).copy_(getattr(ours, name))
        ref.norm.weight.copy_(ours.norm.weight)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
    return ours, ref


def test_megatron_mamba_mixer_matches_transformers():
    ours, ref = _mixers(time_step_min=0.01)
    x = torch.randn(2, 21, 16, generator=torch.Generator().manual_seed(10))  # [batch, seq, hidden] (HF layout)
    with torch.no_grad():
        expected = ref(x)
        ours.dt_limit = (0.01, float("inf"))  # follow the reference's time-step floor
        clamped = ours(x.transpose(0, 1))[0].transpose(0, 1)
        ours.dt_limit = None  # megatron-core's (0, inf)
        unclamped = ours(x.transpose(0, 1))[0].transpose(0, 1)
        ref.time_step_limit = (0.0, float("inf"))
        expected_unclamped = ref(x)
    assert (clamped - expected).abs().max() < 1e-5
    assert (unclamped - expected_unclamped).abs().max() < 1e-5
    assert (clamped - unclamped).abs().max() > 1e-4  # the floor changes the output: both settings are tested


def test_megatron_mamba_mixer_non_mem_eff_path_agrees():
    """megatron's other training/prefill path (separate conv, scan, then norm(y, z)) gives the same output."""
    fused, _ = _mixers()
    split, _ = _mixers(use_mamba_mem_eff_path=False)
    split.load_state_dict(fused.state_dict())
    x = torch.randn(13, 2, 16, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        assert (fused(x)[0] - split(x)[0]).abs().max() < 1e-5


def test_megatron_mamba_mixer_packed_equals_alone():
    from megatron.core.packed_seq_params import PackedSeqParams

    ours, _ = _mixers()
    lengths = [5, 11, 3]
    total = sum(lengths)
    cu = torch.tensor([0, 5, 16, 19], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11, max_seqlen_kv=11,
                          total_tokens=total)
    assert psp.seq_idx.tolist() == [[0] * 5 + [1] * 11 + [2] * 3]
    x = torch.randn(total, 1, 16, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        packed = ours(x, packed_seq_params=psp)[0]
        unpacked = ours(x)[0]
        start = 0
        for n in lengths:
            alone = ours(x[start : start + n])[0]
            assert (packed[start : start + n] - alone).abs().max() < 1e-5
            start += n
    assert (packed[5:] - unpacked[5:]).abs().max() > 1e-3


def test_megatron_mamba_mixer_backward_runs():
    ours, _ = _mixers()
    x = torch.randn(9, 2, 16, requires_grad=True)
    out = ours(x)[0]
    out.square().sum().backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    assert set(grads) == {"conv1d_weight", "conv1d_bias", "dt_bias", "A_log", "D", "in_proj.weight", "norm.weight",
                          "out_proj.weight"}
    assert F.mse_loss(x.grad, torch.zeros_like(x.grad)) > 0


# ---------------------------------------------------------------------------------------------------------------------
# Two ranks: MoE alltoall with EP = 2 (the split-size shim only matters when tokens cross ranks)


@pytest.mark.slow  # one 2-rank torchrun launch: about 17 s on 2 cores, mostly imports
def test_moe_alltoall_expert_parallel_two_ranks(torchrun):
    from pathlib import Path

    launch = torchrun(Path(__file__).resolve().parent / "dist" / "check_moe_alltoall.py",
                      env={"OMP_NUM_THREADS": "1"}, timeout=180)  # fmt: skip
    assert set(launch.ranks) == {0, 1}, launch.stdout[-3000:] + launch.stderr[-3000:]
    for r in launch.ranks.values():
        assert r["max_err"] < 1e-5 and r["remote_assignments"] > 0  # tokens did travel to the other rank's experts

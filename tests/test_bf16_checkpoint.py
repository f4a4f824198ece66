"""bf16 (the recipe's dtype, configs/nano.toml) runs save, resume bit for bit and export.

For 1 rank (`python train.py`) and 2 ranks (torchrun, DP = 2), with and without the distributed optimizer, and with
fp32 and bf16 gradient buffers (`optimizer.grad_reduce_in_fp32`; each on 1 and 2 ranks): the tiny run in bf16 for 4
steps with `checkpoint.save_period=2`, then a second run resumed from a copy of its step_2 (2 + 2 steps); on 2 ranks
also with the precision-aware optimizer (int16 remainders, bf16 moments). Steps 3-4 of
the resumed run, its step-4 weights and every optimizer tensor equal the uninterrupted run's. The DP = 2
distributed-optimizer run with bf16 gradient buffers is exported and loaded by transformers' Omni class (with fp32
ones: tests/test_checkpoint.py's bf16 segment).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import config as config_mod
import distributed
import train

pytestmark = pytest.mark.slow  # 8 tiny runs: about 6 minutes on 2 busy cores

ROOT = Path(__file__).resolve().parents[1]
BF16 = ["model.params_dtype=bfloat16", "mpo.max_num_steps=4", "mpo.val_at_end=false"]
KEYS = ("loss", "preference_loss", "bco_loss", "sft_loss", "accuracy", "rewards/margin", "reward_shift",
        "reward_shift_used", "lr", "grad_norm", "bco/reward_sum", "consumed_pairs")  # fmt: skip


def _run(torchrun, nproc: int, run_dir: Path, *overrides: str) -> None:
    """The tiny bf16 run: `python train.py` on one rank (no launcher), the torchrun fixture on more."""
    args = ["configs/tiny.toml", f"checkpoint.dir={run_dir}", *BF16, *overrides]
    if nproc > 1:
        torchrun("train.py", *args, nproc=nproc, timeout=400)
        return
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _loaded_state(step_dir: Path, dopt: bool, fp32: bool, extra=()) -> list[tuple[str, torch.Tensor]]:
    """Policy weights (with dtype) and every optimizer tensor after loading `step_dir` into a fresh bf16 tiny policy
    in this process (a world of one), its optimizer built with `dopt` and `fp32` gradient buffers."""
    import checkpoint
    import omni_model

    distributed.init_distributed()
    keys = [f"optimizer.use_distributed_optimizer={str(dopt).lower()}",
            f"optimizer.grad_reduce_in_fp32={str(fp32).lower()}", *extra]  # fmt: skip
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [*BF16, *keys])
    policy = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    ddp, opt, sched = train.build_optimizer(policy, cfg)
    checkpoint.load(step_dir, ddp, opt, sched)
    out = [(f"param {n}", p.detach().clone()) for n, p in policy.named_parameters()]
    for i, o in enumerate(checkpoint._inner_optimizers(opt)):
        for g in o.optimizer.param_groups:
            for j, p in enumerate(g["params"]):
                out += [(f"opt {i}.{j}.{k}", v.detach().clone()) for k, v in sorted(o.optimizer.state[p].items())]
    return out


# the precision-aware optimizer with remainders and bf16 moments (tests/test_precision_adam.py: the other settings)
PRECISION = ("optimizer.use_precision_aware_optimizer=true", "optimizer.exp_avg_dtype=bf16",
             "optimizer.exp_avg_sq_dtype=bf16")  # fmt: skip


# (ranks, distributed optimizer, fp32 gradient buffers, more settings): each optimizer and each gradient-buffer dtype
# on 1 and 2 ranks, and the precision-aware optimizer on 2
@pytest.fixture(scope="module", params=[(1, True, True, ()), (1, False, False, ()), (2, True, False, ()),
                                        (2, False, True, ()), (2, True, False, PRECISION)],
                ids=lambda p: f"n{p[0]}-dopt{int(p[1])}-grad{'fp32' if p[2] else 'bf16'}{'-pa' if p[3] else ''}")
def bf16_runs(request, torchrun, tmp_path_factory):
    nproc, dopt, fp32, extra = request.param
    straight, resumed = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    opt = [f"optimizer.use_distributed_optimizer={str(dopt).lower()}",
           f"optimizer.grad_reduce_in_fp32={str(fp32).lower()}", *extra]  # fmt: skip
    _run(torchrun, nproc, straight, *opt, "checkpoint.save_period=2")
    shutil.copytree(straight / "step_2", resumed / "step_2")
    first_two = (straight / "metrics.jsonl").read_text().splitlines()[:2]
    (resumed / "metrics.jsonl").write_text("".join(r + "\n" for r in first_two))
    _run(torchrun, nproc, resumed, *opt, "checkpoint.resume=true")
    return SimpleNamespace(nproc=nproc, dopt=dopt, fp32=fp32, extra=extra, straight=straight, resumed=resumed)


def test_bf16_model_has_one_parameter_dtype():
    """megatron-core builds Mamba's A_log / D (and, without TE, the final norm) in fp32; build_model casts them."""
    import omni_model

    distributed.init_distributed()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", BF16)
    policy = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    biases = {n: b.dtype for n, b in policy.named_buffers() if n.endswith("expert_bias")}
    assert biases and set(biases.values()) == {torch.float32}  # HF keeps e_score_correction_bias in fp32 too


@pytest.mark.parametrize("params_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fp32", [True, False])
def test_grad_reduce_in_fp32_sets_megatron_ddp_gradient_buffers(params_dtype, fp32):
    """optimizer.grad_reduce_in_fp32 reaches megatron DDP: every gradient buffer and main_grad is fp32 (true) or in
    the parameters' dtype (false: bf16 in bf16 runs, half the bytes per parameter)."""
    import omni_model

    distributed.init_distributed()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"model.params_dtype={params_dtype}",
                                                                  f"optimizer.grad_reduce_in_fp32={str(fp32).lower()}"])
    policy = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    ddp, _, _ = train.build_optimizer(policy, cfg)
    want = torch.float32 if fp32 else getattr(torch, params_dtype)
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    assert buffers and {b.grad_data.dtype for b in buffers} == {want}
    assert {p.main_grad.dtype for p in policy.parameters() if p.requires_grad} == {want}


@pytest.mark.parametrize("fp32", [True, False])
def test_bf16_gradient_buffers_get_an_fp32_copy_at_the_optimizer_step(fp32):
    """megatron-core's optimizer hands each fp32 main parameter `main_grad[shard].float()`
    (megatron/core/optimizer/distrib_optimizer.py:2782): a view of an fp32 buffer, a new fp32 tensor beside a bf16
    one, alive until the next step's zero_grad. At DP 1 bf16 buffers hold 2 + 4 bytes per parameter after the step,
    fp32 ones 4 (docs/PERFORMANCE.md, "Gradient buffers")."""
    sys.path.insert(0, str(ROOT / "tests"))
    from step_cases import tiny_step

    import checkpoint

    s = tiny_step("cpu", "model.params_dtype=bfloat16", f"optimizer.grad_reduce_in_fp32={str(fp32).lower()}")
    s["run"](s["batches"], 0.0)
    storages = {b.grad_data.untyped_storage().data_ptr() for b in s["ddp"].buffers + s["ddp"].expert_parallel_buffers}
    (opt,) = checkpoint._inner_optimizers(s["optimizer"])
    grads = [p.grad for g in opt.optimizer.param_groups for p in g["params"]]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
    copies = sum(g.numel() * g.element_size() for g in grads if g.untyped_storage().data_ptr() not in storages)
    params = sum(p.numel() for p in s["policy"].parameters() if p.requires_grad)
    assert copies == (0 if fp32 else 4 * params)


def test_bf16_two_plus_two_steps_equal_four_bit_for_bit(bf16_runs):
    a, b = _rows(bf16_runs.straight), _rows(bf16_runs.resumed)
    assert [r["step"] for r in a] == [1, 2, 3, 4] and [r["step"] for r in b] == [1, 2, 3, 4]
    assert a[0]["preference_loss"] == pytest.approx(0.6931, abs=1e-3)  # bf16 logits: ln 2 up to rounding
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in KEYS} == {k: y[k] for k in KEYS}, x["step"]
    assert a[3]["loss"] != a[0]["loss"]  # the steps trained something
    straight = _loaded_state(bf16_runs.straight / "step_4", bf16_runs.dopt, bf16_runs.fp32, bf16_runs.extra)
    resumed = _loaded_state(bf16_runs.resumed / "step_4", bf16_runs.dopt, bf16_runs.fp32, bf16_runs.extra)
    assert [k for k, _ in straight] == [k for k, _ in resumed]
    assert sum(k.endswith("exp_avg_sq") for k, _ in straight) > 10
    params = [v for k, v in straight if k.startswith("param")]
    assert len(params) > 10 and {v.dtype for v in params} == {torch.bfloat16}
    for (k, x), (_, y) in zip(straight, resumed, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), k
    assert {float(v) for k, v in straight if k.endswith(".step")} == {4.0}


@pytest.mark.parametrize("bf16_runs", [(2, True, False, ())], indirect=True, ids=["n2-dopt1-gradbf16"])
def test_bf16_export_loads_in_transformers(bf16_runs, tmp_path):
    out = tmp_path / "hf"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, "hf_export.py", str(bf16_runs.straight), str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    from safetensors.torch import load_file
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import checkpoint
    import hf_weights
    import omni_model

    distributed.init_distributed()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", BF16)
    ours = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    checkpoint.load(bf16_runs.straight / "step_4", ours)
    ours.eval()
    # the exported tensors are the trained bf16 weights (widened exactly to the source checkpoint's dtype)
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(f))
    a_log = next(k for k in exported if k.endswith("mixer.A_log"))
    mine = dict(ours.named_parameters())
    ours_a_log = next(v for k, v in mine.items() if k.endswith("mixer.A_log"))
    assert torch.equal(exported[a_log].to(torch.bfloat16), ours_a_log.detach())

    model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # only the keys the hub checkpoint has and transformers' class ignores (its processor normalises; see README)
    assert info["unexpected_keys"] == {"vision_model.input_conditioner.norm_mean",
                                       "vision_model.input_conditioner.norm_std"}  # fmt: skip
    # our loader reads the export back to exactly the trained bf16 state (parameters and the router's expert bias)
    reloaded = omni_model.build_model(out, cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(reloaded, out)
    want = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    got = {**dict(reloaded.named_parameters()), **dict(reloaded.named_buffers())}
    assert want.keys() == got.keys()
    assert [k for k in want if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])] == []
    # and transformers computes what we compute from it: both in fp32 on the same exported weights
    fp32 = config_mod.load_config(ROOT / "configs" / "tiny.toml", [*BF16, "model.params_dtype=float32"])
    ours32 = omni_model.build_model(out, fp32.model, fp32.parallel)
    hf_weights.load_hf_weights(ours32, out)
    ours32.eval()
    ids = torch.randint(32, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model.float().eval().language_model(input_ids=ids).logits[0]
        logits = ours32({"input_ids": ids})
    assert (logits - theirs).abs().max().item() <= 1e-4

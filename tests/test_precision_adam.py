"""precision_adam.py, the precision-aware Adam without Transformer Engine, and its [optimizer] settings.

The master split (`split_master` / `master_from_remainder`) over every edge class of fp32 bit patterns and a random
sample against an integer round-to-nearest-even; one step against torch's AdamW on the rebuilt fp32 master; bf16
moments; the state's keys, dtypes and round trip; the settings' one-line errors; in a tiny bf16 run, the
precision-aware optimizer with fp32 moments equal to the fp32-master path bit for bit; resumes 2 + 2 = 4 bit for bit
in one process and on 2 ranks at TP 2 + SP and EP 2 (tests/dist/check_precision_resume.py, one launch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import config as config_mod
from backend import precision_adam

ROOT = Path(__file__).resolve().parents[1]
BF16 = ["model.params_dtype=bfloat16"]
PA = "optimizer.use_precision_aware_optimizer=true"


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int64).to(torch.int32).view(torch.float32)  # two's complement wrap of the uint32 value


def _rne_high(bits: torch.Tensor) -> torch.Tensor:
    """The bf16 bit pattern (as uint16 in int64) of fp32 `bits` by round to nearest, ties to even; NaN excluded."""
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _check_split(bits: torch.Tensor) -> None:
    """For fp32 bit patterns (uint32 in int64, no NaN): the bf16 weight is the round to nearest even, the rebuilt
    master equals the value except at a tie rounded down (low half 0x8000, even high half), one ulp toward it."""
    x = _from_bits(bits)
    weight, rem = precision_adam.split_master(x)
    assert weight.dtype == torch.bfloat16 and rem.dtype == torch.int16 and weight.shape == rem.shape == x.shape
    assert torch.equal(weight.view(torch.int16).to(torch.int64) & 0xFFFF, _rne_high(bits))
    back = _bits(precision_adam.master_from_remainder(weight, rem))
    tie_down = ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) & 1 == 0)
    assert torch.equal(back[~tie_down], bits[~tie_down])
    assert torch.equal(back[tie_down], bits[tie_down] - 1)  # one fp32 ulp nearer zero: the same sign and weight
    assert torch.equal(precision_adam.split_master(_from_bits(back))[0].view(torch.int16), weight.view(torch.int16))
    into = torch.empty_like(weight), torch.empty_like(rem)  # the step's in-place form
    precision_adam.store_master(x, *into)
    assert torch.equal(into[0].view(torch.int16), weight.view(torch.int16)) and torch.equal(into[1], rem)


# high halves: ±0 and subnormals, the smallest normals, around 1, odd and even weights, the largest finite weights
EDGE_HIGH = [0x0000, 0x0001, 0x0002, 0x007E, 0x007F, 0x0080, 0x0081, 0x3F7F, 0x3F80, 0x3F81, 0x4049, 0x7F7E, 0x7F7F]
EDGE_HIGH += [h | 0x8000 for h in EDGE_HIGH]


def test_split_master_every_low_half_of_the_edge_classes():
    """Each edge high half with all 65536 low halves: every tie and its neighbours, the subnormals, the values
    whose weight rounds up into the next binade and the largest finite floats (their weight is ±inf)."""
    low = torch.arange(1 << 16, dtype=torch.int64)
    bits = torch.cat([(h << 16) | low for h in EDGE_HIGH])
    _check_split(bits)
    top = precision_adam.split_master(_from_bits(torch.tensor([0x7F7FFFFF, 0xFF7FFFFF])))[0]
    assert top.float().tolist() == [float("inf"), float("-inf")]  # what the fp32-master path copies, too


def test_split_master_infinities_zeros_and_nan():
    x = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, float("nan")])
    weight, rem = precision_adam.split_master(x)
    back = precision_adam.master_from_remainder(weight, rem)
    assert torch.equal(_bits(back[:4]), _bits(x[:4]))  # -0 keeps its sign
    assert torch.isnan(back[4])  # a NaN master stays NaN (train.py stops before a non-finite step)


def test_split_master_random_bit_patterns():
    bits = torch.randint(0, 1 << 32, (1 << 22,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    finite = ((bits >> 23) & 0xFF) != 0xFF
    _check_split(bits[finite])


def test_an_int16_remainder_cannot_hold_every_master_of_an_even_weight():
    """Why one tie is stored one ulp off: 65537 fp32 values round to nearest even to an even bf16 weight (both ties
    belong to it), and a 16-bit remainder has 65536 values."""
    h = 0x3F80  # 1.0, even
    bits = torch.arange((h << 16) - 0x8000, (h << 16) + 0x8001, dtype=torch.int64)
    assert bool((_rne_high(bits) == h).all()) and bits.numel() == (1 << 16) + 1
    assert _rne_high(torch.tensor([(h << 16) - 0x8001, (h << 16) + 0x8001])).tolist() == [h - 1, h + 1]


def _adam(params, **kw) -> precision_adam.PrecisionAwareAdam:
    return precision_adam.PrecisionAwareAdam(params, lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1,
                                        master_weights=True, use_decoupled_grad=True, **kw)  # fmt: skip


@pytest.mark.parametrize(("remainders", "chunk"), [(True, 1000), (False, precision_adam.STEP_CHUNK), (False, 999)])
def test_step_is_torch_adamw_on_the_fp32_master(remainders, chunk, monkeypatch):
    """Five steps, each from the optimizer's own state: torch.optim.AdamW on the rebuilt fp32 master (fp32 moments)
    gives the new master (bit for bit, but the tie `split_master` stores one ulp off), the bf16 weight is its round
    to nearest even, the moments and step are torch's; in one chunk or several (999: the vector kernels' scalar
    tails fall inside the tensor, where torch's fall at its end)."""
    monkeypatch.setattr(precision_adam, "STEP_CHUNK", chunk)
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(4096, generator=gen) * 0.02
    p = start.bfloat16()
    opt = _adam([p], store_param_remainders=remainders)
    opt.initialize_state(p)
    opt.set_scaled_state(p, "master_param", start if not remainders else precision_adam.split_master(start)[1])
    for _ in range(5):
        master = opt.master(p).clone()
        ref_p = torch.nn.Parameter(master.clone())
        ref = torch.optim.AdamW([ref_p], lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
        ref.state[ref_p] = {k: opt.state[p][k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
        g = torch.randn(4096, generator=gen).bfloat16()
        ref_p.grad, p.decoupled_grad = g.float(), g
        ref.step()
        opt.step()
        want = ref_p.detach()
        assert torch.equal(p.view(torch.int16), want.bfloat16().view(torch.int16))
        ulps = (_bits(opt.master(p)) - _bits(want)).abs()
        assert int(ulps.max()) <= (1 if remainders else 0)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], ref.state[ref_p][k]), k
    assert not torch.equal(opt.master(p), start)


def test_bf16_moments_are_stored_in_bf16_and_computed_in_fp32():
    gen = torch.Generator().manual_seed(2)
    p = (torch.randn(2048, generator=gen) * 0.02).bfloat16()
    opt = _adam([p], store_param_remainders=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for _ in range(3):
        ref_p = torch.nn.Parameter(opt.master(p).clone() if opt.state[p] else p.float())
        ref = torch.optim.AdamW([ref_p], lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
        if opt.state[p]:  # the stored bf16 moments, widened: what the step computes from
            ref.state[ref_p] = {k: opt.state[p][k].float() for k in ("exp_avg", "exp_avg_sq")}
            ref.state[ref_p]["step"] = opt.state[p]["step"].clone()
        g = torch.randn(2048, generator=gen).bfloat16()
        ref_p.grad, p.decoupled_grad = g.float(), g
        ref.step()
        opt.step()
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][k].dtype == torch.bfloat16
            assert torch.equal(opt.state[p][k], ref.state[ref_p][k].bfloat16()), k
        assert torch.equal(p, ref_p.detach().bfloat16())  # the update used the fp32 moments
        assert int((_bits(opt.master(p)) - _bits(ref_p.detach())).abs().max()) <= 1


def test_fp32_parameters_are_updated_in_place_as_torch_adamw_does():
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(512, generator=gen)
    ref_p = torch.nn.Parameter(p.clone())
    opt, ref = _adam([p]), torch.optim.AdamW([ref_p], lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        p.decoupled_grad = ref_p.grad = torch.randn(512, generator=gen)
        opt.step()
        ref.step()
    assert torch.equal(p, ref_p.detach()) and opt.state[p]["master_param"].data_ptr() == p.data_ptr()


def test_state_keys_dtypes_and_round_trip():
    """TE FusedAdam's layout: int16 `master_param` remainders, moments saved (get_unscaled_state) in fp32, stored in
    their dtype; state_dict -> load_state_dict into a fresh optimizer restores every tensor."""
    gen = torch.Generator().manual_seed(4)
    p = (torch.randn(300, generator=gen) * 0.02).bfloat16()
    opt = _adam([p], store_param_remainders=True, exp_avg_sq_dtype=torch.bfloat16)
    p.decoupled_grad = torch.randn(300, generator=gen)
    opt.step()
    st = opt.state[p]
    assert {k: v.dtype for k, v in st.items()} == {"step": torch.float32, "exp_avg": torch.float32,
                                                  "exp_avg_sq": torch.bfloat16, "master_param": torch.int16}
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg_sq"].dtype == torch.float32 and sd["state"][0]["master_param"].dtype == torch.int16
    q = p.clone()
    fresh = _adam([q], store_param_remainders=True, exp_avg_sq_dtype=torch.bfloat16)
    fresh.load_state_dict(sd)
    assert {k: (v.dtype, v.tolist()) for k, v in fresh.state[q].items()} == {k: (v.dtype, v.tolist())
                                                                              for k, v in st.items()}  # fmt: skip
    # a master saved as fp32 values is converted to remainders, and back
    full = _adam([q.clone()], store_param_remainders=False)
    (fp,) = full.param_groups[0]["params"]
    full.set_scaled_state(fp, "master_param", st["master_param"])
    assert full.state[fp]["master_param"].dtype == torch.float32 and torch.equal(full.master(fp), opt.master(p))
    fresh.set_scaled_state(q, "master_param", full.state[fp]["master_param"])
    assert torch.equal(fresh.state[q]["master_param"], st["master_param"])


@pytest.mark.parametrize(("overrides", "key"), [
    (["optimizer.exp_avg_dtype=fp16", PA, *BF16], "optimizer.exp_avg_dtype"),
    (["optimizer.exp_avg_sq_dtype=bf16", *BF16], "optimizer.exp_avg_sq_dtype"),  # without the precision-aware flag
    ([PA, "model.params_dtype=float32"], "optimizer.store_param_remainders"),
    ([PA, *BF16, "optimizer.use_distributed_optimizer=false"], "optimizer.use_distributed_optimizer"),
])  # fmt: skip
def test_bad_optimizer_precision_settings_are_one_config_error(overrides, key):
    with pytest.raises(config_mod.ConfigError, match=key.replace(".", r"\.")):
        config_mod.load_config(ROOT / "configs" / "tiny.toml", overrides)


def test_precision_aware_fp32_weights_without_remainders_is_accepted():
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [PA, "optimizer.store_param_remainders=false",
                                                                  "optimizer.exp_avg_dtype=bf16"])
    assert cfg.optimizer.use_precision_aware_optimizer and cfg.optimizer.exp_avg_dtype == "bf16"


def _three_steps(*overrides: str) -> tuple[list[dict], dict, list]:
    sys.path.insert(0, str(ROOT / "tests"))
    from step_cases import tiny_step

    import checkpoint

    s = tiny_step("cpu", *BF16, *overrides)
    rows, shift = [], 0.0
    for _ in range(3):
        m, shift = s["run"](s["batches"], shift)
        rows.append(m)
    (opt,) = checkpoint._inner_optimizers(s["optimizer"])
    return rows, {n: p.detach().clone() for n, p in s["policy"].named_parameters()}, opt


def test_precision_aware_run_equals_the_fp32_master_run_bit_for_bit():
    """The tiny bf16 policy, three steps: megatron-core's fp32-master path (torch AdamW) and the precision-aware
    optimizer with remainders and fp32 moments give the same metrics and bf16 weights bit for bit (deterministic on
    the CPU: the masters agree but for the ties `split_master` stores one ulp off, 1 in 2**17 elements per step, and
    a weight would differ only where such a master then rounds differently); here the masters differ by at most one
    ulp. Its state is 2 + 8 bytes per parameter, the fp32-master path's 12."""
    ref_rows, ref_w, ref_opt = _three_steps()
    rows, w, opt = _three_steps(PA)
    assert type(opt.optimizer) is precision_adam.PrecisionAwareAdam and type(ref_opt.optimizer) is torch.optim.AdamW
    assert rows == ref_rows and rows[2]["loss"] != rows[0]["loss"]
    assert w.keys() == ref_w.keys() and all(torch.equal(w[k], ref_w[k]) for k in w)
    def params(o):
        return [p for g in o.param_groups for p in g["params"]]

    pairs = list(zip(params(ref_opt.optimizer), params(opt.optimizer), strict=True))
    ulps = max(int((_bits(a.detach()) - _bits(opt.optimizer.master(b))).abs().max()) for a, b in pairs)
    assert ulps <= 1
    for a, b in pairs:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref_opt.optimizer.state[a][k], opt.optimizer.state[b][k])

    def nbytes(o):  # the state, and the inner optimizer's params where they are its own fp32 masters
        own = sum(p.numel() * p.element_size() for p in params(o) if p.dtype == torch.float32)
        return own + sum(v.numel() * v.element_size() for st in o.state.values() for k, v in st.items() if k != "step")

    n = sum(p.numel() for p, _ in pairs)
    assert nbytes(ref_opt.optimizer) == 12 * n and nbytes(opt.optimizer) == 10 * n


def _masters(s) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(fp32 master, fp32 exp_avg, fp32 exp_avg_sq) of every parameter shard of a tiny_step's optimizer, in order."""
    import checkpoint

    (o,) = checkpoint._inner_optimizers(s["optimizer"])
    inner, out = o.optimizer, []
    for p in (p for g in inner.param_groups for p in g["params"]):
        st = inner.state[p]
        master = inner.master(p) if isinstance(inner, precision_adam.PrecisionAwareAdam) else p.detach()
        out.append((master.clone(), st["exp_avg"].float(), st["exp_avg_sq"].float()))
    return out


def _run_state(step: int, cfg) -> dict:
    return {"step": step, "world_size": 1, "consumed_pairs": 0, "reward_shift": 0.0, "reward_shift_num_updates": 0,
            "sampler": {}, "scheduler": {}, "config": config_mod.to_dict(cfg)}  # fmt: skip


COMBOS = {  # the tiny policy's dtype and the optimizer's settings
    "bf16-rem-m32": [*BF16, PA],
    "bf16-rem-m16-grad16": [*BF16, PA, "optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16",
                            "optimizer.grad_reduce_in_fp32=false"],
    "bf16-norem-v16": [*BF16, PA, "optimizer.store_param_remainders=false", "optimizer.exp_avg_sq_dtype=bf16"],
    "fp32-m16": [PA, "optimizer.store_param_remainders=false", "optimizer.exp_avg_dtype=bf16",
                 "optimizer.exp_avg_sq_dtype=bf16"],
}  # fmt: skip


@pytest.mark.parametrize("combo", COMBOS)
def test_resume_two_plus_two_steps_equal_four_bit_for_bit(combo, tmp_path):
    """In one process (a world of one): steps 1-2, a checkpoint, steps 3-4; a fresh policy and optimizer loaded from
    the checkpoint runs steps 3-4 again: the same metrics, weights and optimizer state bit for bit."""
    sys.path.insert(0, str(ROOT / "tests"))
    from step_cases import tiny_step

    import checkpoint

    a = tiny_step("cpu", *COMBOS[combo])
    shift, rows = 0.0, []
    for step in range(1, 5):
        m, shift = a["run"](a["batches"], shift)
        rows.append(m)
        if step == 2:
            path = checkpoint.save(tmp_path, 2, a["ddp"], a["optimizer"], a["scheduler"], _run_state(2, a["cfg"]))
            shift2 = shift
    b = tiny_step("cpu", *COMBOS[combo])
    checkpoint.load(path, b["ddp"], b["optimizer"], b["scheduler"])
    again = []
    for _ in range(2):
        m, shift2 = b["run"](b["batches"], shift2)
        again.append(m)
    assert again == rows[2:] and rows[3]["loss"] != rows[1]["loss"]
    for (n, x), (_, y) in zip(a["policy"].named_parameters(), b["policy"].named_parameters(), strict=True):
        assert torch.equal(x, y), n
    (oa,), (ob,) = checkpoint._inner_optimizers(a["optimizer"]), checkpoint._inner_optimizers(b["optimizer"])
    for p, q in zip(*[[p for g in o.optimizer.param_groups for p in g["params"]] for o in (oa, ob)], strict=True):
        sa, sb = oa.optimizer.state[p], ob.optimizer.state[q]
        assert sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


SWITCHES = [[*BF16], [*BF16, PA, "optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16"],
            [*BF16, PA, "optimizer.store_param_remainders=false"], [*BF16, PA], [*BF16]]  # fmt: skip


def test_resume_that_switches_the_optimizer_precision_converts_the_state(tmp_path):
    """fp32 master -> remainders with bf16 moments -> fp32 master in the optimizer state -> remainders -> fp32
    master, one step and a checkpoint each: every load rebuilds the saved master (one ulp at most where a remainder
    stores a tie), casts the saved moments, keeps the weights, and check_resume names the switched keys as notices."""
    sys.path.insert(0, str(ROOT / "tests"))
    from step_cases import tiny_step

    import checkpoint

    src = tiny_step("cpu", *SWITCHES[0])
    for step, overrides in enumerate(SWITCHES[1:], start=1):
        src["run"](src["batches"], 0.0)
        path = checkpoint.save(tmp_path, step, src["ddp"], src["optimizer"], src["scheduler"],
                               _run_state(step, src["cfg"]))  # fmt: skip
        dst = tiny_step("cpu", *overrides)
        changed = checkpoint.check_resume(checkpoint.read_run_state(path), dst["cfg"])
        assert changed and all(k.startswith("optimizer.") for k in changed)
        checkpoint.load(path, dst["ddp"], dst["optimizer"], dst["scheduler"])
        for (n, x), (_, y) in zip(src["policy"].named_parameters(), dst["policy"].named_parameters(), strict=True):
            assert torch.equal(x, y), n
        moments = {"exp_avg": dst["cfg"].optimizer.exp_avg_dtype, "exp_avg_sq": dst["cfg"].optimizer.exp_avg_sq_dtype}
        for (m0, a0, v0), (m1, a1, v1) in zip(_masters(src), _masters(dst), strict=True):
            assert int((_bits(m0) - _bits(m1)).abs().max()) <= 1
            for want, got, k in ((a0, a1, "exp_avg"), (v0, v1, "exp_avg_sq")):
                assert torch.equal(got, want.bfloat16().float() if moments[k] == "bf16" else want), k
        src = dst


@pytest.fixture(scope="module")
def tp_ep_resume(torchrun, tmp_path_factory) -> dict:
    """tests/dist/check_precision_resume.py on 2 ranks: {f"{layout}-{moments}": {rank: report}}."""
    launch = torchrun(ROOT / "tests" / "dist" / "check_precision_resume.py", tmp_path_factory.mktemp("pa_resume"),
                      timeout=600)  # fmt: skip
    return {case: {r: rep[case] for r, rep in launch.ranks.items()} for case in launch.result}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2_sp-m32", "tp2_sp-m16", "ep2-m32", "ep2-m16"])
def test_resume_two_plus_two_equals_four_at_tp2_and_ep2(tp_ep_resume, case):
    """On 2 ranks at TP = 2 (+SP) and at EP = 2 (DP = 2 for the dense parameters), remainders with fp32 or bf16
    moments: steps 3-4 of a fresh setup loaded from the step-2 checkpoint equal the uninterrupted run's (metrics),
    and so do every rank's weights and every optimizer state tensor of its shard, dtype included."""
    tp, ep = (2, 1) if case.startswith("tp2") else (1, 2)
    moments = "torch.float32" if case.endswith("m32") else "torch.bfloat16"
    ranks = tp_ep_resume[case]
    assert sorted(ranks) == [0, 1]
    for rep in ranks.values():
        assert "error" not in rep, rep
        assert rep["world"] == [tp, ep, 2 // tp]
        assert rep["metrics_equal"] and rep["trained"]
        assert rep["opt_dtypes"] == sorted(["step torch.float32", "master_param torch.int16",
                                            f"exp_avg {moments}", f"exp_avg_sq {moments}"])  # fmt: skip
        assert rep["count"] > 20 and rep["unequal"] == []

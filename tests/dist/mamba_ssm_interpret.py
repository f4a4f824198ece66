"""Run the Triton Mamba-2 kernels (mamba-ssm's scan and gated norm, fla-core's conv: the `mamba triton` set) on the
CPU through Triton's interpreter and compare them with mamba_torch (float32); prints one JSON line
{"kernel_module": ..., "worst": {tensor: max relative difference}}.

Run by tests/test_mamba_ssm_interpret.py in a fresh process with TRITON_INTERPRET=1 (read when the kernels are
defined) and $OMNI_MAMBA_SSM_SRC naming mamba-ssm's sources, imported by mamba_triton.load_mamba_ssm_triton (the
training path's import of the same kernels without the compiled package).
Usage: python tests/dist/mamba_ssm_interpret.py {scan,conv,mixer,shared_prompt} | model {triton,torch} OUT.pt

What this process changes, so that mamba-ssm's GPU code runs on CPU tensors (nothing here is used outside it):
* `torch.cuda.device(...)` is a no-op context and `torch.cuda.get_device_properties(...).multi_processor_count` is
  132 (an H100's; it only sizes a grid): there is no CUDA device;
* Triton's autotuner takes the first config of each kernel instead of timing them all (timing needs a GPU driver;
  Triton < 3.8, e.g. the GPU machine's 3.6, times even a single config, so its timing returns 0 here).
"""

import contextlib
import json
import sys
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def _cpu_harness() -> None:
    from triton.runtime import autotuner

    torch.cuda.device = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(multi_processor_count=132)
    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs, *a, **k: prune(self, kwargs, *a, **k)[:1]
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]  # (median, p20, p80) in ms


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def scan() -> tuple[str, dict]:
    """mamba_ssm's mamba_chunk_scan_combined vs mamba_torch's on a packed case (300 tokens in 3 sequences
    via seq_idx, 8 heads x 16, 2 groups, d_state 16, chunk 64, dt softplus + dt_limit (0.001, inf), D, z): output
    and the gradients of x, dt, B, C, z."""
    from backend import mamba_torch
    from backend import mamba_triton
    from bench.scan import run_scan, scan_inputs

    mamba_chunk_scan_combined = mamba_triton.load_mamba_ssm_triton()["scan_fn"]
    results = []
    for kernel in (mamba_chunk_scan_combined, mamba_torch.mamba_chunk_scan_combined):
        inp = scan_inputs(torch.device("cpu"), 300, 3, heads=8, head_dim=16, groups=2, d_state=16,
                                dtype=torch.float32)
        grad_out = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(1))
        y, grads = run_scan(kernel, inp, 64, grad_out)
        results.append({"y": y.detach(), **grads})
    return mamba_chunk_scan_combined.__module__, {k: _rel(results[0][k], results[1][k]) for k in results[1]}


def conv() -> tuple[str, dict]:
    """mamba_triton.causal_conv1d_fn (fla-core's Triton conv) vs mamba_torch.causal_conv1d_fn: 3 packed sequences
    (a 2-token one, shorter than the 4-tap window; lengths not multiples of fla's 64-token chunk) with silu and bias,
    seq_idx read on the host and the precomputed offsets of mamba_triton.CONV_OFFSETS; output and the gradients of
    x, weight, bias. Also "chunk_indices": conv_chunk_indices against fla's own prepare_chunk_indices (0 = equal)."""
    from fla.ops.utils import prepare_chunk_indices

    from backend import mamba_torch
    from backend import mamba_triton

    g = torch.Generator().manual_seed(0)
    T, dim, width = 150, 24, 4
    cu = [0, 2, 70, T]
    tensors = {"x": torch.randn(1, T, dim, generator=g).transpose(1, 2), "weight": torch.randn(dim, width, generator=g),
               "bias": torch.randn(dim, generator=g)}
    seq_idx = mamba_torch.seq_idx_from_cu_seqlens(torch.tensor(cu), T)
    grad_out = torch.randn(1, dim, T, generator=g)
    ours = mamba_triton.conv_chunk_indices(cu)
    worst = {"chunk_indices": float(not torch.equal(ours, prepare_chunk_indices(torch.tensor(cu), 64)))}
    offsets = (seq_idx, torch.tensor(cu, dtype=torch.int32), ours)
    for name, fn, row in (("", mamba_triton.causal_conv1d_fn, None), ("offsets ", mamba_triton.causal_conv1d_fn,
                                                                     offsets)):
        results = []
        for kernel in (fn, mamba_torch.causal_conv1d_fn):
            a = {k: v.detach().clone().requires_grad_(True) for k, v in tensors.items()}
            token = mamba_triton.CONV_OFFSETS.set(row)
            try:
                y = kernel(a["x"], a["weight"], a["bias"], seq_idx=seq_idx, activation="silu")
            finally:
                mamba_triton.CONV_OFFSETS.reset(token)
            y.backward(grad_out)
            results.append({"y": y.detach(), **{k: v.grad for k, v in a.items()}})
        worst.update({name + k: _rel(results[0][k], results[1][k]) for k in results[1]})
    return mamba_triton.causal_conv1d_fn.__module__, worst


def mixer() -> tuple[str, dict]:
    """The fused mixer body megatron's MambaMixer calls in training, mamba_triton.mamba_split_conv1d_scan_combined
    (fla-core's conv, mamba-ssm's scan and gated norm composed by mamba_torch) vs mamba_torch's, as the mixer calls
    it (seq_idx of 3 packed sequences, D [nheads] with headdim, dt_limit, the z gate in the scan), and with the gated
    norm inside (rmsnorm_weight, norm_before_gate False as Nemotron-H, D [nheads, headdim]); output and the gradient
    of every input."""
    from test_shared_prompt import mixer_tensors

    from backend import mamba_torch
    from backend import mamba_triton

    T = 200
    seq_idx = mamba_torch.seq_idx_from_cu_seqlens(torch.tensor([0, 3, 90, T]), T)
    tensors, kw = mixer_tensors(T, h=4, p=8, g=2, n=8)
    weight = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(3))  # 32 = h * p, the widest output
    worst = {}
    for case in ("scan gate", "norm gate"):
        results = []
        for fn in (mamba_triton.mamba_split_conv1d_scan_combined, mamba_torch.mamba_split_conv1d_scan_combined):
            a = {k: v.float().requires_grad_(True) for k, v in tensors.items()}
            extra = dict(kw)
            if case == "scan gate":  # megatron's training call: no norm, no output projection in the fused body
                del a["rmsnorm_weight"], a["outproj_weight"]
            else:
                a["D"] = a["D"][:, None].expand(-1, 8).contiguous().detach().requires_grad_(True)
                extra.pop("headdim", None)
            out = fn(**a, chunk_size=32, seq_idx=seq_idx, **extra)
            (out * weight[..., :out.shape[-1]]).sum().backward()
            results.append({"out": out.detach(), **{k: v.grad for k, v in a.items()}})
        worst.update({f"{case} {k}": _rel(results[0][k], results[1][k]) for k in results[1]})
    return mamba_triton.mamba_split_conv1d_scan_combined.__module__, worst


def model(kernels: str, out: str, pair_format: str = "separate") -> tuple[str, dict]:
    """The tiny Omni (its 2 Mamba layers through megatron's MambaMixer) on one packed pair with images and padding
    (format "separate"), or on the 4 pairs of shared_prompt_cases as one shared-prompt row ("shared"), built with the
    `mamba triton` set (kernels "triton": install_triton_mamba before megatron_patches.apply, which then keeps it) or
    mamba_torch's ("torch"): saves the logits and every parameter gradient (omni_model_cases' weighting) to `out` for
    the test to compare; {} as "worst"."""
    from omni_model_cases import TINY, logits_and_grads, make_pair_batch
    from shared_prompt_cases import IMAGE, make_pairs

    import distributed
    import hf_weights
    from backend import kernel_selection
    from backend import mamba_triton
    from backend import megatron_patches
    import omni_model
    import pack
    from config import ModelConfig, ParallelConfig

    if kernels == "triton":
        megatron_patches.install_triton_mamba()
    distributed.init_distributed()
    from megatron.core.ssm import mamba_mixer

    fused = mamba_mixer.mamba_split_conv1d_scan_combined.__wrapped__  # under megatron_patches' Mamba scan hook
    assert (fused is mamba_triton.mamba_split_conv1d_scan_combined) == (kernels == "triton"), fused
    m = omni_model.build_model(TINY, ModelConfig(), ParallelConfig(), kernels=kernel_selection.Kernels(
        "local", kernels, "cpu", attention="sdpa", experts="sequential"))
    hits = []  # per conv call: were its offsets the batch's (OmniModel.forward's CONV_OFFSETS), not read back?
    offsets = mamba_triton._offsets

    def recorded(seq_idx):
        row = mamba_triton.CONV_OFFSETS.get()
        hits.append(row is not None and row[0] is seq_idx)
        return offsets(seq_idx)

    mamba_triton._offsets = recorded
    hf_weights.load_hf_weights(m, TINY)
    batch = (make_pair_batch(seed=5, lens=(19, 27), divisible_by=8) if pair_format == "separate" else
             pack.pack_shared_prompt(make_pairs(), divisible_by=8, image_token_id=IMAGE))
    logits, grads = logits_and_grads(m.train(), batch)
    extra = {"conv_offsets_from_the_batch": torch.tensor([len(hits) > 0 and all(hits)])} if kernels == "triton" else {}
    torch.save({"logits": logits, **grads, **extra}, out)
    return fused.__module__, {}


def shared_prompt() -> tuple[str, dict]:
    """shared_prompt.mamba_split_conv1d_scan with the `mamba triton` set (fla-core's conv as conv_fn,
    mamba-ssm's scan as scan_fn: the prompt state h_P is then summed over the prompt, its gated RMSNorm as norm_fn), as
    the Mamba scan hook passes them on a GPU, vs the same function with mamba_torch's kernels (whose equality with
    separate sequences tests/test_shared_prompt.py checks): a row of 4 pairs (prompts not multiples of the chunk, a
    chosen span shorter than the conv window, a one-token prompt, padding); output and the gradients of every input."""
    from test_shared_prompt import SPANS, mixer_tensors, row_offsets

    from backend import mamba_triton
    from backend.shared_prompt import mamba_split_conv1d_scan

    kernels = mamba_triton.kernels()

    seg, T = row_offsets([(p * 11, c * 9, r * 7, pad) for p, c, r, pad in SPANS], tail=5)
    tensors, kw = mixer_tensors(T, h=4, p=8, g=2, n=8)
    weight = torch.randn(1, T, tensors["outproj_weight"].shape[0], generator=torch.Generator().manual_seed(3))
    results = []
    for chosen in (kernels, {}):
        a = {k: v.float().requires_grad_(True) for k, v in tensors.items()}
        out = mamba_split_conv1d_scan(**a, chunk_size=32, row_spans=seg, **kw, **chosen)
        (out * weight).sum().backward()
        results.append({"out": out.detach(), **{k: v.grad for k, v in a.items()}})
    return kernels["scan_fn"].__module__, {k: _rel(results[0][k], results[1][k]) for k in results[1]}


if __name__ == "__main__":
    _cpu_harness()
    checks = {"scan": scan, "conv": conv, "mixer": mixer, "model": model, "shared_prompt": shared_prompt}
    module, worst = checks[sys.argv[1]](*sys.argv[2:])
    print(json.dumps({"kernel_module": module, "worst": worst}))

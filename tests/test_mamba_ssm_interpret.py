"""The Triton Mamba-2 kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1) and compared with
mamba_torch in float32: mamba-ssm's scan and gated norm (the GPU production path, Dockerfile: mamba-ssm 2.3.2.post1)
and the `mamba triton` set (mamba_triton: those two plus fla-core's Triton conv, requirements.txt's fla-core).

This checks, without a GPU, the kernels' algorithm and the way this repository calls them (argument conventions of
`mamba_chunk_scan_combined` and fla's `causal_conv1d`, seq_idx / cu_seqlens packing, dt softplus and dt_limit, D, z,
gated RMSNorm), the fused mixer body megatron calls, and the shared-prompt scan's kernel path. It does not
check GPU numerics: the interpreter computes float32 dot products exactly (a GPU uses TF32) and gives wrong bf16
results, so the bf16 tolerances stay with tests/test_gpu.py.

mamba-ssm cannot be pip-installed without CUDA, and only its Python/Triton sources are needed: the session fixture
fetches the pinned sdist from PyPI once (216 kB, sha256-checked) into ~/.cache/omni-mpo, or takes the directory
named by $OMNI_MAMBA_SSM_SRC (one that holds `mamba_ssm/`, e.g. an unpacked sdist) on a machine without network.
"""

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSION = "2.3.2.post1"
SDIST_URL = ("https://files.pythonhosted.org/packages/af/48/aa7bec0efc7453fa0512276c0069c854bf684219050294266534bfef34bb"
             f"/mamba_ssm-{VERSION}.tar.gz")
SDIST_SHA256 = "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028"
TOL = 1e-5  # float32 against float32, relative to the largest value; measured ≤ 5.8e-6 (mixer: dt_bias)


@pytest.fixture(scope="session")
def mamba_ssm_src() -> Path:
    """A directory holding mamba-ssm's `mamba_ssm/` package sources: $OMNI_MAMBA_SSM_SRC, or the pinned sdist
    unpacked under ~/.cache/omni-mpo (downloaded on first use). Fails (never skips) when neither is available."""
    if os.environ.get("OMNI_MAMBA_SSM_SRC"):
        src = Path(os.environ["OMNI_MAMBA_SSM_SRC"])
        assert (src / "mamba_ssm" / "ops" / "triton" / "ssd_combined.py").is_file(), \
            f"OMNI_MAMBA_SSM_SRC={src} does not hold mamba-ssm's sources (mamba_ssm/ops/triton/ssd_combined.py)"
        return src
    src = Path.home() / ".cache" / "omni-mpo" / f"mamba_ssm-{VERSION}"
    if not (src / "mamba_ssm" / "ops" / "triton" / "ssd_combined.py").is_file():
        try:
            with urllib.request.urlopen(SDIST_URL, timeout=120) as response:
                data = response.read()
        except OSError as e:
            pytest.fail(f"cannot download mamba-ssm {VERSION}'s sdist ({e}); without network, unpack it and set "
                        f"OMNI_MAMBA_SSM_SRC to the directory holding mamba_ssm/ ({SDIST_URL})")
        assert hashlib.sha256(data).hexdigest() == SDIST_SHA256, f"{SDIST_URL}: sha256 differs from the pinned one"
        prefix = f"mamba_ssm-{VERSION}/"
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix + "mamba_ssm/") and m.isfile()]
            tmp = src.with_name(f"{src.name}.tmp{os.getpid()}")
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(tmp, members=members, filter="data")
        if src.exists():  # another session unpacked it meanwhile
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, src)
    return src


def _interpret(src: Path, check: str, module: str = "mamba_ssm.ops.triton.ssd_combined", *args: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1", "OMNI_MAMBA_SSM_SRC": str(src)}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "dist" / "mamba_ssm_interpret.py"), check, *args],
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "only 0-dimensional arrays can be converted to Python scalars" in proc.stderr:
        import numpy
        import triton

        pytest.fail(f"Triton {triton.__version__}'s interpreter does not run with numpy {numpy.__version__}: it "
                    "converts one-element arrays to Python ints, which numpy >= 2.4 refuses (seen with Triton 3.6, "
                    "the GPU machine's; Triton 3.8, torch 2.14.1's, runs): use numpy < 2.4 or Triton >= 3.8")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kernel_module"] == module, result  # the library's kernel (or mamba_triton's), not a stand-in
    return result["worst"]


@pytest.mark.slow
def test_mamba_ssm_scan_equals_mamba_torch(mamba_ssm_src):
    """The packed case in float32: output and the gradients of x, dt, B, C, z."""
    worst = _interpret(mamba_ssm_src, "scan")
    assert set(worst) == {"y", "x", "dt", "B", "C", "z"} and max(worst.values()) <= TOL, worst


@pytest.mark.slow
def test_fla_conv_equals_mamba_torch(mamba_ssm_src):
    """mamba_triton.causal_conv1d_fn (fla-core's Triton conv) on 3 packed sequences, offsets read from seq_idx and
    precomputed (mamba_triton.CONV_OFFSETS): output and the gradients of x, weight, bias; its chunk_indices are
    fla's own."""
    worst = _interpret(mamba_ssm_src, "conv", module="backend.mamba_triton")
    assert worst.pop("chunk_indices") == 0 and len(worst) == 8 and max(worst.values()) <= TOL, worst


@pytest.mark.slow
def test_triton_mixer_body_equals_mamba_torch(mamba_ssm_src):
    """The `mamba triton` fused mixer body (what megatron's MambaMixer calls in training) with the gate in the scan
    and with the gated norm inside: output and the gradient of every input."""
    worst = _interpret(mamba_ssm_src, "mixer", module="backend.mamba_triton")
    assert len(worst) == 7 + 9 and max(worst.values()) <= TOL, worst


@pytest.mark.slow
@pytest.mark.parametrize("pair_format", ["separate", "shared"])
def test_tiny_omni_on_the_triton_set_equals_the_torch_set(mamba_ssm_src, tmp_path, pair_format):
    """The tiny Omni built with the `mamba triton` set (megatron's MambaMixer calling mamba_triton through
    megatron_patches' hook, its gated norm on mamba-ssm's rmsnorm_fn, the conv offsets from the batch: no read back) and
    with mamba_torch, each in its own process, in training mode: the logits and every parameter gradient. Separate
    rows: one packed pair with images and padding; shared: 4 pairs in one shared-prompt row (the pair spans' seq_idx
    is the PackedSeqParams' own, shared_prompt.RowSpans, so the conv takes the batch's offsets there too)."""
    import torch

    _interpret(mamba_ssm_src, "model", "backend.mamba_torch", "torch", str(tmp_path / "torch.pt"), pair_format)
    _interpret(mamba_ssm_src, "model", "backend.mamba_triton", "triton", str(tmp_path / "triton.pt"), pair_format)
    want, got = torch.load(tmp_path / "torch.pt"), torch.load(tmp_path / "triton.pt")
    assert got.pop("conv_offsets_from_the_batch").item()  # every conv call took OmniModel.forward's offsets
    assert got.keys() == want.keys() and len(want) > 40  # the logits and every parameter's gradient
    worst = {k: ((got[k].double() - want[k].double()).abs().max() / want[k].double().abs().max()).item() for k in want}
    assert max(worst.values()) <= TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.slow
def test_shared_prompt_mamba_with_triton_kernels_equals_torch_kernels(mamba_ssm_src):
    """The shared-prompt Mamba layer with the `mamba triton` set (fla-core's conv, mamba-ssm's scan and gated RMSNorm;
    tests/test_gpu.py item 7 in float32): output and the gradient of every mixer input."""
    worst = _interpret(mamba_ssm_src, "shared_prompt")
    assert len(worst) == 9 and max(worst.values()) <= TOL, worst


def test_the_pinned_sdist_is_the_dockerfiles_mamba_ssm():
    """The kernels checked here are the version the GPU image builds (Dockerfile ARG MAMBA_SSM_VERSION)."""
    assert f"ARG MAMBA_SSM_VERSION={VERSION}\n" in (REPO / "Dockerfile").read_text()

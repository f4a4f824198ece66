"""mamba_triton without a GPU or Triton's interpreter: the loader of mamba-ssm's Triton sources (the shim that skips
its package __init__), the conv offsets that fla-core's conv reads, and where fla-core refuses its simple-GLA kernel.
The kernels themselves are compared with mamba_torch in Triton's interpreter (tests/test_mamba_ssm_interpret.py) and
on CUDA (tests/test_gpu.py).

Run: `pytest tests/test_mamba_triton.py`.
"""

import importlib.util
import sys

import pytest
import torch
from conftest import raises_naming

from backend import mamba_torch, mamba_triton


def _fake_sources(root):
    """A `mamba_ssm/` whose package __init__ imports the compiled extension, as mamba-ssm's does, and whose two Triton
    modules import a sibling module by its absolute name, as mamba-ssm's do."""
    triton = root / "mamba_ssm" / "ops" / "triton"
    triton.mkdir(parents=True)
    (root / "mamba_ssm" / "__init__.py").write_text("import selective_scan_cuda  # noqa: F401\n")
    (root / "mamba_ssm" / "ops" / "__init__.py").write_text("")
    (triton / "__init__.py").write_text("")
    (triton / "ssd_bmm.py").write_text("NAME = 'scan'\n")
    (triton / "ssd_combined.py").write_text(
        "from mamba_ssm.ops.triton.ssd_bmm import NAME\n\n\n"
        "def mamba_chunk_scan_combined(*args, **kwargs):\n    return NAME\n"
    )
    (triton / "layernorm_gated.py").write_text("def rmsnorm_fn(*args, **kwargs):\n    return 'norm'\n")


def test_no_sources_is_none_and_a_wrong_folder_is_one_error(tmp_path, monkeypatch):
    """Without $OMNI_MAMBA_SSM_SRC and without an installed mamba-ssm: None. A folder without mamba-ssm's sources:
    one ImportError naming it."""
    monkeypatch.delenv(mamba_triton.MAMBA_SSM_SRC_ENV, raising=False)
    if importlib.util.find_spec("mamba_ssm") is None:
        assert mamba_triton.load_mamba_ssm_triton() is None
    monkeypatch.setenv(mamba_triton.MAMBA_SSM_SRC_ENV, str(tmp_path))
    with raises_naming(ImportError, f"OMNI_MAMBA_SSM_SRC={tmp_path} ", "mamba_ssm/ops/triton/"):
        mamba_triton.load_mamba_ssm_triton()


def test_the_loader_skips_the_package_init_and_leaves_no_module_behind(tmp_path, monkeypatch):
    """The kernels load although the package __init__ would fail (no compiled `selective_scan_cuda`); a second call
    returns the same functions; afterwards no `mamba_ssm*` module and no stand-in for the extension is in sys.modules
    (a stand-in without __spec__ broke importlib.util.find_spec), and a module left by an earlier failed
    import of the package is put back as it was."""
    if "mamba_ssm" in sys.modules or importlib.util.find_spec("selective_scan_cuda") is not None:
        pytest.skip("mamba-ssm is imported or compiled here: the loader then imports the complete package")
    _fake_sources(tmp_path)
    monkeypatch.setenv(mamba_triton.MAMBA_SSM_SRC_ENV, str(tmp_path))
    leftover = type(sys)("mamba_ssm.utils")
    monkeypatch.setitem(sys.modules, "mamba_ssm.utils", leftover)
    first = mamba_triton.load_mamba_ssm_triton()
    second = mamba_triton.load_mamba_ssm_triton()
    assert first == second and (first["scan_fn"](), first["norm_fn"]()) == ("scan", "norm")
    assert first["scan_fn"].__module__ == "mamba_ssm.ops.triton.ssd_combined"
    assert sorted(n for n in sys.modules if n.startswith("mamba_ssm")) == ["mamba_ssm.utils"]
    assert sys.modules["mamba_ssm.utils"] is leftover
    assert "selective_scan_cuda" not in sys.modules and importlib.util.find_spec("selective_scan_cuda") is None


def test_conv_offsets_from_seq_idx_and_from_the_batch():
    """The conv's (cu_seqlens, chunk_indices): the precomputed ones of CONV_OFFSETS when its seq_idx is the very tensor
    the mixer passes (no host read), else derived from seq_idx; both equal the closed form: sequence boundaries where
    seq_idx changes, and ceil(length / 64) chunks per sequence, numbered within it."""
    cu = [0, 2, 70, 200, 201]
    seq_idx = mamba_torch.seq_idx_from_cu_seqlens(torch.tensor(cu), 201)
    want = [(s, c) for s, n in enumerate((2, 68, 130, 1)) for c in range(-(-n // 64))]
    assert mamba_triton.conv_chunk_indices(cu).tolist() == [list(r) for r in want]
    derived = mamba_triton._offsets(seq_idx)
    assert derived[0].tolist() == cu and derived[0].dtype == torch.int32
    assert torch.equal(derived[1], mamba_triton.conv_chunk_indices(cu))
    row = (seq_idx, torch.tensor(cu, dtype=torch.int32), mamba_triton.conv_chunk_indices(cu))
    token = mamba_triton.CONV_OFFSETS.set(row)
    try:
        got = mamba_triton._offsets(seq_idx)
        assert got[0] is row[1] and got[1] is row[2]  # the same tensors, nothing recomputed
        assert mamba_triton._offsets(seq_idx.clone())[0].tolist() == cu  # another tensor: derived again
    finally:
        mamba_triton.CONV_OFFSETS.reset(token)


@pytest.mark.parametrize("capability,triton_version,refused", [((9, 0), "3.6.0", True), ((9, 0), "3.7.1", False),
                                                               ((8, 0), "3.6.0", False), ((9, 0), "3.3.1", False)])
def test_fla_is_left_out_where_it_refuses_triton(monkeypatch, capability, triton_version, refused):
    """fla-core's own guard (Triton >= 3.4.0, < 3.7.1 on Hopper): the scan comparison and benchmark leave it out there
    with the reason instead of failing on its refusal."""
    import triton

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert (mamba_triton.fla_refusal(torch.device("cuda", 0)) is not None) is refused

"""A tiny run on the generated video sample (data/mmpr_video_sample: video clips, frame lists, image + clip rows;
bins of up to 4 pairs mix them): step 1 at the closed form, the video embedder trained, resume 2 + 2 = 4 bit for bit.

Run: `pytest tests/test_train_video.py` (CPU, one rank; two train.py launches, about a minute).
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import ROOT, _loaded_state, _rows  # noqa: E402

VIDEO_RUN = ("data.train.data_path=data/mmpr_video_sample/MMPR-video-sample/meta.json",
             "data.video.target_num_patches=24", "data.train.split_validation_size=0", "mpo.val_at_end=false",
             "mpo.max_num_steps=4", "packing.max_sequences_per_bin=4", "checkpoint.save_period=2")
KEYS = ("loss", "preference_loss", "bco_loss", "sft_loss", "accuracy", "rewards/margin", "reward_shift", "lr",
        "grad_norm", "consumed_pairs", "tokens")


@pytest.fixture(scope="module")
def runs(torchrun, tmp_path_factory):
    """(straight: 4 steps saving step_2 and step_4, resumed: its step_2 copied to a new run folder, then steps 3-4)."""
    env = {"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf_cache"))}
    straight, resumed = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    run = torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={straight}", *VIDEO_RUN, nproc=1, env=env)
    assert "12 train pairs" in run.stdout
    shutil.rmtree(resumed)
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_4", ".lock"))
    again = torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={resumed}", *VIDEO_RUN, nproc=1, env=env)
    assert "resumed from" in again.stdout
    return straight, resumed


def test_step_one_is_the_closed_form_and_the_video_embedder_trains(runs):
    """Policy = reference at step 1: DPO ln 2, BCO 2 ln 2 (delta 0), loss w_p·ln 2 + w_q·2 ln 2 (configs/tiny.toml's
    0.8 and 0.2); after 4 steps the ViT's video embedder has moved from the checkpoint's."""
    from safetensors import safe_open

    straight, _ = runs
    first = _rows(straight)[0]
    assert first["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-6)
    assert first["loss"] == pytest.approx(0.8 * math.log(2) + 0.2 * 2 * math.log(2), abs=1e-6)
    state = dict(_loaded_state(straight / "step_4", *VIDEO_RUN))
    with safe_open(ROOT / "assets" / "tiny-omni" / "model.safetensors", "pt") as f:
        start = f.get_tensor("vision_model.radio_model.model.patch_generator.video_embedder.weight")
    assert not torch.equal(state["param vision_model.video_embedder.weight"], start)


def test_resume_two_plus_two_equals_four_bit_for_bit(runs):
    straight, resumed = runs
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in KEYS} == {k: y[k] for k in KEYS}, x["step"]
    one, two = _loaded_state(straight / "step_4", *VIDEO_RUN), _loaded_state(resumed / "step_4", *VIDEO_RUN)
    assert [k for k, _ in one] == [k for k, _ in two]
    for (k, x), (_, y) in zip(one, two, strict=True):
        assert torch.equal(x, y), k


def test_a_frozen_vision_tower_has_no_gradient_buffer_or_optimizer_state():
    """model.freeze_vision_encoder = true covers the video embedder: no DDP gradient buffer holds a ViT parameter and
    the optimizer's (fp32 main) parameters are exactly the trainable ones."""
    import config
    import distributed
    import omni_model
    import train

    distributed.init_distributed()
    cfg = config.load_config(ROOT / "configs" / "tiny.toml", ["model.freeze_vision_encoder=true"])
    policy = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    ddp, opt, _ = train.build_optimizer(policy, cfg)
    vit = {id(p) for p in policy.vision_model.parameters()}
    assert id(policy.vision_model.video_embedder.weight) in vit
    buffered = {id(p) for b in ddp.buffers for p in b.params}
    assert buffered and not buffered & vit
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert sum(p.numel() for g in opt.optimizer.param_groups for p in g["params"]) == trainable
    assert trainable == sum(p.numel() for p in policy.parameters()) - sum(
        p.numel() for p in policy.vision_model.parameters())

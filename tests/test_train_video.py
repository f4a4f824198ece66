"""A tiny run on image, video and audio pairs (the generated video sample, data/mmpr_video_sample: video clips, frame
lists, image + clip rows; and the image + audio sample, data/mmpr_sample/MMPR-audio; one meta-recipe, bins of up to 4
pairs mix them): step 1 at the closed form, the video embedder and the sound towers trained, resume 2 + 2 = 4 bit for
bit, and hf_export.py's export of it loads in transformers with our logits on a video and on an audio prompt.

Run: `pytest tests/test_train_video.py` (CPU, one rank; two train.py launches and one export, about two minutes).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from omni_model_cases import audio_batch_fields, media_text_inputs, video_text_inputs  # noqa: E402
from test_train import ROOT, _loaded_state, _rows  # noqa: E402

# the video sample and the image + audio sample: their subsets in one meta-recipe (absolute paths), written by `runs`
SUBSETS = (ROOT / "data" / "mmpr_video_sample" / "MMPR-video-sample", ROOT / "data" / "mmpr_sample" / "MMPR-audio")
MEDIA_RUN = ("data.video.target_num_patches=24", "data.train.split_validation_size=0", "mpo.val_at_end=false",
             "mpo.max_num_steps=4", "packing.max_sequences_per_bin=4", "checkpoint.save_period=2")
KEYS = ("loss", "preference_loss", "bco_loss", "sft_loss", "accuracy", "rewards/margin", "reward_shift", "lr",
        "grad_norm", "consumed_pairs", "tokens")


@pytest.fixture(scope="module")
def runs(torchrun, tmp_path_factory):
    """(straight: 4 steps saving step_2 and step_4, resumed: its step_2 copied to a new run folder, then steps 3-4)."""
    env = {"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf_cache"))}
    meta = {}
    for sample in SUBSETS:
        for name, spec in json.loads((sample / "meta.json").read_text()).items():
            meta[name] = {**spec, **{k: str(sample.parent / spec[k]) for k in ("root", "annotation")}}
    meta_path = tmp_path_factory.mktemp("meta") / "meta.json"
    meta_path.write_text(json.dumps(meta))
    straight, resumed = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    run_args = ("train.py", "configs/tiny.toml", f"data.train.data_path={meta_path}", *MEDIA_RUN)
    run = torchrun(*run_args, f"checkpoint.dir={straight}", nproc=1, env=env)
    assert "30 train pairs" in run.stdout  # 12 video, 12 image, 6 audio
    shutil.rmtree(resumed)
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_4", ".lock"))
    again = torchrun(*run_args, f"checkpoint.dir={resumed}", nproc=1, env=env)
    assert "resumed from" in again.stdout
    return straight, resumed


def test_step_one_is_the_closed_form_and_the_media_towers_train(runs):
    """Policy = reference at step 1: DPO ln 2, BCO 2 ln 2 (delta 0), loss w_p·ln 2 + w_q·2 ln 2 (configs/tiny.toml's
    0.8 and 0.2); after 4 steps the ViT's video embedder and the sound encoder and projection have moved from the
    checkpoint's."""
    from safetensors import safe_open

    straight, _ = runs
    first = _rows(straight)[0]
    assert first["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-6)
    assert first["loss"] == pytest.approx(0.8 * math.log(2) + 0.2 * 2 * math.log(2), abs=1e-6)
    state = dict(_loaded_state(straight / "step_4", *MEDIA_RUN))
    with safe_open(ROOT / "assets" / "tiny-omni" / "model.safetensors", "pt") as f:
        for ours, hub in (("vision_model.video_embedder.weight",
                           "vision_model.radio_model.model.patch_generator.video_embedder.weight"),
                          ("sound_encoder.encoder.layers.0.feed_forward1.linear1.weight",) * 2,
                          ("sound_projection.encoder.linear_fc1.weight", "sound_projection.linear1.weight")):
            assert not torch.equal(state[f"param {ours}"], f.get_tensor(hub)), ours


def test_resume_two_plus_two_equals_four_bit_for_bit(runs):
    straight, resumed = runs
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in KEYS} == {k: y[k] for k in KEYS}, x["step"]
    one, two = _loaded_state(straight / "step_4", *MEDIA_RUN), _loaded_state(resumed / "step_4", *MEDIA_RUN)
    assert [k for k, _ in one] == [k for k, _ in two]
    for (k, x), (_, y) in zip(one, two, strict=True):
        assert torch.equal(x, y), k


def test_export_loads_in_transformers_with_our_logits_on_video_and_audio_prompts(runs, tmp_path):
    """hf_export.py of step 4; transformers' NemotronH_Omni loads it and its fp32 logits on a video prompt (its
    get_video_features given to forward, as tests/test_omni_video.py) and on an audio prompt equal the trained
    model's (<= 1e-4, as for images); the checkpoint's own logits differ (training moved them)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import checkpoint
    import config
    import distributed
    import omni_model

    straight, _ = runs
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "hf_export.py", str(straight / "step_4"), str(out)], cwd=ROOT,
                          env=dict(os.environ, TORCHDYNAMO_DISABLE="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    distributed.init_distributed()
    cfg = config.load_config(ROOT / "configs" / "tiny.toml", MEDIA_RUN)
    ours = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    checkpoint.load(straight / "step_4", ours)
    ours.eval()
    exported = NemotronH_Omni_Reasoning_V3.from_pretrained(out).eval()
    original = NemotronH_Omni_Reasoning_V3.from_pretrained(ROOT / cfg.model.hf_path).eval()
    v, a = video_text_inputs(3), media_text_inputs(1)
    with torch.no_grad():
        mine = {"video": ours({"input_ids": v["input_ids"], "pixel_values_videos": v["video_patches"],
                               "video_grid_thw": v["video_grid_thw"]}),
                "audio": ours({"input_ids": a["input_ids"], **audio_batch_fields(a)})}
        for hf in (exported, original):
            tubelets = hf.get_video_features(v["pixel_values_videos"]).pooler_output
            video = BaseModelOutputWithPooling(pooler_output=tuple(tubelets))
            theirs = {"video": hf(input_ids=v["input_ids"], mm_encoder_outputs={"video": video}).logits[0],
                      "audio": hf(input_ids=a["input_ids"], input_features=a["input_features"],
                                  input_features_mask=a["input_features_mask"]).logits[0]}
            for prompt, logits in theirs.items():
                d = (mine[prompt] - logits).abs().max().item()
                assert d <= 1e-4 if hf is exported else d > 1e-4, (prompt, d)


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

"""A tiny run on image, video and audio pairs (the generated video sample, data/mmpr_video_sample: video clips, frame
lists, image + clip rows; and the image + audio sample, data/mmpr_sample/MMPR-audio; one meta-recipe, bins of up to 4
pairs mix them) with EVS on (a copy of the tiny checkpoint at video_pruning_rate RATE): step 1 at the closed form, the
video embedder and the sound towers trained, resume 2 + 2 = 4 bit for bit, and hf_export.py's export of it loads in
transformers (pruning too) with our logits on a video and on an audio prompt.

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
# EVS: a 2-tubelet video of the sample (6 tokens a tubelet) keeps 8 of 12 tokens, all of the first tubelet and 2 of the
# second's (the chunks as the reader fills them, the features the model picks); the frame lists, played there and back
# (frames 0 1 2 1 0: 3 tubelets), keep 12 of 18, 6 of the last two tubelets' 12, so the model moves the row's `<image>`
# tokens between chunks. At 0.7 (the hub's) or 0.5 every video here keeps its first tubelet only.
RATE = 0.3
FRAMES = "moving_square_frames"
KEYS = ("loss", "preference_loss", "bco_loss", "sft_loss", "accuracy", "rewards/margin", "reward_shift", "lr",
        "grad_norm", "consumed_pairs", "tokens")


@pytest.fixture(scope="module")
def runs(torchrun, tmp_path_factory):
    """(straight: 4 steps saving step_2 and step_4, resumed: its step_2 copied to a new run folder, then steps 3-4;
    the runs' overrides; their environment). The model: the tiny checkpoint's files with config.json's
    video_pruning_rate = RATE."""
    model = tmp_path_factory.mktemp("evs_model")
    for f in (ROOT / "assets" / "tiny-omni").iterdir():
        if f.name == "config.json":
            (model / f.name).write_text(json.dumps(json.loads(f.read_text()) | {"video_pruning_rate": RATE}))
        else:
            (model / f.name).symlink_to(f)
    env = {"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf_cache"))}
    meta, folder = {}, tmp_path_factory.mktemp("meta")
    for sample in SUBSETS:
        for name, spec in json.loads((sample / "meta.json").read_text()).items():
            meta[name] = {**spec, **{k: str(sample.parent / spec[k]) for k in ("root", "annotation")}}
    rows = [json.loads(r) for r in Path(meta[FRAMES]["annotation"]).read_text().splitlines()]
    meta[FRAMES]["annotation"] = str(folder / f"{FRAMES}.jsonl")
    Path(meta[FRAMES]["annotation"]).write_text("".join(
        json.dumps(r | {"video": r["video"] + r["video"][-2::-1]}) + "\n" for r in rows))
    (folder / "meta.json").write_text(json.dumps(meta))
    overrides = (f"data.train.data_path={folder / 'meta.json'}", f"model.hf_path={model}", *MEDIA_RUN)
    straight, resumed = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    run_args = ("train.py", "configs/tiny.toml", *overrides)
    run = torchrun(*run_args, f"checkpoint.dir={straight}", nproc=1, env=env)
    assert "30 train pairs" in run.stdout  # 12 video, 12 image, 6 audio
    shutil.rmtree(resumed)
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_4", ".lock"))
    again = torchrun(*run_args, f"checkpoint.dir={resumed}", nproc=1, env=env)
    assert "resumed from" in again.stdout
    return straight, resumed, overrides, env


def test_step_one_is_the_closed_form_and_the_media_towers_train(runs, monkeypatch):
    """Policy = reference at step 1: DPO ln 2, BCO 2 ln 2 (delta 0), loss w_p·ln 2 + w_q·2 ln 2 (configs/tiny.toml's
    0.8 and 0.2); after 4 steps the ViT's video embedder and the sound encoder and projection have moved from the
    checkpoint's. EVS pruned: the run's index (its cache, hit again) holds each video's kept tokens, fewer than its
    tubelets', and at step 1's weights EVS keeps a frame list's tokens in other chunks than the row's first-fill."""
    from safetensors import safe_open

    import config
    import distributed
    import mmpr_index
    import mmpr_media
    import omni_model
    import pack

    straight, _, overrides, env = runs
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_DATASETS_CACHE", env["HF_DATASETS_CACHE"])
    cfg = config.load_config(ROOT / "configs" / "tiny.toml", overrides)
    processor = mmpr_index.load_processor(cfg.model.hf_path, "model.hf_path")
    mmpr_media.apply_video_settings(processor, cfg.data.video)
    index = mmpr_index.build_index(cfg.data.train.data_path, processor, cfg.data)
    assert index.cache_status == "hit"
    assert sorted(t for t in index.video_tokens.tolist() if t) == [8] * 8 + [12] * 4  # of 12 and 18
    assert (pack.video_sequence_tokens(2, 6, RATE), pack.video_sequence_tokens(3, 6, RATE)) == (8, 12)
    distributed.init_distributed()
    model = omni_model.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
    spec = json.loads(Path(cfg.data.train.data_path).read_text())[FRAMES]
    first = json.loads(Path(spec["annotation"]).read_text().splitlines()[0])
    frames, _ = mmpr_media.load_frames([str(Path(spec["root"]) / f) for f in first["video"]], processor, 32)
    pixels, grid, n = mmpr_media.video_pixels(processor, frames)
    assert grid.tolist() == [[5, 4, 6]] and n == 6
    with torch.no_grad():
        feats = model.encode_media(None, None, pixels, grid)[1][0]
    per_chunk = torch.bincount(omni_model.evs_keep(feats, 3, RATE) // n, minlength=3).tolist()
    assert sum(per_chunk) == 12 and per_chunk[0] == 6 and per_chunk != [6, 6, 0], per_chunk

    rows = _rows(straight)
    assert rows[0]["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-6)
    assert rows[0]["loss"] == pytest.approx(0.8 * math.log(2) + 0.2 * 2 * math.log(2), abs=1e-6)
    state = dict(_loaded_state(straight / "step_4", *overrides))
    with safe_open(ROOT / "assets" / "tiny-omni" / "model.safetensors", "pt") as f:
        for ours, hub in (("vision_model.video_embedder.weight",
                           "vision_model.radio_model.model.patch_generator.video_embedder.weight"),
                          ("sound_encoder.encoder.layers.0.feed_forward1.linear1.weight",) * 2,
                          ("sound_projection.encoder.linear_fc1.weight", "sound_projection.linear1.weight")):
            assert not torch.equal(state[f"param {ours}"], f.get_tensor(hub)), ours


def test_resume_two_plus_two_equals_four_bit_for_bit(runs):
    straight, resumed, overrides, _ = runs
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in KEYS} == {k: y[k] for k in KEYS}, x["step"]
    one, two = _loaded_state(straight / "step_4", *overrides), _loaded_state(resumed / "step_4", *overrides)
    assert [k for k, _ in one] == [k for k, _ in two]
    for (k, x), (_, y) in zip(one, two, strict=True):
        assert torch.equal(x, y), k


def test_export_loads_in_transformers_with_our_logits_on_video_and_audio_prompts(runs, tmp_path):
    """hf_export.py of step 4 (config.json's video_pruning_rate carried over); transformers' NemotronH_Omni loads it
    and its fp32 logits on a video prompt (its get_video_features given to forward as one [T, n, H] tensor, which its
    EVS reads) and on an audio prompt equal the trained model's (<= 1e-4, as for images); the checkpoint's own logits
    differ (training moved them). The video: 5 frames on a 4x4 tile (transformers' EVS takes the tile square), 3
    tubelets of 4 tokens; transformers prunes the processor's 12 to 8, our sequence holds 8 first-filled (the data
    reader's layout) and EVS keeps other chunks' tokens."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import checkpoint
    import config
    import distributed
    import omni_model

    straight, _, overrides, _ = runs
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "hf_export.py", str(straight / "step_4"), str(out)], cwd=ROOT,
                          env=dict(os.environ, TORCHDYNAMO_DISABLE="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert json.loads((out / "config.json").read_text())["video_pruning_rate"] == RATE
    distributed.init_distributed()
    cfg = config.load_config(ROOT / "configs" / "tiny.toml", overrides)
    ours = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    checkpoint.load(straight / "step_4", ours)
    ours.eval()
    exported = NemotronH_Omni_Reasoning_V3.from_pretrained(out).eval()
    original = NemotronH_Omni_Reasoning_V3.from_pretrained(ROOT / cfg.model.hf_path).eval()
    assert exported.video_pruning_rate == original.video_pruning_rate == RATE
    v, a = video_text_inputs(5, size=(64, 64), patches=16), media_text_inputs(1)
    ids = v["input_ids"][0]
    placeholders = torch.nonzero(ids == ours.image_token_id).flatten()
    assert v["video_grid_thw"].tolist() == [[5, 4, 4]] and placeholders.numel() == 12
    row = ids[torch.isin(torch.arange(ids.numel()), placeholders[8:], invert=True)][None]
    with torch.no_grad():
        feats = ours.encode_media(None, None, v["video_patches"], v["video_grid_thw"])[1][0]
        mine = {"video": ours({"input_ids": row, "pixel_values_videos": v["video_patches"],
                               "video_grid_thw": v["video_grid_thw"]}),
                "audio": ours({"input_ids": a["input_ids"], **audio_batch_fields(a)})}
        for hf in (exported, original):
            tubelets = hf.get_video_features(v["pixel_values_videos"]).pooler_output  # [3, 4, H]
            video = BaseModelOutputWithPooling(pooler_output=(tubelets,))
            theirs = {"video": hf(input_ids=v["input_ids"], mm_encoder_outputs={"video": video}).logits[0],
                      "audio": hf(input_ids=a["input_ids"], input_features=a["input_features"],
                                  input_features_mask=a["input_features_mask"]).logits[0]}
            assert theirs["video"].shape[0] == row.shape[1] == ids.numel() - 4
            for prompt, logits in theirs.items():
                d = (mine[prompt] - logits).abs().max().item()
                assert d <= 1e-4 if hf is exported else d > 1e-4, (prompt, d)
    per_chunk = torch.bincount(omni_model.evs_keep(feats, 3, RATE) // 4, minlength=3).tolist()
    assert per_chunk[0] == 4 and per_chunk != [4, 4, 0], per_chunk


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

"""The sound path: parity of audio rows (and of one row mixing an image, a clip and a video) with transformers, packed =
unpacked with clips, the hub mapping of the sound encoder, the freeze switches.

Run: `pytest tests/test_audio.py` (CPU, fp32, in-process world of size 1; about 30 s). The reference is transformers'
`NemotronH_Omni_Reasoning_V3` loaded from the same files; audio inputs are generated tones (omni_model_cases.tone).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import raises_naming  # noqa: E402
from omni_model_cases import TINY, audio_batch_fields, media_text_inputs, tone  # noqa: E402

PARITY = 1e-4  # logits max-abs vs transformers, as for images
INVARIANCE = 1e-5  # packed = unpacked
SOUND_TOKEN = 27  # <so_embedding>


@pytest.fixture(scope="module")
def world():
    import distributed

    distributed.init_distributed()


@pytest.fixture(scope="module")
def model(world):
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    m = om.build_model(TINY, ModelConfig(), ParallelConfig())
    m.load_report = hf_weights.load_hf_weights(m, TINY)
    return m.eval()


@pytest.fixture(scope="module")
def reference():
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    return NemotronH_Omni_Reasoning_V3.from_pretrained(TINY).eval()


@pytest.mark.parametrize("n_audio,image", [(1, False), (2, True)])
def test_audio_logits_match_transformers(model, reference, n_audio, image):
    """An audio row, and a row mixing an image with two clips of different lengths (transformers pads them into one
    batch; ours encodes each at its own length)."""
    b = media_text_inputs(n_audio, image)
    ids = b["input_ids"]
    ours_in = {"input_ids": ids, **audio_batch_fields(b)}
    if image:
        ours_in.update(pixel_values=b["pixel_values"], image_grid_hw=b["image_grid_hw"])
    with torch.no_grad():
        ref = reference(**b).logits[0]
        ours = model(ours_in)
        no_audio = model({**ours_in, "input_ids": ids.masked_fill(ids == SOUND_TOKEN, 100),
                          "audio_lens": torch.zeros(0, 2, dtype=torch.int64)})
    assert (ours - ref).abs().max().item() <= PARITY
    assert (no_audio - ref).abs().max().item() > 1e-2  # the clips' features matter


def test_image_video_and_audio_row_logits_match_transformers(model, reference):
    """One prompt holding the chart image, a clip and a 3-frame video (2 tubelets). transformers' forward places image
    and video features on the same `<image>` token and takes only one of them per call: the reference is its
    get_image_features and get_video_features in prompt order (image, then tubelets) given as the image features of
    `forward`, whose audio tower encodes the clip."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    b = media_text_inputs(1, image=True, video_frames=3)
    ids = b["input_ids"]
    assert int((ids == 18).sum()) == 60 + 2 * 6 and int((ids == SOUND_TOKEN).sum()) == 7
    with torch.no_grad():
        image = reference.get_image_features(b["pixel_values"], b["image_grid_hw"]).pooler_output
        tubelets = reference.get_video_features(b["pixel_values_videos"]).pooler_output
        both = BaseModelOutputWithPooling(pooler_output=(*image, *tubelets))
        ref = reference(input_ids=ids, input_features=b["input_features"],
                        input_features_mask=b["input_features_mask"], mm_encoder_outputs={"image": both}).logits[0]
        ours = model({"input_ids": ids, "pixel_values": b["pixel_values"], "image_grid_hw": b["image_grid_hw"],
                      "pixel_values_videos": b["video_patches"], "video_grid_thw": b["video_grid_thw"],
                      **audio_batch_fields(b)})
        swapped = BaseModelOutputWithPooling(pooler_output=(*image, *tubelets.flip(0)))  # the tubelets' order matters
        wrong = reference(input_ids=ids, input_features=b["input_features"],
                          input_features_mask=b["input_features_mask"],
                          mm_encoder_outputs={"image": swapped}).logits[0]
    assert (ours - ref).abs().max().item() <= PARITY
    assert (ours - wrong).abs().max().item() > 1e-2


def _audio_pair_batch(seed: int) -> dict:
    """Two padded rows (lengths 30 and 37), each with its own clip (0.3 s: 4 tokens; 0.5 s: 7 tokens) at position 3."""
    from transformers import AutoProcessor

    fe = AutoProcessor.from_pretrained(TINY).feature_extractor
    g = torch.Generator().manual_seed(seed)
    ids, cu, cu_pad, feats, lens = [], [0], [0], [], []
    for n, secs in ((30, 0.3), (37, 0.5)):
        out = fe([tone(secs, 440.0, seed=n)], sampling_rate=16000, return_tensors="pt")
        frames, valid = out.input_features.shape[1], int(out.attention_mask.sum())
        n_tok = {0.3: 4, 0.5: 7}[secs]
        row = torch.randint(32, 1000, (n,), generator=g)
        row[2], row[3:3 + n_tok], row[3 + n_tok] = 25, SOUND_TOKEN, 26
        pad = -(-n // 8) * 8
        ids.append(torch.cat([row, torch.zeros(pad - n, dtype=torch.int64)]))
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + pad)
        feats.append(out.input_features[0])
        lens.append([frames, valid])
    return {"input_ids": torch.cat(ids)[None], "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32), "audio_features": torch.cat(feats),
            "audio_lens": torch.tensor(lens), "media_index": torch.tensor([0, 1]),
            "media_audio_offsets": torch.tensor([0, 1, 2])}


def test_packed_equals_unpacked_with_audio(model):
    batch = _audio_pair_batch(3)
    f0 = int(batch["audio_lens"][0, 0])
    with torch.no_grad():
        packed = model(batch)
        for s, (feat, lens) in enumerate(((batch["audio_features"][:f0], batch["audio_lens"][:1]),
                                          (batch["audio_features"][f0:], batch["audio_lens"][1:]))):
            a, b = batch["cu_seqlens_padded"][s:s + 2].tolist()
            n = int(batch["cu_seqlens"][s + 1] - batch["cu_seqlens"][s])
            alone = model({"input_ids": batch["input_ids"][:, a:b], "audio_features": feat, "audio_lens": lens,
                           "cu_seqlens": torch.tensor([0, n], dtype=torch.int32),
                           "cu_seqlens_padded": torch.tensor([0, b - a], dtype=torch.int32)})
            assert (packed[a:a + n] - alone[:n]).abs().max().item() <= INVARIANCE


def test_sound_token_count_mismatch_names_both_counts(model):
    batch = _audio_pair_batch(4)
    batch["media_audio_offsets"] = torch.tensor([0, 2, 2])  # both clips (11 features) on the chosen row (4 tokens)
    with raises_naming(ValueError, "sequence 0", "4 <so_embedding>", "11 features"), torch.no_grad():
        model(batch)


def test_sound_encoder_is_mapped_and_stays_in_eval_mode(model):
    """Every hub sound key but NeMo's featurizer buffers has a place in the model (BatchNorm statistics included);
    train() leaves the encoder's BatchNorm on its running statistics."""
    assert model.load_report["untouched"]["sound_encoder.encoder.feature_extractor."] == 2
    assert not any(k.startswith(("sound_encoder.encoder.layers", "sound_projection.")) for k in model.hf_untouched_keys)
    bn = model.sound_encoder.encoder.layers[0].conv.norm
    from safetensors import safe_open

    with safe_open(TINY / "model.safetensors", "pt") as f:
        assert torch.equal(bn.running_var, f.get_tensor("sound_encoder.encoder.layers.0.conv.norm.running_var"))
    try:
        model.train()
        assert model.language_model.training and not bn.training and not model.sound_encoder.encoder.training
    finally:
        model.eval()


def test_freeze_sound_switches(world):
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    m = om.build_model(TINY, ModelConfig(freeze_sound_encoder=True), ParallelConfig())
    trainable = {n.split(".")[0] for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {"language_model", "vision_model", "vision_projection", "sound_projection"}
    m = om.build_model(TINY, ModelConfig(freeze_sound_projector=True), ParallelConfig())
    assert "sound_projection" not in {n.split(".")[0] for n, p in m.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------------------------------------------------
# data: the generated sample (data/mmpr_sample/MMPR-audio) against the processor


AUDIO_META = TINY.parents[1] / "data" / "mmpr_sample" / "MMPR-audio" / "meta.json"


def test_audio_records_are_what_the_processor_makes(tmp_path, monkeypatch):
    """Every generated pair is valid (resampled 8 kHz and 22.05 kHz stereo clips included); each audio row's prompt
    tokens are the processor's own expansion of the rendered prompt with the clips (and image) decoded as
    transformers' load_audio does, and its mel features are the processor's."""
    from PIL import Image
    from transformers import AutoProcessor
    from transformers.audio_utils import load_audio

    import mmpr_data
    import mmpr_index
    from config import Config

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    proc = AutoProcessor.from_pretrained(TINY)
    index = mmpr_index.build_index(AUDIO_META, proc, Config().data, use_cache=False)
    assert len(index) == 18 and mmpr_index.summary_drops(index) == {}
    ds = mmpr_data.PairDataset(index, proc)
    audio_pairs = [i for i in range(len(index)) if index.num_audio[i]]
    assert len(audio_pairs) == 6 and sorted(index.num_audio[audio_pairs].tolist()) == [1, 1, 1, 1, 1, 2]
    for i in audio_pairs:
        pair = ds[i]
        prompt, _, _, images, _, clips = ds._record_text(i)
        waves = [load_audio(p, sampling_rate=16000) for p in clips]
        ref = proc(text=[prompt], audio=waves, images=[Image.open(p) for p in images] or None, return_tensors="pt")
        n = ref["input_ids"].shape[1]
        assert pair.chosen_ids[:n].tolist() == ref["input_ids"][0].tolist(), index.source(i)
        assert int((pair.chosen_ids == SOUND_TOKEN).sum()) == int(pair.audio_token_counts.sum())
        assert pair.audio_lens[:, 1].tolist() == ref["input_features_mask"].sum(-1).tolist()
        if len(clips) == 1:
            assert torch.equal(pair.audio_features, ref["input_features"][0])


def test_frozen_sound_towers_get_no_gradient_buffer_or_optimizer_state(world):
    import omni_model as om
    import train
    from config import Config

    cfg = Config()
    cfg.model.freeze_sound_encoder = cfg.model.freeze_sound_projector = True
    policy = om.build_model(TINY, cfg.model, cfg.parallel)
    ddp, opt, _ = train.build_optimizer(policy, cfg)
    sound = {id(p) for m in (policy.sound_encoder, policy.sound_projection) for p in m.parameters()}
    in_buffers = {id(p) for b in ddp.buffers for p in b.params}
    assert sound and not sound & in_buffers
    assert {id(p) for p in policy.vision_model.parameters()} <= in_buffers  # the other towers train
    # the optimizer's (fp32 main) parameters cover exactly the trainable elements, the sound towers' none
    optimized = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert optimized == sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert optimized == sum(p.numel() for p in policy.parameters()) - sum(
        p.numel() for m in (policy.sound_encoder, policy.sound_projection) for p in m.parameters())


# ----------------------------------------------------------------------------------------------------------------------
# training on image + audio pairs


AUDIO_RUN = ["data.train.data_path=data/mmpr_sample/MMPR-audio/meta.json", "mpo.max_num_steps=4",
             "data.train.split_validation_size=0", "mpo.val_at_end=false", "checkpoint.save_period=4",
             "model.deterministic_mode=true"]


@pytest.fixture(scope="module")
def audio_runs(torchrun, tmp_path_factory):
    """The tiny config on the image + audio sample, DP = 2: 4 steps straight, and 2 + 2 in two segments."""
    env = {"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf_cache"))}
    straight, segments = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("segments")

    def run(run_dir, *more):
        torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", *AUDIO_RUN, *more, env=env)

    run(straight)
    run(segments, "mpo.stop_after_step=2")
    run(segments)
    rows = {d: [json.loads(r) for r in (d / "metrics.jsonl").read_text().splitlines()] for d in (straight, segments)}
    return straight, segments, rows


def test_image_and_audio_pairs_train_and_resume_bit_for_bit(audio_runs):
    from test_train import _loaded_state

    straight, segments, rows = audio_runs
    first = rows[straight][0]
    assert first["preference_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-5)
    assert first["loss"] == pytest.approx(0.8 * math.log(2) + 0.2 * 2 * math.log(2), abs=1e-5)
    assert [r["step"] for r in rows[segments]] == [1, 2, 3, 4]
    keys = ("loss", "preference_loss", "bco_loss", "accuracy", "rewards/margin", "grad_norm", "consumed_pairs")
    for a, b in zip(rows[straight], rows[segments], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    state = dict(_loaded_state(straight / "step_4", *AUDIO_RUN))
    resumed = dict(_loaded_state(segments / "step_4", *AUDIO_RUN))
    assert state.keys() == resumed.keys()
    for k in state:
        assert torch.equal(state[k], resumed[k]), k
    # the sound towers trained: their weights moved from the checkpoint's
    from safetensors import safe_open

    with safe_open(TINY / "model.safetensors", "pt") as f:
        for name, hub in (("sound_encoder.encoder.layers.0.feed_forward1.linear1.weight",) * 2,
                          ("sound_projection.encoder.linear_fc1.weight", "sound_projection.linear1.weight")):
            assert not torch.equal(state[f"param {name}"], f.get_tensor(hub)), name


def test_bf16_model_encodes_audio_with_bf16_statistics(world):
    """torch's BatchNorm wants its statistics in the input's dtype: a bf16 model carries them in bf16 (as
    transformers' model.to(bfloat16)), loaded from the fp32 checkpoint by rounding."""
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    m = om.build_model(TINY, ModelConfig(params_dtype="bfloat16"), ParallelConfig())
    hf_weights.load_hf_weights(m, TINY)
    bn = m.sound_encoder.encoder.layers[0].conv.norm
    assert bn.running_var.dtype == bn.weight.dtype == torch.bfloat16 and bn.num_batches_tracked.dtype == torch.int64
    b = media_text_inputs(1)
    with torch.no_grad():
        logits = m({"input_ids": b["input_ids"], **audio_batch_fields(b)})
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())


def test_an_unsupported_sound_config_is_one_error_naming_it(tmp_path):
    import omni_model as om

    cfg = json.loads((TINY / "config.json").read_text())
    cfg["sound_config"]["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with raises_naming(ValueError, f"{tmp_path / 'config.json'}: sound_config", "silu"):
        om.read_hf_config(tmp_path)

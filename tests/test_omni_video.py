"""omni_model's video path: parity with transformers on video rows, packing with images and video (and the
shared-prompt format), the video embedder's import / export.

Run: `pytest tests/test_omni_video.py` (CPU, fp32, one in-process world of size 1; about 40 s alone). transformers
5.23's `NemotronH_Omni_Reasoning_V3.forward(pixel_values_videos=...)` fails on its own `get_video_features` output
(a tensor given to torch.cat): the reference here is its `get_video_features` passed to `forward` as
`mm_encoder_outputs`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import raises_naming  # noqa: E402
from omni_model_cases import TINY, video_patch_rows, video_text_inputs  # noqa: E402

PARITY = 1e-4  # logits max-abs vs transformers, as for images (tests/test_omni_model.py)
INVARIANCE = 1e-5  # packed = unpacked


@pytest.fixture(scope="module")
def model():
    import distributed
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    distributed.init_distributed()
    m = om.build_model(TINY, ModelConfig(), ParallelConfig())
    hf_weights.load_hf_weights(m, TINY)
    return m.eval()


@pytest.fixture(scope="module")
def reference():
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    return NemotronH_Omni_Reasoning_V3.from_pretrained(TINY).eval()


def _reference_logits(reference, b) -> torch.Tensor:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    tubelets = reference.get_video_features(b["pixel_values_videos"]).pooler_output  # [n_tubelets, tokens, H]
    video = BaseModelOutputWithPooling(pooler_output=tuple(tubelets))
    return reference(input_ids=b["input_ids"], mm_encoder_outputs={"video": video}).logits[0]


@pytest.mark.parametrize("frames", [1, 3])
def test_video_text_logits_match_transformers(model, reference, frames):
    """A video of 1 or 3 frames (the last frame repeated to whole 2-frame tubelets) on a non-square 4x6 tile."""
    b = video_text_inputs(frames)
    tubelets = -(-frames // 2)
    assert b["video_grid_thw"].tolist() == [[frames, 4, 6]]
    assert int((b["input_ids"] == 18).sum()) == tubelets * 6  # one <img> chunk of 4·6/4 tokens per tubelet
    with torch.no_grad():
        ref = _reference_logits(reference, b)
        ours = model({"input_ids": b["input_ids"], "pixel_values_videos": b["video_patches"],
                      "video_grid_thw": b["video_grid_thw"]})
        # the same frames as images (the image embedder, no tubelets): other features
        as_images = model({"input_ids": b["input_ids"], "pixel_values": b["video_patches"][:24 * tubelets],
                           "image_grid_hw": torch.tensor([[4, 6]] * tubelets)})
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= PARITY
    assert (as_images - ref).abs().max().item() > 1e-2


def _mixed_pair(seed: int) -> dict:
    """One pair (chosen 30, rejected 41 tokens, padded to 8) sharing a media slot of one 4x6 image (6 tokens) then one
    3-frame 4x4 video (2 tubelets x 4 tokens): the rows' <image> runs are the image's, then the video's."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in (30, 41):
        body = torch.randint(32, 1000, (n,), generator=g)
        body[2:8] = 18
        body[10:14] = 18
        body[16:20] = 18
        rows.append(body)
    ids, cu, cu_pad = [], [0], [0]
    for r in rows:
        n_pad = -(-r.numel() // 8) * 8
        ids.append(torch.cat([r, torch.zeros(n_pad - r.numel(), dtype=torch.int64)]))
        cu.append(cu[-1] + r.numel())
        cu_pad.append(cu_pad[-1] + n_pad)
    return {
        "input_ids": torch.cat(ids)[None], "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32),
        "pixel_values": torch.randn(24, 768, generator=g), "image_grid_hw": torch.tensor([[4, 6]]),
        "pixel_values_videos": video_patch_rows(torch.randn(3, 3, 64, 64, generator=g)),
        "video_grid_thw": torch.tensor([[3, 4, 4]]),
        "media_index": torch.tensor([0, 0]), "media_image_offsets": torch.tensor([0, 1]),
        "media_video_offsets": torch.tensor([0, 1]),
    }


def test_packed_image_and_video_equal_each_row_alone(model):
    """Two rows sharing an image + video slot in one THD row give the logits of each row run alone (flat, no slots:
    the image's features, then the video's), and the video's features matter."""
    batch = _mixed_pair(seed=4)
    media = {k: batch[k] for k in ("pixel_values", "image_grid_hw", "pixel_values_videos", "video_grid_thw")}
    with torch.no_grad():
        packed = model(batch)
        for s in range(2):
            a, b = batch["cu_seqlens_padded"][s:s + 2].tolist()
            n = int(batch["cu_seqlens"][s + 1] - batch["cu_seqlens"][s])
            alone = model({"input_ids": batch["input_ids"][:, a:b]} | media)
            assert (packed[a:a + n] - alone[:n]).abs().max().item() <= INVARIANCE
        other = model(batch | {"pixel_values_videos": batch["pixel_values_videos"].flip(0)})
    assert (other - packed).abs().max().item() > 1e-3


def test_video_token_count_mismatch_and_pruning_are_errors(model):
    batch = _mixed_pair(seed=4)
    with raises_naming(ValueError, "sequence 0: ", "13 <image> tokens", "media slot 0 gives 14"):
        model(batch | {"input_ids": batch["input_ids"].masked_fill(torch.arange(batch["input_ids"].shape[1]) == 2,
                                                                     100)})
    with raises_naming(ValueError, "pixel_values_videos", "48 patch rows", "need 32"):
        model(batch | {"video_grid_thw": torch.tensor([[2, 4, 4]])})
    model.hf.video_pruning_rate = 0.7
    try:
        with raises_naming(ValueError, "video_pruning_rate", "0.7"):
            model(batch)
    finally:
        model.hf.video_pruning_rate = 0.0


def test_video_embedder_is_loaded_and_exported_exactly(model, tmp_path):
    """The video embedder is a mapped weight: loaded from the checkpoint's patch_generator.video_embedder, and what
    the model holds (here changed) is what export writes, read back bit for bit."""
    from safetensors import safe_open

    import hf_weights

    key = "vision_model.radio_model.model.patch_generator.video_embedder.weight"
    w = model.vision_model.video_embedder.weight
    with safe_open(TINY / "model.safetensors", "pt") as f:
        assert torch.equal(w, f.get_tensor(key))
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(-2.0)
        hf_weights.export_hf(model, tmp_path, TINY)
        with safe_open(tmp_path / "model.safetensors", "pt") as f:
            assert torch.equal(f.get_tensor(key), w.detach())
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert not any(k.startswith(key.rsplit(".", 1)[0]) for k in model.hf_untouched_keys)


def _with_video(p, seed: int):
    """pack.PreferencePair `p` with a 3-frame video of 4x4-patch frames (2 tubelets x 4 tokens) at the end of its
    prompt, after its image's tokens."""
    import pack

    n_prompt = int((~p.chosen_loss_mask).sum())
    chunk = torch.tensor([21] + [18] * 8 + [22])
    rows = [torch.cat([r[:n_prompt], chunk, r[n_prompt:]]) for r in (p.chosen_ids, p.rejected_ids)]
    masks = [torch.cat([m[:n_prompt], torch.zeros(10, dtype=torch.bool), m[n_prompt:]])
             for m in (p.chosen_loss_mask, p.rejected_loss_mask)]
    frames = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(seed))
    return pack.PreferencePair(pair_id=p.pair_id, chosen_ids=rows[0], rejected_ids=rows[1], chosen_loss_mask=masks[0],
                               rejected_loss_mask=masks[1], pixel_values=p.pixel_values, image_grid_hw=p.image_grid_hw,
                               image_token_counts=p.image_token_counts, pixel_values_videos=video_patch_rows(frames),
                               video_grid_thw=torch.tensor([[3, 4, 4]]), video_token_counts=torch.tensor([8]))


def test_shared_prompt_format_with_video_equals_separate_rows(model):
    """Pairs with image + video, video only, image only and text only in one bin: the shared-prompt format (each
    prompt and its media once) gives the separate rows' log-probs, MPO metrics and every gradient, the video
    embedder's included (tests/test_shared_prompt_model.py's check)."""
    from shared_prompt_cases import make_pairs, max_differences, mpo_step
    from step_cases import tiny_config

    import distributed

    ctx = distributed.Ctx.current(tiny_config("packing.shared_prompt=true"), torch.device("cpu"))
    pairs = make_pairs()
    pairs[0], pairs[1] = _with_video(pairs[0], 1), _with_video(pairs[1], 2)
    model.train()
    try:
        d = max_differences(mpo_step(model, ctx, [pairs], shared=False), mpo_step(model, ctx, [pairs], shared=True))
        assert d["num_response_tokens_equal"] and d["grad_names_differ"] == []
        assert d["logprobs"] <= INVARIANCE and max(d["metrics"].values()) <= INVARIANCE, d
        assert d["grad"] <= INVARIANCE, (d["grad"], d["grad_param"])
        assert d["n_grads"] == sum(p.requires_grad for n, p in model.named_parameters()
                                   if not n.startswith(("sound_encoder.", "sound_projection.")))  # no audio here
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)

"""omni_model's video path: parity with transformers on video sequences, with and without EVS (video_pruning_rate),
packing with images and video (and the shared-prompt format), the video embedder's import / export.

Run: `pytest tests/test_omni_video.py` (CPU, fp32, one in-process world of size 1; about 50 s alone). transformers
5.23's `NemotronH_Omni_Reasoning_V3.forward(pixel_values_videos=...)` fails on its own `get_video_features` output
(a tensor given to torch.cat): the reference here is its `get_video_features` passed to `forward` as
`mm_encoder_outputs`, one [tubelets, n, H] tensor in a 1-tuple (the shape its EVS reads).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import raises_naming  # noqa: E402
from omni_model_cases import TINY, video_patch_rows, video_text_inputs  # noqa: E402
from step_cases import DeviceAudit  # noqa: E402

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
    video = BaseModelOutputWithPooling(pooler_output=(tubelets,))
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


@pytest.mark.parametrize("rate", [0.7, 0.5])
def test_evs_logits_match_transformers(model, rate):
    """EVS at video_pruning_rate 0.7 / 0.5 on a 10-frame video (5 tubelets of a 4x4 tile, 4 tokens each): our sequence
    holds the kept count max(4, int(20·(1 - q))) of `<image>` tokens in the first chunks (the data reader's layout), the
    processor's sequence all 20; the logits equal transformers' on its pruned sequence. EVS keeps tokens of later
    tubelets, so the layout the model rebuilds differs from the sequence's."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import omni_model as om
    import pack

    b = video_text_inputs(10, size=(64, 64), patches=16)
    assert b["video_grid_thw"].tolist() == [[10, 4, 4]]
    n_kept = pack.video_sequence_tokens(5, 4, rate)
    assert n_kept == {0.7: 6, 0.5: 10}[rate]
    ids = b["input_ids"][0]
    placeholders = torch.nonzero(ids == 18).flatten()
    assert placeholders.numel() == 20
    ours_ids = ids[torch.isin(torch.arange(ids.numel()), placeholders[n_kept:], invert=True)][None]
    reference = NemotronH_Omni_Reasoning_V3.from_pretrained(TINY, video_pruning_rate=rate).eval()
    model.hf.video_pruning_rate = rate
    try:
        with torch.no_grad():
            ref = _reference_logits(reference, b)
            ours = model({"input_ids": ours_ids, "pixel_values_videos": b["video_patches"],
                          "video_grid_thw": b["video_grid_thw"]})
            feats = model.encode_media(None, None, b["video_patches"], b["video_grid_thw"])[1][0]
    finally:
        model.hf.video_pruning_rate = 0.0
    assert ours.shape == ref.shape == (ids.numel() - 20 + n_kept, ref.shape[1])
    assert (ours - ref).abs().max().item() <= PARITY
    assert om.evs_keep(feats, 5, rate).tolist() != list(range(n_kept))


@pytest.mark.parametrize("rate", [0.7, 0.5, 0.3])
def test_evs_keep_is_transformers_retention_mask(rate):
    """evs_keep = transformers' compute_retention_mask on one video's features (6 tubelets of a 4x4 grid of tokens, the
    fourth a copy of the third: dissimilarity about 0), and on a non-square 2x3 grid given to transformers as its
    real (T, 2, 3)."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import compute_retention_mask

    import omni_model as om

    g = torch.Generator().manual_seed(0)
    for h, w in ((4, 4), (2, 3)):
        x = torch.randn(6, h * w, 16, generator=g)
        x[3] = x[2]
        ref = compute_retention_mask(video_embeds=x.reshape(-1, 16), thw=(6, h, w), spatial_merge_size=1, q=rate)
        assert om.evs_keep(x.reshape(-1, 16), 6, rate).tolist() == torch.nonzero(ref).flatten().tolist()


def _mixed_pair(seed: int) -> dict:
    """One pair (chosen 30, rejected 41 tokens, padded to 8) sharing a media slot of one 4x6 image (6 tokens) then one
    3-frame 4x4 video (2 tubelets x 4 tokens): the sequences' <image> runs are the image's, then the video's."""
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


def test_video_token_count_mismatch_and_evs_layout_are_errors(model):
    batch = _mixed_pair(seed=4)
    with raises_naming(ValueError, "sequence 0: ", "13 <image> tokens", "media slot 0 gives 14"):
        model(batch | {"input_ids": batch["input_ids"].masked_fill(torch.arange(batch["input_ids"].shape[1]) == 2,
                                                                     100)})
    with raises_naming(ValueError, "pixel_values_videos", "48 patch rows", "need 32"):
        model(batch | {"video_grid_thw": torch.tensor([[2, 4, 4]])})
    model.hf.video_pruning_rate = 0.5  # the 2-tubelet video keeps 4 of its 8 tokens
    try:
        with raises_naming(ValueError, "sequence 0: ", "14 <image> tokens", "media slot 0 gives 10"):
            model(batch)  # every video token in the row
        ids = batch["input_ids"].clone()
        ids[0, 16:20] = 100
        ids[0, 32 + 16:32 + 20] = 100
        with raises_naming(ValueError, "sequence 0: ", "video 0 needs 2 chunks", "4 <image>"):
            model(batch | {"input_ids": ids})  # 4 tokens but one run, not one <img> chunk per tubelet
    finally:
        model.hf.video_pruning_rate = 0.0


def _evs_slot(seed: int, frames: int, lens: tuple[int, int], rate: float) -> tuple[list[torch.Tensor], dict]:
    """(chosen and rejected rows of `lens` tokens, their slot's media): a 4x6 image's `<img>` chunk (6 tokens), then a
    `frames`-frame video of 4x4-patch frames as the data reader lays it out under EVS (per tubelet a 2-token label and
    an `<img>` chunk; the kept count of `<image>` tokens, pack.video_sequence_tokens, filling the first chunks), then
    text."""
    import pack

    g = torch.Generator().manual_seed(seed)
    tubelets = -(-frames // 2)
    left = pack.video_sequence_tokens(tubelets, 4, rate)
    prompt = [torch.randint(32, 1000, (3,), generator=g), torch.tensor([21] + [18] * 6 + [22])]
    for _ in range(tubelets):
        c = min(4, left)
        left -= c
        prompt += [torch.randint(32, 1000, (2,), generator=g), torch.tensor([21] + [18] * c + [22])]
    prompt = torch.cat(prompt)
    rows = [torch.cat([prompt, torch.randint(32, 1000, (n - prompt.numel(),), generator=g)]) for n in lens]
    media = {"pixel_values": torch.randn(24, 768, generator=g), "image_grid_hw": torch.tensor([[4, 6]]),
             "pixel_values_videos": video_patch_rows(torch.randn(frames, 3, 64, 64, generator=g)),
             "video_grid_thw": torch.tensor([[frames, 4, 4]])}
    return rows, media


def test_evs_packed_equals_each_row_alone(model):
    """Two pairs in one THD row, each slot an image and its own video (5 and 7 frames: 3 and 4 tubelets) pruned at
    0.5: each row's logits equal the row run alone with its slot's media. EVS is per video (a pair's kept tokens do not
    depend on the other videos of the bin), and the pruned video's frames matter. The forward keeps the device rule
    (tests/step_cases.DeviceAudit: no device value read on the host)."""
    slots = [_evs_slot(5, 5, (40, 47), 0.5), _evs_slot(6, 7, (52, 45), 0.5)]
    ids, cu, cu_pad = [], [0], [0]
    for rows, _ in slots:
        for r in rows:
            n_pad = -(-r.numel() // 8) * 8
            ids.append(torch.cat([r, torch.zeros(n_pad - r.numel(), dtype=torch.int64)]))
            cu.append(cu[-1] + r.numel())
            cu_pad.append(cu_pad[-1] + n_pad)
    media = [m for _, m in slots]
    batch = {"input_ids": torch.cat(ids)[None], "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
             "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32),
             **{k: torch.cat([m[k] for m in media]) for k in media[0]},
             "media_index": torch.tensor([0, 0, 1, 1]), "media_image_offsets": torch.tensor([0, 1, 2]),
             "media_video_offsets": torch.tensor([0, 1, 2])}
    model.hf.video_pruning_rate = 0.5
    audit = DeviceAudit("cpu", host=[SimpleNamespace(host=SimpleNamespace(**batch))])
    try:
        with torch.no_grad():
            with audit:
                packed = model(batch)
            for s in range(4):
                a, n = cu_pad[s], cu[s + 1] - cu[s]
                alone = model({"input_ids": batch["input_ids"][:, a:a + n]} | media[s // 2])
                assert (packed[a:a + n] - alone).abs().max().item() <= INVARIANCE
            other = model(batch | {"pixel_values_videos": batch["pixel_values_videos"].flip(0)})
    finally:
        model.hf.video_pruning_rate = 0.0
    assert (other - packed).abs().max().item() > 1e-3
    assert audit.calls and audit.violations == [] and audit.reads == []  # EVS's layout reads no device value


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


def _with_video(p, seed: int, evs: bool):
    """pack.PreferencePair `p` with a 3-frame video of 4x4-patch frames (2 tubelets x 4 tokens) at the end of its
    prompt, after its image's tokens; with evs=True a 5-frame one (3 tubelets) as laid out at video_pruning_rate 0.5
    (6 kept tokens in its 3 chunks)."""
    import pack

    n_prompt = int((~p.chosen_loss_mask).sum())
    chunk = torch.tensor([21, *[18] * 4, 22, 21, 18, 18, 22, 21, 22] if evs else [21] + [18] * 8 + [22])
    rows = [torch.cat([r[:n_prompt], chunk, r[n_prompt:]]) for r in (p.chosen_ids, p.rejected_ids)]
    masks = [torch.cat([m[:n_prompt], torch.zeros(chunk.numel(), dtype=torch.bool), m[n_prompt:]])
             for m in (p.chosen_loss_mask, p.rejected_loss_mask)]
    n_frames = 5 if evs else 3
    frames = torch.randn(n_frames, 3, 64, 64, generator=torch.Generator().manual_seed(seed))
    return pack.PreferencePair(pair_id=p.pair_id, chosen_ids=rows[0], rejected_ids=rows[1], chosen_loss_mask=masks[0],
                               rejected_loss_mask=masks[1], pixel_values=p.pixel_values, image_grid_hw=p.image_grid_hw,
                               image_token_counts=p.image_token_counts, pixel_values_videos=video_patch_rows(frames),
                               video_grid_thw=torch.tensor([[n_frames, 4, 4]]),
                               video_token_counts=torch.tensor([int((chunk == 18).sum())]))


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_shared_prompt_format_with_video_equals_separate_sequences(model, rate):
    """Pairs with image + video, video only, image only and text only in one bin: the shared-prompt format (each
    prompt and its media once) gives the separate sequences' log-probs, MPO metrics and every gradient, the video
    embedder's included (tests/test_shared_prompt_model.py's check); under EVS too."""
    from shared_prompt_cases import make_pairs, max_differences, mpo_step
    from step_cases import tiny_config

    import distributed

    ctx = distributed.Ctx.current(tiny_config("packing.shared_prompt=true"), torch.device("cpu"))
    pairs = make_pairs()
    pairs[0], pairs[1] = _with_video(pairs[0], 1, rate > 0), _with_video(pairs[1], 2, rate > 0)
    model.train()
    model.hf.video_pruning_rate = rate
    try:
        d = max_differences(mpo_step(model, ctx, [pairs], shared=False), mpo_step(model, ctx, [pairs], shared=True))
        assert d["num_response_tokens_equal"] and d["grad_names_differ"] == []
        assert d["logprobs"] <= INVARIANCE and max(d["metrics"].values()) <= INVARIANCE, d
        assert d["grad"] <= INVARIANCE, (d["grad"], d["grad_param"])
        assert d["n_grads"] == sum(p.requires_grad for n, p in model.named_parameters()
                                   if not n.startswith(("sound_encoder.", "sound_projection.")))  # no audio here
    finally:
        model.hf.video_pruning_rate = 0.0
        model.eval()
        model.zero_grad(set_to_none=True)

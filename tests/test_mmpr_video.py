"""The data reader's video records: the generated video sample (data/mmpr_video_sample) indexed and decoded as the
tiny checkpoint's processor gives it, and every video rule a counted, named drop.

Run: `pytest tests/test_mmpr_video.py` (CPU; about 30 s).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import raises_naming  # noqa: E402
from test_mmpr_data import TINY, data_cfg, record, rgb, write_set  # noqa: E402

import mmpr_data as md  # noqa: E402
import mmpr_index as mi  # noqa: E402
import mmpr_records as mr  # noqa: E402

VIDEO_META = Path(__file__).resolve().parents[1] / "data" / "mmpr_video_sample" / "MMPR-video-sample" / "meta.json"


def video_cfg(**overrides):
    cfg = data_cfg(**overrides)
    cfg.video.target_num_patches = 24  # 48x32 frames -> a 4x6-patch tile, 6 tokens per tubelet
    return cfg


@pytest.fixture(scope="module")
def processor():
    return mi.load_processor(TINY, "model.hf_path")


@pytest.fixture(scope="module")
def video_sample(processor, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("video_cache")))
        index = mi.build_index(VIDEO_META, processor, video_cfg())
    return index, md.PairDataset(index, processor)


def test_video_sample_is_indexed_with_the_processors_counts(video_sample):
    """4 clips (4 frames at 2 fps: 2 tubelets), 4 frame lists (3 frames: 2 tubelets, the last repeats), 4 records of an
    image + a clip; every tubelet a 4x6 tile = 6 tokens; the pairs' sequences hold images' + videos' <image> tokens."""
    index, ds = video_sample
    assert len(index) == 12 and mi.summary_drops(index) == {}
    assert index.video_frames.tolist() == [4] * 4 + [3] * 4 + [4] * 4
    assert index.video_grid_hw.tolist() == [[4, 6]] * 12 and index.video_tokens.tolist() == [12] * 12
    assert index.image_tokens.tolist() == [0] * 8 + [18] * 4
    for i in (0, 4, 8):
        p = ds[i]
        assert p.video_grid_thw.tolist() == [[int(index.video_frames[i]), 4, 6]]
        assert p.pixel_values_videos.shape == (int(index.video_frames[i]) * 24, 768)
        n_media = int(index.image_tokens[i] + index.video_tokens[i])
        assert int((p.chosen_ids == 18).sum()) == int((p.rejected_ids == 18).sum()) == n_media


def test_the_index_keeps_each_pairs_video_files_and_the_dataset_reads_the_same(video_sample, processor):
    """A clip record's one file, a frame list's frame images in order (what the stored reference values' stamps cover);
    a record whose video is no longer the index's is the changed-row DataError naming its annotation line."""
    import copy

    index, _ = video_sample
    media = VIDEO_META.parent / "media"
    assert index.videos(0) == [str(media / "clips" / "clip_0.mp4")]
    assert index.videos(5) == [str(media / "frames" / f"clip_1_{k}.png") for k in range(3)]
    assert index.videos(8) == [str(media / "clips" / "clip_0.mp4")] and index.images(8)
    assert index.media(8) == index.images(8) + index.videos(8)
    moved = copy.deepcopy(index)
    moved.video_paths = [p.replace("clip_0.mp4", "clip_9.mp4") for p in moved.video_paths]
    with pytest.raises(mr.DataError) as e:
        md.PairDataset(moved, processor)[0]
    assert index.source(0) in str(e.value) and "video_missing" in str(e.value)


def test_clip_record_equals_the_processors_own_output(video_sample, processor):
    """A clip record's prompt ids and pixels = the transformers processor called on the rendered prompt with the
    decoded frames and their metadata (timestamps in the frame labels)."""
    from transformers.video_utils import load_video

    index, ds = video_sample
    p = ds[0]
    prompt, *_ = ds._record_text(0)
    frames, metadata = load_video(str(VIDEO_META.parent / "media" / "clips" / "clip_0.mp4"), backend="pyav")
    ref = processor(text=prompt, videos=[frames], videos_kwargs={"video_metadata": metadata}, return_tensors="pt")
    n = int(index.prompt_len[0])
    assert torch.equal(p.chosen_ids[:n], ref["input_ids"][0])
    assert "sampled at 0.50 seconds" in processor.tokenizer.decode(ref["input_ids"][0])
    x = ref["pixel_values_videos"]  # [F, 3, 64, 96]
    pixels = x.reshape(4, 3, 4, 16, 6, 16).permute(0, 2, 4, 1, 3, 5).reshape(96, 768)
    assert torch.equal(p.pixel_values_videos, pixels)


def test_video_rules_are_counted_drops(tmp_path, processor):
    records = [
        record(0, video="clip.mp4", image=None, q="What moves?"),  # valid
        record(1, video="nope.mp4", image=None, q="What moves?"),  # video_missing
        record(2, video="empty.mp4", image=None, q="What moves?"),  # video_unreadable: zero bytes
        record(3, video="garbage.mp4", image=None, q="What moves?"),  # video_unreadable
        record(4, video=["a.png"] * 3, image=None, q="What moves?"),  # too_many_frames (max 2)
        record(5, video=["a.png", "wide.png"], image=None, q="What moves?"),  # video_unreadable: sizes differ
        record(6, video=5, image=None, q="What moves?"),  # missing_field
        record(7, video="clip.mp4", image=None, q="<video> then <video>?"),  # placeholder_mismatch: 2 for 1
        record(8, image=None, q="<video>\nWhat moves?"),  # placeholder_mismatch: no video
        record(9, video="clip.mp4", q="<video> vs <image>"),  # placeholder_mismatch: <image> after <video>
        record(10, video="clip.mp4", q="<image> and the clip?"),  # placeholder_mismatch: <image> but no <video>
        record(11, video=["a.png", "a.png"], q="Same square?"),  # valid: image + 2-frame list, placeholders added
        record(12, video="../clip.mp4", image=None, q="What moves?"),  # image_outside_root
    ]
    meta = write_set(tmp_path, records, {"a.png": rgb(), "wide.png": rgb(64, 40), "garbage.mp4": b"not a video",
                                      "empty.mp4": b""})
    sys.path.insert(0, str(VIDEO_META.parents[1]))
    from make_sample import frame, write_clip

    write_clip(meta.parent / "images" / "clip.mp4", [frame(i, "right", "red") for i in range(4)])
    cfg = video_cfg()
    cfg.video.max_frames = 2
    cfg.video.num_frames = 2  # the 4-frame clip sampled down to 2 frames: within max_frames
    index = mi.build_index(meta, processor, cfg, use_cache=False)
    st = index.stats["sub"]
    assert st["dropped"] == {"video_missing": 1, "video_unreadable": 3, "too_many_frames": 1, "missing_field": 1,
                             "placeholder_mismatch": 4, "image_outside_root": 1}
    assert index.line.tolist() == [1, 12] and index.video_frames.tolist() == [2, 2]
    assert index.image_tokens.tolist()[1] > 0 and index.video_tokens.tolist() == [6, 6]
    ex = st["drop_examples"]
    assert "nope.mp4 does not exist" in ex["video_missing"][0]
    unreadable = [e.split(": ", 1)[1] for e in ex["video_unreadable"]]
    assert unreadable[0].startswith(f"{meta.parent / 'images' / 'empty.mp4'}: ")
    assert unreadable[1].startswith(f"{meta.parent / 'images' / 'garbage.mp4'}: ")
    assert "sizes differ" in unreadable[2]
    assert ex["too_many_frames"][0].endswith("3 frames > data.video.max_frames = 2")
    ds = md.PairDataset(index, processor)
    p = ds[1]
    assert p.image_grid_hw.shape[0] == 1 and p.video_grid_thw.tolist()[0][0] == 2
    text = processor.tokenizer.decode(p.chosen_ids)
    assert text.index("</img>\nFrame 1 and frame 2: <img>") > 0  # the image, then the video, then the question


def test_video_settings_are_checked_and_reach_the_processor(processor):
    import config
    from mmpr_media import apply_video_settings

    cfg = config.Config()
    cfg.data.video.num_frames, cfg.data.video.fps = 4, 2.0
    with pytest.raises(config.ConfigError, match=r"data\.video\.num_frames = 4 and data\.video\.fps = 2\.0"):
        config.validate(cfg)
    cfg.data.video.fps = 0.0
    apply_video_settings(processor, cfg.data.video)
    vp = processor.video_processor
    assert (vp.num_frames, vp.fps) == (4, None)
    assert vp.norm_mean == list(processor.image_processor.image_mean)  # the tiny video processor has none
    assert mr.DROP_REASONS.index("too_many_frames") < mr.DROP_REASONS.index("template_rewrites_text")


def test_an_evs_checkpoint_indexes_and_runs_the_kept_video_tokens(video_sample, tmp_path):
    """A checkpoint with EVS (config.json's video_pruning_rate 0.7, the hub's) trains on video as is: the index counts
    the tokens a video keeps (2 tubelets of 6: max(6, int(12·0.3)) = 6), its records are the processor's without the
    video's last 6 `<image>` tokens (the first chunk full, the second empty), preflight takes the split, and the model
    runs a bin of a clip, a frame list and an image + clip pair."""
    import config
    import distributed
    import hf_weights
    import omni_model
    import pack
    import preflight

    index, ds = video_sample
    for f in TINY.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    hub = json.loads((TINY / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hub | {"video_pruning_rate": 0.7}))
    processor = mi.load_processor(tmp_path, "model.hf_path")
    evs = mi.build_index(VIDEO_META, processor, video_cfg(), use_cache=False)
    assert mi.summary_drops(evs) == {} and evs.video_tokens.tolist() == [6] * 12
    assert (index.prompt_len - evs.prompt_len).tolist() == [6] * 12
    pairs = [md.PairDataset(evs, processor)[i] for i in (0, 4, 8)]
    for i, p in zip((0, 4, 8), pairs, strict=True):
        full = ds[i].chosen_ids
        dropped = torch.nonzero(full == 18).flatten()[-6:]  # the video's <image> tokens come last
        assert torch.equal(p.chosen_ids, full[torch.isin(torch.arange(full.numel()), dropped, invert=True)])
        assert p.video_token_counts.tolist() == [6]
    assert "<img></img>" in processor.tokenizer.decode(pairs[0].chosen_ids)
    cfg = config.Config()
    cfg.model.hf_path, cfg.policy.train_global_batch_size, cfg.packing.shared_prompt = str(tmp_path), 4, False
    assert preflight.check_splits(mi.Split(evs, list(range(12))), None, cfg)[0].pair_ids == list(range(12))
    distributed.init_distributed()
    model = omni_model.build_model(tmp_path, config.ModelConfig(), config.ParallelConfig())
    hf_weights.load_hf_weights(model, tmp_path)
    assert model.hf.video_pruning_rate == 0.7
    batch = pack.pack(pairs, 8, 18)
    with torch.no_grad():
        logits = model.eval()(batch)
    assert logits.shape[0] == batch.input_ids.shape[1] and bool(torch.isfinite(logits).all())


def test_evs_expansion_fills_the_first_chunks(processor):
    """At video_pruning_rate 0.3 a 4-frame video of 6-token tubelets keeps max(6, int(12·0.7)) = 8 tokens: the
    prompt's chunks hold 6 and 2 (omni_model moves them where EVS keeps them)."""
    from mmpr_media import expand_video

    assert processor.video_pruning_rate == 0.0  # the tiny asset's config.json has none
    processor.video_pruning_rate = 0.3
    try:
        text, kept = expand_video(processor, "<video>\nWhat moves?", 4, 6, None)
    finally:
        processor.video_pruning_rate = 0.0
    assert kept == 8
    assert text == "Frame 1 and frame 2: <img>" + "<image>" * 6 + "</img>\nFrame 3 and frame 4: <img>" + \
        "<image>" * 2 + "</img>\nWhat moves?"


def test_index_cli_takes_the_video_settings(capsys):
    """`python mmpr_index.py META --model DIR --video-*`: the run's data.video settings, named by their flags."""
    assert mi.main([str(VIDEO_META), "--model", str(TINY), "--video-target-num-patches", "24", "--video-max-frames",
                    "3", "--num-workers", "0", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split(": ")[1].startswith("4 pairs")  # the 3-frame lists; the 4-frame clips dropped
    assert "    dropped too_many_frames: 8\n" in out and "4 frames sampled > --video-max-frames = 3" in out
    with pytest.raises(mr.DataError, match="--video-num-frames and --video-fps"):
        mi.main([str(VIDEO_META), "--model", str(TINY), "--video-num-frames", "2", "--video-fps", "1"])
    for value in ("nan", "inf", "-1"):  # argparse's float() takes nan and inf; the config refuses them
        with raises_naming(mr.DataError, "--video-fps", value):
            mi.main([str(VIDEO_META), "--model", str(TINY), "--video-fps", value])


def test_frame_count_is_decided_before_decoding(tmp_path, processor, monkeypatch):
    """A file's frames sampled follow from its container's frame count: more than data.video.max_frames is
    too_many_frames before any frame is decoded (a long video decoded whole would not fit in memory); data.video.fps
    above the clip's rate takes every frame, as num_frames does; a container without a frame count (Matroska) and a
    file without a video stream are video_unreadable naming the file."""
    import av
    import numpy as np

    from mmpr_media import Drop, load_frames

    sys.path.insert(0, str(VIDEO_META.parents[1]))
    from make_sample import frame, write_clip

    clip, mkv, sound = tmp_path / "clip.mp4", tmp_path / "clip.mkv", tmp_path / "sound.mp4"
    write_clip(clip, [frame(i, "right", "red") for i in range(4)])  # 4 frames at 2 fps
    with av.open(str(mkv), "w", format="matroska") as c:
        s = c.add_stream("mpeg4", rate=2)
        s.width, s.height, s.pix_fmt = 48, 32, "yuv420p"
        c.mux(s.encode(av.VideoFrame.from_ndarray(frame(0, "right", "red"), format="rgb24")))
        c.mux(s.encode())
    with av.open(str(sound), "w", format="mp4") as c:
        s = c.add_stream("aac", rate=16000)
        a = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        a.sample_rate = 16000
        c.mux(s.encode(a))
        c.mux(s.encode(None))
    vp = processor.video_processor
    monkeypatch.setattr(vp, "num_frames", None)
    monkeypatch.setattr(vp, "fps", 8.0)  # 4x the clip's rate: every frame
    frames, metadata = load_frames(str(clip), processor, max_frames=4)
    assert frames.shape == (4, 32, 48, 3) and metadata.frames_indices.tolist() == [0, 1, 2, 3]
    for path, reason in ((mkv, "video_unreadable"), (sound, "video_unreadable"), (clip, "too_many_frames")):
        with pytest.raises(Drop) as e:
            load_frames(str(path), processor, max_frames=3)
        assert e.value.reason == reason and str(path) in e.value.detail

    real_open = av.open

    class NoDecode:  # the container, but decoding a frame fails the test
        def __init__(self, container):
            self.container = container

        def __getattr__(self, name):
            return getattr(self.container, name)

        def decode(self, *args, **kwargs):
            raise AssertionError("a frame was decoded")

    monkeypatch.setattr(av, "open", lambda *a, **k: NoDecode(real_open(*a, **k)))
    monkeypatch.setattr(vp, "fps", None)  # every frame: 4 > 3
    with pytest.raises(Drop) as e:
        load_frames(str(clip), processor, max_frames=3)
    assert e.value.reason == "too_many_frames"


def test_media_under_other_keys_and_placeholders_in_responses_are_drops(tmp_path, processor):
    """`images` / `videos` / `audios` (other formats' keys, which this reader does not read) are missing_field, not a
    text-only record; `<audio>` outside the question (system, chosen, rejected) is stray_media_token as `<image>` is."""
    records = [
        record(0, image=None, q="Which?"),  # valid: text only
        record(1, image=None, q="What moves?", videos=["clip.mp4"]),
        record(2, image=None, q="Hear?", audios=["t.wav"]),
        record(3, image=None, images=["a.png"]),
        record(4, image=None, q="Hear?", audio="t.wav", chosen="A tone <audio>."),
        record(5, image=None, q="Hear?", rejected="No <audio> here."),
        record(6, image=None, q="Hear?", system="Listen to <audio>."),
    ]
    meta = write_set(tmp_path, records)
    index = mi.build_index(meta, processor, video_cfg(), use_cache=False)
    st = index.stats["sub"]
    assert st["dropped"] == {"missing_field": 3, "stray_media_token": 3} and index.line.tolist() == [1]
    assert [e.split(": ", 1)[1].split()[0] for e in st["drop_examples"]["missing_field"]] == [
        "'videos'", "'audios'", "'images'"]
    assert all("'<audio>'" in e for e in st["drop_examples"]["stray_media_token"])

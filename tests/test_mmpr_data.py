"""mmpr_records.py, mmpr_index.py, mmpr_data.py: meta-recipe parsing and path rules, record validation and every drop
reason, image decoding, template rendering and loss masks (checked token by token and against the processor end to end),
the index cache, splits, the resumable sampler, the step loader, the report and the rank-0 cache build under torchrun.

Every test writes its cache under tmp_path (HF_DATASETS_CACHE is monkeypatched), never to ~/.cache.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import raises_naming, warns_naming
from PIL import Image

import mmpr_data as md
import mmpr_index as mi
import mmpr_media as mm
import mmpr_records as mr
from config import Config, DataConfig
from pack import pack, plan_step

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-omni"
SAMPLE_META = ROOT / "data" / "mmpr_sample" / "MMPR-sample" / "meta.json"
IMAGE_ID, IMG_START, IMG_END, IM_END, THINK, THINK_END = 18, 21, 22, 11, 12, 13


@pytest.fixture(scope="module")
def processor():
    return mi.load_processor(TINY, "--model")  # as train.py loads it


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf_datasets_cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    return cache


def data_cfg(**overrides) -> DataConfig:
    """The config's data section with overrides, e.g. data_cfg(max_seq_length=300, train__max_samples=2)."""
    data = Config().data
    for k, v in overrides.items():
        obj, name = (data.train, k[7:]) if k.startswith("train__") else (data, k)
        setattr(obj, name, v)
    return data


def rgb(w=48, h=40, color=(200, 30, 30)):
    return Image.new("RGB", (w, h), color)


def write_set(base: Path, records: list, images: dict | None = None, name="MMPR-t", subset="sub", spec=None) -> Path:
    """The official layout: base/name/meta.json with paths `name/images`, `name/annotations/<subset>.jsonl`."""
    d = base / name
    (d / "images").mkdir(parents=True, exist_ok=True)
    (d / "annotations").mkdir(exist_ok=True)
    for fname, img in (images or {}).items():
        if isinstance(img, bytes):
            (d / "images" / fname).write_bytes(img)
        else:
            img.save(d / "images" / fname)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (d / "annotations" / f"{subset}.jsonl").write_text("\n".join(lines) + "\n")
    meta = {subset: {"root": f"{name}/images", "annotation": f"{name}/annotations/{subset}.jsonl",
                     "data_augment": False, "repeat_time": 1, **(spec or {})}}
    (d / "meta.json").write_text(json.dumps(meta))
    return d / "meta.json"


def wav(seconds: float, rate: int = 16000) -> bytes:
    """A PCM-16 WAV of a 440 Hz tone."""
    import soundfile as sf

    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(buf, 0.3 * np.sin(2 * np.pi * 440 * t), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def record(i=0, image="a.png", q="<image>\nWhat is it?", chosen=None, rejected=None, **extra):
    r = {"question": q, "chosen": chosen or f"A red square {i}.", "rejected": rejected or f"A blue circle {i}."}
    if image is not None:
        r["image"] = image
    r.update(extra)
    return r


# ----------------------------------------------------------------------------------------------------------------------
# the shipped sample, end to end


@pytest.fixture(scope="module")
def sample(processor, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("sample_cache")))
        index = mi.build_index(SAMPLE_META, processor, data_cfg())
    return index, md.PairDataset(index, processor)


def test_sample_index(sample):
    index, _ = sample
    assert len(index) == 34 and index.subsets[0] == "chartqa_train_extracted_pairs_vqa_correctness_rules"
    assert [index.stats[s]["pairs"] for s in index.subsets] == [12, 10, 12]
    assert mi.summary_drops(index) == {}
    assert index.line[:12].tolist() == list(range(1, 13))  # file order, 1-based lines
    assert index.source(13).endswith("geoqa_plus_extracted_pairs_vqa_format_rules.jsonl:2")
    # lengths: prompt + image tokens are consistent with the per-image arrays
    for i in range(len(index)):
        s, n = int(index.image_start[i]), int(index.num_images[i])
        assert n == 1 and int(index.image_tokens[i]) == int(index.image_token_counts[s:s + n].sum())
        gh, gw = index.image_grid_hw[s].tolist()
        assert index.image_token_counts[s] == gh * gw // 4
    assert set(index.lengths()) == set(range(34))


@pytest.mark.parametrize("i", [0, 5, 12, 21, 22, 33])
def test_sample_pair_equals_processor_end_to_end(sample, processor, i):
    """The pair's sequences and media equal what the processor produces for the template-rendered conversation."""
    index, ds = sample
    pair = ds[i]
    lines = Path(index.annotation_files[int(index.subset_id[i])]).read_text().splitlines()
    raw = json.loads(lines[int(index.line[i]) - 1])
    img = Image.open(index.images(i)[0]).convert("RGB")
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": raw["question"]}]}
    for side in ("chosen", "rejected"):
        text = processor.apply_chat_template([user, {"role": "assistant", "content": raw[side]}], tokenize=False)
        ref = processor(images=[img], text=text, return_tensors="pt")
        assert torch.equal(getattr(pair, f"{side}_ids"), ref["input_ids"][0])
        assert torch.equal(pair.pixel_values, ref["pixel_values"]) and pair.pixel_values.dtype == torch.float32
        assert torch.equal(pair.image_grid_hw, ref["image_grid_hw"])
    # image-token count = what the processor says; one contiguous <img> <image>*n </img> run
    (gh, gw), = pair.image_grid_hw.tolist()
    n = gh * gw // 4
    assert pair.image_token_counts.tolist() == [n] and pair.pixel_values.shape == (gh * gw, 768)
    ids = pair.chosen_ids.tolist()
    first = ids.index(IMAGE_ID)
    assert ids[first - 1] == IMG_START and ids[first:first + n] == [IMAGE_ID] * n and ids[first + n] == IMG_END
    # identical prompt ids; index lengths match the tensors
    p = int(index.prompt_len[i])
    assert torch.equal(pair.chosen_ids[:p], pair.rejected_ids[:p])
    assert (pair.chosen_ids.numel(), pair.rejected_ids.numel()) == index.lengths([i])[i]
    assert not pair.chosen_loss_mask[:p].any() and pair.chosen_loss_mask[p]
    assert pair.pair_id == i


def test_loss_mask_boundaries_token_by_token(sample, processor):
    index, ds = sample
    tok = processor.tokenizer
    pair = ds[3]
    raw = json.loads(Path(index.annotation_files[0]).read_text().splitlines()[3])
    for side in ("chosen", "rejected"):
        ids, mask = getattr(pair, f"{side}_ids").tolist(), getattr(pair, f"{side}_loss_mask").tolist()
        # the mask is one run: from right after `<think></think>` up to and including <|im_end|>; the newline is out
        start, end = mask.index(True), len(mask) - 1 - mask[::-1].index(True)
        assert all(mask[start:end + 1]) and not any(mask[:start]) and not any(mask[end + 1:])
        assert ids[start - 1] == THINK_END and ids[end] == IM_END and end == len(ids) - 2
        assert tok.decode(ids[end + 1:]) == "\n"
        assert tok.decode(ids[start:end + 1]) == raw[side] + "<|im_end|>"
        assert tok.decode(ids[:start]).endswith("<|im_end|>\n<|im_start|>assistant\n<think></think>")
        assert start == int(index.prompt_len[3])
        # the sequence decodes to exactly the rendered template (image placeholder expanded)
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": raw["question"]}]},
             {"role": "assistant", "content": raw[side]}], tokenize=False)
        n = int(pair.image_token_counts[0])
        assert tok.decode(ids) == text.replace("<image>", "<img>" + "<image>" * n + "</img>", 1)


def test_reasoning_responses_and_think_normalisation(tmp_path, processor):
    """A reasoning response's prompt is the thinking-on generation prompt; `<think></think>\\n\\n` + text renders
    like the bare text; a pair mixing the two is kept (NeMo-RL's rule): the prompt is what both generation prompts
    share, and each response opens its own block, token for token the template's rendering of the conversation."""
    meta = write_set(tmp_path, [
        record(0, chosen="<think>\nlook at it\n</think>\nRed.", rejected="<think>guess</think>Blue."),
        record(1, chosen="<think></think>\n\nRed.", rejected="Blue."),
        record(2, chosen="<think>hmm</think>Red.", rejected="Blue."),
        record(3, chosen="Red.", rejected="too short</think>Blue."),  # the block opened by the generation prompt
    ], {"a.png": rgb()})
    index = mi.build_index(meta, processor, data_cfg())
    assert len(index) == 4 and mi.summary_drops(index) == {}
    ds = md.PairDataset(index, processor)
    tok = processor.tokenizer
    p0, p1 = ds[0], ds[1]
    m = p0.chosen_loss_mask.tolist()
    assert tok.decode(p0.chosen_ids[: m.index(True)].tolist()).endswith("<|im_start|>assistant\n<think>\n")
    assert tok.decode(p0.chosen_ids[p0.chosen_loss_mask].tolist()) == "look at it\n</think>\nRed.<|im_end|>"
    assert tok.decode(p0.rejected_ids[p0.rejected_loss_mask].tolist()) == "guess\n</think>\nBlue.<|im_end|>"
    assert tok.decode(p1.chosen_ids[p1.chosen_loss_mask].tolist()) == "Red.<|im_end|>"
    p = int(index.prompt_len[1])
    assert torch.equal(p1.chosen_ids[:p], p1.rejected_ids[:p])
    img = Image.open(tmp_path / "MMPR-t" / "images" / "a.png").convert("RGB")
    for i, (chosen_loss, rejected_loss) in ((2, ("<think>\nhmm\n</think>\nRed.", "<think></think>Blue.")),
                                            (3, ("<think></think>Red.", "<think>\ntoo short\n</think>\nBlue."))):
        pair, p = ds[i], int(index.prompt_len[i])
        assert torch.equal(pair.chosen_ids[:p], pair.rejected_ids[:p])
        assert tok.decode(pair.chosen_ids[:p].tolist()).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert tok.decode(pair.chosen_ids[pair.chosen_loss_mask].tolist()) == chosen_loss + "<|im_end|>"
        assert tok.decode(pair.rejected_ids[pair.rejected_loss_mask].tolist()) == rejected_loss + "<|im_end|>"
        assert not pair.chosen_loss_mask[:p].any() and pair.chosen_loss_mask[p] and pair.rejected_loss_mask[p]
        raw = json.loads((tmp_path / "MMPR-t" / "annotations" / "sub.jsonl").read_text().splitlines()[i])
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": raw["question"]}]}
        for side in ("chosen", "rejected"):  # the sequences are the template's rendering of each conversation
            text = processor.apply_chat_template([user, {"role": "assistant", "content": raw[side]}], tokenize=False)
            ref = processor(images=[img], text=text, return_tensors="pt")["input_ids"][0]
            assert torch.equal(getattr(pair, f"{side}_ids"), ref)


# ----------------------------------------------------------------------------------------------------------------------
# meta-recipe and paths


def test_path_resolution_rules(tmp_path, processor):
    cfg = data_cfg()
    # 1. grandparent (official layout)
    meta = write_set(tmp_path / "g", [record()], {"a.png": rgb()})
    subs = mr.read_meta(meta)
    assert subs[0].annotation == (tmp_path / "g" / "MMPR-t" / "annotations" / "sub.jsonl").resolve()
    # 2. the meta file's own folder
    d = tmp_path / "own"
    (d / "imgs").mkdir(parents=True)
    rgb().save(d / "imgs" / "a.png")
    (d / "data.jsonl").write_text(json.dumps(record()) + "\n")
    (d / "meta.json").write_text(json.dumps({"s": {"root": "imgs", "annotation": "data.jsonl"}}))
    assert len(mi.build_index(d / "meta.json", processor, cfg)) == 1
    # 3. data.train.data_root, for a meta that lives elsewhere
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "meta.json").write_text(json.dumps({"s": {"root": "imgs", "annotation": "data.jsonl"}}))
    with pytest.raises(mr.DataError):
        mr.read_meta(tmp_path / "elsewhere" / "meta.json")
    subs = mr.read_meta(tmp_path / "elsewhere" / "meta.json", data_root=str(d))
    assert subs[0].root == (d / "imgs").resolve()
    index = mi.build_index(tmp_path / "elsewhere" / "meta.json", processor, data_cfg(train__data_root=str(d)))
    assert len(index) == 1
    # absolute paths are used as they are
    (tmp_path / "abs.json").write_text(json.dumps({"s": {"root": str(d / "imgs"),
                                                         "annotation": str(d / "data.jsonl")}}))
    assert mr.read_meta(tmp_path / "abs.json")[0].annotation == d / "data.jsonl"
    # the error lists every path tried
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "meta.json").write_text(json.dumps({"s": {"root": "nope", "annotation": "no.jsonl"}}))
    with raises_naming(mr.DataError, f"{tmp_path / 'x' / 'nope'}, {tmp_path / 'x' / 'y' / 'nope'};") as e:
        mr.read_meta(tmp_path / "x" / "y" / "meta.json")
    assert "\n" not in str(e.value)  # one line
    with raises_naming(mr.DataError, f"(tried {tmp_path / 'dr' / 'nope'};", "data.train.data_root"):
        mr.read_meta(tmp_path / "x" / "y" / "meta.json", data_root=str(tmp_path / "dr"))


def test_meta_errors(tmp_path):
    bad = tmp_path / "debug_mpo.json"  # InternVL's own debug meta has a trailing comma
    bad.write_text('{"a": {"root": "r",\n  "annotation": "a.jsonl", "repeat_time": 1},\n}\n')
    with raises_naming(mr.DataError, f"{bad}:3:1: "):
        mr.read_meta(bad)
    bad.write_text(json.dumps({"a": {"root": "r"}}))
    with raises_naming(mr.DataError, f"{bad}: subset 'a'", "annotation = None", "a file path"):
        mr.read_meta(bad)
    bad.write_text(json.dumps({"a": {"root": "r", "annotation": "x", "repeat_time": -1}}))
    with raises_naming(mr.DataError, f"{bad}: subset 'a'", "repeat_time = -1", "a number >= 0"):
        mr.read_meta(bad)
    bad.write_text(json.dumps({"a": {"root": 3, "annotation": "x"}}))
    with raises_naming(mr.DataError, f"{bad}: subset 'a'", "root = 3", "a folder path or null"):
        mr.read_meta(bad)
    shape = "{subset: {root, annotation, ...}}"
    for text, names in (("[]", [shape]), ("{}", [shape]), ('{"a": 3}', ["subset 'a'", "got int"])):
        bad.write_text(text)
        with raises_naming(mr.DataError, f"{bad}: ", *names):
            mr.read_meta(bad)
    with raises_naming(mr.DataError, tmp_path / "absent.json", "[Errno 2]"):
        mr.read_meta(tmp_path / "absent.json")


def test_meta_warnings_length_and_data_augment(tmp_path, processor):
    meta = write_set(tmp_path, [record(0), record(1)], {"a.png": rgb()}, spec={"length": 5, "data_augment": True,
                                                                         "max_dynamic_patch": 6})
    with pytest.warns(UserWarning) as rec:
        index = mi.build_index(meta, processor, data_cfg())
    msgs = " ".join(str(w.message) for w in rec)
    assert "data_augment is not supported" in msgs and "length = 5 but" in msgs and "has 2 records" in msgs
    assert len(index) == 2


def test_data_warnings_are_collected_as_plain_lines_once(tmp_path, processor, capsys):
    """Data notices (DataWarning) become plain lines, each once, instead of UserWarnings with a source
    line; other warnings still print; mmpr_index.py prints them as 'warning: ...' on stderr."""
    import warnings

    meta = write_set(tmp_path, [record(0), record(1)], {"a.png": rgb()}, spec={"length": 5, "data_augment": True})
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with mr.data_warnings([]) as notes:
            mi.build_index(meta, processor, data_cfg(), use_cache=False)
            mi.build_index(meta, processor, data_cfg(), use_cache=False)  # the same notices again: kept once
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert notes == [f"{meta}: subset 'sub': data_augment is not supported; images are not augmented",
                     f"{meta}: subset 'sub': the meta says length = 5 but {tmp_path}/MMPR-t/annotations/sub.jsonl "
                     "has 2 records"]
    assert [str(w.message) for w in outside] == ["something else"]  # not a data notice: passed through
    assert mi.main([str(meta), "--model", str(TINY), "--num-workers", "0", "--no-cache"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {notes[0]}\nwarning: {notes[1]}\n" in err and "UserWarning" not in err


def test_bad_meta_paths_name_the_real_cause(tmp_path):
    """An empty path and an annotation file (JSON Lines) given as the meta-recipe say so."""
    with raises_naming(mr.DataError, "data.train.data_path"):
        mr.read_meta("")
    for n in (2, 1):  # several records (json: "Extra data") and a single record (a JSON object without subsets)
        jsonl = tmp_path / f"records{n}.jsonl"
        jsonl.write_text("".join(json.dumps(record(i)) + "\n" for i in range(n)))
        with raises_naming(mr.DataError, f"{jsonl}: ", "(JSON Lines)"):
            mr.read_meta(jsonl)
    broken = tmp_path / "broken.json"
    broken.write_text('{"a": 1}\n{"b": 2}\n')  # two objects that are not records: still the JSON error
    with raises_naming(mr.DataError, f"{broken}:2:1: ", "Extra data"):
        mr.read_meta(broken)
    for flag, value, bound in (("--max-samples", "-3", ">= 0"), ("--max-seq-length", "0", ">= 1")):
        with raises_naming(mr.DataError, f"{flag} = {value} ", bound):
            mi.main([str(SAMPLE_META), "--model", str(TINY), flag, value])


def test_a_meta_recipe_that_is_not_utf8_is_one_line(tmp_path):
    """A meta-recipe (or an annotation file given as one) with bytes that are not UTF-8 raised
    UnicodeDecodeError as a traceback on every rank."""
    nonutf = tmp_path / "nonutf.json"
    nonutf.write_bytes(b"\xff\xfe{}")  # a UTF-16 byte-order mark (Windows) before the text
    with raises_naming(mr.DataError, f"{nonutf}: ", "UTF-8", "byte 0xff at offset 0"):
        mr.read_meta(nonutf)
    jsonl = tmp_path / "data.jsonl"  # an annotation file with one record that is not UTF-8, given as the meta
    jsonl.write_bytes(json.dumps(record(0)).encode() + b"\n" + json.dumps(record(1)).encode()[:-2] + b"\xe9\"}\n")
    with raises_naming(mr.DataError, f"{jsonl}: ", "(JSON Lines)"):
        mr.read_meta(jsonl)
    meta = write_set(tmp_path, [record(0)], {"a.png": rgb()})
    meta.write_bytes(b"\xef\xbb\xbf" + meta.read_bytes())  # a UTF-8 byte-order mark is tolerated
    assert [s.name for s in mr.read_meta(meta)] == ["sub"]


def test_meta_unknown_keys_warn_and_repeated_names_are_errors(tmp_path):
    """Keys with typos were ignored silently and a repeated subset name kept only the last subset."""
    meta = write_set(tmp_path, [record(0)], {"a.png": rgb()},
                     spec={"repeat_times": 2, "lenght": 3, "max_dynamic_patch": 6, "color": "red"})
    with mr.data_warnings([]) as notes:
        mr.read_meta(meta)
        mr.read_meta(SAMPLE_META)  # the shipped sample: InternVL's keys only, nothing said
    assert len(notes) == 1 and notes[0].startswith(f"{meta}: subset 'sub': "), notes  # one notice, every key
    assert all(n in notes[0] for n in ("'repeat_times'", "'repeat_time'?", "'lenght'", "'length'?", "'color'")), notes
    dup = tmp_path / "dup.json"
    dup.write_text('{"a": {"annotation": "x.jsonl"}, "b": {"annotation": "y.jsonl"}, "a": {"annotation": "z.jsonl"}}')
    with raises_naming(mr.DataError, f"{dup}: ", "key 'a'"):
        mr.read_meta(dup)
    dup.write_text('{"a": {"annotation": "x.jsonl", "root": null, "annotation": "y.jsonl"}}')
    with raises_naming(mr.DataError, f"{dup}: ", "key 'annotation'"):
        mr.read_meta(dup)


def test_a_directory_where_a_file_belongs_is_called_a_directory(tmp_path):
    """An image path or an annotation path naming a directory was reported as not existing."""
    meta = write_set(tmp_path, [record(0)], {"a.png": rgb()}, spec={"annotation": "MMPR-t/images"})
    with raises_naming(mr.DataError, f"{meta}: ", "'MMPR-t/images'",
                       f"{tmp_path / 'MMPR-t' / 'images'} is a directory"):  # fmt: skip
        mr.read_meta(meta)
    with pytest.raises(mm.Drop) as e:
        mm.load_image(tmp_path)
    assert (e.value.reason, e.value.detail) == ("image_missing", f"{tmp_path} is a directory")
    with pytest.raises(mm.Drop) as e:
        mm.load_image(tmp_path / "nope.png")
    assert e.value.detail == f"{tmp_path / 'nope.png'} does not exist"


def test_sequences_longer_than_the_tokenizer_maximum_give_no_transformers_warning(processor, monkeypatch):
    """transformers' "Token indices sequence length is longer than the specified maximum sequence length"
    reached the console for any record over the tokenizer's model_max_length; the record is checked against
    data.max_seq_length by the index, so the tokenizer is called without its warning."""
    import transformers.tokenization_utils_base as tub

    said = []
    monkeypatch.setattr(tub.logger, "warning", lambda msg, *args, **kwargs: said.append(msg))
    monkeypatch.setattr(processor.tokenizer, "model_max_length", 8)
    monkeypatch.setattr(processor.tokenizer, "deprecation_warnings", {})
    assert len(mr.TextRenderer(processor).encode("word " * 50)) > 8
    assert said == []
    processor.tokenizer("word " * 50, add_special_tokens=False)  # the control: the plain call warns
    assert len(said) == 1 and said[0].startswith("Token indices sequence length is longer than the specified maximum")


def test_drop_messages_count_images_in_the_singular_and_plural(tmp_path, processor):
    records = [record(0, q="<image> and <image>?"), record(1, image=["a.png", "a.png"], q="<image> only"),
            record(2, image=["a.png"] * 3, q="Three?"), record(3)]
    meta = write_set(tmp_path, records, {"a.png": rgb()})
    st = mi.build_index(meta, processor, data_cfg(train__max_images_per_row=2), use_cache=False).stats["sub"]
    sub = f"{tmp_path}/MMPR-t/annotations/sub.jsonl"
    assert st["drop_examples"] == {
        "placeholder_mismatch": [f"{sub}:1: 2 <image> placeholders for 1 image",
                                 f"{sub}:2: 1 <image> placeholder for 2 images"],
        "too_many_images": [f"{sub}:3: 3 images > data.train.max_images_per_row = 2"]}
    assert mr.plural(0, "image") == "0 images" and mr.plural(1, "image") == "1 image"
    assert mr.plural(2, "microbatch") == "2 microbatches" and mr.plural(1, "microbatch") == "1 microbatch"


def test_repeat_time(tmp_path, processor):
    assert mr.apply_repeat_time(10, 1.0, 0, "s") == list(range(10))
    assert mr.apply_repeat_time(10, 0.0, 0, "s") == []
    low = mr.apply_repeat_time(10, 0.3, 7, "s")
    assert len(low) == 3 and low == sorted(set(low)) and low == mr.apply_repeat_time(10, 0.3, 7, "s")
    assert len({tuple(mr.apply_repeat_time(10, 0.3, s, "s")) for s in range(8)}) > 1  # the seed matters
    high = mr.apply_repeat_time(10, 2.5, 7, "s")
    counts = np.bincount(high, minlength=10)
    assert len(high) == 25 and set(counts.tolist()) == {2, 3} and (counts == 3).sum() == 5

    records = [record(i) for i in range(10)]
    for r, expect in ((0.5, 5), (2.5, 25)):
        meta = write_set(tmp_path / str(r), records, {"a.png": rgb()}, spec={"repeat_time": r})
        index = mi.build_index(meta, processor, data_cfg(train__seed=3))
        assert len(index) == expect and index.stats["sub"]["valid"] == 10 and index.stats["sub"]["pairs"] == expect
        lines = index.line.tolist()
        assert lines == [v + 1 for v in mr.apply_repeat_time(10, r, 3, "sub")]
        # repeats of a record share its image slots (images are stored once per record)
        assert len(index.image_token_counts) == len(set(lines))
    ds = md.PairDataset(index, processor)
    a, b = [i for i, ln in enumerate(lines) if ln == lines[0]][:2]
    assert torch.equal(ds[a].chosen_ids, ds[b].chosen_ids) and ds[a].pair_id != ds[b].pair_id


def test_max_samples_keeps_the_first_valid_pairs(processor):
    index = mi.build_index(SAMPLE_META, processor, data_cfg(), max_samples=14)
    assert len(index) == 14 and index.subset_id.tolist() == [0] * 12 + [1] * 2
    assert index.line.tolist() == list(range(1, 13)) + [1, 2]
    third = index.stats["cc0_photos_extracted_prefix_pair_sr0.5_with_image"]
    assert third["rows_read"] == 0 and third["not_read"] == "max_samples reached"
    assert index.stats["geoqa_plus_extracted_pairs_vqa_format_rules"]["rows_read"] == 2  # stopped reading early


# ----------------------------------------------------------------------------------------------------------------------
# records: aliases, multi-image, drops


def test_aliases_system_multi_image_and_text_only(tmp_path, processor):
    imgs = {"a.png": rgb(64, 40, (255, 0, 0)), "b.png": rgb(30, 90, (0, 0, 255))}
    meta = write_set(tmp_path, [
        {"image": "a.png", "question": "<image>\nColour?", "chosen_response": "Red.", "rejected_response": "Blue.",
         "system_prompt": "Answer briefly.", "answer_gt": "Red", "chosen_meta": {"x": 1}},
        {"image": ["a.png", "b.png"], "question": "First <image> then <image>: same?", "chosen": "No.",
         "rejected": "Yes.", "system": "Be exact."},
        {"image": ["a.png", "b.png"], "question": "Compare them.", "chosen": "Different.", "rejected": "Same."},
        {"question": "What is 2+2?", "chosen": "4", "rejected": "5", "system_prompt": None},
    ], imgs)
    index = mi.build_index(meta, processor, data_cfg())
    assert len(index) == 4 and mi.summary_drops(index) == {}
    assert index.num_images.tolist() == [1, 2, 2, 0]
    ds = md.PairDataset(index, processor)
    tok = processor.tokenizer
    p0 = ds[0]
    assert tok.decode(p0.chosen_ids.tolist()).startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")
    assert tok.decode(p0.chosen_ids[p0.chosen_loss_mask].tolist()) == "Red.<|im_end|>"
    pil = [Image.open(tmp_path / "MMPR-t" / "images" / f).convert("RGB") for f in ("a.png", "b.png")]
    for i, text in ((1, "First <image> then <image>: same?"), (2, "Compare them.")):
        pair = ds[i]
        system = [{"role": "system", "content": "Be exact."}] if i == 1 else []
        user = {"role": "user", "content": [{"type": "image"}] * 2 + [{"type": "text", "text": text}]}
        rendered = processor.apply_chat_template(system + [user, {"role": "assistant", "content": "No." if i == 1
                                                                  else "Different."}], tokenize=False)
        if i == 2:  # no placeholder: the template puts the numbered images before the text
            assert "<image 1><image> <image 2><image>\nCompare them." in rendered
        ref = processor(images=pil, text=rendered, return_tensors="pt")
        assert torch.equal(pair.chosen_ids, ref["input_ids"][0]) and torch.equal(pair.pixel_values, ref["pixel_values"])
        grids = pair.image_grid_hw.tolist()
        assert grids == ref["image_grid_hw"].tolist() and grids[0] != grids[1]
        assert pair.image_token_counts.tolist() == [gh * gw // 4 for gh, gw in grids]
        # image runs in order: the first run has image 0's count, the second image 1's
        ids = pair.chosen_ids.tolist()
        starts = [k for k, t in enumerate(ids) if t == IMG_START]
        ends = [k for k, t in enumerate(ids) if t == IMG_END]
        assert [e - s - 1 for s, e in zip(starts, ends, strict=True)] == pair.image_token_counts.tolist()
    text_only = ds[3]
    assert text_only.pixel_values.shape == (0, 768) and text_only.image_grid_hw.shape == (0, 2)
    assert IMAGE_ID not in text_only.chosen_ids.tolist()
    # the packer accepts all of them (pixel_values once per pair, image-token counts consistent)
    batch = pack([ds[i] for i in range(4)], divisible_by=8, image_token_id=IMAGE_ID)
    assert batch.pixel_values.shape[0] == sum(int(ds[i].image_grid_hw.prod(-1).sum()) for i in range(4))


def test_an_empty_image_field_is_a_text_only_record(tmp_path, processor):
    """InternVL reads `"image": ""` (or []) as a pure-text record; it was dropped as missing_field."""
    text = {"question": "What is 9 - 4?", "chosen": "5", "rejected": "3"}
    meta = write_set(tmp_path, [text, {"image": "", **text}, {"image": [], **text}])
    with mr.data_warnings([]):
        index = mi.build_index(meta, processor, data_cfg(), use_cache=False)
    assert len(index) == 3 and mi.summary_drops(index) == {} and index.num_images.tolist() == [0, 0, 0]
    assert index.stats["sub"]["repeats"] == 2  # the same pair as the record without an image key
    ds = md.PairDataset(index, processor)
    for i in (1, 2):
        assert ds[i].pixel_values.shape == (0, 768) and torch.equal(ds[i].chosen_ids, ds[0].chosen_ids)


def _png_bytes(img, fmt="PNG") -> bytes:
    b = io.BytesIO()
    img.save(b, fmt)
    return b.getvalue()


def test_every_drop_reason_is_counted(tmp_path, processor):
    good = _png_bytes(rgb(80, 60))
    records = [
        record(0),  # valid
        '{"image": "a.png", "question": "<image>\\nBroken',  # invalid_json
        "[1, 2]",  # invalid_json (not an object)
        {"image": "a.png", "question": "<image> Q", "chosen": "x", "rejected": None},  # missing_field (null rejected)
        record(1, system=["not", "a", "string"]),  # missing_field (system must be a string)
        record(2, image=["a.png", "a.png", "a.png"], q="Three?"),  # too_many_images (max 2)
        record(3, q="<image> and <image>?"),  # placeholder_mismatch: 2 placeholders, 1 image
        record(4, image=None),  # placeholder_mismatch: a placeholder, no image
        record(5, chosen="See <img> here."),  # stray_media_token in a response
        record(6, q="<image>\nQ<|im_end|>"),  # stray_media_token in the question
        record(7, rejected="A <image> token."),  # stray_media_token: <image> in a response
        record(8, chosen="   "),  # empty_response (missing-ish: whitespace only)
        record(9, rejected="<think>only reasoning</think>  "),  # empty_response
        record(10, image="nope.png"),  # image_missing
        record(11, image="garbage.png"),  # image_unreadable
        record(12, image="half.png"),  # image_truncated
        record(13, chosen="<think>r</think>Red.", rejected="Blue."),  # valid: a mixed reasoning pair is kept
        record(14, chosen="word " * 200),  # too_long
        "",  # blank line: not a record
        record(15, image=["a.png", "a.png"], q="<image> vs <image>"),  # valid, 2 images
        record(16, video="clip.mp4", image=None, q="What happens?"),  # video_missing
        record(17, chosen="<think>cut off while", rejected="<think>also cut"),  # unterminated_reasoning
        record(18, chosen="Sure. <think>r</think>Red."),  # malformed_reasoning: text before <think>
        record(19, rejected="<think>a</think>b<think>c</think>Blue."),  # malformed_reasoning: two blocks
        record(20, q="See <image> <image_1>"),  # placeholder_mismatch: <image> and <image_N> mixed
        # template_rewrites_text: no character is left to hide the /think from the template with
        record(21, q="<image>\nA/think" + "".join(chr(c) for c in range(0xE000, 0xF900))),
        record(23, chosen="Same.", rejected=" Same.\n"),  # identical_responses (after stripping)
        record(24, image="thin.png"),  # image_unprocessable: too thin for the processor's patch budget
        record(25, image="../images/a.png"),  # image_outside_root: `..` climbs above the root
        record(26, video="garbage.mp4", image=None, q="What happens?"),  # video_unreadable
        record(27, video=["a.png"] * 3, image=None, q="What happens?"),  # too_many_frames (max 2)
        record(28, image=None, q="Hear?", audio=5),  # missing_field: audio not a path
        record(29, image=None, q="<audio> <audio>", audio="t.wav"),  # placeholder_mismatch: 2 placeholders, 1 clip
        record(30, image=None, q="Hear?", audio="../images/t.wav"),  # audio_outside_root
        record(31, image=None, q="Hear?", audio="nope.wav"),  # audio_missing
        record(32, image=None, q="Hear?", audio="garbage.wav"),  # audio_unreadable
        record(33, image=None, q="Hear?", audio="empty.wav"),  # audio_empty
        record(34, image=None, q="Hear?", audio="long.wav"),  # audio_too_long (data.train.max_audio_seconds 0.5)
        record(35, q="<image> <audio> both?", audio="t8k.wav"),  # valid: an image and an 8 kHz clip (resampled)
    ]
    meta = write_set(tmp_path, records, {"a.png": good, "garbage.png": b"not an image at all", "half.png":
                                      good[: len(good) // 2], "thin.png": rgb(5000, 1), "t.wav": wav(0.3),
                                      "t8k.wav": wav(0.3, rate=8000), "long.wav": wav(0.6), "empty.wav": wav(0),
                                      "garbage.wav": b"RIFF not really a wave file",
                                      "garbage.mp4": b"not a video at all"})
    # a second subset without root (InternVL accepts "root": null): its relative image path is a drop naming it
    spec = json.loads(meta.read_text())
    (meta.parent / "annotations" / "rootless.jsonl").write_text(
        json.dumps(record(22)) + "\n" + json.dumps(record(36, image=None, q="Hear?", audio="t.wav")) + "\n")
    spec["rootless"] = {"root": None, "annotation": "MMPR-t/annotations/rootless.jsonl"}
    meta.write_text(json.dumps(spec))
    cfg = data_cfg(max_seq_length=200, train__max_images_per_row=2, train__max_audio_seconds=0.5)
    cfg.video.max_frames = 2
    index = mi.build_index(meta, processor, cfg)
    st = index.stats["sub"]
    assert st["dropped"] == {"invalid_json": 2, "missing_field": 3, "video_missing": 1, "video_unreadable": 1,
                             "too_many_frames": 1, "too_many_images": 1,
                             "audio_outside_root": 1, "audio_missing": 1, "audio_unreadable": 1, "audio_empty": 1,
                             "audio_too_long": 1, "placeholder_mismatch": 4, "stray_media_token": 3,
                             "unterminated_reasoning": 1,
                             "malformed_reasoning": 2, "empty_response": 2, "identical_responses": 1,
                             "image_outside_root": 1, "image_missing": 1, "image_unreadable": 1, "image_truncated": 1,
                             "image_unprocessable": 1, "template_rewrites_text": 1, "too_long": 1}
    assert index.stats["rootless"]["dropped"] == {"no_image_root": 1, "no_audio_root": 1}
    assert index.stats["rootless"]["drop_examples"]["no_image_root"] == [
        f"{tmp_path}/MMPR-t/annotations/rootless.jsonl:1: subset 'rootless' has no root for 'a.png'"]
    assert set(mi.summary_drops(index)) == set(mr.DROP_REASONS)
    assert st["rows_read"] == 38 and st["valid"] == 4 and len(index) == 4 and index.line.tolist() == [1, 17, 20, 39]
    assert index.num_audio.tolist() == [0, 0, 0, 1] and index.audio_samples.tolist() == [4800]  # 0.3 s at 16 kHz
    assert st["drop_examples"]["image_missing"][0].startswith(f"{tmp_path}/MMPR-t/annotations/sub.jsonl:14: ")
    assert "nope.png does not exist" in st["drop_examples"]["image_missing"][0]
    assert st["drop_examples"]["too_long"][0].endswith("> data.max_seq_length = 200")
    assert max(index.chosen_len.max(), index.rejected_len.max()) <= 200
    # strict: the first drop is an error naming the file and line
    cfg.strict = True
    first_drop = f"{tmp_path}/MMPR-t/annotations/sub.jsonl:2: "
    with raises_naming(mr.DataError, first_drop, "invalid_json", "data.strict = true", index.cache_dir):
        mi.build_index(meta, processor, cfg)  # the index above is cached: strict still fails
    with raises_naming(mr.DataError, first_drop, "invalid_json", "data.strict = true") as e:
        mi.build_index(meta, processor, cfg, use_cache=False)  # a fresh build stops at the first drop
    assert str(index.cache_dir) not in str(e.value)


def test_a_long_clip_is_dropped_from_its_header_not_decoded(tmp_path, processor, monkeypatch):
    """audio_too_long is judged from the file's header: a clip over data.train.max_audio_seconds and a 1 Hz WAV of
    400 samples (400 s: 6.4 M samples at 16 kHz, 5001 audio tokens > data.max_seq_length) are dropped with nothing
    decoded; a clip replaced after indexing by a longer one is a DataError naming the record, again not decoded."""
    records = [record(0, image=None, q="Hear?", audio="t.wav"), record(1, image=None, q="Hear?", audio="long.wav"),
            record(2, image=None, q="Hear?", audio="slow.wav")]
    meta = write_set(tmp_path, records, {"t.wav": wav(0.3), "long.wav": wav(0.6), "slow.wav": wav(400, rate=1)})
    decoded = []

    def spy(path, rate):
        decoded.append(Path(path).name)
        return mm.load_audio(path, rate)

    monkeypatch.setattr(mr, "load_audio", spy)
    index = mi.build_index(meta, processor, data_cfg(max_seq_length=200, train__max_audio_seconds=0.5),
                           use_cache=False)
    assert index.stats["sub"]["dropped"] == {"audio_too_long": 2} and decoded == ["t.wav"]
    assert index.line.tolist() == [1] and index.audio_samples.tolist() == [4800]
    decoded.clear()
    no_limit = mi.build_index(meta, processor, data_cfg(max_seq_length=200), use_cache=False)  # tokens alone too many
    assert no_limit.stats["sub"]["dropped"] == {"audio_too_long": 1} and decoded == ["t.wav", "long.wav"]
    assert "slow.wav" in no_limit.stats["sub"]["drop_examples"]["audio_too_long"][0]
    assert "data.max_seq_length = 200" in no_limit.stats["sub"]["drop_examples"]["audio_too_long"][0]
    ds = md.PairDataset(index, processor)
    assert int(ds[0].audio_token_counts.sum()) == int(index.audio_tokens[0])
    shutil.copy(meta.parent / "images" / "slow.wav", meta.parent / "images" / "t.wav")

    def not_decoded(path, rate):
        raise AssertionError(f"{path} decoded")

    monkeypatch.setattr(md, "load_audio", not_decoded)
    with raises_naming(mr.DataError, f"{meta.parent / 'annotations' / 'sub.jsonl'}:1", "t.wav"):
        ds[0]


def test_identical_responses_are_a_counted_drop(tmp_path, processor):
    """`chosen == rejected` after stripping surrounding whitespace is a drop with file:line examples (and a
    DataError under data.strict); responses that differ inside (inner whitespace, reasoning only) are kept."""
    records = [
        record(0),  # valid
        record(1, chosen="Red.", rejected="Red."),  # identical
        record(2, chosen="  Red.\n", rejected="Red. "),  # identical after stripping
        record(3, chosen="Red  square.", rejected="Red square."),  # kept: inner whitespace differs
        record(4, chosen="<think>a</think>Red.", rejected="<think>b</think>Red."),  # kept: the reasoning differs
        record(5, chosen="<think>a</think>Red.", rejected="<think>a</think>Red.\t"),  # identical, reasoning included
        # the same rendered tokens: the template drops an empty reasoning block (QA: kept with no signal before)
        record(6, chosen="<think></think>Red.", rejected="Red."),
        record(7, chosen="Red.", rejected="<think>\n</think>\nRed."),
        record(8, chosen="<think>a</think>Red.", rejected="Red."),  # kept: one side reasons
    ]
    meta = write_set(tmp_path, records, {"a.png": rgb()})
    index = mi.build_index(meta, processor, data_cfg(), use_cache=False)
    st = index.stats["sub"]
    assert st["dropped"] == {"identical_responses": 5} and index.line.tolist() == [1, 4, 5, 9]
    only_rendered = mi.build_index(write_set(tmp_path / "r", [records[0], records[6], records[7]], {"a.png": rgb()}),
                                   processor, data_cfg(), use_cache=False).stats["sub"]["drop_examples"]
    assert [e.split(": ", 1)[1] for e in only_rendered["identical_responses"]] == [
        "chosen and rejected render to the same text 'Red.<|im_end|>\\n'"] * 2
    example = f"{tmp_path}/MMPR-t/annotations/sub.jsonl:2: chosen and rejected are the same text"
    assert st["drop_examples"]["identical_responses"][0] == example
    assert mi.summary_drops(index) == {"identical_responses": 5}
    assert "    dropped identical_responses: 5  e.g. " + example in mi.format_report(mi.report(index)).splitlines()
    cfg = data_cfg()
    cfg.strict = True
    with raises_naming(mr.DataError, f"{tmp_path}/MMPR-t/annotations/sub.jsonl:2: ", "identical_responses"):
        mi.build_index(meta, processor, cfg, use_cache=False)


def test_text_that_is_not_unicode_and_an_unusable_image_path_are_counted_drops(tmp_path, processor):
    """QA: a lone surrogate escape ("\\ud83d", valid JSON) crashed the index build in the tokenizer (TypeError), and
    an image name longer than the file system allows in Path.is_file (OSError); both are counted drops now."""
    records = [
        record(0),  # valid
        record(1, chosen="A cat \ud83d"),  # a truncated emoji: half of a surrogate pair
        record(2, q="<image>\ncaf\udce9?"),  # Latin-1 bytes read with errors="surrogateescape"
        record(3, system_prompt="Be \udcff brief."),
        record(4, image="a" * 300 + ".png"),  # NAME_MAX is 255 bytes
    ]
    meta = write_set(tmp_path, records, {"a.png": rgb()})
    assert "\\ud83d" in (meta.parent / "annotations" / "sub.jsonl").read_text()  # JSON's escape, as scraped data has
    index = mi.build_index(meta, processor, data_cfg(), use_cache=False)
    st = index.stats["sub"]
    assert st["dropped"] == {"invalid_json": 3, "image_unreadable": 1} and index.line.tolist() == [1]
    ex = [e.split(": ", 1)[1] for e in st["drop_examples"]["invalid_json"]]
    for example, names in zip(ex, (("'chosen'", "'\\ud83d'", "character 6"),  # the field, the value, its position
                                   ("'question'", "'\\udce9'", "character 11"),
                                   ("'system'", "'\\udcff'", "character 3")), strict=True):  # fmt: skip
        assert all(n in example for n in names), example
    assert st["drop_examples"]["image_unreadable"][0].endswith(".png: File name too long")


def test_an_index_cache_that_cannot_be_written_is_a_warning(tmp_path, processor, monkeypatch, caplog):
    """QA: a cache folder that cannot be created (HF_DATASETS_CACHE under a file, a read-only disk) ended the build
    in a NotADirectoryError after all the work; now a warning, and the index is used uncached."""
    meta = write_set(tmp_path, [record(0), record(1)], {"a.png": rgb()})
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "afile" / "cache"))
    with caplog.at_level("WARNING", logger="omni_mpo.mmpr_index"):
        index = mi.build_index(meta, processor, data_cfg())
    assert len(index) == 2 and index.cache_status == "built"
    assert len(caplog.records) == 1 and "Not a directory" in caplog.records[0].getMessage()
    assert caplog.records[0].getMessage().startswith(f"could not write the MMPR index cache {tmp_path / 'afile'}")


def test_parallel_build_equals_serial(tmp_path, processor, monkeypatch):
    """Forked record checking (data.num_workers >= 2) gives the serial index: same order, lengths, drops, early stop."""
    monkeypatch.setattr(mr, "CHUNK_RECORDS", 3)  # many chunks, a window of 4 in flight
    records = [record(i, image="nope.png" if i % 5 == 2 else "a.png") for i in range(20)]
    meta = write_set(tmp_path, records, {"a.png": rgb()})
    for max_samples in (0, 7):
        serial = mi.build_index(meta, processor, data_cfg(num_workers=0), max_samples=max_samples, use_cache=False)
        forked = mi.build_index(meta, processor, data_cfg(num_workers=2), max_samples=max_samples, use_cache=False)
        assert _same(serial, forked) and len(forked) == (16 if max_samples == 0 else 7)
    assert forked.stats["sub"]["rows_read"] == 9 and forked.stats["sub"]["dropped"] == {"image_missing": 2}


def test_a_checking_process_that_dies_is_one_error_naming_the_lines(tmp_path, processor, monkeypatch):
    """A forked checking process killed while it decodes (out of memory, a decoder's crash) is a DataError naming the
    annotation file and the lines in flight, the killing record among them, not BrokenProcessPool's traceback."""
    import re
    import signal

    monkeypatch.setattr(mr, "CHUNK_RECORDS", 2)
    monkeypatch.setattr(mr, "load_frames", lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
    records = [record(i, image=None, q="Q?", **({"video": "v.mp4"} if i == 3 else {})) for i in range(8)]
    meta = write_set(tmp_path, records)
    with raises_naming(mr.DataError, meta.parent / "annotations" / "sub.jsonl") as e:
        mi.build_index(meta, processor, data_cfg(num_workers=2), use_cache=False)
    first, last = map(int, re.search(r"lines (\d+)-(\d+)", str(e.value)).groups())
    assert first <= 4 <= last  # the video record is line 4


def test_no_valid_pair_is_an_error(tmp_path, processor):
    meta = write_set(tmp_path, [record(0, image="nope.png")], {})
    with raises_naming(mr.DataError, f"{meta}: ", "{'image_missing': 1}"):
        mi.build_index(meta, processor, data_cfg())


def test_no_valid_pair_names_the_empty_subsets(tmp_path, processor):
    """An empty annotation file said only 'drops: {}'; the subsets without a record are named."""
    meta = write_set(tmp_path, [], {})
    with raises_naming(mr.DataError, f"{meta}: ", "drops: {}", "subset(s) 'sub'"):
        mi.build_index(meta, processor, data_cfg(), use_cache=False)


def test_an_annotation_that_is_a_json_array_says_jsonl(tmp_path, processor):
    """A pretty-printed JSON array as the annotation said only "no valid preference pair; drops: {'invalid_json': N}";
    the error now says the file must be JSON Lines and names an example line. A file whose every line is invalid JSON
    gets the same hint; one other subset with pairs turns it into a warning naming the file."""
    meta = write_set(tmp_path, [], {"a.png": rgb()})
    annotation = meta.parent / "annotations" / "sub.jsonl"
    annotation.write_text(json.dumps([record(0), record(1)], indent=2) + "\n")  # 2 records: 14 lines, each invalid JSON
    with warns_naming(mr.DataWarning, annotation, "JSON Lines"), raises_naming(
            mr.DataError, f"{meta}: ", "{'invalid_json': 14}", f"{annotation} ", "JSON Lines", "JSON array",
            f"(e.g. {annotation}:1: Expecting value: line 2 column 1 (char 2))"):  # fmt: skip
        mi.build_index(meta, processor, data_cfg(), use_cache=False)  # the subset's note, then the error
    # a compact array on one line, then lines of a JSON array's objects: none is a JSON object on its own line
    annotation.write_text(json.dumps([record(0)]) + "\n"
                          + "\n".join(json.dumps(record(i)) + "," for i in (1, 2)) + "\n")
    with warns_naming(mr.DataWarning, annotation, "JSON Lines"), raises_naming(
            mr.DataError, f"{meta}: ", "{'invalid_json': 3}", f"{annotation} ", "JSON Lines", "3 non-blank lines",
            f"(e.g. {annotation}:1: expected a JSON object, got list)"):  # fmt: skip
        mi.build_index(meta, processor, data_cfg(), use_cache=False)  # the subset's note, then the error
    # a JSONL with one bad record is not called an array, whatever that record is: the message is the usual one
    annotation.write_text("[1, 2]\n" + json.dumps(record(0, image="nope.png")) + "\n")
    with raises_naming(mr.DataError, f"{meta}: ", "{'invalid_json': 1, 'image_missing': 1}") as e:
        mi.build_index(meta, processor, data_cfg(), use_cache=False)
    assert "JSON Lines" not in str(e.value)  # the usual error: no array hint
    # the array as one subset beside a good one: the index builds, and a warning names the array file
    annotation.write_text(json.dumps([record(0), record(1)], indent=2) + "\n")
    spec = json.loads(meta.read_text())
    (meta.parent / "annotations" / "good.jsonl").write_text(json.dumps(record(5)) + "\n")
    spec["good"] = {"root": "MMPR-t/images", "annotation": "MMPR-t/annotations/good.jsonl"}
    meta.write_text(json.dumps(spec))
    with pytest.warns(mr.DataWarning) as warned:
        index = mi.build_index(meta, processor, data_cfg(), use_cache=False)
    assert len(index) == 1 and index.stats["sub"]["dropped"] == {"invalid_json": 14}
    assert [str(w.message) for w in warned] == [
        f"{annotation} is not JSON Lines (its first line opens a JSON array): an annotation file must be JSONL, one "
        f"JSON object per line (e.g. {annotation}:1: Expecting value: line 2 column 1 (char 2))"]


# ----------------------------------------------------------------------------------------------------------------------
# records as real MMPR / NeMo-RL data writes them: the R1 prompt, directives, null roots, video, reasoning, <image_N>

R1_QUESTION = ("<image>\nEnclose this entire thinking process within <think> and </think> tags.\nWhat is 2+2?")


def _user_turn(question: str, n_tokens: int, system: str = "") -> str:
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
            + question.replace("<image>", "<img>" + "<image>" * n_tokens + "</img>") + "<|im_end|>\n")


def test_record_text_is_rendered_as_written(tmp_path, processor):
    """The template strips `/think` / `/no_think` wherever they occur (in `</think>`, a word, a URL) and obeys them;
    a record's text reaches the model as written instead, and the pair's reasoning mode comes from its responses."""
    url_q = "<image>\nOpen https://example.com/thinking-maps/no_thinking.png: a/think b /no_think c?"
    meta = write_set(tmp_path, [
        record(0, q=R1_QUESTION, chosen="<think>\n2+2=4\n</think>\n4", rejected="<think>\n2+2=5\n</think>\n5"),
        record(1, q=url_q, chosen="Red.", rejected="Blue."),
        record(2, q="<image>\nWhat? /think", chosen="Red.", rejected="Blue."),  # a directive against plain responses
        record(3, system="/no_think", chosen="<think>r</think>Red.", rejected="<think>s</think>Blue."),
    ], {"a.png": rgb(640, 480)})
    # the template on its own: these rewrites are what the renderer prevents (the records crashed the build before)
    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": R1_QUESTION}]}]
    assert "within <think> and <> tags." in processor.apply_chat_template(user, tokenize=False)
    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": url_q}]}]
    assert "https://example.coming-mapsing.png: a b  c?" in processor.apply_chat_template(user, tokenize=False)
    index = mi.build_index(meta, processor, data_cfg())
    assert len(index) == 4 and mi.summary_drops(index) == {}
    ds, tok = md.PairDataset(index, processor), processor.tokenizer
    n = int(index.image_token_counts[0])
    expect = {
        0: (_user_turn(R1_QUESTION, n), "<think>\n", "2+2=4\n</think>\n4", "2+2=5\n</think>\n5"),
        1: (_user_turn(url_q, n), "<think></think>", "Red.", "Blue."),
        2: (_user_turn("<image>\nWhat? /think", n), "<think></think>", "Red.", "Blue."),
        3: (_user_turn("<image>\nWhat is it?", n, "/no_think"), "<think>\n",
            "r\n</think>\nRed.", "s\n</think>\nBlue."),
    }
    for i, (turns, opener, chosen, rejected) in expect.items():
        pair = ds[i]
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            text = turns + "<|im_start|>assistant\n" + opener + response + "<|im_end|>\n"
            ids = tok(text, add_special_tokens=False)["input_ids"]  # <think> / </think> are the reasoning tokens
            assert getattr(pair, f"{side}_ids").tolist() == ids
            assert tok.decode(getattr(pair, f"{side}_ids")[getattr(pair, f"{side}_loss_mask")].tolist()) == (
                response + "<|im_end|>")
    # the R1 instruction keeps both reasoning tokens in the user turn, as a tokenizer gives them at inference
    user_ids = ds[0].chosen_ids[: int(index.prompt_len[0])].tolist()
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK, THINK_END]
    assert user_ids.count(THINK) == 2 and user_ids.count(THINK_END) == 1  # the question's two, + the opener


def test_template_that_rewrites_text_is_a_counted_drop(tmp_path, processor):
    """Any other rewrite by a chat template (here one that respells a word) is dropped, not trained silently."""
    from transformers import AutoProcessor

    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    tpl = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(tpl.replace("| trim -}}", "| replace('colour', 'color') | trim -}}"))
    other = AutoProcessor.from_pretrained(model)
    meta = write_set(tmp_path, [record(0, q="<image>\nWhich colour?"), record(1, q="<image>\nWhich color?"),
                                record(2, system="Say colour.")], {"a.png": rgb()})
    index = mi.build_index(meta, other, data_cfg())
    assert index.line.tolist() == [2] and index.stats["sub"]["dropped"] == {"template_rewrites_text": 2}
    ex = index.stats["sub"]["drop_examples"]["template_rewrites_text"]
    assert "sub.jsonl:1: " in ex[0] and " question text: " in ex[0], ex  # the file:line and the field rewritten
    assert "sub.jsonl:3: " in ex[1] and " system text: " in ex[1], ex
    assert len(mi.build_index(meta, processor, data_cfg(), use_cache=False)) == 3  # the tiny template keeps them


def test_subset_without_root(tmp_path, processor):
    """InternVL's text-only subsets have "root": null (or none): accepted; records that need a root are dropped."""
    d = tmp_path / "set"
    d.mkdir()
    rgb().save(d / "abs.png")
    (d / "text.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"question": "What is 2+2?", "chosen": "4", "rejected": "5"},
        record(1, image=str(d / "abs.png")),  # an absolute image path needs no root
        record(2, image="rel.png"),
    )) + "\n")
    (d / "meta.json").write_text(json.dumps({"text_null": {"root": None, "annotation": "text.jsonl"},
                                             "text_missing": {"annotation": "text.jsonl", "repeat_time": 1}}))
    subs = mr.read_meta(d / "meta.json")
    assert [s.root for s in subs] == [None, None]
    index = mi.build_index(d / "meta.json", processor, data_cfg())
    assert len(index) == 4 and index.num_images.tolist() == [0, 1, 0, 1]
    assert index.images(1) == [str(d / "abs.png")] and index.image_roots == ["", ""]
    for name in ("text_null", "text_missing"):
        assert index.stats[name]["dropped"] == {"no_image_root": 1}
        assert f"subset '{name}' has no root" in index.stats[name]["drop_examples"]["no_image_root"][0]
    ds = md.PairDataset(index, processor)
    assert ds[0].pixel_values.shape == (0, 768) and ds[1].image_grid_hw.shape == (1, 2)


def test_image_paths_that_leave_the_root_are_a_counted_drop(tmp_path, processor):
    """`../../etc/passwd` was opened outside the subset's root (dropped only as unreadable)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    rgb().save(outside / "b.png")
    records = [
        record(0, image="../../../../../../../../etc/passwd"),  # image_outside_root
        record(1, image="sub/../a.png"),  # kept: `..` inside the root
        record(2, image="link.png"),  # kept: a symbolic link in the root may point elsewhere
        record(3, image=str(outside / "b.png")),  # kept: an absolute path is used as written
        record(4, image="../images/a.png"),  # image_outside_root: the check reads the path as written
    ]
    meta = write_set(tmp_path, records, {"a.png": rgb()})
    (meta.parent / "images" / "link.png").symlink_to(outside / "b.png")
    (meta.parent / "images" / "sub").mkdir()
    index = mi.build_index(meta, processor, data_cfg(), use_cache=False)
    assert index.stats["sub"]["dropped"] == {"image_outside_root": 2} and index.line.tolist() == [2, 3, 4]
    assert "'../../../../../../../../etc/passwd'" in index.stats["sub"]["drop_examples"]["image_outside_root"][0]


def test_a_symbolic_link_loop_is_named_as_one(tmp_path):
    """A symbolic link loop was reported as "does not exist"."""
    (tmp_path / "loop.png").symlink_to(tmp_path / "loop.png")
    with pytest.raises(mm.Drop) as e:
        mm.load_image(tmp_path / "loop.png")
    assert e.value.reason == "image_unreadable" and "symbolic link loop" in e.value.detail


def test_reasoning_blocks_must_be_closed_and_single(tmp_path, processor):
    meta = write_set(tmp_path, [
        record(0, chosen="<think>\nThe image is plain grey, so", rejected="<think>\nThere is a cat."),
        record(1, chosen="<think>a</think>Red.", rejected="<think>\nThere is a"),
        record(2, chosen="<think>a</think>Red.<think>b</think>Really red.", rejected="Blue."),
        record(3, chosen="Red. <think>why</think>Yes.", rejected="Blue."),
        record(4, chosen="a</think>b</think>Red.", rejected="Blue."),
        record(5, chosen="<think>a</think>Red.", rejected="Blue."),
    ], {"a.png": rgb()})
    index = mi.build_index(meta, processor, data_cfg())
    st = index.stats["sub"]
    assert index.line.tolist() == [6] and st["dropped"] == {"unterminated_reasoning": 2, "malformed_reasoning": 3}
    assert [e.split(": ", 1)[1] for e in st["drop_examples"]["unterminated_reasoning"]] == [
        "chosen opens <think> and never closes it", "rejected opens <think> and never closes it"]
    assert [e.split(": ", 1)[1] for e in st["drop_examples"]["malformed_reasoning"]] == [
        "chosen: 2 <think> and 2 </think>, not one block at its start",
        "chosen: 1 <think> and 1 </think>, not one block at its start",
        "chosen: 0 <think> and 2 </think>, not one block at its start"]


def test_numbered_image_placeholders(tmp_path, processor):
    """`<image_N>` (NeMo-RL's placeholder) is the N-th image at that place: the pair equals the `<image>` record with
    the images in placeholder order."""
    imgs = {"a.png": rgb(64, 40, (255, 0, 0)), "b.png": rgb(30, 90, (0, 0, 255))}
    meta = write_set(tmp_path, [
        record(0, image=["a.png", "b.png"], q="<image_1> <image_2> Same?", chosen="Yes.", rejected="No."),
        record(1, image=["a.png", "b.png"], q="<image> <image> Same?", chosen="Yes.", rejected="No."),
        record(2, image=["b.png", "a.png"], q="<image_2> <image_1> Same?", chosen="Yes.", rejected="No."),
        record(3, image="a.png", q="<image_1>\nWhat is it?"),
        record(4, image=["a.png", "b.png"], q="<image_1> <image_3>"),
        record(5, image=["a.png", "b.png"], q="<image_1> <image_1>"),
        record(6, image=["a.png", "b.png"], q="<image_1> only"),
    ], imgs)
    index = mi.build_index(meta, processor, data_cfg())
    st = index.stats["sub"]
    assert index.line.tolist() == [1, 2, 3, 4] and st["dropped"] == {"placeholder_mismatch": 3}
    assert st["drop_examples"]["placeholder_mismatch"][0].endswith(
        "<image_N> placeholders [1, 3] for 2 images")
    folder = tmp_path / "MMPR-t" / "images"
    assert index.images(0) == index.images(1) == index.images(2) == [str(folder / "a.png"), str(folder / "b.png")]
    ds = md.PairDataset(index, processor)
    for i in (0, 2):
        for k in ("chosen_ids", "rejected_ids", "pixel_values", "image_grid_hw", "image_token_counts"):
            assert torch.equal(getattr(ds[i], k), getattr(ds[1], k))
    assert "<image_1>" not in processor.tokenizer.decode(ds[3].chosen_ids.tolist())
    assert ds[3].chosen_ids.tolist().count(IMG_START) == 1


def test_subset_notices_repeat_on_a_cache_hit(tmp_path, processor, monkeypatch):
    """The meta-length notice was raised while building the index only, so a run on the cached index said
    nothing; the notices are kept in the index's stats and repeat on every build_index."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    meta = write_set(tmp_path, [record(0), record(1)], {"a.png": rgb()}, spec={"length": 5})
    seen = []
    for _ in range(2):  # a build, then a cache hit
        with mr.data_warnings([]) as notes:
            index = mi.build_index(meta, processor, data_cfg())
        seen.append((index.cache_status, notes))
    length = (f"{meta}: subset 'sub': the meta says length = 5 but {tmp_path}/MMPR-t/annotations/sub.jsonl has 2 "
              "records")
    assert seen == [("built", [length]), ("hit", [length])]


def test_a_subset_that_adds_no_pair_is_a_notice(tmp_path, processor):
    """QA: a subset whose annotation file is empty (no `length` in the meta), or whose records are all dropped, vanished
    into the totals of train.py's data line; each is a notice now (the run goes on with the other subsets)."""
    meta = write_set(tmp_path, [record(0), record(1)], {"a.png": rgb()})
    spec = json.loads(meta.read_text())
    ann = meta.parent / "annotations"
    (ann / "empty.jsonl").write_text("\n\n")  # blank lines are not records
    gone = (record(2, image="nope.png"), record(3, chosen=" "))  # image_missing, empty_response
    (ann / "gone.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gone))
    for name in ("empty", "gone"):
        spec[name] = dict(spec["sub"], annotation=f"MMPR-t/annotations/{name}.jsonl")
    meta.write_text(json.dumps(spec))
    with mr.data_warnings([]) as notes:
        index = mi.build_index(meta, processor, data_cfg(), use_cache=False)
    assert len(index) == 2 and [str(n) for n in notes] == [
        f"{meta}: subset 'empty': {ann / 'empty.jsonl'} holds no records, so the subset adds no pair",
        f"{meta}: subset 'gone': all 2 records of {ann / 'gone.jsonl'} were dropped ({{'image_missing': 1, "
        "'empty_response': 1}), so the subset adds no pair",
    ]


def test_records_that_repeat_another_word_for_word_are_a_notice(tmp_path, processor):
    """QA: duplicated records (a file copied onto itself, the same file under two subsets) were trained as separate
    pairs and leaked into the validation split without a word; they are counted per subset and noted (the pairs stay:
    repetition may be intended, as repeat_time does)."""
    records = [record(0), record(1), record(0), {**record(1), "extra": "ignored"},
               record(2, chosen="  A red square 0.")]
    meta = write_set(tmp_path, records, {"a.png": rgb()})
    spec = json.loads(meta.read_text())
    spec["again"] = dict(spec["sub"])  # the same annotation file under a second subset
    meta.write_text(json.dumps(spec))
    ann = meta.parent / "annotations" / "sub.jsonl"
    with mr.data_warnings([]) as notes:
        index = mi.build_index(meta, processor, data_cfg(), use_cache=False)
    assert len(index) == 10 and index.stats["sub"]["repeats"] == 2 and index.stats["again"]["repeats"] == 5
    assert [str(n) for n in notes] == [
        f"{meta}: subset 'sub': 2 records repeat an earlier record word for word (e.g. {ann}:3 repeats {ann}:1): each "
        "copy is its own pair, and a validation split of these pairs can hold copies of training pairs",
        f"{meta}: subset 'again': 5 records repeat an earlier record word for word (e.g. {ann}:1 repeats {ann}:1 of "
        "subset 'sub'): each copy is its own pair, and a validation split of these pairs can hold copies of training "
        "pairs",
    ]


def test_repeat_time_that_empties_the_data_says_so(tmp_path, processor):
    meta = write_set(tmp_path, [record(i) for i in range(3)], {"a.png": rgb()}, spec={"repeat_time": 0.005})
    with warns_naming(UserWarning, f"{meta}: subset 'sub'", "repeat_time = 0.005", "3 valid records"):
        with raises_naming(mr.DataError, f"{meta}: ", "'sub': repeat_time 0.005 x 3 valid records -> 0 pairs",
                           "drops: {}"):
            mi.build_index(meta, processor, data_cfg())


def test_report_cli_shows_the_new_drop_reasons(tmp_path, capsys):
    meta = write_set(tmp_path, [
        record(0),
        {"video": "clip.mp4", "question": "What happens?", "chosen": "x", "rejected": "y"},
        record(2, chosen="<think>cut", rejected="<think>off"),
        record(3, chosen="Well <think>a</think>Red."),
        record(4, q="<image>\n/think" + "".join(chr(c) for c in range(0xE000, 0xF900))),
    ], {"a.png": rgb()})
    spec = json.loads(meta.read_text())
    (meta.parent / "annotations" / "noroot.jsonl").write_text(json.dumps(record(5)) + "\n")
    spec["noroot"] = {"root": None, "annotation": "MMPR-t/annotations/noroot.jsonl"}
    meta.write_text(json.dumps(spec))
    assert mi.main([str(meta), "--model", str(TINY), "--num-workers", "0"]) == 0
    out = capsys.readouterr().out
    for reason in ("video_missing", "unterminated_reasoning", "malformed_reasoning", "template_rewrites_text",
                   "no_image_root"):
        assert f"    dropped {reason}: 1  e.g. " in out
    assert out.splitlines()[0].split(": ")[1].startswith("1 pairs")


# ----------------------------------------------------------------------------------------------------------------------
# images


def test_image_modes_are_converted_to_rgb(tmp_path):
    def save(name, img, **kw):
        img.save(tmp_path / name, **kw)
        return mm.load_image(tmp_path / name)

    pal = Image.new("P", (4, 4), 1)
    pal.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    assert save("p.png", pal).getpixel((0, 0)) == (10, 200, 30)
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 255))
    rgba.putpixel((1, 1), (0, 255, 0, 0))  # fully transparent green -> white background
    out = save("rgba.png", rgba)
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (255, 0, 0) and out.getpixel((1, 1)) == (255, 255, 255)
    la = Image.new("LA", (4, 4), (50, 0))
    assert save("la.png", la).getpixel((0, 0)) == (255, 255, 255)
    ptrans = Image.new("P", (4, 4), 0)
    ptrans.putpalette([9, 9, 9] * 256)
    assert save("pt.png", ptrans, transparency=0).getpixel((2, 2)) == (255, 255, 255)
    assert save("l.png", Image.new("L", (4, 4), 77)).getpixel((0, 0)) == (77, 77, 77)
    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))
    assert save("c.tif", cmyk).getpixel((0, 0)) == (255, 0, 0)
    a16 = np.array([[0, 257 * 100], [65535, 65535]], dtype=np.uint16)
    out = save("g16.png", Image.fromarray(a16))
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    assert [out.getpixel((x, y)) for y in range(2) for x in range(2)] == [(0,) * 3, (100,) * 3, (255,) * 3, (255,) * 3]


def test_exif_orientation_is_applied(tmp_path, processor):
    img = Image.new("RGB", (64, 32), (255, 0, 0))  # stored 64 wide x 32 high: left half red, right half blue
    img.paste((0, 0, 255), (32, 0, 64, 32))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation 6: display rotated 90 degrees clockwise
    img.save(tmp_path / "rot.jpg", exif=exif, quality=95)
    out = mm.load_image(tmp_path / "rot.jpg")
    assert out.size == (32, 64)  # now 32 wide x 64 high
    top, bottom = np.asarray(out)[5, 16].astype(int), np.asarray(out)[58, 16].astype(int)
    assert abs(top - [255, 0, 0]).max() < 40 and abs(bottom - [0, 0, 255]).max() < 40  # the left edge is on top
    # the index sizes the image in its displayed orientation, as the processor sees it
    meta = write_set(tmp_path / "set", [record(0, image="rot.jpg")], {})
    (tmp_path / "set" / "MMPR-t" / "images" / "rot.jpg").write_bytes((tmp_path / "rot.jpg").read_bytes())
    index = mi.build_index(meta, processor, data_cfg())
    gh, gw = index.image_grid_hw[0].tolist()
    assert gh > gw and (gh, gw) == tuple(processor.image_processor(images=[out])["image_grid_hw"][0].tolist())


@pytest.mark.parametrize("sizes", [[(300, 451)], [(40, 30)], [(900, 120), (64, 64)], [(100, 200)] * 5])
@pytest.mark.parametrize("budget", ["asset", "larger"])
def test_index_image_grids_equal_the_processor(processor, sizes, budget):
    ip = processor.image_processor
    if budget == "larger":  # a budget that depends on the image count: (36 - 4) * 4 = 128 patches, 64 per image
        ip = copy.deepcopy(ip)
        ip.max_num_patches, ip.max_model_len = 2048, 36
        assert mm.image_patch_budget(ip, len(sizes)) == max(128, 64 * len(sizes))
    else:  # the asset: (68 - 4) * 4 = 256 = max_num_patches
        assert mm.image_patch_budget(ip, len(sizes)) == 256
    ref = ip(images=[Image.new("RGB", (w, h)) for h, w in sizes], return_tensors="pt")["image_grid_hw"].tolist()
    assert [list(g) for g in mm.image_grids(ip, sizes)] == ref


def _unprocessable(path, w: int, h: int, own: str = "") -> str:
    """The image_unprocessable detail for a w x h px image of the asset (budget 256)."""
    return (f"{path}: {w}x{h} px, in 16-px patches one side more than 256 times the other: the image processor "
            "cannot size it")


def test_thin_or_wide_images_are_a_counted_drop(tmp_path, processor):
    """An image whose patch grid is more than the patch budget (256 for the asset) times longer on one side than on
    the other (5000x1 px: 313x1 patches) crashed the index build in transformers' get_patch_grid_size with a
    ZeroDivisionError naming no file; such a record is now the drop image_unprocessable with file:line, the other
    records still index, and data.strict makes it an error naming file:line."""
    ip = processor.image_processor
    sizes = {"wide.png": (5000, 8), "tall.png": (2, 5000), "edge.png": (4097, 1),  # refused (width, height)
             "ok_edge.png": (4096, 1), "ok_long.png": (3000, 5), "ok_thin.png": (500, 1)}  # kept
    for name, (w, h) in sizes.items():  # the threshold is the processor's own
        if name.startswith("ok_"):
            ip(images=[rgb(w, h)], return_tensors="pt")
        else:
            with pytest.raises(ZeroDivisionError):
                ip(images=[rgb(w, h)], return_tensors="pt")
    records = [record(0), record(1, image="wide.png"), record(2, image="ok_edge.png"), record(3, image="tall.png"),
            record(4, image="ok_long.png"), record(5, image=["a.png", "edge.png"], q="<image> vs <image>"),
            record(6, image="ok_thin.png")]
    meta = write_set(tmp_path, records, {"a.png": rgb(), **{n: rgb(w, h) for n, (w, h) in sizes.items()}})
    index = mi.build_index(meta, processor, data_cfg(train__max_images_per_row=2), use_cache=False)
    st, images = index.stats["sub"], tmp_path / "MMPR-t" / "images"
    annotation = tmp_path / "MMPR-t" / "annotations" / "sub.jsonl"
    assert st["dropped"] == {"image_unprocessable": 3} and index.line.tolist() == [1, 3, 5, 7]
    assert st["drop_examples"]["image_unprocessable"] == [
        f"{annotation}:2: " + _unprocessable(images / "wide.png", 5000, 8, "313x1"),
        f"{annotation}:4: " + _unprocessable(images / "tall.png", 2, 5000, "1x313"),
        f"{annotation}:6: " + _unprocessable(images / "edge.png", 4097, 1, "257x1"),  # the second image of the record
    ]
    assert (f"    dropped image_unprocessable: 3  e.g. {annotation}:2: "
            + _unprocessable(images / "wide.png", 5000, 8, "313x1")) in mi.format_report(mi.report(index)).splitlines()
    # the kept thin images: the index's grids are the processor's (4096 x 1 px: 2 x 256 patches)
    ds = md.PairDataset(index, processor)
    assert [ds[i].image_grid_hw.tolist() for i in (1, 2, 3)] == [[[2, 256]], [[2, 188]], [[2, 46]]]
    assert index.image_grid_hw.tolist()[1:] == [[2, 256], [2, 188], [2, 46]]
    cfg = data_cfg(train__max_images_per_row=2, strict=True)
    with raises_naming(mr.DataError, f"{annotation}:2: ", "image_unprocessable",
                       _unprocessable(images / "wide.png", 5000, 8, "313x1"), "data.strict = true"):  # fmt: skip
        mi.build_index(meta, processor, cfg, use_cache=False)
    # image_grids names an image by its position when no paths are given
    with pytest.raises(mm.Drop) as d:
        mm.image_grids(ip, [(40, 48), (1, 5000)])
    assert d.value.reason == "image_unprocessable" and d.value.detail == _unprocessable("image 2", 5000, 1, "313x1")


def test_an_image_made_too_thin_after_indexing_is_one_line_in_training(tmp_path, processor):
    """A training step re-processes a pair's images; an image replaced in place (same path: the same index
    fingerprint) by one too thin for the processor is the DataError naming file:line and the cache to delete, not the
    processor's ZeroDivisionError in a DataLoader worker."""
    meta = write_set(tmp_path, [record(0), record(1, image="b.png")], {"a.png": rgb(), "b.png": rgb(64, 64)})
    index = mi.build_index(meta, processor, data_cfg(strict=True))
    image = tmp_path / "MMPR-t" / "images" / "b.png"
    rgb(1, 5000).save(image)
    ds = md.PairDataset(index, processor)
    loader = md.StepLoader(ds, md.PairSampler([0, 1], seed=0, shuffle=False), global_batch_size=2,
                           plan_fn=lambda ids: (None, ids), num_workers=1)
    annotation = tmp_path / "MMPR-t" / "annotations" / "sub.jsonl"
    with raises_naming(mr.DataError, f"{annotation}:2: image_unprocessable: " + _unprocessable(image, 1, 5000),
                       index.cache_dir):  # fmt: skip
        next(iter(loader))


# ----------------------------------------------------------------------------------------------------------------------
# cache


def _same(a: mi.MMPRIndex, b: mi.MMPRIndex) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) if isinstance(getattr(a, k), torch.Tensor)
               else getattr(a, k) == getattr(b, k) for k in a.state() if k != "build_seconds")


def test_cache_hit_miss_and_invalidation(tmp_path, processor, hf_cache):
    meta = write_set(tmp_path, [record(i) for i in range(4)], {"a.png": rgb()})
    cfg = data_cfg()
    first = mi.build_index(meta, processor, cfg)
    assert first.cache_status == "built" and Path(first.cache_dir).parent == hf_cache
    assert sorted(p.name for p in Path(first.cache_dir).iterdir()) == ["index.json", "index.pt"]
    hit = mi.build_index(meta, processor, cfg)
    assert hit.cache_status == "hit" and hit.cache_dir == first.cache_dir and _same(first, hit)
    # no temporary folders left behind
    assert [p.name for p in hf_cache.iterdir()] == [Path(first.cache_dir).name]
    # changed annotation file -> miss, new content indexed
    ann = tmp_path / "MMPR-t" / "annotations" / "sub.jsonl"
    ann.write_text(ann.read_text() + json.dumps(record(9)) + "\n")
    changed = mi.build_index(meta, processor, cfg)
    assert changed.cache_status == "built" and changed.cache_dir != first.cache_dir and len(changed) == 5
    # changed tokenizer (one more token) -> miss; changed settings -> miss
    other = copy.deepcopy(processor)
    other.tokenizer.add_tokens(["<new_token>"])
    assert mi.build_index(meta, other, cfg).cache_status == "built"
    assert mi.build_index(meta, processor, data_cfg(max_seq_length=4000)).cache_status == "built"
    assert mi.build_index(meta, processor, cfg, max_samples=2).cache_status == "built"
    assert mi.build_index(meta, processor, cfg).cache_status == "hit"
    assert mi.build_index(meta, processor, cfg, use_cache=False).cache_status == "disabled"


def test_corrupt_or_partial_cache_is_reported_and_rebuilt(tmp_path, processor):
    meta = write_set(tmp_path, [record(i) for i in range(3)], {"a.png": rgb()})
    cfg = data_cfg()
    good = mi.build_index(meta, processor, cfg)
    folder = Path(good.cache_dir)
    data = (folder / "index.pt").read_bytes()
    (folder / "index.pt").write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])  # one flipped byte
    with warns_naming(UserWarning, folder, "checksum mismatch"):
        again = mi.build_index(meta, processor, cfg)
    assert again.cache_status.startswith("rebuilt: ") and "checksum" in again.cache_status and _same(good, again)
    assert mi.build_index(meta, processor, cfg).cache_status == "hit"
    (folder / "index.json").unlink()  # partial: manifest missing
    with warns_naming(UserWarning, folder, "FileNotFoundError"):
        assert mi.build_index(meta, processor, cfg).cache_status.startswith("rebuilt")
    (folder / "index.pt").write_bytes(data[: len(data) // 2])  # truncated payload
    with warns_naming(UserWarning, folder):
        assert _same(good, mi.build_index(meta, processor, cfg))


def test_cache_root_follows_hf_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "a"))
    assert mi._cache_root() == tmp_path / "a"
    monkeypatch.delenv("HF_DATASETS_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "h"))
    assert mi._cache_root() == tmp_path / "h" / "datasets"
    monkeypatch.delenv("HF_HOME")
    assert mi._cache_root() == Path.home() / ".cache" / "huggingface" / "datasets"


# ----------------------------------------------------------------------------------------------------------------------
# splits, sampler, loader


def test_validation_split(sample, tmp_path, processor):
    index, _ = sample
    tr, va = mi.split_validation(index, 4, seed=42)
    assert len(va) == 4 and len(tr) == 30 and not set(tr) & set(va) and sorted(tr + va) == list(range(34))
    assert mi.split_validation(index, 4, seed=42) == (tr, va) and mi.split_validation(index, 4, seed=1)[1] != va
    assert len(mi.split_validation(index, 0.25, seed=0)[1]) == 8  # floor(0.25 * 34)
    with raises_naming(mr.DataError, "data.train.split_validation_size = 34", "of 34"):
        mi.split_validation(index, 34, seed=0)
    # repeats of one record stay on one side
    meta = write_set(tmp_path, [record(i) for i in range(6)], {"a.png": rgb()}, spec={"repeat_time": 3})
    rep = mi.build_index(meta, processor, data_cfg())
    tr, va = mi.split_validation(rep, 0.5, seed=5)
    assert not {int(rep.line[i]) for i in tr} & {int(rep.line[i]) for i in va} and len(va) == 9
    # load_splits: from split_validation_size, or a separate validation meta
    cfg = data_cfg()
    cfg.train.data_path, cfg.train.split_validation_size = str(SAMPLE_META), 4
    train, val = mi.load_splits(processor, cfg)
    assert len(train.pair_ids) == 30 and len(val.pair_ids) == 4 and val.index is train.index
    cfg.validation.data_path = str(meta)
    with warns_naming(UserWarning, "data.validation.data_path", "data.train.split_validation_size"):
        train, val = mi.load_splits(processor, cfg)
    assert len(train.pair_ids) == 34 and len(val.index) == 18 and val.index.meta_path == str(meta)


def test_sampler_order_and_resume():
    ids = list(range(100, 110))
    a, b = md.PairSampler(ids, seed=3), md.PairSampler(ids, seed=3)  # two ranks
    first = a.take(7)
    assert first == b.take(7)
    state = a.state_dict()
    assert state == {"epoch": 0, "offset": 7, "deferred": [], "num_pairs": 10, "seed": 3, "shuffle": True,
                     "fingerprint": ""}
    cont = a.take(8)  # crosses into epoch 1, whose order starts [104, 101, 102, 108, 105, ...]
    assert sorted(first + cont[:3]) == ids  # epoch 0 is a permutation
    # 108 and 105 ended epoch 0 in this step: their epoch-1 draws are deferred to the next step, never repeated here
    assert cont == [105, 103, 108, 104, 101, 102, 100, 107] and len(set(cont)) == 8
    assert a.state_dict()["epoch"] == 1 and a.state_dict()["offset"] == 7 and a.state_dict()["deferred"] == [108, 105]
    resumed = md.PairSampler(ids, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.take(8) == cont  # continues with the next unseen pair
    e0, e1 = a.epoch_order(0), a.epoch_order(1)
    assert sorted(e1) == ids and e0 != e1 and e0 != ids
    unshuffled = md.PairSampler(ids, seed=3, shuffle=False)
    assert unshuffled.take(10) + unshuffled.take(2) == ids + ids[:2]
    with pytest.raises(AssertionError):
        unshuffled.take(11)
    with raises_naming(mr.DataError, "num_pairs 10 -> 9"):
        md.PairSampler(ids[:9], seed=3).load_state_dict(state)
    with raises_naming(mr.DataError, "seed 3 -> 4", "data.train.seed"):
        md.PairSampler(ids, seed=4).load_state_dict(state)


def test_sampler_never_repeats_a_pair_within_a_step_across_epoch_boundaries():
    """27 pairs, 4 per step: step 7 straddles the epoch boundary (3 pairs of epoch 0, then epoch 1, which begins with
    pair 1 of the tail); every step holds 4 distinct pairs, every epoch pass draws every pair exactly once."""
    a = md.PairSampler(list(range(27)), seed=42)
    steps = [a.take(4) for _ in range(14)]
    assert all(len(set(s)) == 4 for s in steps)
    assert sorted([p for s in steps[:6] for p in s] + steps[6][:3]) == list(range(27))  # epoch 0, once each
    assert a.epoch_order(1)[0] == 1 and 1 in steps[6][:3]  # the repeat the old sampler put in step 7
    assert steps[6] == [1, 13, 8, 11] and steps[7][0] == 1  # deferred: pair 1 opens step 8
    flat = [p for s in steps for p in s][27:]  # epoch 1 (and the start of epoch 2): each pair once within 27 draws
    assert sorted(flat[:27]) == list(range(27))
    # resume from the state after step 7 (a deferral pending) continues identically
    b = md.PairSampler(list(range(27)), seed=42)
    for _ in range(7):
        b.take(4)
    state = json.loads(json.dumps(b.state_dict()))
    assert state["deferred"] == [1]
    c = md.PairSampler(list(range(27)), seed=42)
    c.load_state_dict(state)
    assert [c.take(4) for _ in range(7)] == steps[7:]


def test_step_loader_with_workers_and_packer(sample, processor):
    index, ds = sample
    cfg = Config()
    cfg.packing.max_tokens_per_bin, cfg.packing.max_sequences_per_bin = 1024, 2
    cfg.packing.shared_prompt = False  # separate records (the plan reads no prompt lengths)
    dp, rank = 2, 1

    def plan_fn(ids):
        plan = plan_step(index.lengths(ids), cfg.packing, dp)
        return plan, [p for b in plan.ranks[rank] for p in b.pair_ids]

    sampler = md.PairSampler(list(range(len(index))), seed=0)
    loader = md.StepLoader(ds, sampler, global_batch_size=6, plan_fn=plan_fn, num_workers=2)
    ref = md.PairSampler(list(range(len(index))), seed=0)
    steps = []
    for step in loader:
        steps.append(step)
        if len(steps) == 3:
            break
    for step in steps:
        assert step.pair_ids == ref.take(6) and step.sampler_state == ref.state_dict()
        mine = {p for b in step.plan.ranks[rank] for p in b.pair_ids}
        assert set(step.pairs) == mine and mine < set(step.pair_ids)  # only this rank's pairs are decoded
        for b in step.plan.ranks[rank]:
            batch = pack([step.pairs[p] for p in b.pair_ids], divisible_by=8, image_token_id=IMAGE_ID)
            assert batch.input_ids.shape[1] <= 1024
        for p, pair in step.pairs.items():
            assert torch.equal(pair.chosen_ids, ds[p].chosen_ids)
    # resuming from a step's saved state gives the following steps
    resumed = md.PairSampler(list(range(len(index))), seed=0)
    resumed.load_state_dict(steps[1].sampler_state)
    assert resumed.take(6) == steps[2].pair_ids


def test_a_data_error_in_a_loader_worker_keeps_its_one_line_message(tmp_path, processor):
    """A DataError raised in a DataLoader worker (data.num_workers >= 1) reached train.py as torch's
    "Caught DataError in DataLoader worker process 0." plus the worker's traceback; the training process now raises
    the worker's own one-line message (file:line: reason)."""
    buf = io.BytesIO()
    rgb(64, 64).save(buf, format="PNG")
    meta = write_set(tmp_path, [record(0), record(1, image="b.png")], {"a.png": rgb(), "b.png": buf.getvalue()})
    index = mi.build_index(meta, processor, data_cfg(strict=True))  # every record good at build time
    image = tmp_path / "MMPR-t" / "images" / "b.png"
    image.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])  # the image changes after the index was built
    ds = md.PairDataset(index, processor)
    sampler = md.PairSampler([0, 1], seed=0, shuffle=False)
    loader = md.StepLoader(ds, sampler, global_batch_size=2, plan_fn=lambda ids: (None, ids), num_workers=1)
    annotation = tmp_path / "MMPR-t" / "annotations" / "sub.jsonl"
    with raises_naming(mr.DataError, f"{annotation}:2: image_truncated: {image}: ", "image file is truncated",
                       index.cache_dir):  # PIL's words for the cause, and the index cache to delete  # fmt: skip
        next(iter(loader))


def test_a_loader_worker_that_dies_is_one_error_naming_its_pairs(tmp_path, processor, monkeypatch):
    """A DataLoader worker killed while it decodes a pair (out of memory, a decoder's crash) is a DataError naming
    the pairs it was loading (file:line), not torch's traceback."""
    import signal

    meta = write_set(tmp_path, [record(0), record(1, image="b.png")], {"a.png": rgb(), "b.png": rgb(64, 64)})
    index = mi.build_index(meta, processor, data_cfg())
    real = md.load_image
    monkeypatch.setattr(md, "load_image", lambda p: os.kill(os.getpid(), signal.SIGKILL) if p.endswith("b.png")
                        else real(p))
    loader = md.StepLoader(md.PairDataset(index, processor), md.PairSampler([0, 1], seed=0, shuffle=False),
                           global_batch_size=2, plan_fn=lambda ids: (None, ids), num_workers=1)
    with raises_naming(mr.DataError, f"{tmp_path / 'MMPR-t' / 'annotations' / 'sub.jsonl'}:2", "data.num_workers"):
        next(iter(loader))


def test_a_stop_signal_while_a_loader_worker_starts_does_not_kill_it(tmp_path, processor, monkeypatch):
    """A SIGTERM from torchrun (another process than the worker's parent) that reached a DataLoader worker after its
    fork but before its worker_init_fn killed it (torch's worker handler re-raises such a SIGTERM), and the rank's step
    with it. Here the worker's start takes a second, and the signal comes 0.2 s after the fork: the first step loads."""
    import threading

    import psutil

    meta = write_set(tmp_path, [record(0), record(1)], {"a.png": rgb()})
    index = mi.build_index(meta, processor, data_cfg())
    ds = md.PairDataset(index, processor)
    loader = md.StepLoader(ds, md.PairSampler([0, 1], seed=0, shuffle=False), global_batch_size=2,
                           plan_fn=lambda ids: (None, ids), num_workers=1)  # fmt: skip
    deaf = md.ignore_stop_signals
    monkeypatch.setattr(md, "ignore_stop_signals", lambda *a: (time.sleep(1.0), deaf(*a)))
    before, sent = {c.pid for c in psutil.Process().children()}, []

    def signal_the_new_worker():
        deadline = time.time() + 30
        while time.time() < deadline and not sent:
            new = [c.pid for c in psutil.Process().children() if c.pid not in before]
            if new:
                time.sleep(0.2)
                subprocess.run(["kill", "-TERM", str(new[0])], check=True)  # si_pid: not the worker's parent
                sent.append(new[0])
            time.sleep(0.01)

    thread = threading.Thread(target=signal_the_new_worker)
    thread.start()
    try:
        step = next(iter(loader))
    finally:
        thread.join()
    assert sent and sorted(step.pairs) == [0, 1]


def test_sampler_state_notes_changed_data_with_the_same_pair_count():
    """The sampler state carries the index fingerprint; a resume over data with the same pair count but
    another fingerprint returns the note train.resume prints; no note for the same data or an older state without a
    fingerprint; another pair count is still refused."""
    a = md.PairSampler(list(range(10)), seed=1, fingerprint="a" * 64)
    a.take(4)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["fingerprint"] == "a" * 64
    assert md.PairSampler(list(range(10)), seed=1, fingerprint="a" * 64).load_state_dict(state) is None
    changed = md.PairSampler(list(range(10)), seed=1, fingerprint="b" * 64)
    assert changed.load_state_dict(state) == (
        "index fingerprint aaaaaaaaaaaa -> bbbbbbbbbbbb: the meta-recipe, an annotation file (size or mtime), an "
        "image folder, the processor or a data setting differs; the same 10 pairs, so the run continues from the "
        "saved position"
    )
    assert changed.take(3) == a.take(3)  # the position still applies
    old = {k: v for k, v in state.items() if k != "fingerprint"}  # a checkpoint written before the field existed
    assert md.PairSampler(list(range(10)), seed=1, fingerprint="b" * 64).load_state_dict(old) is None
    with raises_naming(mr.DataError, "sampler state", "num_pairs 10 -> 9"):
        md.PairSampler(list(range(9)), seed=1, fingerprint="b" * 64).load_state_dict(state)
    with raises_naming(mr.DataError, "shuffle True -> False", "data.train.shuffle"):
        md.PairSampler(list(range(10)), seed=1, shuffle=False, fingerprint="a" * 64).load_state_dict(state)


def test_the_wait_for_rank_0s_index_build_uses_a_gloo_group_with_a_long_timeout(tmp_path, processor, monkeypatch):
    """The other ranks waited for rank 0's index build on the default group, whose NCCL timeout (10 min) is
    far shorter than a build over a full MMPR release; the wait is now on a gloo group with INDEX_BUILD_TIMEOUT (as
    rank 1 sees it here, torch.distributed replaced by recorders)."""
    import datetime

    meta = write_set(tmp_path, [record(0), record(1)], {"a.png": rgb()})
    dist, calls, group = torch.distributed, [], object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.append(("new_group", kw)) or group)
    monkeypatch.setattr(dist, "broadcast_object_list",
                        lambda msg, src, group=None: calls.append(("broadcast", msg, src, group)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda g=None: calls.append(("destroy", g)))
    index = mi.build_index(meta, processor, data_cfg())
    assert mi.INDEX_BUILD_TIMEOUT == datetime.timedelta(hours=24)
    assert calls == [("new_group", {"backend": "gloo", "timeout": datetime.timedelta(hours=24)}),
                     ("broadcast", [None], 0, group), ("destroy", group)]  # fmt: skip
    assert len(index) == 2


# ----------------------------------------------------------------------------------------------------------------------
# report and CLI


def test_report_json_cli(tmp_path, processor, capsys):
    # in-process (a subprocess would pay the transformers import again); `python mmpr_index.py` calls this main
    assert mi.main([str(SAMPLE_META), "--model", str(TINY), "--max-samples", "20", "--json", "--num-workers", "2"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["num_pairs"] == 20 and rep["cache"] == "built" and rep["cache_dir"].startswith(str(tmp_path))
    subs = rep["subsets"]
    assert list(subs) == ["chartqa_train_extracted_pairs_vqa_correctness_rules",
                          "geoqa_plus_extracted_pairs_vqa_format_rules",
                          "cc0_photos_extracted_prefix_pair_sr0.5_with_image"]
    assert [subs[s]["pairs"] for s in subs] == [12, 8, 0] and rep["total"]["dropped"] == {}
    lengths = subs["chartqa_train_extracted_pairs_vqa_correctness_rules"]["lengths"]
    assert set(lengths) == {"prompt", "image_tokens", "video_tokens", "chosen", "rejected"}
    for p in lengths.values():
        assert p["min"] <= p["p50"] <= p["p90"] <= p["p99"] <= p["max"]
    assert lengths["image_tokens"]["max"] <= 64 and lengths["chosen"]["min"] > lengths["prompt"]["min"]
    # the same numbers as the in-process report
    ref = mi.report(mi.build_index(SAMPLE_META, processor, data_cfg(), max_samples=20))
    assert rep["subsets"] == json.loads(json.dumps(ref["subsets"])) and rep["total"] == json.loads(json.dumps(
        ref["total"]))


def test_cli_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        mi.main(["--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal width
    for option, default in (("--max-samples MAX_SAMPLES", "(default 0 = all)"),
                            ("--max-seq-length MAX_SEQ_LENGTH data.max_seq_length", "(default 8192)"),
                            ("--num-workers NUM_WORKERS", f"(default {min(8, os.cpu_count() or 1)} = min(8, CPUs))")):
        assert option in help_text and default in help_text.split(option)[-1].split(" --")[0]


def test_cli_names_its_own_flags_where_the_messages_name_config_keys(tmp_path, capsys):
    """The report said `> data.max_seq_length = 1000` and a missing root `(set data.train.data_root to its base)`:
    config keys that this command line spells --max-seq-length and --data-root."""
    meta = write_set(tmp_path, [record(0), record(1, chosen="word " * 3000)], {"a.png": rgb()})
    assert mi.main([str(meta), "--model", str(TINY), "--num-workers", "0", "--max-seq-length", "1000",
                    "--no-cache"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "    dropped too_long: 1  e.g. " in out and "tokens > --max-seq-length = 1000" in out
    assert "data.max_seq_length" not in out
    assert mi.cli_text("x (set data.train.data_root to its base); data.train.max_samples = 3") == \
        "x (set --data-root to its base); --max-samples = 3"


def test_cli_prebuilds_the_cache_a_run_with_other_data_settings_finds(tmp_path, monkeypatch, capsys):
    """QA: a run with data.train.max_images_per_row or data.train.seed off their defaults could not find the cache
    `python mmpr_index.py` had built (no such flags; the seed was in the fingerprint even with no sampled subset) and
    silently rebuilt it, for hours on MMPR. The flags exist now, and the seed counts only for a fractional
    repeat_time."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    processor = mi.load_processor(TINY, "--model")
    meta = write_set(tmp_path, [record(i) for i in range(6)], {"a.png": rgb()})
    assert mi.main([str(meta), "--model", str(TINY), "--num-workers", "0", "--max-images-per-row", "3",
                    "--seed", "7"]) == 0  # fmt: skip
    assert "(cache hit" not in capsys.readouterr().out
    run = data_cfg(num_workers=0, train__max_images_per_row=3)
    assert mi.build_index(meta, processor, run).cache_status == "hit"  # the run's seed (42) does not matter here
    run.train.max_images_per_row = 2
    assert mi.build_index(meta, processor, run).cache_status == "built"
    half = write_set(tmp_path / "h", [record(i) for i in range(6)], {"a.png": rgb()}, spec={"repeat_time": 0.5})
    picked = {}
    for seed, status in ((42, "built"), (42, "hit"), (7, "built")):
        index = mi.build_index(half, processor, data_cfg(num_workers=0, train__seed=seed))
        assert index.cache_status == status and len(index) == 3
        picked[seed] = index.line.tolist()
    assert picked[42] != picked[7]  # the seed picks other records: it must be in the fingerprint
    with raises_naming(mr.DataError, "--max-images-per-row = 0", ">= 1"):
        mi.main([str(meta), "--model", str(TINY), "--max-images-per-row", "0"])


def test_cli_report_quotes_a_lone_surrogate_without_a_crash(tmp_path):
    """QA: an image path with a lone surrogate escape ("chart_\\ud83d.png", an image_missing drop) ended the report in
    UnicodeEncodeError while printing its drop example."""
    meta = write_set(tmp_path, [record(0), record(1, image="chart_\ud83d.png")], {"a.png": rgb()})
    proc = subprocess.run([sys.executable, "mmpr_index.py", str(meta), "--model", str(TINY), "--num-workers", "0",
                           "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "    dropped image_missing: 1  e.g. " in proc.stdout and "chart_\\ud83d.png does not exist" in proc.stdout


def test_cli_bad_meta_is_one_line_naming_the_file(tmp_path):
    meta = tmp_path / "meta.json"
    meta.write_text('{"a": {"root": "img", "annotation": "a.jsonl",},}')  # trailing commas
    proc = subprocess.run([sys.executable, "mmpr_index.py", str(meta), "--model", str(TINY)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"error: {meta}:1:47: invalid JSON: Expecting property name enclosed in double quotes" in proc.stderr


def test_cli_model_that_is_not_a_local_directory_is_one_immediate_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="0")  # a hub lookup would be tried (and retried) without the check
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "mmpr_index.py", str(SAMPLE_META), "--model", "assets/nope"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and time.perf_counter() - t < 60
    err = proc.stderr  # one line: the flag and its value, the file missing, and the directory it is relative to
    assert err.startswith("error: --model 'assets/nope': ") and err.count("\n") == 1, err
    assert "config.json" in err and f"{ROOT})" in err and "Traceback" not in err, err


def test_model_without_processor_files_is_one_line_naming_the_setting(tmp_path, processor):
    """A model directory with config.json but no tokenizer / processor files ended `mmpr_index.py --model` and
    train.py's data loading in transformers' ValueError traceback (one per rank under torchrun)."""
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    for key in ("--model", "model.hf_path"):
        with raises_naming(mr.DataError, f"{key} {str(tmp_path)!r}: ", f"Unrecognized processing class in {tmp_path}."
                           ) as e:  # the setting, its value, and transformers' first line  # fmt: skip
            mi.load_processor(tmp_path, key)
        assert "\n" not in str(e.value)
    with raises_naming(mr.DataError, "model.hf_path 'assets/nope'", "config.json"):
        mi.load_processor("assets/nope", "model.hf_path")
    assert mi.processor_identity(mi.load_processor(TINY, "--model")) == mi.processor_identity(processor)


def test_report_text_and_values(tmp_path, processor):
    meta = write_set(tmp_path, [record(0), record(1, image="nope.png"), record(2)], {"a.png": rgb()})
    index = mi.build_index(meta, processor, data_cfg())
    rep = mi.report(index)
    assert rep["total"]["rows_read"] == 3 and rep["total"]["pairs"] == 2 and rep["total"]["dropped"] == {
        "image_missing": 1}
    c = index.chosen_len.double()
    assert rep["total"]["lengths"]["chosen"]["p50"] == pytest.approx(float(c.median() if len(c) % 2 else c.mean()))
    text = mi.format_report(rep)
    assert "dropped image_missing: 1  e.g. " in text and "sub.jsonl:2" in text
    assert text.splitlines()[2].split()[:5] == ["sub", "3", "2", "2", "1"]


# ----------------------------------------------------------------------------------------------------------------------
# distributed: rank 0 builds, the other waits and reads; a failure on rank 0 reaches every rank


@pytest.mark.slow  # two processes importing transformers: ~25 s on 2 busy cores
def test_rank0_builds_and_others_read_under_torchrun(torchrun, tmp_path):
    bad = write_set(tmp_path / "bad", [record(0, image="nope.png")], {})
    env = {"MODEL": str(TINY), "META": str(SAMPLE_META), "BAD_META": str(bad),
           "HF_DATASETS_CACHE": str(tmp_path / "shared_cache"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    res = torchrun(Path(__file__).resolve().parent / "dist" / "check_mmpr_index.py", env=env).ranks
    assert set(res) == {0, 1}
    assert res[0]["status"] == "built" and res[1]["status"] == "hit"
    assert res[0]["n"] == res[1]["n"] == 34 and res[0]["lens"] == res[1]["lens"]
    assert res[0]["order"] == res[1]["order"]  # the same global order on every rank
    assert "sub.jsonl:1: record dropped (image_missing" in res[0]["err"]
    assert res[1]["err"].startswith("rank 0 failed to build the MMPR index: DataError:")
    assert "sub.jsonl:1" in res[1]["err"]

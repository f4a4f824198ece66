"""Foundation: the typed config (TOML, overrides, every validation error) and the tiny Omni asset in transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import raises_naming

from config import Config, ConfigError, from_dict, load_config, to_dict, validate_parallel

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-omni"
SAMPLE = ROOT / "data" / "mmpr_sample" / "MMPR-sample"


# ----------------------------------------------------------------------------------------------------------------------
# config


def test_nano_recipe_values():
    cfg = load_config(ROOT / "configs" / "nano.toml")
    m = cfg.mpo
    assert (m.reference_policy_kl_penalty, m.preference_loss_weight, m.bco_loss_weight, m.sft_loss_weight) == (
        0.05, 0.8, 0.2, 0.0)
    assert (m.reward_shift_momentum, m.max_num_steps) == (0.99, 7000)
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.scheduler.lr_warmup_steps) == (8e-7, 2e-9, 50)
    assert (cfg.optimizer.adam_beta2, cfg.optimizer.weight_decay, cfg.optimizer.clip_grad) == (0.98, 0.1, 1.0)
    assert cfg.optimizer.grad_reduce_in_fp32  # not dpo.yaml's bf16 buffers (docs/PERFORMANCE.md, "Gradient buffers")
    assert cfg.policy.train_global_batch_size == 256 and cfg.data.max_seq_length == 8192
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.expert_model_parallel_size, p.context_parallel_size) == (8, 8, 1)
    assert p.sequence_parallel and cfg.packing.max_sequences_per_bin == 1 and cfg.checkpoint.save_period == 100
    assert validate_parallel(cfg, world_size=8, num_experts=128) == 1


def test_tiny_config_points_at_shipped_files():
    cfg = load_config(ROOT / "configs" / "tiny.toml")
    assert (ROOT / cfg.model.hf_path / "config.json").is_file()
    assert (ROOT / cfg.data.train.data_path).is_file()
    assert cfg.logging.wandb == "disabled"


def test_overrides_are_parsed_to_the_field_type(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # conftest's "disabled" would override logging.wandb
    cfg = load_config(
        ROOT / "configs" / "tiny.toml",
        ["mpo.max_num_steps=9", "mpo.reward_shift=-0.5", "mpo.quality_average_log_probs=true",
         "data.train.data_path=/abs/meta.json", "logging.wandb=offline", "optimizer.lr=3"],
    )
    assert cfg.mpo.max_num_steps == 9 and isinstance(cfg.mpo.max_num_steps, int)
    assert cfg.mpo.reward_shift == -0.5
    assert cfg.mpo.quality_average_log_probs is True
    assert cfg.data.train.data_path == "/abs/meta.json"
    assert cfg.logging.wandb == "offline"
    assert cfg.optimizer.lr == 3.0 and isinstance(cfg.optimizer.lr, float)


def test_defaults_toml_override_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[mpo]\nmax_num_steps = 5\nreward_shift = 0.25\n")
    cfg = load_config(f, ["mpo.max_num_steps=7"])
    assert cfg.mpo.max_num_steps == 7  # override beats TOML
    assert cfg.mpo.reward_shift == 0.25  # TOML beats default
    assert cfg.mpo.bco_loss_weight == Config().mpo.bco_loss_weight  # default kept


def test_round_trip_through_dict():
    cfg = load_config(ROOT / "configs" / "nano.toml")
    assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg


@pytest.mark.parametrize(
    "override, names",  # the key, its value as read, and the type / choices / bound it must meet
    [
        ("mpo.bogus=1", ["'mpo.bogus'"]),
        ("nosection.x=1", ["'nosection'"]),
        ("mpo.max_num_steps=abc", ["mpo.max_num_steps = 'abc' ", "int"]),
        ("mpo.quality_average_log_probs=maybe", ["mpo.quality_average_log_probs = 'maybe' ", "bool"]),
        ("logging.wandb=sometimes", ["logging.wandb", "['online', 'offline', 'disabled']"]),
        ("packing.pair_grouping_key=prompt", ["packing.pair_grouping_key", "['pair_index']"]),
        ("mpo.preference_loss_weight=-0.1", ["mpo.preference_loss_weight = -0.1 ", ">= 0"]),
        ("mpo.bco_loss_weight=-1", ["mpo.bco_loss_weight = -1.0 ", ">= 0"]),
        ("mpo.reward_shift_momentum=1.0", ["mpo.reward_shift_momentum = 1.0 ", "[0, 1)"]),
        ("mpo.reward_shift_momentum=-0.1", ["mpo.reward_shift_momentum = -0.1 ", "[0, 1)"]),
        ("mpo.stop_after_step=7", ["mpo.stop_after_step = 7 ", "[1, mpo.max_num_steps = 6]"]),
        ("mpo.stop_after_step=-1", ["mpo.stop_after_step = -1 ", "[1, mpo.max_num_steps"]),
        ("policy.train_global_batch_size=0", ["policy.train_global_batch_size = 0 ", ">= 1"]),
        ("mpo", ["'mpo'", "section.key=value"]),
        ("mpo=3", ["mpo ", "[mpo]"]),
        ("optimizer.lr=nan", ["optimizer.lr = 'nan' ", "finite"]),
        ("mpo.reference_policy_kl_penalty=inf", ["mpo.reference_policy_kl_penalty = 'inf' ", "finite"]),
        ("scheduler.lr_warmup_steps=6", ["scheduler.lr_warmup_steps = 6 ", "< mpo.max_num_steps = 6"]),
        ("scheduler.lr_warmup_init=1.0", ["scheduler.lr_warmup_init = 1.0 ", "<= optimizer.lr = 0.0001"]),
        ("data.train.split_validation_size=1.5", ["data.train.split_validation_size = 1.5", "(< 1", "(>= 1)"]),
        # before: int(1.5) = 1 pair, silently
        # QA: 0 was accepted and put NaN into the weights (0/0 in the first update), -1e-8 was torch's traceback
        ("optimizer.adam_eps=0", ["optimizer.adam_eps = 0.0 ", "> 0"]),
        ("optimizer.adam_eps=-1e-8", ["optimizer.adam_eps = -1e-08 ", "> 0"]),
        ("optimizer.adam_eps=1e-300", ["optimizer.adam_eps = 1e-300 ", "> 0"]),  # 0 in fp32
    ],
)
def test_invalid_overrides_name_the_key(override, names):
    with raises_naming(ConfigError, *names):
        load_config(ROOT / "configs" / "tiny.toml", [override])


NO_WEIGHTS = ["mpo.preference_loss_weight=0", "mpo.bco_loss_weight=0", "mpo.sft_loss_weight=0"]


@pytest.mark.parametrize("overrides, keys", [
    (NO_WEIGHTS, ["mpo.preference_loss_weight", "mpo.bco_loss_weight", "mpo.sft_loss_weight", "all 0"]),
    (NO_WEIGHTS + ["mpo.reference_policy_kl_penalty=0"], ["mpo.sft_loss_weight", "all 0"]),
    (["mpo.reference_policy_kl_penalty=0"],  # tiny.toml: w_p 0.8, w_q 0.2
     ["mpo.reference_policy_kl_penalty = 0", "mpo.preference_loss_weight = 0.8", "mpo.bco_loss_weight = 0.2"]),
    (["mpo.reference_policy_kl_penalty=0", "mpo.preference_loss_weight=0", "mpo.sft_loss_weight=1"],
     ["mpo.reference_policy_kl_penalty = 0", "mpo.bco_loss_weight = 0.2"]),
])  # fmt: skip
def test_settings_that_train_nothing_are_refused(overrides, keys):
    """All loss weights 0, or beta = 0 under a DPO / BCO weight (those terms are then constant: ln 2 and
    2 ln 2 at delta = 0), trained nothing (loss or grad norm 0 on every step) and were accepted."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "tiny.toml", overrides)
    assert all(k in str(e.value) for k in keys) and "\n" not in str(e.value)


def test_beta_zero_is_accepted_when_only_the_sft_term_trains():
    """The SFT term does not use beta: beta = 0 with w_p = w_q = 0 and w_g > 0 trains the SFT NLL."""
    sft_only = ["mpo.reference_policy_kl_penalty=0", "mpo.preference_loss_weight=0", "mpo.bco_loss_weight=0",
                "mpo.sft_loss_weight=1"]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "tiny.toml", sft_only)
    assert (cfg.mpo.reference_policy_kl_penalty, cfg.mpo.sft_loss_weight) == (0.0, 1.0)

def test_toml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[mpo]\nmax_num_steps = 'ten'\n")
    with raises_naming(ConfigError, f"{bad}: ", "mpo.max_num_steps = 'ten'", "expected int"):
        load_config(bad)
    bad.write_text("[mpo\n")
    with raises_naming(ConfigError, f"{bad}: ", "line 1, column 5"):
        load_config(bad)
    bad.write_text("[optimizer]\nlr = nan\n")  # TOML has nan and inf; no field means them
    with raises_naming(ConfigError, f"{bad}: ", "optimizer.lr = nan"):
        load_config(bad)
    bad.write_text("[mpo]\nmax_num_steps = 3.5\n")  # a float is not an int in TOML
    with raises_naming(ConfigError, f"{bad}: ", "mpo.max_num_steps = 3.5", "expected int"):
        load_config(bad)


def test_parallel_validation_messages():
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["policy.train_global_batch_size=3"])
    with raises_naming(ConfigError, "policy.train_global_batch_size = 3", "DP = world 2 / (TP 1 * CP 1) = 2"):
        validate_parallel(cfg, world_size=2)
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["parallel.tensor_model_parallel_size=2"])
    with raises_naming(ConfigError, "world size 3", "parallel.tensor_model_parallel_size (2)",
                       "parallel.context_parallel_size (1)"):
        validate_parallel(cfg, world_size=3)
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["parallel.expert_model_parallel_size=3"])
    with raises_naming(ConfigError, "parallel.expert_model_parallel_size (3)", "world size 2"):
        validate_parallel(cfg, world_size=2)
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["parallel.expert_model_parallel_size=2"])
    with raises_naming(ConfigError, "parallel.expert_model_parallel_size = 2", "expert count 5"):
        validate_parallel(cfg, world_size=2, num_experts=5)
    assert validate_parallel(cfg, world_size=2, num_experts=4) == 2


def test_sequence_parallel_without_tensor_parallelism_names_both_keys():
    """SP with TP = 1 was megatron-core's "Cannot use sequence parallelism without tensor parallelism" with
    no key named (preflight matched field names, not megatron's words); config.validate refuses it first."""
    with raises_naming(ConfigError, "parallel.sequence_parallel = true", "parallel.tensor_model_parallel_size"):
        load_config(ROOT / "configs" / "tiny.toml", ["parallel.sequence_parallel=true"])
    load_config(ROOT / "configs" / "tiny.toml", ["parallel.sequence_parallel=true",
                                                 "parallel.tensor_model_parallel_size=2"])  # fmt: skip
    # past validate (a config object changed by hand), preflight maps megatron-core's words to both keys
    import omni_model
    import preflight

    cfg = load_config(ROOT / "configs" / "tiny.toml")
    cfg.parallel.sequence_parallel = True
    with raises_naming(ConfigError, "language model", "parallel.sequence_parallel = True",
                       "parallel.tensor_model_parallel_size = 1", "assets/tiny-omni/config.json"):  # fmt: skip
        preflight.check_model_config(cfg, omni_model.read_hf_config(ROOT / cfg.model.hf_path))


def test_config_cli_prints_resolved_json():
    out = subprocess.run([sys.executable, "config.py", "configs/tiny.toml", "mpo.max_num_steps=3"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["mpo"]["max_num_steps"] == 3
    bad = subprocess.run([sys.executable, "config.py", "configs/tiny.toml", "mpo.max_num_step=3"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: override 'mpo.max_num_step=3': ") and "'mpo.max_num_step'" in bad.stderr


def test_config_cli_reader_leaving_early_is_quiet():
    """`python config.py configs/tiny.toml | head` ended in a BrokenPipeError traceback. With the pipe's read end
    closed before the config is printed: exit status 1 (the Python docs' handling of SIGPIPE), nothing on stderr."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "config.py", "configs/tiny.toml"], cwd=ROOT, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (1, "")


def test_config_cli_help_and_usage_errors(capsys):
    """`python config.py --help` printed "error: config file '--help' not found"; help is the usage (exit 0), a
    missing config file name is argparse's usage + one error line (exit 2), a bad value one `error:` line (exit 1)."""
    import config

    with pytest.raises(SystemExit) as e:
        config.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python config.py [-h] CONFIG.toml [section.key=value ...]")
    with pytest.raises(SystemExit) as e:
        config.main([])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and err[-1].startswith("python config.py: error: ") and "CONFIG.toml" in err[-1], err
    assert config.main([str(ROOT / "configs" / "tiny.toml"), "optimizer.lr=abc"]) == 1
    captured = capsys.readouterr()
    err = captured.err  # one `error:` line naming the override, the key, its value and the type
    assert captured.out == "" and err.startswith("error: override 'optimizer.lr=abc': optimizer.lr = 'abc' "), err
    assert err.count("\n") == 1 and "float" in err, err


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_under_torchrun_rank_0_alone_prints_usage_errors_and_help(monkeypatch, capsys, rank, printed):
    """Every rank parses the command line: the usage error (and --help) was printed once per rank."""
    import config

    monkeypatch.setenv("RANK", rank)
    for argv, code in (([], 2), (["--help"], 0), (["a.toml", "--steps", "3"], 2)):
        with pytest.raises(SystemExit) as e:
            config.parse_cli(argv, "train.py", "MPO training")
        out = capsys.readouterr()
        assert e.value.code == code and bool(out.out + out.err) == printed, (argv, out)
    assert config.parse_cli(["a.toml", "x.y=1"], "train.py", "MPO training") == ("a.toml", ["x.y=1"])


def test_tilde_in_every_path_field_is_expanded_once_at_load(tmp_path, monkeypatch, capsys):
    """A `~` in checkpoint.dir made a literal `~` directory in the working directory (`rm -rf ~` then removes the
    home), data.train.data_path passed the preflight (which expanded it) and failed in the loader, model.hf_path was
    never expanded. Now load_config (and from_dict) expand every PATH_KEYS field, from a TOML file or an override."""
    import config

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nhf_path = "~/models/omni"\n[data.train]\ndata_path = "~/mmpr/meta.json"\n'
                    'data_root = "~"\n[data.validation]\ndata_path = "~/val/meta.json"\n'
                    '[logging]\nwandb_project = "~proj"\n')  # fmt: skip
    cfg = load_config(toml, ["checkpoint.dir=~/runs/a"])
    got = (cfg.model.hf_path, cfg.data.train.data_path, cfg.data.train.data_root, cfg.data.validation.data_path,
           cfg.checkpoint.dir, cfg.logging.wandb_project)  # fmt: skip
    assert got == (f"{home}/models/omni", f"{home}/mmpr/meta.json", str(home), f"{home}/val/meta.json",
                   f"{home}/runs/a", "~proj")  # fmt: skip
    assert not (tmp_path / "~").exists() and not Path("~").exists()
    saved = to_dict(load_config(None))
    saved["checkpoint"]["dir"] = "~/old_run"  # a config saved before the expansion existed
    assert from_dict(saved).checkpoint.dir == f"{home}/old_run"
    assert config.main([str(toml), "checkpoint.dir=~/runs/b"]) == 0  # `python config.py` prints it expanded
    printed = json.loads(capsys.readouterr().out)
    assert (printed["checkpoint"]["dir"], printed["model"]["hf_path"]) == (f"{home}/runs/b", f"{home}/models/omni")
    with raises_naming(ConfigError, "checkpoint.dir = '~no_such_user_omni_mpo/run'", "'~no_such_user_omni_mpo' ",
                       "./~no_such_user_omni_mpo/run"):  # fmt: skip
        load_config(None, ["checkpoint.dir=~no_such_user_omni_mpo/run"])


def test_path_keys_list_every_path_field():
    """A new str field is either a path (config.PATH_KEYS: `~` expanded) or listed here as not one."""
    import dataclasses
    import typing

    import config

    def str_fields(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                yield from str_fields(tp, f"{prefix}{f.name}.")
            elif tp is str:
                yield f"{prefix}{f.name}"

    assert sorted(str_fields(Config)) == sorted([*config.PATH_KEYS, "logging.wandb_project", "model.hf_revision"])


def test_preflight_checks_the_expanded_path_the_loader_reads(tmp_path, monkeypatch):
    import preflight

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"model.hf_path={TINY}", "data.train.data_path=~/meta.json",
                                                       f"checkpoint.dir={tmp_path / 'run'}"])  # fmt: skip
    with raises_naming(ConfigError, f"data.train.data_path = '{tmp_path}/meta.json' "):  # `~` expanded
        preflight.check_inputs(cfg)
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["model.hf_path=~/nope"])
    with raises_naming(ConfigError, f"model.hf_path = '{tmp_path}/nope'", "config.json"):
        preflight.check_inputs(cfg)


@pytest.mark.parametrize("value, expected", [
    ('"assets/tiny-omni"', "assets/tiny-omni"),
    ("'assets/tiny-omni'", "assets/tiny-omni"),  # a TOML literal string: no escapes
    (r'"a\tb\u00e9"', "a\tb\u00e9"),  # TOML escapes: tab, é
    (r"'C:\models'", "C:\\models"),
    ('""', ""),
    ('"', '"'),  # one character: not a quoted string, kept as today
    ('"a', '"a'),
    ("a'b'", "a'b'"),
    ("plain", "plain"),
])  # fmt: skip
def test_a_toml_quoted_override_is_the_string_itself(value, expected):
    """`model.hf_path="assets/tiny-omni"` (quotes kept by the shell's single quotes) was stored with its quotes."""
    assert load_config(None, [f"model.hf_path={value}"]).model.hf_path == expected


def test_quoted_overrides_of_other_fields(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert load_config(None, ["logging.wandb='offline'"]).logging.wandb == "offline"  # a Literal of strings
    for override, names in [  # the override, the key and its value, and TOML's reason / the type / the choices
        ('model.hf_path="a"b"', ["model.hf_path = '\"a\"b\"' ", "TOML", "(Expected newline or end of document"]),
        ('model.hf_path="a\\q"', ["model.hf_path = '\"a\\\\q\"' ", "TOML", "(Unescaped '\\' in a string)"]),
        ('model.hf_path="a" = "b"', ["model.hf_path = '\"a\" = \"b\"' ", "TOML", "(Expected newline"]),
        ('mpo.max_num_steps="3"', ["mpo.max_num_steps = '\"3\"' ", "int"]),  # only string fields take a quoted value
        ("logging.wandb='sometimes'", ["logging.wandb = 'sometimes' ", "['online', 'offline', 'disabled']"]),
    ]:  # fmt: skip
        with raises_naming(ConfigError, f"override {override!r}: ", *names):
            load_config(None, [override])


def test_config_path_that_is_a_directory_or_not_text_is_one_line(tmp_path, monkeypatch, capsys):
    """`python config.py configs/` said "config file 'configs/' not found" although it exists (a directory)."""
    import config

    monkeypatch.chdir(ROOT)
    assert config.main(["configs/"]) == 1
    captured = capsys.readouterr()
    err = captured.err  # one `error:` line naming the path and the TOML files it holds
    assert captured.out == "" and err.startswith("error: config file 'configs/' ") and err.count("\n") == 1, err
    assert "(it holds nano-lora.toml, nano.toml, tiny.toml)" in err, err
    with raises_naming(ConfigError, f"config file '{tmp_path}' ", "no .toml file"):
        load_config(tmp_path)
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\xff\xfe[mpo]\n")
    with raises_naming(ConfigError, f"config file '{binary}' ", "UTF-8", "byte 0"):
        load_config(binary)


# ----------------------------------------------------------------------------------------------------------------------
# tiny Omni asset


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(TINY)


def test_asset_has_hub_layout():
    cfg = json.loads((TINY / "config.json").read_text())
    assert cfg["model_type"] == "NemotronH_Nano_Omni_Reasoning_V3"
    assert set(cfg["llm_config"]["hybrid_override_pattern"]) == set("M*E-")  # every layer kind
    hub_keys = {"llm_config", "vision_config", "vit_hidden_size", "projector_hidden_size", "img_context_token_id"}
    assert hub_keys <= set(cfg)
    from safetensors import safe_open

    with safe_open(TINY / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for k in ("language_model.backbone.layers.0.mixer.in_proj.weight",
              "language_model.backbone.layers.1.mixer.q_proj.weight",
              "language_model.backbone.layers.2.mixer.experts.3.up_proj.weight",
              "language_model.backbone.layers.2.mixer.gate.e_score_correction_bias",
              "language_model.backbone.layers.4.mixer.up_proj.weight",
              "vision_model.radio_model.model.blocks.1.attn.qkv.weight",
              "vision_model.radio_model.model.patch_generator.cls_token.token",
              "vision_model.radio_model.input_conditioner.norm_mean",
              "mlp1.0.weight", "mlp1.1.weight", "mlp1.3.weight", "language_model.lm_head.weight"):
        assert k in keys, k
    assert not any("layer_scale" in k for k in keys)
    index = json.loads((TINY / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == keys
    assert (TINY / "model.safetensors").stat().st_size < 8 * 2**20


def test_special_tokens_are_single_ids(processor):
    tok = processor.tokenizer
    expected = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 10, "<|im_end|>": 11, "<think>": 12,
                "</think>": 13, "<image>": 18, "<img>": 21, "</img>": 22, "<so_embedding>": 27}
    for text, i in expected.items():
        assert tok.encode(text, add_special_tokens=False) == [i], text
        assert tok.decode([i]) == text
    s = "<|im_start|>user\n<img><image><image></img>Hi<|im_end|>"
    ids = tok.encode(s, add_special_tokens=False)
    assert tok.decode(ids) == s
    assert ids.count(18) == 2 and ids[0] == 10 and ids[-1] == 11


def test_chat_template_renders_the_omni_format(processor):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."},
    ]
    out = processor.apply_chat_template(msgs, tokenize=False)
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n"
                   "<|im_start|>assistant\n<think></think>A cat.<|im_end|>\n")
    # empty system turn always emitted; placeholder already in the text -> no prefix; generation prompt thinks
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "<image>\nDescribe."}]}]
    out = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out == ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<image>\nDescribe.<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n")
    out = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert out.endswith("<|im_start|>assistant\n<think></think>")
    # reasoning in the final assistant turn is kept; a /no_think directive is stripped
    msgs = [{"role": "system", "content": "/no_think"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n4"}]
    out = processor.apply_chat_template(msgs, tokenize=False)
    assert out == ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\nadd\n</think>\n4<|im_end|>\n")
    # two images get numbered placeholders
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]}]
    assert "<image 1><image> <image 2><image>\nCompare." in processor.apply_chat_template(msgs, tokenize=False)


def test_processor_expands_images_with_small_budget(processor):
    from PIL import Image

    img = Image.open(SAMPLE / "images" / "Photos" / "chelsea.png")
    batch = processor(images=[img], text="<image>\nDescribe.", return_tensors="pt")
    (gh, gw), = batch["image_grid_hw"].tolist()
    n_tokens = gh * gw // 4
    assert 16 <= n_tokens <= 64 and gh % 2 == 0 and gw % 2 == 0
    ids = batch["input_ids"][0].tolist()
    assert ids.count(18) == n_tokens
    first = ids.index(18)
    assert ids[first - 1] == 21 and ids[first + n_tokens] == 22  # <img> <image>*N </img>
    assert batch["pixel_values"].shape == (gh * gw, 3 * 16 * 16)


def test_transformers_loads_the_asset_and_runs_image_text(processor):
    from PIL import Image
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(TINY, output_loading_info=True)
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    # the only keys transformers does not use: the CLIP input conditioner (the processor normalises)
    assert info["unexpected_keys"] == {"vision_model.input_conditioner.norm_mean",
                                       "vision_model.input_conditioner.norm_std"}
    for layer in model.vision_model.encoder.layer:  # absent from the hub file: must load as identity
        assert torch.equal(layer.layer_scale1.lambda1, torch.ones_like(layer.layer_scale1.lambda1))
    cfg = model.config
    assert cfg.text_config.layers_block_type == [
        "linear_attention", "full_attention", "moe", "linear_attention", "mlp", "moe"]  # from "M*EM-E"
    assert cfg.image_token_id == 18 and cfg.vision_hidden_size == 32
    img = Image.open(SAMPLE / "images" / "ChartQA" / "chart_000.png")
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which is highest?"}]},
         {"role": "assistant", "content": "Figs."}], tokenize=False)
    batch = processor(images=[img], text=text, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
        text_only = model(input_ids=batch["input_ids"][:, :5]).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], 1024)
    assert torch.isfinite(logits).all() and logits.std() > 0
    # causal: the text before the first image token does not depend on the image
    assert torch.allclose(logits[0, :5], text_only[0], atol=1e-5)


def test_input_conditioner_keys_transformers_ignores_repeat_the_processor_statistics(processor):
    """Why transformers' "UNEXPECTED keys" table for vision_model.input_conditioner.norm_mean/std is harmless: the
    native Omni class normalises pixels in its image processor (image_mean / image_std), and those are the stored
    statistics to fp32 precision. The keys stay because the hub checkpoint (and its remote code) has them."""
    from safetensors import safe_open

    with safe_open(TINY / "model.safetensors", "pt") as f:
        mean = f.get_tensor("vision_model.radio_model.input_conditioner.norm_mean")
        std = f.get_tensor("vision_model.radio_model.input_conditioner.norm_std")
    ip = processor.image_processor
    assert mean.shape == std.shape == (3, 1, 1) and mean.dtype == torch.float32
    assert torch.equal(mean.flatten(), torch.tensor(ip.image_mean, dtype=torch.float32))
    assert torch.equal(std.flatten(), torch.tensor(ip.image_std, dtype=torch.float32))


def test_dockerfile_agrees_with_requirements_slurm_and_megatron_patches():
    """The image cannot be built here (no Docker engine): what can drift is checked as text. The Dockerfile's own
    grep drops exactly the torch and torchvision pins of requirements.txt (the container's stay); its megatron-core is
    the release the patches were checked on and requirements.txt pins; its wandb is train.sbatch's WANDB_PIN_VERSION."""
    import re

    from backend import megatron_patches

    docker = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", docker, flags=re.M))
    pattern = re.search(r"grep -vE '([^']+)' /tmp/requirements.txt", docker).group(1)
    kept = subprocess.run(["grep", "-vE", pattern, str(ROOT / "requirements.txt")], capture_output=True, text=True,
                          check=True).stdout.splitlines()  # fmt: skip
    reqs = (ROOT / "requirements.txt").read_text().splitlines()
    assert sorted(set(reqs) - set(kept)) == ["torch==2.14.1", "torchvision==0.29.1"]
    assert args["MEGATRON_CORE_VERSION"] == megatron_patches.MEGATRON_CORE_VERSION_CHECKED
    assert f"megatron-core=={args['MEGATRON_CORE_VERSION']}" in reqs
    sbatch = (ROOT / "slurm" / "train.sbatch").read_text()
    assert f"WANDB_PIN_VERSION=${{WANDB_PIN_VERSION-{args['WANDB_VERSION']}}}" in sbatch
    readme = " ".join((ROOT / "docs" / "CLUSTER.md").read_text().split())
    assert (f"megatron-core {args['MEGATRON_CORE_VERSION']}, mamba-ssm {args['MAMBA_SSM_VERSION']}, causal-conv1d "
            f"{args['CAUSAL_CONV1D_VERSION']}, wandb {args['WANDB_VERSION']} and `requirements.txt`") in readme
    assert f"The image is `{args['BASE_IMAGE']}`" in readme


def test_deterministic_mode_checks_and_sets_its_environment(monkeypatch, capsys):
    """model.deterministic_mode: an environment that contradicts it is one ConfigError before any work; otherwise the
    unset variables get their deterministic values and torch's deterministic algorithms go on (warn_only)."""
    import distributed

    names = list(distributed.DETERMINISTIC_ENV)
    assert names == ["CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "MAMBA_DETERMINISTIC"]
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    distributed.check_deterministic_env(False)  # off: the environment is the user's
    with raises_naming(ConfigError, "model.deterministic_mode = true", "NVTE_ALLOW_NONDETERMINISTIC_ALGO='1'", "'0'"):
        distributed.check_deterministic_env(True)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with raises_naming(ConfigError, "model.deterministic_mode = true", "CUBLAS_WORKSPACE_CONFIG=':0:0'", "':4096:8'",
                       "':16:8'"):  # fmt: skip
        distributed.set_deterministic(True)
    assert not torch.are_deterministic_algorithms_enabled()  # refused before anything was set
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "mamba_ssm", types.ModuleType("mamba_ssm"))  # imported before the config
    monkeypatch.delenv("RANK", raising=False)
    try:
        distributed.set_deterministic(True)
        assert [os.environ.get(n) for n in names] == [":4096:8", "0", "1"]
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        err = capsys.readouterr().err  # one note naming the setting, the module and the variable to export
        assert err.startswith("note: model.deterministic_mode: ") and err.count("\n") == 1, err
        assert "mamba-ssm" in err and "MAMBA_DETERMINISTIC=1" in err, err
        distributed.set_deterministic(True)  # exported (here: by the first call): no note
        assert capsys.readouterr().err == ""
    finally:
        torch.use_deterministic_algorithms(False)
        for name in names:
            os.environ.pop(name, None)
    distributed.set_deterministic(False)  # off: nothing set
    assert [os.environ.get(n) for n in names] == [None] * 3 and not torch.are_deterministic_algorithms_enabled()

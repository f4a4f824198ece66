"""The checks a run makes before it spends time, each failure one config.ConfigError line naming the keys to change.

`check_inputs` (files, run directory, wandb, packing; before init_distributed), `check_model_config` (megatron-core's
rules on the model and layout; before any process group) and `check_splits` (the loaded data against the batch and bin
sizes; before the models are built). Tests: `pytest tests/test_train.py -k "check_"`.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import config as config_mod
import distributed
import hf_weights
import mmpr_index
import model_hub
import omni_model
import pack


def check_inputs(cfg) -> omni_model.OmniHFConfig:
    """The checks that need neither a process group nor a model (a typo fails in seconds): model.hf_path (a hub id
    resolved first: model_hub.resolve_model; `read_model_config`, whose result it returns), the data paths,
    `check_packing`, `check_run_dir`, `check_wandb`, `distributed.check_deterministic_env`."""
    model_hub.resolve_model(cfg)  # a hub id: its snapshot in the hub cache, downloaded when missing
    folder = model_hub.model_dir(cfg.model)
    hf = read_model_config(folder)
    if not hf_weights.has_safetensors(folder):  # HFReader's rule, before any rank loads a weight
        raise config_mod.ConfigError(
            f"model.hf_path = {folder!r}: no model.safetensors.index.json and no *.safetensors there (the "
            "weights of the HF checkpoint)"
        )
    if not cfg.data.train.data_path.strip():
        raise config_mod.ConfigError("data.train.data_path is empty: set it to an MMPR meta-recipe JSON")
    for key, path in (
        ("data.train.data_path", cfg.data.train.data_path),
        ("data.validation.data_path", cfg.data.validation.data_path),
    ):
        if path and not Path(path).is_file():
            raise config_mod.ConfigError(
                f"{key} = {path!r} is not a file (an MMPR meta-recipe JSON{_relative_hint(path)})"
            )
    check_packing(cfg)
    check_run_dir(cfg.checkpoint.dir, folder)
    check_wandb(cfg.logging.wandb)
    distributed.check_deterministic_env(cfg.model.deterministic_mode)
    return hf


def _relative_hint(path: str) -> str:
    return "" if Path(path).is_absolute() else f"; relative paths are relative to the working directory {os.getcwd()}"


def _json_object(path: Path) -> dict | None:
    """The JSON object in file `path`, or None (unreadable, not JSON, another JSON value)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _is_hf_config(obj: dict | None) -> bool:
    """A Hugging Face model config has model_type or architectures (an omni-mpo run's config.json has neither)."""
    return obj is not None and ("model_type" in obj or "architectures" in obj)


def check_packing(cfg) -> None:
    """packing.make_sequence_length_divisible_by against the layout, and packing.shared_prompt = true without CP.

    CP cuts each sequence into 2*CP chunks; SP splits each rank's tokens over TP: the multiple is 2*CP (CP > 1) times TP
    (SP), NeMo-RL's rule (nemo_rl/models/megatron/data.py::_get_pack_sequence_parameters_for_megatron).
    """
    p, pk = cfg.parallel, cfg.packing
    tp, cp, sp = p.tensor_model_parallel_size, p.context_parallel_size, p.sequence_parallel
    if pk.shared_prompt is True and cp > 1:
        raise config_mod.ConfigError(
            f"packing.shared_prompt = true is not supported with parallel.context_parallel_size = {cp} yet; set "
            'packing.shared_prompt = "auto" (separate sequences with CP) or false, or context_parallel_size = 1'
        )
    need = (2 * cp if cp > 1 else 1) * (tp if sp and tp > 1 else 1)
    if pk.make_sequence_length_divisible_by % need != 0:
        raise config_mod.ConfigError(
            f"packing.make_sequence_length_divisible_by = {pk.make_sequence_length_divisible_by} must be a multiple "
            f"of {need} (2*CP with CP > 1, times TP with sequence parallelism) for TP = {tp}, CP = {cp}, "
            f"sequence_parallel = {sp}"
        )


def read_model_config(hf_path: str) -> omni_model.OmniHFConfig:
    """`model.hf_path`'s config.json (`omni_model.read_hf_config`), or a ConfigError naming the key: no config.json,
    not an HF model config (an omni-mpo run's config.json among them), another architecture, or an unsupported
    setting."""
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        raise config_mod.ConfigError(
            f"model.hf_path = {hf_path!r}: no config.json there (a local HF checkpoint directory"
            f"{_relative_hint(hf_path)})"
        )
    obj = _json_object(path)
    if obj is not None and {"model", "mpo", "checkpoint"} <= obj.keys():
        raise config_mod.ConfigError(
            f"model.hf_path = {hf_path!r}: its config.json is an omni-mpo run's resolved config, not an HF model: to "
            f"start from a trained policy, export it first (python hf_export.py {hf_path} OUT) and set "
            "model.hf_path=OUT"
        )
    if not _is_hf_config(obj):
        raise config_mod.ConfigError(
            f"model.hf_path = {hf_path!r}: {path} is not a Hugging Face model config (a JSON object with model_type)"
        )
    if obj.get("model_type") not in omni_model.MODEL_TYPES:
        raise config_mod.ConfigError(
            f"model.hf_path = {hf_path!r}: {path} has model_type {obj.get('model_type')!r}, not Nemotron-3-Nano-Omni's "
            f"({' or '.join(map(repr, omni_model.MODEL_TYPES))})"
        )
    text = obj.get("llm_config") or obj.get("text_config") or {}
    pattern = text.get("hybrid_override_pattern") if isinstance(text, dict) else None
    symbols = set(omni_model._BLOCK_TO_SYMBOL.values())
    if pattern is not None and (not isinstance(pattern, str) or not pattern or set(pattern) - symbols):
        raise config_mod.ConfigError(
            f"model.hf_path = {hf_path!r}: {path} has hybrid_override_pattern {pattern!r}: one character per layer "
            f"from {''.join(sorted(symbols))} (M Mamba, * attention, E MoE, - MLP)"
        )
    try:
        hf = omni_model.read_hf_config(hf_path)
    except ValueError as e:  # a setting this implementation does not support
        raise config_mod.ConfigError(f"model.hf_path = {hf_path!r}: {e}") from None
    if hf_weights.has_safetensors(hf_path):  # the weights' layers are the pattern's (plan.py may plan a bare config)
        layers = {int(k.split(".")[3]) for k in hf_weights.HFReader(hf_path).weight_map
                  if k.startswith("language_model.backbone.layers.")}
        if layers and max(layers) + 1 != len(hf.pattern):
            raise config_mod.ConfigError(
                f"model.hf_path = {hf_path!r}: {path} has hybrid_override_pattern {hf.pattern!r} ({len(hf.pattern)} "
                f"layers), the weights hold {max(layers) + 1} language-model layers"
            )
    return hf


def _checkpoint_around(path: Path) -> Path | None:
    """`path` or its nearest ancestor that is a checkpoint (step_<N> with run_state.json or model_optim/) or a save in
    progress (step_<N>.tmp / .old), or None."""
    import checkpoint

    for p in (path, *path.parents):
        if checkpoint.TMP_RE.match(p.name) or checkpoint.OLD_RE.match(p.name):
            return p
        if checkpoint.STEP_RE.match(p.name) and (
            (p / checkpoint.RUN_STATE_FILE).is_file() or (p / checkpoint.MODEL_OPTIM_DIR).is_dir()
        ):
            return p
    return None


def check_run_dir(ckpt_dir: str, hf_path: str | None = None) -> None:
    """`checkpoint.dir` is a directory this process can write and no run would lose (not an HF model, not in a
    checkpoint); created when missing."""
    import checkpoint

    if not ckpt_dir.strip():
        raise config_mod.ConfigError(
            "checkpoint.dir is empty: set the run directory (step_<N>/ checkpoints, metrics.jsonl and config.json go "
            "there), e.g. checkpoint.dir=results/my_run"
        )
    path = Path(ckpt_dir)
    if path.exists() and not path.is_dir():
        raise config_mod.ConfigError(f"checkpoint.dir = {ckpt_dir!r} is an existing file, not a directory")
    if hf_path and path.resolve() == Path(hf_path).resolve():
        raise config_mod.ConfigError(
            f"checkpoint.dir = {ckpt_dir!r} is model.hf_path: the run would write its resolved config.json over the "
            "model's; choose another run directory"
        )
    if (path.is_dir() and _is_hf_config(_json_object(path / "config.json"))) or (
        path / checkpoint.EXPORT_INFO_FILE
    ).is_file():
        raise config_mod.ConfigError(
            f"checkpoint.dir = {ckpt_dir!r} holds an HF model checkpoint (its config.json would be replaced by the "
            "run's resolved config); choose another run directory"
        )
    if (step := _checkpoint_around(path.resolve())) is not None:
        raise config_mod.ConfigError(
            f"checkpoint.dir = {ckpt_dir!r} is the checkpoint {step} or inside it (a new run there is removed with "
            f"it); to resume that run, set checkpoint.dir={step.parent}"
        )
    existing = path
    while not existing.exists():  # the nearest existing ancestor (relative paths end at ".")
        existing = existing.parent
    if not existing.is_dir():
        raise config_mod.ConfigError(
            f"checkpoint.dir = {ckpt_dir!r} cannot be created: {str(existing)!r} is not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "written" if existing == path else "created"
        why = "a read-only file system at" if os.statvfs(existing).f_flag & os.ST_RDONLY else "no write permission on"
        raise config_mod.ConfigError(f"checkpoint.dir = {ckpt_dir!r} cannot be {what}: {why} {str(existing)!r}")
    try:  # os.access says yes to root on /proc and /sys, where mkdir still fails
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise config_mod.ConfigError(f"checkpoint.dir = {ckpt_dir!r} cannot be created: {e.strerror}") from None


def check_wandb(mode: str) -> None:
    """With `mode` (logging.wandb after WANDB_MODE) "online" or "offline" wandb must import; with "online" it must
    find an API key (`wandb.login(verify=False, prompt=False)`: no prompt, no network)."""
    if mode == "disabled":
        return
    try:
        import wandb
    except ImportError as e:  # not installed, or a broken install (e.g. a protobuf it cannot load)
        raise config_mod.ConfigError(
            f"logging.wandb = {mode!r} needs the wandb package, which does not import here ({type(e).__name__}: "
            f"{e}); install it (`pip install wandb`, as requirements.txt does) or set logging.wandb=disabled (or "
            "WANDB_MODE=disabled)"
        ) from None
    if mode != "online":
        return

    # login looks up only under WANDB_MODE=online; silent, since a non-silent login asks the server (DESIGN.md)
    env = {"WANDB_MODE": "online", "WANDB_SILENT": "true"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        found = wandb.login(verify=False, prompt=False)
    except wandb.errors.AuthenticationError as e:
        raise config_mod.ConfigError(f"logging.wandb = 'online': {e}") from None
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        wandb.teardown()  # wandb.init reads the restored environment afresh (no "changes ... ignored" warning)
    if not found:
        raise config_mod.ConfigError(
            "logging.wandb = 'online' but W&B finds no API key (WANDB_API_KEY, ~/.netrc from `wandb login`, or a "
            "wandb settings file); set one, or use logging.wandb=offline or disabled"
        )


# megatron-core TransformerConfig fields (and prose names) set from this project's keys, found in its messages
MCORE_FIELD_KEYS = {
    "tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    "context_parallel_size": "parallel.context_parallel_size",
    "expert_model_parallel_size": "parallel.expert_model_parallel_size",
    "expert_tensor_parallel_size": "parallel.expert_tensor_parallel_size",
    "sequence_parallel": "parallel.sequence_parallel",
    "sequence parallelism": "parallel.sequence_parallel",
    "tensor parallelism": "parallel.tensor_model_parallel_size",
    "params_dtype": "model.params_dtype",
    "bf16": "model.params_dtype",
    "recompute_granularity": "model.recompute",
    "recompute_method": "model.recompute",
    "moe_token_dispatcher_type": "model.moe_token_dispatcher_type",
    "moe_router_load_balancing_type": "model.moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "model.moe_aux_loss_coeff",
    "moe_router_bias_update_rate": "model.moe_router_bias_update_rate",
}


def check_model_config(cfg, hf, kernels=None) -> None:
    """megatron-core's constraints, before any process group: the three TransformerConfigs are built (their own
    checks), plus the rules it enforces later (MoE with TP > 1 needs SP, ETP = 1, vocab % TP, something to train).
    kernels: the run's kernel_selection.Kernels (its spec; None: probed)."""
    m, p = cfg.model, cfg.parallel
    towers = ["freeze_vision_encoder", "freeze_vision_projector", "freeze_language_model"]
    towers += ["freeze_sound_encoder", "freeze_sound_projector"] if hf.sound is not None else []
    if all(getattr(m, k) for k in towers):
        raise config_mod.ConfigError(
            ", ".join(f"model.{k}" for k in towers) + " are all true: nothing to train; unfreeze at least one")
    use_te = omni_model.uses_te_spec() if kernels is None else kernels.spec == "te"
    parts = (
        ("language model", functools.partial(omni_model.language_config, use_te=use_te)),
        ("vision encoder", omni_model.vision_config),
        ("vision projector", omni_model.projector_config),
    ) + ((("sound projector", functools.partial(omni_model.projector_config,
                                                ffn_hidden_size=hf.sound.projection_hidden_size)),)
         if hf.sound is not None else ())
    for what, build in parts:
        try:
            mcore = build(hf, m, p)
        except (ValueError, AssertionError, TypeError) as e:
            named = {k: v for k, v in MCORE_FIELD_KEYS.items() if k in str(e)}
            keys = ", ".join(dict.fromkeys(f"{v} = {config_mod.get_dotted(cfg, v)!r}" for v in named.values()))
            raise config_mod.ConfigError(
                f"megatron-core refuses the {what} config: {str(e).strip()} (this run's "
                f"{keys or 'settings'}; the other sizes come from {m.hf_path}/config.json)"
            ) from None
        if what == "language model":
            lm = mcore
    check_lora(cfg, hf)
    tp = p.tensor_model_parallel_size
    if lm.num_moe_experts and tp > 1 and not p.sequence_parallel:
        raise config_mod.ConfigError(
            f"parallel.tensor_model_parallel_size = {tp} with MoE layers needs parallel.sequence_parallel = true "
            "(megatron-core's MoELayer refuses MoE and tensor parallelism without sequence parallelism in training)"
        )
    if lm.num_moe_experts and p.expert_tensor_parallel_size != 1:
        raise config_mod.ConfigError(
            f"parallel.expert_tensor_parallel_size = {p.expert_tensor_parallel_size}: only 1 (experts whole on their "
            "EP rank) is supported"
        )
    if hf.text.vocab_size % tp:
        raise config_mod.ConfigError(
            f"parallel.tensor_model_parallel_size = {tp} must divide the vocabulary size {hf.text.vocab_size} "
            f"({m.hf_path}/config.json): the output layer stays vocab-parallel"
        )


def lora_layers(hf) -> dict[str, dict[str, int]]:
    """{lora component flag: {target layer name: its smaller dimension min(in, out)}}: the layers lora.apply_lora
    finds in the model of `hf` (omni_model.OmniHFConfig), by the layer pattern and sizes of its config.json."""
    t, h, vh = hf.text, hf.text.hidden_size, hf.vision_hidden_size
    heads, kv, head_dim = t.num_attention_heads, t.num_key_value_heads, t.head_dim
    lm: dict[str, int] = {}
    if "M" in hf.pattern:
        lm.update(in_proj=h, out_proj=min(h, t.mamba_num_heads * t.mamba_head_dim))
    if "*" in hf.pattern:
        lm.update(linear_qkv=min(h, (heads + 2 * kv) * head_dim), linear_proj=min(h, heads * head_dim))
    if "-" in hf.pattern:
        lm.update(linear_fc1=min(h, t.intermediate_size), linear_fc2=min(h, t.intermediate_size))
    moe = "E" in hf.pattern
    shared = getattr(t, "moe_shared_expert_intermediate_size", 0) or 0
    mlp_ratio_size = int(vh * getattr(hf.vision, "mlp_ratio", 4.0))
    return {
        "language_model": lm,
        "shared_expert": dict.fromkeys(("linear_fc1", "linear_fc2"), min(h, shared)) if moe and shared else {},
        "routed_experts": dict.fromkeys(("linear_fc1", "linear_fc2"), min(h, t.moe_intermediate_size)) if moe else {},
        "vision_tower": {"linear_qkv": vh, "linear_proj": vh, "linear_fc1": min(vh, mlp_ratio_size),
                         "linear_fc2": min(vh, mlp_ratio_size)},
        "projector": {"linear_fc1": min(4 * vh, hf.projector_hidden_size),
                      "linear_fc2": min(hf.projector_hidden_size, h)},
        "sound_projector": {} if hf.sound is None else {
            "linear_fc1": min(hf.sound.hidden_size, hf.sound.projection_hidden_size),
            "linear_fc2": min(hf.sound.projection_hidden_size, h)},
    }  # fmt: skip


def check_lora(cfg, hf) -> None:
    """With lora.rank > 0: lora.targets match a layer of an adapted component (`lora_layers`), and lora.rank is at
    most the smaller dimension of every targeted layer (a wider adapter adds nothing a full update lacks)."""
    lo = cfg.lora
    if lo.rank <= 0:
        return
    layers = lora_layers(hf)
    matched = [(c, t, d) for c, by in layers.items() if getattr(lo, c) for t, d in by.items() if t in lo.targets]
    if not matched:
        has = "; ".join(f"lora.{c}: {sorted(layers[c]) or 'none'}" for c in layers if getattr(lo, c))
        raise config_mod.ConfigError(
            f"lora.targets = {lo.targets} match no layer of the adapted components ({has}; {cfg.model.hf_path}"
            "/config.json): name one of those layers or set another component flag"
        )
    component, target, dim = min(matched, key=lambda m: m[2])
    if lo.rank > dim:
        raise config_mod.ConfigError(
            f"lora.rank = {lo.rank} exceeds the smaller dimension {dim} of a targeted layer (lora.{component}'s "
            f"{target}, {cfg.model.hf_path}/config.json): set lora.rank <= {dim}"
        )


def check_splits(train_split, val_split, cfg):
    """The loaded splits against the batch and bin sizes -> (train split, validation split or None, console notes).
    With packing.drop_oversized_pairs, pairs larger than a bin are dropped here (`Split.dropped_oversized`)."""
    notes = []
    if val_split is not None and val_split.index is not train_split.index and \
            set(val_split.index.annotation_files) & set(train_split.index.annotation_files):
        same = sorted(set(val_split.index.annotation_files) & set(train_split.index.annotation_files))
        notes.append(
            f"validation: data.validation.data_path shares {len(same)} annotation file(s) with the training data "
            f"(e.g. {same[0]}): those validation pairs are training pairs"
        )
    size = cfg.data.train.split_validation_size
    if val_split is not None and val_split.index is train_split.index and size >= 1 and len(val_split.pair_ids) > size:
        notes.append(
            f"validation: data.train.split_validation_size = {size} gave {len(val_split.pair_ids)} validation pairs: "
            "the repeats of a record (repeat_time) stay together in one split"
        )
    if val_split is not None and not val_split.pair_ids:
        notes.append(
            f"validation: data.train.split_validation_size = {cfg.data.train.split_validation_size} of "
            f"{len(train_split.index)} pairs is 0 pairs: no validation"
        )
        val_split = None
    pk = cfg.packing
    d = pk.make_sequence_length_divisible_by
    kept = {}
    for name, split in (("training", train_split), ("validation", val_split)):
        if split is None:
            continue
        shared = split.index.shared_lengths(split.pair_ids) if pack.shared_prompt_on(pk) else None
        sizes = pack.pair_bin_tokens(split.index.lengths(split.pair_ids), d, shared)
        big = sorted((p for p, n in sizes.items() if n > pk.max_tokens_per_bin), key=lambda p: -sizes[p])
        kept[name] = split
        if not big:
            continue
        if not pk.drop_oversized_pairs:
            raise config_mod.ConfigError(
                f"{len(big)} of {len(sizes)} {name} pairs need more than packing.max_tokens_per_bin = "
                f"{pk.max_tokens_per_bin} tokens (largest: {split.index.source(big[0])}, {sizes[big[0]]} tokens after "
                f"padding to a multiple of {d}); raise the limit, lower data.max_seq_length, or set "
                "packing.drop_oversized_pairs = true"
            )
        if len(big) == len(sizes):
            raise config_mod.ConfigError(
                f"every {name} pair needs more than packing.max_tokens_per_bin = {pk.max_tokens_per_bin} tokens"
            )
        dropped = set(big)
        kept[name] = mmpr_index.Split(split.index, [p for p in split.pair_ids if p not in dropped], len(big))
        left = len(sizes) - len(big)
        where = "(metrics: dropped_oversized)" if name == "training" else f"(validation uses the other {left})"
        notes.append(
            f"{name}: {len(big)} of {len(sizes)} pairs exceed packing.max_tokens_per_bin = {pk.max_tokens_per_bin} "
            f"and are dropped at start (largest: {split.index.source(big[0])}, {sizes[big[0]]} tokens) {where}"
        )
    train_split, val_split = kept["training"], kept.get("validation")
    if val_split is None and cfg.mpo.val_period:
        notes.append(
            f"validation: mpo.val_period = {cfg.mpo.val_period} is ignored: there is no validation data (set "
            "data.validation.data_path or data.train.split_validation_size)"
        )
    gbs, n_train = cfg.policy.train_global_batch_size, len(train_split.pair_ids)
    if n_train < gbs:
        raise config_mod.ConfigError(
            f"policy.train_global_batch_size = {gbs} pairs per step but only {n_train} training pairs (after "
            f"data.train.max_samples = {cfg.data.train.max_samples}, data.train.split_validation_size = "
            f"{cfg.data.train.split_validation_size}, dropped records and {train_split.dropped_oversized} oversized "
            "pairs): a step would repeat pairs; lower the batch or use more data"
        )
    return train_split, val_split, notes

"""Typed run configuration: one dataclass tree, loaded from TOML, then `section.key=value` overrides.

Precedence: dataclass defaults < TOML file < command-line overrides. Every knob is documented once, in its field's
comment below; the TOML sections mirror the tree (`[data.train]` is `Config.data.train`). Run
`python config.py configs/nano.toml [overrides...]` to print the resolved config.

    cfg = load_config("configs/tiny.toml", ["mpo.max_num_steps=2", "data.train.max_samples=8"])
    validate_parallel(cfg, world_size=2)   # the checks that need the world size

Errors: every problem (unknown key, wrong type, invalid value) raises `ConfigError` naming the file or override,
the dotted key and the allowed values, before any distributed or model work starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):  # noqa: UP036 - tomli fallback kept for Python 3.10 images
    import tomllib
else:  # pragma: no cover - Python 3.10 images only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem found before the run starts; the message names the key and the allowed values."""


# ---- The tree (units in the comments; names as NeMo-RL's MPO recipe: reference_policy_kl_penalty, ...) ----------
@dataclass
class ModelConfig:
    # the HF checkpoint (config.json, safetensors, tokenizer, processor): a local directory (relative to the cwd; it
    # wins over a hub id of the same name) or a Hugging Face hub id (org/name), downloaded into the hub cache
    hf_path: str = "assets/tiny-omni"
    # with a hub id: the branch, tag or commit to use ("" = main); the run records the commit it resolved to
    hf_revision: str = ""
    params_dtype: Literal["float32", "bfloat16"] = "float32"  # parameter dtype; bf16 keeps fp32 master weights
    freeze_vision_encoder: bool = False  # no gradient into the RADIO ViT
    freeze_vision_projector: bool = False  # no gradient into the mlp1 projector
    freeze_language_model: bool = False  # no gradient into the hybrid language model
    freeze_sound_encoder: bool = False  # no gradient into the Parakeet sound encoder (checkpoints with sound_config)
    freeze_sound_projector: bool = False  # no gradient into the sound projection
    recompute: Literal["none", "full", "selective"] = "none"  # activation recomputation granularity
    mamba_dt_clamp: bool = True  # clamp softplus(dt) to >= time_step_min as transformers does (False = mcore)
    moe_aux_loss_coeff: float = 0.0  # MoE load-balancing auxiliary loss coefficient (0 = off)
    # mcore router balancing; "seq_aux_loss" is refused (a packed THD row is one sequence to megatron-core)
    moe_router_load_balancing_type: Literal["none", "aux_loss", "seq_aux_loss"] = "none"
    moe_router_bias_update_rate: float = 1e-3  # expert-bias step per optimizer step (aux-loss-free); 0 freezes it
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"  # megatron MoE dispatcher; allgather: EP 1
    deterministic_mode: bool = False  # deterministic GPU kernels (distributed.set_deterministic); bit-exact, slower


@dataclass
class TrainDataConfig:
    data_path: str = "data/mmpr_sample/MMPR-sample/meta.json"  # MMPR meta-recipe JSON (subset -> root, annotation)
    data_root: str = ""  # base for relative root/annotation paths; "" = the meta file's grandparent, then its folder
    max_samples: int = 0  # keep the first N valid pairs in meta/file order (first light; not random); 0 = all
    seed: int = 42  # seed of repeat_time subsampling, the validation split and the per-epoch shuffle
    shuffle: bool = True  # reshuffle the pair order every epoch
    split_validation_size: float = 0.0  # validation split: a fraction (< 1) or a whole pair count (>= 1); 0 = none
    max_images_per_row: int = 8  # records with more images are dropped (reason too_many_images)
    max_audio_seconds: float = 0.0  # records with a longer audio clip are dropped (audio_too_long); 0 = no limit


@dataclass
class ValidationDataConfig:
    data_path: str = ""  # a separate validation meta-recipe; "" = use data.train.split_validation_size
    max_samples: int = 0  # keep the first N valid validation pairs; 0 = all


@dataclass
class VideoDataConfig:
    """How a record's video becomes frames (mmpr_media.py); 0 = the checkpoint's video processor's value."""

    num_frames: int = 0  # frames sampled uniformly from a video file (0: the processor's num_frames)
    fps: float = 0.0  # else frames sampled per second (0: the processor's fps; neither: every frame)
    max_frames: int = 32  # records whose video gives more frames are dropped (too_many_frames); frame lists too
    target_num_patches: int = 0  # 16-px patches per frame tile (0: the processor's video_target_num_patches)


@dataclass
class DataConfig:
    max_seq_length: int = 8192  # longest sequence in tokens, expanded image tokens included; longer pairs are dropped
    num_workers: int = 0  # DataLoader workers decoding and processing images (0 = in the main process)
    strict: bool = False  # turn every dropped record into an error naming its file and line
    train: TrainDataConfig = field(default_factory=TrainDataConfig)
    validation: ValidationDataConfig = field(default_factory=ValidationDataConfig)
    video: VideoDataConfig = field(default_factory=VideoDataConfig)


@dataclass
class MPOConfig:
    max_num_steps: int = 20  # optimizer steps of the whole run; also the LR schedule horizon
    stop_after_step: int = 0  # end this segment (save, exit 0) after this step; 0 = run to max_num_steps
    val_period: int = 0  # validate every N steps (0 = only at the end when val_at_end)
    val_at_end: bool = True  # validate after the last step
    val_batches: int = 32  # at most this many validation batches per validation (>= 1)
    val_global_batch_size: int = 32  # pairs per validation batch
    seed: int = 42  # model-parallel RNG seed (dropout is off; kept for reproducibility of any randomness)
    reference_policy_kl_penalty: float = 0.05  # beta of the DPO / BCO log-ratio rewards
    preference_loss_weight: float = 0.8  # w_p: weight of the DPO (sigmoid) preference term
    sft_loss_weight: float = 0.0  # w_g: weight of the SFT (NLL of the chosen response) term
    bco_loss_weight: float = 0.2  # w_q: weight of the BCO term (the MPO paper's quality loss)
    preference_average_log_probs: bool = False  # divide L_y by the response-token count in the preference term
    sft_average_log_probs: bool = True  # divide the SFT NLL by the chosen response-token count
    quality_average_log_probs: bool = False  # divide L_y by the response-token count in the BCO (quality) term
    reward_shift: float = 0.0  # initial BCO reward shift delta (a resumed run uses the checkpointed value)
    reward_shift_momentum: float = 0.99  # EMA momentum m of delta: delta = m*delta + (1-m)*mean(beta*L); in [0, 1)


@dataclass
class PolicyConfig:
    train_global_batch_size: int = 4  # preference pairs per optimizer step, over all data-parallel ranks
    logprob_chunk_size: int = 1024  # tokens per chunk of the vocab-parallel log-prob computation


@dataclass
class ReferenceConfig:
    offload: bool = False  # keep the frozen reference model on CPU between its forward passes (GPU only; a note on CPU)
    # where the reference's log-prob sums come from: "online", a frozen reference model's forward in every step;
    # "precomputed", one reference pass over every training and validation pair at the start of the job, stored in
    # <checkpoint.dir>/reference_logprobs/ (reference_logprobs.py), and no reference model in training
    logprobs: Literal["online", "precomputed"] = "online"
    max_tokens_per_bin: int = 0  # tokens per bin of the reference pass; 0 = packing.max_tokens_per_bin (>= it)
    max_sequences_per_bin: int = 0  # pairs per bin of the reference pass; 0 = packing.max_sequences_per_bin


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1  # TP degree (must divide the world size)
    context_parallel_size: int = 1  # CP degree
    expert_model_parallel_size: int = 1  # EP degree; must divide the number of experts
    expert_tensor_parallel_size: int = 1  # ETP: TP inside each expert; only 1 is supported
    sequence_parallel: bool = False  # megatron-core SP: needs TP > 1; TP > 1 with MoE needs SP


@dataclass
class OptimizerConfig:
    lr: float = 1e-4  # peak learning rate
    min_lr: float = 1e-6  # learning rate at the end of the cosine decay (step max_num_steps)
    weight_decay: float = 0.0  # decoupled weight decay (AdamW style)
    adam_beta1: float = 0.9  # Adam's first-moment (gradient EMA) decay, in [0, 1) (the recipe's and AdamW's default)
    adam_beta2: float = 0.98  # second-moment decay, in [0, 1): NeMo-RL's Nano Omni MPO recipe (AdamW's default: 0.999)
    adam_eps: float = 1e-8  # added to sqrt(second moment) in Adam's update denominator (the recipe's and AdamW's)
    clip_grad: float = 1.0  # global gradient-norm clip (0 = off)
    use_distributed_optimizer: bool = True  # megatron-core distributed optimizer (shards optimizer state over DP)
    # megatron DDP's gradient buffers (summed over microbatches, reduced over DP and CP) in fp32 (true) or in
    # model.params_dtype (false: bf16 buffers, plus an fp32 copy of this DP rank's gradients at each optimizer step;
    # measured error and memory: docs/PERFORMANCE.md, "Gradient buffers")
    grad_reduce_in_fp32: bool = True
    # megatron-core's precision-aware optimizer (needs the distributed optimizer): the optimizer reads the gradient
    # buffers in place and updates the bf16 weights itself; with store_param_remainders (bf16 weights) the fp32 master
    # is the bf16 weight plus an int16 remainder (2 bytes per parameter instead of 4). TE's FusedAdam where installed,
    # else precision_adam.PrecisionAwareAdam. Measured: docs/PERFORMANCE.md, "Optimizer state"
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True  # megatron-core's default; applies to bf16 weights with the flag above
    exp_avg_dtype: Literal["fp32", "bf16"] = "fp32"  # Adam's first moment stored in (bf16: precision-aware only)
    exp_avg_sq_dtype: Literal["fp32", "bf16"] = "fp32"  # the second moment, likewise


@dataclass
class SchedulerConfig:
    lr_warmup_steps: int = 2  # optimizer steps of linear warmup from lr_warmup_init to optimizer.lr
    lr_warmup_init: float = 0.0  # learning rate at step 0 of the warmup
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"  # decay to min_lr at mpo.max_num_steps


@dataclass
class PackingConfig:
    max_tokens_per_bin: int = 4096  # tokens per packed microbatch (both sequences of a pair count), after padding
    max_sequences_per_bin: int = 1  # pairs per packed microbatch (a pair, chosen + rejected, counts once; 1 = one pair)
    make_sequence_length_divisible_by: int = 8  # pad each sequence to this multiple (2*CP and TP with SP divide it)
    pair_grouping_key: Literal["pair_index"] = "pair_index"  # the only accepted value: a pair is never split
    drop_oversized_pairs: bool = False  # pairs larger than a bin: dropped at start (true) or a ConfigError (false)
    # one THD span [prompt | chosen | rejected] per pair (pack.pack_shared_prompt); "auto": resolved at start by
    # shared_prompt.resolve (on where checked exact against separate sequences); true refused with CP
    shared_prompt: bool | Literal["auto"] = "auto"


@dataclass
class CheckpointConfig:
    dir: str = "results/tiny"  # run directory: step_N/ checkpoints and metrics.jsonl
    save_period: int = 0  # save every N steps (0 = only at stop_after_step, the end and on signals)
    keep_last: int = 2  # keep this many complete checkpoints (0 = keep all)
    resume: bool = True  # resume from the latest complete checkpoint in dir; False refuses to start over one


@dataclass
class LoggingConfig:
    wandb: Literal["online", "offline", "disabled"] = "disabled"  # Weights & Biases mode unless WANDB_MODE is set
    wandb_project: str = "vlm-mpo"  # W&B project unless WANDB_PROJECT is set
    log_period: int = 1  # print a line every N steps


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")  # Megatron-Bridge's


@dataclass
class LoraConfig:
    """LoRA adapters (lora.py): W + (alpha/rank)·B·A on the targeted megatron-core linears, base weights frozen."""

    rank: int = 0  # adapter rank r; 0 = LoRA off (full-parameter training)
    alpha: float = 32.0  # scale numerator: the adapter adds (alpha / rank)·B·A (> 0)
    dropout: float = 0.0  # dropout on the adapter's input, in [0, 1)
    # layer names (Megatron-Bridge's): attention linear_qkv / linear_proj, MLP linear_fc1 / linear_fc2, Mamba
    # in_proj / out_proj; where they get adapters: the flags below
    targets: list[Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj"]] = field(
        default_factory=lambda: list(LORA_TARGETS))
    language_model: bool = True  # adapters on the targets of the hybrid language model's layers
    shared_expert: bool = True  # ... and on the MoE shared expert's linear_fc1 / linear_fc2 (when targeted)
    routed_experts: bool = False  # ... and on every routed expert's fc1 / fc2 (one adapter pair per expert)
    vision_tower: bool = False  # adapters on the RADIO ViT's targets
    projector: bool = False  # adapters on the mlp1 projector's linear_fc1 / linear_fc2 (when targeted)
    sound_projector: bool = False  # adapters on the sound projection's linear_fc1 / linear_fc2 (when targeted)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mpo: MPOConfig = field(default_factory=MPOConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


# The path-valued fields: a leading `~` is expanded at load (`expand_user_paths`).
PATH_KEYS = ("model.hf_path", "data.train.data_path", "data.train.data_root", "data.validation.data_path",
             "checkpoint.dir")


# ---- Loading and overriding ----------
def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _unquote(value: str, key: str, where: str) -> str:
    """An override value quoted as a TOML string ("..." or '...') -> the string, escapes applied; others unchanged."""
    if len(value) < 2 or value[0] not in "\"'" or value[-1] != value[0]:
        return value
    try:
        parsed = tomllib.loads(f"v = {value}")
    except tomllib.TOMLDecodeError as e:  # the position tomllib gives is in "v = <value>": left out
        reason = re.sub(r" \(at line \d+, column \d+\)$", "", str(e))
        raise ConfigError(f"{where}: {key} = {value!r} is not a valid TOML string ({reason})") from None
    if list(parsed) != ["v"] or not isinstance(parsed["v"], str):
        raise ConfigError(f"{where}: {key} = {value!r} is not one TOML string")
    return parsed["v"]


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Convert a TOML value or an override string to the field type `tp`; raise ConfigError naming `key`."""
    from_cli = isinstance(value, str) and where.startswith("override")
    origin = typing.get_origin(tp)
    if from_cli and (tp is str or (origin is Literal and all(isinstance(a, str) for a in typing.get_args(tp)))):
        value = _unquote(value, key, where)
    if origin is list:  # a TOML array; on the command line also "a,b" or a TOML array "['a', 'b']"
        if from_cli:
            text = value.strip()
            if text.startswith("["):
                try:
                    value = tomllib.loads(f"v = {text}")["v"]
                except tomllib.TOMLDecodeError:
                    raise ConfigError(f"{where}: {key} = {value!r} is not a valid TOML array") from None
            else:
                value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {key} = {value!r} has the wrong type; expected a list")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, key, where) for v in value]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {key} = {value!r} is not allowed; choose one of {list(allowed)}")
        return value
    if origin in (typing.Union, types.UnionType):  # Optional[...], or a choice of types (bool | Literal["auto"])
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)) and (value is None or (from_cli and value.lower() in ("none", "null"))):
            return None
        for arg in args:  # the first type that takes the value
            try:
                return _coerce(value, arg, key, where)
            except ConfigError as e:
                error = e
        if len(args) == 1:
            raise error
        hint = ""
        if bool in args and from_cli:
            hint = " (true, false, 1 or 0)"
        elif bool in args and isinstance(value, str):  # a TOML string such as "true"
            hint = " (true or false, without quotes)"
        names = " | ".join(_type_name(a) for a in args)
        raise ConfigError(f"{where}: {key} = {value!r} is not allowed; expected {names}{hint}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli:
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif from_cli:
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # TOML and float() accept nan / inf; no field means them
                raise ConfigError(f"{where}: {key} = {value!r} must be a finite number")
            return number
    elif tp is str and isinstance(value, str):
        return value
    raise ConfigError(f"{where}: {key} = {value!r} has the wrong type; expected {_type_name(tp)}")


def _apply(obj: Any, data: dict[str, Any], prefix: str, where: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys here: {names}")
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: {key} is a section [{key}], not a value")
            _apply(getattr(obj, k), v, key + ".", where)
        else:
            setattr(obj, k, _coerce(v, tp, key, where))


def apply_override(cfg: Config, override: str) -> None:
    """Apply one `section.key=value` override in place (the value is parsed to the field's type)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected section.key=value")
    path, value = override.split("=", 1)
    parts = path.strip().split(".")
    nested: dict[str, Any] = {parts[-1]: value}
    for p in reversed(parts[:-1]):
        nested = {p: nested}
    _apply(cfg, nested, "", f"override {override!r}")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a `Config` from defaults, a TOML file (optional) and `key.path=value` overrides, then validate it."""
    cfg = Config()
    if path is not None:
        if Path(path).is_dir():
            tomls = sorted(p.name for p in Path(path).glob("*.toml"))
            held = f"it holds {', '.join(tomls)}" if tomls else "it holds no .toml file"
            raise ConfigError(f"config file {str(path)!r} is a directory, not a TOML file ({held}); name the file")
        if not Path(path).is_file():
            raise ConfigError(f"config file {str(path)!r} not found (relative paths are relative to the working "
                              f"directory {os.getcwd()}; the shipped configs are in configs/)")
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else f"not UTF-8 text ({e.reason} at byte {e.start})"
            raise ConfigError(f"config file {str(path)!r} cannot be read: {reason}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        _apply(cfg, data, "", str(path))
    for o in overrides:
        apply_override(cfg, o)
    expand_user_paths(cfg)
    apply_wandb_mode_env(cfg)
    validate(cfg)
    return cfg


def expand_user_paths(cfg: Config) -> None:
    """Expand a leading `~` / `~user` in every path-valued field (PATH_KEYS) in place; TOML has no shell expansion."""
    for key in PATH_KEYS:
        section, name = key.rsplit(".", 1)
        obj = get_dotted(cfg, section)
        value = getattr(obj, name)
        expanded = os.path.expanduser(value)
        if expanded.startswith("~"):
            user = expanded.split("/", 1)[0]
            raise ConfigError(f"{key} = {value!r}: {user!r} cannot be expanded (no such user or no home directory "
                              f"known); write the path out, or ./{value} for a directory named {user!r}")
        setattr(obj, name, expanded)


def get_dotted(obj: Any, dotted: str) -> Any:
    """The value at a dotted key of a Config (or any nested attributes): get_dotted(cfg, "data.train.seed")."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def apply_wandb_mode_env(cfg: Config) -> None:
    """WANDB_MODE (online / offline / disabled), when set, overrides logging.wandb (the machine decides)."""
    if not (mode := os.environ.get("WANDB_MODE", "").strip()):
        return
    if mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"WANDB_MODE = {mode!r} (it overrides logging.wandb): choose one of online, offline, "
                          "disabled, or unset it")
    cfg.logging.wandb = mode


def validate(cfg: Config) -> None:
    """Check values that do not depend on the world size. Raises ConfigError naming the key and the allowed range."""
    m, opt = cfg.mpo, cfg.optimizer
    for k in ("preference_loss_weight", "sft_loss_weight", "bco_loss_weight", "reference_policy_kl_penalty"):
        if getattr(m, k) < 0:
            raise ConfigError(f"mpo.{k} = {getattr(m, k)} must be >= 0")
    weights = ("preference_loss_weight", "bco_loss_weight", "sft_loss_weight")
    if all(getattr(m, k) == 0 for k in weights):
        raise ConfigError("mpo.preference_loss_weight, mpo.bco_loss_weight and mpo.sft_loss_weight are all 0: "
                          "nothing to train; set at least one > 0")
    on = [f"mpo.{k} = {getattr(m, k)}" for k in weights[:2] if getattr(m, k) > 0]
    if m.reference_policy_kl_penalty == 0 and on:  # beta = 0 makes the DPO and BCO terms constants
        raise ConfigError(f"mpo.reference_policy_kl_penalty = 0 with {' and '.join(on)} trains nothing (no gradient); "
                          "set mpo.reference_policy_kl_penalty > 0 or those weights to 0")
    if not 0.0 <= m.reward_shift_momentum < 1.0:
        raise ConfigError(f"mpo.reward_shift_momentum = {m.reward_shift_momentum} must be in [0, 1)")
    if m.max_num_steps < 1:
        raise ConfigError(f"mpo.max_num_steps = {m.max_num_steps} must be >= 1")
    if m.stop_after_step != 0 and not 1 <= m.stop_after_step <= m.max_num_steps:
        raise ConfigError(f"mpo.stop_after_step = {m.stop_after_step} must be in [1, mpo.max_num_steps = "
                          f"{m.max_num_steps}] (or 0 for no segment stop)")
    positive = ("policy.train_global_batch_size", "policy.logprob_chunk_size", "packing.max_tokens_per_bin",
                "packing.max_sequences_per_bin", "packing.make_sequence_length_divisible_by", "data.max_seq_length",
                "data.train.max_images_per_row", "data.video.max_frames", "mpo.val_global_batch_size",
                "mpo.val_batches", "logging.log_period", "parallel.tensor_model_parallel_size",
                "parallel.context_parallel_size", "parallel.expert_model_parallel_size",
                "parallel.expert_tensor_parallel_size")
    for k in positive:
        if get_dotted(cfg, k) < 1:
            raise ConfigError(f"{k} = {get_dotted(cfg, k)} must be >= 1")
    if not (math.isfinite(cfg.data.train.max_audio_seconds) and cfg.data.train.max_audio_seconds >= 0):
        raise ConfigError(f"data.train.max_audio_seconds = {cfg.data.train.max_audio_seconds} must be >= 0 (0: no "
                          "limit)")
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1:
        raise ConfigError("parallel.sequence_parallel = true needs parallel.tensor_model_parallel_size > 1; set "
                          "parallel.sequence_parallel = false or raise TP")
    non_negative = ("data.train.max_samples", "data.validation.max_samples", "data.num_workers",
                    "data.train.split_validation_size", "checkpoint.save_period", "checkpoint.keep_last",
                    "mpo.val_period", "scheduler.lr_warmup_steps", "optimizer.lr", "optimizer.min_lr",
                    "optimizer.weight_decay", "optimizer.clip_grad", "scheduler.lr_warmup_init",
                    "model.moe_router_bias_update_rate", "reference.max_tokens_per_bin",
                    "reference.max_sequences_per_bin", "data.video.num_frames", "data.video.fps",
                    "data.video.target_num_patches")
    for k in non_negative:
        if get_dotted(cfg, k) < 0:
            raise ConfigError(f"{k} = {get_dotted(cfg, k)} must be >= 0")
    if cfg.data.video.num_frames and cfg.data.video.fps:
        raise ConfigError(f"data.video.num_frames = {cfg.data.video.num_frames} and data.video.fps = "
                          f"{cfg.data.video.fps}: set one (frames per video, or frames per second), the other 0")
    size = cfg.data.train.split_validation_size
    if size >= 1 and size != int(size):
        raise ConfigError(f"data.train.split_validation_size = {size}: a fraction of the pairs (< 1, e.g. 0.015) or a "
                          "whole pair count (>= 1), not both")
    if cfg.model.moe_token_dispatcher_type == "allgather" and cfg.parallel.expert_model_parallel_size > 1:
        raise ConfigError("model.moe_token_dispatcher_type = 'allgather' needs parallel.expert_model_parallel_size = "
                          "1: megatron-core's all-gather over the EP ranks needs equal token counts, and their packed "
                          "bins differ; use 'alltoall'")
    if cfg.model.moe_router_load_balancing_type == "seq_aux_loss":
        raise ConfigError("model.moe_router_load_balancing_type = 'seq_aux_loss' is not supported (megatron-core "
                          "takes a packed row as one sequence); use 'aux_loss' or 'none'")
    validate_reference(cfg)
    validate_lora(cfg)
    if opt.min_lr > opt.lr:
        raise ConfigError(f"optimizer.min_lr = {opt.min_lr} must be <= optimizer.lr = {opt.lr}")
    for k in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(opt, k) < 1.0:
            raise ConfigError(f"optimizer.{k} = {getattr(opt, k)} must be in [0, 1)")
    if not opt.adam_eps >= FLOAT32_TINY:  # 0 in fp32 gives 0/0 = NaN for a parameter without gradient yet
        raise ConfigError(f"optimizer.adam_eps = {opt.adam_eps} must be > 0 and at least 1.2e-38 (the smallest "
                          "normal float32), e.g. 1e-8")
    validate_optimizer_precision(cfg)
    validate_schedule(cfg)


def validate_optimizer_precision(cfg: Config) -> None:
    """The precision-aware optimizer's settings, as megatron-core can honour them (the dtypes' names: load_config)."""
    opt = cfg.optimizer
    for k in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(opt, k) != "fp32" and not opt.use_precision_aware_optimizer:
            raise ConfigError(f"optimizer.{k} = {getattr(opt, k)!r} needs optimizer.use_precision_aware_optimizer = "
                              "true (megatron-core keeps fp32 moments otherwise)")
    if not opt.use_precision_aware_optimizer:
        return
    if not opt.use_distributed_optimizer:
        raise ConfigError("optimizer.use_precision_aware_optimizer = true needs optimizer.use_distributed_optimizer "
                          "= true (megatron-core's distributed optimizer holds it)")
    if opt.store_param_remainders and cfg.model.params_dtype != "bfloat16":
        raise ConfigError(f"optimizer.store_param_remainders = true with model.params_dtype = "
                          f"{cfg.model.params_dtype!r}: remainders complete bf16 weights to fp32; set "
                          "optimizer.store_param_remainders = false or model.params_dtype = 'bfloat16'")


def validate_reference(cfg: Config) -> None:
    """The reference section's rules across sections: the pass's bins hold any training bin; offload is online-only."""
    r, bin_tokens = cfg.reference, cfg.packing.max_tokens_per_bin
    if r.logprobs == "precomputed" and r.offload:
        raise ConfigError("reference.offload = true with reference.logprobs = 'precomputed': training holds no "
                          "reference model to offload (the reference pass holds only the reference); set one of them")
    if 0 < r.max_tokens_per_bin < bin_tokens:
        raise ConfigError(f"reference.max_tokens_per_bin = {r.max_tokens_per_bin} must be >= "
                          f"packing.max_tokens_per_bin = {bin_tokens} (the pass holds no policy, gradients or "
                          "optimizer state), or 0 for the same")


def validate_lora(cfg: Config) -> None:
    """The [lora] section: rank >= 0, alpha > 0, dropout in [0, 1), no adapter on a frozen component, something to
    adapt, the base model frozen whole (the reference is the base with the adapters off) and no reference model to
    offload."""
    lo, m = cfg.lora, cfg.model
    if lo.rank < 0:
        raise ConfigError(f"lora.rank = {lo.rank} must be >= 0 (0 = LoRA off)")
    if not lo.alpha > 0:
        raise ConfigError(f"lora.alpha = {lo.alpha} must be > 0 (the adapter adds (alpha / rank)·B·A)")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout = {lo.dropout} must be in [0, 1)")
    if len(set(lo.targets)) != len(lo.targets):
        raise ConfigError(f"lora.targets = {lo.targets} names a layer twice")
    if lo.rank == 0:
        return
    frozen = (("language_model", "freeze_language_model"), ("shared_expert", "freeze_language_model"),
              ("routed_experts", "freeze_language_model"), ("vision_tower", "freeze_vision_encoder"),
              ("projector", "freeze_vision_projector"), ("sound_projector", "freeze_sound_projector"))
    for flag, freeze in frozen:
        if getattr(lo, flag) and getattr(m, freeze):
            raise ConfigError(f"lora.{flag} = true with model.{freeze} = true: adapters on a frozen component; "
                              f"set lora.{flag} = false or model.{freeze} = false")
    if not lo.targets:
        raise ConfigError(f"lora.targets is empty with lora.rank = {lo.rank}: name layers from {list(LORA_TARGETS)}, "
                          "or set lora.rank = 0")
    mlp = {"linear_fc1", "linear_fc2"}  # the targets of the components that are off by default
    for flag, names in (("routed_experts", mlp), ("vision_tower", {"linear_qkv", "linear_proj", *mlp}),
                        ("projector", mlp), ("sound_projector", mlp)):
        if getattr(lo, flag) and not names & set(lo.targets):
            raise ConfigError(f"lora.{flag} = true but lora.targets = {lo.targets} names none of its layers "
                              f"{sorted(names)}")
    if not any(getattr(lo, f) for f in ("language_model", "shared_expert", "routed_experts", "vision_tower",
                                        "projector", "sound_projector")):
        raise ConfigError(f"lora.rank = {lo.rank} but every lora component flag is false: no adapter; set one of "
                          "lora.language_model, lora.shared_expert, lora.routed_experts, lora.vision_tower, "
                          "lora.projector, lora.sound_projector, or lora.rank = 0")
    if cfg.reference.offload:
        raise ConfigError(f"reference.offload = true with lora.rank = {lo.rank}: there is no reference model to "
                          "offload (the reference is the policy with its adapters off); set reference.offload = false")
    if m.moe_router_bias_update_rate > 0:
        raise ConfigError(f"model.moe_router_bias_update_rate = {m.moe_router_bias_update_rate} with lora.rank = "
                          f"{lo.rank}: the expert bias is part of the frozen base model (the reference is the base "
                          "with the adapters off); set model.moe_router_bias_update_rate = 0")


FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, without importing torch here


def validate_schedule(cfg: Config) -> None:
    """The learning-rate schedule's rules (`validate`, and train.build_scheduler for a config changed after it)."""
    s, horizon = cfg.scheduler, cfg.mpo.max_num_steps
    if s.lr_warmup_steps >= horizon:
        raise ConfigError(f"scheduler.lr_warmup_steps = {s.lr_warmup_steps} must be < mpo.max_num_steps = {horizon}")
    if s.lr_warmup_init > cfg.optimizer.lr:
        raise ConfigError(f"scheduler.lr_warmup_init = {s.lr_warmup_init} must be <= optimizer.lr = {cfg.optimizer.lr}")


def validate_parallel(cfg: Config, world_size: int, num_experts: int | None = None) -> int:
    """Check TP * CP * DP = world, ETP * EP | world, EP | experts, DP | global batch; returns DP."""
    p = cfg.parallel
    tp, cp, ep = p.tensor_model_parallel_size, p.context_parallel_size, p.expert_model_parallel_size
    if world_size % (tp * cp) != 0:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size ({tp}) * "
                          f"parallel.context_parallel_size ({cp}) = {tp * cp}")
    dp = world_size // (tp * cp)
    etp = p.expert_tensor_parallel_size
    if world_size % (etp * ep) != 0:
        raise ConfigError(f"parallel.expert_tensor_parallel_size ({etp}) * parallel.expert_model_parallel_size ({ep}) "
                          f"= {etp * ep} must divide the world size {world_size}")
    if num_experts is not None and num_experts % ep != 0:
        raise ConfigError(f"parallel.expert_model_parallel_size = {ep} must divide the expert count {num_experts}")
    gbs = cfg.policy.train_global_batch_size
    if gbs % dp != 0:
        raise ConfigError(f"policy.train_global_batch_size = {gbs} must be divisible by the data-parallel size "
                          f"DP = world {world_size} / (TP {tp} * CP {cp}) = {dp}")
    return dp


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as a plain nested dict (JSON-serialisable); saved with every checkpoint."""
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from `to_dict` output (checkpoint metadata), validating every key as a TOML file would."""
    cfg = Config()
    _apply(cfg, data, "", "saved config")
    expand_user_paths(cfg)
    validate(cfg)
    return cfg


# Known-harmless library messages kept off the console by `quiet_known_warnings`, matched by their start.
KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # megatron on CPU: torch fallbacks (megatron_patches)
    "Apex is not installed",
    "absl.logging is not installed",
    "full scope is deprecated",  # megatron's TransformerConfig default cuda_graph_scope
    "MimoModelConfig is experimental",
    "The .grad attribute of a Tensor that is not a leaf Tensor",  # megatron optimizer probes main params
    "`torch.distributed.reduce_scatter_tensor` is deprecated",  # megatron DDP / distributed optimizer
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "Mismatch dtype between input and weight",  # bf16 input to an fp32-computed norm on CPU
    "Only transformer-engine>=1.7.0 supports MoE experts",  # megatron's TE spec built at import, unused without TE
    "The argument order of load has been changed",  # torch.distributed.checkpoint, called by megatron's loader
    "Please use DTensor instead and we are deprecating ShardedTensor",  # megatron dist_checkpointing on torch 2.14
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single",
    "Deterministic mode: set TRITON_CACHE_AUTOTUNING=1",  # model.deterministic_mode's Triton Mamba kernels
    "Deterministic mode: upgrade to Triton >= 3.4.0",
    "Triton is not supported on current platform, roll back to CPU",  # fla-core on a machine without a GPU
)
KNOWN_LOG_RECORDS = {  # logger name -> the start of its records to keep off the console (a str or a tuple of str)
    "megatron.core.transformer.transformer_layer": "Rewrapping ModuleSpec",
    "megatron.core.distributed.distributed_data_parallel": "DistributedDataParallel: full_param_layout not provided",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    "transformers.configuration_utils": "You are using a model of type",  # the Omni processor's sub-configs
    "torch.utils.cpp_extension": "No CUDA runtime is found",
    "megatron.core.dist_checkpointing.strategies.filesystem_async":  # a failed save: checkpoint.save's one line
        ("Local worker ", "An error is caught while starting worker "),
}
SHOW_WARNINGS_ENV = "OMNI_MPO_SHOW_WARNINGS"


def quiet_known_warnings() -> bool:
    """Filter KNOWN_WARNINGS / KNOWN_LOG_RECORDS (before megatron-core is imported); False if OMNI_MPO_SHOW_WARNINGS."""
    import logging
    import warnings

    if os.environ.get(SHOW_WARNINGS_ENV, "0") not in ("", "0"):
        return False
    for text in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text))
    for name, start in KNOWN_LOG_RECORDS.items():
        logging.getLogger(name).addFilter(lambda record, start=start: not record.getMessage().startswith(start))
    return True


def parse_cli(argv: list[str] | None, prog: str, description: str) -> tuple[str, list[str]]:
    """The command line `CONFIG.toml [section.key=value ...]` of config.py and train.py -> (path, overrides)."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("config", metavar="CONFIG.toml", help="the TOML config, e.g. configs/tiny.toml")
    ap.add_argument("overrides", metavar="section.key=value", nargs="*", default=[],
                    help="overrides, applied in order after the file (every key is documented in config.py)")
    if os.environ.get("RANK", "0") == "0":
        args = ap.parse_args(argv)
    else:  # under torchrun rank 0 alone prints the usage, an argument error or --help; the others exit with it
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = ap.parse_args(argv)
    return args.config, args.overrides


def exit_cli(main) -> None:
    """`sys.exit(main())`; a reader that leaves early (`| head`) ends it quietly, status 1 (Python's SIGPIPE note)."""
    try:
        code = main()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's shutdown
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the shutdown's flush must not raise again
        code = 1
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """`python config.py CONFIG.toml [section.key=value ...]`: the resolved config as JSON, or one `error:` line."""
    path, overrides = parse_cli(argv, "python config.py", "Print the resolved run configuration (defaults < TOML "
                                "< overrides) as JSON, checked as train.py checks it (paths: by train.py's preflight).")
    try:
        print(json.dumps(to_dict(load_config(path, overrides)), indent=2))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_cli(main)

"""Fine-tuning configuration: YAML file + ``--key value`` overrides, every key validated.

An unknown key, a missing value or a value of the wrong type is a :class:`ConfigError` that names
the key (with a suggestion for typos). The templates ``configs/finetune_orb_v3.yaml`` and ``finetune_orb_v2.yaml``
document every key (written by ``scripts/make_templates.py``; tests/test_templates.py keeps them in step).
Reading the YAML (files, packaged templates by name, ``--key value``) is :mod:`orb.training.config_files`.
"""

import difflib
import logging
import math
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

from orb.data.buckets import MAX_BUCKETS
from orb.data.mixture import replay_per_step
from orb.device import device_name
from orb.errors import ConfigError
from orb.models.config import MODEL_NAMES, ModelConfig
from orb.device import OPS_PROFILES
from orb.precision import PRECISIONS
from orb.training.config_files import TypedNumber, merged_settings, parse_overrides, read_yaml  # noqa: F401
from orb.training.schedule import SCHEDULES

ALGORITHMS = ("adam", "sgd")  # orb.training.optimizer.FlatAdam
MATMUL_PRECISIONS = ("highest", "high")  # the deprecated matmul_precision key


@dataclass
class LossWeights:
    energy: float = 1.0
    forces: float = 1.0
    stress: float = 1.0
    confidence: float = 1.0  # orb-v3
    equigrad: float = 0.0  # orb-v3 conservative


@dataclass
class ReferenceEnergyConfig:
    trainable: str = "auto"  # auto: orb-v2 trains them, orb-v3 keeps them (as orb-models) | true | false
    table: str = ""  # a published table by orb-models 0.7.0's name (vasp-r2scan, matpes-pbe, ...)
    file: str = ""
    fit: str = "none"  # none | residual (to DFT - starting model) | least_squares (to the DFT energies)


DataPath = Union[str, List[str]]  # one file or folder, or a list of them (read as one data set)


@dataclass
class AnchorConfig:
    """L2-SP: a penalty ``weight * sum((theta - theta_0)^2)`` pulling the trained weights toward the starting ones."""

    weight: float = 0.0  # 0 = off
    groups: List[str] = field(default_factory=list)  # parameter groups anchored ([] = every trained parameter)


@dataclass
class LoraConfig:
    """Low-rank adapters W + (alpha / rank) B A on the linear layers of the chosen groups' MLPs, merged into W in
    every exported checkpoint."""

    rank: Optional[int] = None  # null = off; else at least 1
    alpha: float = 8.0
    groups: List[str] = field(default_factory=lambda: ["layers", "heads"])
    train_others: bool = False  # false: only the adapters train; true: every parameter but the adapted weights


@dataclass
class ReplayConfig:
    """Structures of the foundation's own distribution trained and validated beside the target (replay)."""

    data_path: DataPath = ""
    val_data_path: DataPath = ""
    val_samples: int = 100
    labels: str = "data"  # data | model (the starting checkpoint's predictions)
    fraction: float = 0.0
    num_samples: int = 0
    selection: str = "fps"  # fps | random
    loss_weight: float = 1.0
    head: str = "shared"  # shared | separate
    in_selection: bool = False  # the best epoch (and early stopping) by validation loss + replay_val loss

    @property
    def enabled(self) -> bool:
        return bool(self.data_path)


@dataclass
class TrainConfig:
    train_data_path: DataPath = ""  # ASE SQLite, extxyz or any ase.io file, .aselmdb, a folder, or a list of these;
    val_data_path: DataPath = ""  # none by default: a run names its own data (check_training_data)
    val_fraction: float = 0.0  # without val_data_path: this share of the training structures held out, seeded
    checkpoint_path: str = ""
    output_dir: str = "outputs/run"
    device_target: str = "auto"
    device_id: int = 0
    batch_size: int = 8
    max_epochs: int = 10
    lr: float = 3e-4
    lr_schedule: str = "cosine"
    warmup_fraction: float = 0.05
    ema_decay: float = 0.99
    optimizer: str = "adam"
    gradient_clip_mode: str = "norm"  # orb-models 0.7.0's; "value" clamps elements as 0.4.2/0.5.5 did
    gradient_clip_val: float = 0.5
    loss_weights: LossWeights = field(default_factory=LossWeights)
    reference_energies: ReferenceEnergyConfig = field(default_factory=ReferenceEnergyConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    online_normalisation: bool = True  # the targets' normalisers absorb every training batch (orb-models')
    freeze: List[str] = field(default_factory=list)  # parameter groups kept at the starting weights
    lr_multipliers: Dict[str, float] = field(default_factory=dict)  # parameter group -> factor on lr
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    energy_key: str = ""  # where non-SQLite data keep their labels (orb.data.formats; "" = the defaults)
    forces_key: str = ""
    stress_key: str = ""
    charge_key: str = "charge"
    spin_key: str = "spin"
    patience: int = 0
    freeze_backbone: bool = False
    augmentation: bool = True
    random_seed: int = 1234
    buckets: List[List[int]] = field(default_factory=list)
    num_buckets: int = 0  # 0: chosen, weighing padded work against one compilation per bucket
    save_every_x_epochs: int = 5
    save_every_n_steps: int = 0
    save_every_minutes: float = 30.0
    keep_checkpoints: int = 3
    max_nonfinite_steps: int = 5
    log_every_n_steps: int = 10
    progress_bar: str = "auto"
    record_batches: bool = False
    num_threads: int = 0
    deterministic: bool = False  # bit-reproducible runs: one CPU kernel thread; MindSpore's deterministic computing
    data_workers: int = 2
    compile_cache: bool = True  # compiled graphs kept in the cache and loaded by later starts (orb.graph_cache)
    ops_profile: str = "auto"
    precision: str = "float32-high"  # orb.precision: float32-high | float32-highest | bf16-mixed | fp16-mixed | float64
    initial_loss_scale: float = 65536.0  # fp16-mixed: the dynamic loss scale's start (PyTorch GradScaler's init_scale)
    optimizer_shard: bool = False
    callbacks: List[str] = field(default_factory=list)  # "module:Name" of classes whose objects see the loop
    model: ModelConfig = field(default_factory=ModelConfig)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


CHOICES = {
    "lr_schedule": SCHEDULES,
    "ops_profile": OPS_PROFILES,
    "precision": PRECISIONS,
    "optimizer": ALGORITHMS,
    "reference_energies.trainable": ("auto", "true", "false"),
    "gradient_clip_mode": ("value", "norm", "none"),
    "progress_bar": ("auto", "true", "false"),
    "reference_energies.fit": ("none", "residual", "least_squares"),
    "replay.labels": ("data", "model"),
    "replay.selection": ("fps", "random"),
    "replay.head": ("shared", "separate"),
}
RENAMED = {"kernels": "'ops_profile' (auto | portable | cpu; 'builtin' kernels are the portable profile)"}
POSITIVE = ("batch_size", "max_epochs", "save_every_x_epochs", "log_every_n_steps",
            "model.latent_dim", "model.mlp_hidden_dim", "model.num_mlp_layers", "model.num_message_passing_steps",
            "model.num_rbf", "model.max_neighbors", "model.head_mlp_hidden_dim", "model.head_num_mlp_layers",
            "model.polynomial_order", "model.num_elements", "model.decoder_out_dim")
NON_NEGATIVE = ("device_id", "random_seed")
SEED_LIMIT = 2 ** 32  # numpy's and MindSpore's seeds are unsigned 32-bit
INT_LIMIT = SEED_LIMIT  # every integer setting (a count, a size, a seed) is below it
MAX_PROCESSES = 256  # data_workers and num_threads: beyond any node's cores
# Beyond these a run would only exhaust memory before its first step (2**32 epochs: a 256 GiB schedule table):
SIZE_LIMITS = {"max_epochs": 10 ** 6, "model.max_neighbors": 10 ** 4, "model.num_rbf": 10 ** 4,
               "model.latent_dim": 2 ** 16, "model.mlp_hidden_dim": 2 ** 16, "model.head_mlp_hidden_dim": 2 ** 16,
               "model.num_message_passing_steps": 10 ** 3, "model.num_mlp_layers": 10 ** 3,
               "model.head_num_mlp_layers": 10 ** 3, "loss_weights.energy": 1e6, "loss_weights.forces": 1e6,
               "loss_weights.stress": 1e6, "loss_weights.confidence": 1e6, "loss_weights.equigrad": 1e6,
               "anchor.weight": 1e6, "replay.loss_weight": 1e6, "lora.alpha": 1e6,
               # structures per step: the buckets' graph slots grow with it (4294967295: a 128 GiB allocation)
               "batch_size": 10 ** 6, "model.num_elements": 118, "model.decoder_out_dim": 2 ** 16,
               # lengths in Å (1e300 overflowed float32 into NaN radial-basis centres; the run went on) and the
               # envelope's power (2**32: every loss NaN)
               "model.radius": 100.0, "model.rbf_radius": 100.0, "model.cutoff_rmax": 100.0,
               "model.polynomial_order": 64}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping of settings, got {value!r}")
        return _build(tp, value, key + ".")
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {_coerce(k, key_type, f"{key}[{k!r}]"): _coerce(v, value_type, f"{key}.{k}") for k, v in value.items()}
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is Union and type(None) in typing.get_args(tp) and tp != DataPath:  # Optional[X]: null or an X
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(value, inner, key)
    if tp == DataPath:
        if isinstance(value, (list, tuple)):
            paths = [_coerce(v, str, f"{key}[{i}]") for i, v in enumerate(value)]
            if not all(paths):
                raise ConfigError(f"config key '{key}' lists an empty path: {value!r}")
            return paths[0] if len(paths) == 1 else paths
        return _coerce(value, str, key)
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
        try:
            number = float(value)  # an integer beyond float's range overflows
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"config key '{key}' must be a finite number, got {str(value)[:40]}")
        return number
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
        if abs(value) >= INT_LIMIT:
            raise ConfigError(f"config key '{key}' must be below {INT_LIMIT}, got {str(value)[:40]}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
        return value
    if tp is str:
        if value is None:
            return ""
        if isinstance(value, bool):  # true / false
            return "true" if value else "false"
        if isinstance(value, int):  # ConfigLoader's ints are plain decimals: their text is the value's
            return str(value)
        if isinstance(value, TypedNumber):  # typed on the command line: as typed
            return value.text
        if not isinstance(value, str):  # a float's text may not come back (1.10 -> 1.1)
            raise ConfigError(f"config key '{key}' must be a string, got {value!r} (quote it)")
        return value
    raise ConfigError(f"config key '{key}' has unsupported type {_type_name(tp)}")


def deprecated_matmul_precision(values: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """The old ``matmul_precision: high | highest`` as ``precision: float32-high | float32-highest``, with one
    deprecation line; given beside a ``precision`` that says otherwise, refused."""
    if "matmul_precision" not in values:
        return values
    values = dict(values)
    old = values.pop("matmul_precision")
    if old not in MATMUL_PRECISIONS:
        raise ConfigError(f"config key '{prefix}matmul_precision' must be one of {list(MATMUL_PRECISIONS)}, got "
                          f"{old!r} (it is deprecated: use 'precision')")
    new = f"float32-{old}"
    if values.get("precision", new) != new:
        raise ConfigError(f"config keys 'matmul_precision' ({old}) and 'precision' ({values['precision']}) "
                          "disagree: keep only 'precision'")
    values["precision"] = new
    logging.getLogger("orb").warning("config key 'matmul_precision' is deprecated: write 'precision: %s'", new)
    return values


def model_named_by_weights(values: Dict[str, Any]) -> Dict[str, Any]:
    """``checkpoint_path: NAME`` (published weights, :mod:`orb.pretrained`) gives ``model.name`` when the config does
    not; a config naming another model is refused (two names for one run's weights is a mistake either way)."""
    from orb.pretrained import published_name

    path, model = values.get("checkpoint_path"), values.get("model")
    name = published_name(path) if isinstance(path, str) else None
    if name is None or not isinstance(model, (dict, type(None))):
        return values
    given = (model or {}).get("name")
    if given is None:
        return dict(values, model=dict(model or {}, name=name))
    if given != name:
        raise ConfigError(f"config key 'checkpoint_path' names the published weights of {name}, but 'model.name' is "
                          f"{given}: set model.name to {name} (or leave it out: the weights' name sets it)")
    return values


def _build(cls, values: Dict[str, Any], prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    if cls is TrainConfig:
        values = model_named_by_weights(deprecated_matmul_precision(values))
    for key in values:
        if prefix + key in RENAMED:
            raise ConfigError(f"config key '{prefix}{key}' is now {RENAMED[prefix + key]}", prefix + key)
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}", prefix + key)
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in values.items()}
    if cls is ModelConfig:  # the model's name chooses the defaults of the other settings
        if kwargs.get("name", "orb_v2") not in MODEL_NAMES:
            close = difflib.get_close_matches(str(kwargs.get("name")), MODEL_NAMES, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"config key '{prefix}name': unknown model '{kwargs.get('name')}'{hint}; valid names: "
                              f"{', '.join(MODEL_NAMES)}")
        return ModelConfig.from_dict(kwargs)
    return cls(**kwargs)


def _validate(cfg: TrainConfig) -> TrainConfig:
    from orb.models.reference_energies import NUM_REFERENCE_ELEMENTS, load_reference_file, reference_table

    flat = flatten(cfg.to_dict())
    if cfg.reference_energies.table:
        reference_table(cfg.reference_energies.table)  # an unknown name is refused, listing the valid ones
    if cfg.reference_energies.file:  # (read at the model's build: its bad entry was a NaN loss an epoch later)
        load_reference_file(cfg.reference_energies.file, [0.0] * NUM_REFERENCE_ELEMENTS)
    try:
        cfg.device_target = flat["device_target"] = device_name(cfg.device_target)  # cpu -> CPU
    except ValueError as exc:
        raise ConfigError(f"config key 'device_target' {exc}") from None
    for key, choices in CHOICES.items():
        if flat[key] not in choices:
            raise ConfigError(f"config key '{key}' must be one of {list(choices)}, got {flat[key]!r}")
    for key in POSITIVE:
        if flat[key] < 1:
            raise ConfigError(f"config key '{key}' must be at least 1, got {flat[key]}")
    for key in NON_NEGATIVE:
        if flat[key] < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {flat[key]}")
    if cfg.lr <= 0:
        raise ConfigError(f"config key 'lr' must be positive, got {cfg.lr}")
    if not 0 <= cfg.warmup_fraction < 1:
        raise ConfigError(f"config key 'warmup_fraction' must be in [0, 1), got {cfg.warmup_fraction}")
    if cfg.gradient_clip_val <= 0 and cfg.gradient_clip_mode != "none":  # (unused without clipping)
        raise ConfigError(f"config key 'gradient_clip_val' must be positive, got {cfg.gradient_clip_val}")
    for name in ("energy", "forces", "stress", "confidence", "equigrad"):
        if getattr(cfg.loss_weights, name) < 0:
            raise ConfigError(f"config key 'loss_weights.{name}' must be >= 0")
    if not any(getattr(cfg.loss_weights, n) > 0 for n in ("energy", "forces", "stress")):
        raise ConfigError("config keys 'loss_weights.*' are all 0: nothing to train")
    for i, bucket in enumerate(cfg.buckets):
        if len(bucket) != 2 or min(bucket) < 2:
            raise ConfigError(f"config key 'buckets[{i}]' must be [num_nodes, num_edges] with sizes >= 2, got {bucket}")
    if not cfg.output_dir.strip():  # it would write the run into the working directory
        raise ConfigError("config key 'output_dir' is empty")
    if cfg.lr > 1:
        raise ConfigError(f"config key 'lr' must be at most 1, got {cfg.lr}")
    for key, limit in SIZE_LIMITS.items():
        if flat[key] > limit:
            raise ConfigError(f"config key '{key}' must be at most {limit}, got {flat[key]}")
    if not 0 <= cfg.num_threads <= MAX_PROCESSES:
        raise ConfigError(f"config key 'num_threads' must be 0 (MindSpore's default) to {MAX_PROCESSES}, "
                          f"got {cfg.num_threads}")
    if not 0 <= cfg.data_workers <= MAX_PROCESSES:
        raise ConfigError(f"config key 'data_workers' must be 0 (prepare batches in the training process) to "
                          f"{MAX_PROCESSES}, got {cfg.data_workers}")
    if not 0 <= cfg.num_buckets <= MAX_BUCKETS:
        raise ConfigError(f"config key 'num_buckets' must be 0 (chosen) to {MAX_BUCKETS} (each bucket compiles once), "
                          f"got {cfg.num_buckets}")
    if not 1 <= cfg.initial_loss_scale <= 2.0 ** 24:  # (NaN fails too)
        raise ConfigError(f"config key 'initial_loss_scale' must be in [1, 2^24] (fp16-mixed's dynamic loss scale "
                          f"starts there, halves on overflow), got {cfg.initial_loss_scale}")
    if not 0 <= cfg.ema_decay < 1:
        raise ConfigError(f"config key 'ema_decay' must be in [0, 1) (0 = off), got {cfg.ema_decay}")
    for key in ("radius", "cutoff_rmax", "rbf_radius"):
        if getattr(cfg.model, key) <= 0:
            raise ConfigError(f"config key 'model.{key}' must be positive, got {getattr(cfg.model, key)}")
    for key in ("save_every_n_steps", "keep_checkpoints", "max_nonfinite_steps"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {getattr(cfg, key)}")
    if cfg.save_every_minutes < 0:
        raise ConfigError(f"config key 'save_every_minutes' must be >= 0 (0 = off), got {cfg.save_every_minutes}")
    if cfg.patience < 0:
        raise ConfigError(f"config key 'patience' must be >= 0 (0 = train every epoch), got {cfg.patience}")
    if not 0 <= cfg.val_fraction < 1:
        raise ConfigError(f"config key 'val_fraction' must be in [0, 1) (the share of the training structures held "
                          f"out for validation; 0 = off), got {cfg.val_fraction}")
    if cfg.patience and not cfg.val_data_path and not cfg.val_fraction:
        raise ConfigError("config key 'patience' stops on the validation loss and needs val_data_path or val_fraction")
    if cfg.reference_energies.fit == "residual" and not cfg.checkpoint_path:
        raise ConfigError("config key 'reference_energies.fit': residual fits to the starting checkpoint's "
                          "errors and needs checkpoint_path (least_squares needs none)")
    for i, name in enumerate(cfg.callbacks):
        if name.count(":") != 1 or not all(name.split(":")):
            raise ConfigError(f"config key 'callbacks[{i}]' must be 'module:Name', got {name!r}")
    _validate_replay(cfg)
    _validate_strategies(cfg)
    return cfg


def _validate_strategies(cfg: TrainConfig) -> None:
    """freeze, lr_multipliers, anchor and lora: group names the model has, sane numbers."""
    from orb.models.groups import check_group

    layers = cfg.model.num_message_passing_steps
    for i, name in enumerate(cfg.freeze):
        check_group(name, f"freeze[{i}]", layers)
    for name, factor in cfg.lr_multipliers.items():
        check_group(name, f"lr_multipliers.{name}", layers)
        if not 0 <= factor <= 1e6:
            raise ConfigError(f"config key 'lr_multipliers.{name}' must be 0 (freezes the group) to 1e6, got {factor}")
    if cfg.anchor.weight < 0:
        raise ConfigError(f"config key 'anchor.weight' must be >= 0 (0 = off), got {cfg.anchor.weight}")
    for i, name in enumerate(cfg.anchor.groups):
        check_group(name, f"anchor.groups[{i}]", layers)
    lora = cfg.lora
    if lora.rank is None:
        return
    if lora.rank < 1:
        raise ConfigError(f"config key 'lora.rank' must be at least 1 (leave it null for no adapters), got {lora.rank}")
    width = min(cfg.model.latent_dim, cfg.model.mlp_hidden_dim, cfg.model.head_mlp_hidden_dim)
    if lora.rank > width:
        raise ConfigError(f"config key 'lora.rank' ({lora.rank}) is above the narrowest layer width ({width}): a "
                          "low-rank adapter must be narrower than the layers it adapts")
    if lora.alpha <= 0:
        raise ConfigError(f"config key 'lora.alpha' must be positive, got {lora.alpha}")
    if not lora.groups:
        raise ConfigError("config key 'lora.groups' is empty: name the groups whose MLPs get adapters")
    for i, name in enumerate(lora.groups):
        check_group(name, f"lora.groups[{i}]", layers)


def _validate_replay(cfg: TrainConfig) -> None:
    replay = cfg.replay
    if not 0 <= replay.fraction < 1:
        raise ConfigError(f"config key 'replay.fraction' must be in [0, 1) (the share of each step's structures "
                          f"drawn from replay data), got {replay.fraction}")
    for key in ("num_samples", "val_samples"):
        if getattr(replay, key) < 0:
            raise ConfigError(f"config key 'replay.{key}' must be >= 0, got {getattr(replay, key)}")
    if replay.loss_weight < 0:
        raise ConfigError(f"config key 'replay.loss_weight' must be >= 0, got {replay.loss_weight}")
    if not replay.enabled:
        if replay.fraction > 0 or replay.val_data_path:
            key = "fraction" if replay.fraction > 0 else "val_data_path"
            raise ConfigError(f"config key 'replay.{key}' is set but 'replay.data_path' is empty")
        return
    if replay.labels == "model" and not cfg.checkpoint_path:
        raise ConfigError("config key 'replay.labels': model labels replay data with the starting checkpoint's "
                          "predictions and needs checkpoint_path")
    if replay.in_selection and replay.val_samples == 0 and not replay.val_data_path:
        raise ConfigError("config key 'replay.in_selection' adds the held-out replay structures' loss to the "
                          "validation loss: hold some out (replay.val_samples > 0 or replay.val_data_path)")
    if replay.head == "separate" and replay.fraction == 0:
        raise ConfigError("config key 'replay.head': separate replay heads are trained only on replay structures; "
                          "set replay.fraction > 0 (or head: shared to only measure forgetting)")
    if replay.fraction > 0:
        replay_count = replay_per_step(cfg.batch_size, replay.fraction)
        if cfg.batch_size - replay_count < 1:
            raise ConfigError(f"config keys 'replay.fraction' ({replay.fraction}) and 'batch_size' "
                              f"({cfg.batch_size}) leave no target structure in a step")


MAPPINGS = ("lr_multipliers",)  # keys whose value is a mapping, not a block of settings


def flatten(d: Dict, prefix: str = "") -> Dict[str, Any]:
    """Nested settings as dotted keys (``model.name``): how errors and resume checks name them."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and prefix + k not in MAPPINGS:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config (a file, or a packaged template by name; none: the defaults), apply ``--key value``
    overrides and validate. ``checkpoint_path`` naming a checkpoint of this program, and no ``model.name``: the model
    is the checkpoint's architecture, any model key the config sets on top (the architecture was the default's)."""
    from orb.pretrained import published_name

    values = merged_settings(path, overrides)
    with values.naming_its_file():  # (a key of the file's, not one given on the command line)
        cfg = _validate(_build(TrainConfig, values))
    model = values.get("model") or {}
    if cfg.checkpoint_path and isinstance(model, dict) and "name" not in model and \
            published_name(cfg.checkpoint_path) is None:
        from orb.io.checkpoint import stored_settings  # (MindSpore's import: only for such a checkpoint)

        stored = stored_settings(cfg.checkpoint_path)
        if stored:
            return _validate(_build(TrainConfig, dict(values, model=dict(stored, **model))))
    return cfg


def config_from_dict(values: Dict[str, Any]) -> TrainConfig:
    return _validate(_build(TrainConfig, values))

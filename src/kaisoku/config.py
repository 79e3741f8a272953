"""Configuration: a tree of kw-only dataclasses, TOML files and dotted command-line overrides.

Each section is one dataclass; the docstring under each field is its ``--help`` text. A run's config is
built in this order: a preset (a Python function in :mod:`kaisoku.presets`), then a TOML file, then
``--section.field value`` overrides. Everything is validated before anything is launched.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

from kaisoku.config_sections import (
    ByteSize,
    CheckpointConfig,
    CompileMode,
    DataConfig,
    DistConfig,
    MemoryConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    SchedConfig,
    TrainConfig,
    kfac_setting_error,
)
from kaisoku.errors import ConfigError
from kaisoku.units import parse_bytes


@dataclass(kw_only=True)
class Config:
    """A whole training run."""

    run_dir: str = "runs/default"
    """Folder for config.toml, metrics.jsonl and checkpoints/."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)


# ----------------------------------------------------------------------------------------------------
# Introspection: field docs, types and dotted keys.


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def iter_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """Every leaf field as (dotted key, type, default, help text), in declaration order."""
    out: list[tuple[str, Any, Any, str]] = []
    docs = field_docs(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        key = f"{prefix}{f.name}"
        if _is_section(tp):
            out.extend(iter_fields(tp, key + "."))
        else:
            out.append((key, tp, getattr(defaults, f.name), docs.get(f.name, "")))
    return out


def type_name(tp: Any) -> str:
    """A short readable name for a field type, e.g. ``int`` or ``one of sgd, lars``."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(str(v) for v in typing.get_args(tp))
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def coerce(key: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (a string from the command line, or a TOML value) to field type ``tp``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise ConfigError(f"{key}: {value!r} is not valid; choose one of: {', '.join(map(str, choices))}")
    if origin in (types.UnionType, typing.Union):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value in (None, "none", "None", ""):
                    return None
                continue
            try:
                return coerce(key, arg, value)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(f"{key}: {value!r} is not a {type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{key}: {value!r} is not a bool; use true or false")
    if tp is ByteSize:
        try:
            return ByteSize(parse_bytes(value))
        except ConfigError:
            raise ConfigError(f"{key}: {value!r} is not a size such as 2GiB or 500MB") from None
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not an {tp.__name__}")
        try:
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return tp(value) if not (tp is int and isinstance(value, str)) else int(value, 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: {value!r} is not a{'n' if tp is int else ''} {tp.__name__}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if origin in (list, tuple):
        items = value.split(",") if isinstance(value, str) else list(value)
        args = typing.get_args(tp)
        item_tp = args[0] if args else str
        converted = [coerce(key, item_tp, item.strip() if isinstance(item, str) else item) for item in items]
        return tuple(converted) if origin is tuple else converted
    raise ConfigError(f"{key}: unsupported field type {tp}")


def _normalise_key(key: str) -> str:
    return key.replace("-", "_")


#: Keys that moved to another section -> where they live now.
MOVED_KEYS = {"train.precision": "precision.mode"}

#: Keys that are gone -> why, and what to do instead.
REMOVED_KEYS = {
    "data.crop_decode": (
        "data.crop_decode was removed: decoding each JPEG at the DCT scale of its crop read photos of "
        "ImageNet's size more slowly than exact decoding (0.86x in kaisoku bench loader); remove the setting"
    ),
}


def _resolve(cfg: Any, dotted: str) -> tuple[Any, str, Any]:
    """Find the section object, field name and type that ``dotted`` names, or raise ConfigError."""
    key = _normalise_key(dotted)
    if key in REMOVED_KEYS:
        raise ConfigError(REMOVED_KEYS[key])
    moved = MOVED_KEYS.get(key)
    if moved:
        raise ConfigError(f"{dotted} is now {moved}; set {moved} instead (e.g. --{moved} bf16)")
    parts = key.split(".")
    obj = cfg
    for depth, part in enumerate(parts):
        cls = type(obj)
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            where = ".".join(parts[:depth]) or "the config"
            valid = ", ".join(names)
            raise ConfigError(f"unknown config key '{dotted}': {where} has {valid}")
        tp = _hints(cls)[part]
        if depth == len(parts) - 1:
            if _is_section(tp):
                raise ConfigError(f"'{dotted}' is a section; set one of its fields, e.g. {dotted}.<field>")
            return obj, part, tp
        if not _is_section(tp):
            raise ConfigError(
                f"unknown config key '{dotted}': '{'.'.join(parts[: depth + 1])}' has no fields"
            )
        obj = getattr(obj, part)
    raise ConfigError(f"empty config key '{dotted}'")


def apply_override(cfg: Config, dotted: str, value: Any) -> None:
    """Set ``cfg.<dotted>`` to ``value`` after converting it to the field's type."""
    obj, name, tp = _resolve(cfg, dotted)
    setattr(obj, name, coerce(_normalise_key(dotted), tp, value))


def apply_mapping(cfg: Config, mapping: dict[str, Any], prefix: str = "") -> None:
    """Apply a nested mapping (a parsed TOML file) onto ``cfg``."""
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            _section(cfg, dotted)
            apply_mapping(cfg, value, dotted + ".")
        else:
            apply_override(cfg, dotted, value)


def _section(cfg: Config, dotted: str) -> Any:
    """The section object that ``dotted`` names, or ConfigError listing the sections there are."""
    section: Any = cfg
    for part in _normalise_key(dotted).split("."):
        cls = type(section)
        sections = [f.name for f in dataclasses.fields(cls) if _is_section(_hints(cls)[f.name])]
        if part not in sections:
            raise ConfigError(f"unknown config section '{dotted}'; sections: {', '.join(sections) or 'none'}")
        section = getattr(section, part)
    return section


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file, with a one-line error for a missing or malformed file."""
    path = Path(path).expanduser()
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as a nested dict of plain values."""
    return dataclasses.asdict(cfg, dict_factory=lambda items: {k: _plain(v) for k, v in items})


def _plain(value: Any) -> Any:
    return int(value) if isinstance(value, ByteSize) else value


def to_toml(cfg: Config) -> str:
    """The config as TOML text, every field written out."""
    return tomli_w.dumps(to_dict(cfg))


def from_dict(mapping: dict[str, Any]) -> Config:
    """Build a Config from a nested dict (e.g. a checkpoint's saved config)."""
    cfg = Config()
    apply_mapping(cfg, mapping)
    return cfg


def validate(cfg: Config) -> None:
    """Check each field's own range (what types alone do not catch); raise ConfigError naming the field.

    Checks that span sections, or need the world, the data or the model, are :func:`kaisoku.run_plan.resolve`'s.
    """
    checks: list[tuple[bool, str]] = [
        (cfg.data.global_batch > 0, "data.global_batch must be > 0"),
        (cfg.data.image_size >= 8, "data.image_size must be >= 8"),
        (0.0 < cfg.data.crop_scale_min <= 1.0, "data.crop_scale_min must be in (0, 1]"),
        (cfg.data.workers >= 0, "data.workers must be >= 0"),
        (0.0 <= cfg.data.val_fraction < 1.0, "data.val_fraction must be in [0, 1)"),
        (cfg.model.num_classes >= 0, "model.num_classes must be >= 0"),
        (cfg.model.width >= 0, "model.width must be >= 0 (0: the model's own)"),
        (cfg.optim.lr > 0, f"optim.lr must be > 0 (got {cfg.optim.lr})"),
        (cfg.optim.weight_decay >= 0, "optim.weight_decay must be >= 0"),
        (0 <= cfg.optim.momentum < 1, "optim.momentum must be in [0, 1)"),
        (cfg.optim.eta >= 0, f"optim.eta must be >= 0 (0: by model size) (got {cfg.optim.eta})"),
        (
            cfg.train.compile in typing.get_args(CompileMode),
            "train.compile must be off, model, optimizer, all or auto",
        ),
        (cfg.optim.eps >= 0, "optim.eps must be >= 0"),
        (cfg.sched.warmup_epochs >= 0, "sched.warmup_epochs must be >= 0"),
        (cfg.train.epochs > 0, "train.epochs must be > 0"),
        (cfg.train.max_steps >= 0, "train.max_steps must be >= 0"),
        (cfg.train.grad_accum >= 1, "train.grad_accum must be >= 1"),
        (0 <= cfg.train.label_smoothing < 1, "train.label_smoothing must be in [0, 1)"),
        (cfg.train.log_every >= 1, "train.log_every must be >= 1"),
        (cfg.train.val_every >= 0, "train.val_every must be >= 0"),
        (cfg.train.max_skips >= 1, "train.max_skips must be >= 1"),
        (0 < cfg.train.rollback_lr_scale < 1, "train.rollback_lr_scale must be in (0, 1)"),
        (cfg.train.max_rollbacks >= 1, "train.max_rollbacks must be >= 1"),
        (cfg.dist.nproc >= 0, "dist.nproc must be >= 0"),
        (cfg.dist.timeout > 0, "dist.timeout must be > 0 seconds"),
        (cfg.dist.max_restarts >= 0, "dist.max_restarts must be >= 0"),
        (cfg.checkpoint.keep >= 1, "checkpoint.keep must be >= 1"),
        (cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps must be >= 0"),
        (cfg.precision.history >= 1, f"precision.history must be >= 1 (got {cfg.precision.history})"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    kfac_error = kfac_setting_error(dataclasses.asdict(cfg.optim.kfac), "optim.kfac.")
    if kfac_error:
        raise ConfigError(kfac_error)
    losses = ("auto", "cross-entropy", "mse")
    if cfg.train.loss not in losses and ":" not in cfg.train.loss:
        raise ConfigError(
            f"train.loss: {cfg.train.loss!r} is not valid; choose one of: {', '.join(losses)}, or your own "
            "as package.module:function"
        )
    if cfg.data.dataset and ":" not in cfg.data.dataset:
        raise ConfigError(
            f"data.dataset: '{cfg.data.dataset}' is not an import path of the form package.module:name"
        )
    if cfg.data.dataset and cfg.data.path:
        raise ConfigError("data.dataset and data.path both name the training data; set one of them")

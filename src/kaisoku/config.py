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
from typing import TYPE_CHECKING, Any, Literal

import tomli_w

from kaisoku.errors import ConfigError
from kaisoku.units import parse_bytes

if TYPE_CHECKING:
    from kaisoku.data.shuffle import ShuffleSpec
    from kaisoku.data.staging import CacheSettings


class ByteSize(int):
    """A byte count; config files and the command line may write it as ``2GiB``, ``500MB`` or ``0``.

    Parsed once, when the config is read, by :func:`kaisoku.units.parse_bytes`.
    """


@dataclass(kw_only=True)
class ModelConfig:
    """Which network to train."""

    name: str = "resnet10"
    """Model builder: resnet10, resnet18, resnet34, resnet50 (torchvision ResNets), small-cnn."""
    num_classes: int = 0
    """Number of output classes; 0 takes it from the dataset."""
    stem: Literal["imagenet", "small", "compact"] = "compact"
    """ResNet stem: imagenet (7x7/2 conv + max-pool, for 224 px), small (3x3/1 conv, no pool) or compact (3x3/2 conv, no pool: for images of 24 to 64 px)."""
    zero_init_residual: bool = True
    """Start the last BatchNorm gamma of every residual block at zero, so each block begins as identity."""
    bn_momentum: float = 0.1
    """BatchNorm running-statistics momentum."""


@dataclass(kw_only=True)
class DataConfig:
    """Where samples come from and how they are batched and augmented."""

    path: str = ""
    """Dataset: a packed dataset (kaisoku pack), or a folder of class sub-folders of images. Empty: kaisoku's generated demo set."""
    cache_dir: str = "~/.cache/kaisoku"
    """Where the generated demo set is written on first use."""
    image_size: int = 24
    """Side of the square training crop, in pixels."""
    crop_scale_min: float = 0.35
    """Smallest area fraction of the random-resized crop."""
    global_batch: int = 128
    """Samples per optimizer step over all ranks; stays fixed whatever the world size."""
    workers: int = 1
    """Decoding workers per rank: threads for packed data with data.loader threads (at least 1), else DataLoader worker processes (0 decodes in the training process)."""
    val_fraction: float = 0.1
    """Fraction of a class-folder dataset held out for validation when it has no val/ split."""
    shuffle: Literal["global", "block", "partial"] = "global"
    """Packed data: sample order each epoch, keyed by (train.seed, epoch): global (any sample anywhere), block (permuted shards, data.block_shards shuffled together: sequential reads), partial (each node trains on its own shards and exchanges data.exchange of them with the other nodes every epoch)."""
    block_shards: int = 8
    """block: shards whose samples are shuffled together."""
    buffer_size: int = 0
    """block: samples in a sliding window that mixes across block edges (0: none)."""
    exchange: float = 0.0
    """partial: fraction Q in [0, 1] of each node's samples exchanged per epoch (0: local only; 1: like global)."""
    local_cache: str = ""
    """Packed data: node-local directory (SSD) that stages shards from data.path; empty: no disk tier."""
    local_capacity: ByteSize = ByteSize(0)
    """Bytes the node-local tier may use, e.g. 200GiB (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, kB/MB/GB/TB of 1000); 0 with data.local_cache: the free space of its file system minus a margin (logged)."""
    ram_capacity: ByteSize = ByteSize(0)
    """Bytes of RAM (/dev/shm, shared by a node's ranks) for staged shards, e.g. 16GiB; 0: off."""
    ram_dir: str = "/dev/shm/kaisoku"
    """Where the RAM tier, exchanged samples and the cache's control files live."""
    skip_corrupt: bool = False
    """Packed data: skip (and count) damaged records instead of stopping with an error naming them."""
    crop_decode: bool = False
    """Packed data: decode each JPEG at the smallest DCT scale (1/2, 1/4, 1/8) its training crop allows: much faster for large photos, pixels differ slightly from the exact decode (the default)."""
    loader: Literal["threads", "processes"] = "threads"
    """Packed data: how batches are made: threads (data.workers threads, at least 1, decode without the GIL into reused batch buffers; the fastest) or processes (a DataLoader with data.workers worker processes). Same batches either way."""


@dataclass(kw_only=True)
class KFACConfig:
    """K-FAC: precondition Linear, Conv1d, Conv2d and BatchNorm gradients with Kronecker-factored curvature."""

    enabled: bool = False
    """Precondition gradients with K-FAC before every optimizer step (works with sgd and lars)."""
    factor_update_steps: int = 1
    """Update the running-average factors A and G every this many steps."""
    inv_update_steps: int = 10
    """Recompute the eigendecompositions (or inverses) every this many steps."""
    damping: float = 1e-3
    """Tikhonov damping: eigen applies (G (x) A + damping I)^-1; inverse adds sqrt(damping) to each factor."""
    factor_decay: float = 0.95
    """Weight of the old running average in each factor update, in [0, 1)."""
    kl_clip: float = 1e-3
    """Scale each update so that lr^2 * sum(v . g) <= kl_clip; 0 disables KL clipping."""
    method: Literal["eigen", "inverse"] = "eigen"
    """eigen (exact damping) or inverse (inverses with factored damping)."""
    memory_mode: Literal["full", "owner"] = "full"
    """full: every rank keeps every decomposition; owner: only its owner keeps it and broadcasts the preconditioned gradient."""
    bn: Literal["diagonal", "unit", "skip"] = "diagonal"
    """BatchNorm Fisher: diagonal, unit (2x2 per channel) or skip (left to the optimizer)."""
    skip_layers: list[str] = field(default_factory=list)
    """Module or class names K-FAC leaves to the optimizer."""
    bucket_cap_mb: float = 25.0
    """Size of the flat buffers the factor statistics are all-reduced in, in MiB."""
    stat_fraction: float = 1.0
    """Share of each batch (its first samples) the Linear/conv factor statistics are computed on, in (0, 1]."""


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer and its hyper-parameters."""

    name: Literal["sgd", "lars", "lamb", "adamw"] = "sgd"
    """Optimizer: sgd (momentum SGD), lars (layer-wise trust ratio, for large batches), lamb or adamw."""
    lr: float = 0.2
    """Peak learning rate (after warmup)."""
    momentum: float = 0.9
    """Momentum factor."""
    nesterov: bool = False
    """Use Nesterov momentum."""
    weight_decay: float = 5e-5
    """L2 weight decay."""
    no_decay_bn_bias: bool = True
    """Exclude BatchNorm parameters and biases (ndim <= 1) from weight decay (and from LARS adaptation)."""
    eta: float = 0.0
    """LARS trust coefficient: the layer's step is scaled by eta * ||w|| / (||g|| + wd * ||w|| + eps); 0: by model size, 0.001 * (25.6e6 / params) ** 0.6 in [0.001, 0.08]."""
    trust_clip: bool = False
    """LARC: clip the LARS trust ratio so the layer lr never exceeds the global lr."""
    eps: float = 1e-9
    """LARS denominator epsilon."""
    compile: bool = False
    """Run the LARS update through torch.compile (fused kernels on GPUs; the first step compiles)."""
    kfac: KFACConfig = field(default_factory=KFACConfig)


@dataclass(kw_only=True)
class SchedConfig:
    """The learning-rate schedule, per optimizer step."""

    name: Literal["constant", "cosine", "arccot", "poly", "step"] = "cosine"
    """Schedule after warmup: constant, cosine, arccot (arc-cotangent), poly (polynomial) or step."""
    warmup_epochs: float = 0.5
    """Linear warmup, in epochs, up to the schedule's value where warmup ends (the peak, except arccot: about 0.94 of it with slope 10)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak (cosine, poly)."""
    arccot_center: float = 0.5
    """arccot: where the learning rate is exactly half the peak, as a fraction of the whole run."""
    arccot_slope: float = 10.0
    """arccot: steepness; lr = lr0 * arccot(slope * (t - center)) / pi with t the fraction of the run done."""
    poly_power: float = 2.0
    """poly: exponent of the polynomial decay."""
    step_milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])
    """step: fractions of the run at which the learning rate is multiplied by step_gamma."""
    step_gamma: float = 0.1
    """step: multiplier at each milestone."""


CompileMode = Literal["off", "model", "optimizer", "all", "auto"]
"""What ``train.compile`` passes through torch.compile."""


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop."""

    epochs: float = 6.0
    """Epochs to train (fractions allowed)."""
    max_steps: int = 0
    """Stop after this many optimizer steps; 0 runs all epochs."""
    seed: int = 0
    """Seed of every random choice: init, sample order (seed, epoch), augmentation (seed, epoch, index)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast precision: fp32, bf16 (CPU and CUDA) or fp16 with a gradient scaler (CUDA only)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (gradients synchronised on the last one only)."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing."""
    compile: CompileMode = "off"
    """torch.compile: off, model, optimizer (its step), all, or auto (times 20 steps each way, keeps the faster)."""
    val_every: int = 0
    """Validate every N steps; 0 validates at the end of each epoch."""
    log_every: int = 10
    """Write a metrics line every N steps."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device: auto picks CUDA when available."""
    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"
    """A NaN/inf loss or gradient: stop (exit 4 naming the step and the first layer), skip (drop the step, as a gradient scaler does; checked every step) or rollback (reload the newest checkpoint with a lower learning rate). Checked at each log line and before every checkpoint; a checkpoint with non-finite weights is never written."""
    max_skips: int = 10
    """skip: stop after this many consecutive skipped steps."""
    rollback_lr_scale: float = 0.5
    """rollback: multiply the learning rate by this at each rollback."""
    max_rollbacks: int = 3
    """rollback: stop after this many rollbacks in one run."""


@dataclass(kw_only=True)
class DistConfig:
    """Process groups and launching."""

    nproc: int = 0
    """Ranks to launch on this node; 0: one per GPU, else 2 CPU ranks."""
    timeout: float = 300.0
    """Seconds a collective waits for a peer before the run stops (torch's own default is 30 minutes)."""
    max_restarts: int = 0
    """Times torchrun restarts the ranks after a failure; a restarted run resumes from its newest checkpoint."""
    eager_init: bool = True
    """Join the process group in a background thread while the model and data are built."""
    buckets: Literal["layer-groups", "uniform"] = "layer-groups"
    """DDP gradient buckets: layer-groups (small near the output, growing towards the input) or uniform."""
    first_bucket_mb: float = 1.0
    """layer-groups: size of the first bucket (output end), in MiB."""
    bucket_cap_mb: float = 25.0
    """Largest bucket, in MiB."""
    bucket_growth: float = 2.0
    """layer-groups: size ratio between consecutive buckets."""
    compress: Literal["none", "bf16"] = "none"
    """Gradient compression on the wire: none or bf16 (halves all-reduce bytes)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints: what, when, how many."""

    every_steps: int = 0
    """Save every N optimizer steps; 0 saves at the end of each epoch."""
    keep: int = 3
    """How many of the newest checkpoints to keep."""
    resume: str = ""
    """Resume from: "" (no), "auto" (the newest valid checkpoint in the run dir) or a checkpoint file."""


@dataclass(kw_only=True)
class MetricsConfig:
    """Progress, logs and summaries."""

    progress: bool = True
    """Show a progress bar on rank 0."""
    tensorboard: bool = False
    """Also write TensorBoard event files under the run dir (needs the tensorboard package)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """Hybrid data x pipeline parallelism and switch-parallel."""

    dp: int = -1
    """Data-parallel replicas; -1: the world size divided by pp. dp x pp must equal the world size."""
    pp: int = 1
    """Pipeline stages per replica (1: plain data parallelism with DDP)."""
    microbatches: int = 4
    """Micro-batches per replica batch when pp > 1; must divide the per-replica batch."""
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    """Pipeline schedule."""
    virtual_stages: int = 1
    """Stages per rank for interleaved-1f1b (2 or more to interleave)."""
    balance: Literal["parameters", "time"] = "parameters"
    """Split the model's blocks into stages balanced by parameter count or by time measured on rank 0."""
    switch: str = ""
    """Switch-parallel schedule, e.g. "dp2xpp2:0-10,dp4:10-" (half-open ranges, last open-ended); overrides dp/pp."""
    switch_unit: Literal["epoch", "step"] = "epoch"
    """What the ranges of parallel.switch count."""

    @property
    def hybrid(self) -> bool:
        """True when training runs on pipeline stages or switches layout (pp > 1 or a switch schedule)."""
        return self.pp > 1 or bool(self.switch.strip())


@dataclass(kw_only=True)
class MemoryConfig:
    """Training memory: recomputation of activations, the optimizer step inside backward."""

    recompute: Literal["none", "blocks", "selective"] = "none"
    """Activation checkpointing per model block: none, blocks (recompute each block in backward) or selective (keep conv/matmul outputs, recompute the cheap element-wise ops). Bit-identical training."""
    blocks: str = ""
    """Blocks that memory.recompute applies to, as indices of the model's ordered blocks ("1,3-6"); empty: all."""
    update_in_backward: bool = False
    """Update each parameter as soon as its gradient is final (under DDP: per bucket after its all-reduce) and free the gradient; same weights. SGD, LARS, LAMB; not with grad_accum > 1, K-FAC, hybrid parallelism, fp16, on_nonfinite skip or a compiled optimizer."""


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


def _resolve(cfg: Any, dotted: str) -> tuple[Any, str, Any]:
    """Find the section object, field name and type that ``dotted`` names, or raise ConfigError."""
    parts = _normalise_key(dotted).split(".")
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


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Check values that types alone do not catch; raise ConfigError naming the field.

    ``world_size`` is the number of ranks the run will have, where it is known before launching; the
    parallel layout is checked against it then (else on each rank, with the world it joined).
    """
    checks: list[tuple[bool, str]] = [
        (cfg.data.global_batch > 0, "data.global_batch must be > 0"),
        (cfg.data.image_size >= 8, "data.image_size must be >= 8"),
        (0.0 < cfg.data.crop_scale_min <= 1.0, "data.crop_scale_min must be in (0, 1]"),
        (cfg.data.workers >= 0, "data.workers must be >= 0"),
        (0.0 <= cfg.data.val_fraction < 1.0, "data.val_fraction must be in [0, 1)"),
        (cfg.model.num_classes >= 0, "model.num_classes must be >= 0"),
        (cfg.optim.lr > 0, f"optim.lr must be > 0 (got {cfg.optim.lr})"),
        (cfg.optim.weight_decay >= 0, "optim.weight_decay must be >= 0"),
        (0 <= cfg.optim.momentum < 1, "optim.momentum must be in [0, 1)"),
        (cfg.optim.eta >= 0, f"optim.eta must be >= 0 (0: by model size) (got {cfg.optim.eta})"),
        (cfg.train.compile in typing.get_args(CompileMode), "train.compile must be off, model, optimizer, all or auto"),
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
        (cfg.optim.kfac.factor_update_steps >= 1, "optim.kfac.factor_update_steps must be >= 1"),
        (cfg.optim.kfac.inv_update_steps >= 1, "optim.kfac.inv_update_steps must be >= 1"),
        (cfg.optim.kfac.damping >= 0, "optim.kfac.damping must be >= 0"),
        (0 <= cfg.optim.kfac.factor_decay < 1, "optim.kfac.factor_decay must be in [0, 1)"),
        (cfg.optim.kfac.kl_clip >= 0, "optim.kfac.kl_clip must be >= 0"),
        (0 < cfg.optim.kfac.stat_fraction <= 1, "optim.kfac.stat_fraction must be in (0, 1]"),
        (cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    from kaisoku.engine.compile import compile_conflict

    conflict = compile_conflict(cfg.train.compile, hybrid=cfg.parallel.hybrid, kfac=cfg.optim.kfac.enabled)
    if conflict:
        raise ConfigError(conflict)
    if cfg.memory.update_in_backward:
        from kaisoku.memory.in_backward import in_backward_conflict

        conflict = in_backward_conflict(
            optimizer=cfg.optim.name,
            grad_accum=cfg.train.grad_accum,
            kfac=cfg.optim.kfac.enabled,
            hybrid=cfg.parallel.hybrid,
            precision=cfg.train.precision,
            on_nonfinite=cfg.train.on_nonfinite,
            compile_mode=cfg.train.compile,
            compile_optimizer=cfg.optim.compile,
        )
        if conflict:
            raise ConfigError(conflict)
    if cfg.memory.recompute != "none" and cfg.parallel.hybrid:
        raise ConfigError("memory.recompute is for data parallelism; set it to none with parallel.pp > 1 or a switch")
    shuffle, cache = data_settings(cfg.data)
    _validate_parallel(cfg, world_size, shuffle.depends_on_nodes, cache.enabled)
    if cfg.data.path and not Path(cfg.data.path).expanduser().exists():
        raise ConfigError(f"data.path {cfg.data.path} does not exist; point it at a dataset folder")
    if cfg.data.path and not Path(cfg.data.path).expanduser().is_dir():
        raise ConfigError(f"data.path {cfg.data.path} is not a folder of class sub-folders")


def data_settings(data: DataConfig, num_nodes: int = 1) -> tuple[ShuffleSpec, CacheSettings]:
    """The shuffle and the node cache's settings of ``data.*``; each checks its own values (ConfigError)."""
    from kaisoku.data.shuffle import ShuffleSpec
    from kaisoku.data.staging import CacheSettings

    shuffle = ShuffleSpec(
        name=data.shuffle,
        block_shards=data.block_shards,
        buffer_size=data.buffer_size,
        exchange=data.exchange,
        num_nodes=num_nodes,
    )
    cache = CacheSettings(
        local_dir=data.local_cache,
        local_capacity=int(data.local_capacity),
        ram_dir=data.ram_dir,
        ram_capacity=int(data.ram_capacity),
    )
    return shuffle, cache


def _validate_parallel(cfg: Config, world_size: int | None, node_shuffle: bool, node_cache: bool) -> None:
    """Check ``parallel.*`` (through :func:`kaisoku.distributed.layout.check_parallel`) and what it excludes."""
    from kaisoku.distributed.layout import check_parallel

    par = cfg.parallel
    check_parallel(
        world_size=world_size,
        global_batch=cfg.data.global_batch,
        dp=par.dp,
        pp=par.pp,
        microbatches=par.microbatches,
        schedule=par.schedule,
        virtual_stages=par.virtual_stages,
        switch=par.switch,
        unit=par.switch_unit,
        block_count=functools.partial(_block_count, cfg.model),
    )
    if not par.hybrid:
        return
    what = "parallel.switch" if par.switch.strip() else f"parallel.pp {par.pp}"
    unsupported = [
        (cfg.train.grad_accum != 1, f"train.grad_accum {cfg.train.grad_accum}: use parallel.microbatches"),
        (cfg.optim.kfac.enabled, "optim.kfac.enabled (K-FAC runs on data parallelism only)"),
        (cfg.train.precision == "fp16", "train.precision fp16 (use bf16 or fp32)"),
        (node_shuffle, f"data.shuffle {cfg.data.shuffle} (use global or block)"),
        (node_cache, "data.local_cache / data.ram_capacity (the node cache plans for data-parallel ranks)"),
    ]
    for refused, setting in unsupported:
        if refused:
            raise ConfigError(f"{what} does not work with {setting}")


def _block_count(model: ModelConfig) -> int:
    from kaisoku.models.zoo import block_count

    return block_count(model.name, stem=model.stem)

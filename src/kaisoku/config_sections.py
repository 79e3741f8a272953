"""The sections of kaisoku's config tree: one kw-only dataclass per section, a docstring under each field.

The docstrings are the ``kaisoku train --help`` text. :mod:`kaisoku.config` puts the sections together
into :class:`~kaisoku.config.Config` and reads, writes and validates it.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal


class ByteSize(int):
    """A byte count; config files and the command line may write it as ``2GiB``, ``500MB`` or ``0``.

    Parsed once, when the config is read, by :func:`kaisoku.units.parse_bytes`.
    """


@dataclass(kw_only=True)
class ModelConfig:
    """Which network to train."""

    name: str = "resnet10"
    """Model: your own as package.module:factory (a function or nn.Module class, given the run's ModelSpec if it takes an argument), or one of kaisoku's: resnet10, resnet18, resnet34, resnet50 (torchvision ResNets), small-cnn, cosmoflow (3D CNN regressing 4 parameters from [4, D, D, D] volumes, D = data.image_size), vit-tiny (6 layers, width 192, patch 4 for 32-64 px), vit-b16 (torchvision ViT-B/16); vision transformers take their image size from data.image_size."""
    num_classes: int = 0
    """Number of output classes; 0 takes it from the dataset."""
    stem: Literal["imagenet", "small", "compact"] = "compact"
    """ResNet stem: imagenet (7x7/2 conv + max-pool, for 224 px), small (3x3/1 conv, no pool) or compact (3x3/2 conv, no pool: for images of 24 to 64 px)."""
    zero_init_residual: bool = True
    """Start the last BatchNorm gamma of every residual block at zero, so each block begins as identity."""
    bn_momentum: float = 0.1
    """BatchNorm running-statistics momentum."""
    width: int = 0
    """Channels of the first conv block, doubled at each block: cosmoflow (five blocks; 0: the reference's 32; cosmoflow-cpu uses 8 to train on a CPU) and small-cnn (three blocks; 0: 32)."""


@dataclass(kw_only=True)
class DataConfig:
    """Where samples come from and how they are batched and augmented."""

    path: str = ""
    """Dataset: a packed dataset (kaisoku pack), or a folder of class sub-folders of images. Empty: kaisoku's generated demo set (or data.dataset)."""
    dataset: str = ""
    """Your own map-style Dataset of (input, target) pairs or dict samples, as package.module:name: a Dataset, a Dataset class, or a function returning one or a (train, val) pair."""
    collate: str = ""
    """Your own collate function for data.dataset, as package.module:name: called with a list of samples, it returns a batch ((inputs, targets), or a dict the model takes as keyword arguments); empty: torch's default collate."""
    cache_dir: str = "~/.cache/kaisoku"
    """Where the generated demo set is written on first use."""
    image_size: int = 24
    """Side of the square training crop, in pixels."""
    crop_scale_min: float = 0.35
    """Smallest area fraction of the random-resized crop."""
    global_batch: int = 128
    """Samples per optimizer step over all ranks; stays fixed whatever the world size."""
    workers: int = 1
    """Decoding workers per rank: worker processes kept for the whole run for packed data with data.loader batch (0: one thread of the training process decodes), threads with data.loader threads (at least 1), DataLoader worker processes otherwise (0 decodes in the training process)."""
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
    loader: Literal["batch", "threads", "processes"] = "batch"
    """Packed data: how batches are made: batch (data.workers worker processes, started once and kept across epochs, each decoding whole batches in one call into batch buffers in shared memory, so that no core waits for another's Python; the fastest), threads (data.workers threads of the training process, at least 1, sample by sample into reused buffers) or processes (a DataLoader with data.workers worker processes, started each epoch, collating samples); all three give the same batches."""
    decode: Literal["cpu", "gpu"] = "cpu"
    """Packed JPEG data: where training images are decoded: cpu (the host, by data.loader) or gpu (the training device: data.workers threads only read records and draw the keyed crops, the CUDA device decodes each batch in one nvJPEG call and crops, resizes and flips there; same crops and flips, pixels within a few levels of the host path's). Without a CUDA device gpu decodes on the host, after one line."""


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
    overhead_target: float = 0.0
    """0: factor_update_steps and inv_update_steps as given; in (0, 1): after 5 warm-up steps (4 timed), choose them (powers of two up to 128) so that K-FAC's amortised overhead (statistics, decompositions, preconditioning, measured; slowest rank) stays under this fraction of the plain step time; chosen once, logged, the same on every rank, kept on resume."""
    factor_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the Linear/conv factor statistics (matrix-product inputs and sums) and of the stored factors: float32, or bfloat16 (half the factor memory; much faster statistics on CPUs with AVX512-BF16/AMX and on GPUs, about 0.5% relative error); blending and decompositions stay float32."""


#: K-FAC's numeric settings and the range each must lie in: the one home of these checks, applied to the
#: config's ``optim.kfac.*`` and to the values :class:`~kaisoku.optim.kfac.KFAC` is given from Python.
KFAC_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "factor_update_steps": (lambda v: v >= 1, ">= 1"),
    "inv_update_steps": (lambda v: v >= 1, ">= 1"),
    "damping": (lambda v: v >= 0, ">= 0"),
    "factor_decay": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "kl_clip": (lambda v: v >= 0, ">= 0 (0: off)"),
    "bucket_cap_mb": (lambda v: v > 0, "> 0"),
    "stat_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "overhead_target": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "grad_accum": (lambda v: v >= 1, ">= 1"),
    "max_interval": (lambda v: v >= 1, ">= 1"),
}


def kfac_choices(name: str) -> tuple[str, ...]:
    """The values K-FAC's setting ``name`` (method, memory_mode, bn, factor_dtype) may take: its config
    field's ``Literal``, so the config and the constructor accept the same words."""
    return typing.get_args(typing.get_type_hints(KFACConfig)[name])


def kfac_setting_error(values: Mapping[str, object], prefix: str) -> str:
    """The first K-FAC setting in ``values`` outside its range or choices, as one line naming it with
    ``prefix`` (``"optim.kfac."`` or ``"K-FAC "``); "" when all are valid. Values that are not plain
    numbers or words (schedules given as functions) are the caller's to check."""
    for name, value in values.items():
        if name in KFAC_RANGES and isinstance(value, (int, float)) and not isinstance(value, bool):
            accepts, expected = KFAC_RANGES[name]
            if not accepts(value):
                return f"{prefix}{name} must be {expected}, got {value}"
        elif isinstance(value, str):
            choices = kfac_choices(name)
            if value not in choices:
                return f"{prefix}{name} must be one of {', '.join(choices)}, got '{value}'"
    return ""


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
    """Exclude norm parameters and biases (ndim <= 1) and a ViT's class token and position embedding from weight decay (and from LARS/LAMB adaptation)."""
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
    step_factors: list[float] = field(default_factory=list)
    """step: the multiplier of the peak from each milestone on, one per milestone (e.g. 0.25, 0.125); empty: step_gamma compounded."""


TaskName = Literal["auto", "classification", "token-classification", "language-model", "regression"]
"""What a run's data is for (``train.task``)."""
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
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (gradients synchronised on the last one only)."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing."""
    loss: str = "auto"
    """Loss: your own as package.module:function (called as loss(outputs, targets); with dict samples targets is the whole batch), or auto, cross-entropy, mse: auto uses the model's own loss where its output carries one (a Hugging Face model given labels), else the task's (cross-entropy for classification and token targets, -100 left out; mse, mean squared error, for a regression set such as kaisoku datagen --kind cosmo); a loss that does not fit the task is refused."""
    metrics: list[str] = field(default_factory=list)
    """Your own validation metrics, as package.module:name import paths (comma-separated): a function metric(outputs, targets) returning the batch's mean, or a torchmetrics metric (an instance, or a class taking no arguments); each is reported as val_<name>, reduced over every rank."""
    task: TaskName = "auto"
    """What the data is for: auto (read from the targets: integer scalars are classification, integer sequences token-classification, or language-model where a dict sample's labels equal its input_ids; float targets regression), classification, token-classification (a label per token), language-model (a causal model: the logits at t predict the label at t+1) or regression."""
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
    nnodes: str = "1"
    """Hosts of the run: N, or MIN:MAX to go on with fewer hosts after one is lost (torchrun elastic restarts, dist.max_restarts) and grow back to MAX when a lost host returns (the same command there, with --resume auto); more than 1 needs dist.rdzv_endpoint and the same command on every host."""
    node_rank: int = -1
    """This host's index with a fixed dist.nnodes (torchrun's static rendezvous at dist.rdzv_endpoint); -1: hosts get their index at the c10d rendezvous."""
    rdzv_endpoint: str = ""
    """HOST[:PORT] of the rendezvous with dist.nnodes > 1 (port 29400 when left out): an address of one of the hosts every host can reach."""
    timeout: float = 300.0
    """Seconds a collective waits for a peer before the run stops (torch's own default is 30 minutes)."""
    short_timeout: float = 60.0
    """Seconds a collective waits during validation and the start-up checks after the group is joined (same data on every rank, the loader's set-up), where every rank runs the same short steps: a rank that never comes is said in this time, not after dist.timeout; 0: dist.timeout throughout. Reading a checkpoint keeps dist.timeout (a large one may take minutes)."""
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
    async_save: bool = False
    """Sharded checkpoints (parallel.shard grad or full): write the shards in the background while training goes on; the step folder appears once complete (at the next save or the end of training)."""


@dataclass(kw_only=True)
class MetricsConfig:
    """Progress, logs and summaries."""

    progress: bool = True
    """Show a progress bar on rank 0."""
    tensorboard: bool = False
    """Also write TensorBoard event files under the run dir (needs the tensorboard package)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """Hybrid data x pipeline parallelism, switch-parallel, and sharded data parallelism."""

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
    shard: Literal["none", "grad", "full"] = "none"
    """Shard the weights, gradients and optimizer state over the data-parallel ranks (FSDP2, per model block): none (DDP: every rank holds everything), grad (ZeRO-2-like: weights gathered for forward stay whole until backward, one all-gather per step) or full (ZeRO-3-like: gathered again for backward; the least memory). Each rank then holds about 1/N of the model state."""
    dp_replicate: int = 1
    """With parallel.shard: replicas of the sharded model (HSDP): the ranks split into this many groups, each holding one full copy sharded over its world / dp_replicate ranks, gradients averaged between groups. Set it to the node count to shard within a node and replicate across nodes. Must divide the world size."""

    @property
    def hybrid(self) -> bool:
        """True when training runs on pipeline stages or switches layout (pp > 1 or a switch schedule)."""
        return self.pp > 1 or bool(self.switch.strip())


@dataclass(kw_only=True)
class MemoryConfig:
    """Training memory: recomputation, compression and offload of activations, the optimizer step inside backward, the budget planner."""

    recompute: Literal["none", "blocks", "selective"] = "none"
    """Activation checkpointing per model block: none, blocks (recompute each block in backward) or selective (keep conv/matmul outputs, recompute the cheap element-wise ops). Bit-identical training."""
    blocks: str = ""
    """Blocks that memory.recompute applies to, as indices of the model's ordered blocks ("1,3-6"); empty: all."""
    compress: Literal["none", "bf16", "int8"] = "none"
    """Keep saved activations compressed until backward: bf16, or int8 with a per-tensor scale from a 16-step history of absolute maxima. Not exact (see the README)."""
    update_in_backward: bool = False
    """Update each parameter as soon as its gradient is final (under DDP: per bucket after its all-reduce) and free the gradient; same weights. SGD, LARS, LAMB; not with grad_accum > 1, K-FAC, hybrid parallelism, fp16, on_nonfinite skip or a compiled optimizer."""
    offload: Literal["none", "pinned", "disk"] = "none"
    """Move saved activations out until backward: pinned (CUDA: pinned host memory on a side stream, prefetched back) or disk (files in memory.offload_dir, background writer, read-ahead in backward order). Exact."""
    offload_dir: str = ""
    """Node-local directory for memory.offload disk (and for the planner's offload choice); must exist and be writable."""
    budget: str = ""
    """Memory one training step may add to what the run holds between steps (activations, gradients, temporaries): a size (2GiB) or a fraction of the GPU's or host's memory (0.5). Profiles one step, then picks keep/compress/recompute/offload per block with the least added time; logged and written to metrics.jsonl."""
    policy: str = ""
    """Force a technique per block, e.g. "0-2:recompute,5:compress" (keep, compress, int8, recompute, offload); with memory.budget the planner chooses the other blocks."""
    allow_shard: bool = True
    """With memory.budget on 2+ data-parallel ranks (parallel.shard none): the planner may choose parallel.shard full instead of activation techniques, when it fits the budget and its measured all-gather + reduce-scatter time is less than the cheapest per-block plan's; false: per-block plans only."""


PrecisionMode = Literal["fp32", "bf16", "fp16", "int8-stats", "int16-stats", "fp8-stats"]
"""What ``precision.mode`` runs the model in."""


@dataclass(kw_only=True)
class PrecisionConfig:
    """Numeric precision: autocast, or low precision with shared exponents chosen from statistics."""

    mode: PrecisionMode = "fp32"
    """fp32; bf16 autocast (CPU and CUDA); fp16 autocast with a gradient scaler (CUDA only); or int8-stats, int16-stats, fp8-stats: every Conv2d/Linear rounds its weight, input and output gradient to int8/int16 fixed point or fp8 (E4M3 forward, E5M2 gradients) with a per-tensor exponent from the last precision.history absolute maxima (emulated on the CPU; real fp8 matmuls for Linear layers on GPUs with fp8 tensor cores)."""
    history: int = 16
    """*-stats: absolute maxima each tensor's exponent e = ceil(log2(max)) is chosen from."""
    keep: list[str] = field(default_factory=lambda: ["first", "last"])
    """*-stats: Conv2d/Linear layers kept in precision.keep_format: layer names (as in model.named_modules), first, last; empty: none."""
    keep_format: Literal["bf16", "fp32"] = "bf16"
    """*-stats: the format of the kept layers."""
    tensors: list[str] = field(default_factory=lambda: ["weights", "activations", "gradients"])
    """*-stats: what the quantized layers round (the others stay float32)."""
    exponent: Literal["stats", "fixed"] = "stats"
    """*-stats: stats (from the amax history) or fixed (precision.fixed_exponent for every tensor: the control without statistics)."""
    fixed_exponent: int = 0
    """exponent fixed: the shared exponent of every tensor (int8: values in [-1, 1) on a grid of 2^-7 at 0)."""
    gradient_rounding: Literal["nearest", "stochastic"] = "stochastic"
    """int8-stats/int16-stats: how gradients round to fixed point: stochastic (unbiased; random bits keyed by train.seed and the layer) or nearest."""
    fp8: Literal["auto", "emulate", "real"] = "auto"
    """fp8-stats: auto (real fp8 matmuls where the GPU has fp8 tensor cores, else emulated), emulate, or real (refused where unsupported)."""

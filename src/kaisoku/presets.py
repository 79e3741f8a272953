"""Named presets: Python functions that return a complete :class:`~kaisoku.config.Config`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kaisoku.config import Config
from kaisoku.errors import ConfigError
from kaisoku.optim.recipe import CPU_RECIPE, IMAGENET_RECIPE


def cpu_demo() -> Config:
    """The embedded default: a small ResNet on the generated shapes set, 2 CPU ranks, a few minutes."""
    return Config()


def resnet50_imagenet_lars() -> Config:
    """ResNet-50 on an ImageNet folder (``--data.path``) on GPUs with the large-batch recipe.

    :data:`~kaisoku.optim.recipe.IMAGENET_RECIPE` at a global batch of 32,768 (MLPerf-style): LARS (eta
    0.001), lr 29.0 with 5 warmup epochs then a polynomial (power 2) decay, weight decay 5e-5 off BN and
    biases, label smoothing 0.1, zero-initialised last BN gamma per residual block, bf16 autocast, 40 epochs.
    """
    cfg = Config(run_dir="runs/resnet50-imagenet-lars")
    IMAGENET_RECIPE.apply(cfg, batch=32768, epochs=40)
    cfg.model.name = "resnet50"
    cfg.model.stem = "imagenet"
    cfg.data.image_size = 224
    cfg.data.crop_scale_min = 0.08
    cfg.data.workers = 8
    cfg.precision.mode = "bf16"
    cfg.train.log_every = 50
    cfg.checkpoint.every_steps = 0
    return cfg


def cpu_large_batch() -> Config:
    """The demo task at 16x its batch (2,048) with the large-batch recipe, on CPU ranks.

    :data:`~kaisoku.optim.recipe.CPU_RECIPE`, the recipe ``kaisoku bench largebatch`` measures (LARS, lr
    0.2 * sqrt(16), weight decay 5e-4 off BN and biases, arc-cotangent decay with slope 5, label smoothing
    0.1, 12 epochs), with two settings of its own for resnet10: a trust coefficient of 0.08 (the size rule
    gives resnet10's 4.9 M parameters 0.0027) and half an epoch of warmup (the demo set's epoch is 3 steps
    at this batch).
    """
    cfg = Config(run_dir="runs/cpu-large-batch")
    replace(CPU_RECIPE, eta=0.08, warmup_epochs=0.5).apply(cfg, batch=2048, epochs=12)
    cfg.train.log_every = 2
    return cfg


def vit_tiny_shapes() -> Config:
    """vit-tiny on the generated shapes set at 32 px on CPU ranks, with the ViT recipe.

    AdamW (lr 2e-3, betas 0.9/0.999, weight decay 0.05 off norms, biases, class token and position
    embedding), half an epoch of linear warmup then cosine to zero, label smoothing 0.1, global batch 128,
    4 epochs. ``--optim.name lamb`` trains with LAMB instead.
    """
    cfg = Config(run_dir="runs/vit-tiny-shapes")
    cfg.model.name = "vit-tiny"
    cfg.data.image_size = 32
    cfg.data.crop_scale_min = 0.5
    cfg.data.global_batch = 128
    cfg.optim.name = "adamw"
    cfg.optim.lr = 2e-3
    cfg.optim.momentum = 0.9
    cfg.optim.weight_decay = 0.05
    cfg.optim.no_decay_bn_bias = True
    cfg.sched.name = "cosine"
    cfg.sched.warmup_epochs = 0.5
    cfg.train.label_smoothing = 0.1
    cfg.train.epochs = 4
    cfg.train.log_every = 10
    return cfg


def cosmoflow_cpu() -> Config:
    """CosmoFlow on generated 32³ universes (1,024 training samples, made and packed on first use, or
    ``--data.path``), 2 CPU ranks: cosmoflow at width 8, Adam (lr 3e-3, warmup then cosine), 28 epochs (about 7 minutes), MSE
    loss, validation MAE per target."""
    cfg = Config(run_dir="runs/cosmoflow-cpu")
    cfg.model.name = "cosmoflow"
    cfg.model.width = 8  # the reference's layers at a quarter of its channels: minutes on 2 CPU cores
    cfg.data.image_size = 32
    cfg.data.global_batch = 16
    cfg.data.workers = 1
    cfg.optim.name = "adamw"  # SGD at the reference's rates needs far more epochs than minutes allow
    cfg.optim.lr = 3e-3
    cfg.optim.weight_decay = 0.0
    cfg.sched.name = "cosine"
    cfg.sched.warmup_epochs = 0.5
    cfg.train.epochs = 28
    cfg.train.log_every = 10
    cfg.dist.nproc = 2
    return cfg


def cosmoflow() -> Config:
    """CosmoFlow at 128³ with the MLPerf HPC reference hyper-parameters (``--data.path``: a packed set).

    SGD with momentum 0.9, learning rate 0.001 per 64 samples scaled linearly with the global batch (4 per
    rank on 128 ranks: 0.008 for a global batch of 512), 4 warm-up epochs, then x0.25 from
    epoch 32 and x0.125 from epoch 64 of 128; MSE loss, no weight decay.
    """
    cfg = Config(run_dir="runs/cosmoflow")
    ranks = 128
    cfg.model.name = "cosmoflow"
    cfg.data.image_size = 128
    cfg.data.global_batch = 4 * ranks
    cfg.data.workers = 4
    cfg.optim.name = "sgd"
    cfg.optim.lr = 0.001 * cfg.data.global_batch / 64
    cfg.optim.momentum = 0.9
    cfg.optim.weight_decay = 0.0
    cfg.sched.name = "step"
    cfg.sched.warmup_epochs = 4
    cfg.sched.step_milestones = [32 / 128, 64 / 128]
    cfg.sched.step_factors = [0.25, 0.125]
    cfg.train.epochs = 128
    cfg.train.log_every = 50
    return cfg


#: Preset name -> function returning its Config.
PRESETS: dict[str, Callable[[], Config]] = {
    "cpu-demo": cpu_demo,
    "resnet50-imagenet-lars": resnet50_imagenet_lars,
    "cpu-large-batch": cpu_large_batch,
    "cosmoflow-cpu": cosmoflow_cpu,
    "cosmoflow": cosmoflow,
    "vit-tiny-shapes": vit_tiny_shapes,
}


def get_preset(name: str) -> Config:
    """The config of preset ``name``; an unknown name is a ConfigError listing the presets."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()

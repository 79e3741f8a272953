"""Named presets: Python functions that return a complete :class:`~kaisoku.config.Config`."""

from __future__ import annotations

from collections.abc import Callable

from kaisoku.config import Config
from kaisoku.errors import ConfigError


def cpu_demo() -> Config:
    """The embedded default: a small ResNet on the generated shapes set, 2 CPU ranks, a few minutes."""
    return Config()


def resnet50_imagenet_lars() -> Config:
    """ResNet-50 on an ImageNet folder (``--data.path``) on GPUs with the large-batch recipe.

    MLPerf-style hyper-parameters for a global batch of 32,768: LARS (eta 0.001), base lr 29.0 with 5
    warmup epochs then a polynomial (power 2) decay, weight decay 5e-5 off BN and biases, label
    smoothing 0.1, zero-initialised last BN gamma per residual block, bf16 autocast, 40 epochs.
    """
    cfg = Config(run_dir="runs/resnet50-imagenet-lars")
    cfg.model.name = "resnet50"
    cfg.model.stem = "imagenet"
    cfg.model.zero_init_residual = True
    cfg.data.image_size = 224
    cfg.data.crop_scale_min = 0.08
    cfg.data.global_batch = 32768
    cfg.data.workers = 8
    cfg.optim.name = "lars"
    cfg.optim.lr = 29.0
    cfg.optim.momentum = 0.9
    cfg.optim.weight_decay = 5e-5
    cfg.optim.eta = 0.001
    cfg.optim.no_decay_bn_bias = True
    cfg.sched.name = "poly"
    cfg.sched.warmup_epochs = 5
    cfg.sched.poly_power = 2.0
    cfg.train.epochs = 40
    cfg.train.label_smoothing = 0.1
    cfg.train.precision = "bf16"
    cfg.train.log_every = 50
    cfg.checkpoint.every_steps = 0
    return cfg


def cpu_large_batch() -> Config:
    """The demo task at 16x its batch (2,048) with the large-batch recipe, on CPU ranks.

    LARS (eta 0.08, lr 0.2 * sqrt(16)), weight decay 5e-4 off BN and biases, half an epoch of warmup
    then arc-cotangent (slope 5), label smoothing 0.1: the settings ``kaisoku bench largebatch`` uses.
    """
    cfg = Config(run_dir="runs/cpu-large-batch")
    cfg.data.global_batch = 2048
    cfg.optim.name = "lars"
    cfg.optim.lr = 0.8
    cfg.optim.eta = 0.08
    cfg.optim.weight_decay = 5e-4
    cfg.sched.name = "arccot"
    cfg.sched.arccot_slope = 5.0
    cfg.sched.warmup_epochs = 0.5
    cfg.train.label_smoothing = 0.1
    cfg.train.epochs = 12
    cfg.train.log_every = 2
    return cfg


#: Preset name -> function returning its Config.
PRESETS: dict[str, Callable[[], Config]] = {
    "cpu-demo": cpu_demo,
    "resnet50-imagenet-lars": resnet50_imagenet_lars,
    "cpu-large-batch": cpu_large_batch,
}


def get_preset(name: str) -> Config:
    """The config of preset ``name``; an unknown name is a ConfigError listing the presets."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()

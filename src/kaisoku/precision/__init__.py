"""Low precision chosen from statistics: shared-exponent int8/int16 fixed point and fp8 for Conv2d and Linear.

- :mod:`~kaisoku.precision.scaler`: a tensor's amax history -> shared exponent, overflow and underflow counts.
- :mod:`~kaisoku.precision.quant`: fake quantization of weights, activations and gradients (straight-through).
- :mod:`~kaisoku.precision.fp8`: real fp8 matmuls on GPUs with fp8 tensor cores.
- :mod:`~kaisoku.precision.stats`: per-layer figures for ``metrics.jsonl`` and the end-of-run table.
- :mod:`~kaisoku.precision.float32_layers`: normalization, and convolutions over maps so small that a tap sees
  only padding, kept in float32 under bf16/fp16 autocast.

``precision.mode`` picks fp32, bf16 or fp16 autocast (:class:`kaisoku.engine.step.Precision`) or one of the
``*-stats`` modes, which :func:`apply_precision` switches on in the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kaisoku.errors import ConfigError
from kaisoku.precision.float32_layers import keep_norms_float32, keep_padded_convs_float32
from kaisoku.precision.fp8 import fp8_support, use_real_fp8
from kaisoku.precision.quant import MODE_FORMATS, TENSORS, quantizable_layers, quantize_model, resolve_keep
from kaisoku.precision.scaler import AmaxHistory, ExponentScaler, shared_exponent
from kaisoku.precision.stats import PrecisionMonitor

if TYPE_CHECKING:
    from kaisoku.config_sections import PrecisionConfig

__all__ = [
    "AmaxHistory",
    "ExponentScaler",
    "PrecisionMonitor",
    "apply_precision",
    "keep_norms_float32",
    "keep_padded_convs_float32",
    "mode_conflict",
    "quantizable_layers",
    "quantize_model",
    "resolve_keep",
    "shared_exponent",
]

STATS_MODES = tuple(MODE_FORMATS)
"""The modes that quantize layers from statistics."""


def mode_conflict(mode: str, device_type: str, fp8: str = "auto", fp8_reason: str = "") -> str:
    """Why ``mode`` cannot run on a ``device_type`` device ("" when it can): one line naming what to use.

    ``fp8_reason`` is :func:`kaisoku.precision.fp8.fp8_support`'s answer for the device ("" where real fp8
    runs); ``fp8 real`` needs it empty.
    """
    if mode == "fp16" and device_type != "cuda":
        return f"precision.mode fp16 needs CUDA (its gradient scaler); use bf16 on the {device_type}"
    if mode == "fp8-stats" and fp8 == "real" and fp8_reason:
        return (
            f"precision.fp8 real: {fp8_reason}; use precision.fp8 auto (emulated here) or precision.mode bf16"
        )
    return ""


def apply_precision(
    model: nn.Module,
    cfg: PrecisionConfig,
    device: torch.device,
    *,
    announce: Callable[[str], None] | None = None,
    seed: int = 0,
) -> PrecisionMonitor | None:
    """Quantize ``model``'s Conv2d and Linear layers in place for a ``*-stats`` mode; its monitor (None
    for fp32, bf16 and fp16, which are autocast: there the normalization layers, and convolutions on maps so
    small that a tap sees only padding, are kept in float32, see :mod:`kaisoku.precision.float32_layers`).
    ``announce`` hears how the mode runs here, once."""
    if cfg.mode in ("bf16", "fp16"):
        keep_norms_float32(model)
        keep_padded_convs_float32(model)
        return None
    if cfg.mode not in STATS_MODES:
        return None
    unknown = [t for t in cfg.tensors if t not in TENSORS]
    if unknown:
        raise ConfigError(
            f"precision.tensors: {', '.join(unknown)} unknown; choose from {', '.join(TENSORS)}"
        )
    layers = quantize_model(
        model,
        cfg.mode,
        keep=cfg.keep,
        keep_format=cfg.keep_format,
        history=cfg.history,
        fixed_exponent=cfg.fixed_exponent if cfg.exponent == "fixed" else None,
        tensors=tuple(cfg.tensors),
        stochastic_seed=seed if cfg.gradient_rounding == "stochastic" else None,
    )
    note = ""
    if cfg.mode == "fp8-stats":
        reason = fp8_support(device)
        if cfg.fp8 == "real" and reason:
            raise ConfigError(mode_conflict(cfg.mode, device.type, cfg.fp8, reason))
        if cfg.fp8 != "emulate" and not reason:
            count = use_real_fp8(model)
            note = (
                f"precision.mode fp8-stats: real fp8 matmuls for {count} Linear layers; convolutions emulated"
            )
        else:
            note = f"precision.mode fp8-stats: emulated on {device.type} ({reason or 'precision.fp8 emulate'}); slower than fp32, not faster"
    else:
        note = f"precision.mode {cfg.mode}: emulated (values rounded to the format, arithmetic in float32)"
    monitor = PrecisionMonitor(cfg.mode, layers, note=note)
    if announce is not None:
        announce(note)
    return monitor

"""Normalization layers kept in float32 under bf16 and fp16 autocast.

CPU autocast runs BatchNorm, LayerNorm and GroupNorm in the dtype of their input, so after a bf16
convolution the batch statistics come from bf16 values. Over a 1x1 map with a handful of samples
(resnet10 at 16 px, micro-batches of 4-8) the variance is tiny next to the squared mean, and a kernel that
forms it as E[x^2] - E[x]^2 in bf16 can round it below zero: rsqrt(var + eps) is then NaN. Which kernel runs
depends on the CPU (native bf16 instructions or float32 emulation), which is why the NaN came and went.
Mixed-precision practice keeps normalization in float32; :func:`keep_norms_float32` does that by class
swap, so names, ``state_dict`` keys and ``isinstance`` checks are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

#: The normalization classes whose instances are swapped (subclasses included).
NORM_TYPES: tuple[type[nn.Module], ...] = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)

_SWAPPED: dict[type[nn.Module], type[nn.Module]] = {}


class Float32Norm(nn.Module):
    """Mixin: run the wrapped normalization's forward in float32 with autocast off; the output stays
    float32 (the next autocast layer casts it back down)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base class's forward on ``x`` as float32, autocast disabled."""
        with torch.autocast(x.device.type, enabled=False):
            return super().forward(x.float(), *args, **kwargs)  # type: ignore[misc]


def _float32_class(cls: type[nn.Module]) -> type[nn.Module]:
    swapped = _SWAPPED.get(cls)
    if swapped is None:
        swapped = type(f"Float32{cls.__name__}", (Float32Norm, cls), {"__module__": __name__})
        _SWAPPED[cls] = swapped
    return swapped


def keep_norms_float32(model: nn.Module) -> int:
    """Swap every BatchNorm, LayerNorm and GroupNorm in ``model`` to its float32 variant, in place; the
    number swapped. Idempotent."""
    count = 0
    for module in model.modules():
        if isinstance(module, Float32Norm) or not isinstance(module, NORM_TYPES):
            continue
        module.__class__ = _float32_class(type(module))
        count += 1
    return count

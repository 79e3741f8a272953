"""Layers kept in float32 under bf16 and fp16 autocast.

**Normalization.** CPU autocast runs BatchNorm, LayerNorm and GroupNorm in the dtype of their input, so after
a bf16 convolution the batch statistics would come from bf16 values. Mixed-precision practice keeps
normalization in float32 (CUDA autocast does so for BatchNorm); :func:`keep_norms_float32` does that here.

**Convolutions with taps that only ever see padding.** On CPUs with native bf16 (AVX512-BF16, AMX), oneDNN's
bf16 weight-gradient kernel for a 3x3 stride-2 convolution over a 1x1 map (resnet10's ``layer4.0.conv1`` at
16 px) leaves the gradient of the taps that only see zero padding unwritten: whatever the allocator's
memory held, NaN now and then. That was the intermittent bf16 NaN. float32 and the non-oneDNN path give the
correct zeros. :func:`keep_padded_convs_float32` runs a convolution in float32 whenever its input is so small
that some tap sees only padding; such inputs are tiny maps, so the float32 cost is negligible, and every
convolution over a normal-sized map stays in bf16.

Both swap classes, so names, ``state_dict`` keys, hooks and ``isinstance`` checks are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from kaisoku.conv_geometry import tap_ranges

#: The normalization classes whose instances are swapped (subclasses included).
NORM_TYPES: tuple[type[nn.Module], ...] = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)

_SWAPPED: dict[tuple[type[nn.Module], type[nn.Module]], type[nn.Module]] = {}


class Float32Norm(nn.Module):
    """Mixin: run the wrapped normalization's forward in float32 with autocast off; the output stays
    float32 (the next autocast layer casts it back down)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base class's forward on ``x`` as float32, autocast disabled."""
        with torch.autocast(x.device.type, enabled=False):
            return super().forward(x.float(), *args, **kwargs)  # type: ignore[misc]


def padding_only_taps(
    size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> bool:
    """Whether a convolution over a map of ``size`` (per spatial dimension) has a kernel tap that never
    touches the input, only the zero padding (``padding`` is the leading pad of each dimension)."""
    return any(
        lo >= hi
        for n, k, s, p, d in zip(size, kernel, stride, padding, dilation)
        for lo, hi in tap_ranges(n, k, s, p, d)[1]
    )


def _leading_padding(conv: _ConvNd) -> tuple[int, ...]:
    if isinstance(conv.padding, str):  # "valid" or "same" (stride 1): the leading half of the total
        if conv.padding == "valid":
            return (0,) * len(conv.kernel_size)
        return tuple(d * (k - 1) // 2 for k, d in zip(conv.kernel_size, conv.dilation))
    return tuple(conv.padding)


class Float32PaddedConv(nn.Module):
    """Mixin: under CPU autocast, run the wrapped convolution in float32 when the input leaves a kernel tap
    seeing only zero padding (see the module's docstring); otherwise the base class's forward unchanged."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base class's forward, in float32 with autocast off for inputs with padding-only taps."""
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu") and self._padding_only(x.shape[2:]):
            with torch.autocast("cpu", enabled=False):
                return super().forward(x.float(), *args, **kwargs)  # type: ignore[misc]
        return super().forward(x, *args, **kwargs)  # type: ignore[misc]

    def _padding_only(self, size: torch.Size) -> bool:
        conv: _ConvNd = self  # type: ignore[assignment]
        if conv.padding_mode != "zeros":  # other modes pad with data, never with zeros
            return False
        cache: dict[tuple[int, ...], bool] = self.__dict__.setdefault("_padding_only_cache", {})
        key = tuple(size)
        if key not in cache:
            cache[key] = padding_only_taps(
                key, conv.kernel_size, conv.stride, _leading_padding(conv), conv.dilation
            )
        return cache[key]


def _swapped_class(mixin: type[nn.Module], cls: type[nn.Module]) -> type[nn.Module]:
    swapped = _SWAPPED.get((mixin, cls))
    if swapped is None:
        prefix = "Float32" if mixin is Float32Norm else "Float32Padded"
        swapped = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": __name__})
        _SWAPPED[(mixin, cls)] = swapped
    return swapped


def _swap(model: nn.Module, mixin: type[nn.Module], types: tuple[type[nn.Module], ...]) -> int:
    count = 0
    for module in model.modules():
        if isinstance(module, mixin) or not isinstance(module, types):
            continue
        module.__class__ = _swapped_class(mixin, type(module))
        count += 1
    return count


def keep_norms_float32(model: nn.Module) -> int:
    """Swap every BatchNorm, LayerNorm and GroupNorm in ``model`` to its float32 variant, in place; the
    number swapped. Idempotent."""
    return _swap(model, Float32Norm, NORM_TYPES)


def keep_padded_convs_float32(model: nn.Module) -> int:
    """Swap every convolution in ``model`` to its variant that runs in float32 (under CPU autocast) on inputs
    where a tap sees only padding, in place; the number swapped. Idempotent."""
    return _swap(model, Float32PaddedConv, (_ConvNd,))

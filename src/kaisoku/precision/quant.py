"""Fake quantization of Conv2d and Linear layers: weights, input activations and output gradients.

Each quantized layer rounds, on every use, its weight and its input to the mode's format with a shared
exponent from that tensor's own amax history (:class:`~kaisoku.precision.scaler.ExponentScaler`), runs
the layer in float32 on the rounded values, and in backward rounds the gradient arriving at its output
with a third scaler before the weight and input gradients are computed from it. The forward rounding is
a straight-through estimator: its gradient passes unchanged.

Layers are switched in place by changing their class to a subclass (``QuantConv2d``, ``QuantLinear``):
names, parameters, ``state_dict`` keys and ``isinstance`` checks stay as they were, so optimizers, DDP,
K-FAC and checkpoints see the same model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisoku.errors import ConfigError
from kaisoku.precision.scaler import HISTORY, ExponentScaler

TENSORS = ("weights", "activations", "gradients")
"""What a quantized layer rounds."""

#: Mode -> formats of (weights, activations, gradients).
MODE_FORMATS: dict[str, tuple[str, str, str]] = {
    "int8-stats": ("int8", "int8", "int8"),
    "int16-stats": ("int16", "int16", "int16"),
    "fp8-stats": ("e4m3", "e4m3", "e5m2"),
}


class _RoundForward(torch.autograd.Function):
    """Round in forward, pass the gradient straight through (STE)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scaler: ExponentScaler, record: bool) -> torch.Tensor:
        return scaler(x, record=record)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _RoundBackward(torch.autograd.Function):
    """Identity in forward; rounds the incoming gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scaler: ExponentScaler) -> torch.Tensor:
        ctx.scaler = scaler
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.scaler(grad), None


def round_forward(x: torch.Tensor, scaler: ExponentScaler, record: bool = True) -> torch.Tensor:
    """``x`` rounded by ``scaler``; its gradient is the identity (straight-through)."""
    return _RoundForward.apply(x, scaler, record)


def round_gradient(x: torch.Tensor, scaler: ExponentScaler) -> torch.Tensor:
    """``x`` unchanged; the gradient flowing back through it is rounded by ``scaler``."""
    return _RoundBackward.apply(x, scaler)


@dataclass
class LayerQuant:
    """The scalers of one layer (``None`` where that tensor stays in float32) and its format label."""

    name: str
    label: str
    weights: ExponentScaler | None
    activations: ExponentScaler | None
    gradients: ExponentScaler | None

    def scalers(self) -> dict[str, ExponentScaler]:
        """The layer's scalers by tensor."""
        found = {"weights": self.weights, "activations": self.activations, "gradients": self.gradients}
        return {key: value for key, value in found.items() if value is not None}

    def inputs(
        self, x: torch.Tensor, weight: torch.Tensor, training: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input and weight as rounded for this use."""
        if self.activations is not None:
            x = round_forward(x, self.activations, training)
        if self.weights is not None:
            weight = round_forward(weight, self.weights, training)
        return x, weight

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output, whose gradient is rounded in backward."""
        if self.gradients is not None and y.requires_grad:
            return round_gradient(y, self.gradients)
        return y


class QuantConv2d(nn.Conv2d):
    """A Conv2d whose weight, input and output gradient are rounded by ``self.quant``."""

    quant: LayerQuant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution on rounded operands."""
        x, weight = self.quant.inputs(x, self.weight, self.training)
        return self.quant.output(self._conv_forward(x, weight, self.bias))


class QuantLinear(nn.Linear):
    """A Linear whose weight, input and output gradient are rounded by ``self.quant``."""

    quant: LayerQuant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The matrix product on rounded operands."""
        x, weight = self.quant.inputs(x, self.weight, self.training)
        return self.quant.output(F.linear(x, weight, self.bias))


_SWAP: dict[type[nn.Module], type[nn.Module]] = {nn.Conv2d: QuantConv2d, nn.Linear: QuantLinear}


def quantizable_layers(model: nn.Module) -> list[str]:
    """Names of the Conv2d and Linear layers of ``model``, in registration order."""
    return [
        name
        for name, module in model.named_modules()
        if type(module) in _SWAP or type(module) in _SWAP.values()
    ]


def resolve_keep(model: nn.Module, keep: list[str] | tuple[str, ...]) -> list[str]:
    """The layer names ``keep`` means ("first" and "last" name the first and last layer); ConfigError
    listing the layers for a name that is not one."""
    return keep_names(quantizable_layers(model), keep)


def keep_names(names: Sequence[str], keep: Sequence[str]) -> list[str]:
    """:func:`resolve_keep` on a model's quantizable layer names (``quantizable_layers``), in order."""
    out: list[str] = []
    for item in keep:
        item = item.strip()
        if not item:
            continue
        if item in ("first", "last"):
            if names:
                out.append(names[0] if item == "first" else names[-1])
            continue
        if item not in names:
            raise ConfigError(
                f"precision.keep: no Conv2d/Linear layer named '{item}'; the layers are: first, last, "
                + ", ".join(names)
            )
        out.append(item)
    return list(dict.fromkeys(out))


def layer_quant(
    name: str,
    mode: str,
    *,
    kept: bool,
    keep_format: str = "bf16",
    history: int = HISTORY,
    fixed_exponent: int | None = None,
    tensors: tuple[str, ...] = TENSORS,
    stochastic_seed: int | None = None,
) -> LayerQuant:
    """The scalers of layer ``name`` under ``mode`` (``kept``: ``keep_format`` rounding for all three);
    ``stochastic_seed`` (not None): its fixed-point gradient rounds stochastically, keyed by it."""
    if kept:
        formats = (keep_format,) * 3
        label = keep_format
    else:
        formats = MODE_FORMATS[mode]
        label = "/".join(dict.fromkeys(formats)) + (
            f" fixed 2^{fixed_exponent}" if fixed_exponent is not None else ""
        )
    made: list[ExponentScaler | None] = []
    for tensor, fmt in zip(TENSORS, formats):
        if tensor not in tensors or fmt == "fp32":
            made.append(None)
        else:
            seed = stochastic_seed if tensor == "gradients" and not kept else None
            fixed = None if kept else fixed_exponent
            made.append(ExponentScaler(fmt, history=history, fixed_exponent=fixed, stochastic_seed=seed))
    return LayerQuant(name, label, *made)


def quantize_model(
    model: nn.Module,
    mode: str,
    *,
    keep: list[str] | tuple[str, ...] = ("first", "last"),
    keep_format: str = "bf16",
    history: int = HISTORY,
    fixed_exponent: int | None = None,
    tensors: tuple[str, ...] = TENSORS,
    stochastic_seed: int | None = None,
) -> dict[str, LayerQuant]:
    """Switch every Conv2d and Linear of ``model`` to its quantized class, in place; the layers' scalers."""
    if mode not in MODE_FORMATS:
        raise ConfigError(f"precision.mode {mode} does not quantize; use one of {', '.join(MODE_FORMATS)}")
    kept = set(resolve_keep(model, keep))
    layers: dict[str, LayerQuant] = {}
    for index, (name, module) in enumerate(model.named_modules()):
        cls = _SWAP.get(type(module))
        if cls is None:
            continue
        quant = layer_quant(
            name,
            mode,
            kept=name in kept,
            keep_format=keep_format,
            history=history,
            fixed_exponent=fixed_exponent,
            tensors=tensors,
            stochastic_seed=None if stochastic_seed is None else stochastic_seed * 100_003 + index,
        )
        module.__class__ = cls
        module.quant = quant  # type: ignore[assignment]
        layers[name] = quant
    return layers


def dequantize_model(model: nn.Module) -> None:
    """Undo :func:`quantize_model` (and the real-fp8 swap): plain Conv2d and Linear layers again."""
    for module in model.modules():
        for plain in (nn.Conv2d, nn.Linear):
            if isinstance(module, plain) and type(module) is not plain:
                module.__class__ = plain
                module.__dict__.pop("quant", None)

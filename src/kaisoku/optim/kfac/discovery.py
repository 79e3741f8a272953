"""Finding the modules of a model that K-FAC preconditions, each wrapped in its hooked K-FAC layer."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kaisoku.optim.kfac.layers import BatchNormLayer, Clock, KFACLayer, classify


def hook_layers(
    model: nn.Module,
    *,
    bn: str,
    skip_layers: Iterable[str],
    stat_fraction: float,
    factor_dtype: torch.dtype,
    collecting: Callable[[], bool],
    grad_scale: Callable[[], float],
    clock: Clock,
) -> tuple[dict[str, KFACLayer], list[str]]:
    """The K-FAC layers of ``model``'s supported modules by module name, their hooks installed, and the
    modules left to the base optimizer for their type (``"name (reason)"``).

    Modules named in ``skip_layers`` (by module name or class name) are passed over, and so is everything
    inside a ``MultiheadAttention`` (its projections are never called as modules). ``bn``,
    ``stat_fraction`` and ``factor_dtype`` are as for :class:`~kaisoku.optim.kfac.KFAC`; ``collecting``,
    ``grad_scale`` and ``clock`` go to each layer's :meth:`~kaisoku.optim.kfac.layers.KFACLayer.register`.
    """
    skip = set(skip_layers)
    layers: dict[str, KFACLayer] = {}
    skipped: list[str] = []
    opaque: list[str] = []  # modules whose sub-layers are never called as modules (attention)
    for name, module in model.named_modules():
        if name in skip or type(module).__name__ in skip:
            continue
        if any(not prefix or name.startswith(prefix + ".") for prefix in opaque):
            continue
        if isinstance(module, nn.MultiheadAttention):
            opaque.append(name)
        layer_class, reason = classify(module, bn)
        if layer_class is None:
            if reason is not None:
                skipped.append(f"{name or '<root>'} ({reason})")
            continue
        if layer_class is BatchNormLayer:
            layer: KFACLayer = BatchNormLayer(name, module, unit_wise=bn == "unit")
        else:
            layer = layer_class(name, module)
            layer.stat_fraction = stat_fraction
            layer.factor_dtype = factor_dtype
        layer.register(collecting, grad_scale, clock)
        layers[name] = layer
    return layers, skipped

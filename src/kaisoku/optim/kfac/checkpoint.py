"""Saving and restoring a K-FAC preconditioner's layer state (factors, damping floors, decompositions).

The functions take the pieces they read and write, not the preconditioner: ``KFAC.state_dict`` and
``KFAC.load_state_dict`` hand them over and apply what comes back (the step, a pending refresh, the
chosen intervals).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kaisoku.errors import ConfigError
from kaisoku.optim.kfac.layers import KFACLayer

#: Per layer name, per factor: [eigenvectors, eigenvalues] or [inverse], or None when not held here.
Decompositions = dict[str, list[list[torch.Tensor] | None]]


def save_state(
    *,
    steps: int,
    method: str,
    bn: str,
    layers: Mapping[str, KFACLayer],
    decompositions: Decompositions,
    intervals: dict[str, Any] | None,
) -> dict[str, Any]:
    """Step, factors, damping floors, the chosen ``intervals`` and the ``decompositions`` this rank holds.

    A local operation (no collective); tensors are copies.
    """
    saved: dict[str, Any] = {}
    for name, layer in layers.items():
        entry: dict[str, Any] = {
            "factors": [None if f is None else f.detach().clone() for f in layer.factors],
            "damping_floor": layer.damping_floor,
        }
        if name in decompositions:
            entry["decomposition"] = [
                None if held is None else [t.detach().clone() for t in held] for held in decompositions[name]
            ]
        saved[name] = entry
    return {"steps": steps, "method": method, "bn": bn, "layers": saved, "intervals": intervals}


def load_state(
    state: dict[str, Any],
    *,
    method: str,
    bn: str,
    layers: Mapping[str, KFACLayer],
    decompositions: Decompositions,
    needs_decomposition: Callable[[str, int], bool],
) -> bool:
    """Put the saved factors, damping floors and decompositions back into ``layers`` and
    ``decompositions``; whether a decomposition this rank needs (``needs_decomposition(layer, factor)``)
    is missing and must be recomputed from the factors at the next step.

    Decompositions saved by another ``method`` are dropped. Raises ``ConfigError`` when the saved layers
    or BatchNorm mode do not match this model's.
    """
    saved = state["layers"]
    if set(saved) != set(layers):
        missing = sorted(set(layers) - set(saved))
        extra = sorted(set(saved) - set(layers))
        raise ConfigError(
            "K-FAC state does not match the model: "
            f"layers missing from the state {missing[:5]}, unknown layers in the state {extra[:5]}"
        )
    if state.get("bn", bn) != bn:
        raise ConfigError(f"K-FAC state was saved with bn='{state['bn']}', this run uses '{bn}'")
    same_method = state.get("method") == method
    refresh = False
    for name, layer in layers.items():
        entry = saved[name]
        layer.factors = [
            None if f is None else f.detach().to(layer.device, layer.factor_dtype, copy=True)
            for f in entry["factors"]
        ]
        layer.damping_floor = float(entry["damping_floor"])
        if name not in decompositions:
            continue
        stored = entry.get("decomposition") if same_method else None
        held: list[list[torch.Tensor] | None] = [None, None]
        for index in range(2):
            if stored is not None and stored[index] is not None:
                held[index] = [t.detach().to(layer.device, torch.float32, copy=True) for t in stored[index]]
            if layer.factors[index] is not None and held[index] is None and needs_decomposition(name, index):
                refresh = True
        decompositions[name] = held
    return refresh

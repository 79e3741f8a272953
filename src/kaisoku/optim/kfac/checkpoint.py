"""Saving and restoring a ``KFAC`` preconditioner's state (factors, decompositions, chosen intervals)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kaisoku.errors import ConfigError

if TYPE_CHECKING:
    from kaisoku.optim.kfac.preconditioner import KFAC


def save_state(kfac: KFAC) -> dict[str, Any]:
    """Step, factors, damping floors and the decompositions this rank holds (all of them in "full"
    mode; in "owner" mode only its own, the rest are recomputed from the factors on resume).

    A local operation (no collective); tensors are copies.
    """
    layers: dict[str, Any] = {}
    for name, layer in kfac.layers.items():
        entry: dict[str, Any] = {
            "factors": [None if f is None else f.detach().clone() for f in layer.factors],
            "damping_floor": layer.damping_floor,
        }
        if name in kfac._decompositions:
            entry["decomposition"] = [
                None if held is None else [t.detach().clone() for t in held]
                for held in kfac._decompositions[name]
            ]
        layers[name] = entry
    intervals = None if kfac._tuner is None else kfac._tuner.state_dict()
    return {
        "steps": kfac.steps,
        "method": kfac.method,
        "bn": kfac.bn,
        "layers": layers,
        "intervals": intervals,
    }


def load_state(kfac: KFAC, state: dict[str, Any]) -> None:
    """Restore what ``state_dict()`` saved; the next ``step()`` continues where that run stopped.

    Raises ``ConfigError`` when the saved layers do not match this model's.
    """
    saved = state["layers"]
    if set(saved) != set(kfac.layers):
        missing = sorted(set(kfac.layers) - set(saved))
        extra = sorted(set(saved) - set(kfac.layers))
        raise ConfigError(
            "K-FAC state does not match the model: "
            f"layers missing from the state {missing[:5]}, unknown layers in the state {extra[:5]}"
        )
    if state.get("bn", kfac.bn) != kfac.bn:
        raise ConfigError(f"K-FAC state was saved with bn='{state['bn']}', this run uses '{kfac.bn}'")
    same_method = state.get("method") == kfac.method
    kfac.steps = int(state["steps"])
    refresh = False
    for name, layer in kfac.layers.items():
        entry = saved[name]
        layer.factors = [
            None if f is None else f.detach().to(layer.device, layer.factor_dtype, copy=True)
            for f in entry["factors"]
        ]
        layer.damping_floor = float(entry["damping_floor"])
        if name not in kfac._decompositions:
            continue
        stored = entry.get("decomposition") if same_method else None
        held: list[list[torch.Tensor] | None] = [None, None]
        for index in range(2):
            if stored is not None and stored[index] is not None:
                held[index] = [t.detach().to(layer.device, torch.float32, copy=True) for t in stored[index]]
            needed = kfac.memory_mode == "full" or kfac.owner(name, index) == kfac.comm.rank
            if layer.factors[index] is not None and needed and held[index] is None:
                refresh = True
        kfac._decompositions[name] = held
    kfac._refresh = refresh
    if kfac._tuner is not None:
        saved_intervals = state.get("intervals")
        if saved_intervals:  # a resumed run keeps the intervals its first steps chose
            kfac._tuner.chosen = (
                int(saved_intervals["factor_update_steps"]),
                int(saved_intervals["inv_update_steps"]),
            )
            kfac._tuner.measured = {
                k: float(v) for k, v in saved_intervals.items() if not k.endswith("_steps")
            }
            kfac._adopt(kfac._tuner)
        else:
            kfac._tuner.restart()

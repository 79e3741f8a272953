"""The layout-independent optimizer state: parameters named as in the whole model instead of numbered.

A checkpoint in this form loads under any parallel layout (each stage takes the parameters it holds) and
into plain data parallelism; stages' forms merge back into one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kaisoku.errors import KaisokuError


def named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str], *, snapshot: bool = True
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameters named as in the full model instead of numbered.

    ``snapshot``: tensors are copied to the CPU, so the form is one that later steps do not change; without
    it the form holds the optimizer's own tensors (DTensor shards stay shards), for a writer that copies or
    writes them before the next step.
    """
    raw = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            index_to_name[index] = names[id(p)]
            index += 1
    groups = []
    for raw_group in raw["param_groups"]:
        # "params" become names; an optimizer built from named parameters also lists them in
        # "param_names", which would be wrong for another layout's groups, so it is left out.
        hyper = {key: value for key, value in raw_group.items() if key not in ("params", "param_names")}
        groups.append({**hyper, "params": [index_to_name[i] for i in raw_group["params"]]})
    copy = _snapshot if snapshot else _as_is
    state = {
        index_to_name[i]: {key: copy(value) for key, value in per_param.items()}
        for i, per_param in raw["state"].items()
    }
    return {"state": state, "param_groups": groups}


def _snapshot(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _as_is(value: Any) -> Any:
    return value


def load_named_optimizer_state(
    optimizer: torch.optim.Optimizer, named: dict[str, Any], names: dict[int, str]
) -> None:
    """Load a :func:`named_optimizer_state` form (of this stage or of the whole model) into ``optimizer``.

    Each of the optimizer's groups takes its hyperparameters from the saved group that holds its first
    parameter; every parameter takes its saved state by name.
    """
    group_of = {name: group for group in named["param_groups"] for name in group["params"]}
    groups = []
    state: dict[int, Any] = {}
    index = 0
    for group in optimizer.param_groups:
        group_names = [names[id(p)] for p in group["params"]]
        source = group_of.get(group_names[0], group) if group_names else group
        hyper = {key: value for key, value in source.items() if key not in ("params", "param_names")}
        if "param_names" in group:
            hyper["param_names"] = list(group["param_names"])
        ids = list(range(index, index + len(group_names)))
        index += len(group_names)
        groups.append({**hyper, "params": ids})
        for i, name in zip(ids, group_names):
            if name in named["state"]:
                state[i] = named["state"][name]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _hyper_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = set(a) - {"params"}
    if keys != set(b) - {"params"}:
        return False
    for key in keys:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def merge_named_optimizer_states(parts: Iterable[dict[str, Any]], order: Sequence[str]) -> dict[str, Any]:
    """One named form from the stages' forms: groups with equal hyperparameters merged, names in ``order``."""
    rank_of = {name: i for i, name in enumerate(order)}
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for part in parts:
        state.update(part["state"])
        for group in part["param_groups"]:
            same = next((g for g in groups if _hyper_equal(g, group)), None)
            if same is None:
                groups.append({**group, "params": list(group["params"])})
            else:
                same["params"].extend(group["params"])
    for group in groups:
        group["params"].sort(key=lambda name: rank_of.get(name, len(rank_of)))
    ordered_state = {name: state[name] for name in sorted(state, key=lambda n: rank_of.get(n, len(rank_of)))}
    return {"state": ordered_state, "param_groups": groups}


def is_named_optimizer_state(state: dict[str, Any]) -> bool:
    """True for the layout-independent form (parameters named, not numbered)."""
    return all(isinstance(p, str) for group in state["param_groups"] for p in group["params"])


def named_from_torch_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """A torch ``optimizer.state_dict()`` (parameters numbered) in the named form, from its ``param_names``.

    Optimizers built by :mod:`kaisoku.optim.factory` list their parameters' names in every group.
    """
    index_to_name: dict[int, str] = {}
    groups = []
    for group in state["param_groups"]:
        names = group.get("param_names")
        if names is None or len(names) != len(group["params"]):
            raise KaisokuError(
                "the checkpoint's optimizer state does not name its parameters; it cannot load into "
                "another parallel layout"
            )
        index_to_name.update(zip(group["params"], names))
        hyper = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        groups.append({**hyper, "params": list(names)})
    return {"state": {index_to_name[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def with_param_names(named: dict[str, Any]) -> dict[str, Any]:
    """A named form with each group listing its ``param_names`` too, as a sharded checkpoint holds it (what
    torch's ``get_state_dict`` gives for an optimizer built from named parameters: the keys a reader's own
    groups hold)."""
    return {
        "state": named["state"],
        "param_groups": [{**group, "param_names": list(group["params"])} for group in named["param_groups"]],
    }

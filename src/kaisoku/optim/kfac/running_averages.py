"""A layer's running-average Kronecker factors: statistics packed for the all-reduce, new ones blended in."""

from __future__ import annotations

import warnings

import torch

from kaisoku.optim.kfac.decompositions import KFACWarning, raise_damping_floor
from kaisoku.optim.kfac.layers import KFACLayer


def statistics_to_reduce(layer: KFACLayer) -> list[torch.Tensor]:
    """``layer``'s statistic sums (zeros where it has none) and then its counts, all float32, to be summed
    over the ranks."""
    # Reduced and blended in float32 whatever the factor dtype: sums over ranks lose nothing.
    tensors = [
        torch.zeros(shape, device=layer.device) if stat is None else stat.float()
        for stat, shape in zip(layer.stat_sums, layer.factor_shapes())
    ]
    tensors.append(torch.tensor(layer.stat_counts, dtype=torch.float32, device=layer.device))
    return tensors


def blend_factors(
    layer: KFACLayer,
    sums: list[torch.Tensor],
    counts: torch.Tensor,
    *,
    decay: float,
    damping: float,
    step: int,
) -> None:
    """Blend the fresh factors ``sums / counts`` into ``layer``'s running averages (``decay``: weight of
    the old average) at ``step``.

    A factor without samples is left alone; statistics that are not finite are skipped with a
    :class:`~kaisoku.optim.kfac.KFACWarning`; an old factor that is not finite is replaced by the fresh one
    and the layer's damping floor raised above ``damping``.
    """
    fresh = [total / count for total, count in zip(sums, counts.unbind(0))]
    olds = list(layer.factors)
    # The counts and every finiteness check reach the host in one transfer (one GPU synchronisation).
    checks = [torch.isfinite(f).all() for f in fresh]
    checks += [torch.isfinite(old).all() if old is not None else checks[0].new_ones(()) for old in olds]
    n = len(fresh)
    host = torch.cat([counts.float().flatten(), torch.stack(checks).float()]).tolist()
    for index, (count, fresh_finite, old_finite) in enumerate(zip(host[:n], host[n : 2 * n], host[2 * n :])):
        old = olds[index]
        if count <= 0:
            continue
        if not fresh_finite:
            warnings.warn(
                f"K-FAC: statistics of factor {layer.factor_names[index]} of layer '{layer.name}' "
                f"are not finite at step {step}; this update of the factor is skipped",
                KFACWarning,
                stacklevel=3,
            )
            continue
        dtype = layer.factor_dtype
        if old is None:
            layer.factors[index] = fresh[index].to(dtype, copy=True)
        elif not old_finite:
            layer.factors[index] = fresh[index].to(dtype, copy=True)
            raise_damping_floor(layer, damping, "a factor was not finite", step)
        else:
            # Blended in float32 and rounded once, so bfloat16 storage does not compound round-off.
            layer.factors[index] = (old.float() * decay + fresh[index] * (1.0 - decay)).to(dtype)

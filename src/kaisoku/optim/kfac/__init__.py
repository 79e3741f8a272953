"""K-FAC: Kronecker-factored approximate curvature, a preconditioner in front of any base optimizer.

``KFAC(model, ...)`` hooks Linear (and Hugging Face's transposed ``Conv1D``), Conv1d, Conv2d and BatchNorm layers, keeps running-average factors, and
``KFAC.step()`` replaces their gradients with preconditioned ones. Factor statistics are summed over the
data-parallel ranks; decompositions are spread over the ranks by ``greedy_assignment``; with
``overhead_target`` the update intervals are chosen from the measured cost (``choose_intervals``).
"""

from __future__ import annotations

from kaisoku.optim.kfac.assignment import bucket_plan, decomposition_cost, greedy_assignment, rank_loads
from kaisoku.optim.kfac.intervals import choose_intervals
from kaisoku.optim.kfac.layers import SingularFactorError
from kaisoku.optim.kfac.patches import patch_sums
from kaisoku.optim.kfac.preconditioner import (
    BN_MODES,
    FACTOR_DTYPES,
    KFAC,
    MEMORY_MODES,
    METHODS,
    KFACWarning,
)

__all__ = [
    "BN_MODES",
    "FACTOR_DTYPES",
    "KFAC",
    "KFACWarning",
    "MEMORY_MODES",
    "METHODS",
    "SingularFactorError",
    "bucket_plan",
    "choose_intervals",
    "decomposition_cost",
    "greedy_assignment",
    "patch_sums",
    "rank_loads",
]

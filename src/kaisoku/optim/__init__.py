"""Optimizers, learning-rate schedules and their factory."""

from __future__ import annotations

from kaisoku.optim.factory import OPTIMIZERS, build_optimizer, build_scheduler, param_groups
from kaisoku.optim.lars import LAMB, LARS, exclude_ndim_le_1
from kaisoku.optim.recipe import LargeBatch, LargeBatchKFAC, large_batch, large_batch_kfac, lars_eta
from kaisoku.optim.schedules import WarmupSchedule, plot_schedule, schedule_factor

__all__ = [
    "LAMB",
    "LARS",
    "LargeBatch",
    "LargeBatchKFAC",
    "OPTIMIZERS",
    "WarmupSchedule",
    "build_optimizer",
    "build_scheduler",
    "exclude_ndim_le_1",
    "large_batch",
    "large_batch_kfac",
    "lars_eta",
    "param_groups",
    "plot_schedule",
    "schedule_factor",
]

"""K-FAC intervals adapted to measured cost: how often to update the factors and the decompositions.

:func:`choose_intervals` is the pure rule; :class:`IntervalTuner` collects the timings of the first few
steps and holds the choice (the same on every rank, saved with the preconditioner's state).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

#: Steps timed (after one untimed step) before the intervals are chosen.
WARMUP_STEPS = 4
#: Default cap on both intervals.
MAX_INTERVAL = 128
#: Timed steps that also decompose: a round of decompositions costs the same every time, and on a GPU
#: one round of a resnet's eigendecompositions outweighs many plain steps.
DECOMPOSITION_SAMPLES = 1


def _pow2_at_least(x: float, cap: int) -> int:
    """The smallest power of two >= ``x`` (at least 1), but at most ``cap`` (itself a power of two)."""
    if x <= 1:
        return 1
    if not math.isfinite(x):
        return cap
    return min(cap, 2 ** math.ceil(math.log2(x) - 1e-12))


def predicted_overhead(
    step_s: float, stats_s: float, decomp_s: float, precond_s: float, factor_every: int, inv_every: int
) -> float:
    """K-FAC's amortised time per step as a fraction of the plain step ``step_s``."""
    per_step = stats_s / factor_every + decomp_s / inv_every + precond_s
    return per_step / step_s if step_s > 0 else math.inf


def choose_intervals(
    step_s: float,
    stats_s: float,
    decomp_s: float,
    precond_s: float,
    target: float,
    max_interval: int = MAX_INTERVAL,
) -> tuple[int, int]:
    """``(factor_every, inv_every)`` keeping K-FAC's amortised overhead under ``target`` of a plain step.

    ``step_s`` is the step without K-FAC; ``stats_s`` the cost of one factor update (statistics in the
    hooks, their all-reduce and the running averages), ``decomp_s`` of one round of decompositions,
    ``precond_s`` of the preconditioning paid at every step. The overhead per step is
    ``stats_s / F + decomp_s / I + precond_s``. The rule takes the real-valued ``F <= I`` of least
    ``F + I`` that meets the target (``F = I = (s + d) / B`` when ``d <= s``, else
    ``F = sqrt(s) (sqrt(s) + sqrt(d)) / B`` and ``I = sqrt(d) (sqrt(s) + sqrt(d)) / B``, with
    ``B = target * step_s - precond_s``) and rounds each up to a power of two, so that ``I`` is a multiple
    of ``F`` (decompositions fall on factor updates) and both are monotone in every cost. Both are capped
    at ``max_interval`` (rounded down to a power of two); when even the cap misses the target (or the
    preconditioning alone exceeds it) the result is ``(cap, cap)``, K-FAC's least overhead.
    """
    if not 0 < target < 1:
        raise ValueError(f"target must be in (0, 1), got {target}")
    if max_interval < 1:
        raise ValueError(f"max_interval must be >= 1, got {max_interval}")
    cap = 2 ** int(math.floor(math.log2(max_interval)))
    s, d = max(0.0, stats_s), max(0.0, decomp_s)
    budget = target * step_s - max(0.0, precond_s)
    if s == 0 and d == 0:
        return 1, 1
    if budget <= 0:
        return cap, cap
    if d <= s:
        f_real = i_real = (s + d) / budget
    else:
        root = math.sqrt(s) + math.sqrt(d)
        f_real, i_real = math.sqrt(s) * root / budget, math.sqrt(d) * root / budget
    factor_every = _pow2_at_least(f_real, cap)
    inv_every = _pow2_at_least(max(i_real, factor_every), cap)
    # Only the cap on I can leave the target missed while a larger F would meet it.
    while factor_every < cap and s / factor_every + d / inv_every > budget:
        factor_every *= 2
    return factor_every, max(inv_every, factor_every)


@dataclass
class IntervalTuner:
    """Times the first steps of a run and holds the chosen intervals.

    ``samples`` are ``(step_s, stats_s, decomp_s, precond_s)`` per timed step (``decomp_s`` NaN on a
    step that did not decompose: only the untimed step and the first ``DECOMPOSITION_SAMPLES`` timed ones
    do); ``chosen`` is ``(factor_every, inv_every)`` once decided; ``measured`` the agreed medians it was
    chosen from.
    """

    target: float
    max_interval: int = MAX_INTERVAL
    warmup: int = WARMUP_STEPS
    samples: list[tuple[float, float, float, float]] = field(default_factory=list)
    chosen: tuple[int, int] | None = None
    measured: dict[str, float] = field(default_factory=dict)
    prev_exit: float | None = None
    factor_mark: float = 0.0

    @property
    def tuning(self) -> bool:
        """True while the intervals are still being measured."""
        return self.chosen is None

    def decomposes(self) -> bool:
        """Whether the step about to run decomposes (the untimed step and the first timed ones)."""
        return len(self.samples) < DECOMPOSITION_SAMPLES

    def ready(self) -> bool:
        """Whether enough steps have been timed to choose."""
        return len(self.samples) >= self.warmup

    def record(
        self, marks: list[float], factor_at_enter: float, factor_at_exit: float, decomposed: bool = True
    ) -> None:
        """Time one step from ``marks`` (entry, statistics done, decompositions done, exit of ``step()``)
        and the clock's cumulative ``factor`` seconds (the hooks' statistics) at entry and exit."""
        enter, stats_end, decomp_end, exit_ = marks
        hooks = factor_at_enter - self.factor_mark
        if self.prev_exit is not None:
            plain = max(0.0, enter - self.prev_exit - hooks)
            decomp = decomp_end - stats_end if decomposed else math.nan
            self.samples.append((plain, hooks + stats_end - enter, decomp, exit_ - decomp_end))
        self.prev_exit = exit_
        self.factor_mark = factor_at_exit

    def medians(self) -> list[float]:
        """This rank's median of each timed phase."""
        return [statistics.median([v for v in column if not math.isnan(v)]) for column in zip(*self.samples)]

    def decide(self, agreed: list[float]) -> tuple[int, int]:
        """Choose from the agreed ``(step_s, stats_s, decomp_s, precond_s)``; returns the intervals."""
        step_s, stats_s, decomp_s, precond_s = agreed
        self.chosen = choose_intervals(step_s, stats_s, decomp_s, precond_s, self.target, self.max_interval)
        overhead = predicted_overhead(step_s, stats_s, decomp_s, precond_s, *self.chosen)
        self.measured = {
            "step_s": step_s,
            "stats_s": stats_s,
            "decomp_s": decomp_s,
            "precond_s": precond_s,
            "overhead": overhead,
        }
        return self.chosen

    def message(self) -> str:
        """The choice in one log line."""
        assert self.chosen is not None
        overhead = self.measured.get("overhead", math.nan)
        return (
            f"K-FAC intervals: factors every {self.chosen[0]}, decompositions every {self.chosen[1]} "
            f"(overhead {100 * overhead:.0f}% of a step, target {100 * self.target:.0f}%)"
        )

    def state_dict(self) -> dict[str, Any] | None:
        """The choice for a checkpoint (None while still measuring)."""
        if self.chosen is None:
            return None
        return {"factor_update_steps": self.chosen[0], "inv_update_steps": self.chosen[1], **self.measured}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Take back the choice ``state_dict()`` saved; with none (the run stopped while measuring),
        measure again from the next step."""
        if not saved:
            self.restart()
            return
        self.chosen = (int(saved["factor_update_steps"]), int(saved["inv_update_steps"]))
        self.measured = {k: float(v) for k, v in saved.items() if not k.endswith("_steps")}

    def restart(self) -> None:
        """Forget the timings (after a resume before the choice was made)."""
        self.samples.clear()
        self.prev_exit = None

"""Goal entries of a benchmark summary, judged by the interval of the figure, never by one point.

A goal is met only when the whole interval of its figure clears the target: a bootstrap interval over the
repeats or seeds (resampled with a fixed, recorded seed), or an interval the benchmark measured itself
(a paired IQR). A figure inside its noise is recorded ``met: false`` with ``reason: "within noise: ..."``;
a figure of one measurement is unmet with a reason that says so, unless it is exact by nature (a count, a
bit-for-bit comparison), which the entry states in ``exact``. Gaps keep their sign: a gap's samples are
the signed per-seed gaps, and its value is their statistic (never the absolute value of a mean).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

#: The bootstrap's resampling seed: fixed, so that an interval is reproducible from the recorded samples.
BOOTSTRAP_SEED = 0
#: Bootstrap resamples per interval.
BOOTSTRAP_RESAMPLES = 4000
#: The bootstrap interval's confidence.
CONFIDENCE = 0.95

#: The reason of a figure measured once (no repeats, no seeds): its noise is unknown.
ONE_MEASUREMENT = "one measurement, no repeats or seeds: its noise is unknown"

_COMPARATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}

Statistic = Literal["median", "mean"]


@dataclass(frozen=True)
class Interval:
    """Where a figure lies given its noise: ``low`` to ``high``, and how that was computed."""

    low: float
    high: float
    method: str

    def text(self) -> str:
        """``[low, high]`` with four significant digits."""
        return f"[{self.low:.4g}, {self.high:.4g}]"


def _statistic(values: np.ndarray, statistic: Statistic, axis: int | None = None) -> Any:
    return np.median(values, axis=axis) if statistic == "median" else np.mean(values, axis=axis)


def bootstrap_interval(
    samples: Sequence[float], statistic: Statistic = "median", *, unit: str = "repeats"
) -> Interval:
    """The percentile bootstrap interval (:data:`CONFIDENCE`) of ``statistic`` over ``samples``.

    Resampled :data:`BOOTSTRAP_RESAMPLES` times by a generator seeded with :data:`BOOTSTRAP_SEED` (never
    the time or the process), so the same samples give the same interval. With few samples it spans about
    their range: three seeds cannot settle a figure their spread straddles. ``unit`` names what a sample
    is (repeats, seeds, rounds) in the method's text.
    """
    values = np.asarray(samples, dtype=np.float64)
    if values.size == 0:
        raise ValueError("bootstrap_interval needs at least one sample")
    rng = np.random.Generator(np.random.PCG64(BOOTSTRAP_SEED))
    picks = rng.integers(0, values.size, size=(BOOTSTRAP_RESAMPLES, values.size))
    stats = _statistic(values[picks], statistic, axis=1)
    tail = (1.0 - CONFIDENCE) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return Interval(
        float(low),
        float(high),
        f"bootstrap {CONFIDENCE:.0%} interval of the {statistic} over {values.size} {unit} "
        f"(seed {BOOTSTRAP_SEED}, {BOOTSTRAP_RESAMPLES} resamples)",
    )


def paired_iqr(samples: Sequence[float], *, unit: str = "rounds") -> Interval:
    """The inter-quartile range of paired samples (each one side's measure over the other's, taken side by
    side) as the figure's interval."""
    values = np.asarray(samples, dtype=np.float64)
    q1, q3 = np.percentile(values, [25, 75])
    return Interval(float(q1), float(q3), f"paired IQR over {values.size} {unit}")


def _clears(interval: Interval, op_text: str, bound: float) -> bool:
    """Whether every value of ``interval`` meets ``op bound``."""
    compare = _COMPARATORS[op_text]
    edge = interval.high if op_text in ("<=", "<") else interval.low
    return bool(compare(edge, bound))


def _misses(interval: Interval, op_text: str, bound: float) -> bool:
    """Whether no value of ``interval`` meets ``op bound``."""
    compare = _COMPARATORS[op_text]
    edge = interval.low if op_text in ("<=", "<") else interval.high
    return not compare(edge, bound)


def _round(value: float) -> float:
    return round(float(value), 4)


def goal(
    value: float | None,
    target: str,
    *,
    samples: Sequence[float] | None = None,
    statistic: Statistic = "median",
    unit: str = "repeats",
    interval: Interval | None = None,
    exact: str = "",
    reason: str = "",
    **details: Any,
) -> dict[str, Any]:
    """A summary entry ``{"value", "goal", "met", "interval", "interval_method", ...}``; ``target`` reads like
    ``"<= 1.03"``.

    The figure's noise comes from ``samples`` (its value per repeat or seed: the interval is
    :func:`bootstrap_interval` of ``statistic``, and ``value``, when None, is that statistic), or from an
    ``interval`` the benchmark measured (:func:`paired_iqr`). The goal is met only when the whole interval
    clears the target; an interval that straddles it gives ``reason: "within noise: <interval> vs
    <target>"``. A figure with neither is unmet with :data:`ONE_MEASUREMENT` as its reason, unless
    ``exact`` says why it has no noise (a count, a bit-for-bit check): then the value alone is judged.

    ``reason`` says why the goal is not met whatever the value (it could not be measured, or does not
    apply here): the entry is then never met and carries the reason. A missing or non-finite value needs
    one. ``details`` (per-seed values, ...) are added to the entry as they are.
    """
    op_text, _, number = target.partition(" ")
    if op_text not in _COMPARATORS:
        raise ValueError(
            f"goal target {target!r}: write it as '<op> <number>' with op one of {list(_COMPARATORS)}"
        )
    bound = float(number)
    finite = None
    if samples is not None:
        finite = [float(x) for x in samples if x is not None and math.isfinite(float(x))]
        if len(finite) < len(samples):
            reason = (
                reason or f"{len(samples) - len(finite)} of {len(samples)} {unit} measured no finite value"
            )
        if value is None and finite:
            value = float(_statistic(np.asarray(finite), statistic))
        if len(finite) >= 2 and interval is None:
            interval = bootstrap_interval(finite, statistic, unit=unit)
    if value is not None and not math.isfinite(float(value)):
        reason = reason or f"the measured value was {value}"
        value = None
    if value is None and not reason:
        raise ValueError(f"goal {target!r} has no value: say why in reason=")
    if value is not None and not reason:
        if interval is not None:
            if not _clears(interval, op_text, bound) and not _misses(interval, op_text, bound):
                reason = f"within noise: {interval.text()} vs {target}"
        elif not exact:
            reason = ONE_MEASUREMENT
    met = (
        not reason
        and value is not None
        and _COMPARATORS[op_text](float(value), bound)
        and (interval is None or _clears(interval, op_text, bound))
    )
    entry: dict[str, Any] = {
        "value": None if value is None else _round(value),
        "goal": target,
        "met": bool(met),
    }
    if reason:
        entry["reason"] = reason
    if interval is not None:
        entry["interval"] = [_round(interval.low), _round(interval.high)]
        entry["interval_method"] = interval.method
    if finite is not None:
        entry["samples"] = [_round(x) for x in finite]
    if exact:
        entry["exact"] = exact
    entry.update(details)
    return entry


def ratio_interval(
    numerator: Sequence[float], denominator: Sequence[float], statistic: Statistic = "median"
) -> Interval:
    """The bootstrap interval of ``statistic(numerator) / statistic(denominator)`` for two sets measured
    apart (not paired): each side resampled on its own, with the fixed :data:`BOOTSTRAP_SEED`."""
    top, bottom = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    rng = np.random.Generator(np.random.PCG64(BOOTSTRAP_SEED))
    tops = _statistic(top[rng.integers(0, top.size, size=(BOOTSTRAP_RESAMPLES, top.size))], statistic, axis=1)
    bottoms = _statistic(
        bottom[rng.integers(0, bottom.size, size=(BOOTSTRAP_RESAMPLES, bottom.size))], statistic, axis=1
    )
    tail = (1.0 - CONFIDENCE) / 2.0
    low, high = np.quantile(tops / bottoms, [tail, 1.0 - tail])
    return Interval(
        float(low),
        float(high),
        f"bootstrap {CONFIDENCE:.0%} interval of the ratio of {statistic}s, {top.size} over {bottom.size} "
        f"runs resampled apart (seed {BOOTSTRAP_SEED}, {BOOTSTRAP_RESAMPLES} resamples)",
    )


def worst_of(
    cases: dict[str, tuple[float, Interval | None]], target: str, *, reason: str = "", **details: Any
) -> dict[str, Any]:
    """The goal of the worst of several cases (the highest for a ``<`` target, the lowest for ``>``), each
    ``(value, interval)`` (None: measured once).

    The interval is the worst of the cases' bounds, bound by bound: it clears the target exactly when every
    case's interval does, so a case inside its noise keeps the goal unmet even when another case is the
    worst by its point value. The entry lists each case's value and interval (``per_case``).
    """
    if not cases:
        return goal(None, target, reason=reason or "no case was measured", **details)
    worst = max if target.partition(" ")[0] in ("<=", "<") else min
    worst_case = worst(cases, key=lambda case: cases[case][0])
    measured = [i for _, i in cases.values() if i is not None]
    if len(measured) < len(cases) and not reason:
        reason = ONE_MEASUREMENT + f" ({', '.join(c for c, (_, i) in cases.items() if i is None)})"
    interval = None
    if measured:
        interval = Interval(
            worst(i.low for i in measured),
            worst(i.high for i in measured),
            f"bound by bound the worst of {len(measured)} cases' intervals, each a {measured[0].method}",
        )
    per_case = {
        case: {"value": _round(value)} | ({"interval": [_round(i.low), _round(i.high)]} if i else {})
        for case, (value, i) in cases.items()
    }
    return goal(
        cases[worst_case][0],
        target,
        interval=interval,
        reason=reason,
        worst_case=worst_case,
        per_case=per_case,
        **details,
    )


def worst_goal(
    samples_by_case: dict[str, Sequence[float]],
    target: str,
    *,
    statistic: Statistic = "median",
    unit: str = "repeats",
    reason: str = "",
    **details: Any,
) -> dict[str, Any]:
    """:func:`worst_of` the cases, each from its own samples (value: their ``statistic``; interval: their
    :func:`bootstrap_interval`; fewer than two samples: measured once)."""
    cases = {
        case: (
            float(_statistic(np.asarray(values, dtype=np.float64), statistic)),
            bootstrap_interval(values, statistic, unit=unit) if len(values) >= 2 else None,
        )
        for case, values in samples_by_case.items()
        if len(values) > 0
    }
    return worst_of(cases, target, reason=reason, **details)


def unmet_goals(summary: dict[str, dict[str, Any]]) -> list[str]:
    """The names of the summary's goals that are not met."""
    return [name for name, entry in summary.items() if not entry.get("met")]


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """``numerator[i] / denominator[i]`` for each pair measured side by side (same seed or round)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired_ratios: {len(numerator)} against {len(denominator)} values")
    return [a / b if b else math.nan for a, b in zip(numerator, denominator)]


def paired_gap_std(disagreement: float, samples: int) -> float:
    """The standard deviation, from validation sampling alone, of the accuracy gap between two models scored
    on the same ``samples`` images: ``sqrt(d / n)`` for a fraction ``d`` of the images that exactly one of
    the two classifies correctly (a fraction, as the accuracies are). One model's accuracy alone spreads by
    the binomial ``sqrt(p (1 - p) / n)``; on the same images the images both get right or wrong cancel."""
    if samples <= 0:
        raise ValueError(f"paired_gap_std needs a positive number of samples, not {samples}")
    return math.sqrt(disagreement / samples)


def seeds_for_half_width(std: float, half_width: float) -> int:
    """Seeds whose mean has a normal-approximation 95% interval narrower than ``half_width`` on each side
    (``1.96 std / sqrt(k) < half_width``), for per-seed values that spread by ``std``; at least 2."""
    if half_width <= 0:
        raise ValueError(f"seeds_for_half_width needs a positive half-width, not {half_width}")
    return max(2, math.floor((1.959964 * std / half_width) ** 2) + 1)


def resolution(entry: dict[str, Any], half_width: float) -> dict[str, Any]:
    """Whether a goal entry over seeds could tell its goal apart from no gap at all: its interval's
    ``interval_half_width`` against ``half_width`` (the goal's distance from 0), the per-seed spread
    ``seed_std`` and the ``seeds_needed`` for an interval that narrow at that spread. Empty without an
    interval."""
    if "interval" not in entry or len(entry.get("samples", [])) < 2:
        return {}
    low, high = entry["interval"]
    std = float(np.std(entry["samples"], ddof=1))
    return {
        "interval_half_width": _round((high - low) / 2.0),
        "resolves_goal": bool((high - low) / 2.0 < half_width),
        "seed_std": _round(std),
        "seeds_needed": seeds_for_half_width(std, half_width),
    }

"""Peak memory measured in a subprocess sees a known allocation inside the step, and nothing before it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kaisoku.errors import KaisokuError
from kaisoku.memory.measure import measure_in_subprocess

MIB = 1 << 20


def allocating_step(mib: int, before_mib: int = 0) -> Callable[[], dict[str, float]]:
    """A step that fills ``mib`` MiB and frees it; ``before_mib`` MiB are allocated and freed at build."""
    if before_mib:
        junk = torch.ones(before_mib * MIB // 4)
        del junk  # freed before the warm-up: the reset peak must not see it

    def step() -> dict[str, float]:
        block = torch.ones(mib * MIB // 4) if mib else torch.ones(1)
        return {"sum": float(block.sum())}

    return step


@pytest.mark.timeout(120)
def test_measures_a_known_allocation() -> None:
    target = "tests.memory.test_measure:allocating_step"
    small = measure_in_subprocess(target, {"mib": 0, "before_mib": 256}, threads=1)
    large = measure_in_subprocess(target, {"mib": 64}, threads=1)
    assert small.source == large.source == "VmHWM"
    assert large.extra == {"sum": 64 * MIB / 4}
    difference = (large.peak_bytes - large.before_bytes) - (small.peak_bytes - small.before_bytes)
    # 64 MiB more, give or take allocator pages; the 256 MiB freed before the step is not counted.
    assert 60 * MIB < difference < 70 * MIB
    assert small.peak_bytes - small.before_bytes < 8 * MIB


def test_a_failing_configuration_is_one_line() -> None:
    with pytest.raises(KaisokuError, match="measuring tests.memory.test_measure:nothing .* failed"):
        measure_in_subprocess("tests.memory.test_measure:nothing", {}, threads=1)

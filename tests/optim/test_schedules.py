"""Learning-rate schedules: warmup, arccot, cosine, poly, step, constant; LRScheduler behaviour; plots."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch

from kaisoku.optim.schedules import WarmupSchedule, arccot, plot_schedule, schedule_factor, schedule_values

PEAK = 0.8


def lrs(name: str, total: int, warmup: int = 0, **kwargs: float) -> list[float]:
    """The learning rate of every step, read from a real optimizer driven by the scheduler."""
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=PEAK)
    scheduler = WarmupSchedule(
        optimizer, schedule_factor(name, total_steps=total, warmup_steps=warmup, **kwargs)
    )
    values = []
    for _ in range(total):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def test_arccot_is_the_principal_branch() -> None:
    assert arccot(0.0) == pytest.approx(math.pi / 2)
    assert arccot(-1e9) == pytest.approx(math.pi)
    assert arccot(1e9) == pytest.approx(0.0, abs=1e-8)
    assert arccot(1.0) == pytest.approx(math.pi / 4)


def test_arccot_schedule_warmup_centre_and_end() -> None:
    total, warmup, slope, center = 1000, 50, 10.0, 0.5
    values = lrs("arccot", total, warmup, arccot_slope=slope, arccot_center=center)

    def curve(step: int) -> float:
        return PEAK * arccot(slope * (step / total - center)) / math.pi

    # Linear warmup from 1/warmup of the curve to the curve's value where warmup ends.
    assert values[0] == pytest.approx(curve(warmup) / warmup)
    assert values[warmup - 1] == pytest.approx(curve(warmup))
    assert values[warmup] == pytest.approx(curve(warmup))
    assert values[warmup // 2 - 1] == pytest.approx(curve(warmup) / 2)
    # Near the peak well before the centre, exactly half of it at the centre, falling towards 0 after.
    assert values[warmup] > 0.9 * PEAK
    assert values[500] == pytest.approx(PEAK / 2, rel=1e-12)
    assert values[-1] == pytest.approx(curve(total - 1))
    assert values[-1] < 0.07 * PEAK
    assert all(a >= b for a, b in zip(values[warmup:], values[warmup + 1 :]))


def test_arccot_slope_steepens_the_fall() -> None:
    gentle = lrs("arccot", 200, arccot_slope=2.0)
    steep = lrs("arccot", 200, arccot_slope=40.0)
    assert gentle[100] == pytest.approx(steep[100]) == pytest.approx(PEAK / 2)
    assert steep[20] > gentle[20] and steep[180] < gentle[180]


def test_cosine_and_poly_reach_the_floor() -> None:
    cosine = lrs("cosine", 110, 10, min_lr_ratio=0.1)
    assert cosine[9] == pytest.approx(PEAK)
    assert cosine[10] == pytest.approx(PEAK)
    assert cosine[60] == pytest.approx(PEAK * (0.1 + 0.9 * 0.5))
    assert cosine[-1] == pytest.approx(PEAK * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 99 / 100))))

    poly = lrs("poly", 110, 10, poly_power=2.0, min_lr_ratio=0.0)
    assert poly[10] == pytest.approx(PEAK)
    assert poly[60] == pytest.approx(PEAK * 0.25)
    assert poly[-1] == pytest.approx(PEAK * (1 / 100) ** 2)


def test_step_and_constant() -> None:
    step = lrs("step", 100, 0, step_milestones=[0.5, 0.75], step_gamma=0.1)
    assert step[49] == pytest.approx(PEAK)
    assert step[50] == pytest.approx(PEAK * 0.1)
    assert step[75] == pytest.approx(PEAK * 0.01)
    constant = lrs("constant", 20, 4)
    assert constant[0] == pytest.approx(PEAK / 4)
    assert constant[3:] == pytest.approx([PEAK] * 17)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        schedule_factor("cosine", total_steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        schedule_factor("cosine", total_steps=0)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_factor("linear", total_steps=10)


def test_state_dict_resumes_the_curve_and_loads_weights_only() -> None:
    def make() -> tuple[torch.optim.Optimizer, WarmupSchedule]:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
        return optimizer, WarmupSchedule(
            optimizer, schedule_factor("arccot", total_steps=100, warmup_steps=5)
        )

    optimizer, scheduler = make()
    for _ in range(37):
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    optimizer2, scheduler2 = make()
    scheduler2.load_state_dict(state)
    optimizer2.param_groups[0]["lr"] = scheduler2.get_last_lr()[0]
    assert scheduler2.last_epoch == 37
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        optimizer2.step()
        scheduler2.step()
        assert optimizer2.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])


def test_plot_schedule_from_factory_or_function(tmp_path: Path) -> None:
    def factory(optimizer: torch.optim.Optimizer) -> WarmupSchedule:
        return WarmupSchedule(optimizer, schedule_factor("arccot", total_steps=60, warmup_steps=6))

    def fn(step: int) -> float:
        return 0.1 * schedule_factor("cosine", total_steps=60)(step)

    assert schedule_values(factory, 60, lr=2.0)[30] == pytest.approx(1.0)
    assert schedule_values(fn, 60)[0] == pytest.approx(0.1)
    for name, schedule in (("factory", factory), ("fn", fn)):
        path = plot_schedule(schedule, 60, tmp_path / "plots" / f"{name}.png", steps_per_epoch=6)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

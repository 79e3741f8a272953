"""K-FAC intervals adapted to measured cost: the pure rule, the warm-up, agreement over ranks, resume."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from kaisoku.config import Config
from kaisoku.errors import ConfigError
from kaisoku.optim.kfac import KFAC
from kaisoku.optim.kfac.intervals import WARMUP_STEPS, choose_intervals, predicted_overhead
from kaisoku.run_facts import check_config
from tests.dist_harness import run_ranks


def test_hand_worked_cases() -> None:
    # d <= s: F = I = (s + d) / B = (4 + 1) / (0.25 * 10) = 2, and the target is met exactly.
    assert choose_intervals(10.0, 4.0, 1.0, 0.0, 0.25) == (2, 2)
    # d > s: B = 3, sqrt(s) + sqrt(d) = 3, F = 1 * 3 / 3 = 1, I = 2 * 3 / 3 = 2.
    assert choose_intervals(10.0, 1.0, 4.0, 0.0, 0.3) == (1, 2)
    # Rounded up to powers of two: F* = I* = 9.1 / 1.575 = 5.8 -> 8 (the 1D CNN figures).
    assert choose_intervals(10.3, 8.2, 0.9, 1.0, 0.25) == (8, 8)
    # Free K-FAC: every step.
    assert choose_intervals(10.0, 0.0, 0.0, 0.5, 0.25) == (1, 1)


def test_cap_when_the_target_is_out_of_reach() -> None:
    # Preconditioning alone exceeds the target: the least overhead K-FAC can have.
    assert choose_intervals(10.0, 1.0, 1.0, 3.0, 0.25) == (128, 128)
    # Statistics far too dear: capped, the cap rounded down to a power of two.
    assert choose_intervals(10.0, 1e6, 1.0, 0.0, 0.25, max_interval=100) == (64, 64)
    # Only I would pass the cap: F grows until the target is met.
    factor_every, inv_every = choose_intervals(1.0, 0.001, 20.0, 0.0, 0.25, max_interval=128)
    assert inv_every == 128 and predicted_overhead(1.0, 0.001, 20.0, 0.0, factor_every, inv_every) <= 0.25


def test_monotone_and_target_met_when_reachable() -> None:
    rng = random.Random(16)
    for _ in range(2000):
        step, s, d, p = rng.uniform(1, 20), rng.uniform(0, 30), rng.uniform(0, 30), rng.uniform(0, 3)
        target = rng.uniform(0.05, 0.9)
        f, i = choose_intervals(step, s, d, p, target)
        assert i % f == 0 and 1 <= f <= i <= 128
        if predicted_overhead(step, s, d, p, 128, 128) <= target:
            assert predicted_overhead(step, s, d, p, f, i) <= target + 1e-12
        # Cheaper statistics, decompositions or preconditioning, or a looser target: never larger.
        for cheaper in ((step, s * 0.7, d, p), (step, s, d * 0.7, p), (step, s, d, p * 0.7)):
            f2, i2 = choose_intervals(*cheaper, target)
            assert f2 <= f and i2 <= i
        f3, i3 = choose_intervals(step, s, d, p, min(0.95, target * 1.3))
        assert f3 <= f and i3 <= i


def test_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        choose_intervals(1.0, 1.0, 1.0, 0.0, 0.0)
    with pytest.raises(ConfigError, match="overhead_target"):
        KFAC(nn.Linear(2, 2), lr=0.1, overhead_target=1.0)
    cfg = Config()
    cfg.optim.kfac.overhead_target = -0.1
    with pytest.raises(ConfigError, match="overhead_target"):
        check_config(cfg, 1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(model: nn.Module, kfac: KFAC, steps: range, rank: int = 0) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    kfac.lr = optimizer
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        kfac.step()
        optimizer.step()
        optimizer.zero_grad()


def test_warmup_chooses_logs_and_resumes(caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    kfac = KFAC(model, lr=0.05, overhead_target=0.25, inv_update_steps=3)
    announced: list[tuple[dict[str, object], str]] = []
    kfac.on_intervals = lambda record, text: announced.append((record, text))
    with caplog.at_level(logging.INFO, logger="kaisoku.optim.kfac"):
        _train(model, kfac, range(WARMUP_STEPS))
        assert kfac.intervals is None
        assert kfac.timings["decomposition"] > 0
        _train(model, kfac, range(WARMUP_STEPS, WARMUP_STEPS + 1))
    assert kfac.intervals is not None
    assert (kfac.factor_update_steps, kfac.inv_update_steps) == kfac.intervals
    assert any("K-FAC intervals: factors every" in r.getMessage() for r in caplog.records)
    ((record, text),) = announced
    assert record["event"] == "kfac_intervals" and record["step"] == WARMUP_STEPS + 1
    assert (record["factor_update_steps"], record["inv_update_steps"]) == kfac.intervals
    assert text.startswith(f"K-FAC intervals: factors every {kfac.intervals[0]},")
    state = kfac.state_dict()
    assert state["intervals"]["step_s"] > 0 and state["intervals"]["stats_s"] > 0

    resumed = KFAC(_model(), lr=0.05, overhead_target=0.25)
    resumed.load_state_dict(state)
    assert resumed.intervals == kfac.intervals
    assert resumed.inv_update_steps == kfac.inv_update_steps
    # Fixed intervals ignore a saved choice.
    fixed = KFAC(_model(), lr=0.05, inv_update_steps=3)
    fixed.load_state_dict(state)
    assert fixed.intervals is None and fixed.inv_update_steps == 3


def _ranks_body(rank: int, world_size: int, tmp: Path) -> dict[str, object]:
    torch.set_num_threads(1)
    model = _model()
    # Rank 1 is made slower at the factor statistics, so the ranks measure different costs.
    slow = nn.Linear(16, 16)
    kfac = KFAC(model, lr=0.05, overhead_target=0.2, max_interval=16)
    if rank == 1:

        def busy(*_: object) -> None:
            for _ in range(20):
                slow(torch.randn(256, 16))

        model[0].register_forward_hook(busy)
    _train(model, kfac, range(WARMUP_STEPS + 1), rank)
    local = kfac._tuner.medians()
    state = kfac.state_dict()
    model2 = _model()
    resumed = KFAC(model2, lr=0.05, overhead_target=0.2, max_interval=16)
    resumed.load_state_dict(state)
    _train(model2, resumed, range(WARMUP_STEPS + 1, WARMUP_STEPS + 3), rank)
    return {
        "intervals": kfac.intervals,
        "measured": state["intervals"],
        "local": local,
        "resumed": resumed.intervals,
    }


def test_two_ranks_agree(tmp_path: Path) -> None:
    results = run_ranks(_ranks_body, 2, tmp_path, timeout=60.0)
    assert results[0]["intervals"] == results[1]["intervals"] is not None
    assert results[0]["measured"] == results[1]["measured"]
    assert results[0]["resumed"] == results[0]["intervals"] == results[1]["resumed"]
    # The agreed figures are the maximum over the ranks of each rank's medians.
    for index, key in enumerate(("step_s", "stats_s", "decomp_s", "precond_s")):
        assert results[0]["measured"][key] == max(r["local"][index] for r in results)


def test_warmup_decomposes_twice_and_times_the_round_it_ran() -> None:
    from kaisoku.optim.kfac.intervals import DECOMPOSITION_SAMPLES

    model = _model()
    kfac = KFAC(model, lr=0.05, overhead_target=0.25, inv_update_steps=1000)
    rounds: list[int] = []
    decompose = kfac._decompose_owned

    def counted(*args: object, **kwargs: object) -> None:
        rounds.append(kfac.steps)
        decompose(*args, **kwargs)  # type: ignore[arg-type]

    kfac._decompose_owned = counted  # type: ignore[method-assign]
    _train(model, kfac, range(WARMUP_STEPS + 1))
    # The untimed first step and the first timed one; a decomposition round costs the same each time.
    assert sorted(set(rounds)) == list(range(1 + DECOMPOSITION_SAMPLES))
    decomp = [sample[2] for sample in kfac._tuner.samples]
    assert decomp[0] > 0 and all(math.isnan(v) for v in decomp[DECOMPOSITION_SAMPLES:])
    assert kfac._tuner.measured["decomp_s"] == decomp[0]

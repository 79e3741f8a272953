"""The budget planner's choice, worked by hand on small cases, and its one-line refusals."""

from __future__ import annotations

import pytest

from kaisoku.errors import ConfigError
from kaisoku.memory.planner import BlockCost, Option, choose, minimum_peak, parse_budget, parse_policy

MIB = 1 << 20


def _block(saved: int, *, recompute_s: float, compress: tuple[int, float] | None = None) -> BlockCost:
    """A block keeping ``saved`` MiB; recompute holds 1 MiB (its input) and brings ``saved`` back."""
    options = {
        "keep": Option(saved * MIB, 0.0),
        "recompute": Option(1 * MIB, recompute_s, transient_bytes=saved * MIB),
    }
    if compress is not None:
        options["compress"] = Option(compress[0] * MIB, compress[1])
    return BlockCost(saved_bytes=saved * MIB, options=options)


# Three blocks: A keeps 10 MiB (recompute 1.0 s, compress to 5 MiB for 0.2 s), B 8 MiB (0.5 s, no
# compression), C 4 MiB (0.1 s, compress to 2 MiB for 0.3 s). Fixed 20 MiB.
BLOCKS = [
    _block(10, recompute_s=1.0, compress=(5, 0.2)),
    _block(8, recompute_s=0.5),
    _block(4, recompute_s=0.1, compress=(2, 0.3)),
]


@pytest.mark.parametrize(
    ("budget_mib", "expected", "peak_mib", "added"),
    [
        (42, ("keep", "keep", "keep"), 42, 0.0),  # everything fits as it is
        (38, ("compress", "keep", "keep"), 37, 0.2),  # A compressed: 20+5+8+4
        # 33: compress A, recompute B and C: 20 + 5+1+1 + transient 8 = 35, too much; compress A and C,
        # recompute B: 20 + 5+1+2 + 8 = 36, too much. Only everything recomputed fits: 20 + 3 + 10 = 33.
        (33, ("recompute", "recompute", "recompute"), 33, 1.6),
    ],
)
def test_choice_on_hand_worked_cases(
    budget_mib: int, expected: tuple[str, ...], peak_mib: int, added: float
) -> None:
    plan = choose(BLOCKS, fixed=20 * MIB, budget=budget_mib * MIB)
    assert plan.techniques == expected
    assert plan.predicted_peak == peak_mib * MIB
    assert plan.added_s == pytest.approx(added)


def test_cheapest_of_several_fitting_plans() -> None:
    # 36 MiB: compress A (5) + recompute C (held 1, transient 4): 20+5+8+1+4 = 38 no;
    # compress A + compress C: 20+5+8+2 = 35 fits at 0.5 s; recompute B alone: 20+10+1+4+8 = 43 no.
    plan = choose(BLOCKS, fixed=20 * MIB, budget=36 * MIB)
    assert plan.techniques == ("compress", "keep", "compress")
    assert plan.added_s == pytest.approx(0.5)
    assert plan.summary() == "0:compress, 1:keep, 2:compress"


def test_forced_policy_is_respected() -> None:
    # B forced to recompute: keeping A and C gives 20 + 10+1+4 + transient 8 = 43 > 42. Compress C:
    # 41 at 0.8 s; compress A: 38 at 0.7 s; recompute C: 20 + 10+1+1 + 8 = 40 at 0.6 s (the cheapest).
    plan = choose(BLOCKS, fixed=20 * MIB, budget=42 * MIB, forced={1: "recompute"})
    assert plan.techniques == ("keep", "recompute", "recompute")
    assert plan.predicted_peak == 40 * MIB
    assert plan.added_s == pytest.approx(0.6)


def test_too_small_budget_names_the_minimum() -> None:
    assert minimum_peak(BLOCKS, 20 * MIB) == 33 * MIB
    with pytest.raises(ConfigError) as info:
        choose(BLOCKS, fixed=20 * MIB, budget=30 * MIB)
    message = str(info.value)
    assert "needs at least 33.0 MiB with everything recomputed" in message
    assert "\n" not in message


def test_policy_parsing_and_unknown_block() -> None:
    assert parse_policy("0-2:recompute, 5:compress", 10) == {
        0: "recompute",
        1: "recompute",
        2: "recompute",
        5: "compress",
    }
    with pytest.raises(ConfigError, match=r"block '12' does not exist; the model's blocks are 0-9"):
        parse_policy("12:offload", 10)
    with pytest.raises(ConfigError, match="techniques: keep, compress, recompute, offload"):
        parse_policy("1:swap", 10)


def test_budget_sizes_and_fractions() -> None:
    assert parse_budget("2GiB") == 2 << 30
    assert parse_budget("0.5", total_bytes=8 << 30) == 4 << 30
    with pytest.raises(ConfigError, match="neither a fraction"):
        parse_budget("3")


def test_gradients_late_in_backward_count_against_transients() -> None:
    # With 5 MiB of gradients beside any transient, everything recomputed costs 20 + 3 + 10 + 5 = 38;
    # compressing A and C without a transient costs 20 + 5 + 8 + 2 = 35, now the lowest peak.
    plan = choose(BLOCKS, fixed=20 * MIB, budget=35 * MIB, backward_bytes=5 * MIB)
    assert plan.techniques == ("compress", "keep", "compress")
    assert plan.predicted_peak == 35 * MIB
    assert minimum_peak(BLOCKS, 20 * MIB, backward_bytes=5 * MIB) == 35 * MIB
    with pytest.raises(ConfigError, match="needs at least 35.0 MiB"):
        choose(BLOCKS, fixed=20 * MIB, budget=34 * MIB, backward_bytes=5 * MIB)

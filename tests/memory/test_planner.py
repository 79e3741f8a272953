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
# compression), C 4 MiB (0.1 s, compress to 2 MiB for 0.3 s). Fixed 20 MiB. The modelled peak is the
# highest of: the end of forward (20 + every block's held bytes) and each block's backward (20 + the
# held bytes of the blocks up to it + what it brings back).
BLOCKS = [
    _block(10, recompute_s=1.0, compress=(5, 0.2)),
    _block(8, recompute_s=0.5),
    _block(4, recompute_s=0.1, compress=(2, 0.3)),
]


@pytest.mark.parametrize(
    ("budget_mib", "expected", "peak_mib", "added"),
    [
        (42, ("keep", "keep", "keep"), 42, 0.0),  # everything fits as it is: the end of forward, 42
        (38, ("compress", "keep", "keep"), 37, 0.2),  # A compressed: 20+5+8+4
        # 33: compressing A leaves B's backward at 20+5+8 = 33 but the end at 37; recomputing A holds
        # 1 MiB: its backward 20+1+10 = 31, the end 20+1+8+4 = 33.
        (33, ("recompute", "keep", "keep"), 33, 1.0),
        # 32: recompute A and compress C (1.3 s: end 31, A's backward 31) beats recomputing A and B
        # (1.5 s); recomputing A and C ends at 30 but C's backward is 20+1+8+1+4 = 34.
        (32, ("recompute", "keep", "compress"), 31, 1.3),
    ],
)
def test_choice_on_hand_worked_cases(
    budget_mib: int, expected: tuple[str, ...], peak_mib: int, added: float
) -> None:
    plan = choose(BLOCKS, fixed=20 * MIB, budget=budget_mib * MIB)
    assert plan.techniques == expected
    assert plan.predicted_peak == peak_mib * MIB
    assert plan.added_s == pytest.approx(added)


def test_summary_names_ranges() -> None:
    plan = choose(BLOCKS, fixed=20 * MIB, budget=32 * MIB)
    assert plan.summary() == "0:recompute, 1:keep, 2:compress"


def test_forced_policy_is_respected() -> None:
    # B forced to recompute: its backward is 20 + 10 + 1 + 8 = 39 <= 42 with A kept; the end 35.
    plan = choose(BLOCKS, fixed=20 * MIB, budget=42 * MIB, forced={1: "recompute"})
    assert plan.techniques == ("keep", "recompute", "keep")
    assert plan.predicted_peak == 39 * MIB
    assert plan.added_s == pytest.approx(0.5)


def test_too_small_budget_names_the_minimum() -> None:
    # No plan goes below A's backward with A recomputed (20 + 1 + 10): compressing A (25) leaves B's
    # backward at 33 or more.
    assert minimum_peak(BLOCKS, 20 * MIB) == 31 * MIB
    with pytest.raises(ConfigError) as info:
        choose(BLOCKS, fixed=20 * MIB, budget=30 * MIB)
    message = str(info.value)
    assert "needs at least 31.0 MiB with its least-memory plan (0-2:recompute)" in message
    assert "\n" not in message


def test_backward_working_set_counts_in_every_backward_phase() -> None:
    # 5 MiB beside every block's backward: A recomputed is now 36; the end of forward is unchanged.
    assert minimum_peak(BLOCKS, 20 * MIB, backward_bytes=5 * MIB) == 36 * MIB
    with pytest.raises(ConfigError, match="needs at least 36.0 MiB"):
        choose(BLOCKS, fixed=20 * MIB, budget=35 * MIB, backward_bytes=5 * MIB)
    # A block's own backward bytes count in its own phase only: 6 MiB on C rules out keeping every
    # block (C's backward 20+10+8+4+6 = 48 > 42); the cheapest plans that fit (0.5 s: A and C
    # compressed, or B recomputed) peak at C's backward, 41.
    heavy = [*BLOCKS[:2], BlockCost(saved_bytes=4 * MIB, options=BLOCKS[2].options, backward_bytes=6 * MIB)]
    plan = choose(heavy, fixed=20 * MIB, budget=42 * MIB)
    assert plan.added_s == pytest.approx(0.5)
    assert plan.predicted_peak == 41 * MIB


def test_policy_parsing_and_unknown_block() -> None:
    assert parse_policy("0-2:recompute, 5:compress", 10) == {
        0: "recompute",
        1: "recompute",
        2: "recompute",
        5: "compress",
    }
    with pytest.raises(ConfigError, match=r"block '12' does not exist; the model's blocks are 0-9"):
        parse_policy("12:offload", 10)
    assert parse_policy("0:int8", 2) == {0: "int8"}
    with pytest.raises(ConfigError, match="techniques: keep, compress, int8, recompute, offload"):
        parse_policy("1:swap", 10)


def test_budget_sizes_and_fractions() -> None:
    assert parse_budget("2GiB") == 2 << 30
    assert parse_budget("0.5", total_bytes=8 << 30) == 4 << 30
    with pytest.raises(ConfigError, match="neither a fraction"):
        parse_budget("3")

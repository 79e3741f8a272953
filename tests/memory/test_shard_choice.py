"""memory.budget's pricing of full sharding, worked by hand (pure: no process group)."""

from __future__ import annotations

import pytest

from kaisoku.errors import ConfigError
from kaisoku.memory.planner import BlockCost, Option, choose_with_shard, minimum_peak, price_shard

MIB = 1 << 20
FIXED = 10 * MIB


def _blocks() -> list[BlockCost]:
    """Eight blocks of 8 MiB of weights each; block 0 keeps 20 MiB of activations (compressible to 5 MiB
    for 0.4 s), the others 1 MiB. A block's backward holds the gradients of it and the blocks after it."""
    out = []
    for index in range(8):
        saved = 20 if index == 0 else 1
        options = {"keep": Option(saved * MIB, 0.0)}
        if index == 0:
            options["compress"] = Option(5 * MIB, 0.4, transient_bytes=5 * MIB)
        late = 8 * (8 - index)
        out.append(BlockCost(saved * MIB, options, backward_bytes=late * MIB, param_bytes=8 * MIB))
    return out


def test_shard_price_by_hand() -> None:
    # Block 0's backward: 10 fixed + 20 kept + its own gradient whole (8) + the other 56 MiB of gradients
    # as halves (28) + one block's gathered weights (8) = 74 MiB; the end of forward is 10 + 27 + 8 = 45.
    price = price_shard(_blocks(), fixed=FIXED, shards=2, gather_s=0.25)
    assert price.predicted_peak == 74 * MIB
    assert price.added_s == 0.25
    assert price.weight_bytes_saved == 32 * MIB
    # Without sharding every gradient is whole: keep peaks at 10 + 20 + 64 = 94 MiB, and the least any
    # per-block plan reaches is block 0 compressed, 10 + 5 + 5 + 64 = 84 MiB.
    assert minimum_peak(_blocks(), FIXED, dict.fromkeys(range(8), "keep")) == 94 * MIB
    assert minimum_peak(_blocks(), FIXED) == 84 * MIB
    # More ranks, smaller gradient shards: 10 + 20 + 8 + 56/4 + 8 = 60 MiB.
    assert price_shard(_blocks(), fixed=FIXED, shards=4, gather_s=0.0).predicted_peak == 60 * MIB


def test_shard_chosen_when_no_per_block_plan_fits() -> None:
    price = price_shard(_blocks(), fixed=FIXED, shards=2, gather_s=5.0)
    plan = choose_with_shard(_blocks(), fixed=FIXED, budget=80 * MIB, shard=price)
    assert plan.shard == "full" and plan.summary() == "shard full"
    assert plan.techniques == ("keep",) * 8
    assert plan.predicted_peak == 74 * MIB and plan.added_s == 5.0
    assert "no per-block plan fits" in plan.shard_note


@pytest.mark.parametrize(("gather_s", "shard"), [(0.1, "full"), (1.0, "none")])
def test_shard_against_the_cheapest_fitting_plan(gather_s: float, shard: str) -> None:
    # At 90 MiB both fit: block 0 compressed (+0.4 s) or sharding (+gather_s); the faster one is taken.
    price = price_shard(_blocks(), fixed=FIXED, shards=2, gather_s=gather_s)
    plan = choose_with_shard(_blocks(), fixed=FIXED, budget=90 * MIB, shard=price)
    assert plan.shard == shard
    if shard == "none":
        assert plan.techniques[0] == "compress" and plan.added_s == pytest.approx(0.4)
        assert plan.shard_price == price
        assert "not chosen" in plan.shard_note and "+1000.0 ms" in plan.shard_note, plan.shard_note


def test_shard_not_chosen_when_it_does_not_fit_or_nothing_is_needed() -> None:
    price = price_shard(_blocks(), fixed=FIXED, shards=2, gather_s=0.0)
    # 100 MiB: every block kept fits and adds nothing; sharding (even free) does not beat it.
    plan = choose_with_shard(_blocks(), fixed=FIXED, budget=100 * MIB, shard=price)
    assert plan.shard == "none" and plan.added_s == 0.0
    # With 10% headroom, 80 MiB leaves 72 MiB: sharding's 74 does not fit, nor does any per-block plan.
    with pytest.raises(ConfigError) as info:
        choose_with_shard(_blocks(), fixed=FIXED, budget=80 * MIB, shard=price, headroom=0.1)
    message = str(info.value)
    assert "is too small" in message and "full sharding over 2 ranks needs at least" in message, message
    assert "\n" not in message


def test_not_priced_keeps_the_reason_and_the_per_block_plan() -> None:
    plan = choose_with_shard(
        _blocks(), fixed=FIXED, budget=90 * MIB, shard=None, not_priced="memory.allow_shard is off"
    )
    assert plan.shard == "none" and plan.techniques[0] == "compress"
    assert plan.shard_note == "sharding not priced: memory.allow_shard is off"
    with pytest.raises(ConfigError) as info:
        choose_with_shard(_blocks(), fixed=FIXED, budget=80 * MIB, shard=None)
    assert "sharding" not in str(info.value)

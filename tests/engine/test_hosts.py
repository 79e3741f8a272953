"""What hosts.json and the terminal say when the world changes size between attempts."""

from __future__ import annotations

from kaisoku.engine.hosts import world_change


def _attempt(world_size: int, hosts: dict[str, list[int]], start_step: int = 0) -> dict:
    return {"world_size": world_size, "num_nodes": len(hosts), "hosts": hosts, "start_step": start_step}


def test_a_lost_host_and_a_host_that_joins_are_each_named_once() -> None:
    both = _attempt(4, {"n0": [0, 1], "n1": [2, 3]})
    alone = _attempt(2, {"n0": [0, 1]}, start_step=8)
    back = _attempt(4, {"n0": [0, 1], "n1": [2, 3]}, start_step=12)
    assert world_change(both, alone) == "world size 4 -> 2 (lost n1); 1 host continue from step 8"
    assert world_change(alone, back) == "world size 2 -> 4 (joined n1); 2 hosts continue from step 12"


def test_the_same_size_or_a_first_attempt_says_nothing() -> None:
    both = _attempt(2, {"n0": [0], "n1": [1]})
    assert world_change(None, both) is None
    assert world_change(both, _attempt(2, {"n0": [0], "n2": [1]}, start_step=4)) is None

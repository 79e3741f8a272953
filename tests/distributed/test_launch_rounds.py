"""The attempt a rank belongs to, alike on every host of a rendezvous round, and the agent's environment
for a rendezvous across hosts."""

from __future__ import annotations

import os

import pytest

from kaisoku.distributed.launch import (
    RESTART_COUNT_ENV,
    ROUND_ENV,
    UNSHARED_STORE_ENV,
    adopt_rendezvous_round,
    rendezvous_for,
)


def test_the_round_replaces_the_hosts_own_restart_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # A host that rejoined has restarted nothing itself; the round it joined says which attempt it is.
    monkeypatch.setenv(RESTART_COUNT_ENV, "0")
    monkeypatch.setenv(ROUND_ENV, "2")
    assert adopt_rendezvous_round() == 2
    assert os.environ[RESTART_COUNT_ENV] == "2"


def test_without_a_round_the_restart_count_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    monkeypatch.delenv(ROUND_ENV, raising=False)
    assert adopt_rendezvous_round() == 1
    monkeypatch.delenv(RESTART_COUNT_ENV)
    assert adopt_rendezvous_round() == 0


def test_c10d_across_hosts_unshares_the_store_and_static_leaves_it() -> None:
    elastic = rendezvous_for("1:2", -1, "node0", run_id="r", join_timeout=60)
    static = rendezvous_for("2", 1, "node0:29400", run_id="r", join_timeout=60)
    assert elastic is not None and static is not None
    assert elastic.agent_env() == dict([UNSHARED_STORE_ENV])
    assert static.agent_env() == {}
    assert rendezvous_for("1", -1, "", run_id="r", join_timeout=60) is None

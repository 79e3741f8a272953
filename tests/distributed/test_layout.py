"""Parallel layouts and rank placement: pure checks, no processes."""

from __future__ import annotations

import pytest

from kaisoku.distributed.layout import ParallelLayout, check_parallel, resolve_schedule
from kaisoku.distributed.mesh import rank_coordinates, rank_grid
from kaisoku.errors import ConfigError, KaisokuError


def test_world_mismatch_shows_the_arithmetic() -> None:
    with pytest.raises(ConfigError, match=r"dp 2 x pp 3 = 6 but the world has 4 ranks"):
        ParallelLayout(dp=2, pp=3).check_world(4)
    ParallelLayout(dp=2, pp=2).check_world(4)


@pytest.mark.parametrize("dp, pp", [(0, 1), (1, 0), (-2, 2), (True, 1)])
def test_degrees_must_be_positive_integers(dp: int, pp: int) -> None:
    with pytest.raises(ConfigError, match="positive integer"):
        ParallelLayout(dp=dp, pp=pp)


def test_resolve_fills_dp_from_the_world() -> None:
    assert ParallelLayout.resolve(8, dp=-1, pp=2) == ParallelLayout(4, 2)
    assert ParallelLayout.resolve(4) == ParallelLayout(4, 1)
    with pytest.raises(ConfigError, match="pp 3 does not divide the world of 4 ranks"):
        ParallelLayout.resolve(4, dp=-1, pp=3)
    with pytest.raises(ConfigError, match="dp 3 x pp 2 = 6 but the world has 4 ranks"):
        ParallelLayout.resolve(4, dp=3, pp=2)


@pytest.mark.parametrize(
    "text, layout, canonical",
    [
        ("dp2xpp2", ParallelLayout(2, 2), "dp2xpp2"),
        ("DP4", ParallelLayout(4, 1), "dp4"),
        ("pp4", ParallelLayout(1, 4), "pp4"),
        ("dp1xpp1", ParallelLayout(1, 1), "dp1"),
        ("dp2pp3", ParallelLayout(2, 3), "dp2xpp3"),
    ],
)
def test_parse_and_print(text: str, layout: ParallelLayout, canonical: str) -> None:
    assert ParallelLayout.parse(text) == layout
    assert str(layout) == canonical
    assert ParallelLayout.parse(str(layout)) == layout


@pytest.mark.parametrize("text", ["", "dp", "2x2", "dp2xtp2", "pp2xdp2"])
def test_parse_rejects_other_text(text: str) -> None:
    with pytest.raises(ConfigError, match="cannot read parallel layout"):
        ParallelLayout.parse(text)


def test_row_major_when_pipelines_fit_nodes() -> None:
    layout = ParallelLayout(dp=4, pp=2)
    expected = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_grid(layout) == expected
    assert rank_grid(layout, ranks_per_node=4) == expected
    assert rank_grid(layout, ranks_per_node=2) == expected


def test_pipelines_stay_on_a_node_where_they_fit() -> None:
    # 2 nodes of 3 ranks, pipelines of 2: row-major would make [2, 3] cross nodes and keep [4, 5] inside;
    # either way one pipeline must cross. Whole pipelines first: [0,1] on node 0, [3,4] on node 1.
    grid = rank_grid(ParallelLayout(dp=3, pp=2), ranks_per_node=3)
    assert grid == [[0, 1], [2, 5], [3, 4]]
    # 3 nodes of 3 ranks, pipelines of 3 ranks: each pipeline is one node.
    assert rank_grid(ParallelLayout(dp=3, pp=3), ranks_per_node=3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_placement_minimises_pipelines_crossing_nodes() -> None:
    def crossings(grid: list[list[int]], per_node: int) -> int:
        return sum(len({rank // per_node for rank in pipeline}) > 1 for pipeline in grid)

    for per_node in (1, 2, 3, 4, 5, 6):
        for pp in (1, 2, 3, 4):
            for dp in (1, 2, 3, 5):
                layout = ParallelLayout(dp=dp, pp=pp)
                grid = rank_grid(layout, ranks_per_node=per_node)
                flat = sorted(rank for pipeline in grid for rank in pipeline)
                assert flat == list(range(dp * pp))
                assert all(len(pipeline) == pp for pipeline in grid)
                # Whole pipelines that fit inside nodes never cross: at most the leftovers do.
                world = dp * pp
                fitting = sum(min(per_node, world - s) // pp for s in range(0, world, per_node))
                assert crossings(grid, per_node) <= dp - min(dp, fitting)


def test_rank_coordinates_invert_the_grid() -> None:
    layout = ParallelLayout(dp=3, pp=2)
    grid = rank_grid(layout, ranks_per_node=3)
    for dp_index, pipeline in enumerate(grid):
        for pp_index, rank in enumerate(pipeline):
            assert rank_coordinates(rank, layout, ranks_per_node=3) == (dp_index, pp_index)
    assert rank_coordinates(3, ParallelLayout(2, 2)) == (1, 1)
    with pytest.raises(KaisokuError, match="rank 4 is outside the layout dp2xpp2 of 4 ranks"):
        rank_coordinates(4, ParallelLayout(2, 2))


# ----------------------------------------------------------------------------------------------------
# check_parallel / resolve_schedule: the one place parallel settings are checked, from plain values.


def test_check_parallel_plain_data_parallel_needs_no_model() -> None:
    def never() -> int:
        raise AssertionError("the block count is only needed for pipeline layouts")

    assert check_parallel(world_size=None, global_batch=128, block_count=never) is None
    schedule = check_parallel(world_size=4, global_batch=128, block_count=never)
    assert schedule is not None and [str(s.layout) for s in schedule.segments] == ["dp4"]


def test_check_parallel_shows_the_arithmetic_against_the_world() -> None:
    with pytest.raises(ConfigError, match=r"dp 2 x pp 2 = 4 but the world has 2 ranks"):
        check_parallel(world_size=2, global_batch=16, dp=2, pp=2)
    with pytest.raises(ConfigError, match=r"parallel.pp 3 does not divide the world of 4 ranks"):
        check_parallel(world_size=4, global_batch=12, pp=3, microbatches=3)
    with pytest.raises(ConfigError, match="needs a world of at least 2 ranks"):
        check_parallel(world_size=1, global_batch=16, pp=2)


def test_check_parallel_checks_batches_schedules_and_blocks_per_layout() -> None:
    with pytest.raises(ConfigError, match="replica batch of 6 samples .* multiple of 8"):
        check_parallel(world_size=4, global_batch=12, switch="dp2xpp2:0-1,dp4:1-", microbatches=4)
    with pytest.raises(ConfigError, match="1f1b needs at least pp 4 micro-batches"):
        check_parallel(world_size=4, global_batch=16, pp=4, microbatches=2)
    with pytest.raises(ConfigError, match="needs 8 pipeline stages .* only 5 blocks"):
        check_parallel(world_size=8, global_batch=64, pp=8, microbatches=8, block_count=lambda: 5)
    # Without a world, what does not depend on it is still checked.
    with pytest.raises(ConfigError, match="only 3 blocks"):
        check_parallel(world_size=None, global_batch=64, pp=4, microbatches=4, block_count=lambda: 3)


def test_resolve_schedule_fills_the_world() -> None:
    assert str(resolve_schedule(4, pp=2).layout_at(0)) == "dp2xpp2"
    assert str(resolve_schedule(4).layout_at(7)) == "dp4"
    schedule = resolve_schedule(4, switch="pp4:0-2,dp4:2-")
    assert [str(schedule.layout_at(e)) for e in range(4)] == ["pp4", "pp4", "dp4", "dp4"]
    with pytest.raises(ConfigError, match="dp 4 x pp 1 = 4 but the world has 2 ranks"):
        resolve_schedule(2, switch="dp4")

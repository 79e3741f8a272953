"""The DeviceMesh of a layout on real gloo ranks: named dimensions and sub-groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kaisoku.distributed.layout import ParallelLayout
from kaisoku.distributed.mesh import build_mesh
from tests.dist_harness import run_ranks


def _describe(layout: ParallelLayout, grid: list[list[int]] | None = None) -> dict[str, object]:
    mesh = build_mesh(layout, grid=grid)
    summed = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(summed, group=mesh.pp_group)
    return {
        "names": mesh.mesh.mesh_dim_names,
        "dp": (mesh.dp_index, dist.get_process_group_ranks(mesh.dp_group)),
        "pp": (mesh.pp_index, dist.get_process_group_ranks(mesh.pp_group)),
        "pp_sum": summed.item(),
        "owners": [mesh.stage_owner(s) for s in range(layout.pp)],
    }


def _two_rank_meshes(rank: int, world_size: int, tmp: Path) -> list[dict[str, object]]:
    return [_describe(ParallelLayout(1, 2)), _describe(ParallelLayout(2, 1))]


def _four_rank_meshes(rank: int, world_size: int, tmp: Path) -> list[dict[str, object]]:
    # Row-major through init_device_mesh, then an explicit grid through DeviceMesh.
    return [_describe(ParallelLayout(2, 2)), _describe(ParallelLayout(2, 2), grid=[[0, 2], [1, 3]])]


@pytest.mark.timeout(60)
def test_two_rank_pipeline_and_data_parallel_meshes(tmp_path: Path) -> None:
    pipeline, data = zip(*run_ranks(_two_rank_meshes, 2, tmp_path))
    assert [p["names"] for p in pipeline] == [("dp", "pp")] * 2
    assert [p["pp"] for p in pipeline] == [(0, [0, 1]), (1, [0, 1])]
    assert [p["dp"] for p in pipeline] == [(0, [0]), (0, [1])]
    assert [d["dp"] for d in data] == [(0, [0, 1]), (1, [0, 1])]
    assert [d["pp"] for d in data] == [(0, [0]), (0, [1])]
    assert pipeline[0]["pp_sum"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_four_rank_hybrid_mesh_groups(tmp_path: Path) -> None:
    row_major, explicit = zip(*run_ranks(_four_rank_meshes, 4, tmp_path))
    assert [r["pp"] for r in row_major] == [(0, [0, 1]), (1, [0, 1]), (0, [2, 3]), (1, [2, 3])]
    assert [r["dp"] for r in row_major] == [(0, [0, 2]), (0, [1, 3]), (1, [0, 2]), (1, [1, 3])]
    assert [r["pp_sum"] for r in row_major] == [1.0, 1.0, 5.0, 5.0]
    assert row_major[0]["owners"] == [0, 1]
    assert [e["pp"] for e in explicit] == [(0, [0, 2]), (0, [1, 3]), (1, [0, 2]), (1, [1, 3])]
    assert [e["dp"] for e in explicit] == [(0, [0, 1]), (1, [0, 1]), (0, [2, 3]), (1, [2, 3])]
    assert [e["pp_sum"] for e in explicit] == [2.0, 4.0, 2.0, 4.0]
    assert explicit[0]["owners"] == [0, 2]

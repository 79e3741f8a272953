"""Every benchmark's ``--quick`` path through ``kaisoku bench``: the record's schema, every goal present,
and the recorded results folder untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kaisoku.testing.cluster import unavailable_reason
from kaisoku.testing.sshfs import unavailable_reason as sshfs_unavailable_reason
from kaisoku_bench import BENCHMARKS, main
from kaisoku_bench.common import locate_mnist
from tests.bench.schema import RECORDED, check_record, fingerprint

#: Benchmarks whose quick run trains on MNIST and asserts on the rows it makes (the others record their MNIST
#: goals as unmet with the reason where the archive is missing, which tests/bench/test_machinery.py checks).
NEEDS_MNIST = {"largebatch"}

#: Benchmark -> every goal its summary must hold, whatever could or could not be measured.
GOALS: dict[str, set[str]] = {
    "engine": {"engine_step_time_vs_minimal_ddp", "engine_step_time_vs_minimal_ddp_image_folder"},
    "loader": {
        f"kaisoku_vs_{what}_{size}"
        for what in ("best_peer", "limit", "imagefolder_simplejpeg")
        for size in ("64px", "96px")
    }
    | {
        "index_open_s_10M",
        "index_private_bytes_per_record",
        "kaisoku_batch_vs_per_sample_64px-rrc",
        "gpu_decode_vs_host_64px-rrc",
        "loader_memory_per_worker_vs_per_sample_imagenet-like",
    },
    "slowfs": {
        "kaisoku_global_io_vs_tuned_perfile_1G_2msRTT_64px",
        "kaisoku_block_io_vs_tuned_perfile_1G_2msRTT_64px",
        "kaisoku_partial_io_vs_tuned_perfile_1G_2msRTT_64px",
        "kaisoku_io_vs_ceiling_min",
        "kaisoku_rereads_minus_evicted_undersized_cache",
        "kaisoku_vs_best_packed_peer",
    },
    "optim": {
        "lars_vs_fused_sgd_resnet50",
        "lars_cuda_kernels_per_step",
        "lars_vs_foreach_sgd_resnet50",
        "lars_speedup_vs_reference_small_tensors",
        "lars_top_level_calls",
        "lars_host_syncs",
    },
    "largebatch": {
        "recipe_gap_to_b0_best_at_16x",
        "recipe_gap_to_b0_best_at_64x",
        "recipe_minus_sgd_linear_at_64x",
        "wall_minutes",
    },
    "parallel": {"bubble_1f1b_worst_relative_gap", "switch_accuracy_gap_points", "switch_speedup_vs_dp"},
    "kfac": {
        "kfac_time_to_target_vs_best_mnist",
        "kfac_time_to_target_vs_best_resnet10_shapes",
        "kfac_time_to_target_vs_sgd",
        "kfac_step_time_vs_sgd",
    },
    "compile": {"auto_vs_eager_worst"},
    "checkpoint": {"checksum_share_of_save_file", "checksum_share_of_save_sharded"},
    "memory": {
        "recompute_and_in_backward_exact",
        "largest_batch_ratio_resnet18",
        "planner_peak_within_budget",
        "planner_60pct_slowdown",
        "planner_40pct_slowdown",
        "compression_val_accuracy_gap_points",
        "offload_rise_vs_plain_worst",
        "offload_slowdown_worst",
    },
    "plan": {
        "epoch_time_median_abs_error",
        "epoch_time_worst_abs_error",
        "recommendation_within_10pct_of_fastest",
    },
    "vit": {
        "val_accuracy",
        "seconds_to_60pct",
        "switch_val_accuracy",
        "switch_seconds_to_60pct",
        "switch_accuracy_gap_points",
        "bubble_1f1b_worst_relative_gap",
    },
    "cosmoflow": {
        "val_mae_32cubed",
        "wall_minutes",
        "zstd_ratio_vs_raw",
        "delta_ratio_vs_zstd",
        "lossy_mae_gap",
        "lossy_ratio",
        "loader_rate_vs_uncompressed_min",
    },
    "precision": {
        f"{prefix}_{label}"
        for label in ("mnist_small_cnn", "shapes_resnet10")
        for prefix in (
            "int8_stats_gap_points",
            "fp8_stats_gap_points",
            "int16_stats_gap_points",
            "int8_fixed_control_gap_points",
        )
    },
    "cluster": {
        "node_loss_to_training_s",
        "node_return_to_training_s",
        "weak_scaling_efficiency_4_hosts",
        "planner_unseen_median_abs_error",
        "planner_unseen_worst_abs_error",
        "planner_recommendation_vs_fastest_equal_quality",
    },
}


GOALS["throughput"] = {"kaisoku_step_time_vs_loop_with_loader", "kaisoku_images_per_s_vs_synthetic_loop"}

GOALS["shard"] = {
    "largest_params_full_vs_ddp_at_4_ranks",
    "step_time_vs_minimal_fully_shard",
    "sharded_save_vs_rank0_torch_save",
    "sharded_vs_ddp_weight_diff_over_tolerance",
    "lars_sharded_vs_unsharded_diff_over_tolerance",
}


def test_every_registered_benchmark_has_a_quick_test() -> None:
    assert set(GOALS) == set(BENCHMARKS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(GOALS))
def test_quick_run_records_every_goal_and_leaves_results_alone(name: str, tmp_path: Path) -> None:
    if name in NEEDS_MNIST and locate_mnist() is None:
        pytest.skip(
            f"bench {name} trains on MNIST: set KAISOKU_MNIST to an mnist.npz (see shared/data/README.md)"
        )
    before = fingerprint(RECORDED)
    assert main([name, "--quick", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / f"{name}.json").read_text())
    check_record(record, GOALS[name])
    if name == "cluster" and unavailable_reason() is None:
        assert record["rows"], record["summary"]  # where the box can be built, the loss was measured
    if name == "cluster" and unavailable_reason() is None and sshfs_unavailable_reason() is None:
        judged = record["summary"]["planner_recommendation_vs_fastest_equal_quality"]
        # --quick judges the recommendation once, on the scaling box (its storage host serves over sshfs):
        # every strategy measured and priced.
        assert judged["recommended"] in judged["strategies"] and judged["equal_quality_rule"]
        for entry in judged["strategies"].values():
            assert entry["measured_s"] > 0 and entry["predicted_s"] > 0 and 0 <= entry["quality"] <= 1
    if name == "largebatch":
        # The quick run takes every path of the full one, the ablation at the largest batch included.
        ablated = [row for row in record["rows"] if row.get("ablation")]
        assert len(ablated) == 4 and all(len(row["test_per_seed"]) == 1 for row in ablated)
        assert {row["batch"] for row in ablated} == {max(row["batch"] for row in record["rows"])}
    assert record["argv"] == [name, "--quick", "--out", str(tmp_path)]
    assert fingerprint(RECORDED) == before

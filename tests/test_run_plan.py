"""The run plan: every derived value, and every refusal of settings that span sections, with no process group.

Most cases build :class:`DataFacts` by hand and call the pure :func:`resolve`; the facts gatherers
(:func:`describe_data`, :func:`describe_model`) are tested on real folders, packed sets and modules.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from kaisoku.config import Config, apply_override
from kaisoku.data.loading.transforms import IMAGENET_MEAN, IMAGENET_STD
from kaisoku.data.shards.writer import pack
from kaisoku.errors import ConfigError
from kaisoku.facts import DataFacts, WorldShape
from kaisoku.parts import ModelSpec, UserParts
from kaisoku.run_facts import check_config, describe_data, describe_model, plan_run
from kaisoku.run_plan import resolve

IMAGES = DataFacts(
    source="packed", num_classes=10, num_samples=1000, has_val=True, root="/d", description="d"
)
VOLUMES = DataFacts(
    source="packed",
    task="regression",
    sample_shape=(4, 16, 16, 16),
    in_channels=4,
    num_classes=4,
    num_samples=64,
    description="volumes",
)


def _cfg(**overrides: object) -> Config:
    cfg = Config()
    for key, value in overrides.items():
        apply_override(cfg, key.replace("__", "."), value)
    return cfg


def _plan(cfg: Config, world: int | None = 2, data: DataFacts = IMAGES, parts: UserParts | None = None):  # noqa: ANN202
    shape = WorldShape(world, world) if world is not None else None
    return resolve(cfg, shape, data, describe_model(cfg, data, parts))


# ------------------------------------------------------------------------------------------------
# Derived values


def test_data_parallel_batches_shape_task_and_steps() -> None:
    plan = _plan(_cfg(data__global_batch=128, train__grad_accum=2), world=4)
    assert (plan.rank_batch, plan.micro_batch) == (32, 16)
    assert plan.sample_shape == (3, 24, 24)
    assert plan.memory_input_shape == (16, 3, 24, 24)
    assert (plan.task, plan.loss, plan.hybrid) == ("classification", "cross-entropy", False)
    assert plan.steps_per_epoch == 1000 // 128
    assert str(plan.schedule) == "dp4:0-"
    assert (plan.mean, plan.std) == (IMAGENET_MEAN, IMAGENET_STD)
    assert plan.model.spec == ModelSpec(
        sample_shape=(3, 24, 24), num_classes=10, in_channels=3, task="classification"
    )


def test_hybrid_batches_come_from_replicas_and_microbatches() -> None:
    plan = _plan(_cfg(data__global_batch=64, parallel__pp=2, parallel__microbatches=4), world=4)
    assert plan.hybrid
    assert (plan.rank_batch, plan.micro_batch) == (32, 8)  # 2 replicas of a 2-stage pipeline
    assert str(plan.schedule) == "dp2xpp2:0-"
    assert (plan.mesh_shape, plan.mesh_description) == ((2,), "dp=2")  # not one replica per rank


def test_volumes_regression_mse_and_no_normalisation() -> None:
    plan = _plan(_cfg(model__name="cosmoflow", data__global_batch=8), world=2, data=VOLUMES)
    assert (plan.task, plan.loss) == ("regression", "mse")
    assert plan.sample_shape == (4, 16, 16, 16)
    assert (plan.mean, plan.std) == ((), ())
    assert plan.steps_per_epoch == 8


def test_one_channel_images_normalise_by_half() -> None:
    data = DataFacts(source="packed", in_channels=1, num_classes=10, num_samples=100, description="d")
    plan = _plan(_cfg(model__name="small-cnn", data__global_batch=10), data=data)
    assert (plan.mean, plan.std) == ((0.5,), (0.25,))
    assert plan.sample_shape == (1, 24, 24)


def test_precision_paths() -> None:
    assert _plan(_cfg()).precision_path == "fp32"
    assert _plan(_cfg(precision__mode="bf16")).precision_path == "autocast"
    assert _plan(_cfg(precision__mode="int8-stats")).precision_path == "stats"


def test_shuffle_and_cache_settings_and_nodes() -> None:
    cfg = _cfg(data__shuffle="partial", data__exchange=0.25, data__ram_capacity="1MiB")
    plan = resolve(cfg, WorldShape(4, 2), IMAGES, describe_model(cfg, IMAGES))
    assert plan.shuffle.name == "partial" and plan.shuffle.num_nodes == 2 and plan.shuffle.exchange == 0.25
    assert plan.cache.enabled and plan.cache.ram_capacity == 1 << 20
    assert plan.world.num_nodes == 2


def test_data_read_sample_by_sample_takes_the_unpacked_global_order() -> None:
    folder = DataFacts(source="folder", num_classes=3, root="/f", description="f")
    assert _plan(_cfg(), data=folder).shuffle.unpacked
    assert not _plan(_cfg()).shuffle.unpacked  # packed data keeps its own stream's order


def test_training_shard_and_validation_batch_of_each_rank() -> None:
    plan = _plan(_cfg(data__global_batch=64), world=4)
    assert [plan.train_shard(rank) for rank in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert plan.val_batch == 16
    hybrid = _plan(_cfg(data__global_batch=64, parallel__pp=2), world=4)
    # Both stages of a pipeline read their replica's order; validation still shards over all 4 ranks.
    assert [hybrid.train_shard(rank) for rank in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert hybrid.val_batch == 16


def test_steps_unknown_until_an_image_folder_is_opened() -> None:
    data = DataFacts(source="folder", num_classes=3, root="/f", description="f")
    plan = _plan(_cfg(), data=data)
    assert plan.steps_per_epoch is None
    assert plan.total_steps(10) == (60, 60)  # 6 epochs of 10 steps


def test_total_steps_span_the_epochs_and_max_steps_only_stops_early() -> None:
    plan = _plan(_cfg(train__epochs=1.5, train__max_steps=4))
    assert plan.total_steps(7) == (11, 4)
    assert _plan(_cfg(train__epochs=0.01)).total_steps(10) == (1, 1)  # at least one step


def test_plan_without_a_world_checks_what_it_can() -> None:
    plan = _plan(_cfg(), world=None)
    assert plan.schedule is None and plan.rank_batch == 128


def test_user_dataset_facts_and_plan() -> None:
    x = torch.randint(0, 100, (40, 12))
    y = torch.randint(0, 5, (40,))
    parts = UserParts(model=nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(96, 5)))
    parts.train_data = TensorDataset(x, y)
    cfg = _cfg(data__global_batch=8)
    plan = plan_run(cfg, 2, parts)
    assert plan.data.source == "user" and plan.data.num_samples == 40 and not plan.data.has_val
    assert plan.sample_shape == (12,) and plan.task == "classification"
    assert (plan.mean, plan.std) == ((), ())
    assert plan.steps_per_epoch == 5 and plan.model.block_count == 3
    regression = UserParts(
        model=parts.model, train_data=TensorDataset(torch.randn(16, 3), torch.randn(16, 2))
    )
    plan = plan_run(cfg, 2, regression)
    assert (plan.task, plan.loss, plan.model.spec.num_classes) == ("regression", "mse", 2)


def test_user_loss_by_import_path_is_the_users() -> None:
    assert _plan(_cfg(train__loss="torch.nn:L1Loss")).loss == "user"


def test_model_facts_blocks_and_layers() -> None:
    cfg = _cfg(model__name="vit-tiny", data__image_size=32)
    facts = describe_model(cfg, IMAGES)
    assert facts.block_count == 8
    assert "heads.head" in facts.layer_names
    assert describe_model(_cfg(), IMAGES).block_count == 6


def test_describe_data_reads_a_packed_index_and_a_folder(tmp_path: Path) -> None:
    x = np.random.default_rng(0).integers(0, 256, (40, 8, 8), dtype=np.uint8)
    y = np.arange(40) % 4
    np.savez(tmp_path / "set.npz", x_train=x, y_train=y, x_val=x[:8], y_val=y[:8])
    pack(tmp_path / "set.npz", tmp_path / "packed")
    facts = describe_data(_cfg(data__path=str(tmp_path / "packed")))
    assert (facts.source, facts.num_samples, facts.num_classes, facts.in_channels) == ("packed", 40, 4, 1)
    assert facts.has_val
    folder = tmp_path / "folder"
    for name in ("a", "b", "c"):
        (folder / name).mkdir(parents=True)
    facts = describe_data(_cfg(data__path=str(folder)))
    assert (facts.source, facts.num_classes, facts.num_samples) == ("folder", 3, 0)


# ------------------------------------------------------------------------------------------------
# Refusals before launch


@pytest.mark.parametrize(
    ("overrides", "world", "data", "message"),
    [
        ({"model__name": "nosuch"}, 2, IMAGES, "unknown model 'nosuch'"),
        ({"model__name": "cosmoflow"}, 2, IMAGES, "takes volumes"),
        ({}, 2, VOLUMES, "2D image classifier"),
        ({"model__name": "cosmoflow", "train__loss": "cross-entropy"}, 2, VOLUMES, "does not fit"),
        ({"train__loss": "mse"}, 2, IMAGES, "does not fit"),
        ({"model__name": "cosmoflow", "train__label_smoothing": 0.1}, 2, VOLUMES, "is for classification"),
        ({"model__name": "vit-tiny", "data__image_size": 30}, 2, IMAGES, "not a multiple of its patch"),
        ({"data__global_batch": 100}, 3, IMAGES, "not a multiple of the world size 3"),
        ({"data__global_batch": 96, "train__grad_accum": 5}, 2, IMAGES, "does not divide the 48 samples"),
        ({"parallel__pp": 3}, 4, IMAGES, "parallel"),
        ({"parallel__pp": 8, "parallel__microbatches": 8}, 8, IMAGES, "only 6 blocks"),
        ({"parallel__pp": 2, "train__grad_accum": 2}, 2, IMAGES, "use parallel.microbatches"),
        ({"parallel__pp": 2, "optim__kfac__enabled": True}, 2, IMAGES, "K-FAC runs on data parallelism"),
        ({"parallel__pp": 2, "precision__mode": "int8-stats"}, 2, IMAGES, "use bf16 or fp32"),
        ({"parallel__pp": 2, "data__shuffle": "partial"}, 2, IMAGES, "use global or block"),
        ({"parallel__pp": 2, "data__ram_capacity": "1MiB"}, 2, IMAGES, "node cache"),
        ({"parallel__pp": 2, "memory__recompute": "selective"}, 2, IMAGES, "memory.recompute"),
        ({"parallel__pp": 2, "train__compile": "model"}, 2, IMAGES, "pipeline stages"),
        ({"optim__kfac__enabled": True, "train__compile": "model"}, 2, IMAGES, "K-FAC reads layer inputs"),
        ({"memory__update_in_backward": True, "optim__kfac__enabled": True}, 2, IMAGES, "update_in_backward"),
        ({"memory__recompute": "blocks", "memory__blocks": "0-9"}, 2, IMAGES, "memory.blocks"),
        ({"memory__budget": "1GiB", "memory__recompute": "selective"}, 2, IMAGES, "leave memory.recompute"),
        (
            {"memory__compress": "bf16", "memory__offload": "disk", "memory__offload_dir": "/tmp"},
            2,
            IMAGES,
            "pick one",
        ),
        ({"precision__mode": "fp16", "train__device": "cpu"}, 2, IMAGES, "fp16"),
        ({"precision__mode": "int8-stats", "memory__recompute": "selective"}, 2, IMAGES, "moved exponent"),
        ({"precision__mode": "int8-stats", "train__compile": "model"}, 2, IMAGES, "Python state"),
        ({"precision__mode": "int8-stats", "precision__keep": "nosuch"}, 2, IMAGES, "no Conv2d/Linear layer"),
        ({"data__global_batch": 2000}, 2, IMAGES, "fewer than one global batch"),
    ],
)
def test_cross_section_refusals(overrides: dict, world: int, data: DataFacts, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _plan(_cfg(**overrides), world=world, data=data)


def test_block_and_node_shuffles_need_a_packed_dataset() -> None:
    folder = DataFacts(source="folder", num_classes=3, root="/f", description="f")
    with pytest.raises(ConfigError, match="kaisoku pack /f DST"):
        _plan(_cfg(data__shuffle="block"), data=folder)


def test_a_classifier_needs_a_class_count() -> None:
    data = DataFacts(source="folder", num_classes=0, root="/f", description="data.path /f")
    with pytest.raises(ConfigError, match="set model.num_classes"):
        _plan(_cfg(), data=data)


def test_pipeline_refuses_a_model_without_blocks_in_one_line() -> None:
    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)

    parts = UserParts(
        model=Opaque(), train_data=TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    )
    with pytest.raises(ConfigError, match="parallel.pp 2 needs the model's ordered blocks.*ordered_blocks"):
        plan_run(_cfg(data__global_batch=8, parallel__pp=2), 2, parts)
    assert plan_run(_cfg(data__global_batch=8), 2, parts).model.block_count is None  # fine without pp


def test_missing_data_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        check_config(_cfg(data__path=str(tmp_path / "nothing")), 2)


def test_validation_cadence_needs_a_validation_set() -> None:
    parts = UserParts(
        model=nn.Linear(4, 2), train_data=TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    )
    with pytest.raises(ConfigError, match="validation set"):
        plan_run(_cfg(data__global_batch=8, train__val_every=2), 2, parts)

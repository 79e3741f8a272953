"""The engine on real 2-rank gloo groups: training, validation, exact stop-and-resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from tests.dist_harness import run_ranks
from tests.train_harness import tiny_config


def _config(data: Path, run_dir: Path, **overrides: object) -> Config:
    engine_settings: dict[str, object] = {
        "model__name": "resnet10",
        "model__stem": "imagenet",  # the cheapest stem: 16 px inputs reach layer1 at 4 x 4
        "train__log_every": 2,
        "sched__warmup_epochs": 0.5,
        "optim__lr": 0.05,  # tiny 16 px batches: the demo's 0.2 can diverge in bf16
    }
    return tiny_config(data, run_dir, **{**engine_settings, **overrides})


def _train(
    rank: int,
    world_size: int,
    tmp: Path,
    data: Path,
    run_dir: Path,
    max_steps: int,
    resume: str,
    overrides: dict,
) -> dict:
    cfg = _config(data, run_dir, **overrides)
    cfg.train.max_steps = max_steps
    trainer = build_trainer(
        cfg, World(rank=rank, world_size=world_size, local_world_size=world_size), resume=resume
    )
    summary = trainer.fit()
    trainer.metrics.close()
    return {"summary": summary, "model": {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}}


def _parameters(state: dict) -> dict:
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=80, size=20, val_count=20, workers=1)


@pytest.mark.timeout(240)
def test_stop_and_resume_equals_uninterrupted_run(tmp_path: Path, tiny_data: Path) -> None:
    # 80 samples / global batch 16 = 5 steps per epoch, 10 in all; stop at 3, resume to 10.
    straight = run_ranks(_train, 2, tmp_path / "a", tiny_data, tmp_path / "run-a", 0, "", {})
    run_ranks(
        _train, 2, tmp_path / "b1", tiny_data, tmp_path / "run-b", 3, "", {"checkpoint__every_steps": 3}
    )
    resumed = run_ranks(_train, 2, tmp_path / "b2", tiny_data, tmp_path / "run-b", 0, "auto", {})
    assert straight[0]["summary"]["steps"] == resumed[0]["summary"]["steps"] == 10
    for key, value in straight[0]["model"].items():
        assert torch.equal(value, resumed[0]["model"][key]), key
    # Both ranks hold the same weights after DDP (BN running statistics are rank 0's, broadcast at
    # each forward, so they are compared only where they are saved: rank 0).
    for key, value in _parameters(straight[0]["model"]).items():
        assert torch.equal(value, straight[1]["model"][key]), key
    metrics = (tmp_path / "run-a" / "metrics.jsonl").read_text().splitlines()
    assert any('"val_accuracy"' in line for line in metrics)
    assert any('"data_wait_fraction"' in line and '"peak_memory_mib"' in line for line in metrics)


@pytest.mark.timeout(240)
def test_grad_accumulation_and_bf16_run(tmp_path: Path, tiny_data: Path) -> None:
    results = run_ranks(
        _train,
        2,
        tmp_path / "c",
        tiny_data,
        tmp_path / "run-c",
        4,
        "",
        {
            "train__grad_accum": 2,
            "precision__mode": "bf16",
            "dist__compress": "bf16",
            "data__global_batch": 32,
            # resnet10 at 16 px (1x1 maps in layer4, 8-sample micro-batches): the configuration whose bf16
            # BatchNorm statistics went NaN now and then; normalization now runs in float32 under bf16.
            "model__name": "resnet10",
        },
    )
    summary = results[0]["summary"]
    assert summary["steps"] == 4  # 80 samples / 32 = 2 steps per epoch, 2 epochs
    assert 0.0 <= summary["val_accuracy"] <= 1.0
    assert torch.isfinite(torch.tensor(summary["final_loss"]))
    for key, value in _parameters(results[0]["model"]).items():
        assert torch.equal(value, results[1]["model"][key]), key


@pytest.fixture(scope="module")
def tiny_packed(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kaisoku.data.shards.writer import pack

    dst = tmp_path_factory.mktemp("packed") / "shapes"
    pack(tiny_data, dst, shard_bytes=4096, progress=False)
    return dst


def _train_packed(rank: int, world_size: int, tmp: Path, data: Path, run_dir: Path, overrides: dict) -> dict:
    cfg = _config(data, run_dir, **overrides)
    cfg.data.ram_dir = str(tmp / "shm")
    # Two "nodes" of one rank each, with their own cache folders.
    world = World(rank=rank, world_size=world_size, local_world_size=1, node=rank, num_nodes=world_size)
    trainer = build_trainer(cfg, world)
    summary = trainer.fit()
    trainer.metrics.close()
    stats = trainer.train_data.stats()
    trainer.train_data.close()
    return {"summary": summary, "stats": stats}


@pytest.mark.timeout(240)
def test_packed_partial_shuffle_with_exchange_and_ram_cache(tmp_path: Path, tiny_packed: Path) -> None:
    overrides = {
        "data__shuffle": "partial",
        "data__exchange": 0.5,
        "data__ram_capacity": "64MiB",
        "data__workers": 1,
    }
    results = run_ranks(_train_packed, 2, tmp_path, tiny_packed, tmp_path / "run", overrides)
    assert results[0]["summary"]["steps"] == 10
    assert 0.0 <= results[0]["summary"]["val_accuracy"] <= 1.0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any('"shuffle_quality"' in line for line in lines)


@pytest.mark.timeout(240)
def test_lars_arccot_kfac_run_checkpoints_preconditioner(tmp_path: Path, tiny_data: Path) -> None:
    overrides = {
        "optim__name": "lars",
        "sched__name": "arccot",
        "train__label_smoothing": 0.1,
        "optim__kfac__enabled": True,
        "optim__kfac__inv_update_steps": 2,
        "model__name": "small-cnn",  # small factors: a ResNet's 4608-wide conv factors take seconds to decompose
    }
    results = run_ranks(_train, 2, tmp_path / "k", tiny_data, tmp_path / "run-k", 3, "", overrides)
    assert results[0]["summary"]["steps"] == 3
    for value in results[0]["model"].values():
        assert torch.isfinite(value.float()).all()
    state = torch.load(tmp_path / "run-k" / "checkpoints" / "step-00000003.pt", weights_only=True)
    assert state["preconditioner"]["steps"] == 3
    assert state["preconditioner"]["layers"]

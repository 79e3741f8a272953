"""Vision transformers on pipeline stages and across a switch, on 2 real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.distributed.layout import ParallelLayout
from kaisoku.distributed.mesh import build_mesh
from kaisoku.distributed.pipeline import HybridOptions, HybridParallel
from kaisoku.distributed.switch import switch_layout
from kaisoku.engine.build import build_trainer
from kaisoku.models.vit import build_vit
from tests.dist_harness import run_ranks
from tests.distributed.test_pipeline import batches, reference_training, sgd, slice_replica
from tests.distributed.test_switch import assert_full_states_equal, saved
from tests.train_harness import tiny_config

STEPS_PER_EPOCH = 5  # 80 samples / global batch 16


def tiny_vit() -> nn.Module:
    """vit-tiny cut to 2 layers of width 32 on 1-channel 16 px images, its head initialised non-zero."""
    torch.manual_seed(0)
    model = build_vit("vit-tiny", num_classes=4, image_size=16, in_channels=1, layers=2, width=32, heads=2)
    nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


def _hybrid(layout: ParallelLayout) -> HybridParallel:
    return HybridParallel(
        tiny_vit(),
        build_mesh(layout),
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=sgd,
        options=HybridOptions(microbatches=2, schedule="1f1b"),
    )


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches([8, 8, 8, 8], shape=(1, 16, 16))


def _split_and_switch(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    data = _data()
    hybrid = _hybrid(ParallelLayout(1, 2))
    stage_params = [name for name, _ in hybrid.named_parameters]
    step = lambda h, x, y: h.train_step(*slice_replica(x, y, h.dp_index, h.dp_size))  # noqa: E731
    losses = [step(hybrid, *batch) for batch in data[:2]]
    before = hybrid.full_state_dict()
    record = saved(before)  # what a checkpoint written here keeps
    hybrid = switch_layout(hybrid, ParallelLayout(2, 1))
    after = hybrid.full_state_dict()
    losses += [step(hybrid, *batch) for batch in data[2:]]
    # A fresh dp=2 run with other weights loads the checkpoint taken under pp=2.
    resumed = _hybrid(ParallelLayout(2, 1))
    for p in resumed.model.parameters():
        nn.init.normal_(p)
    resumed.load_full_state_dict(record)
    loaded = resumed.full_state_dict()
    return {
        "stage_params": stage_params,
        "losses": losses,
        "before": before,
        "after": after,
        "loaded": loaded,
        "resumed_losses": [step(resumed, *batch) for batch in data[2:]],
    }


@pytest.mark.timeout(120)
def test_vit_splits_between_encoder_layers_and_switches_to_data_parallel(tmp_path: Path) -> None:
    first, second = run_ranks(_split_and_switch, 2, tmp_path)
    # 4 blocks (embedding, 2 encoder layers, norm + head) balanced by parameters: 2 a stage, so the
    # class token and position embedding sit on stage 0 with the first encoder layer.
    assert {"class_token", "encoder.pos_embedding", "conv_proj.weight"} <= set(first["stage_params"])
    assert any(n.startswith("encoder.layers.encoder_layer_0.") for n in first["stage_params"])
    assert not any(n.startswith("encoder.layers.encoder_layer_0.") for n in second["stage_params"])
    assert {"encoder.ln.weight", "heads.head.weight"} <= set(second["stage_params"])
    assert any(n.startswith("encoder.layers.encoder_layer_1.") for n in second["stage_params"])
    for result in (first, second):
        assert result["before"]["layout"] == "pp2" and result["after"]["layout"] == "dp2"
        assert_full_states_equal(result["after"], result["before"])  # identical weights after the switch
        assert_full_states_equal(result["loaded"], result["before"])  # layout-independent checkpoint
    # No BatchNorm: every layout computes the whole batch's gradient, so the run is the one-process run.
    expected, _ = reference_training(tiny_vit(), _data(), dp=1, microbatches=2)
    assert first["losses"] == pytest.approx(expected, rel=1e-5)
    assert second["resumed_losses"] == pytest.approx(expected[2:], rel=1e-5)
    assert first["losses"] == second["losses"]


def _train(rank: int, world_size: int, tmp: Path, data: Path, run_dir: Path) -> dict[str, Any]:
    cfg = tiny_config(
        data,
        run_dir,
        model__name="vit-tiny",
        optim__name="adamw",
        optim__lr=1e-3,
        optim__weight_decay=0.05,
        train__label_smoothing=0.1,
        train__log_every=1,
        train__epochs=1,
        parallel__switch="pp2:0-2,dp2:2-",
        parallel__switch_unit="step",
        parallel__microbatches=2,
    )
    trainer = build_trainer(cfg, World(rank=rank, world_size=world_size, local_world_size=world_size))
    initial = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    summary = trainer.fit()
    trainer.metrics.close()
    return {"summary": summary, "initial": initial, "model": trainer.unwrapped.state_dict()}


@pytest.mark.timeout(180)
def test_kaisoku_train_switches_vit_tiny_from_pipeline_to_data_parallel(tmp_path: Path) -> None:
    data = generate(tmp_path / "shapes", count=80, size=20, val_count=20, workers=1)
    run_dir = tmp_path / "run"
    first, second = run_ranks(_train, 2, tmp_path, data, run_dir)
    assert first["summary"]["steps"] == STEPS_PER_EPOCH
    assert torch.isfinite(torch.tensor(first["summary"]["final_loss"]))
    assert 0.0 <= first["summary"]["val_accuracy"] <= 1.0
    for name, value in first["model"].items():
        assert torch.equal(second["model"][name], value), name
    assert not torch.equal(first["model"]["encoder.pos_embedding"], first["initial"]["encoder.pos_embedding"])
    assert first["model"]["conv_proj.weight"].shape == (192, 3, 4, 4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    switches = [(row["step"], row["layout"]) for row in rows if row.get("event") == "switch"]
    assert switches == [(2, "dp2")]
    final = torch.load(run_dir / "checkpoints" / f"step-{STEPS_PER_EPOCH:08d}.pt", weights_only=True)
    assert final["layout"] == "dp2"
    for name, value in first["model"].items():
        assert torch.equal(final["model"][name], value), name

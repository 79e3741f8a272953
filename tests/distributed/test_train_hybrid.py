"""Hybrid data x pipeline parallelism and switch-parallel from the trainer (``parallel.*``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.distributed.named_state import named_from_torch_optimizer_state, named_optimizer_state
from kaisoku.distributed.sharded_checkpoint import read_whole
from kaisoku.engine.build import build_trainer
from kaisoku.engine.step import continue_schedule
from kaisoku.errors import ConfigError
from kaisoku.models.blocks import state_names
from kaisoku.optim.factory import build_optimizer, build_optimizer_from_named, build_scheduler, warmup_steps
from kaisoku.optim.schedules import schedule_factor
from kaisoku.run_facts import check_config
from tests.dist_harness import run_ranks
from tests.train_harness import kaisoku_in_process, tiny_config

# 80 samples / global batch 16 = 5 steps per epoch.
STEPS_PER_EPOCH = 5


def _config(data: Path | str, run_dir: Path | str, **overrides: object) -> Config:
    hybrid_settings: dict[str, object] = {
        "train__log_every": 1,
        "sched__warmup_epochs": 0.5,
        "optim__lr": 0.05,  # fixed here, whatever the default: a few steps that stay finite
        "parallel__microbatches": 2,
    }
    return tiny_config(data, run_dir, **{**hybrid_settings, **overrides})


def _train(
    rank: int,
    world_size: int,
    tmp: Path,
    data: Path,
    run_dir: Path,
    max_steps: int,
    resume: str,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    cfg = _config(data, run_dir, **overrides)
    cfg.train.max_steps = max_steps
    trainer = build_trainer(
        cfg, World(rank=rank, world_size=world_size, local_world_size=world_size), resume=resume
    )
    loaded = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    # Sharded stages' optimizers hold copies' parameters, which the model's names do not cover.
    sharded = overrides.get("parallel__shard", "none") != "none"
    optimizer = None if sharded else named_optimizer_state(trainer.optimizer, state_names(trainer.unwrapped))
    lr = trainer.optimizer.param_groups[0]["lr"]
    summary = trainer.fit()
    trainer.metrics.close()
    return {
        "summary": summary,
        "loaded": loaded,
        "loaded_optimizer": optimizer,
        "loaded_lr": lr,
        "model": {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()},
        "data_shard": (trainer.train_data.sampler.rank, trainer.train_data.sampler.world_size),
    }


def _train_stages(
    rank: int, world_size: int, tmp: Path, data: Path, run_dir: Path, overrides: dict[str, Any]
) -> dict[str, Any]:
    """3 steps of a run whose stages hold their own (sharded) copies: its summary and the gathered model."""
    cfg = _config(data, run_dir, **overrides)
    cfg.train.max_steps = 3
    trainer = build_trainer(cfg, World(rank=rank, world_size=world_size, local_world_size=world_size))
    initial = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    summary = trainer.fit()
    trainer.metrics.close()
    model = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    return {"summary": summary, "initial": initial, "model": model}


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoint(run_dir: Path, step: int) -> dict[str, Any]:
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}.pt", weights_only=True)


def _expected_lr(cfg: Config, step: int) -> float:
    total = round(cfg.train.epochs * STEPS_PER_EPOCH)
    factor = schedule_factor(
        cfg.sched.name, total_steps=total, warmup_steps=warmup_steps(cfg.sched, STEPS_PER_EPOCH)
    )
    return cfg.optim.lr * factor(step)


def assert_states_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=80, size=20, val_count=20, workers=1)


# ------------------------------------------------------------------------------------------------
# Multi-rank runs through build_trainer.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline_run(
    tiny_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[dict[str, Any]], Path]:
    """3 steps of a 2-stage pipeline on 2 ranks (shared by the tests below): each rank's result, the run dir."""
    tmp = tmp_path_factory.mktemp("pp2")
    ranks = run_ranks(_train, 2, tmp, tiny_data, tmp / "run", 3, "", {"parallel__pp": 2})
    return ranks, tmp / "run"


@pytest.mark.timeout(180)
def test_pipeline_of_two_stages_trains_from_the_trainer(
    pipeline_run: tuple[list[dict[str, Any]], Path],
) -> None:
    (first, second), run_dir = pipeline_run
    assert first["summary"]["steps"] == 3
    assert torch.isfinite(torch.tensor(first["summary"]["final_loss"]))
    assert 0.0 <= first["summary"]["val_accuracy"] <= 1.0
    # Gathered from the two stages, every rank holds the same whole model, and it has trained.
    assert_states_equal(second["model"], first["model"])
    assert not torch.equal(first["model"]["head.2.weight"], first["loaded"]["head.2.weight"])
    assert not torch.equal(first["model"]["features.0.0.weight"], first["loaded"]["features.0.0.weight"])
    # Both stages read the one replica's whole batch; each rank's optimizer covers its own stage only.
    assert first["data_shard"] == second["data_shard"] == (0, 1)
    assert "features.0.0.weight" in first["loaded_optimizer"]["param_groups"][0]["params"]
    assert all(
        "features.0" not in name for g in second["loaded_optimizer"]["param_groups"] for name in g["params"]
    )
    saved = _checkpoint(run_dir, 3)
    assert saved["layout"] == "pp2"
    assert_states_equal(saved["model"], first["model"])
    start = next(row for row in _metrics(run_dir) if row.get("event") == "start")
    assert start["parallel"] == "pp2:0-"


SWITCH = {"parallel__switch": "pp2:0-1,dp2:1-"}


@pytest.fixture(scope="module")
def switch_run(
    tiny_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[dict[str, Any]], Path]:
    """2 epochs on 2 ranks switching from pp2 to dp2 after the first (shared by the tests below)."""
    tmp = tmp_path_factory.mktemp("switch")
    return run_ranks(_train, 2, tmp, tiny_data, tmp / "run", 0, "", SWITCH), tmp / "run"


@pytest.mark.timeout(180)
def test_switch_from_pipeline_to_data_parallel_mid_run(
    tmp_path: Path, tiny_data: Path, switch_run: tuple[list[dict[str, Any]], Path]
) -> None:
    (first, second), run_dir = switch_run
    overrides = SWITCH
    assert first["summary"]["steps"] == 2 * STEPS_PER_EPOCH
    assert torch.isfinite(torch.tensor(first["summary"]["final_loss"]))
    assert_states_equal(second["model"], first["model"])
    rows = _metrics(run_dir)
    switches = [row for row in rows if row.get("event") == "switch"]
    assert [(row["step"], row["layout"]) for row in switches] == [(STEPS_PER_EPOCH, "dp2")]
    # After the switch the data follows the dp axis: two replicas, one shard each.
    assert (first["data_shard"], second["data_shard"]) == ((0, 2), (1, 2))
    # The learning-rate schedule runs on across the switch, step by step.
    cfg = _config(tiny_data, run_dir, **overrides)
    logged = {row["step"]: row["lr"] for row in rows if "lr" in row}
    assert sorted(logged) == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    for step, lr in logged.items():
        assert lr == pytest.approx(_expected_lr(cfg, step), rel=1e-12), step
    # The end-of-epoch checkpoint was gathered under the pipeline, the last under data parallelism.
    assert _checkpoint(run_dir, STEPS_PER_EPOCH)["layout"] == "pp2"
    final = _checkpoint(run_dir, 2 * STEPS_PER_EPOCH)
    assert final["layout"] == "dp2"
    assert_states_equal(final["model"], first["model"])
    # Resumed from the checkpoint taken just before the switch, a run switches and ends the same.
    before_switch = str(run_dir / "checkpoints" / f"step-{STEPS_PER_EPOCH:08d}.pt")
    resumed_dir = tmp_path / "resumed"
    resumed = run_ranks(_train, 2, tmp_path / "r", tiny_data, resumed_dir, 0, before_switch, overrides)
    assert [row["layout"] for row in _metrics(resumed_dir) if row.get("event") == "switch"] == ["dp2"]
    assert_states_equal(resumed[0]["model"], first["model"])


@pytest.mark.timeout(240)
def test_sharded_switch_from_pipeline_to_data_parallel_resumes_after_it(
    tmp_path: Path, tiny_data: Path, switch_run: tuple[list[dict[str, Any]], Path]
) -> None:
    """The same switch with parallel.shard full: pp2 stages sharded over their (single) replica, then dp2 as one
    stage of every block sharded over both ranks. Stopped 2 steps after the switch, it writes a folder of
    shards that a run resumes from, switching back to dp2 and ending where the unsharded run ends."""
    (reference, _), _ = switch_run
    sharded = {**SWITCH, "parallel__shard": "full"}
    stop = STEPS_PER_EPOCH + 2
    run_dir = tmp_path / "run"
    first, second = run_ranks(_train, 2, tmp_path / "a", tiny_data, run_dir, stop, "", sharded)
    assert first["summary"]["steps"] == stop
    assert_states_equal(second["model"], first["model"])
    assert [row["layout"] for row in _metrics(run_dir) if row.get("event") == "switch"] == ["dp2"]
    assert (first["data_shard"], second["data_shard"]) == ((0, 2), (1, 2))
    folder = run_dir / "checkpoints" / f"step-{stop:08d}"  # written under dp2: a folder of shards
    assert folder.is_dir()
    assert read_whole(folder, tmp_path / "whole.pt")["model"].keys() == first["model"].keys()
    resumed_dir = tmp_path / "resumed"
    resumed = run_ranks(_train, 2, tmp_path / "b", tiny_data, resumed_dir, 0, str(folder), sharded)
    assert [row["layout"] for row in _metrics(resumed_dir) if row.get("event") == "switch"] == ["dp2"]
    assert resumed[0]["summary"]["steps"] == 2 * STEPS_PER_EPOCH
    assert_states_equal(resumed[1]["model"], resumed[0]["model"])
    # Reduce-scattered shards train as the whole-gradient all-reduce does, within fp32 noise.
    for name, value in reference["model"].items():
        torch.testing.assert_close(resumed[0]["model"][name], value, rtol=0, atol=1e-5, msg=name)
    assert any(not torch.equal(v, first["model"][k]) for k, v in resumed[0]["model"].items())


@pytest.mark.timeout(240)
def test_checkpoints_move_between_pipeline_and_data_parallel_runs(
    tmp_path: Path, tiny_data: Path, pipeline_run: tuple[list[dict[str, Any]], Path]
) -> None:
    _, pipeline_dir = pipeline_run
    ddp_dir, back_dir = tmp_path / "dp2", tmp_path / "back"
    saved = _checkpoint(pipeline_dir, 3)
    # A pp=2 checkpoint resumes in a plain data-parallel (DDP) run.
    resumed = run_ranks(
        _train,
        2,
        tmp_path / "b",
        tiny_data,
        ddp_dir,
        5,
        str(pipeline_dir / "checkpoints" / "step-00000003.pt"),
        {"parallel__dp": 2},
    )
    cfg = _config(tiny_data, ddp_dir)
    for result in resumed:
        assert_states_equal(result["loaded"], saved["model"])
        assert result["loaded_lr"] == pytest.approx(_expected_lr(cfg, 3), rel=1e-12)
        assert result["summary"]["steps"] == 5
    momentum = resumed[0]["loaded_optimizer"]["state"]
    assert sorted(momentum) == sorted(saved["optimizer"]["state"])
    for name, state in saved["optimizer"]["state"].items():
        assert torch.equal(momentum[name]["momentum_buffer"], state["momentum_buffer"]), name
    assert "layout" not in _checkpoint(ddp_dir, 5)
    # And the DDP checkpoint goes back into a pipeline run.
    ddp_saved = _checkpoint(ddp_dir, 5)
    back = run_ranks(
        _train,
        2,
        tmp_path / "c",
        tiny_data,
        back_dir,
        6,
        str(ddp_dir / "checkpoints" / "step-00000005.pt"),
        {"parallel__pp": 2},
    )
    for result in back:
        assert_states_equal(result["loaded"], ddp_saved["model"])
        assert result["summary"]["steps"] == 6
        assert result["loaded_lr"] == pytest.approx(_expected_lr(cfg, 5), rel=1e-12)
    assert_states_equal(back[1]["model"], back[0]["model"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_pipeline_stages_write_their_shards_that_resume_on_data_parallel(
    tmp_path: Path, tiny_data: Path
) -> None:
    """pp 2 x shard 2 through build_trainer: every rank writes its own stage's shards into a checkpoint folder
    (keyed by the whole model's names), which a plain 2-rank data-parallel run resumes."""
    run_dir = tmp_path / "ppshard"
    sharded = run_ranks(
        _train_stages, 4, tmp_path / "a", tiny_data, run_dir, {"parallel__pp": 2, "parallel__shard": "full"}
    )
    assert all(result["summary"]["steps"] == 3 for result in sharded)
    for result in sharded[1:]:
        assert_states_equal(result["model"], sharded[0]["model"])  # every rank gathers the same model
    folder = run_dir / "checkpoints" / "step-00000003"  # a folder of shards, not one file
    written = read_whole(folder, tmp_path / "whole.pt")["model"]
    assert written.keys() == sharded[0]["model"].keys()
    saved = {name: written[name] for name in sharded[0]["model"]}
    assert_states_equal(saved, sharded[0]["model"])
    # The stages trained: the same 3 steps unsharded (pp 2 x dp 2) end at the same weights within fp32 noise.
    whole = run_ranks(_train_stages, 4, tmp_path / "w", tiny_data, tmp_path / "pp2dp2", {"parallel__pp": 2})
    for name, value in whole[0]["model"].items():
        torch.testing.assert_close(sharded[0]["model"][name], value, rtol=0, atol=1e-5, msg=name)
    assert any(not torch.equal(v, sharded[0]["initial"][k]) for k, v in sharded[0]["model"].items())
    resumed = run_ranks(
        _train, 2, tmp_path / "b", tiny_data, tmp_path / "dp2", 4, str(folder), {"parallel__dp": 2}
    )
    for result in resumed:
        assert_states_equal(result["loaded"], saved)
        assert result["summary"]["steps"] == 4


# ------------------------------------------------------------------------------------------------
# Bad input, before anything starts.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parallel.switch": "pp2:0-1,dp2:2-"}, "should start where the previous ended, at 1"),
        ({"parallel.switch": "dp2xqq2:0-1,dp2:1-"}, "cannot read parallel layout 'dp2xqq2'"),
        ({"parallel.pp": 2, "parallel.dp": 2, "dist.nproc": 2}, r"dp 2 x pp 2 = 4 but the world has 2 ranks"),
        ({"parallel.dp": 3, "dist.nproc": 2}, r"dp 3 x pp 1 = 3 but the world has 2 ranks"),
        (
            {"parallel.pp": 2, "parallel.microbatches": 3, "dist.nproc": 2},
            "replica batch of 16 samples .* does not split into parallel.microbatches 3",
        ),
        (
            {"parallel.switch": "dp2xpp2:0-1,dp4:1-", "data.global_batch": 12, "parallel.microbatches": 4},
            "replica batch of 6 samples .* make data.global_batch a multiple of 8",
        ),
        (
            {"parallel.pp": 8, "parallel.microbatches": 8},
            r"needs 8 pipeline stages \(pp 8 x parallel.virtual_stages 1\) but the model has only 4 blocks",
        ),
        (
            {"parallel.pp": 2, "optim.kfac.enabled": True},
            "parallel.pp 2 does not work with optim.kfac.enabled",
        ),
        ({"parallel.pp": 2, "train.grad_accum": 2}, "does not work with train.grad_accum 2"),
        ({"parallel.pp": 2, "parallel.virtual_stages": 2}, "needs parallel.schedule 'interleaved-1f1b'"),
    ],
)
def test_bad_parallel_settings_fail_validation(overrides: dict[str, object], message: str) -> None:
    cfg = _config("", "runs/x", **{key.replace(".", "__"): value for key, value in overrides.items()})
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, cfg.dist.nproc or None)  # the world kaisoku would launch


def test_defaults_and_plain_dp_stay_valid() -> None:
    cfg = _config("", "runs/x")
    assert not cfg.parallel.hybrid
    check_config(cfg)
    cfg.parallel.dp = 2
    check_config(cfg)
    cfg.parallel.switch = "pp2:0-1,dp2:1-"
    assert cfg.parallel.hybrid
    check_config(cfg)


@pytest.mark.timeout(120)
def test_cli_reports_a_layout_that_does_not_fill_the_world_in_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    args = ["--nproc", "2", "--parallel.pp", "2", "--parallel.dp", "2", "--run-dir", str(tmp_path / "run")]
    result = kaisoku_in_process(capfd, "train", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "dp 2 x pp 2 = 4 but the world has 2 ranks" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before the ranks were launched


# ------------------------------------------------------------------------------------------------
# Pure pieces: the schedule across optimizers, named optimizer state.
# ------------------------------------------------------------------------------------------------


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_schedule_continues_on_a_new_optimizer() -> None:
    cfg = _config("", "runs/x")
    cfg.sched.name = "arccot"
    make = {"cfg": cfg.sched, "steps_per_epoch": 4, "total_steps": 20}
    model = _net()
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, **make)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    # Another layout's optimizer (one stage's parameters, with the saved state) continues at step 7.
    stage = build_optimizer_from_named(list(model.named_parameters())[2:], cfg.optim)
    named = named_from_torch_optimizer_state(optimizer.state_dict())
    from kaisoku.distributed.pipeline import load_named_optimizer_state

    load_named_optimizer_state(stage, named, state_names(model))
    follower = build_scheduler(stage, **make)
    continue_schedule(follower, 7)
    assert follower.last_epoch == scheduler.last_epoch == 7
    assert [g["lr"] for g in stage.param_groups] == pytest.approx([optimizer.param_groups[0]["lr"]] * 2)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
        stage.step()
        follower.step()
        assert stage.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12)


def test_torch_optimizer_state_becomes_named() -> None:
    model = _net()
    optimizer = build_optimizer(model, Config().optim)
    model(torch.randn(4, 4)).sum().backward()
    optimizer.step()
    named = named_from_torch_optimizer_state(optimizer.state_dict())
    reference = named_optimizer_state(optimizer, state_names(model))
    assert (
        sorted(named["state"]) == sorted(reference["state"]) == sorted(n for n, _ in model.named_parameters())
    )
    for name, state in reference["state"].items():
        assert torch.equal(named["state"][name]["momentum_buffer"], state["momentum_buffer"]), name
    assert [g["params"] for g in named["param_groups"]] == [
        ["0.weight", "2.weight"],
        ["0.bias", "1.weight", "1.bias", "2.bias"],
    ]
    assert all("param_names" not in g for g in named["param_groups"])

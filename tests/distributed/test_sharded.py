"""Sharded data parallelism (FSDP2 per block) on real 2-rank gloo groups: it trains through the trainer, it
matches DDP, LARS/LAMB on shards match unsharded, sharded checkpoints move between layouts, and ``kaisoku
ckpt convert`` turns them into one file (and back) that resumes bit-identically; ``checkpoint.async_save`` writes
the same checkpoint while training goes on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kaisoku.cli import main
from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.distributed.sharded_checkpoint import read_whole, sharded_state
from kaisoku.engine.build import build_trainer
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.engine.hybrid import HybridStep
from kaisoku.engine.trainer import Trainer
from tests.dist_harness import run_ranks
from tests.train_harness import tiny_config

#: Sharded vs DDP weights after a few fp32 steps: the reduce-scatter averages in another order than DDP's
#: all-reduce (pre- and post-division), so equal up to fp32 rounding carried through a few steps.
WEIGHT_ATOL = 1e-5


def _config(data: Path, run_dir: Path, **overrides: object) -> Config:
    settings: dict[str, object] = {
        "model__name": "resnet10",
        "model__stem": "imagenet",
        "train__log_every": 2,
        "sched__warmup_epochs": 0.5,
        "optim__lr": 0.05,
        "metrics__progress": False,
    }
    return tiny_config(data, run_dir, **{**settings, **overrides})


def _build(
    rank: int, world_size: int, data: Path, run_dir: Path, max_steps: int, resume: str, overrides: dict
) -> Trainer:
    cfg = _config(data, run_dir, **overrides)
    cfg.train.max_steps = max_steps
    return build_trainer(
        cfg, World(rank=rank, world_size=world_size, local_world_size=world_size), resume=resume
    )


def _whole_state(trainer: Trainer) -> dict:
    """The weights and the optimizer state (by parameter name) as whole tensors, on every rank, whatever the
    engine (a collective)."""
    if isinstance(trainer.engine, HybridStep):
        full = trainer.engine.parallel.full_state_dict()
        return {"model": full["model"], "optimizer": full["optimizer"]["state"]}
    model_state, optimizer_state = sharded_state(trainer.unwrapped, trainer.optimizer)

    def whole(value: object) -> object:
        return value.full_tensor().clone() if hasattr(value, "full_tensor") else value

    return {
        "model": {k: whole(v) for k, v in model_state.items()},
        "optimizer": {k: {n: whole(t) for n, t in v.items()} for k, v in optimizer_state["state"].items()},
    }


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
    trainer = _build(rank, world_size, data, run_dir, max_steps, resume, overrides)
    summary = trainer.fit()
    trainer.metrics.close()
    return {"summary": summary, **_whole_state(trainer), "kind": type(trainer.engine).__name__}


def _parameters(state: dict) -> dict:
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=20, val_count=16, workers=1)


def _close(a: dict, b: dict, atol: float) -> None:
    """Parameters and optimizer state of two runs equal within ``atol`` (0: bitwise)."""
    for key, value in _parameters(a["model"]).items():
        torch.testing.assert_close(b["model"][key], value, rtol=0, atol=atol, msg=key)
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for key, slots in a["optimizer"].items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(b["optimizer"][key][slot], value, rtol=0, atol=atol, msg=key)


STEPS = {"train__epochs": 1}  # 64 samples / 16 = 4 steps
SHARD = {**STEPS, "parallel__shard": "full"}


@pytest.fixture(scope="module")
def straight(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Uninterrupted 4-step runs: DDP on 2 ranks and full sharding on 2 ranks."""
    tmp = tmp_path_factory.mktemp("straight")
    ddp = run_ranks(_train, 2, tmp / "a", tiny_data, tmp / "run-a", 0, "", STEPS, timeout=240)
    sharded = run_ranks(_train, 2, tmp / "b", tiny_data, tmp / "run-b", 0, "", SHARD, timeout=240)
    return {"ddp": ddp[0], "shard": sharded[0], "shard_dir": tmp / "run-b"}


@pytest.mark.timeout(600)
def test_full_shard_matches_ddp(straight: dict[str, dict]) -> None:
    ddp, sharded = straight["ddp"], straight["shard"]
    assert sharded["kind"] == "ShardedStep" and ddp["kind"] == "DataParallelStep"
    assert sharded["summary"]["steps"] == ddp["summary"]["steps"] == 4
    _close(ddp, sharded, WEIGHT_ATOL)
    # Every rank wrote its own shard file into the final checkpoint folder, which lists their checksums.
    folder = straight["shard_dir"] / "checkpoints" / "step-00000004"
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "checksums.json",
        "trainer.pt",
    ]


@pytest.mark.timeout(300)
def test_grad_level_adamw_accumulation_matches_ddp(tmp_path: Path, tiny_data: Path) -> None:
    settings = {**STEPS, "optim__name": "adamw", "optim__lr": 1e-3, "train__grad_accum": 2}
    ddp = run_ranks(_train, 2, tmp_path / "a", tiny_data, tmp_path / "run-a", 0, "", settings, timeout=240)
    sharded = run_ranks(
        _train, 2, tmp_path / "b", tiny_data, tmp_path / "run-b", 0, "",
        {**settings, "parallel__shard": "grad"}, timeout=240,
    )  # fmt: skip
    _close(ddp[0], sharded[0], WEIGHT_ATOL)


@pytest.mark.timeout(300)
def test_bf16_sharded_run_trains(tmp_path: Path, tiny_data: Path) -> None:
    settings = {**SHARD, "precision__mode": "bf16", "optim__name": "lamb", "optim__lr": 1e-3}
    result = run_ranks(_train, 2, tmp_path / "a", tiny_data, tmp_path / "run", 0, "", settings, timeout=240)
    summary = result[0]["summary"]
    assert summary["steps"] == 4 and torch.isfinite(torch.tensor(summary["final_loss"]))
    # Weights stay fp32 between steps (bf16 only in the gathered copies).
    assert all(v.dtype == torch.float32 for k, v in _parameters(result[0]["model"]).items())


@pytest.fixture(scope="module")
def shard_at_two(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A fully sharded 2-rank run stopped at step 2 with its checkpoint (copy the run before resuming it)."""
    tmp = tmp_path_factory.mktemp("shard-at-two")
    first = {**SHARD, "checkpoint__every_steps": 2}
    at_two = run_ranks(_train, 2, tmp / "s", tiny_data, tmp / "run", 2, "", first, timeout=240)
    return {
        "state": at_two[0],
        "run": tmp / "run",
        "checkpoint": tmp / "run" / "checkpoints" / "step-00000002",
    }


@pytest.fixture(scope="module")
def ddp_from_shards(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory, shard_at_two: dict) -> dict:
    """The step-2 sharded checkpoint resumed on DDP (2 ranks) to step 4."""
    tmp = tmp_path_factory.mktemp("ddp-from-shards")
    resume = str(shard_at_two["checkpoint"])
    return run_ranks(_train, 2, tmp / "d", tiny_data, tmp / "run", 0, resume, STEPS, timeout=240)[0]


@pytest.fixture(scope="module")
def ddp_at_two(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single-file DDP checkpoint at step 2 (2 ranks)."""
    tmp = tmp_path_factory.mktemp("ddp-at-two")
    settings = {**STEPS, "checkpoint__every_steps": 2}
    run_ranks(_train, 2, tmp / "p", tiny_data, tmp / "run", 2, "", settings, timeout=240)
    checkpoints = tmp / "run" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step-00000002.pt"]
    return checkpoints / "step-00000002.pt"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_moves_between_layouts(
    tmp_path: Path,
    tiny_data: Path,
    straight: dict[str, dict],
    shard_at_two: dict,
    ddp_from_shards: dict,
    ddp_at_two: Path,
) -> None:
    # Sharded checkpoint at step 2 -> resumed sharded (bitwise), on DDP 2 ranks and on 1 rank.
    assert [p.name for p in shard_at_two["checkpoint"].parent.iterdir()] == ["step-00000002"]
    for name in ("run-s", "run-one"):
        shutil.copytree(shard_at_two["run"], tmp_path / name)
    same = run_ranks(_train, 2, tmp_path / "s2", tiny_data, tmp_path / "run-s", 0, "auto", SHARD, timeout=240)
    _close(straight["shard"], same[0], 0.0)
    assert ddp_from_shards["kind"] == "DataParallelStep"
    _close(straight["ddp"], ddp_from_shards, WEIGHT_ATOL)
    # One rank reads the shards whole: the step-2 weights and optimizer state exactly.
    # (Training on from there differs from 2 ranks: BatchNorm statistics are per rank's batch.)
    on_one = run_ranks(
        _train, 1, tmp_path / "o", tiny_data, tmp_path / "run-one", 2, "auto", STEPS, timeout=240
    )
    _close(shard_at_two["state"], on_one[0], 0.0)
    # A single-file DDP checkpoint at step 2 -> resumed fully sharded.
    onto_shards = run_ranks(
        _train, 2, tmp_path / "p2", tiny_data, tmp_path / "run-p", 0, str(ddp_at_two), SHARD, timeout=240
    )
    assert onto_shards[0]["kind"] == "ShardedStep"
    _close(straight["ddp"], onto_shards[0], WEIGHT_ATOL)


def _convert(source: Path, destination: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kaisoku", "ckpt", "convert", str(source), str(destination)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.timeout(600)
def test_convert_sharded_to_one_file_and_back(
    tmp_path: Path,
    tiny_data: Path,
    straight: dict[str, dict],
    shard_at_two: dict,
    ddp_from_shards: dict,
) -> None:
    single = tmp_path / "one" / "step-00000002.pt"
    done = _convert(shard_at_two["checkpoint"], single)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote single-file checkpoint {single} (step 2)") and not done.stderr
    assert sorted(p.name for p in single.parent.iterdir()) == [single.name]  # no scratch or temp file left
    # The file on 1 rank: the step-2 weights and optimizer state exactly; on DDP (2 ranks) to step 4: bitwise
    # what resuming the folder itself gives.
    on_one = run_ranks(
        _train, 1, tmp_path / "o", tiny_data, tmp_path / "run-one", 2, str(single), STEPS, timeout=240
    )
    _close(shard_at_two["state"], on_one[0], 0.0)
    on_ddp = run_ranks(
        _train, 2, tmp_path / "d", tiny_data, tmp_path / "run-dp", 0, str(single), STEPS, timeout=240
    )
    assert on_ddp[0]["kind"] == "DataParallelStep" and on_ddp[0]["summary"]["steps"] == 4
    _close(ddp_from_shards, on_ddp[0], 0.0)

    # Back into a folder (one shard): resumed fully sharded on 2 ranks, bitwise the uninterrupted run.
    folder = tmp_path / "back" / "step-00000002"
    done = _convert(single, folder)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "checksums.json",
        "trainer.pt",
    ]
    sharded = run_ranks(
        _train, 2, tmp_path / "s", tiny_data, tmp_path / "run-s", 0, str(folder), SHARD, timeout=240
    )
    assert sharded[0]["kind"] == "ShardedStep"
    _close(straight["shard"], sharded[0], 0.0)


def _same(a: object, b: object) -> bool:
    """Nested checkpoint state equal, tensors bitwise (dtype included)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.timeout(120)
def test_convert_round_trip_is_exact(tmp_path: Path, ddp_at_two: Path) -> None:
    """A DDP single file -> folder -> file holds exactly what it held (no process group, one process)."""
    folder, back = tmp_path / "step-00000002", tmp_path / "step-00000002.pt"
    assert main_exit(["ckpt", "convert", str(ddp_at_two), str(folder)]) == 0
    assert main_exit(["ckpt", "convert", str(folder), str(back)]) == 0
    original, returned = (CheckpointManager.load(p) for p in (ddp_at_two, back))
    assert _same(original, returned)
    assert CheckpointManager.load(folder)["step"] == 2


def main_exit(argv: list[str]) -> int:
    """``kaisoku ARGV`` in this process; its exit code."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return int(exited.value.code or 0)


@pytest.mark.timeout(120)
def test_convert_refuses_bad_sources(
    tmp_path: Path, shard_at_two: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    incomplete = tmp_path / "incomplete"  # what a writer killed before the metadata leaves
    shutil.copytree(shard_at_two["checkpoint"], incomplete)
    (incomplete / ".metadata").unlink()
    damaged = tmp_path / "damaged"
    shutil.copytree(shard_at_two["checkpoint"], damaged)
    with open(damaged / "__1_0.distcp", "r+b") as handle:
        handle.truncate(1000)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    (tmp_path / "empty").mkdir()
    cases = {  # damaged data exits 3, a path that is no checkpoint at all 2
        tmp_path / "missing": ("does not exist", 2),
        tmp_path / "empty": ("is not a kaisoku checkpoint", 2),
        incomplete: ("is incomplete (no .metadata)", 3),
        damaged: ("is corrupt or unreadable (its shard file __1_0.distcp is cut short: 1000 of ", 3),
        junk: ("is corrupt or unreadable", 3),
    }
    for source, (expected, code) in cases.items():
        destination = tmp_path / "out" / f"{source.name}.pt"
        assert main_exit(["ckpt", "convert", str(source), str(destination)]) == code
        err = capsys.readouterr().err
        assert err.startswith("kaisoku: error: kaisoku ckpt convert: ") and expected in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert not destination.exists()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    # An existing destination is never overwritten.
    assert main_exit(["ckpt", "convert", str(shard_at_two["checkpoint"]), str(junk)]) == 2
    assert "exists; remove it" in capsys.readouterr().err and junk.read_bytes() == b"not a checkpoint"


@pytest.mark.timeout(600)
def test_async_save_writes_the_same_checkpoint_and_resumes(
    tmp_path: Path, tiny_data: Path, straight: dict[str, dict], shard_at_two: dict
) -> None:
    background = {**SHARD, "checkpoint__every_steps": 2, "checkpoint__async_save": True}
    run = tmp_path / "run"
    result = run_ranks(_train, 2, tmp_path / "a", tiny_data, run, 0, "", background, timeout=240)
    _close(straight["shard"], result[0], 0.0)  # writing in the background does not touch training
    checkpoints = run / "checkpoints"
    # Both folders were renamed into place (the last one before the run ended); no temp folder is left.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000004"]
    # The step-2 checkpoint holds what a synchronous save wrote, though training went on while it was written.
    written, expected = (
        read_whole(folder, tmp_path / f"{name}.whole")
        for name, folder in (("async", checkpoints / "step-00000002"), ("sync", shard_at_two["checkpoint"]))
    )
    assert _same(expected, written)
    trainer, trainer_sync = (
        CheckpointManager.load(folder)
        for folder in (checkpoints / "step-00000002", shard_at_two["checkpoint"])
    )
    assert (
        trainer["config"]["checkpoint"]["async_save"]
        and not trainer_sync["config"]["checkpoint"]["async_save"]
    )
    for state in (trainer, trainer_sync):
        del state["config"], state["sharded_dir"]
    assert _same(trainer_sync, trainer)
    # Resumed from it (saving in the background again): bitwise the uninterrupted run.
    shutil.rmtree(checkpoints / "step-00000004")
    resumed = run_ranks(_train, 2, tmp_path / "r", tiny_data, run, 0, "auto", background, timeout=240)
    assert resumed[0]["summary"]["steps"] == 4
    _close(straight["shard"], resumed[0], 0.0)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000004"]

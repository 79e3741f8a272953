"""Validation and start-up never wait out the run's whole collective timeout: a collective a rank never comes
to is cut by ``dist.short_timeout`` with a line naming the phase, and a sharded model validates on every rank
alike when the validation set does not divide by the world (a rank short of batches runs spare forwards)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from tests.dist_harness import run_ranks
from tests.train_harness import tiny_config


def _rank_in_a_short_phase(rank: int, tmp: str) -> None:
    """Rank 0 all-reduces under a 2-second short timeout: on a background group, where rank 1 comes 4 s late
    (exempt: it waits), then on the training group, where rank 1 never comes; it writes what it raised (and
    how the run's failure line reads) to a file. No final barrier: the group is broken."""
    import torch.distributed as dist

    from kaisoku.distributed import env
    from kaisoku.engine.failures import classify

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    done = Path(tmp) / "rank0-done"
    background = env.background_group()  # a background save's group: exempt from the short timeout
    if rank == 1:
        time.sleep(4)  # twice the short timeout late, on the background group only
        dist.all_reduce(torch.ones(1), group=background)
        while not done.exists():
            time.sleep(0.1)
        os._exit(0)
    try:
        with env.collective_timeout(2, 120, "validation at step 3"):
            late = torch.ones(1)
            dist.all_reduce(late, group=background)
            env.all_reduce_sum([1.0], torch.device("cpu"))
        text = "no error"
    except env.CollectiveTimeout as error:
        text = f"{error}\n{classify(error).cause}\nbackground sum {late.item():g}"
    (Path(tmp) / "rank0.txt").write_text(text)
    done.touch()
    os._exit(0)


@pytest.mark.timeout(120)
def test_a_collective_a_rank_never_comes_to_is_cut_by_the_short_timeout_naming_the_phase(
    tmp_path: Path,
) -> None:
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_rank_in_a_short_phase, args=(rank, str(tmp_path))) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(90)
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        proc.kill()
    assert not alive, "a rank still waits: the short timeout did not cut the collective"
    raised, cause, background = (tmp_path / "rank0.txt").read_text().splitlines()
    assert raised == "validation at step 3: Timed out after 2 s waiting for another rank (dist.short_timeout)"
    assert cause.startswith("lost contact with another rank (validation at step 3: Timed out after 2 s")
    assert background == "background sum 2"  # waited 4 s for rank 1 there: the short timeout left it alone


def _validate_sharded(rank: int, world_size: int, tmp: Path, data: Path) -> dict[str, float]:
    cfg = tiny_config(
        data, tmp / "run", parallel__shard="full", train__max_steps=2, dist__short_timeout=20,
        checkpoint__every_steps=0,
    )  # fmt: skip
    trainer = build_trainer(cfg, World(rank=rank, world_size=world_size, local_world_size=world_size))
    batches = len(trainer.val_loader or ())
    summary = trainer.fit()
    trainer.metrics.close()
    return {"batches": batches, "val_samples": summary["val_samples"], "val_loss": summary["val_loss"]}


@pytest.mark.timeout(240)
def test_a_sharded_model_validates_a_set_that_does_not_divide_by_the_world(tmp_path: Path) -> None:
    """17 validation images over 2 ranks at 8 a batch: rank 0 has 2 batches, rank 1 one. A sharded forward
    gathers weights with every rank, so rank 1 runs a spare forward (before, rank 0 waited for it forever)."""
    data = generate(tmp_path / "shapes", count=32, size=20, val_count=17, workers=1)
    results = run_ranks(_validate_sharded, 2, tmp_path, data, timeout=200)
    assert [r["batches"] for r in results] == [2, 1]
    assert [r["val_samples"] for r in results] == [
        17,
        17,
    ]  # every image once: the spare forward counts nothing
    assert results[0]["val_loss"] == results[1]["val_loss"]

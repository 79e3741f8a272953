"""memory.budget under data parallelism: every rank applies rank 0's plan, even when its own profile differs.

Two real gloo ranks build and train through ``kaisoku train``'s builder. A test seam makes each rank's
profile prefer a different technique (keep made too big for the budget; rank 0 finds recompute cheapest,
rank 1 compression), so rank 1 alone would choose another plan: it must apply rank 0's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kaisoku.data.datagen import generate
from kaisoku.engine.compile import synthetic_batch
from kaisoku.memory.profile import Profile
from tests.dist_harness import run_ranks
from tests.train_harness import metric_lines, tiny_config

BUDGET = "1GiB"
_SEEN: list = []  # the profile this rank planned from (in the rank's process)


def _prefer(name: str) -> Callable[[Profile], Profile]:
    """A profile adjustment: keep never fits the budget, ``name`` costs nothing, the others 1 s."""
    from kaisoku.memory.planner import Option

    def adjust(profile: Profile) -> Profile:
        blocks = []
        for block in profile.blocks:
            options = {
                key: Option(
                    held_bytes=1 << 42 if key == "keep" else option.held_bytes,
                    added_s=0.0 if key in ("keep", name) else 1.0,
                    transient_bytes=option.transient_bytes,
                )
                for key, option in block.options.items()
            }
            blocks.append(dataclasses.replace(block, options=options))
        _SEEN.append(dataclasses.replace(profile, blocks=blocks))
        return _SEEN[-1]

    return adjust


def _applied(model: torch.nn.Module) -> tuple[str, ...]:
    """The technique each ordered block actually runs with (read off the installed forward)."""
    from kaisoku.memory.checkpointing import CheckpointedBlock, HookedBlock

    cells = [cell.cell_contents for cell in model.forward.__func__.__closure__ or ()]
    runners = next(c for c in cells if isinstance(c, list))
    out = []
    for runner in runners:
        if isinstance(runner, CheckpointedBlock):
            out.append("recompute")
        elif isinstance(runner, HookedBlock):
            out.append("int8" if runner.saving.__self__.mode == "int8" else "compress")
        else:
            out.append("keep")
    return tuple(out)


def _too_small_on_rank_zero(rank: int) -> str:
    """Only rank 0's budget is too small: every rank raises rank 0's one-line error (no rank hangs)."""
    from kaisoku.config_sections import MemoryConfig
    from kaisoku.distributed.env import rank_zero_value
    from kaisoku.errors import ConfigError
    from kaisoku.memory.profile import setup_memory

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    memory = MemoryConfig(budget="1B" if rank == 0 else "1GiB")
    with pytest.raises(ConfigError) as info:
        setup_memory(
            model,
            memory,
            device=torch.device("cpu"),
            example=lambda: synthetic_batch((4, 8), 2, torch.device("cpu"), seed=0),
            agree=rank_zero_value,
        )
    return str(info.value)


def _train(rank: int, world_size: int, tmp: Path, data: Path, run_dir: Path) -> dict:
    from kaisoku.distributed.env import World
    from kaisoku.engine.build import build_trainer
    from kaisoku.memory import profile as profile_module
    from kaisoku.memory.planner import choose

    error = _too_small_on_rank_zero(rank)
    profile_module._adjust_profile = _prefer("recompute" if rank == 0 else "int8")
    cfg = tiny_config(data, run_dir, memory__budget=BUDGET, train__max_steps=2, train__epochs=1)
    trainer = build_trainer(cfg, World(rank=rank, world_size=world_size, local_world_size=world_size))
    applied = _applied(trainer.unwrapped)
    trainer.fit()
    trainer.metrics.close()
    # What this rank would have chosen from its own (adjusted) profile, with no agreement.
    (seen,) = _SEEN
    own = choose(seen.blocks, fixed=seen.fixed, budget=1 << 30, headroom=0.1).techniques
    return {
        "error": error,
        "applied": applied,
        "own": own,
        "model": {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()},
    }


@pytest.mark.timeout(120)
def test_every_rank_applies_rank_zeros_plan(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    data = generate(tmp_path / "shapes", count=32, size=16, val_count=16, workers=1)
    ranks = run_ranks(_train, 2, tmp_path, data, tmp_path / "run")
    zero, one = ranks
    assert "memory.budget" in zero["error"] and "is too small" in zero["error"], zero["error"]
    assert "\n" not in zero["error"]
    assert one["error"] == zero["error"]
    assert set(zero["applied"]) == {"recompute"}, zero["applied"]
    # Rank 1 on its own would compress some block (the test can fail); it applies rank 0's plan.
    assert one["own"] != zero["applied"] and zero["own"] == zero["applied"], (one["own"], zero["own"])
    assert one["applied"] == zero["applied"]
    # Training results: the same weights on both ranks (BatchNorm's running statistics are each rank's own).
    weights = [k for k in zero["model"] if "running_" not in k and "num_batches" not in k]
    assert weights
    for key in weights:
        assert torch.equal(zero["model"][key], one["model"][key]), key
    events = [r for r in metric_lines(tmp_path / "run") if r.get("event") == "memory_plan"]
    assert len(events) == 1 and events[0]["shared_by_ranks"] == 2
    assert tuple(events[0]["techniques"]) == zero["applied"]

"""memory.* from config: validation refuses what update-in-backward excludes; kaisoku train's engine uses it."""

from __future__ import annotations

import pytest

from kaisoku.config import Config
from kaisoku.errors import ConfigError
from kaisoku.run_facts import check_config


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (lambda c: setattr(c.train, "grad_accum", 2), "train.grad_accum > 1"),
        (lambda c: setattr(c.optim.kfac, "enabled", True), "optim.kfac"),
        (lambda c: setattr(c.parallel, "pp", 2), "hybrid parallelism"),
        (lambda c: setattr(c.precision, "mode", "fp16"), "precision.mode fp16"),
        (lambda c: setattr(c.train, "on_nonfinite", "skip"), "train.on_nonfinite skip"),
        (lambda c: setattr(c.optim, "name", "adamw"), "optim.name adamw"),
    ],
)
def test_update_in_backward_refuses_exclusions(override, needle: str) -> None:
    cfg = Config()
    cfg.memory.update_in_backward = True
    check_config(cfg)  # the defaults are fine
    override(cfg)
    with pytest.raises(ConfigError, match="memory.update_in_backward cannot be combined with") as info:
        check_config(cfg)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_recompute_refused_under_pipeline() -> None:
    cfg = Config()
    cfg.memory.recompute = "blocks"
    cfg.parallel.pp = 2
    with pytest.raises(
        ConfigError, match="parallel.pp 2 does not work with memory.recompute / memory.compress"
    ):
        check_config(cfg)


def _trained(data, run_dir, **memory: object):
    import torch

    from kaisoku.config import apply_override
    from kaisoku.distributed.env import World
    from kaisoku.engine.build import build_trainer

    cfg = Config(run_dir=str(run_dir))
    cfg.data.path = str(data)
    cfg.data.image_size = 16
    cfg.data.global_batch = 8
    cfg.data.workers = 0
    cfg.model.name = "resnet10"
    cfg.model.stem = "small"
    cfg.optim.name = "lars"
    cfg.train.max_steps = 3
    cfg.train.epochs = 1
    cfg.metrics.progress = False
    for key, value in memory.items():
        apply_override(cfg, f"memory.{key}", value)
    check_config(cfg, 1)
    trainer = build_trainer(cfg, World())
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):  # exact on a GPU too
        summary = trainer.fit()
    trainer.metrics.close()
    return trainer.engine.model.state_dict(), summary


@pytest.mark.timeout(300)
def test_train_with_memory_settings_matches_plain(tmp_path) -> None:
    """The objects ``kaisoku train`` builds: recompute + update-in-backward give the plain run's weights."""
    import torch

    from kaisoku.data.datagen import generate

    data = generate(tmp_path / "shapes", count=64, size=16, val_count=16, workers=1)
    plain, _ = _trained(data, tmp_path / "plain")
    memory, _ = _trained(data, tmp_path / "mem", recompute="selective", update_in_backward=True)
    assert plain.keys() == memory.keys()
    for key in plain:
        assert torch.equal(plain[key], memory[key]), key
    # bf16 saved activations: not exact, close after 3 steps.
    compressed, _ = _trained(data, tmp_path / "bf16", compress="bf16")
    diffs = [float((plain[k].float() - compressed[k].float()).abs().max()) for k in plain]
    assert 0 < max(diffs) < 1e-2


def test_block_list_checked_before_training() -> None:
    cfg = Config()
    cfg.model.name = "resnet18"
    cfg.memory.recompute = "blocks"
    cfg.memory.blocks = "1-40"
    with pytest.raises(ConfigError, match=r"memory.blocks: '1-40' is outside the model's blocks 0-9"):
        check_config(cfg)


@pytest.mark.timeout(300)
def test_budget_plan_is_logged_and_a_too_small_budget_refused(tmp_path) -> None:
    """memory.budget through the objects ``kaisoku train`` builds: the plan lands in metrics.jsonl."""
    import json

    from kaisoku.data.datagen import generate

    data = generate(tmp_path / "shapes", count=32, size=16, val_count=16, workers=1)
    _, summary = _trained(
        data, tmp_path / "plan", budget="0.9", policy="0:recompute", offload_dir=str(tmp_path)
    )
    lines = [json.loads(line) for line in (tmp_path / "plan" / "metrics.jsonl").read_text().splitlines()]
    plans = [line for line in lines if line.get("event") == "memory_plan"]
    assert len(plans) == 1 and plans[0]["techniques"][0] == "recompute"
    assert plans[0]["predicted_peak_bytes"] <= plans[0]["budget_bytes"]
    steps = [line for line in lines if "peak_memory_mib" in line and "step" in line]
    assert steps and all(line["peak_memory_mib"] > 0 for line in steps)
    with pytest.raises(ConfigError, match=r"needs at least .* with its least-memory plan") as info:
        _trained(data, tmp_path / "small", budget="1KiB")
    assert "\n" not in str(info.value)


def test_policy_naming_a_missing_block_lists_the_blocks() -> None:
    cfg = Config()
    cfg.model.name = "resnet18"
    cfg.memory.policy = "0-2:recompute,12:compress"
    with pytest.raises(
        ConfigError, match=r"memory.policy: block '12' does not exist; the model's blocks are 0-9"
    ):
        check_config(cfg)
    cfg.memory.policy = ""
    cfg.memory.offload = "disk"
    cfg.memory.offload_dir = "/nonexistent/kaisoku"
    with pytest.raises(ConfigError, match="memory.offload_dir /nonexistent/kaisoku does not exist"):
        check_config(cfg)

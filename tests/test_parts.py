"""The user's parts named by import path (:mod:`kaisoku.parts`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kaisoku.errors import ConfigError
from kaisoku.parts import load_object


def test_import_path_finds_a_module_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As under ``python -m kaisoku``, also from the ``kaisoku`` console script (whose sys.path lacks the
    working directory)."""
    (tmp_path / "kaisoku_parts_here.py").write_text("def factory() -> int:\n    return 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.delitem(sys.modules, "kaisoku_parts_here", raising=False)
    assert load_object("kaisoku_parts_here:factory", "model.name")() == 7
    assert sys.path[-1] == os.getcwd()  # after everything installed: shadows nothing


def test_import_path_of_a_missing_module_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="^model.name: cannot import kaisoku_no_such_module "):
        load_object("kaisoku_no_such_module:net", "model.name")


def test_a_float64_dataset_of_scalar_targets_trains_a_float32_regressor(tmp_path: Path) -> None:
    """numpy float64 inputs and scalar float targets (a common user dataset): the batch is float32 and the
    loss compares [B, 1] outputs with [B] targets element by element, not broadcast to [B, B]."""
    import numpy as np
    import torch
    from torch import nn

    from kaisoku.config import Config
    from kaisoku.distributed.env import World
    from kaisoku.engine.build import build_trainer
    from kaisoku.engine.tasks import mse_to_outputs
    from kaisoku.parts import UserParts

    class Points(torch.utils.data.Dataset):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.x = rng.normal(size=(64, 3))
            self.y = self.x @ np.array([1.0, -2.0, 0.5])

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[np.ndarray, np.float64]:
            return self.x[i], self.y[i]

    outputs, targets = torch.zeros(4, 1), torch.arange(4.0, dtype=torch.float64)
    assert float(mse_to_outputs(outputs, targets)) == pytest.approx(float((torch.arange(4.0) ** 2).mean()))
    cfg = Config(run_dir=str(tmp_path / "run"))
    cfg.data.global_batch, cfg.data.workers, cfg.train.epochs, cfg.optim.lr = 16, 0, 3, 0.05
    cfg.metrics.progress = False
    torch.manual_seed(0)
    trainer = build_trainer(cfg, World(), parts=UserParts(model=nn.Linear(3, 1), train_data=Points()))
    assert trainer.settings.task == "regression"
    summary = trainer.fit()
    trainer.metrics.close()
    assert summary["steps"] == 12 and summary["final_loss"] < 1.0


def test_a_model_factory_that_needs_real_tensors_is_planned(tmp_path: Path) -> None:
    """A factory that reads a tensor's value cannot be built on the meta device; the plan builds it for real."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from kaisoku.config import Config
    from kaisoku.parts import UserParts
    from kaisoku.run_facts import plan_run

    def factory(spec: object) -> nn.Module:
        scale = torch.ones(1).sum().item()  # fails on the meta device
        return nn.Sequential(nn.Linear(4, int(2 * scale)))

    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    cfg = Config()
    cfg.data.global_batch = 8
    plan = plan_run(cfg, 1, UserParts(model=factory, train_data=data))
    assert plan.model.block_count == 1 and plan.model.layer_names == ("0",)

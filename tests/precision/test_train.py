"""precision.mode from config: the modes train through build_trainer, statistics reach metrics.jsonl, bad input
is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kaisoku.cli import main as cli_main
from kaisoku.config import Config, apply_override
from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.errors import ConfigError
from kaisoku.precision.quant import QuantConv2d
from kaisoku.run_facts import check_config
from tests.train_harness import metric_lines, tiny_config


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=16, val_count=16, workers=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["int8-stats", "fp8-stats"])
def test_stats_mode_trains_and_logs_per_layer_statistics(
    mode: str, tmp_path: Path, tiny_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_config(
        tiny_data,
        tmp_path / "run",
        precision__mode=mode,
        train__max_steps=4,
        train__log_every=2,
        train__device="cpu",  # the emulation (a GPU with fp8 tensor cores runs tests/gpu's real path)
    )
    check_config(cfg, 1)
    trainer = build_trainer(cfg, World())
    assert isinstance(trainer.engine.model.features[1][0], QuantConv2d)
    summary = trainer.fit()
    trainer.metrics.close()
    assert torch.isfinite(torch.tensor(summary["final_loss"]))
    if mode == "fp8-stats":
        assert "emulated on cpu" in capsys.readouterr().out
    lines = metric_lines(tmp_path / "run")
    windows = [line for line in lines if line.get("event") == "precision"]
    assert [line["step"] for line in windows] == [2, 4]
    middle = windows[-1]["layers"]["features.1.0"]
    assert set(middle) == {"weights", "activations", "gradients"}
    for figures in middle.values():
        assert isinstance(figures["exponent"], int)
        assert 0.0 <= figures["overflow_rate"] <= 1.0 and 0.0 <= figures["underflow_fraction"] <= 1.0
    assert "features.0.0" not in windows[-1]["layers"]  # the first layer is kept in bf16
    final = [line for line in lines if line.get("event") == "precision_summary"][-1]["layers"]
    assert final["features.0.0"]["format"] == "bf16"


def test_old_key_and_bad_input_are_one_line() -> None:
    with pytest.raises(ConfigError, match="train.precision is now precision.mode") as info:
        apply_override(Config(), "train.precision", "bf16")
    assert "\n" not in str(info.value)
    cfg = Config()
    cfg.train.device = "cpu"
    cfg.precision.mode = "fp16"
    with pytest.raises(ConfigError, match="precision.mode fp16 needs CUDA.*use bf16"):
        check_config(cfg)
    cfg.precision.mode = "fp8-stats"
    cfg.precision.fp8 = "real"
    with pytest.raises(ConfigError, match="precision.fp8 real: cpu has no fp8 matmul"):
        check_config(cfg)
    cfg.precision.fp8 = "auto"
    cfg.model.name = "small-cnn"
    cfg.precision.keep = ["first", "features.7"]
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    assert "no Conv2d/Linear layer named 'features.7'" in str(info.value)
    assert "features.1.0" in str(info.value) and "\n" not in str(info.value)


def test_cli_help_lists_the_precision_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--precision.mode" in out and "int8-stats" in out and "--train.precision" not in out

"""The user's own validation metrics (functions and torchmetrics metrics) by Python and by import path, the
trial step that refuses a model, loss or metric that do not fit before launch, and tokens/s."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import kaisoku
from kaisoku.engine.user_metrics import UserMetrics, named_metrics
from kaisoku.errors import ConfigError
from tests.train_harness import kaisoku_in_process

USER_FILES = Path(__file__).resolve().parents[1] / "user_files"


def exact_match(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy of a batch."""
    return (outputs.argmax(1) == targets).float().mean()


def test_metrics_are_named_and_names_that_clash_or_cannot_be_keys_are_refused() -> None:
    from torchmetrics.classification import MulticlassAccuracy

    accuracy = MulticlassAccuracy(num_classes=3)
    assert list(named_metrics([exact_match, accuracy])) == ["exact_match", "multiclass_accuracy"]
    assert list(named_metrics(exact_match)) == ["exact_match"]
    assert list(named_metrics({"top1": exact_match})) == ["top1"]
    with pytest.raises(ConfigError, match="without a name"):
        named_metrics([lambda outputs, targets: 0.0])
    with pytest.raises(ConfigError, match="'accuracy' cannot name a metric"):
        named_metrics({"accuracy": exact_match})
    with pytest.raises(ConfigError, match="two metrics are named 'exact_match'"):
        named_metrics([exact_match, exact_match])
    with pytest.raises(ConfigError, match="'f1' is a int"):
        named_metrics({"f1": 3})


def test_a_plain_metric_is_the_sample_weighted_mean_over_batches() -> None:
    """Batches of 3 and 1 samples: the figure is the mean over the 4 samples, not over the 2 batches."""
    metrics = UserMetrics(
        {"exact_match": exact_match}, torch.device("cpu"), target_key=None, task="classification"
    )
    right = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    metrics.update(right, torch.tensor([0, 0, 0]), 3)  # 2 of 3 right
    metrics.update(torch.tensor([[0.0, 1.0]]), torch.tensor([0]), 1)  # 0 of 1
    assert metrics.compute(lambda values: values) == {"val_exact_match": pytest.approx(0.5)}
    metrics.reset()
    metrics.update(right, torch.tensor([0, 0, 1]), 3)
    assert metrics.compute(lambda values: values) == {"val_exact_match": pytest.approx(1.0)}


class Linear(nn.Module):
    """Three classes of 4 features."""

    def __init__(self, returns: str = "tensor") -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.returns = returns

    def forward(self, x: torch.Tensor) -> object:
        out = self.layer(x)
        return {"loss": out.sum()} if self.returns == "loss-only" else out


def _dataset(count: int, seed: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 4, generator=generator)
    return torch.utils.data.TensorDataset(x, x[:, :3].argmax(1))


def _config(run_dir: Path) -> kaisoku.Config:
    cfg = kaisoku.Config(run_dir=str(run_dir))
    cfg.data.global_batch, cfg.data.workers, cfg.train.epochs = 16, 0, 2
    cfg.metrics.progress = False
    return cfg


def test_fit_reports_its_metrics_in_the_summary_the_records_and_the_report(tmp_path: Path) -> None:
    from torchmetrics.classification import MulticlassAccuracy

    torch.manual_seed(0)
    summary = kaisoku.fit(
        _config(tmp_path / "run"),
        model=Linear(),
        data=_dataset(64, 0),
        val_data=_dataset(40, 1),
        metrics=[exact_match, MulticlassAccuracy(num_classes=3, average="micro")],
    )
    assert summary["val_exact_match"] == pytest.approx(summary["val_accuracy"])
    assert summary["val_multiclass_accuracy"] == pytest.approx(summary["val_accuracy"])
    assert "tokens_per_s" not in summary  # float features are not token ids
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r.get("event") == "validation"][-1]["val_exact_match"] == summary[
        "val_exact_match"
    ]
    from kaisoku.engine.report import write_report

    write_report(tmp_path / "run")
    assert (tmp_path / "run" / "report" / "val_exact_match.png").stat().st_size > 0


@pytest.fixture
def user_lm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run from the folder of the user's files, as a user would."""
    monkeypatch.chdir(USER_FILES)
    monkeypatch.syspath_prepend(str(USER_FILES))
    yield
    sys.modules.pop("user_lm", None)


def _train(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "train", "--nproc", "1", "--run-dir", str(tmp_path / "run"),
        "--model.name", "user_lm:tiny_lm", "--data.dataset", "user_lm:tokens",
        "--data.global-batch", "16", "--data.workers", "0", "--train.epochs", "2", "--optim.lr", "0.5",
        "--metrics.progress", "false", *extra,
    ]  # fmt: skip


def test_the_cli_takes_metrics_by_import_path_and_reports_tokens_per_second(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], user_lm: None
) -> None:
    plan = kaisoku_in_process(
        capfd, *_train(tmp_path, "--train.metrics", "user_lm:next_token_accuracy", "--print-plan")
    )
    assert plan.returncode == 0, plan.stderr
    assert "32 samples, each epoch, language-model figures + next_token_accuracy" in plan.stdout, plan.stdout
    run = kaisoku_in_process(capfd, *_train(tmp_path, "--train.metrics", "user_lm:next_token_accuracy"))
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in records if r.get("event") == "validation"][-1]
    # The causal model's own shift and the metric's agree with the task's token accuracy.
    assert validation["val_next_token_accuracy"] == pytest.approx(validation["val_token_accuracy"])
    steps = [r for r in records if "tokens_per_s" in r]
    assert steps and all(r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 12) for r in steps)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--model.name", "user_lm:loss_only"], "failed in validation: TypeError: the model's output (dict) holds no tensor"),
        (["--train.loss", "user_lm:per_token_loss"], "loss: it returned a tensor of shape [22]"),
        (["--train.metrics", "user_lm:per_token_loss"], "failed in train.metrics: TypeError: metric 'per_token_loss' returned 22 values"),
    ],
)  # fmt: skip
def test_a_model_loss_or_metric_that_does_not_fit_is_one_line_before_launch(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], user_lm: None, extra: list[str], expected: str
) -> None:
    for command in (_train(tmp_path, *extra, "--print-plan"), _train(tmp_path, "--nproc", "2", *extra)):
        result = kaisoku_in_process(capfd, *command)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr
        assert not (tmp_path / "run").exists()


def test_fit_refuses_a_model_whose_output_validation_cannot_score_before_training(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        kaisoku.fit(
            _config(tmp_path / "run"),
            model=Linear("loss-only"),
            data=_dataset(64, 0),
            val_data=_dataset(8, 1),
        )
    lines = capfd.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and "failed in validation" in lines[0], lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

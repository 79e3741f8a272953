"""Models and data as people write them: dict samples passed as keyword arguments, dict outputs carrying
their own loss, token targets (a label per token, or a causal language model's shifted labels), and the
summary reduced over ranks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import kaisoku
from kaisoku.errors import ConfigError

VOCAB, LENGTH = 16, 12
ROOT = Path(__file__).resolve().parents[2]


class NextToken(Dataset):
    """Token sequences counting up modulo VOCAB from a keyed start: the next token is always learnable.
    ``as_dict``: Hugging Face style samples (``input_ids``, ``labels`` equal to them); else ``(tokens,
    per-token labels)`` pairs whose label at t is the token at t + 1."""

    def __init__(self, count: int, seed: int, as_dict: bool) -> None:
        starts = torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))
        self.tokens = (starts[:, None] + torch.arange(LENGTH + 1)) % VOCAB
        self.as_dict = as_dict

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> Any:
        if self.as_dict:
            ids = self.tokens[index, :LENGTH]
            return {"input_ids": ids, "attention_mask": torch.ones(LENGTH, dtype=torch.long), "labels": ids}
        return self.tokens[index, :LENGTH], self.tokens[index, 1:]


class TinyCausalLM(nn.Module):
    """Takes ``input_ids`` (and ``labels``) as keyword arguments and returns a dict with ``logits`` and, given
    labels, the shifted next-token ``loss``, as a Hugging Face causal LM does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return out


class TokenTagger(nn.Module):
    """Token ids ``[B, T]`` in, logits ``[B, T, C]`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def _config(run_dir: Path, **train: Any) -> kaisoku.Config:
    cfg = kaisoku.Config(run_dir=str(run_dir))
    cfg.data.global_batch, cfg.data.workers, cfg.train.epochs, cfg.optim.lr = 32, 0, 4, 0.5
    cfg.metrics.progress = False
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_a_dict_dataset_and_a_model_returning_its_own_loss_train_as_a_language_model(tmp_path: Path) -> None:
    """Hugging Face's shape: dict samples as keyword arguments, the model's own loss used; validation reports
    per-token loss, token accuracy and perplexity of the shifted predictions."""
    torch.manual_seed(0)
    summary = kaisoku.fit(
        _config(tmp_path / "run"),
        model=TinyCausalLM(),
        data=NextToken(256, 0, as_dict=True),
        val_data=NextToken(64, 1, as_dict=True),
    )
    assert summary["val_token_accuracy"] > 0.9  # counting up is learnable: chance is 1/16
    assert summary["val_perplexity"] < 2.0
    assert summary["val_tokens"] == 64 * (LENGTH - 1)  # every label but the first of each sequence
    assert summary["val_perplexity"] == pytest.approx(math.exp(summary["val_loss"]))


def test_integer_sequence_targets_are_token_classification_with_cross_entropy_per_token(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    cfg = _config(tmp_path / "run", loss="cross-entropy", label_smoothing=0.05)
    summary = kaisoku.fit(
        cfg,
        model=TokenTagger(),
        data=NextToken(256, 0, as_dict=False),
        val_data=NextToken(64, 1, as_dict=False),
    )
    assert summary["val_token_accuracy"] > 0.9
    assert summary["val_tokens"] == 64 * LENGTH
    # The plan says what it resolved.
    from kaisoku.engine.build import user_parts
    from kaisoku.parts import UserParts
    from kaisoku.run_facts import plan_run

    parts = user_parts(cfg, UserParts(model=TokenTagger(), train_data=NextToken(64, 0, as_dict=False)))
    plan = plan_run(cfg, None, parts)
    assert plan.task == "token-classification" and plan.loss == "cross-entropy"
    assert "(input, target) pairs" in plan.data.description


def test_a_task_the_targets_do_not_fit_and_dict_batches_under_pipeline_stages_are_refused(
    tmp_path: Path,
) -> None:
    from kaisoku.engine.build import user_parts
    from kaisoku.parts import UserParts
    from kaisoku.run_facts import plan_run

    cfg = _config(tmp_path / "run", task="classification")
    parts = user_parts(cfg, UserParts(model=TokenTagger(), train_data=NextToken(64, 0, as_dict=False)))
    with pytest.raises(ConfigError, match="train.task classification does not fit .*token-classification"):
        plan_run(cfg, None, parts)
    cfg = _config(tmp_path / "run")
    parts = user_parts(cfg, UserParts(model=TinyCausalLM(), train_data=NextToken(64, 0, as_dict=True)))
    described = plan_run(cfg, None, parts).describe()  # what --print-plan prints
    for row in (
        "task                  language-model",
        "batch                 model(**batch); labels: batch['labels']; loss(outputs, batch)",
        "loss                  the model's own where its output carries one, else cross-entropy per token, shifted",
        "optimizer             sgd, lr 0.5",
        "total steps           8",
    ):
        assert row in described, described
    cfg.parallel.pp = 2
    parts = user_parts(cfg, UserParts(model=TinyCausalLM(), train_data=NextToken(64, 0, as_dict=True)))
    with pytest.raises(ConfigError, match="pipeline stages pass tensors between them"):
        plan_run(cfg, None, parts)


def token_accuracy(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A user's metric: the batch's next-token accuracy."""
    return (outputs["logits"][:, :-1].argmax(-1) == batch["labels"][:, 1:]).float().mean()


def fit_and_write_summary(folder: str) -> None:
    """A rank's ``main`` under ``kaisoku.launch``: fit with a validation set of an odd size (the ranks see
    other numbers of samples) and two metrics of the user's, then write this rank's summary to a file."""
    from torchmetrics.classification import MulticlassAccuracy

    torch.manual_seed(0)
    summary = kaisoku.fit(
        _config(Path(folder) / "run", epochs=1),
        model=TinyCausalLM(),
        data=NextToken(256, 0, as_dict=True),
        val_data=NextToken(45, 1, as_dict=True),
        metrics={
            "next_token": token_accuracy,
            "tm_accuracy": MulticlassAccuracy(num_classes=VOCAB, average="micro", ignore_index=-100),
        },
    )
    rank = os.environ.get("RANK", "0")
    (Path(folder) / f"summary-{rank}.json").write_text(json.dumps(summary))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_return_the_same_summary_with_the_loss_averaged_over_ranks(tmp_path: Path) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(
        "import functools, sys\n"
        "import kaisoku\n"
        "from tests.engine.test_models_as_written import fit_and_write_summary\n\n"
        "if __name__ == '__main__':\n"
        "    kaisoku.launch(functools.partial(fit_and_write_summary, sys.argv[1]), nproc=2)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=200, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads((tmp_path / f"summary-{rank}.json").read_text()) for rank in (0, 1)]
    assert summaries[0]["steps"] == summaries[1]["steps"] == 8
    assert summaries[0]["final_loss"] == summaries[1]["final_loss"]
    # The user's metrics are the whole validation set's, on every rank: a plain function's batch means
    # weighted by samples, and torchmetrics' own gathered states, both equal the task's token accuracy.
    for summary in summaries:
        assert summary["val_samples"] == 45
        assert summary["val_next_token"] == pytest.approx(summary["val_token_accuracy"], abs=1e-9)
        assert summary["val_tm_accuracy"] == pytest.approx(summary["val_token_accuracy"], abs=1e-6)
    assert summaries[0]["val_next_token"] == summaries[1]["val_next_token"]
    assert summaries[0]["tokens_per_s"] == pytest.approx(summaries[0]["samples_per_s"] * LENGTH)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in records if r.get("event") == "validation"]
    assert validation and "val_next_token" in validation[-1] and "val_tm_accuracy" in validation[-1]
    assert any("tokens_per_s" in r for r in records if "loss" in r)


_RANK_DATA = '''
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset


def data():
    """Built from a generator seeded by the rank: every rank holds other samples."""
    generator = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    x = torch.randn(256, 8, generator=generator)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def net(spec):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ranks_holding_other_data_are_refused_naming_the_rank(tmp_path: Path) -> None:
    (tmp_path / "rank_data.py").write_text(_RANK_DATA)
    result = subprocess.run(
        [
            sys.executable, "-m", "kaisoku", "train", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
            "--data.dataset", "rank_data:data", "--model.name", "rank_data:net", "--data.global-batch", "32",
            "--data.workers", "0", "--train.val-every", "0", "--metrics.progress", "false",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=200, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    cause, hint = result.stderr.strip().splitlines()
    assert cause.startswith("kaisoku: error: data: rank 1 holds another training dataset than rank 0"), cause
    assert "seed its randomness (kaisoku.launch seeds every rank alike" in cause
    assert hint == f"kaisoku: full logs in {tmp_path / 'run' / 'logs'}"
    assert not (tmp_path / "run" / "checkpoints").exists()


def pad_tokens(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A user's collate: sequences of different lengths padded to the longest, labels padded with -100."""
    longest = max(len(s["input_ids"]) for s in samples)

    def padded(key: str, value: int) -> torch.Tensor:
        return torch.stack(
            [torch.cat([s[key], torch.full((longest - len(s[key]),), value)]) for s in samples]
        )

    return {"input_ids": padded("input_ids", 0), "labels": padded("labels", -100)}


class Ragged(Dataset):
    """NextToken's dict samples cut to keyed lengths (8 to LENGTH): a batch needs padding."""

    def __init__(self, count: int, seed: int) -> None:
        self.inner = NextToken(count, seed, as_dict=True)
        self.lengths = torch.randint(8, LENGTH + 1, (count,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample, length = self.inner[index], int(self.lengths[index])
        return {"input_ids": sample["input_ids"][:length], "labels": sample["labels"][:length]}


def test_a_collate_fn_pads_ragged_dict_samples_and_padding_is_left_out(tmp_path: Path) -> None:
    torch.manual_seed(0)
    summary = kaisoku.fit(
        _config(tmp_path / "run"), model=TinyCausalLM(), data=Ragged(256, 0), val_data=Ragged(64, 1),
        collate_fn=pad_tokens,
    )  # fmt: skip
    counted = int(sum(Ragged(64, 1).lengths - 1))  # the shifted labels that are not padding
    assert summary["val_tokens"] == counted
    assert summary["val_token_accuracy"] > 0.9


class PhotoWithMeta(Dataset):
    """``({"image", "meta"}, label)`` samples: a nested input, handed to the model as keyword arguments."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.image, self.meta = (
            torch.randn(count, 4, generator=generator),
            torch.randn(count, 2, generator=generator),
        )

    def __len__(self) -> int:
        return len(self.image)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], int]:
        return {"image": self.image[index], "meta": self.meta[index]}, int(self.image[index, :3].argmax())


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)

    def forward(self, image: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.cat([image, meta], dim=1))


def test_a_nested_input_in_pairs_goes_to_the_model_as_keyword_arguments(tmp_path: Path) -> None:
    torch.manual_seed(0)
    summary = kaisoku.fit(
        _config(tmp_path / "run", epochs=3),
        model=TwoInputs(),
        data=PhotoWithMeta(128, 0),
        val_data=PhotoWithMeta(64, 1),
    )
    assert summary["val_samples"] == 64 and summary["val_accuracy"] > 0.6  # chance: 1/3


class Unlabelled(Dataset):
    """Dict samples with no target: ``{"x"}`` points near a 2-D plane in 8-D (an autoencoder learns them)."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        basis = torch.randn(2, 8, generator=torch.Generator().manual_seed(99))
        self.x = torch.randn(count, 2, generator=generator) @ basis

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index]}


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode, self.decode = nn.Linear(8, 2), nn.Linear(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


def reconstruction(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The user's loss: it sees the whole batch."""
    return nn.functional.mse_loss(outputs, batch["x"])


def test_dict_samples_without_a_target_train_on_the_users_loss_and_validate_it(tmp_path: Path) -> None:
    from kaisoku.engine.build import user_parts
    from kaisoku.parts import UserParts
    from kaisoku.run_facts import plan_run

    cfg = _config(tmp_path / "plan")
    with pytest.raises(
        ConfigError, match="no target; .*or give a loss of your own, which sees the whole batch"
    ):
        plan_run(cfg, None, user_parts(cfg, UserParts(model=AutoEncoder(), train_data=Unlabelled(64, 0))))
    parts = user_parts(cfg, UserParts(model=AutoEncoder(), train_data=Unlabelled(64, 0), loss=reconstruction))
    described = plan_run(cfg, None, parts).describe()
    assert "task                  loss-only" in described
    assert "batch                 model(**batch); loss(outputs, batch)" in described
    torch.manual_seed(0)
    cfg = _config(tmp_path / "run", epochs=6)
    cfg.optim.lr = 0.1
    with torch.no_grad():
        untrained = float(reconstruction(AutoEncoder()(Unlabelled(64, 1).x), {"x": Unlabelled(64, 1).x}))
    summary = kaisoku.fit(
        cfg, model=AutoEncoder(), data=Unlabelled(256, 0), val_data=Unlabelled(64, 1), loss=reconstruction
    )
    assert summary["val_samples"] == 64
    assert summary["val_loss"] < 0.5 * untrained  # it learned the plane


def test_a_nested_input_under_pipeline_stages_is_refused_before_launch(tmp_path: Path) -> None:
    from kaisoku.engine.build import user_parts
    from kaisoku.parts import UserParts
    from kaisoku.run_facts import plan_run

    cfg = _config(tmp_path / "run")
    cfg.parallel.pp = 2
    parts = user_parts(cfg, UserParts(model=TwoInputs(), train_data=PhotoWithMeta(64, 0)))
    with pytest.raises(
        ConfigError, match="pipeline stages pass tensors between them, .* gives the model nested inputs"
    ):
        plan_run(cfg, None, parts)


class PairOut(nn.Module):
    """A block that hands on a (features, extra) pair: fine in one process, not between pipeline stages."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer(x), x


class PairIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 3)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.layer(pair[0])


def test_blocks_that_hand_on_a_tuple_are_refused_under_pipeline_stages_before_launch(tmp_path: Path) -> None:
    """The trial step before launch runs the ordered blocks in turn when the plan has pipeline stages."""
    from kaisoku.engine.build import user_parts
    from kaisoku.engine.trial import trial_step
    from kaisoku.parts import UserParts
    from kaisoku.run_facts import plan_run

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x[:, :3].argmax(1))
    cfg = _config(tmp_path / "run")
    cfg.parallel.pp, cfg.parallel.microbatches = 2, 2
    parts = user_parts(cfg, UserParts(model=nn.Sequential(PairOut(), PairIn()), train_data=data))
    plan = plan_run(cfg, 2, parts)  # the world kaisoku train --nproc 2 plans for
    with pytest.raises(ConfigError, match=r"block 0 \(PairOut\) of the model's ordered blocks gives a tuple"):
        trial_step(plan, parts)
    tensors = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    trial_step(
        plan, user_parts(cfg, UserParts(model=tensors, train_data=data))
    )  # tensors between blocks: fine

"""A user's small causal language model, token data and metric, as a file of theirs would hold them (nothing
here is kaisoku's): ``kaisoku train --model.name user_lm:tiny_lm --data.dataset user_lm:tokens
--train.metrics user_lm:next_token_accuracy``, run from this folder. ``loss_only`` and ``per_token_loss`` are
mistakes a trial step catches before launch."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB, LENGTH = 16, 12


class Counting(Dataset):
    """Dict samples of token ids counting up modulo VOCAB from a seeded start; ``labels`` equal the ids."""

    def __init__(self, count: int, seed: int) -> None:
        starts = torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))
        self.ids = (starts[:, None] + torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tokens() -> tuple[Dataset, Dataset]:
    """128 training and 32 validation sequences."""
    return Counting(128, 0), Counting(32, 1)


class TinyLM(nn.Module):
    """Embedding and head; returns ``{"logits", "loss"}`` given labels, as a Hugging Face causal LM does."""

    def __init__(self, loss_only: bool = False) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB)
        self.loss_only = loss_only

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids))
        out = {} if self.loss_only else {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
            )
        return out


def tiny_lm() -> TinyLM:
    """The model."""
    return TinyLM()


def loss_only() -> TinyLM:
    """A model that returns its loss and no predictions: validation has nothing to score."""
    return TinyLM(loss_only=True)


def next_token_accuracy(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's next-token accuracy: a metric of the user's."""
    return (outputs["logits"][:, :-1].argmax(-1) == batch["labels"][:, 1:]).float().mean()


def per_token_loss(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss left unreduced (one value per token): a mistake."""
    logits = outputs["logits"][:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), reduction="none"
    )

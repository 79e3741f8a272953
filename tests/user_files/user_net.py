"""A user's own model, data and loss, as a file of theirs would hold them: nothing here is kaisoku's.

The tests train it through ``kaisoku train --model.name user_net:net --data.dataset user_net:digits`` (run
from this folder) and through ``kaisoku.fit``. ``USER_NET_MNIST`` points at an MNIST ``.npz``;
``USER_NET_HOLD_AT=FILE`` makes the training set stop serving once FILE exists (a checkpoint: the test then
kills a rank at a known step).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


class Digits(Dataset):
    """The first ``count`` MNIST digits of a split as float images in [0, 1] and integer labels."""

    def __init__(self, split: str, count: int) -> None:
        with np.load(os.environ["USER_NET_MNIST"], allow_pickle=False) as archive:
            self.images = torch.from_numpy(archive[f"x_{split}"][:count]).float().div(255).unsqueeze(1)
            self.labels = torch.from_numpy(archive[f"y_{split}"][:count]).long()
        self.hold_at = os.environ.get("USER_NET_HOLD_AT", "") if split == "train" else ""

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        while self.hold_at and os.path.exists(self.hold_at):
            time.sleep(0.1)  # held until the test kills the run
        return self.images[index], self.labels[index]


def digits() -> tuple[Dataset, Dataset]:
    """256 training and 128 validation digits."""
    return Digits("train", 256), Digits("val", 128)


def net(spec: object) -> nn.Sequential:
    """Two conv blocks and a head with dropout, as an ``nn.Sequential`` (so it splits into pipeline stages)."""
    classes = getattr(spec, "num_classes", 0) or 10
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(16 * 7 * 7, classes)),
    )


def smooth_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with a little label smoothing: a loss of the user's own."""
    return nn.functional.cross_entropy(outputs, targets, label_smoothing=0.05)

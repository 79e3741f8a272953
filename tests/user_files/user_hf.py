"""examples/hf_causal_lm.py's parts by import path, its training set made to hold still once the file
``USER_HF_HOLD_AT`` names exists (a checkpoint: the test then kills a rank at a known step)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

sys.path.append(str(Path(__file__).resolve().parents[2] / "examples"))

from hf_causal_lm import counting_dataset, next_token_accuracy, tiny_gpt2  # noqa: E402

__all__ = ["data", "next_token_accuracy", "tiny_gpt2"]


class Held(Dataset):
    """``dataset``, serving nothing while the hold file exists."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.hold_at = os.environ.get("USER_HF_HOLD_AT", "")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        while self.hold_at and os.path.exists(self.hold_at):
            time.sleep(0.1)  # held until the test kills the run
        return self.dataset[index]


def data() -> tuple[Dataset, Any]:
    """The example's training (held) and validation sets."""
    return Held(counting_dataset(512, 0)), counting_dataset(128, 1)

"""``kaisoku bench largebatch``: test accuracy against batch size on MNIST, at a fixed epoch budget.

A small BatchNorm CNN is trained for the same number of epochs at batch B0 and at 16x and 64x B0 with
three methods: (i) momentum SGD with the linear learning-rate scaling rule and warmup (then cosine), (ii) the
same with Nesterov momentum, (iii) kaisoku's large-batch recipe: LARS (no weight decay or adaptation on
BatchNorm and biases), warmup then arc-cotangent decay, label smoothing 0.1. Each method's learning rate
comes from its own 3-point grid (scaled with the batch size by the method's rule) and is picked per batch
size on ``x_val`` with seed 0; the table reports ``x_test`` accuracy, the mean over 2 seeds of the picked
learning rate.

Large batches are reached by gradient accumulation over micro-batches of at most 512 samples: BatchNorm
normalises each micro-batch (as data-parallel BatchNorm does per rank), the optimizer sees the whole batch.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kaisoku.config import OptimConfig, SchedConfig
from kaisoku.optim.factory import build_optimizer, build_scheduler

#: Largest number of samples in one forward pass; bigger batches accumulate gradients.
MICRO_BATCH = 512


def locate_mnist() -> Path | None:
    """The MNIST archive: ``$KAISOKU_MNIST``, else ``../shared/data/mnist.npz`` beside the repository or cwd."""
    env = os.environ.get("KAISOKU_MNIST")
    if env:
        return Path(env).expanduser()
    repo_root = Path(__file__).resolve().parents[3]
    for base in (repo_root, Path.cwd()):
        candidate = base.parent / "shared" / "data" / "mnist.npz"
        if candidate.exists():
            return candidate
    return None


@dataclass
class Split:
    """Normalised images ``(N, 1, 28, 28)`` float32 and labels ``(N,)`` int64."""

    x: Tensor
    y: Tensor


def load_mnist(path: Path, *, limit: dict[str, int] | None = None) -> dict[str, Split]:
    """The train, val and test splits as tensors, optionally cut to ``limit[split]`` samples."""
    arrays = np.load(path, allow_pickle=False)
    splits = {}
    for split in ("train", "val", "test"):
        x = arrays[f"x_{split}"]
        y = arrays[f"y_{split}"]
        if limit and split in limit:
            x, y = x[: limit[split]], y[: limit[split]]
        images = torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0).sub_(0.1307).div_(0.3081)
        splits[split] = Split(images.unsqueeze(1).contiguous(), torch.from_numpy(y.astype(np.int64)))
    return splits


class SmallCNN(nn.Module):
    """Two strided 3x3 conv + BatchNorm + ReLU stages (28 -> 14 -> 7 px; ``width``, ``2 * width`` channels)
    and a linear head. Strided convolutions instead of pooling keep it cheap on a CPU."""

    def __init__(self, width: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
        )
        self.head = nn.Linear(2 * width * 7 * 7, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits of a batch of 28x28 images."""
        return self.head(self.features(x).flatten(1))


@dataclass
class Method:
    """One training method: optimizer and schedule config, label smoothing, lr grid and batch scaling."""

    name: str
    optim: OptimConfig
    sched: SchedConfig
    lr_grid: tuple[float, ...]
    """Learning rates at B0; at batch k * B0 each is multiplied by ``k ** lr_scaling_power``."""
    lr_scaling_power: float = 1.0
    label_smoothing: float = 0.0
    notes: str = ""


def methods(warmup_epochs: float) -> list[Method]:
    """The three methods compared."""
    sgd_sched = SchedConfig(name="cosine", warmup_epochs=warmup_epochs)
    sgd = OptimConfig(name="sgd", momentum=0.9, weight_decay=5e-4, no_decay_bn_bias=False)
    return [
        Method("sgd-linear", sgd, sgd_sched, (0.05, 0.1, 0.2), notes="lr = base * k, warmup + cosine"),
        Method(
            "nesterov-linear",
            replace(sgd, nesterov=True),
            sgd_sched,
            (0.05, 0.1, 0.2),
            notes="lr = base * k, warmup + cosine",
        ),
        Method(
            "kaisoku-recipe",
            OptimConfig(name="lars", momentum=0.9, weight_decay=5e-4, eta=0.02, no_decay_bn_bias=True),
            SchedConfig(name="arccot", warmup_epochs=warmup_epochs, arccot_center=0.5, arccot_slope=10.0),
            (0.05, 0.1, 0.2),
            lr_scaling_power=0.5,
            label_smoothing=0.1,
            notes="LARS eta 0.02, lr = base * sqrt(k), warmup + arccot, label smoothing 0.1",
        ),
    ]


@dataclass
class RunResult:
    """The outcome of one training run."""

    accuracy: dict[str, float] = field(default_factory=dict)
    diverged: bool = False
    steps: int = 0
    seconds: float = 0.0


def evaluate(model: nn.Module, split: Split, batch: int = 2000) -> float:
    """Top-1 accuracy in percent, BatchNorm in eval mode."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(split.y), batch):
            logits = model(split.x[start : start + batch])
            correct += int((logits.argmax(1) == split.y[start : start + batch]).sum())
    model.train()
    return 100.0 * correct / len(split.y)


def train_run(
    data: dict[str, Split],
    method: Method,
    *,
    batch: int,
    lr: float,
    seed: int,
    epochs: int,
    evaluate_on: tuple[str, ...] = ("val", "test"),
    width: int = 8,
) -> RunResult:
    """Train a fresh :class:`SmallCNN` for ``epochs`` epochs at ``batch`` and evaluate it.

    Sample order is keyed by (seed, epoch); the last incomplete batch of an epoch is dropped, so every epoch
    takes ``len(train) // batch`` optimizer steps.
    """
    started = time.perf_counter()
    torch.manual_seed(seed)
    model = SmallCNN(width)
    optimizer = build_optimizer(model, replace(method.optim, lr=lr))
    train = data["train"]
    steps_per_epoch = len(train.y) // batch
    if steps_per_epoch < 1:
        raise ValueError(f"batch {batch} is larger than the {len(train.y)} training samples")
    scheduler = build_scheduler(
        optimizer, method.sched, steps_per_epoch=steps_per_epoch, total_steps=steps_per_epoch * epochs
    )
    micro = min(batch, MICRO_BATCH)
    result = RunResult()
    model.train()
    for epoch in range(epochs):
        order = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(len(train.y)))
        for step in range(steps_per_epoch):
            indices = order[step * batch : (step + 1) * batch]
            total_loss = torch.zeros(())
            for start in range(0, batch, micro):
                chunk = indices[start : start + micro]
                logits = model(train.x[chunk])
                loss = F.cross_entropy(logits, train.y[chunk], label_smoothing=method.label_smoothing)
                (loss * (len(chunk) / batch)).backward()
                total_loss += loss.detach() * (len(chunk) / batch)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            result.steps += 1
            if not math.isfinite(float(total_loss)):
                result.diverged = True
                break
        if result.diverged:
            break
    for split in evaluate_on:
        result.accuracy[split] = evaluate(model, data[split])
    result.seconds = time.perf_counter() - started
    return result

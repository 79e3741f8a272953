"""Train your own model on your own Dataset with kaisoku, on N local ranks or under torchrun / srun.

    python examples/own_model.py --model transformer             # a small transformer on token sequences
    python examples/own_model.py --model resnet18 --nproc 2      # torchvision's ResNet-18 on images
    python examples/own_model.py --model transformer -- --parallel.pp 2   # the same, as a 2-stage pipeline

Everything after ``--`` is a kaisoku setting (``--section.field value``, as for ``kaisoku train``). The two
datasets below stand in for yours: any map-style Dataset of (input, target) pairs works.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torchvision
from torch import nn
from torch.utils.data import Dataset

import kaisoku
from kaisoku.config import apply_override


class Stripes(Dataset):
    """Images of stripes in one of 4 orientations (the label), with noise: your image dataset goes here."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (count,), generator=generator)
        self.noise = torch.randn(count, 3, 32, 32, generator=generator) * 0.5
        grid = torch.arange(32.0)
        rows, cols = torch.meshgrid(grid, grid, indexing="ij")
        self.patterns = torch.stack([rows, cols, rows + cols, rows - cols]).div(3).sin()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        label = self.labels[index]
        return self.patterns[label].expand(3, 32, 32) + self.noise[index], label


class Tokens(Dataset):
    """Sequences of 16 tokens; the label says whether token 7 occurs: your token dataset goes here."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 32, (count, 16), generator=generator)
        self.labels = (self.tokens == 7).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index], self.labels[index]


class Embed(nn.Module):
    """Token and position embeddings."""

    def __init__(self, vocab: int, length: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(1, length, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, length) token ids -> (batch, length, width)."""
        return self.tokens(x) + self.positions


class Head(nn.Module):
    """Layer norm, mean over the sequence, a linear classifier."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, length, width) -> (batch, classes)."""
        return self.out(self.norm(x).mean(dim=1))


class TinyTransformer(nn.Module):
    """A small encoder-only transformer. ``ordered_blocks()`` lets kaisoku cut it into pipeline stages and
    plan its memory per block; applied in turn, the blocks compute ``forward``."""

    def __init__(self, vocab: int = 32, length: int = 16, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = Embed(vocab, length, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, nhead=4, dim_feedforward=4 * width, dropout=0.1, batch_first=True
            )
            for _ in range(layers)
        )
        self.head = Head(width, 2)

    def ordered_blocks(self) -> list[nn.Module]:
        """Embedding, each encoder layer, head."""
        return [self.embed, *self.layers, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits for a batch of token sequences."""
        for block in self.ordered_blocks():
            x = block(x)
        return x


def main() -> None:
    """Parse the arguments and train on this rank (``kaisoku.launch`` runs it on every rank)."""
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    own, settings = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["transformer", "resnet18"], default="transformer")
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (ignored under torchrun or srun)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop early (0: all epochs)")
    parser.add_argument("--run-dir", default="runs/own-model")
    args = parser.parse_args(own)
    cfg = kaisoku.Config(run_dir=args.run_dir)
    cfg.data.global_batch = 64
    cfg.data.workers = 0
    cfg.train.epochs = 3
    cfg.train.max_steps = args.max_steps
    cfg.optim.name = "adamw" if args.model == "transformer" else "sgd"
    cfg.optim.lr = 1e-3 if args.model == "transformer" else 0.05
    cfg.metrics.progress = False
    for key, value in zip(settings[::2], settings[1::2]):
        apply_override(cfg, key.removeprefix("--"), value)
    if args.model == "resnet18":
        model: nn.Module = torchvision.models.resnet18(num_classes=4)
        train, val = Stripes(1024, seed=0), Stripes(256, seed=1)
    else:
        model = TinyTransformer()
        train, val = Tokens(2048, seed=0), Tokens(512, seed=1)
    summary = kaisoku.fit(cfg, model=model, data=train, val_data=val)
    if os.environ.get("RANK", "0") == "0":  # every rank gets the summary; one prints it
        print(
            f"{args.model}: {summary['steps']} steps, validation accuracy {100 * summary['val_accuracy']:.1f}%"
        )


if __name__ == "__main__":
    nproc = 2
    if "--nproc" in sys.argv:
        nproc = int(sys.argv[sys.argv.index("--nproc") + 1])
    kaisoku.launch(main, nproc=nproc)

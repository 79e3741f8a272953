"""The large-batch recipe from Python on random data: LARS, warmup then polynomial decay, label smoothing.

    python examples/large_batch.py                 # 4,096 samples, batch 1,024, 2 epochs
    python examples/large_batch.py --samples 512 --batch 128 --epochs 1

Every step prints one line (loss, learning rate, seconds so far), so a run that takes a while shows it works.
"""

from __future__ import annotations

import argparse
import time

import torch

from kaisoku.models.zoo import build_model
from kaisoku.optim import large_batch


def main() -> None:
    """Train small-cnn on random 28x28 images with the recipe, one progress line per epoch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096, help="random training samples")
    parser.add_argument("--batch", type=int, default=1024, help="global batch")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the samples")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model("small-cnn", num_classes=10, in_channels=1)
    x, y = torch.randn(args.samples, 1, 28, 28), torch.randint(0, 10, (args.samples,))
    batch, epochs = args.batch, args.epochs
    steps = len(x) // batch
    optimizer, scheduler, loss_fn = large_batch(
        model, base_lr=0.1, batch=batch, epochs=epochs, steps_per_epoch=steps
    )
    print(
        f"small-cnn, {len(x):,} samples, batch {batch:,}: {steps} steps per epoch, {epochs} epochs",
        flush=True,
    )
    start = time.perf_counter()
    for epoch in range(epochs):
        for step, i in enumerate(range(0, steps * batch, batch)):
            loss = loss_fn(model(x[i : i + batch]), y[i : i + batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()  # once per optimizer step
            print(
                f"epoch {epoch + 1}/{epochs} step {step + 1}/{steps}: loss {loss.item():.4f}, "
                f"lr {scheduler.get_last_lr()[0]:.4f}, {time.perf_counter() - start:.1f} s",
                flush=True,
            )
    print(f"done: {epochs * steps} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

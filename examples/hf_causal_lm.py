"""A Hugging Face causal language model trained by ``kaisoku.fit`` on a ``datasets.Dataset``, as written.

The model is built from its config (no download): GPT-2 with 2 layers of width 64 over a 32-token vocabulary.
The data is an in-memory ``datasets.Dataset`` of token ids that count up by a step of the sequence's own
(learnable: the step is visible from the first two tokens). Each sample is ``{"input_ids", "attention_mask",
"labels"}``; kaisoku passes the batch to the model as keyword arguments and trains the loss the model returns.

    pip install -e '.[hf]'
    python examples/hf_causal_lm.py [--run-dir DIR] [--nproc 2] [--shard full] [--precision bf16] [--kfac]

The same parts by import path from the command line (run from this folder):

    kaisoku train --model.name hf_causal_lm:tiny_gpt2 --data.dataset hf_causal_lm:data \
        --train.metrics hf_causal_lm:next_token_accuracy --optim.name adamw --optim.lr 3e-3 \
        --data.global-batch 32 --data.workers 0
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

import kaisoku

VOCAB, LENGTH = 32, 16


def counting_dataset(count: int, seed: int) -> object:
    """``count`` sequences ``start, start + step, ...`` modulo VOCAB as a ``datasets.Dataset`` of torch tensors."""
    import datasets  # optional dependency: the hf extra

    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (count, 1), generator=generator)
    steps = torch.randint(1, 4, (count, 1), generator=generator)
    ids = (starts + steps * torch.arange(LENGTH)) % VOCAB
    table = {"input_ids": ids.tolist(), "attention_mask": [[1] * LENGTH] * count, "labels": ids.tolist()}
    return datasets.Dataset.from_dict(table).with_format("torch")


def data() -> tuple[object, object]:
    """512 training and 128 validation sequences (``--data.dataset hf_causal_lm:data``)."""
    return counting_dataset(512, 0), counting_dataset(128, 1)


def next_token_accuracy(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A metric of the user's: the batch's accuracy at predicting each token from those before it."""
    predicted = outputs.logits[:, :-1].argmax(-1)
    return (predicted == batch["labels"][:, 1:]).float().mean()


def tiny_gpt2() -> torch.nn.Module:
    """GPT-2 with 2 layers, 2 heads, width 64 (randomly initialised from its config)."""
    import transformers  # optional dependency: the hf extra

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def main(args: argparse.Namespace) -> None:
    """Train on every rank of the launch; rank 0 prints what was learned."""
    cfg = kaisoku.Config(run_dir=args.run_dir)
    cfg.data.global_batch, cfg.data.workers, cfg.train.epochs = 32, 0, args.epochs
    cfg.optim.name, cfg.optim.lr, cfg.sched.warmup_epochs = "adamw", 3e-3, 0.2
    cfg.parallel.shard, cfg.precision.mode, cfg.optim.kfac.enabled = args.shard, args.precision, args.kfac
    cfg.metrics.progress = False
    train, val = data()
    summary = kaisoku.fit(cfg, model=tiny_gpt2(), data=train, val_data=val, metrics=[next_token_accuracy])
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(
        f"hf causal lm: {summary['steps']} steps, token accuracy {summary['val_token_accuracy']:.1%}, "
        f"perplexity {summary['val_perplexity']:.2f}, next-token accuracy (own metric) "
        f"{summary['val_next_token_accuracy']:.1%}, {summary['tokens_per_s']:.0f} tokens/s",
        flush=True,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/hf-causal-lm")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=6)
    parser.add_argument("--shard", default="none", choices=["none", "full"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--kfac", action="store_true")
    arguments = parser.parse_args()
    try:
        import datasets  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as missing:
        print(
            f"kaisoku: error: this example needs {missing.name}: pip install -e '.[hf]'",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    kaisoku.launch(lambda: main(arguments), nproc=arguments.nproc)

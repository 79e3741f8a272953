"""The training engine: trainer, checkpoints, metrics."""

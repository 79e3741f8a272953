"""Batches and outputs as people's models take and give them: tensors, tuples, lists and dicts, nested.

A batch reaches the step as an ``(inputs, targets)`` pair. Datasets of ``(input, target)`` samples give the
two parts; datasets of dict samples (Hugging Face ``datasets``, most NLP code) give the whole batch dict as
both: the model is called with it as keyword arguments and a loss sees the whole batch, the labels under the
dataset's target key (``labels`` as Hugging Face names them). A model's output may be a tensor, a tuple, a
dict or an object with ``logits`` and ``loss`` attributes (a Hugging Face ``ModelOutput``); the model's own
loss is used when it gives one and the run names no loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

#: Where a dict sample's target is looked for, in this order (Hugging Face names it ``labels``).
TARGET_KEYS = ("labels", "label", "targets", "target", "y")
#: Token targets that take no part in the loss or the accuracy (Hugging Face's and torch's convention).
IGNORE_INDEX = -100


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (nested dicts, lists, tuples) on ``device``, copied without
    blocking the host; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple keeps its type
        return type(value)(*(to_device(item, device) for item in value))
    if isinstance(value, list | tuple):
        return type(value)(to_device(item, device) for item in value)
    return value


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value`` (depth first, in insertion order), if any."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list | tuple) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def batch_size(inputs: Any) -> int:
    """How many samples a batch holds: the first dimension of its first tensor."""
    tensor = first_tensor(inputs)
    return int(tensor.shape[0]) if tensor is not None and tensor.ndim > 0 else 1


def call_model(model: nn.Module, inputs: Any) -> Any:
    """The model's output for ``inputs``: a dict batch goes in as keyword arguments, anything else as the one
    positional argument."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)


def model_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned with its output (``outputs.loss`` or ``outputs["loss"]``), if any."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def logits_of(outputs: Any) -> torch.Tensor:
    """The predictions in a model's output: the tensor itself, ``logits`` (attribute or key), else the first
    tensor of a tuple, list or dict that is not the loss."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    found = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(outputs, Mapping):
        items = [value for key, value in outputs.items() if key != "loss"]
    else:
        items = list(outputs) if isinstance(outputs, list | tuple) else []
    tensor = first_tensor(items)
    if tensor is None:
        raise TypeError(f"the model's output ({type(outputs).__name__}) holds no tensor of predictions")
    return tensor


def labels_of(targets: Any, key: str | None) -> Any:
    """The labels in a batch's targets: the targets themselves, or the batch dict's entry ``key``."""
    if isinstance(targets, Mapping):
        return targets[key] if key is not None else None
    return targets

"""What a user hands kaisoku: their own model, dataset and loss, as Python objects or import paths.

From Python, :func:`kaisoku.fit` takes the objects. From the command line, ``--model.name pkg.mod:factory``,
``--data.dataset pkg.mod:factory`` and ``--train.loss pkg.mod:fn`` name them by import path, so every rank
imports them itself (the module must be importable there: the working directory and ``PYTHONPATH`` are).

- A model is an ``nn.Module`` instance, or a factory (a function or a module class) called with the run's
  :class:`ModelSpec` when it takes one argument, else with none. Pipeline parallelism (``parallel.pp``)
  needs the model's ordered blocks: an ``nn.Sequential``, or a model with an ``ordered_blocks()`` method.
- A dataset is a map-style ``torch.utils.data.Dataset`` of ``(input, target)`` pairs or of dicts, or a
  factory returning one or a ``(train, val)`` pair. The task is read from the targets (``train.task``):
  integer scalars classification, integer sequences token classification (or a causal language model),
  floats regression; dicts with no target train on the user's loss alone (loss-only).
- A loss is a callable ``loss(outputs, targets) -> scalar tensor`` (``targets`` is the whole batch for dict
  samples); without one, the model's own loss where its output carries one, else cross-entropy or mean
  squared error.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from kaisoku.engine.user_metrics import named_metrics
from kaisoku.errors import ConfigError

#: A model, or what builds one from the run's :class:`ModelSpec`.
ModelSource = nn.Module | Callable[..., nn.Module]
#: A loss of outputs against targets.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """What the resolved run plan says the model takes and gives; a user's model factory receives it."""

    sample_shape: tuple[int, ...]
    """One input sample's shape, without the batch dimension."""
    num_classes: int
    """Classes (classification) or targets (regression); 0 where the data does not say."""
    in_channels: int
    """Channels of an input sample (its first dimension for images and volumes)."""
    task: str
    """classification or regression."""


@dataclass
class UserParts:
    """The user's own model, data and loss; any of them may be None (kaisoku's own is used)."""

    model: ModelSource | None = None
    train_data: Dataset | None = None
    val_data: Dataset | None = None
    loss: LossFn | None = None
    collate: Callable[[list[Any]], Any] | None = None
    """Makes a batch of a list of the dataset's samples (None: torch's default collate)."""
    metrics: dict[str, Any] | None = None
    """The user's validation metrics by name (:mod:`kaisoku.engine.user_metrics`); None: none."""

    def merged(self, other: UserParts) -> UserParts:
        """These parts, with ``other``'s filling what these leave out."""
        return UserParts(
            model=self.model if self.model is not None else other.model,
            train_data=self.train_data if self.train_data is not None else other.train_data,
            val_data=self.val_data if self.val_data is not None else other.val_data,
            loss=self.loss if self.loss is not None else other.loss,
            collate=self.collate if self.collate is not None else other.collate,
            metrics=self.metrics if self.metrics is not None else other.metrics,
        )


def is_import_path(name: str) -> bool:
    """Whether a config value names an object by import path (``package.module:name``)."""
    return ":" in name


def load_object(path: str, key: str) -> Any:
    """The object ``package.module:name`` names; a one-line ConfigError naming ``key`` when it cannot load."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{key}: '{path}' is not an import path of the form package.module:name")
    # ``python -m kaisoku`` finds modules in the working directory, the ``kaisoku`` console script would not:
    # put it on the path, last, so that both read import paths alike and nothing installed is shadowed.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"{key}: cannot import {module_name} ({error}); run from the folder that holds it or add it "
            "to PYTHONPATH"
        ) from None
    except Exception as error:  # the user's module raised while importing: say so in one line
        raise ConfigError(f"{key}: importing {module_name} failed: {type(error).__name__}: {error}") from None
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: {module_name} has no {attribute}")
        obj = getattr(obj, part)
    return obj


def _call_factory(factory: Callable[..., Any], argument: Any, key: str) -> Any:
    """``factory(argument)`` when it takes a positional argument, else ``factory()``."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        parameters = []  # a builtin or C callable: call it without arguments
    takes = any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) and p.default is p.empty
        for p in parameters
    )
    try:
        return factory(argument) if takes else factory()
    except ConfigError:
        raise
    except Exception as error:
        name = getattr(factory, "__qualname__", repr(factory))
        raise ConfigError(f"{key}: {name} failed: {type(error).__name__}: {error}") from error


def build_user_model(source: ModelSource, spec: ModelSpec) -> nn.Module:
    """The user's model for ``spec``: the instance itself, or what the factory returns."""
    if isinstance(source, nn.Module):
        return source
    model = _call_factory(source, spec, "model")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _as_datasets(obj: Any, key: str) -> tuple[Dataset, Dataset | None]:
    """A dataset, or a (train, val) pair, as (train, val); a one-line ConfigError for anything else."""
    if isinstance(obj, tuple) and len(obj) == 2:
        train, val = obj
    else:
        train, val = obj, None
    for what, item in (("training", train), ("validation", val)):
        if item is None and what == "validation":
            continue
        if not (hasattr(item, "__getitem__") and hasattr(item, "__len__")):
            raise ConfigError(
                f"{key}: the {what} dataset is a {type(item).__name__}; give a map-style Dataset "
                "(with __getitem__ and __len__) of (input, target) pairs"
            )
    return train, val


def parts_from_config(
    model_name: str, dataset: str, loss: str, collate: str = "", metrics: Sequence[str] = ()
) -> UserParts:
    """The parts that ``model.name``, ``data.dataset``, ``train.loss``, ``data.collate`` and ``train.metrics``
    name by import path (others None)."""
    parts = UserParts()
    if metrics:
        names = [path.partition(":")[2].split(".")[-1] for path in metrics]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            raise ConfigError(f"train.metrics: two metrics are named {twice!r}; give each its own name")
        parts.metrics = named_metrics({name: _metric_at(path) for name, path in zip(names, metrics)})
    if collate:
        fn = load_object(collate, "data.collate")
        if not callable(fn):
            raise ConfigError(f"data.collate: {collate} is a {type(fn).__name__}, not a callable")
        parts.collate = fn
    if is_import_path(model_name):
        source = load_object(model_name, "model.name")
        if not (isinstance(source, nn.Module) or callable(source)):
            raise ConfigError(
                f"model.name: {model_name} is a {type(source).__name__}, not a model or factory"
            )
        parts.model = source
    if dataset:
        obj = load_object(dataset, "data.dataset")
        if callable(obj) and not isinstance(obj, Dataset):
            obj = _call_dataset_factory(obj)
        parts.train_data, parts.val_data = _as_datasets(obj, "data.dataset")
    if is_import_path(loss):
        fn = load_object(loss, "train.loss")
        if isinstance(fn, type):
            fn = fn()  # a loss module class, e.g. torch.nn.CrossEntropyLoss
        if not callable(fn):
            raise ConfigError(f"train.loss: {loss} is a {type(fn).__name__}, not a callable loss")
        parts.loss = fn
    return parts


def _metric_at(path: str) -> Any:
    """The metric an import path names: a function, a torchmetrics metric, or a metric class (instantiated
    with no arguments)."""
    metric = load_object(path, "train.metrics")
    if isinstance(metric, type):
        try:
            metric = metric()
        except Exception as error:
            raise ConfigError(
                f"train.metrics: {path}() failed: {type(error).__name__}: {error}; name an instance made "
                "with its arguments instead"
            ) from None
    return metric


def _call_dataset_factory(factory: Callable[..., Any]) -> Any:
    """A dataset factory's result (it takes no arguments)."""
    try:
        return factory()
    except ConfigError:
        raise
    except Exception as error:
        name = getattr(factory, "__qualname__", repr(factory))
        raise ConfigError(f"data.dataset: {name} failed: {type(error).__name__}: {error}") from error


def check_user_parts(parts: UserParts) -> None:
    """Python-given parts of the right kind (the same one-line errors as import paths get)."""
    if parts.model is not None and not (isinstance(parts.model, nn.Module) or callable(parts.model)):
        raise ConfigError(f"model: a {type(parts.model).__name__} is not a torch.nn.Module or a factory")
    if parts.train_data is not None:
        _as_datasets((parts.train_data, parts.val_data), "data")
    if parts.loss is not None and not callable(parts.loss):
        raise ConfigError(f"loss: a {type(parts.loss).__name__} is not callable")
    if parts.collate is not None and not callable(parts.collate):
        raise ConfigError(f"collate_fn: a {type(parts.collate).__name__} is not callable")
    if parts.metrics is not None:
        named_metrics(parts.metrics)  # the same one-line refusals for Python's metrics as for import paths

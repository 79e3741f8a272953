"""What a run plan is resolved from: the facts of the data and of the model, gathered, and :func:`plan_run`.

:func:`describe_data` reads a packed index, an image folder's classes or the user's first sample;
:func:`describe_model` builds the model on the meta device for its blocks and layer names. These read
files and import the user's code, so they live apart from the pure :func:`kaisoku.run_plan.resolve`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisoku.config import Config, validate
from kaisoku.data.datagen import CLASSES as SHAPES_CLASSES
from kaisoku.data.loading.loader import packed_splits
from kaisoku.data.shards.format import read_index
from kaisoku.data.shards.sources import class_folders, image_folder_splits
from kaisoku.distributed.env import inside_slurm_step, inside_torchrun, planned_world_size, world_from_env
from kaisoku.engine.structures import TARGET_KEYS, first_tensor
from kaisoku.errors import ConfigError, KaisokuError
from kaisoku.facts import BatchForm, DataFacts, DataSource, ModelFacts, TaskKind, WorldShape
from kaisoku.models.blocks import ordered_blocks
from kaisoku.models.zoo import build_model, is_zoo_model
from kaisoku.parts import ModelSpec, UserParts, build_user_model
from kaisoku.precision.quant import quantizable_layers
from kaisoku.run_plan import RunPlan, resolve


def generated_source(cfg: Config) -> DataSource:
    """Which generated set a config without data.path trains on."""
    return "generated-cosmo" if cfg.model.name == "cosmoflow" else "generated-shapes"


def describe_data(cfg: Config, parts: UserParts | None = None) -> DataFacts:
    """The facts of ``cfg``'s training data: the user's dataset, a packed index, an image folder, or the
    generated set (known without generating it). One-line ConfigError for a missing or unusable path."""
    if parts is not None and parts.train_data is not None:
        own_loss = parts.loss is not None
        return describe_user_data(parts.train_data, parts.val_data, cfg.model.num_classes, own_loss=own_loss)
    if not cfg.data.path:
        if generated_source(cfg) == "generated-cosmo":
            size = cfg.data.image_size
            return DataFacts(
                source="generated-cosmo",
                task="regression",
                sample_shape=(4, size, size, size),
                in_channels=4,
                num_classes=4,
                has_val=True,
                description="the generated universe set (regression)",
            )
        return DataFacts(
            source="generated-shapes",
            num_classes=len(SHAPES_CLASSES),
            has_val=True,
            description="the generated shapes set: 2D images (classification)",
        )
    path = Path(cfg.data.path).expanduser()
    if not path.exists():
        raise ConfigError(f"data.path {cfg.data.path} does not exist; point it at a dataset folder")
    if not path.is_dir():
        raise ConfigError(f"data.path {cfg.data.path} is not a folder of class sub-folders")
    packed = packed_splits(path)
    if packed is None:
        return DataFacts(
            source="folder",
            num_classes=len(class_folders(path / "train" if image_folder_splits(path) else path)),
            has_val=True,
            root=str(path),
            description=f"data.path {path} holds 2D images (classification)",
        )
    try:
        index = read_index(packed[0])
    except KaisokuError:
        # A damaged index is a data failure, said where the data is opened (exit 3, with a run folder).
        return DataFacts(source="packed", readable=False, root=str(path), description=f"data.path {path}")
    task = "regression" if index.task == "regression" else "classification"
    stored = next((list(f.shape or []) for f in index.fields if f.name in ("x", "image")), [])
    facts: dict[str, Any] = {}
    if task == "regression":
        volume = next(
            (f.shape for f in index.fields if f.name != index.target and f.shape and len(f.shape) == 4), None
        )
        if volume is None:
            shapes = ", ".join(f"{f.name} {list(f.shape or [])}" for f in index.fields)
            raise ConfigError(
                f"{index.root} is a regression set without a volume field [C, D, D, D] (fields: {shapes}); "
                "generate one with kaisoku datagen DIR --kind cosmo"
            )
        target = index.field(str(index.target))
        facts = {
            "sample_shape": tuple(int(d) for d in volume),
            "in_channels": int(volume[0]),
            "num_classes": int(torch.Size(target.shape or (1,)).numel()),
        }
    else:
        image = next((f for f in index.fields if f.name == "image"), None)
        channels = 3
        if image is not None and image.kind == "array" and image.shape is not None:
            channels = 1 if len(image.shape) == 2 else int(image.shape[-1])
        labels = index.columns.get("label")
        top = int(labels.max()) + 1 if labels is not None and len(labels) else 0
        facts = {"in_channels": channels, "num_classes": len(index.classes or ()) or top}
    kind = "volumes" if task == "regression" else "images"
    if packed[1] is not None:
        try:
            facts["val_samples"] = read_index(packed[1]).num_samples
        except KaisokuError:
            pass  # a damaged validation index is said where the data is opened
    return DataFacts(
        source="packed",
        task=task,
        num_samples=index.num_samples,
        has_val=packed[1] is not None,
        root=str(path),
        description=f"data.path {path} holds {kind} {stored} ({task})",
        **facts,
    )


def describe_user_data(train: Any, val: Any | None, num_classes: int, *, own_loss: bool = False) -> DataFacts:
    """The facts of a user's map-style dataset, from its first sample: ``(input, target)`` pairs, or dicts
    (the model then takes the batch as keyword arguments; the target is the entry named ``labels``,
    ``label``, ``targets``, ``target`` or ``y``; a dict with none of them trains on the user's own loss,
    ``own_loss``, which sees the whole batch: the ``loss-only`` task)."""
    if len(train) == 0:
        raise ConfigError("data: the training dataset is empty")
    try:
        sample = train[0]
    except Exception as error:
        raise ConfigError(
            f"data: reading the first training sample failed: {type(error).__name__}: {error}"
        ) from error
    target_key: str | None = None
    target: torch.Tensor | None = None
    causal = False
    batch_form: BatchForm
    if isinstance(sample, Mapping):
        target_key = next((key for key in TARGET_KEYS if key in sample), None)
        if target_key is None and not own_loss:
            raise ConfigError(
                f"data: a sample is a dict with keys {', '.join(map(repr, sample))} and no target; name it "
                f"{' or '.join(map(repr, TARGET_KEYS[:2]))} (the model gets the batch as keyword arguments), "
                "or give a loss of your own, which sees the whole batch"
            )
        first = sample.get("input_ids", next((v for k, v in sample.items() if k != target_key), None))
        inputs = _leading_tensor(first, "input")
        batch_form = "dicts"
        form = f"dict samples ({', '.join(sample)}) as keyword arguments"
        if target_key is None:
            form += ", no target: your loss sees the whole batch"
        else:
            target = _leading_tensor(sample[target_key], "target")
            causal = (
                target_key == "labels"
                and "input_ids" in sample
                and torch.equal(_leading_tensor(sample["input_ids"], "input"), target)
            )
            form += f", target {target_key!r}"
    elif isinstance(sample, (tuple, list)) and len(sample) == 2:
        # The input may be any nesting of tensors (a dict goes to the model as keyword arguments): its first
        # tensor stands for it here.
        inputs, target = _leading_tensor(sample[0], "input"), _leading_tensor(sample[1], "target")
        nested = isinstance(sample[0], (Mapping, list, tuple))
        batch_form = "nested-pairs" if nested else "pairs"
        form = "(input, target) pairs" + (" with a nested input" if nested else "")
    else:
        raise ConfigError(
            f"data: a sample is a {type(sample).__name__}; the dataset must give (input, target) pairs or "
            "dicts holding a 'labels' entry"
        )
    task = _task_of(target, causal)
    classes = getattr(train, "classes", None)
    if target is None:
        count = 0
    elif task == "regression":
        count = max(1, target.numel())
    else:
        count = num_classes or (len(classes) if isinstance(classes, (list, tuple)) else 0)
    shape = tuple(int(d) for d in inputs.shape)
    return DataFacts(
        source="user",
        task=task,
        sample_shape=shape,
        in_channels=shape[0] if shape else 1,
        num_classes=count,
        num_samples=len(train),
        has_val=val is not None,
        target_key=target_key,
        batch_form=batch_form,
        tokens_per_sample=inputs.numel() if inputs.ndim >= 1 and not inputs.is_floating_point() else 0,
        val_samples=len(val) if val is not None else 0,
        description=f"the given dataset of {len(train)} {form}, input {list(shape)} {inputs.dtype} ({task})",
    )


def _task_of(target: torch.Tensor | None, causal: bool) -> TaskKind:
    """The task a first sample's target says: none (a dict only the user's loss reads) loss-only, an integer
    scalar classification, integers per token token-classification (language-model where the labels are the
    input ids), floats regression."""
    if target is None:
        return "loss-only"
    if target.is_floating_point() or target.is_complex():
        return "regression"
    if target.ndim == 0:
        return "classification"
    return "language-model" if causal else "token-classification"


def _leading_tensor(value: Any, what: str) -> torch.Tensor:
    """``value`` as a tensor (a number, an array), or the first tensor of a nested tuple, list or dict."""
    found = first_tensor(value) if isinstance(value, (Mapping, list, tuple)) else None
    if found is not None:
        return found
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(
            f"data: a sample's {what} is a {type(value).__name__} holding no tensor, array or number"
        ) from None


def model_spec(cfg: Config, data: DataFacts) -> ModelSpec:
    """What the model must take and give, from the data's facts and ``model.*``."""
    size = cfg.data.image_size
    shape = data.sample_shape or (data.in_channels, size, size)
    return ModelSpec(
        sample_shape=tuple(shape),
        num_classes=cfg.model.num_classes or data.num_classes,
        in_channels=data.in_channels,
        task=data.task,
    )


def build_zoo_model(cfg: Config, spec: ModelSpec) -> nn.Module:
    """``model.name`` from kaisoku's zoo for ``spec`` (on the current default device)."""
    return build_model(
        cfg.model.name,
        num_classes=spec.num_classes,
        stem=cfg.model.stem,
        zero_init_residual=cfg.model.zero_init_residual,
        bn_momentum=cfg.model.bn_momentum,
        in_channels=spec.in_channels,
        size=spec.sample_shape[-1],
        width=cfg.model.width,
    )


def make_model(cfg: Config, spec: ModelSpec, parts: UserParts | None = None) -> nn.Module:
    """The run's model: the user's (an instance or a factory called with ``spec``), else the zoo's."""
    if parts is not None and parts.model is not None:
        return build_user_model(parts.model, spec)
    return build_zoo_model(cfg, spec)


def describe_model(cfg: Config, data: DataFacts, parts: UserParts | None = None) -> ModelFacts:
    """The facts of the run's model, built on the meta device (no memory, no initialisation cost)."""
    spec = model_spec(cfg, data)
    if parts is None or parts.model is None:
        if not is_zoo_model(cfg.model.name):
            build_model(cfg.model.name, num_classes=1)  # the one-line error listing the choices
        if spec.task == "classification" and spec.num_classes < 1 and data.readable:
            raise ConfigError(
                f"model.num_classes: {data.description or 'the dataset'} does not say how many classes it "
                "has; set model.num_classes"
            )
    if parts is not None and isinstance(parts.model, nn.Module):
        model = parts.model
    else:
        # Built only to count its blocks and name its layers: nothing is initialised, so init warnings
        # (e.g. a zero-class head while the index is unreadable) say nothing about the run.
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = make_model(cfg, spec, parts)
        except ConfigError:
            if parts is None or parts.model is None:
                raise
            # A factory that computes with real tensors (e.g. reads a value) cannot run on the meta
            # device; built for real instead, its own errors still say what failed.
            model = make_model(cfg, spec, parts)
    try:
        count: int | None = len(ordered_blocks(model))
        reason = ""
    except KaisokuError as error:
        count, reason = None, str(error)
    layers = tuple(quantizable_layers(model))
    return ModelFacts(spec=spec, block_count=count, block_error=reason, layer_names=layers)


def planned_world(nproc: int, nnodes: int = 1) -> WorldShape:
    """The world a run will have: the launcher's inside torchrun or a Slurm step, else ``nproc`` ranks on
    each of ``nnodes`` hosts (``nproc`` 0: one per GPU, else 2)."""
    if inside_torchrun() or inside_slurm_step():
        world = world_from_env()
        return WorldShape(world.world_size, world.local_world_size)
    per_node = planned_world_size(nproc)
    return WorldShape(per_node * max(1, nnodes), per_node)


def plan_run(cfg: Config, world: WorldShape | int | None = None, parts: UserParts | None = None) -> RunPlan:
    """Gather the data and model facts of ``cfg`` (and the user's ``parts``) and :func:`resolve` it.

    ``world`` is the world the run will have, or its size (all ranks on one node), or None where it is not
    known yet (the layouts are then checked as far as they can be).
    """
    shape = WorldShape(world, world) if isinstance(world, int) else world
    data = describe_data(cfg, parts)
    own_loss = parts is not None and parts.loss is not None
    return resolve(cfg, shape, data, describe_model(cfg, data, parts), own_loss=own_loss)


def check_config(
    cfg: Config, world: WorldShape | int | None = None, parts: UserParts | None = None
) -> RunPlan:
    """Everything ``kaisoku train`` checks before launch: each section's fields, then the plan."""
    validate(cfg)
    return plan_run(cfg, world, parts)

"""``kaisoku ckpt convert SRC DEST``: a sharded checkpoint folder into one single-file checkpoint, and back.

Both forms hold the same state and resume the same run bit-identically on any layout. A folder
(``step-XXXXXXXX/``: model and optimizer shards plus ``trainer.pt``) becomes a file (``step-XXXXXXXX.pt``)
holding whole tensors and the optimizer's own numbered state dict, as a data-parallel run writes it; a file
(a data-parallel or a pipeline run's) becomes a folder of one shard that any shard layout reads. Torch's
converters do the shard I/O (:mod:`kaisoku.distributed.sharded_checkpoint`); this module moves the optimizer state between its numbered
and named forms (parameter names come from the ``param_names`` every kaisoku optimizer group lists) and
keeps the rest of the trainer's state (data order, RNG, step, scheduler) as it is. DEST appears only when
complete: a file through temp + fsync + rename, a folder written as ``.DEST.tmp`` and renamed. The source is
verified first (its content checksums; a damaged one is refused, exit 3) and DEST carries checksums of its own.

``kaisoku ckpt verify PATH`` checks a checkpoint, or every checkpoint of a run folder, without loading a model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kaisoku.distributed.named_state import named_from_torch_optimizer_state, with_param_names
from kaisoku.distributed.sharded_checkpoint import UnreadableCheckpointError, read_whole, write_whole
from kaisoku.engine.checkpoint import (
    CheckpointManager,
    checkpoint_step,
    remove,
    write_checkpoint_file,
    write_trainer_file,
)
from kaisoku.engine.checksums import write_folder_checksums
from kaisoku.errors import ConfigError, KaisokuError
from kaisoku.fsutil import fsync_dir, write_failure

_PROG = "kaisoku ckpt convert"


def numbered_optimizer_state(named: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's optimizer state (parameters named) as ``Optimizer.state_dict()`` numbers them:
    in group order, from 0."""
    index: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    return {"state": {index[name]: slots for name, slots in named["state"].items()}, "param_groups": groups}


def named_optimizer_state(numbered: dict[str, Any]) -> dict[str, Any]:
    """``Optimizer.state_dict()`` in the form a sharded checkpoint holds it: parameters named, each group
    still listing its ``param_names`` (what the reading optimizer's own groups hold)."""
    return with_param_names(named_from_torch_optimizer_state(numbered))


def convert_checkpoint(source: Path, destination: Path) -> str:
    """Convert the checkpoint ``source`` (folder or file) into the other form at ``destination``; one line
    saying what was written. ConfigError (exit 2) for a ``source`` that is not a complete kaisoku checkpoint
    or a ``destination`` that exists."""
    if not source.exists():
        raise ConfigError(f"{_PROG}: {source} does not exist; give a checkpoint folder or .pt file")
    if destination.exists():
        raise ConfigError(f"{_PROG}: {destination} exists; remove it or choose another destination")
    try:
        state = CheckpointManager.load(source)
    except UnreadableCheckpointError as error:  # damaged: exit 3, as for other damaged data
        raise UnreadableCheckpointError(f"{_PROG}: {error}") from None
    except KaisokuError as error:
        raise ConfigError(f"{_PROG}: {error}") from None
    step = int(state["step"])
    if source.is_dir():
        _to_single_file(source, state, destination)
        return (
            f"wrote single-file checkpoint {destination} (step {step}) from the sharded checkpoint {source}"
        )
    if "layout" in state:
        # A pipeline run's file names its parameters already (the layout-independent form); the folder
        # holds no layout: any layout reads it.
        optimizer = with_param_names(state["optimizer"])
        state = {key: value for key, value in state.items() if key != "layout"}
    else:
        try:
            optimizer = named_optimizer_state(state["optimizer"])
        except KaisokuError as error:
            raise ConfigError(f"{_PROG}: {source}: {error}") from None
    _to_folder(state, optimizer, destination)
    return f"wrote sharded checkpoint {destination} (step {step}) from the single-file checkpoint {source}"


def _to_single_file(source: Path, state: dict[str, Any], destination: Path) -> None:
    """The shards of ``source`` read whole, written with ``state`` (its ``trainer.pt``) as one file."""
    scratch = destination.parent / f".{destination.name}.whole.tmp"
    rest = {key: value for key, value in state.items() if key not in ("sharded", "sharded_dir")}
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        try:
            whole = read_whole(source, scratch)
        except KaisokuError as error:  # a missing or damaged shard file
            raise ConfigError(f"{_PROG}: {error}") from None
        single = {"model": whole["model"], "optimizer": numbered_optimizer_state(whole["optimizer"]), **rest}
        write_checkpoint_file(destination, single)
    except OSError as error:
        raise write_failure(error, destination, "the converted checkpoint") or error from None
    finally:
        scratch.unlink(missing_ok=True)


def _to_folder(state: dict[str, Any], optimizer: dict[str, Any], destination: Path) -> None:
    """``state`` as a sharded checkpoint folder of one shard (written as ``.DEST.tmp``, then renamed)."""
    tmp = destination.parent / f".{destination.name}.tmp"
    try:
        remove(tmp)  # a killed conversion's leftovers
        tmp.mkdir(parents=True)
        write_whole({"model": state["model"], "optimizer": optimizer}, tmp)
        write_trainer_file(tmp, state)
        write_folder_checksums(tmp)
        os.replace(tmp, destination)
        fsync_dir(destination.parent)
    except BaseException as error:
        remove(tmp)
        if isinstance(error, OSError):
            raise write_failure(error, destination, "the converted checkpoint") or error from None
        raise


def verify_checkpoints(target: Path) -> tuple[list[str], bool]:
    """Check the checkpoint ``target`` (a file or sharded folder), or every checkpoint of a run folder or its
    ``checkpoints/`` folder: one line each, and whether all are sound. ConfigError for a path that holds
    none."""
    if not target.exists():
        raise ConfigError(f"kaisoku ckpt verify: {target} does not exist; give a checkpoint or a run folder")
    if checkpoint_step(target) >= 0 or target.suffix == ".pt":
        paths = [target]
    else:
        folder = target / "checkpoints" if (target / "checkpoints").is_dir() else target
        paths = CheckpointManager(folder, keep=1).list()
    if not paths:
        raise ConfigError(f"kaisoku ckpt verify: {target} holds no checkpoint")
    lines, sound = [], True
    for path in paths:
        try:
            state = CheckpointManager.load(path)
            lines.append(f"ok       {path} (step {int(state['step'])})")
        except KaisokuError as error:
            sound = False
            lines.append(f"damaged  {path}: {error}")
    return lines, sound

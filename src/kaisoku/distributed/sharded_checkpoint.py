"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), readable on any other layout.

Every rank writes its own shards of the model and optimizer state into one folder; DCP's metadata records
each tensor's global shape and the pieces, so any layout can read it back: another shard count or
replica count (resharded on load), plain data parallelism, or a single rank without a process group. Model
and optimizer state are keyed by parameter name, so the parameter order of the reader does not matter.
A single-file data-parallel checkpoint (whole tensors, the optimizer's own id-keyed state) loads into a
sharded model too (:func:`load_full_into_sharded`). Folder naming and atomicity are
:class:`kaisoku.engine.checkpoint.CheckpointManager`'s. :func:`read_whole` and :func:`write_whole` move a
checkpoint between the two forms in one process, with no model and no process group (``kaisoku ckpt
convert``). :class:`BackgroundSaver` writes the shards while training goes on (``checkpoint.async_save``).

DCP keeps no checksums: kaisoku adds its own (``checksums.json``, :mod:`kaisoku.engine.checksums`). A damaged
folder is also found by :func:`check_shard_files` (a shard file missing or cut short, from the metadata and
the files' sizes) or by the load itself (a piece that does not load; DCP's ``CheckpointException``, a
BaseException, becomes :class:`UnreadableCheckpointError` naming the folder and the file).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from kaisoku.distributed import env
from kaisoku.distributed.named_state import is_named_optimizer_state, with_param_names
from kaisoku.errors import DamagedDataError, KaisokuError

#: The file DCP writes last, once every rank's shards are in place: a folder without it is incomplete.
METADATA_FILE = ".metadata"


class UnreadableCheckpointError(DamagedDataError):
    """A checkpoint that is damaged or incomplete (not one of another model): an older one may still load.

    Raised alike on every rank by a sharded load (DCP gathers each rank's read failures), so that
    ``--resume auto`` can move on to an older checkpoint on all ranks together. Exit code 3, as for other
    damaged data.
    """


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported on first use: it takes about 1.7 s to import, and every
    process that imports the engine would pay it, sharded or not (start-up time)."""
    import torch.distributed.checkpoint as dcp  # in-function: start-up time (see the docstring)
    import torch.distributed.checkpoint.format_utils
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (the submodules used below)

    return dcp


def sharded_state(model: nn.Module, optimizer: Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state, optimizer_state)`` keyed by parameter name; sharded parameters stay DTensor shards."""
    return _dcp().state_dict.get_state_dict(model, optimizer)


def save_sharded(state: dict[str, Any], folder: Path) -> None:
    """Write ``state`` (tensors, DTensor shards, small objects) into ``folder``: every rank its own file,
    fsynced; rank 0 writes the metadata last. A collective: every rank calls it with its own shards."""
    dcp = _dcp()
    writer = dcp.FileSystemWriter(folder, sync_files=True, thread_count=1)
    try:
        with _single_process_is_intended():
            dcp.save(state, storage_writer=writer)
    except dcp.api.CheckpointException as error:
        raise save_failure(error) from error


def save_failure(error: BaseException) -> BaseException:
    """A failed DCP save as an ordinary exception: DCP's CheckpointException derives from BaseException (no
    ``except Exception`` sees it) and wraps each rank's failure. The first rank's file-system error where
    one has it (a full or read-only disk), else a RuntimeError with the first failure's message; any other
    exception as it is."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return error
    causes = [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
    causes = [cause for cause in causes if isinstance(cause, BaseException)]
    for cause in causes:
        if isinstance(cause, OSError):
            return cause
    return RuntimeError(str(causes[0]) if causes else str(error))


class BackgroundSaver:
    """Sharded saves that run in a background thread (``dcp.async_save``) while training goes on.

    The state is first copied into fresh CPU memory (DCP's staging, before :meth:`start` returns), so the
    steps that follow do not change what is written. The save's own collectives (planning, the metadata)
    run over a gloo group of their own, created on the first save: on the training group they would
    interleave with the step's collectives from another thread.
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None

    def start(self, state: dict[str, Any], folder: Path) -> Future:
        """Begin writing ``state`` into ``folder`` (a collective, as :func:`save_sharded`); the future is done
        once this rank's shards are written, and on rank 0 once the metadata is too."""
        if self._group is None:
            self._group = env.background_group()
        dcp = _dcp()
        writer = dcp.FileSystemWriter(folder, sync_files=True, thread_count=1)
        started = dcp.async_save(state, storage_writer=writer, process_group=self._group)
        # A stager that stages asynchronously answers with two futures; the write's is the one to wait for.
        return started if isinstance(started, Future) else started.upload_completion


def read_whole(folder: Path, scratch: Path) -> dict[str, Any]:
    """Every tensor and object of the sharded checkpoint ``folder`` as whole tensors (``{"model",
    "optimizer"}`` as :func:`sharded_state` keyed them), read by one process with no process group.

    ``scratch``: a file path for torch's own converter (``dcp_to_torch_save``) to write the whole state
    into; it is memory-mapped back, so the state is never held twice in memory, and removed by the caller.
    """
    dcp = _dcp()
    check_shard_files(folder)
    try:
        with _single_process_is_intended():
            dcp.format_utils.dcp_to_torch_save(folder, scratch)
    except dcp.api.CheckpointException as error:  # a BaseException: each rank's failure wrapped
        raise unreadable(folder, error) from None
    return torch.load(scratch, map_location="cpu", weights_only=True, mmap=True)


def write_whole(state: dict[str, Any], folder: Path) -> None:
    """Write ``state`` (whole tensors, keyed as :func:`sharded_state` keys them) into ``folder`` as a sharded
    checkpoint of one shard, from one process with no process group (what torch's ``torch_save_to_dcp``
    does, without its unsafe load of a file); any layout reads it as it reads any other."""
    dcp = _dcp()
    writer = dcp.FileSystemWriter(folder, sync_files=True, thread_count=1)
    with _single_process_is_intended():
        dcp.save(state, storage_writer=writer, no_dist=True)


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence torch's two-line warning that it assumes one process where no process group is up: a
    sharded checkpoint written or read by one rank (or by ``kaisoku ckpt``) is meant to be."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _storage_files(folder: Path) -> tuple[Any, dict[str, int]]:
    """The folder's DCP metadata and, for each shard file it names, the bytes that file must hold."""
    dcp = _dcp()
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except FileNotFoundError:
        raise UnreadableCheckpointError(f"checkpoint {folder} is incomplete (no {METADATA_FILE})") from None
    except Exception as error:  # pickle raises several types for a damaged file
        raise UnreadableCheckpointError(
            f"checkpoint {folder} is corrupt or unreadable ({METADATA_FILE}: {type(error).__name__})"
        ) from None
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return metadata, sizes


def check_shard_files(folder: str | Path) -> None:
    """UnreadableCheckpointError naming the file when a shard file that the metadata of the sharded checkpoint
    ``folder`` lists is missing or shorter than the pieces it records (a copy or disk cut short).

    Reads the metadata and the files' sizes only: cheap enough to run on every checkpoint considered."""
    folder = Path(folder)
    _, sizes = _storage_files(folder)
    for name, needed in sorted(sizes.items()):
        try:
            held = (folder / name).stat().st_size
        except FileNotFoundError:
            raise UnreadableCheckpointError(
                f"checkpoint {folder} is incomplete (its shard file {name} is missing)"
            ) from None
        if held < needed:
            raise UnreadableCheckpointError(
                f"checkpoint {folder} is corrupt or unreadable (its shard file {name} is cut short: "
                f"{held} of {needed} bytes)"
            )


def _first_unreadable_file(folder: Path) -> str | None:
    """The first shard file of ``folder`` holding a piece that does not load (None: each one loads).

    Reads every piece once, one at a time: only after a load failed, to name the file."""
    try:
        metadata, _ = _storage_files(folder)
    except KaisokuError:
        return METADATA_FILE
    pieces = sorted(
        (info.relative_path, info.offset, info.length) for info in (metadata.storage_data or {}).values()
    )
    for name, offset, length in pieces:
        try:
            with open(folder / name, "rb") as handle:
                handle.seek(offset)
                piece = handle.read(length)
        except OSError:
            return name
        # Tensors and small objects alike are torch.save archives (a zip file each); an object's classes may
        # be ones weights_only refuses to build, which says that the archive itself read.
        if not piece.startswith(_ZIP_MAGIC):
            return name
        try:
            torch.load(io.BytesIO(piece), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any other failure to load names the file
            if "Unsupported global" not in str(error):
                return name
    return None


#: How every torch.save archive begins (a zip file's local header).
_ZIP_MAGIC = b"PK\x03\x04"


def unreadable(folder: str | Path, error: BaseException) -> UnreadableCheckpointError:
    """The one-line error of DCP's ``CheckpointException`` (every rank's failures) reading ``folder``."""
    failures = getattr(error, "failures", {}) or {}
    # Each failure is torch's (exception, stack) pair.
    causes = [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
    why = ", ".join(sorted({type(cause).__name__ for cause in causes})) or type(error).__name__
    name = _first_unreadable_file(Path(folder))
    where = f" in {name}" if name else ""
    return UnreadableCheckpointError(
        f"checkpoint {folder} is corrupt or unreadable ({why} reading its shards{where})"
    )


def _read_into(folder: str | Path, model: nn.Module, optimizer: Optimizer) -> tuple[dict, dict]:
    """This model's and optimizer's state, read from the sharded checkpoint ``folder`` into their layout."""
    # The templates say which pieces this rank needs; an optimizer without state yet gets it by a
    # zero-learning-rate step inside get_state_dict (then overwritten here).
    model_state, optimizer_state = _dcp().state_dict.get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    _load(folder, state)
    return state["model"], state["optimizer"]


def _load(folder: str | Path, state: dict[str, Any]) -> None:
    """Read what the template ``state`` holds from the sharded checkpoint ``folder``: tensors in place (a
    DTensor: this rank's pieces), other values replaced. A collective; damage raises alike on every rank."""
    dcp = _dcp()
    check_shard_files(folder)
    try:
        with _single_process_is_intended():
            dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
    except dcp.api.CheckpointException as error:  # a BaseException; raised alike on every rank
        raise unreadable(folder, error) from None


#: How the optimizer's entries of a sharded checkpoint are keyed once DCP flattens them.
_OPTIMIZER_STATE = "optimizer.state."
_PARAM_GROUPS = "optimizer.param_groups."


def read_named_shards(
    folder: str | Path, tensors: dict[str, torch.Tensor], parameters: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Read part of a model from the sharded checkpoint ``folder`` (written under any layout), by the names
    that :func:`sharded_state` gives: ``tensors`` (weights and buffers by name; DTensor shards take this
    rank's pieces) in place, and the optimizer state of ``parameters`` (by name), each slot laid out as its
    parameter. Returns that optimizer state in the named form of :mod:`kaisoku.distributed.named_state`,
    with every parameter group the checkpoint lists. A collective of every rank.

    What is read is decided by the checkpoint's metadata, not by an optimizer's state (which need not exist
    yet): a pipeline stage reads its own parameters' slots and nothing else."""
    metadata, _ = _storage_files(Path(folder))
    tensor_type = _dcp().metadata.TensorStorageMetadata
    state: dict[str, Any] = {f"model.{name}": tensor for name, tensor in tensors.items()}
    slots: dict[str, dict[str, str]] = {}  # parameter name -> slot -> key
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(_PARAM_GROUPS):
            state[key] = None  # a small object, replaced by the load
        elif key.startswith(_OPTIMIZER_STATE):
            name, _, slot = key[len(_OPTIMIZER_STATE) :].rpartition(".")
            parameter = parameters.get(name)
            if parameter is None:
                continue
            slots.setdefault(name, {})[slot] = key
            if not isinstance(entry, tensor_type):
                state[key] = None
            elif tuple(entry.size) == tuple(parameter.shape):  # a slot the shape of its parameter: its layout
                state[key] = torch.empty_like(parameter, dtype=entry.properties.dtype)
            else:  # a scalar such as a step count: whole on every rank
                state[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    _load(folder, state)
    groups: dict[int, dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith(_PARAM_GROUPS):
            index, _, field = key[len(_PARAM_GROUPS) :].partition(".")
            groups.setdefault(int(index), {})[field] = value
    return {
        "state": {name: {slot: state[key] for slot, key in per.items()} for name, per in slots.items()},
        "param_groups": [groups[index] for index in sorted(groups)],
    }


def load_sharded(folder: str | Path, model: nn.Module, optimizer: Optimizer) -> None:
    """Load the sharded checkpoint ``folder`` into ``model`` and ``optimizer`` (sharded or not, any layout)."""
    model_state, optimizer_state = _read_into(folder, model, optimizer)
    _dcp().state_dict.set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state
    )


def read_full_state(folder: str | Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``{"model", "optimizer"}`` as a single-file checkpoint holds them (whole tensors, the optimizer's own
    state dict), read from the sharded checkpoint ``folder`` for an unsharded ``model`` and ``optimizer``."""
    load_sharded(folder, model, optimizer)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def named_optimizer_state(saved: dict[str, Any], optimizer: Optimizer, model: nn.Module) -> dict[str, Any]:
    """An optimizer state dict keyed by position (``Optimizer.state_dict``) re-keyed by parameter name.

    ``saved`` must come from an optimizer with the same parameter groups in the same order as
    ``optimizer`` (the same model through the same optimizer factory).
    """
    names = {id(p): name for name, p in model.named_parameters()}
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, optimizer.param_groups)
    ):
        raise ValueError("the checkpoint's optimizer has other parameter groups than this one")
    by_index: dict[int, str] = {}
    groups = []
    for saved_group, group in zip(saved_groups, optimizer.param_groups):
        fqns = [names[id(p)] for p in group["params"]]
        by_index.update(zip(saved_group["params"], fqns))
        groups.append({**saved_group, "params": fqns})
    state = {by_index[index]: value for index, value in saved["state"].items()}
    return {"state": state, "param_groups": groups}


def load_full_into_sharded(
    model_state: dict[str, Any], optimizer_state: dict[str, Any], model: nn.Module, optimizer: Optimizer
) -> None:
    """Load whole-tensor model and optimizer state (a single-file checkpoint) into a sharded model: each
    rank keeps its own pieces.

    ``optimizer_state``: a data-parallel run's (numbered, ``Optimizer.state_dict``) or a pipeline run's
    layout-independent form (:mod:`kaisoku.distributed.named_state`: keyed by parameter name already, its
    groups merged over the stages; each parameter finds its group by name)."""
    if is_named_optimizer_state(optimizer_state):
        named = with_param_names(optimizer_state)
    else:
        named = named_optimizer_state(optimizer_state, optimizer, model)
    _dcp().state_dict.set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=named,
        options=_dcp().state_dict.StateDictOptions(full_state_dict=True),
    )

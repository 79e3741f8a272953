"""Consistency checks of an index as read: a failure is a ``DamagedDataError`` saying what is off."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.shards.schema import TASKS
from kaisoku.data.shards.tables import check_offsets, column_table
from kaisoku.errors import DamagedDataError

_SHARD_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def require(condition: bool, path: Path, what: str) -> None:
    """``DamagedDataError`` saying that the index at ``path`` is damaged (``what``) unless ``condition``."""
    if not condition:
        raise DamagedDataError(f"index {path} is damaged: {what}; re-pack the dataset")


def check_shard_name(position: int, name: Any, where: Path) -> None:
    """Shard ``position``'s file ``name`` is a plain file name inside the dataset directory."""
    require(
        isinstance(name, str) and bool(_SHARD_NAME.match(name)) and name not in (".", ".."),
        where,
        f"shard {position} has a bad file name {name!r}",
    )


def check_num_samples(document: Mapping[str, Any], total: int, where: Path) -> None:
    """The document's ``num_samples`` (when given) is ``total``, the sum over its shards."""
    declared = int(document.get("num_samples", total))
    require(declared == total, where, f"num_samples {declared} != {total}, the sum over shards")


def check_int_columns(int_fields: Iterable[str], columns: Collection[str], where: Path) -> None:
    """Every ``int`` field (by name) has its column."""
    for name in int_fields:
        require(name in columns, where, f"int field {name!r} has no column")


def check_task(document: Mapping[str, Any], field_names: Collection[str], where: Path) -> dict[str, str]:
    """``{"task", "target"}`` as the document declares them: a known task, and a target that is a field."""
    task = str(document.get("task", "classification"))
    require(task in TASKS, where, f"unknown task {task!r}")
    if task == "classification":
        return {"task": task, "target": "label"}
    target = str(document.get("target", ""))
    require(target in field_names, where, f"target field {target!r} is not a field")
    return {"task": task, "target": target}


def check_labels(
    columns: Mapping[str, np.ndarray], task: str | None, classes: Sequence[str] | None, where: Path
) -> None:
    """A classification index's labels fit its own ``classes`` (a label past the list would reach the
    model as a class it does not have): none below 0, none past the class names."""
    labels = columns.get("label")
    if task != "classification" or labels is None or labels.size == 0:
        return
    low, high = int(labels.min()), int(labels.max())
    require(low >= 0, where, f"field 'label' holds {low}, below 0")
    if classes is not None:
        require(
            high < len(classes),
            where,
            f"field 'label' goes up to {high}, but 'classes' names {len(classes)} "
            f"(labels 0..{len(classes) - 1})",
        )


def check_v1_shard(
    name: str, samples: int, offsets: np.ndarray, record_crc: np.ndarray, nbytes: int, where: Path
) -> None:
    """A version-1 shard entry: samples, one offset more than samples tiling its bytes, a CRC32 per record."""
    require(samples > 0, where, f"shard {name} has no samples")
    require(offsets.shape == (samples + 1,), where, f"shard {name} needs {samples + 1} offsets")
    require(record_crc.shape == (samples,), where, f"shard {name} needs {samples} record checksums")
    require(
        int(offsets[0]) == 0 and int(offsets[-1]) == nbytes and bool(np.all(np.diff(offsets) > 0)),
        where,
        f"shard {name} has offsets that do not tile its {nbytes} bytes",
    )


def check_tables(
    tables: Mapping[str, np.ndarray],
    *,
    num_shards: int,
    total: int,
    column_names: Iterable[str],
    table_path: Path,
    where: Path,
) -> None:
    """The version-2 tables hold what ``num_shards`` shards of ``total`` samples need: the offsets, the
    record CRC32s and a column per name."""
    for name, need in (("offsets", total + num_shards), ("record_crc32", total)):
        got = tables[name].size if name in tables else None
        if got != need:
            raise DamagedDataError(
                f"index table {name!r} in {table_path} has {got} entries, the shards in {where} need {need}; "
                "re-pack the dataset"
            )
    for name in column_names:
        got = tables[column_table(name)].size if column_table(name) in tables else None
        if got != total:
            raise DamagedDataError(
                f"index table {column_table(name)!r} in {table_path} has {got} entries, not {total}; "
                "re-pack the dataset"
            )


def check_table_offsets(
    offsets: np.ndarray,
    firsts: np.ndarray,
    samples: np.ndarray,
    nbytes: np.ndarray,
    names: list[str],
    table_path: Path,
) -> None:
    """Each shard's offsets in the table (from ``firsts``) tile its bytes (:func:`check_offsets`)."""
    problem = check_offsets(offsets, firsts, samples, nbytes, names)
    if problem is not None:
        raise DamagedDataError(
            f"index table {table_path} does not match the shards: {problem}; re-pack the dataset"
        )

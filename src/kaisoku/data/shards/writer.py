"""``kaisoku pack``: pack an ImageFolder tree, a ``.npz`` of arrays or any iterable of dicts into shards.

Layouts:

* ImageFolder ``SRC/<class>/**/<image>`` -> ``DST/index.json`` + ``DST/shard-*.kshard``; fields
  ``image`` (the file's encoded bytes, kept as they are) and ``label``; a tree of splits -> one
  dataset per split in ``DST/<split>/`` (the folder rules are :mod:`kaisoku.data.shards.sources`').
* ``.npz`` with ``x_<split>``/``y_<split>`` pairs -> one dataset per split in ``DST/<split>/``, rows
  stored as raw arrays (:func:`kaisoku.data.shards.sources.array_fields`).
* An iterable of dicts (library API) -> ``DST/``, fields inferred from the first sample or given.

Shards are cut when the next record would take a shard past ``shard_bytes`` of *logical* record
bytes (payloads before compression), so boundaries are known before compressing, identical for
every codec and worker count, and each shard holds at least one record. ImageFolder and ``.npz``
samples are permuted with ``seed`` first (``shuffle=True``) so that every shard mixes classes,
which a shard-block shuffle relies on; iterables keep their order.

Determinism: the same input and arguments give byte-identical shards and index for any
``workers`` (no times, no absolute paths, single-threaded zstd). Each shard is written by a
worker process into a temp file, fsynced and renamed; the index is written last, the same way,
so a directory with an index is always complete.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from kaisoku.data.shards.codecs import get_codec
from kaisoku.data.shards.destination import (
    destination_failure,
    prepare_destination,
    remove_empty_folders,
    remove_stale_shards,
)
from kaisoku.data.shards.format import (
    Field,
    Index,
    ShardInfo,
    write_shard,
)
from kaisoku.data.shards.pack_progress import PackProgress
from kaisoku.data.shards.recode import ImageRecode
from kaisoku.data.shards.records import RecordCodec, encode_rows
from kaisoku.data.shards.sources import (
    array_fields,
    infer_fields,
    npz_split,
    npz_splits,
    read_image,
    scan_image_tree,
)
from kaisoku.data.shards.tables import TABLES_NAME
from kaisoku.errors import KaisokuError
from kaisoku.units import parse_bytes

DEFAULT_SHARD_BYTES = 64 * 1024**2
"""Default target shard size: large sequential reads, small enough to stage and evict one by one."""

_RECORD_WINDOW = 2  # shard tasks in flight per worker: bounds memory, keeps workers busy


def default_workers() -> int:
    """Worker processes used when ``workers`` is not given: the usable cores, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def plan_shards(sizes: Sequence[int] | np.ndarray, shard_bytes: int) -> list[tuple[int, int]]:
    """Cut consecutive items of the given logical sizes into ``[start, end)`` shard ranges.

    A shard is closed when the next item would take it past ``shard_bytes``; every shard holds at
    least one item, so an item larger than ``shard_bytes`` gets a shard of its own.
    """
    if shard_bytes <= 0:
        raise KaisokuError(f"shard size must be positive, got {shard_bytes} bytes")
    ranges: list[tuple[int, int]] = []
    start = 0
    total = 0
    for position, size in enumerate(sizes):
        if position > start and total + int(size) > shard_bytes:
            ranges.append((start, position))
            start, total = position, 0
        total += int(size)
    if len(sizes) > start:
        ranges.append((start, len(sizes)))
    return ranges


# ---------------------------------------------------------------------------------------------
# Writing one shard (runs in worker processes)
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _ShardResult:
    info: ShardInfo | None
    columns: dict[str, list[int]]
    skipped: list[str] = field(default_factory=list)


def _int_columns(fields: Sequence[Field]) -> dict[str, list[int]]:
    return {f.name: [] for f in fields if f.kind == "int"}


@dataclass(kw_only=True)
class _FolderTask:
    directory: Path
    shard_id: int
    root: Path
    items: list[tuple[str, int]]
    fields: tuple[Field, ...]
    codec: str
    verify_images: bool
    skip_corrupt: bool
    recode: ImageRecode | None = None


def _pack_folder_shard(task: _FolderTask) -> _ShardResult:
    encoder = RecordCodec(task.fields, task.codec)
    records: list[bytes] = []
    labels: list[int] = []
    skipped: list[str] = []
    for relative, label in task.items:
        data, problem = read_image(task.root / relative, verify=task.verify_images)
        if problem is not None:
            if task.skip_corrupt:
                skipped.append(relative)
                continue
            raise KaisokuError(problem)
        if task.recode is not None:
            try:
                data = task.recode(data)
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
                if task.skip_corrupt:
                    skipped.append(relative)
                    continue
                raise KaisokuError(
                    f"cannot re-encode image {task.root / relative}: {error}; "
                    "re-encode or remove it, or pack with --skip-corrupt to leave it out"
                ) from None
        record, _ = encoder.encode({"image": data, "label": label})
        records.append(record)
        labels.append(label)
    info = write_shard(task.directory, task.shard_id, records) if records else None
    return _ShardResult(info=info, columns={"label": labels}, skipped=skipped)


@dataclass(kw_only=True)
class _ArrayTask:
    directory: Path
    shard_id: int
    fields: tuple[Field, ...]
    codec: str
    columns: dict[str, np.ndarray]


def _pack_array_shard(task: _ArrayTask) -> _ShardResult:
    records, ints = encode_rows(RecordCodec(task.fields, task.codec), task.columns)
    return _ShardResult(info=write_shard(task.directory, task.shard_id, records), columns=ints)


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


def _run_ordered(
    function: Callable[[Any], _ShardResult], tasks: Iterable[Any], workers: int
) -> Iterator[_ShardResult]:
    """Results of ``function`` over ``tasks`` in task order, on a process pool when workers > 1."""
    if workers <= 1:
        for task in tasks:
            yield function(task)
        return
    import multiprocessing
    from concurrent.futures import Future, ProcessPoolExecutor

    # fork: workers need nothing re-imported and never re-run the caller's script (as spawn and
    # forkserver do with an unguarded __main__); they only touch numpy, zstd, Pillow and files.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    executor = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context(method))
    pending: deque[Future[_ShardResult]] = deque()
    try:
        for task in tasks:
            pending.append(executor.submit(function, task))
            if len(pending) >= _RECORD_WINDOW * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _finish(
    directory: Path,
    results: Iterable[_ShardResult],
    *,
    fields: tuple[Field, ...],
    codec: str,
    classes: Sequence[str] | None,
    source: str,
    pack_args: Mapping[str, Any],
    progress: PackProgress,
) -> Index:
    shards: list[ShardInfo] = []
    columns = _int_columns(fields)
    skipped: list[str] = []
    try:
        for result in results:
            if result.info is not None:
                shards.append(result.info)
            for name, values in result.columns.items():
                columns[name].extend(values)
            for item in result.skipped:
                progress.log(f"[yellow]skipped unreadable image {item}")
            skipped.extend(result.skipped)
            progress.advance((result.info.samples if result.info is not None else 0) + len(result.skipped))
    except BaseException:
        # The pool has finished (or cancelled) every task by now; leave no orphan shards behind.
        # Any shard file here belongs to this run or to a pack whose index is already gone.
        remove_stale_shards(directory, keep=set())
        raise
    if not shards:
        raise KaisokuError(f"nothing to pack into {directory}: every sample was skipped as unreadable")
    index = Index(
        root=directory,
        codec=codec,
        fields=fields,
        shards=tuple(shards),
        columns={name: np.asarray(values, dtype=np.int64) for name, values in columns.items()},
        classes=tuple(classes) if classes is not None else None,
        source=source,
        pack=dict(pack_args),
        skipped=tuple(skipped),
    )
    try:
        index = index.write(directory)
    except BaseException:
        # No index landed (a full disk, say): the shards and the tables are this pack's orphans.
        remove_stale_shards(directory, keep=set())
        (directory / TABLES_NAME).unlink(missing_ok=True)
        raise
    remove_stale_shards(directory, {shard.file for shard in shards})
    return index


def _order(count: int, shuffle: bool, seed: int) -> np.ndarray:
    if not shuffle:
        return np.arange(count, dtype=np.int64)
    return np.random.Generator(np.random.PCG64(seed)).permutation(count).astype(np.int64)


def _check_args(shard_bytes: int, codec: str, workers: int | None) -> int:
    if shard_bytes <= 0:
        raise KaisokuError(f"shard size must be positive, got {shard_bytes} bytes")
    get_codec(codec)
    if workers is None:
        return default_workers()
    if workers < 0:
        raise KaisokuError(f"workers must be >= 0, got {workers}")
    return workers


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def pack_image_folder(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    codec: str = "raw",
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    shuffle: bool = True,
    seed: int = 0,
    skip_corrupt: bool = False,
    verify_images: bool = True,
    recode: ImageRecode | None = None,
) -> Index | dict[str, Index]:
    """Pack the ImageFolder tree ``src`` into ``dst``; see :func:`pack` for the arguments.

    A tree whose folders are all split names (``train``, ``val``, ``test``, ...) each holding class
    folders is packed split by split into ``dst/<split>/`` with one label mapping (the sorted union
    of the class names), and gives ``{split: Index}``.
    """
    root, directory = Path(src), Path(dst)
    workers = _check_args(shard_bytes, codec, workers)
    options: dict[str, Any] = {
        "shard_bytes": shard_bytes,
        "codec": codec,
        "workers": workers,
        "progress": progress,
        "shuffle": shuffle,
        "seed": seed,
        "skip_corrupt": skip_corrupt,
        "verify_images": verify_images,
        "recode": recode,
    }
    tree = scan_image_tree(root)
    prepare_destination(directory, root, overwrite)
    if "" in tree.splits:
        return _pack_folder(root, directory, tree.classes, tree.splits[""], **options)
    return {
        split: _pack_folder(root / split, directory / split, tree.classes, items, **options)
        for split, items in tree.splits.items()
    }


def _pack_folder(
    root: Path,
    directory: Path,
    classes: Sequence[str],
    items: Sequence[tuple[str, int, int]],
    *,
    shard_bytes: int,
    codec: str,
    workers: int,
    progress: bool,
    shuffle: bool,
    seed: int,
    skip_corrupt: bool,
    verify_images: bool,
    recode: ImageRecode | None,
) -> Index:
    directory.mkdir(parents=True, exist_ok=True)
    fields = (Field(name="image", kind="image"), Field(name="label", kind="int"))
    encoder = RecordCodec(fields, codec)
    order = _order(len(items), shuffle, seed)
    sizes = [encoder.logical_size({"image": items[i][2]}) for i in order]
    ranges = plan_shards(sizes, shard_bytes)
    tasks = (
        _FolderTask(
            directory=directory,
            shard_id=shard_id,
            root=root,
            items=[(items[i][0], items[i][1]) for i in order[start:end]],
            fields=fields,
            codec=codec,
            verify_images=verify_images,
            skip_corrupt=skip_corrupt,
            recode=recode,
        )
        for shard_id, (start, end) in enumerate(ranges)
    )
    recorded = {"recode": recode.record()} if recode is not None else {}
    with PackProgress(progress, f"pack {root.name}", len(items)) as bar:
        return _finish(
            directory,
            _run_ordered(_pack_folder_shard, tasks, min(workers, len(ranges))),
            fields=fields,
            codec=codec,
            classes=classes,
            source="imagefolder",
            pack_args={"shard_bytes": shard_bytes, "shuffle": shuffle, "seed": seed, **recorded},
            progress=bar,
        )


def pack_npz(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    codec: str = "raw",
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    shuffle: bool = True,
    seed: int = 0,
) -> dict[str, Index]:
    """Pack each ``x_<split>``/``y_<split>`` pair of ``src`` into ``dst/<split>/``; see :func:`pack`."""
    path, root = Path(src), Path(dst)
    workers = _check_args(shard_bytes, codec, workers)
    splits = npz_splits(path)
    prepare_destination(root, None, overwrite)
    indexes: dict[str, Index] = {}
    with np.load(path, allow_pickle=False) as archive:
        for split, (x_key, y_key) in splits.items():
            x, y = npz_split(path, archive, split, x_key, y_key)
            fields = array_fields(x, y)
            encoder = RecordCodec(fields, codec)
            row_sizes = {
                f.name: int(np.prod(f.shape)) * np.dtype(f.dtype).itemsize for f in fields if f.dtype
            }
            record_size = encoder.logical_size(row_sizes)
            order = _order(len(x), shuffle, seed)
            ranges = plan_shards([record_size] * len(x), shard_bytes)
            directory = root / split
            directory.mkdir(parents=True, exist_ok=True)
            tasks = (
                _ArrayTask(
                    directory=directory,
                    shard_id=shard_id,
                    fields=fields,
                    codec=codec,
                    columns={
                        fields[0].name: x[order[start:end]],
                        fields[1].name: y[order[start:end]],
                    },
                )
                for shard_id, (start, end) in enumerate(ranges)
            )
            with PackProgress(progress, f"pack {path.name}:{split}", len(x)) as bar:
                indexes[split] = _finish(
                    directory,
                    _run_ordered(_pack_array_shard, tasks, min(workers, len(ranges))),
                    fields=fields,
                    codec=codec,
                    classes=None,
                    source=f"npz:{split}",
                    pack_args={"shard_bytes": shard_bytes, "shuffle": shuffle, "seed": seed},
                    progress=bar,
                )
    return indexes


def pack_records(
    samples: Iterable[Mapping[str, Any]],
    dst: str | os.PathLike[str],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    codec: str = "raw",
    overwrite: bool = False,
    progress: bool = True,
    fields: Sequence[Field] | None = None,
    source: str = "records",
) -> Index:
    """Pack dicts from ``samples``, in their order, into ``dst`` (encoded in this process).

    ``fields`` fixes the schema; without it the first sample's values decide (:func:`infer_fields`).
    Every sample must have every field, with the same kinds (and array dtype/shape).
    """
    directory = Path(dst)
    _check_args(shard_bytes, codec, 0)
    prepare_destination(directory, None, overwrite)
    iterator = iter(samples)
    try:
        first = next(iterator)
    except StopIteration:
        raise KaisokuError(f"nothing to pack into {directory}: the sample iterable is empty") from None
    schema = tuple(fields) if fields is not None else infer_fields(first)
    encoder = RecordCodec(schema, codec)

    def shard_results() -> Iterator[_ShardResult]:
        records: list[bytes] = []
        ints = _int_columns(schema)
        total = 0
        shard_id = 0
        for sample in _chain_first(first, iterator):
            record, logical = encoder.encode(sample)
            if records and total + logical > shard_bytes:
                yield _ShardResult(info=write_shard(directory, shard_id, records), columns=ints)
                records, ints, total = [], _int_columns(schema), 0
                shard_id += 1
            records.append(record)
            total += logical
            for name in ints:
                ints[name].append(int(sample[name]))
        yield _ShardResult(info=write_shard(directory, shard_id, records), columns=ints)

    with PackProgress(progress, f"pack {directory.name}", None) as bar:
        return _finish(
            directory,
            shard_results(),
            fields=schema,
            codec=codec,
            classes=None,
            source=source,
            pack_args={"shard_bytes": shard_bytes},
            progress=bar,
        )


def _chain_first(first: Mapping[str, Any], rest: Iterator[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    yield first
    yield from rest


def pack(
    source: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
    dst: str | os.PathLike[str],
    *,
    shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    codec: str = "raw",
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    shuffle: bool = True,
    seed: int = 0,
    skip_corrupt: bool = False,
    verify_images: bool = True,
    recode: ImageRecode | None = None,
) -> Index | dict[str, Index]:
    """Pack ``source`` into shards and an index under ``dst``; the engine of ``kaisoku pack``.

    ``recode``: re-encode an ImageFolder's images (JPEG quality, chroma subsampling, a cap on the longer
    side, raw pixels for tiny images), recorded in the index; None keeps the source's bytes.

    ``source``: an ImageFolder directory (-> one :class:`Index`; a tree of split folders such as
    train/val -> ``{split: Index}``, each in ``dst/<split>/``), a ``.npz`` with x_<split>/y_<split>
    arrays (-> ``{split: Index}``, each in ``dst/<split>/``), or an iterable of sample dicts
    (-> one :class:`Index`, packed in order, in this process).

    ``shard_bytes``: target logical bytes per shard (an int or a size string such as ``"64MiB"``). ``codec``: raw | zstd | lz4 for non-image
    fields. ``workers``: packing processes (None: cores, at most 8; 0 or 1: in this process).
    ``overwrite``: replace a previous pack in a non-empty ``dst`` (other files there are left
    alone); without it a non-empty ``dst`` is an error. ``progress``: show a rich progress bar.
    ``shuffle``/``seed``: permute ImageFolder and .npz samples before sharding. ``skip_corrupt``:
    leave unreadable images out (listed in the index's ``skipped``) instead of failing.
    ``verify_images``: decode-check every image while packing.
    """
    shard_bytes = parse_bytes(shard_bytes)
    existed = Path(dst).exists()
    try:
        if isinstance(source, str | os.PathLike):
            path = Path(source)
            if path.is_dir():
                return pack_image_folder(
                    path,
                    dst,
                    shard_bytes=shard_bytes,
                    codec=codec,
                    workers=workers,
                    overwrite=overwrite,
                    progress=progress,
                    shuffle=shuffle,
                    seed=seed,
                    skip_corrupt=skip_corrupt,
                    verify_images=verify_images,
                    recode=recode,
                )
            if path.suffix == ".npz" and path.is_file():
                return pack_npz(
                    path,
                    dst,
                    shard_bytes=shard_bytes,
                    codec=codec,
                    workers=workers,
                    overwrite=overwrite,
                    progress=progress,
                    shuffle=shuffle,
                    seed=seed,
                )
            if not path.exists():
                raise KaisokuError(f"source {path} does not exist")
            raise KaisokuError(f"source {path} is neither an ImageFolder directory nor a .npz file")
        return pack_records(
            source, dst, shard_bytes=shard_bytes, codec=codec, overwrite=overwrite, progress=progress
        )
    except OSError as error:  # a full, read-only or immutable destination: one line, not a traceback
        failure = destination_failure(error, Path(dst))
        if failure is None:
            raise
        remove_empty_folders(Path(dst), keep_root=existed)
        raise failure from None

"""``ShardedDataset``: random access by global sample index into packed shards.

Reading a sample: global index -> (shard, record) -> the shard's bytes (an mmap of the shard
file, or whatever buffer a ``shard_opener`` returns, e.g. a RAM or local-disk cache tier) ->
the record's bytes, checked against its CRC32 -> fields decoded (images decoded late, in the
worker) -> optional ``transform(sample, index=..., epoch=...)``.

The dataset is picklable and opens its mmaps lazily in each process, so it works inside a plain
``torch.utils.data.DataLoader`` with worker processes.

The cache seam: a ``shard_opener(shard_id) -> buffer`` replaces the default mmap of the shard
file. It is called on every record read (the opener does its own caching and eviction; the
dataset keeps no reference to what it returns beyond the read), must return an object with the
buffer protocol holding the whole shard file as packed (the dataset checks its length against
the index), and must be picklable when DataLoader workers are used. A cache that already holds a
shard's bytes can also call :func:`kaisoku.data.shards.format.record_view` directly, and samples that
arrive as record bytes (an exchange between ranks) go through :meth:`ShardedDataset.sample_from_record`.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch.utils.data

from kaisoku.data.loading.gpu_decode import EncodedBatch
from kaisoku.data.loading.image_label import ImageLabelTransform  # noqa: F401  (its public home was this module)
from kaisoku.data.loading.shard_source import ShardOpener, ShardSource, open_shard_mmap
from kaisoku.data.loading.transforms import decode_image
from kaisoku.data.shards.checksum import crc32
from kaisoku.data.shards.format import Index, read_index
from kaisoku.data.shards.records import CorruptRecordError, RecordCodec, check_record, record_view
from kaisoku.errors import KaisokuError

logger = logging.getLogger("kaisoku.data")

_LOGGED_SKIPS = 20  # per process: enough to name the damage without flooding the log


class SampleTransform(Protocol):
    """Turns a decoded sample dict into what the loader yields, keyed by its index and epoch."""

    def __call__(self, sample: dict[str, Any], *, index: int, epoch: int) -> Any:
        """Transform one sample."""
        ...


def _tally(tally: dict[int, list[int]], shard_id: int, nbytes: int) -> None:
    """Add one record of ``nbytes`` read from shard ``shard_id`` to ``tally``'s ``[bytes, records]``."""
    counts = tally.setdefault(shard_id, [0, 0])
    counts[0] += nbytes
    counts[1] += 1


class ShardedDataset(torch.utils.data.Dataset):
    """Map-style dataset over a packed directory: ``dataset[i]`` is sample ``i`` in packed order.

    Without a transform a sample is a dict of its fields (images decoded to HWC uint8 RGB unless
    ``decode_images=False``; arrays as numpy arrays; ints, strings, bytes as such). With a
    ``transform`` it is ``transform(sample, index=i, epoch=e)``, e.g. :class:`ImageLabelTransform`.
    The epoch is ``set_epoch``'s value, or given per access as ``dataset[(epoch, i)]`` (a sampler
    can yield such pairs so that persistent DataLoader workers see epoch changes).

    A damaged record (failed CRC32, cut off by a truncated shard, in a missing shard, or an image
    that does not decode) raises :class:`~kaisoku.data.shards.format.CorruptRecordError` naming the file,
    the record and the sample index; with ``skip_corrupt=True`` it is logged, counted in
    ``skipped`` (per process) and returned as ``None``, which :func:`kaisoku.data.loading.transforms.collate`
    leaves out of the batch.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Index,
        *,
        transform: SampleTransform | None = None,
        skip_corrupt: bool = False,
        verify: bool = True,
        decode_images: bool = True,
        shard_opener: ShardOpener | None = None,
        check_files: bool = True,
        source: ShardSource | None = None,
    ) -> None:
        """Open the dataset at ``path`` (a directory, its ``index.json``, or a read :class:`Index`).

        ``verify``: check each record's CRC32 on read (cheap next to decoding). ``shard_opener``:
        where shard bytes come from (see the module docs); default: an mmap per shard file, opened
        on first use in each process. ``check_files``: with the default opener, check now that
        every shard file exists with the size the index gives, so a missing or truncated shard
        fails at start-up rather than hours into an epoch. ``source``: the :class:`ShardSource` shared
        with the loader that trains on this dataset (its counters, its node cache once attached).
        """
        self.index = path if isinstance(path, Index) else read_index(path)
        self.transform = transform
        self.skip_corrupt = skip_corrupt
        self.verify = verify
        self.decode_images = decode_images
        self.source = source if source is not None else ShardSource(opener=shard_opener)
        if shard_opener is not None:
            self.source.opener = shard_opener
        self.epoch = 0
        self.skipped = 0  # records skipped as damaged, in this process
        self._codec = RecordCodec(self.index.fields, self.index.codec)
        self._image_fields = tuple(f.name for f in self.index.fields if f.kind == "image")
        self._starts = self.index.shard_starts()
        self._starts_list = self._starts.tolist()
        self._buffers: dict[int, Any] = {}
        self._pid = os.getpid()
        if self.source.opener is None and check_files and not skip_corrupt:
            for shard_id in range(len(self.index.shards)):
                self._check_file(shard_id)

    # -- shard-level information for samplers, caches and exchanges --------------------------

    def __len__(self) -> int:
        """Number of samples."""
        return int(self._starts[-1])

    @property
    def labels(self) -> np.ndarray:
        """The ``label`` column (int64, one per sample), read from the index without touching shards."""
        return self.column("label")

    def column(self, name: str) -> np.ndarray:
        """The index column of the int field ``name`` (int64, one per sample)."""
        column = self.index.columns.get(name)
        if column is None:
            raise KaisokuError(
                f"{self.index.root} has no int column {name!r}; "
                f"columns: {', '.join(self.index.columns) or 'none'}"
            )
        return column

    @property
    def classes(self) -> tuple[str, ...] | None:
        """Class names by label (ImageFolder packs), else None."""
        return self.index.classes

    def shard_sizes(self) -> np.ndarray:
        """Samples per shard (int64), in shard order; samples are numbered shard after shard."""
        return self.index.shard_sizes()

    def shard_nbytes(self) -> np.ndarray:
        """Bytes per shard file (int64): what a cache tier must hold for each shard."""
        return self.index.shard_nbytes()

    def shard_paths(self) -> list[Path]:
        """Path of every shard file on the source, in shard order."""
        return [self.index.shard_path(i) for i in range(len(self.index.shards))]

    def shard_of(self, index: int) -> tuple[int, int]:
        """``(shard id, record within the shard)`` of global sample ``index``."""
        index = self._check_index(index)
        shard_id = bisect.bisect_right(self._starts_list, index) - 1
        return shard_id, index - self._starts_list[shard_id]

    def locate(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`shard_of`: shard ids and records of many global indices."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"sample indices must lie in 0..{len(self) - 1}")
        shard_ids = np.searchsorted(self._starts, indices, side="right") - 1
        return shard_ids, indices - self._starts[shard_ids]

    # -- reading -------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch given to the transform (in this process; see the class docs for workers)."""
        self.epoch = int(epoch)

    def record_bytes(self, index: int) -> bytes:
        """The stored bytes of sample ``index`` (CRC-checked when ``verify``), for caches and exchanges."""
        shard_id, record = self.shard_of(index)
        return bytes(self._record_view(shard_id, record))

    def sample_from_record(self, data: bytes | memoryview, index: int, *, epoch: int | None = None) -> Any:
        """Decode and transform record bytes obtained elsewhere (another rank, a cache) as sample ``index``.

        With ``verify`` the bytes are checked against the index's CRC32 for that sample first. Damage
        raises or, with ``skip_corrupt``, returns ``None``, exactly as ``dataset[index]`` would.
        """
        shard_id, record = self.shard_of(index)
        try:
            if self.verify:
                check_record(self.index, data, shard_id, record)
            return self._finish(data, shard_id, record, index, self.epoch if epoch is None else epoch)
        except CorruptRecordError as error:
            return self._skip(error)

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        """Sample ``key`` (a global index, or an ``(epoch, index)`` pair)."""
        if isinstance(key, tuple):
            epoch, index = int(key[0]), key[1]
        else:
            epoch, index = self.epoch, key
        shard_id, record = self.shard_of(index)
        index = self._starts_list[shard_id] + record
        try:
            view = self._record_view(shard_id, record)
            if self.source.counters is not None:
                self._count_read(shard_id, len(view))
            return self._finish(view, shard_id, record, index, epoch)
        except CorruptRecordError as error:
            return self._skip(error)

    def _count_read(self, shard_id: int, nbytes: int, records: int = 1) -> None:
        source = self.source
        tier = source.tier_of(shard_id) if source.tier_of is not None else "source"
        assert source.counters is not None
        source.counters.add(f"served_{tier}_bytes", nbytes)
        if tier == "source":
            source.counters.add("source_records", records)

    def read_into(
        self, key: tuple[int, int], out: np.ndarray, data: bytes | memoryview | None = None
    ) -> int | None:
        """Write sample ``key`` (``(epoch, index)``) into ``out`` through the transform's ``into``.

        Returns its label, or None when it was skipped as damaged (``skip_corrupt``). ``data``: the
        record's bytes obtained elsewhere (another rank), CRC-checked here with ``verify``. Used by
        :class:`kaisoku.data.loading.batches.ThreadedBatches`; the transform must have an ``into`` method
        (:class:`ImageLabelTransform` has).
        """
        epoch, index = int(key[0]), key[1]
        shard_id, record = self.shard_of(index)
        index = self._starts_list[shard_id] + record
        try:
            data = self._record_bytes(shard_id, record, data)
            return self._finish(data, shard_id, record, index, epoch, out=out)
        except CorruptRecordError as error:
            return self._skip(error)

    def read_batch_into(
        self,
        keys: Sequence[tuple[int, int]],
        out: np.ndarray,
        datas: Sequence[bytes | memoryview | None] | None = None,
    ) -> list[int | None]:
        """:meth:`read_into` for several keys of one epoch at once, through the transform's ``batch_into``
        (one call decodes and augments them all); ``out[k]`` receives ``keys[k]``.

        Returns the labels, None for a sample skipped as damaged. ``datas[k]``: record bytes obtained
        elsewhere, as ``data`` of :meth:`read_into`. A transform without ``batch_into`` (or an evaluation
        spec, or several epochs in ``keys``) reads sample by sample; so does a chunk in which an image does
        not decode, so that the damaged one is named (or skipped) exactly as :meth:`read_into` would.
        """
        batch_into = getattr(self.transform, "batch_into", None)
        spec = getattr(self.transform, "spec", None)
        epochs = {int(key[0]) for key in keys}
        # The batch path writes 3-channel images; single-channel data (MNIST arrays) reads sample by sample.
        single_channel = out.ndim == 4 and out.shape[1] != 3
        if batch_into is None or spec is None or not spec.train or len(epochs) != 1 or single_channel:
            return [self.read_into(key, out[k], datas[k] if datas else None) for k, key in enumerate(keys)]
        epoch = epochs.pop()
        labels: list[int | None] = [None] * len(keys)
        rows, indices, samples = self._parse_keys(keys, datas)
        if not rows:
            return labels
        chunk = out[rows[0] : rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else None
        target = chunk if chunk is not None else np.empty((len(rows), *out.shape[1:]), dtype=out.dtype)
        try:
            got = batch_into(samples, indices=indices, epoch=epoch, out=target)
        except KaisokuError:  # an image that does not decode: per sample, to name or skip it
            return [self.read_into(key, out[k], datas[k] if datas else None) for k, key in enumerate(keys)]
        if chunk is None:
            out[rows] = target
        for k, label in zip(rows, got, strict=True):
            labels[k] = label
        return labels

    def _record_bytes(
        self,
        shard_id: int,
        record: int,
        data: bytes | memoryview | None,
        tally: dict[int, list[int]] | None = None,
    ) -> bytes | memoryview:
        """Record ``record`` of shard ``shard_id``: read here (and counted, or added to ``tally``'s
        ``[bytes, records]`` of its shard for the caller to count at once), or ``data`` obtained elsewhere
        (received from another node), checked against the index when ``verify`` is on."""
        if data is None:
            data = self._record_view(shard_id, record)
            if tally is not None:
                _tally(tally, shard_id, len(data))
            elif self.source.counters is not None:
                self._count_read(shard_id, len(data))
        elif self.verify:
            check_record(self.index, data, shard_id, record)
        return data

    def _parse_keys(
        self, keys: Sequence[tuple[int, int]], datas: Sequence[bytes | memoryview | None] | None
    ) -> tuple[list[int], list[int], list[dict[str, Any]]]:
        """The records of ``keys`` read (counted), checked and parsed, images still encoded: the positions
        in ``keys`` of those not skipped as damaged, their global indices and their fields. Located at once
        and counted once per shard (a batch's bookkeeping costs little next to its decoding)."""
        rows: list[int] = []
        indices: list[int] = []
        samples: list[dict[str, Any]] = []
        shard_ids, records = self.locate([key[1] for key in keys])
        read: dict[int, list[int]] = {}  # shard -> [bytes, records] read from it here
        shards = self.index.shards
        buffers: dict[int, memoryview] = {}  # each shard's bytes, looked up once a batch
        for k, (shard_id, record) in enumerate(zip(shard_ids.tolist(), records.tolist(), strict=True)):
            data = datas[k] if datas else None
            sample = None
            if data is None and self.verify and (shard_id in buffers or self._opens(shard_id, buffers)):
                # The common case in a few lines (a sample's Python is what a small image's rate is made
                # of): the record's bytes in place, its length and checksum, its fields as views. Anything
                # amiss goes the checked way below, which names (or skips) it.
                shard = shards[shard_id]
                start, end = shard.offsets.item(record), shard.offsets.item(record + 1)
                view = buffers[shard_id][start:end]
                if len(view) == end - start and crc32(view) == shard.record_crc32.item(record):
                    sample = self._codec.decode_or_none(view, views=True)
                    if sample is not None:
                        _tally(read, shard_id, end - start)
            if sample is None:
                try:
                    data = self._record_bytes(shard_id, record, data, read)
                    # Views, not copies, of the encoded images: a chunk's records are decoded within this
                    # call, and copying them held a chunk of encoded bytes per thread (4.5 MB for 128 photos).
                    sample = self._parse(data, shard_id, record, views=True)
                except CorruptRecordError as error:
                    self._skip(error)
                    continue
            samples.append(sample)
            rows.append(k)
            indices.append(self._starts_list[shard_id] + record)
        if self.source.counters is not None:
            for shard_id, (nbytes, count) in read.items():
                self._count_read(shard_id, nbytes, count)
        return rows, indices, samples

    def read_encoded(
        self, keys: Sequence[tuple[int, int]], datas: Sequence[bytes | memoryview | None] | None = None
    ) -> tuple[EncodedBatch, torch.Tensor]:
        """The samples ``keys`` (one epoch) as an :class:`~kaisoku.data.loading.gpu_decode.EncodedBatch`,
        to be decoded on the training device, and their int64 labels, through the transform's ``encoded``
        (:class:`ImageLabelTransform`; ``decode_images=False``). Damaged records are skipped (left out) or
        raise as in :meth:`read_into`; ``datas`` as there. A non-JPEG image that does not decode (decoded
        here, on the host) raises naming its sample."""
        encoded = getattr(self.transform, "encoded", None)
        epochs = {int(key[0]) for key in keys}
        if encoded is None or self.decode_images or len(epochs) != 1:
            raise KaisokuError(
                "decoding on the device needs an ImageLabelTransform over encoded images "
                "(decode_images=False) and keys of one epoch"
            )
        _, indices, samples = self._parse_keys(keys, datas)
        if not samples:
            raise KaisokuError(
                f"cannot make a batch of {len(keys)} samples: none left after skipping damaged records"
            )
        batch, labels = encoded(samples, indices=indices, epoch=epochs.pop())
        return batch, torch.tensor(labels, dtype=torch.int64)

    def __getitems__(self, keys: Sequence[int | tuple[int, int]]) -> list[Any]:
        """Several samples at once (the DataLoader's batched fetch)."""
        return [self[key] for key in keys]

    def close(self) -> None:
        """Release the mmaps this process opened (they reopen on the next read)."""
        buffers, self._buffers = self._buffers, {}
        for buffer in buffers.values():
            if isinstance(buffer, mmap.mmap):
                buffer.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_buffers"] = {}  # mmaps are per process: reopened lazily after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    # -- internals -----------------------------------------------------------------------------

    def _check_index(self, index: int) -> int:
        index = operator.index(index)
        total = self._starts_list[-1]
        if index < 0:
            index += total
        if not 0 <= index < total:
            raise IndexError(f"sample index {index} out of range for {total} samples")
        return index

    def _describe(self, shard_id: int, record: int) -> str:
        return (
            f"{self.index.shard_path(shard_id)} record {record} "
            f"(sample {self._starts_list[shard_id] + record})"
        )

    def _check_file(self, shard_id: int) -> None:
        shard = self.index.shards[shard_id]
        path = self.index.shard_path(shard_id)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CorruptRecordError(
                f"shard file {path} is missing (shard {shard_id}, samples {self._starts_list[shard_id]}.."
                f"{self._starts_list[shard_id + 1] - 1}); re-pack or re-stage it, or use skip_corrupt",
                file=shard.file,
                record=0,
            ) from None
        if size != shard.nbytes:
            self._size_mismatch(shard_id, size)

    def _size_mismatch(self, shard_id: int, size: int) -> None:
        shard = self.index.shards[shard_id]
        path = self.index.shard_path(shard_id)
        if size < shard.nbytes:
            first_cut = int(np.searchsorted(shard.offsets[1:], size, side="right"))
            raise CorruptRecordError(
                f"shard {path} is truncated: {size} of {shard.nbytes} bytes, records {first_cut}.."
                f"{shard.samples - 1} (samples {self._starts_list[shard_id] + first_cut}..) are cut off; "
                "re-pack or re-stage it, or use skip_corrupt",
                file=shard.file,
                record=first_cut,
            )
        raise CorruptRecordError(
            f"shard {path} has {size} bytes, its index says {shard.nbytes}: "
            "the file was replaced; re-pack it",
            file=shard.file,
            record=0,
        )

    def _buffer(self, shard_id: int) -> Any:
        if self.source.opener is not None:
            buffer = self.source.opener(shard_id)
            size = len(memoryview(buffer))
            if size != self.index.shards[shard_id].nbytes and not self.skip_corrupt:
                self._size_mismatch(shard_id, size)
            return buffer
        if self._pid != os.getpid():  # inherited through fork: reopen in this process
            self._buffers, self._pid = {}, os.getpid()
        buffer = self._buffers.get(shard_id)
        if buffer is None:
            path = self.index.shard_path(shard_id)
            try:
                buffer = open_shard_mmap(path)
            except FileNotFoundError:
                if not self.skip_corrupt:
                    self._check_file(shard_id)
                logger.warning("shard file %s is missing: its records are skipped", path)
                buffer = b""
            except OSError as error:
                raise KaisokuError(f"cannot read shard {path}: {error.strerror or error}") from None
            size = len(buffer)
            if size != self.index.shards[shard_id].nbytes and not self.skip_corrupt:
                self._size_mismatch(shard_id, size)
            self._buffers[shard_id] = buffer
        return buffer

    def _opens(self, shard_id: int, buffers: dict[int, memoryview]) -> bool:
        """Put shard ``shard_id``'s bytes in ``buffers``; False when it cannot be opened (the checked path
        says why, or skips its records)."""
        try:
            buffers[shard_id] = memoryview(self._buffer(shard_id))
        except KaisokuError:
            return False
        return True

    def _record_view(self, shard_id: int, record: int) -> memoryview:
        return record_view(self.index, self._buffer(shard_id), shard_id, record, verify=self.verify)

    def _parse(
        self, data: bytes | memoryview, shard_id: int, record: int, *, views: bool = False
    ) -> dict[str, Any]:
        """The record's fields, images still encoded (``views``: uncopied, as :meth:`RecordCodec.decode`)."""
        try:
            return self._codec.decode(data, views=views)
        except Exception as error:  # a malformed record that passed (or skipped) its checksum
            raise CorruptRecordError(
                f"{self._describe(shard_id, record)} cannot be parsed ({error}); re-pack the dataset",
                file=self.index.shards[shard_id].file,
                record=record,
            ) from None

    def _finish(
        self,
        data: bytes | memoryview,
        shard_id: int,
        record: int,
        index: int,
        epoch: int,
        out: np.ndarray | None = None,
    ) -> Any:
        sample = self._parse(data, shard_id, record)
        if self.decode_images:
            for name in self._image_fields:
                try:
                    sample[name] = decode_image(sample[name])
                except KaisokuError as error:
                    raise CorruptRecordError(
                        f"{self._describe(shard_id, record)}: field {name!r}: {error}",
                        file=self.index.shards[shard_id].file,
                        record=record,
                    ) from None
        if out is not None:
            into = getattr(self.transform, "into", None)
            if into is None:
                raise KaisokuError(
                    f"the dataset's transform {type(self.transform).__name__} cannot write into a batch "
                    "buffer (it has no into method); use the processes loader (data.loader processes)"
                )
            return into(sample, index=index, epoch=epoch, out=out)
        if self.transform is not None:
            return self.transform(sample, index=index, epoch=epoch)
        return sample

    def _skip(self, error: CorruptRecordError) -> None:
        if not self.skip_corrupt:
            raise error
        self.skipped += 1
        if self.source.counters is not None:
            self.source.counters.add("skipped_records")
        if self.skipped <= _LOGGED_SKIPS:
            # Only what is damaged: the remedy the error carries (use skip_corrupt) is what is on already.
            logger.warning("skipped damaged record: %s", str(error).split("; ")[0])
        elif self.skipped == _LOGGED_SKIPS + 1:
            logger.warning("further damaged records are skipped without a message (see .skipped)")
        return None

"""Batches made by threads: samples decoded without the GIL straight into reused batch buffers.

JPEG decoding (libjpeg-turbo through simplejpeg), resampling (Pillow) and the flip-and-transpose copy
all release the GIL, so a few threads in the training process decode in parallel, and each writes its
samples into a preallocated batch (uint8 NCHW for images, in channels-last memory for RGB, as FFCV's
batches are; the sample's own dtype and shape otherwise, e.g. float32 volumes with float targets for
regression): no worker processes to start each epoch, no batch pickled
or passed through shared memory, no fresh batch tensor per step. Buffers come from a ring (a
:class:`BatchRing`) and are reused ``size`` batches later, so a batch stays valid while the trainer holds it (it
holds at most a step's micro-batches). A loader keeps its ring for every epoch: allocated (and, with
``pin_memory`` on CUDA, pinned) once, its pages touched once.

The samples are the ones the dataset's transform gives (keyed by (seed, epoch, index)), whichever thread
decodes them: a batch is bit-identical to the one the DataLoader path collates.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from kaisoku.errors import KaisokuError

Key = tuple[int, int]
SKIPPED_LABEL = np.iinfo(np.int64).min
"""The label slot of a sample skipped as damaged, in a batch whose labels are integers (left out of the
batch handed to the trainer)."""

ReadContext = Callable[[Sequence[Key]], contextlib.AbstractContextManager[object]]
"""Given a batch's keys, the context its reads run in, in the reading thread (the packed loader's says
which step they are for, see :meth:`kaisoku.data.node_cache.cache.NodeCache.reading_for`)."""


def no_read_context(keys: Sequence[Key]) -> contextlib.AbstractContextManager[object]:
    """The default :data:`ReadContext`: reads need nothing around them."""
    return contextlib.nullcontext()


class FillableDataset(Protocol):
    """A dataset that writes sample ``(epoch, index)`` into a given CHW uint8 array and returns its label."""

    def read_into(self, key: Key, out: np.ndarray) -> int | None:
        """Write the sample into ``out``; its label, or None when it was skipped as damaged."""
        ...

    def __getitem__(self, key: Key) -> Any:
        """The sample as ``(CHW uint8 array, label)``, or None when skipped."""
        ...


class BatchFillableDataset(FillableDataset, Protocol):
    """A :class:`FillableDataset` that also writes several samples in one call (the batch decode path)."""

    def read_batch_into(self, keys: Sequence[Key], out: np.ndarray) -> list[int | None]:
        """Write sample ``keys[k]`` into ``out[k]``; their labels, None for a sample skipped as damaged."""
        ...


class BatchRing:
    """``size`` batch buffers reused in turn, kept across iterations: one :class:`ThreadedBatches` iteration
    uses it at a time, going on from the slot the previous one stopped at, so the batches the trainer still
    holds from the previous epoch stay intact. ``pin_memory``: pinned buffers (where CUDA is present).

    The buffers are sized by the first samples read (their shape, dtype and target) and allocated on first
    use; again only for a larger batch. ``shared``: the image buffers live in shared memory, so that worker
    processes forked after they are allocated write into them (:mod:`~kaisoku.data.loading.worker_batches`);
    such a ring is not pickled.
    """

    def __init__(self, size: int, *, pin_memory: bool = False, shared: bool = False) -> None:
        self.size = int(size)
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.shared = shared
        self.shape: tuple[int, ...] | None = None
        """A sample's shape (None until the first sample is read)."""
        self.dtype = torch.uint8
        self.targets: np.ndarray | None = None
        """An array target's (shape, dtype) template, e.g. regression; None for integer labels."""
        self._buffers: list[tuple[torch.Tensor, np.ndarray]] = []
        self._kept: list[np.ndarray] = []
        self._slot = 0
        self._lease = threading.Lock()

    def size_by(self, sample: tuple[Any, Any]) -> None:
        """Take the buffers' sample shape, dtype and target kind from ``sample`` (image, label)."""
        image = np.asarray(sample[0])
        self.shape = tuple(image.shape)
        self.dtype = torch.from_numpy(image[:0]).dtype
        if isinstance(sample[1], np.ndarray):
            self.targets = sample[1]

    def lease(self) -> bool:
        """Claim the ring for one iteration; False when another iteration holds it (a generator not closed)."""
        return self._lease.acquire(blocking=False)

    def release(self) -> None:
        """End the iteration's claim (its decodes are done)."""
        self._lease.release()

    def take(self, batch: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The next buffers (images, labels, kept flags) for a batch of ``batch`` samples."""
        self.reserve(batch)
        return self.buffers(self.claim())

    def reserve(self, batch: int) -> None:
        """Have buffers for batches of ``batch`` samples (allocated now if they are smaller or missing)."""
        assert self.shape is not None, "size_by() first"
        if not self._buffers or self._buffers[0][0].shape[0] < batch:
            self._allocate(batch, self.shape)

    @property
    def capacity(self) -> int:
        """Samples a buffer holds (0 before the first allocation)."""
        return int(self._buffers[0][0].shape[0]) if self._buffers else 0

    @property
    def next_slot(self) -> int:
        """The slot :meth:`claim` hands out next."""
        return self._slot

    def claim(self) -> int:
        """The next slot, in turn."""
        slot = self._slot
        self._slot = (slot + 1) % self.size
        return slot

    def resume_after(self, slot: int) -> None:
        """Hand out the slot after ``slot`` next (the slots claimed since were never filled, or are done)."""
        self._slot = (slot + 1) % self.size

    def buffers(self, slot: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Slot ``slot``'s buffers: images, labels, kept flags."""
        images, labels = self._buffers[slot]
        return images, labels, self._kept[slot]

    def _allocate(self, batch: int, shape: tuple[int, ...]) -> None:
        self._buffers, self._kept = [], []
        # RGB images live in channels-last memory (each sample one HWC block, the batch an NCHW view): a
        # decoder writes a sample where it lies, with no HWC -> CHW copy; the trainer's first cast
        # (``normalize``) lays the batch out as the model wants it.
        image_batch = self.dtype == torch.uint8 and len(shape) == 3 and shape[0] == 3
        for _ in range(self.size):
            stored = (batch, shape[1], shape[2], shape[0]) if image_batch else (batch, *shape)
            if self.shared:
                images = _shared_empty(stored, self.dtype, pin=self.pin_memory)
            else:
                images = torch.empty(stored, dtype=self.dtype, pin_memory=self.pin_memory)
            if image_batch:
                images = images.permute(0, 3, 1, 2)
            if self.targets is None:
                labels = np.empty(batch, dtype=np.int64)
            else:
                labels = np.empty((batch, *self.targets.shape), dtype=self.targets.dtype)
            self._buffers.append((images, labels))
            self._kept.append(np.ones(batch, dtype=bool))


def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """An uninitialised tensor in anonymous shared memory (``mmap`` of no file, ``MAP_SHARED``): processes
    forked after it is made write into the same pages. Its pages are allocated as they are first written,
    and it does not live in /dev/shm, so a container's small /dev/shm does not bound it. ``pin``:
    page-locked where it lies (``cudaHostRegister``, CUDA's way for memory allocated elsewhere)."""
    count = math.prod(shape)
    nbytes = max(1, count * torch.empty((), dtype=dtype).element_size())
    try:
        region = mmap.mmap(-1, nbytes)
    except OSError as error:
        raise KaisokuError(
            f"cannot map {nbytes / 2**20:.1f} MiB of shared memory for the loader's batch buffers "
            f"({error.strerror or error}); lower data.global_batch or data.workers, or set data.loader threads"
        ) from None
    tensor = torch.frombuffer(region, dtype=dtype, count=count).view(shape)  # keeps ``region`` alive
    if pin:
        torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    return tensor


def finish_batch(
    images: torch.Tensor, labels: np.ndarray, kept: np.ndarray | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled batch as the trainer receives it: the samples skipped as damaged (``kept`` False, or, for
    integer labels without ``kept``, the label :data:`SKIPPED_LABEL`) left out, compacted into fresh tensors."""
    if kept is None:
        kept = labels != SKIPPED_LABEL
    if not kept.all():
        if not kept.any():
            raise KaisokuError(
                f"cannot make a batch of {len(labels)} samples: none left after skipping damaged records"
            )
        index = torch.from_numpy(np.flatnonzero(kept))
        return images.index_select(0, index), torch.from_numpy(labels[kept].copy())
    return images, torch.from_numpy(labels)


def first_samples(dataset: FillableDataset, keys: Sequence[Key]) -> list[tuple[Any, Any] | None]:
    """``keys``' samples read the ordinary way up to the first one not skipped (None: skipped as damaged):
    its shape sizes a ring's buffers."""
    first: list[tuple[Any, Any] | None] = []
    for key in keys:
        first.append(dataset[key])
        if first[-1] is not None:
            return first
    raise KaisokuError(
        f"cannot make a batch of {len(keys)} samples: none left after skipping damaged records"
    )


class ThreadedBatches:
    """Iterate ``(images, labels)`` batches for ``batches`` of keys, decoded by ``threads`` threads.

    ``prefetch`` batches are decoded ahead of the one being consumed, into the buffers of ``ring`` (at least
    ``prefetch + 2`` of them; None: a ring of its own of that many); the caller must be done with a batch
    ``ring.size - prefetch - 1`` batches later. A batch with samples skipped as damaged is returned compacted
    (smaller). An iteration that finds ``ring`` in use by another decodes into a ring of its own.

    ``chunked`` (a dataset with ``read_batch_into``, image samples): each thread decodes a contiguous
    chunk of the batch in one ``read_batch_into`` call (:mod:`kaisoku.data.loading.batch_augment`) instead
    of every ``threads``-th sample one call each. (The samples read to size the ring, the first ones it
    serves, stay the per-sample path's: read once, counted once.) Every read of a batch runs inside
    ``read_context(keys)``.
    """

    def __init__(
        self,
        dataset: FillableDataset,
        batches: Iterable[Sequence[Key]],
        *,
        threads: int,
        prefetch: int = 2,
        ring: BatchRing | None = None,
        chunked: bool = False,
        read_context: ReadContext = no_read_context,
    ) -> None:
        self.dataset = dataset
        self.read_context = read_context
        self.chunked = chunked and hasattr(dataset, "read_batch_into")
        self.batches = iter(batches)
        self.threads = max(1, int(threads))
        self.prefetch = max(1, int(prefetch))
        self.ring = ring if ring is not None else BatchRing(self.prefetch + 2)
        if self.ring.size < self.prefetch + 2:
            raise ValueError(
                f"a ring of {self.ring.size} buffers is too small for {self.prefetch} prefetched"
            )

    def _fill(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        kept: np.ndarray,
        keys: Sequence[Key],
        part: int,
        done: int,
        array_targets: bool,
    ) -> None:
        with self.read_context(keys):
            if self.chunked and not array_targets:
                size = -(-(len(keys) - done) // self.threads)
                begin, end = done + part * size, min(len(keys), done + (part + 1) * size)
                if begin < end:
                    # A BatchFillableDataset: ``chunked`` checked it has the method.
                    dataset: Any = self.dataset
                    got = dataset.read_batch_into(keys[begin:end], images[begin:end])
                    labels[begin:end] = [SKIPPED_LABEL if label is None else label for label in got]
                return
            for j in range(part, len(keys), self.threads):
                if j >= done:  # the first ``done`` samples were read while sizing the buffers
                    label = self.dataset.read_into(keys[j], images[j])
                    if not array_targets:
                        labels[j] = SKIPPED_LABEL if label is None else label
                    else:
                        kept[j] = label is not None
                        if label is not None:
                            labels[j] = label

    def _submit(self, pool: ThreadPoolExecutor, ring: BatchRing, keys: Sequence[Key]) -> tuple[Any, ...]:
        first: dict[int, tuple[np.ndarray, int] | None] = {}
        if ring.shape is None:
            with self.read_context(keys):
                first = dict(enumerate(first_samples(self.dataset, keys)))
            ring.size_by(next(s for s in first.values() if s is not None))
        array_targets = ring.targets is not None
        images, labels, kept = ring.take(len(keys))
        kept[:] = True
        view = images.numpy()[: len(keys)]
        for j, sample in first.items():
            if not array_targets:
                labels[j] = SKIPPED_LABEL if sample is None else sample[1]
            else:
                kept[j] = sample is not None
                if sample is not None:
                    labels[j] = sample[1]
            if sample is not None:
                view[j] = sample[0]
        done = len(first)
        futures = [
            pool.submit(self._fill, view, labels, kept, keys, part, done, array_targets)
            for part in range(self.threads)
        ]
        array_kept = kept[: len(keys)] if array_targets else None
        return images[: len(keys)], labels[: len(keys)], futures, array_kept

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        leased = self.ring.lease()
        ring = self.ring if leased else BatchRing(self.ring.size, pin_memory=self.ring.pin_memory)
        pending: deque[tuple[Any, ...]] = deque()
        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="kaisoku-decode") as pool:
                try:
                    for keys in self.batches:
                        pending.append(self._submit(pool, ring, keys))
                        if len(pending) > self.prefetch:
                            yield self._finish(pending.popleft())
                    while pending:
                        yield self._finish(pending.popleft())
                finally:
                    for _, _, futures, _ in pending:
                        for future in futures:
                            future.cancel()
        finally:  # the pool has shut down: no decode of this iteration still writes into the ring
            if leased:
                self.ring.release()

    @staticmethod
    def _finish(entry: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels, futures, kept = entry
        for future in futures:
            Future.result(future)  # re-raises a decoding error with its own message
        return finish_batch(images, labels, kept)

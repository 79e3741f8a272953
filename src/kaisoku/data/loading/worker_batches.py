"""Batches made by worker processes that outlive an epoch, each decoding whole batches into shared buffers.

The default ``data.loader batch`` path with ``data.workers`` >= 1. A DataLoader's worker processes (started
once, kept across epochs: ``persistent_workers``) each take a whole micro-batch of keys and decode it in
one call (:meth:`~kaisoku.data.loading.dataset.ShardedDataset.read_batch_into`, the batch path of
:mod:`~kaisoku.data.loading.batch_augment`) straight into a slot of a :class:`BatchRing` allocated in
shared memory before they start. What travels back is the slot and the labels, not the pixels: no batch
pickled, no shared-memory segment made per batch. Each worker runs its own interpreter, so the Python a
sample still costs (reading and checking its record, the calls around the decoder) runs on every core at
once instead of taking turns for one GIL, as threads of one process do; on the 64 px sets this is what
parallel decoding was waiting on (``benchmarks/README.md``).

Slots are handed out in turn by the batch sampler, in the training process. A worker writes the batch
``k`` it is given when training has taken batch ``k - prefetch * workers`` at the earliest (the DataLoader
sends a task as it hands a batch over), so a ring of :func:`ring_size` slots leaves the batches the
trainer still holds (a step's micro-batches and the previous step's) alone. A new pass over the data goes
on from the slot after the last one handed over: before it sends new tasks, the DataLoader's reset has
waited for every task of the previous pass to finish (and workers started again replace stopped ones).

The batches are the ones the thread paths make, bit for bit (the same keyed crops and flips, the same
decoder and resizer); damaged records are skipped or named as there.

The workers are forked from the rank as the pass that first needs them begins, before its first batch is
handed over: a rank forked while another of its threads enters Python (autograd's, during a step) can
leave the child stuck in its start under Python 3.11, and between passes no step runs. Forked, they share the rank's imports and
memory (a fresh interpreter importing torch would add about 280 MiB each).

The workers ignore the stop signals a rank handles (SIGTERM, SIGUSR1): Slurm sends them to every process of
a job step at its time limit, and the rank, stopping with a checkpoint, needs its workers for the step it
finishes. So they are stopped by the rank: by :meth:`WorkerBatches.close`, at the latest as the
interpreter exits (before ``multiprocessing`` would stop them with SIGTERM), or by their death with it.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import pickle
import signal
import traceback
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn

import torch
from torch.utils.data import DataLoader, Dataset

from kaisoku.data.loading.batches import (
    SKIPPED_LABEL,
    BatchRing,
    FillableDataset,
    ReadContext,
    finish_batch,
    first_samples,
)
from kaisoku.distributed.launch import die_with_rank
from kaisoku.errors import KaisokuError

PREFETCH = 2
"""Micro-batches each worker has been given ahead (the DataLoader's ``prefetch_factor``)."""


def ring_size(workers: int, micro_batches: int) -> int:
    """Slots a ring needs for ``workers`` workers: the batches sent ahead, plus the trainer's holding (a
    step's micro-batches and the previous step's), plus the one being handed over."""
    return PREFETCH * workers + 2 * micro_batches + 1


class _SlotKeys:
    """A micro-batch's keys and the ring slot its samples go to: one DataLoader task. ``head``: the labels
    of its first samples, read (and put into the slot) by the training process (None: skipped)."""

    __slots__ = ("keys", "slot", "head")

    def __init__(self, keys: Sequence[tuple[int, int]], slot: int, head: Sequence[Any] = ()) -> None:
        self.keys = keys
        self.slot = slot
        self.head = head


class _Failed:
    """What a worker returns for a batch that stopped on a known failure: the error itself (every
    :class:`KaisokuError` pickles) and where in the worker it was raised."""

    __slots__ = ("error", "worker_traceback")

    def __init__(self, error: KaisokuError) -> None:
        try:
            pickle.dumps(error)
            self.error = error
        except Exception:  # a subclass whose arguments do not pickle: its class is lost, its message kept
            self.error = KaisokuError(str(error))
        self.worker_traceback = "".join(traceback.format_exception(error))

    def raise_here(self) -> NoReturn:
        """Raise the error in the training process, the same class with the same message (the failure it
        is classified as, the line it prints); the worker's traceback goes with it as a note, for the log."""
        self.error.add_note(f"raised in a loader worker process:\n{self.worker_traceback}")
        raise self.error


class _Slotted:
    """The DataLoader's batch sampler: the current pass's batches, each given the ring's next slot."""

    def __init__(self, ring: BatchRing) -> None:
        self.ring = ring
        self.batches: Iterator[Sequence[tuple[int, int]]] = iter(())
        self.head: list[tuple[Any, Any] | None] = []
        """The first batch's first samples, read in this process (what sized the ring)."""

    def __iter__(self) -> Iterator[_SlotKeys]:
        for keys in self.batches:
            if len(keys) > self.ring.capacity:
                raise KaisokuError(
                    f"a batch of {len(keys)} samples outgrew the loader's buffers of {self.ring.capacity}"
                )
            slot = self.ring.claim()
            head_labels: list[Any] = []
            if self.head:  # the pass's first batch only, once: no work on the others
                images = self.ring.buffers(slot)[0].numpy()
                for k, sample in enumerate(self.head):
                    if sample is not None:
                        images[k] = sample[0]
                head_labels = [None if sample is None else sample[1] for sample in self.head]
                self.head = []
            yield _SlotKeys(keys, slot, head_labels)


class _RingFiller(Dataset):
    """What a worker process runs: each task's samples decoded into its slot of the shared ring."""

    def __init__(self, samples: FillableDataset, ring: BatchRing, read_context: ReadContext) -> None:
        self.samples = samples
        self.ring = ring
        self.read_context = read_context

    def __len__(self) -> int:
        return len(self.samples)  # type: ignore[arg-type]  # every dataset the loader reads has a length

    def __getitem__(self, key: tuple[int, int]) -> Any:
        """Sample ``key`` the ordinary way (tasks come as whole batches, through :meth:`__getitems__`)."""
        return self.samples[key]

    def __getitems__(self, task: _SlotKeys) -> tuple[int, list[Any]] | _Failed:
        """Decode ``task``'s samples (those after its head) into its slot; the slot and the labels (None:
        skipped as damaged)."""
        done = len(task.head)
        images = self.ring.buffers(task.slot)[0].numpy()[done : len(task.keys)]
        keys = task.keys[done:]
        read_batch_into = getattr(self.samples, "read_batch_into", None)
        try:
            with self.read_context(task.keys):
                if read_batch_into is not None:
                    return task.slot, [*task.head, *read_batch_into(keys, images)]
                return task.slot, [
                    *task.head,
                    *(self.samples.read_into(key, images[k]) for k, key in enumerate(keys)),
                ]
        except KaisokuError as error:  # the training process raises it (_Failed.raise_here)
            return _Failed(error)


def _worker_init(worker_id: int) -> None:
    """A worker's start: it dies with its rank, and leaves the rank's stop signals to the rank."""
    die_with_rank(worker_id)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


_OPEN: weakref.WeakSet[WorkerBatches] = weakref.WeakSet()
"""Every :class:`WorkerBatches` whose workers may be running: stopped at exit (:func:`_close_all`)."""


@atexit.register
def _close_all() -> None:
    """Stop every worker still running as the interpreter exits: they ignore the SIGTERM ``multiprocessing``
    would stop them with (registered after its own exit hook, so run before it)."""
    for batches in list(_OPEN):
        batches.close()


def _as_is(batch: Any) -> Any:
    """The DataLoader's collate function: a task's result needs none."""
    return batch


class WorkerBatches:
    """``workers`` worker processes filling ``ring`` (shared, :func:`ring_size` slots), kept across passes.

    :meth:`pass_over` iterates one pass's ``(images, labels)``. The workers start on the first pass that
    needs them and are kept for the next ones; they start again when the samples or the read context differ
    from the previous pass's (the samples received from other nodes change each epoch), or when a batch
    outgrows the buffers. The first sample ever is read here, in this process: it sizes the
    ring before the workers that share it start.
    """

    def __init__(self, workers: int, ring: BatchRing) -> None:
        if not ring.shared:
            raise ValueError("WorkerBatches needs a ring in shared memory (BatchRing(shared=True))")
        self.workers = max(1, int(workers))
        self.ring = ring
        self._slotted = _Slotted(ring)
        self._loader: DataLoader[Any] | None = None
        self._serving: tuple[Any, Any] | None = None  # (samples, read context) the workers were started with
        self._last: int | None = None  # the slot of the last batch handed over

    def pass_over(
        self,
        samples: FillableDataset,
        batches: Iterable[Sequence[tuple[int, int]]],
        read_context: ReadContext,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass's batches of ``samples`` for the key lists ``batches``, each read inside
        ``read_context(keys)``."""
        pending = iter(batches)
        first = next(pending, None)
        self._slotted.head = []
        results: Iterator[Any] = iter(())
        if first is not None:
            if self.ring.shape is None:  # sized by the first sample, read here; its task carries it
                with read_context(first):
                    self._slotted.head = first_samples(samples, first)
                self.ring.size_by(next(s for s in self._slotted.head if s is not None))
            if len(first) > self.ring.capacity:
                self.close()
                self.ring.reserve(len(first))
            serving = self._serving  # None exactly while no workers run (close() clears both)
            if serving is None or serving[0] is not samples or serving[1] is not read_context:
                self._start(samples, read_context)
            if self._last is not None:
                self.ring.resume_after(self._last)
            self._slotted.batches = itertools.chain([first], pending)
            assert self._loader is not None
            # Before the first batch is handed over: the workers are forked (on a pass's first use) before
            # training runs a step of it, while no other thread of the rank is in Python.
            results = iter(self._loader)
        for result in results:
            if isinstance(result, _Failed):
                result.raise_here()
            slot, labels = result
            self._last = slot
            yield self._handed_over(slot, labels)

    def _handed_over(self, slot: int, got: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels, kept = self.ring.buffers(slot)
        count = len(got)
        if self.ring.targets is None:
            labels[:count] = [SKIPPED_LABEL if label is None else label for label in got]
            return finish_batch(images[:count], labels[:count], None)
        for k, label in enumerate(got):
            kept[k] = label is not None
            if label is not None:
                labels[k] = label
        return finish_batch(images[:count], labels[:count], kept[:count])

    def _start(self, samples: FillableDataset, read_context: ReadContext) -> None:
        self.close()
        self._loader = DataLoader(
            _RingFiller(samples, self.ring, read_context),
            batch_sampler=self._slotted,  # type: ignore[arg-type]  # any iterable of tasks will do
            num_workers=self.workers,
            collate_fn=_as_is,
            persistent_workers=True,
            prefetch_factor=PREFETCH,
            worker_init_fn=_worker_init,
            # Forked: a worker shares the rank's imports and pages (copied only where written), where a
            # fresh interpreter with torch imported adds about 280 MiB; it runs none of the user's script.
            multiprocessing_context=multiprocessing.get_context("fork"),
        )
        self._serving = (samples, read_context)
        _OPEN.add(self)

    def close(self) -> None:
        """Stop the workers (they start again on the next pass)."""
        loader, self._loader, self._serving = self._loader, None, None
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            # The DataLoader keeps its persistent workers' iterator; ending it stops and joins them now
            # rather than whenever the loader is collected.
            iterator._shutdown_workers()
            for worker in getattr(iterator, "_workers", ()):
                if worker.is_alive():  # not done within the DataLoader's wait; SIGTERM is ignored here
                    worker.kill()
                    worker.join()
        del loader

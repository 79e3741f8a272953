"""Saved activations moved out of the training memory until backward needs them (``saved_tensors_hooks``).

- :class:`DiskOffload` (any device): out-of-core to a node-local directory (``memory.offload_dir``). A
  background writer writes each saved activation to its own file and drops it from memory; backward
  reads them back in reverse order of saving (the order it needs them), a background reader keeping
  :attr:`~DiskOffload.read_ahead` tensors ahead of it. Files are deleted once read.
- :class:`PinnedOffload` (CUDA): copies saved activations to pinned host memory on a side stream and
  copies them back on that stream ahead of backward (prefetch of the next tensors in backward order),
  the pattern of the PyTorch saved-tensors-hooks documentation.

A tensor saved by several operations is moved once (same tensor object -> same handle). Parameters,
non-float and small tensors (under :data:`MIN_BYTES`) stay as they are. Exact: the bytes come back
unchanged. :func:`check_offload_dir` refuses a missing, unwritable or full directory in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kaisoku.errors import ConfigError
from kaisoku.units import format_bytes

#: Tensors smaller than this stay in memory: not worth a file or a copy.
MIN_BYTES = 1 << 16
#: Bytes of saved tensors waiting for the writer before the forward pass waits for it (back-pressure).
MAX_PENDING = 16 << 20
#: Free space an offload directory needs at least, when the run's need is not known yet.
MIN_FREE = 64 << 20


def check_offload_dir(directory: str, need_bytes: int = MIN_FREE) -> Path:
    """``directory`` resolved, after checking it exists, is writable and has ``need_bytes`` free.

    A one-line :class:`ConfigError` naming the directory otherwise (raised before training starts).
    """
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ConfigError(f"memory.offload_dir {path} does not exist or is not a directory; create it first")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kaisoku-probe-") as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
    except OSError as exc:
        raise ConfigError(f"memory.offload_dir {path} is not writable ({exc.strerror or exc})") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise ConfigError(
            f"memory.offload_dir {path} is full: {format_bytes(free)} free, a step needs {format_bytes(need_bytes)}"
        )
    return path


def _offloadable(tensor: torch.Tensor, min_bytes: int = MIN_BYTES) -> bool:
    return (
        tensor.is_floating_point()
        and tensor.layout == torch.strided
        and not isinstance(tensor, nn.Parameter)
        and tensor.numel() * tensor.element_size() >= min_bytes
    )


class _Registry:
    """Handles of one step's saved tensors: a tensor saved twice gets the same handle."""

    def __init__(self) -> None:
        self.count = 0
        """Handles given so far; never reset, so a late write of one step cannot collide with the next."""
        self.uses: dict[int, int] = {}
        """Handle -> how many saves of it backward has not unpacked yet."""
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

    def handle(self, tensor: torch.Tensor) -> tuple[int, bool]:
        """(handle, new) for ``tensor``."""
        key = id(tensor)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is tensor:
            self.uses[seen[1]] += 1
            return seen[1], False
        index = self.count
        self.count += 1
        self._seen[key] = (weakref.ref(tensor), index)
        self.uses[index] = 1
        return index, True

    def used(self, index: int) -> bool:
        """Count one unpack of ``index``; True when it was the last one (the tensor can be let go)."""
        self.uses[index] -= 1
        return self.uses[index] <= 0

    def clear(self) -> None:
        """Forget the step's tensors."""
        self.uses.clear()
        self._seen.clear()


class _SavedTensorHooks:
    """What both offload targets share: the saved-tensors hooks around a step or a block."""

    _segment: int = 0
    _segments: dict[int, int]

    def _pack(self, tensor: torch.Tensor) -> Any:
        raise NotImplementedError

    def _unpack(self, packed: Any) -> torch.Tensor:
        raise NotImplementedError

    def begin(self) -> None:
        """Start a step: forget the previous step's saved tensors."""
        raise NotImplementedError

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Offload what the forward pass inside saves (one forward per step)."""
        self.begin()
        with self.hooks():
            yield

    def hooks(self) -> Any:
        """The saved-tensors hooks alone (for one block; :meth:`begin` once per step).

        Each call opens a segment: backward reads ahead only within the segment it is in, so a
        block's backward never brings back an earlier block's tensors while its own are still held.
        """
        self._segment += 1
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _mark(self, index: int) -> None:
        """Remember the segment the tensor of handle ``index`` was saved in."""
        self._segments[index] = self._segment

    def _ahead(self, index: int, count: int) -> list[int]:
        """The handles saved just before ``index`` in its segment (what backward needs next), nearest first."""
        segment = self._segments.get(index)
        out = []
        for ahead in range(index - 1, max(-1, index - 1 - count), -1):
            if self._segments.get(ahead) != segment:
                break
            out.append(ahead)
        return out


class DiskOffload(_SavedTensorHooks):
    """Out-of-core saved activations in ``directory`` (a private sub-directory, removed by :meth:`close`)."""

    def __init__(
        self,
        directory: str,
        *,
        read_ahead: int = 4,
        max_pending_bytes: int = MAX_PENDING,
        min_bytes: int = MIN_BYTES,
    ) -> None:
        root = check_offload_dir(directory)
        self.min_bytes = min_bytes
        self.dir = Path(tempfile.mkdtemp(prefix="kaisoku-offload-", dir=root))
        atexit.register(shutil.rmtree, self.dir, True)  # a run that ends without close() leaves no files
        self.read_ahead = read_ahead
        self.max_pending_bytes = max_pending_bytes
        self.written_bytes = 0
        """Bytes written to files so far (all steps)."""
        self._registry = _Registry()
        self._segments = {}
        self._meta: dict[int, tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device]] = {}
        self._pending: dict[int, torch.Tensor] = {}  # saved, not yet written: still in memory
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._reads: dict[int, Future[torch.Tensor]] = {}
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kaisoku-offload-read")
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="kaisoku-offload-write", daemon=True)
        self._writer.start()

    def _file(self, index: int) -> Path:
        return self.dir / f"{index}.bin"

    def _write_loop(self) -> None:
        while True:
            index = self._queue.get()
            if index is None:
                return
            try:
                self._write_one(index)
            finally:
                self._queue.task_done()  # flush() joins the queue: no write may still be in flight

    def _write_one(self, index: int) -> None:
        with self._cond:
            tensor = self._pending.get(index)
        if tensor is not None:
            try:
                flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
                flat.numpy().tofile(self._file(index))
            except BaseException as exc:  # surfaced on the training thread at unpack
                self._error = exc
        with self._cond:
            if tensor is not None and self._pending.pop(index, None) is not None:
                size = tensor.numel() * tensor.element_size()
                self._pending_bytes -= size
                self.written_bytes += size
            elif tensor is not None:  # backward used it from memory meanwhile: the file is not needed
                self._file(index).unlink(missing_ok=True)
            self._cond.notify_all()

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not _offloadable(tensor, self.min_bytes):
            return tensor
        index, new = self._registry.handle(tensor)
        if new:
            size = tensor.numel() * tensor.element_size()
            with self._cond:  # back-pressure: the forward pass waits for the writer past the limit
                self._cond.wait_for(lambda: self._pending_bytes <= self.max_pending_bytes)
                self._pending[index] = tensor.detach()
                self._pending_bytes += size
            self._meta[index] = (tensor.shape, tensor.stride(), tensor.dtype, tensor.device)
            self._mark(index)
            self._queue.put(index)
        return ("disk", index)

    def _read(self, index: int) -> torch.Tensor:
        with self._cond:
            self._cond.wait_for(lambda: index not in self._pending)
        shape, stride, dtype, device = self._meta[index]
        path = self._file(index)
        data = torch.from_numpy(np.fromfile(path, dtype=np.uint8)).view(dtype)
        with contextlib.suppress(OSError):
            path.unlink()
        if list(stride) == list(torch.empty(shape, device="meta").stride()):
            out = data.view(shape)
        else:
            out = torch.empty_strided(shape, stride, dtype=dtype).copy_(data.view(shape))
        return out.to(device, non_blocking=True)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        index = packed[1]
        last = self._registry.used(index)
        with self._cond:
            pending = self._pending.get(index)
            if pending is not None and last:  # not written yet, and never needed again: skip the write
                del self._pending[index]
                self._pending_bytes -= pending.numel() * pending.element_size()
                self._cond.notify_all()
        if pending is not None:  # backward caught up with the writer: use it from memory
            return pending
        future = self._reads.pop(index, None) if last else self._reads.get(index)
        if future is None:
            future = self._reader.submit(self._read, index)
            if not last:
                self._reads[index] = future
        # Read ahead in backward order: the tensors saved just before this one are needed next.
        for ahead in self._ahead(index, self.read_ahead):
            if ahead not in self._reads and ahead in self._meta and self._registry.uses.get(ahead, 0) > 0:
                self._reads[ahead] = self._reader.submit(self._read, ahead)
        if self._error is not None:
            raise self._error
        return future.result()

    def flush(self) -> None:
        """Wait until every saved tensor is written and the writer is idle (a write racing backward, whose
        tensor backward took from memory, has removed its file again)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending)
        self._queue.join()

    def begin(self) -> None:
        """Start a step: forget the previous one's tensors and files."""
        # Tensors of the previous step that backward never read (a graph dropped unused).
        for future in self._reads.values():
            future.cancel()
        self._reads.clear()
        self._registry.clear()
        with self._cond:  # the writer finishes the previous step before its files go
            self._cond.wait_for(lambda: not self._pending)
        for stale in self.dir.glob("*.bin"):
            stale.unlink(missing_ok=True)
        self._meta.clear()
        self._segments.clear()

    def close(self) -> None:
        """Stop the threads and remove the private directory."""
        self._queue.put(None)
        self._writer.join(timeout=30)
        self._reader.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __del__(self) -> None:  # best effort: a run that ends without close() leaves no files
        with contextlib.suppress(Exception):
            if self._writer.is_alive():
                self._queue.put(None)
            shutil.rmtree(self.dir, ignore_errors=True)


class PinnedOffload(_SavedTensorHooks):
    """CUDA saved activations copied to pinned host memory on a side stream, prefetched back for backward."""

    def __init__(self, device: torch.device, *, prefetch: int = 2) -> None:
        if device.type != "cuda":
            raise ConfigError("memory.offload pinned needs a CUDA device; use disk with memory.offload_dir")
        self.device = device
        self.prefetch = prefetch
        self.min_bytes = MIN_BYTES
        self.stream = torch.cuda.Stream(device)
        self._registry = _Registry()
        self._segments = {}
        self._host: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}
        self._back: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "cuda" or not _offloadable(tensor, self.min_bytes):
            return tensor
        index, new = self._registry.handle(tensor)
        if new:
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)  # same strides
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            tensor.record_stream(self.stream)  # its memory is reused only after the copy
            self._host[index] = (host, done)
            self._mark(index)
        return ("pinned", index)

    def _fetch(self, index: int) -> None:
        if index in self._back or index not in self._host:
            return
        host, written = self._host[index]
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(written)
            device_copy = host.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self._back[index] = (device_copy, ready)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        index = packed[1]
        last = self._registry.used(index)
        self._fetch(index)
        for ahead in self._ahead(index, self.prefetch):
            self._fetch(ahead)  # the tensors backward needs next
        tensor, ready = self._back.pop(index) if last else self._back[index]
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        tensor.record_stream(current)
        return tensor

    def flush(self) -> None:
        """Wait until every copy to the host is done."""
        self.stream.synchronize()

    def begin(self) -> None:
        """Start a step: forget the previous one's host copies."""
        self._registry.clear()
        self._segments.clear()
        self._host.clear()
        self._back.clear()

    def close(self) -> None:
        """Nothing to release beyond the host buffers of the last step."""
        self._host.clear()
        self._back.clear()


def build_offload(mode: str, device: torch.device, directory: str) -> DiskOffload | PinnedOffload | None:
    """The offload of ``memory.offload``: ``pinned`` (CUDA), ``disk`` (``directory``) or None."""
    if mode == "pinned":
        return PinnedOffload(device)
    if mode == "disk":
        if not directory:
            raise ConfigError("memory.offload disk needs memory.offload_dir (a node-local directory)")
        return DiskOffload(directory)
    return None

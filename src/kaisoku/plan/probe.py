"""``kaisoku probe PATH``: measure the file system holding PATH and this node's tiers; write a cluster TOML.

Measured, each within a share of ``--seconds``:

* sequential read bandwidth of the file system at PATH vs concurrent readers (1, 2, 4, 8, 16 threads,
  each reading its own scratch file);
* small-file reads per second vs readers (open + read of ~1.5 KB files) and the same for ~100 KB files;
* write and read bandwidth of a node-local folder (``--local``, default the system's temporary folder)
  and of the RAM tier (/dev/shm);
* with ``--train CONFIG``: the compute time of one training step of that ``kaisoku train`` config
  (:func:`measure_step`), written as ``[compute] step_seconds`` and ``batch_per_rank``; the config is
  resolved by the function :func:`kaisoku.plan.probe_command.cmd_probe` is handed (the command line's, which ``kaisoku train`` uses).

Every figure is measured in :data:`REPEATS` passes (each on files of its own where files are written): the
profile keeps their median and, as ``<key>_low`` and ``<key>_high``, the slowest and the fastest, which
``kaisoku plan`` turns into a range on every prediction.

The page cache is dropped before every read pass where this process may (root, /proc/sys/vm/drop_caches);
otherwise each pass reads files no earlier pass touched and the profile says the cache was not dropped.
The node-to-node bandwidth cannot be measured from one node: the profile carries a loopback TCP figure,
marked as such, to be replaced by the interconnect's. On a PATH that is not writable the probe says so in
one line and measures what reading needs no writing: existing files under PATH.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kaisoku.errors import ConfigError

if TYPE_CHECKING:
    from kaisoku.config import Config

READERS = (1, 2, 4, 8, 16)
REPEATS = 3
"""Passes per measured figure: the profile keeps their median and, as the figure's range, the slowest and
the fastest (``kaisoku plan`` shows the range and chooses at its slow end)."""
SMALL_BYTES = 1536
MEDIUM_BYTES = 100 * 1024
_CHUNK = 1 << 20
FOLDERS = 16
"""Folders the probe's small files are spread over (a dataset's files lie in many class folders)."""


def spread(paths: Sequence[Path]) -> list[Path]:
    """``paths`` in a random order keyed by their count (reads then hop between folders, as a shuffled
    epoch over class folders does, instead of walking one folder)."""
    import random

    out = list(paths)
    random.Random(len(out)).shuffle(out)
    return out


def is_writable(folder: Path) -> bool:
    """Whether scratch files can be made in ``folder`` (tried, not guessed from permission bits)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def can_drop_caches() -> bool:
    """Whether this process may drop the page cache."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> bool:
    """Drop the page cache where allowed; whether it was dropped."""
    if not can_drop_caches():
        return False
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as handle:
        handle.write("3\n")
    return True


def _write_file(path: Path, nbytes: int, *, sync: bool = True) -> None:
    block = os.urandom(min(nbytes, _CHUNK))
    with open(path, "wb") as handle:
        left = nbytes
        while left > 0:
            handle.write(block[: min(left, len(block))])
            left -= len(block)
        if sync:
            handle.flush()
            os.fsync(handle.fileno())


def _read_file(path: Path) -> int:
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(_CHUNK):
            total += len(chunk)
    return total


def parallel_read(paths: Sequence[Path], readers: int, deadline: float) -> tuple[float, int, int]:
    """Read ``paths`` with ``readers`` threads until done or ``deadline``: seconds, bytes, files read."""
    lock = threading.Lock()
    state = {"next": 0, "bytes": 0, "files": 0}

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                i = state["next"]
                state["next"] += 1
            if i >= len(paths):
                return
            n = _read_file(paths[i])
            with lock:
                state["bytes"] += n
                state["files"] += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        for future in [pool.submit(worker) for _ in range(readers)]:
            future.result()
    return time.perf_counter() - start, state["bytes"], state["files"]


def _tier(folder: Path, nbytes: int) -> tuple[float, float]:
    """Write then read bandwidth (bytes/s) of one file of ``nbytes`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"kaisoku-probe-tier-{os.getpid()}.bin"
    try:
        start = time.perf_counter()
        _write_file(path, nbytes)
        write = nbytes / (time.perf_counter() - start)
        drop_caches()
        start = time.perf_counter()
        _read_file(path)
        return write, nbytes / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)


def _loopback_bandwidth(nbytes: int = 64 << 20) -> float:
    """Bytes/s through a loopback TCP connection (a stand-in where no second node is at hand)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(_CHUNK):
                received[0] += len(data)

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    block = b"\0" * _CHUNK
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as client:
        for _ in range(nbytes // _CHUNK):
            client.sendall(block)
    thread.join(30)
    server.close()
    return received[0] / (time.perf_counter() - start)


def _with_range(key: str, passes: list[list[float]], scale: float, digits: int) -> dict[str, list[float]]:
    """``key`` (the median pass per reader count), ``key_low`` and ``key_high`` (the slowest and the fastest),
    scaled and rounded; the rounding never leaves the median outside its range."""
    middle = [round(statistics.median(rates) * scale, digits) for rates in passes]
    low = [min(m, round(min(rates) * scale, digits)) for m, rates in zip(middle, passes, strict=True)]
    high = [max(m, round(max(rates) * scale, digits)) for m, rates in zip(middle, passes, strict=True)]
    return {key: middle, f"{key}_low": low, f"{key}_high": high}


def probe(
    path: str | Path,
    *,
    seconds: float = 60.0,
    local: str | Path | None = None,
    ram: str | Path = "/dev/shm",
    readers: Sequence[int] = READERS,
    progress: Callable[[str, float], None] | None = None,
    sync: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Measure and return the profile as a TOML-ready mapping (see the module docstring).

    ``sync``: called before every read pass of the shared file system, the same number of times on
    every host whose ``path`` is writable alike; the probe of a job's hosts passes a barrier, so that
    every host reads together and each figure is what a host gets while all of them read.
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"kaisoku probe: {root} is not a folder")
    report = progress or (lambda what, fraction: None)
    together = sync or (lambda: None)
    started = time.monotonic()
    dropped = can_drop_caches()
    cache_note = (
        "page cache dropped before every read pass"
        if dropped
        else "page cache NOT dropped (no permission): each pass reads files written for it alone"
    )
    writable = is_writable(root)
    scratch = Path(tempfile.mkdtemp(prefix="kaisoku-probe-", dir=root)) if writable else None
    seq: list[list[float]] = []  # per reader count: the rate of each pass
    small: list[list[float]] = []
    medium: list[list[float]] = []
    notes: list[str] = []
    try:
        budget = seconds * (0.7 if writable else 0.9)
        # Three passes per reader count where scratch files can be written, two (existing files) otherwise.
        per_pass = budget / ((3 if writable else 2) * len(readers))
        if scratch is not None:
            calibration = scratch / "calibrate.bin"
            t0 = time.perf_counter()
            _write_file(calibration, 1 << 20)
            write_rate = (1 << 20) / (time.perf_counter() - t0)
            # Every pass reads files no other pass touched; their writing takes ~20% of the budget.
            big = max(256 << 10, min(32 << 20, int(write_rate * seconds * 0.2 / sum(readers) / REPEATS)))
            for i, count in enumerate(readers):
                report(f"sequential reads, {count} readers", i / (3 * len(readers)))
                rates = []
                for repeat in range(REPEATS):
                    files = []
                    for j in range(count):
                        p = scratch / f"seq-{count}-{repeat}-{j}.bin"
                        _write_file(p, big, sync=False)
                        files.append(p)
                    drop_caches()
                    together()
                    s, n, _ = parallel_read(files, count, time.monotonic() + per_pass * 4 / REPEATS)
                    rates.append(n / s)
                seq.append(rates)
            for size, out, tag in ((SMALL_BYTES, small, "1.5 KB"), (MEDIUM_BYTES, medium, "100 KB")):
                for i, count in enumerate(readers):
                    report(
                        f"{tag} files, {count} readers",
                        (len(readers) * (1 + (out is medium)) + i) / (3 * len(readers)),
                    )
                    folder = scratch / f"small-{size}-{count}"
                    for j in range(FOLDERS):
                        (folder / f"d{j:02d}").mkdir(parents=True)
                    files = []
                    t0 = time.monotonic()
                    while len(files) < 4000 and time.monotonic() - t0 < per_pass:
                        p = folder / f"d{len(files) % FOLDERS:02d}" / f"{len(files):05d}.bin"
                        _write_file(p, size, sync=False)
                        files.append(p)
                    order = spread(files)
                    rates = []
                    for repeat in range(REPEATS):  # each pass its own share of the files
                        drop_caches()
                        together()
                        share = order[repeat::REPEATS] or order
                        s, _, done = parallel_read(share, count, time.monotonic() + per_pass / REPEATS)
                        rates.append(done / s)
                    out.append(rates)
        else:
            notes.append(f"{root} is not writable: only reads of files already under it were measured")
            print(
                f"kaisoku probe: {root} is not writable; measuring only reads of the files already there",
                file=sys.stderr,
            )
            found = sorted(
                (p for p in root.rglob("*") if p.is_file() and os.access(p, os.R_OK)),
                key=lambda p: p.stat().st_size,
            )[:20000]
            if not found:
                raise ConfigError(f"kaisoku probe: {root} is not writable and holds no readable files")
            # Small-file reads: the smallest files only (up to 4x the smallest size), never the large ones.
            smallest = found[0].stat().st_size
            little = [p for p in found[:4000] if p.stat().st_size <= max(4 * smallest, 4096)]
            large = found[-max(readers) :]
            for i, count in enumerate(readers):
                report(f"existing files, {count} readers", i / len(readers))
                seq.append([])
                small.append([])
                for repeat in range(REPEATS):
                    drop_caches()
                    together()
                    # Every pass reads all the large files it can in its time share (one file is latency).
                    s, n, _ = parallel_read(large, count, time.monotonic() + per_pass / REPEATS)
                    seq[-1].append(n / s)
                    drop_caches()
                    together()
                    share = spread(little)[repeat::REPEATS] or little
                    s, _, done = parallel_read(share, count, time.monotonic() + per_pass / REPEATS)
                    small[-1].append(done / s)
        report("local and RAM tiers", 0.95)
        tier_bytes = int(min(64 << 20, max(4 << 20, seconds * (1 << 20))))
        local_dir = Path(local) if local else Path(tempfile.gettempdir())
        local_w, local_r = _tier(local_dir, tier_bytes)
        ram_w, ram_r = _tier(Path(ram), tier_bytes)
        net = [_loopback_bandwidth(max(8 << 20, tier_bytes) // REPEATS) for _ in range(REPEATS)]
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    report("done", 1.0)
    # The model's tables must not decrease where the readers' own files were the limit: keep them as measured.
    profile: dict[str, Any] = {
        "cluster": {"name": f"probe of {root}", "nodes": 1, "ranks_per_node": 1, "readers_per_node": 8},
        "shared_fs": {
            "readers": list(readers),
            **_with_range("seq_read_MBps", seq, 1e-6, 2),
            **_with_range("small_reads_per_s", small, 1.0, 1),
            "small_file_bytes": SMALL_BYTES if writable else int(little[len(little) // 2].stat().st_size),
        },
        "network": {
            "node_bandwidth_MBps": round(statistics.median(net) / 1e6, 1),
            "node_bandwidth_MBps_low": round(min(net) / 1e6, 1),
            "node_bandwidth_MBps_high": round(max(net) / 1e6, 1),
        },
        "local": {
            "path": str(local_dir),
            "capacity": int(shutil.disk_usage(local_dir).free * 0.9),
            "read_MBps": round(local_r / 1e6, 1),
            "write_MBps": round(local_w / 1e6, 1),
        },
        "ram": {
            "capacity": int(shutil.disk_usage(ram).free * 0.5),
            "bandwidth_MBps": round(min(ram_r, ram_w) / 1e6, 1),
        },
        "probe": {
            "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "path": str(root),
            "host": socket.gethostname(),
            "seconds": round(time.monotonic() - started, 1),
            "units": "MBps = 10^6 bytes/s; reads_per_s = files opened and read per second, all readers together",
            "seq_method": "N threads each read its own scratch file of the same size once, 1 MiB reads, unbuffered",
            "small_method": (
                "N threads open and read whole files of small_file_bytes, as many as fit the time share, in a "
                f"keyed random order over the files' folders ({FOLDERS} when the probe writes them): a network "
                "or FUSE file system may serialise the look-ups within one folder, as a dataset's class "
                "folders would not"
            ),
            "cache": cache_note,
            "tier_method": f"one file of {tier_bytes >> 20} MiB written (fsync) then read, in local.path and in /dev/shm",
            "network_method": "loopback TCP on this host: replace with the interconnect's per-node bandwidth",
            "capacity_method": "local: 90% of free space; ram: 50% of free /dev/shm",
        },
    }
    profile["probe"]["spread"] = (
        f"{REPEATS} passes per figure: the figure is their median, _low and _high the slowest and the fastest"
    )
    if medium:
        profile["probe"]["reads_per_s_100KB"] = [round(statistics.median(v), 1) for v in medium]
    if notes:
        profile["probe"]["notes"] = notes
    return profile


def measure_step(cfg: Config, *, config: str | Path, seconds: float = 10.0, ranks: int = 0) -> dict[str, Any]:
    """Compute time of one training step of ``cfg``, the ``kaisoku train`` config read from the file
    ``config``: the model and optimizer ``kaisoku train`` builds (same builders), forward, loss,
    backward and optimizer step on a random batch of the per-rank size, timed after 2 warm-up steps for
    up to ``seconds`` (at least 3 steps); the median. ``ranks``: ranks the global batch is split over
    (0: the config's ``dist.nproc``, or 1)."""
    import statistics

    # start-up: torch, the model zoo and the optimizers load only when --train asks for a step time
    import torch

    from kaisoku.models.zoo import build_model
    from kaisoku.optim.factory import build_optimizer

    world = ranks or max(1, cfg.dist.nproc)
    batch = max(1, cfg.data.global_batch // world // max(1, cfg.train.grad_accum))
    device = torch.device(
        "cuda" if cfg.train.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    )
    volume = cfg.model.name == "cosmoflow"
    classes = cfg.model.num_classes or (4 if volume else 1000)
    size = cfg.data.image_size
    shape = (4, size, size, size) if volume else (3, size, size)
    torch.manual_seed(cfg.train.seed)
    model = build_model(
        cfg.model.name, num_classes=classes, stem=cfg.model.stem, in_channels=shape[0], size=size,
        width=cfg.model.width,
    ).to(device)  # fmt: skip
    optimizer = build_optimizer(model, cfg.optim)
    inputs = torch.randn(batch, *shape, device=device)
    if volume:
        targets: torch.Tensor = torch.randn(batch, classes, device=device)
        loss_fn: Any = torch.nn.MSELoss()
    else:
        targets = torch.randint(0, classes, (batch,), device=device)
        loss_fn = torch.nn.CrossEntropyLoss()
    times: list[float] = []
    deadline = time.monotonic() + seconds
    for k in range(1000):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k >= 2:
            times.append(time.perf_counter() - start)
        if len(times) >= 3 and time.monotonic() > deadline:
            break
    return {
        "step_seconds": round(statistics.median(times), 6),
        "batch_per_rank": batch,
        "ranks": world,
        "config": str(config),
        "method": (
            f"median of {len(times)} steps (forward, loss, backward, {cfg.optim.name} step) of "
            f"{cfg.model.name} on a random batch of {batch} x {'x'.join(map(str, shape))} on {device.type}, "
            f"after 2 warm-up steps; {classes} outputs"
        ),
    }

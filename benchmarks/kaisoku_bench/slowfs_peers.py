"""The packed peers of ``kaisoku bench slowfs``: LitData, MosaicML Streaming (MDS) and WebDataset, each
reading its own format from the slow mount, with its own local cache where it has one.

The formats are written once on the serving side by the builders of :mod:`kaisoku_bench.loader_peers` (the
folders ``kaisoku bench loader`` uses, kept between runs) and read through the mount by its readers:
LitData as ``local:`` + the mounted folder (its remote-folder scheme: chunks copied into its cache as they
are read), MDS with the mounted folder as Streaming's ``remote`` and a local folder as its ``local`` cache,
WebDataset reading the tar shards in place (it keeps no cache of files it can open). Each peer decodes and
flips (simplejpeg) in 2 DataLoader workers, as in the warm-data benchmark.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kaisoku.plan.probe import drop_caches
from kaisoku_bench import loader_peers
from kaisoku_bench.imagesets import BATCH, WORKERS, ImageSet

PEERS = ("litdata", "mds", "webdataset")
"""The packed peers, in table order."""

CACHE = {
    "litdata": "LitData cache (local:, chunks copied as read)",
    "mds": "Streaming local (remote = the mount)",
    "webdataset": "none (tar shards read in place)",
}
"""What each peer keeps locally while it reads from the mount."""


def peer_folder(image_set: ImageSet, peer_dir: Path, name: str) -> Path:
    """Where peer ``name``'s format of ``image_set`` is kept (the folder ``kaisoku bench loader`` uses)."""
    return loader_peers.format_folder(peer_dir, image_set.folder.parent.name, name)


def write_format(image_set: ImageSet, peer_dir: Path, name: str) -> None:
    """Write peer ``name``'s format of ``image_set`` (once; kept between runs) through its builder in
    :mod:`kaisoku_bench.loader_peers`; raises :class:`~kaisoku_bench.loader_peers.PeerMissing`."""
    files = image_set.shuffled_files()
    folder = peer_folder(image_set, peer_dir, name)
    builders: dict[str, Callable[[], loader_peers.PeerLoader]] = {
        "litdata": lambda: loader_peers.litdata(files, folder, batch=BATCH, workers=WORKERS),
        "mds": lambda: loader_peers.mds(files, folder, batch=BATCH, workers=WORKERS),
        "webdataset": lambda: loader_peers.webdataset(files, folder, batch=BATCH, workers=WORKERS),
    }
    builders[name]().close()


def mounted_reader(name: str, mounted: Path, cache: Path) -> loader_peers.PeerLoader:
    """Peer ``name`` reading its format from ``mounted`` (the format's folder seen through the mount), with
    its local cache (if it has one) in ``cache``."""
    if name == "litdata":
        return loader_peers.litdata_reader(f"local:{mounted / 'data'}", cache, batch=BATCH, workers=WORKERS)
    if name == "mds":
        return loader_peers.mds_reader(mounted / "data", cache, batch=BATCH, workers=WORKERS)
    return loader_peers.webdataset_reader(mounted, batch=BATCH, workers=WORKERS)


def peer_epochs(
    build: Callable[[Path], loader_peers.PeerLoader], cache_root: Path, repeats: int
) -> list[dict[str, Any]]:
    """``repeats`` runs of 2 epochs of a peer, each run with a fresh reader and an empty cache folder
    (``build(cache)``; the reader opens the format's index before the clock starts, as kaisoku's rows
    do). An epoch is timed from the page-cache drop to its last batch, worker start-up included."""
    out: list[dict[str, Any]] = []
    for repeat in range(repeats):
        cache = cache_root / f"run{repeat}"
        shutil.rmtree(cache, ignore_errors=True)
        peer = build(cache)
        try:
            for epoch in range(2):
                drop_caches()
                start = time.perf_counter()
                samples = sum(int(labels.shape[0]) for _, labels in peer.make())
                out.append(
                    {
                        "repeat": repeat,
                        "epoch": epoch,
                        "seconds": time.perf_counter() - start,
                        "total": samples,
                    }
                )
        finally:
            peer.close()
            shutil.rmtree(cache, ignore_errors=True)
    return out

"""``kaisoku bench loader``: warm local data against peer loaders and the decode limit; the index's scale.

Rows: the ``ShardLoader`` ``kaisoku train`` builds (its batch path, the default), the same loader sample by
sample (``data.loader threads``, with the pixel difference between the two), its crop-aware decoding on the
ImageNet-like set, the peers of :mod:`kaisoku_bench.loader_peers`, and the single-thread decode limit times
the cores, over the sets of :mod:`kaisoku_bench.imagesets` (decode + flip, and random-resized-crop + flip),
interleaved, the first epoch reported apart. The index part is
:mod:`kaisoku_bench.loader_index`. Setup, goals and limits: ``benchmarks/README.md``, section loader.
"""

from __future__ import annotations

import functools
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaisoku.config import Config
from kaisoku.data.loading.batch_augment import decode_batch_into
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.gpu_decode import decode_on_device, encode_batch, jpeg_decoder_library
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.loading.transforms import (
    augment,
    augment_into,
    decode_image,
    resizer,
)
from kaisoku.data.shards.format import read_index
from kaisoku.distributed.env import World
from kaisoku.engine.data_build import shard_loader
from kaisoku.run_facts import plan_run
from kaisoku_bench import loader_peers, loader_profile
from kaisoku_bench.common import goal, interleaved, median_iqr, process_table, record_and_show
from kaisoku_bench.goals import paired_ratios
from kaisoku_bench.imagesets import (
    BATCH,
    SEED,
    WORKERS,
    ImageSet,
    data_root,
    epoch_of,
    image_set,
    log,
    own_format_pack,
    photo_set,
    production_loader,
    raw_pixel_pack,
    work_transform,
)
from kaisoku_bench.loader_index import index_part
from kaisoku_bench.loader_memory import memory_part

NAME = "loader"


# -------------------------------------------------------------------------------------------------- part (a)


def limit_rate(blobs: list[bytes], transform: ImageLabelTransform, cores: int, epoch: int) -> float:
    """The physical limit: single-thread, in-process decode + augment samples/s over in-memory bytes, times
    ``cores`` (kaisoku's exact per-sample work: :func:`decode_image` then :func:`augment`)."""
    start = time.perf_counter()
    for index, data in enumerate(blobs):
        image = decode_image(data)
        augment(image, transform.spec, seed=transform.seed, epoch=epoch, index=index)
    return cores * len(blobs) / (time.perf_counter() - start)


@dataclass
class _RowRecord:
    name: str
    decoder: str
    samples: list[int]
    shape: str = ""
    cpu_us: list[float] = field(default_factory=list)


def _live_children_cpu() -> float:
    """CPU seconds (user + system) of this process's running children (persistent DataLoader workers, which
    ``RUSAGE_CHILDREN`` counts only once they are waited for)."""
    me = os.getpid()
    return sum(cpu for parent, cpu in process_table().values() if parent == me)


def cpu_seconds() -> float:
    """CPU time of this process and of its children, running or finished, user + system."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _live_children_cpu()


def _time_epoch(batches: Any, record: _RowRecord, size: int) -> float:
    """Iterate one epoch; return samples/s; record CPU per sample (persistent DataLoader workers' included);
    check what it yields."""
    cpu_start = cpu_seconds()
    start = time.perf_counter()
    count = 0
    for images, labels in batches:
        if not record.shape:
            if images.dtype != torch.uint8 or tuple(images.shape[1:]) != (3, size, size):
                raise RuntimeError(f"{record.name} yields {images.dtype} {tuple(images.shape)}")
            if labels.dtype != torch.int64:
                raise RuntimeError(f"{record.name} yields labels of {labels.dtype}")
            record.shape = f"uint8{list(images.shape)} + int64[{labels.shape[0]}]"
        count += int(labels.shape[0])
    seconds = time.perf_counter() - start
    record.samples.append(count)
    record.cpu_us.append((cpu_seconds() - cpu_start) / count * 1e6)
    return count / seconds


@dataclass(frozen=True)
class RowSet:
    """One image set's rows: the set, the augmentation every row performs, interleaved rounds."""

    images: ImageSet
    crop: bool
    """True: random-resized-crop to the output size + flip (the ImageNet-like row); False: decode + flip."""
    rounds: int
    ffcv: bool = True
    """Run FFCV's row (``--quick`` does not: its first epoch compiles for half a minute)."""
    raw: bool = False
    """Also read raw pixels (tiny images): kaisoku's ``pack --raw-side`` and FFCV's ``write_mode="raw"``."""

    @property
    def name(self) -> str:
        """The set's name in rows and summary keys: the image set's, ``-rrc`` added for a random-resized-crop
        row set over small images (the ImageNet-like set always crops)."""
        small_crop = self.crop and self.images.name != "imagenet-like"
        return self.images.name + ("-rrc" if small_crop else "")

    @property
    def transform(self) -> ImageLabelTransform:
        """kaisoku's transform for the set's work (the one ``kaisoku train`` builds for a crop)."""
        return work_transform(self.images.size, self.crop)


def _kaisoku_decoder(row: str) -> str:
    """What kaisoku's row ``row`` decodes with, as the table says."""
    decoder = "simplejpeg"
    if row != "kaisoku-per-sample":
        decoder += f" + {resizer()} resizer (batch path)"
    if row == "kaisoku-own-format":
        decoder += " on its own format (re-encoded q90 4:2:0, as FFCV's)"
    if row == "kaisoku-raw":
        decoder = "raw pixels (pack --raw-side), no decoding (batch path)"
    if row == "kaisoku-first-epoch":
        decoder += ", a fresh loader"
    return decoder


def _steady(values: Sequence[float]) -> float:
    """The steady-state figure: the median after the first epoch (which pays start-up and compilation)."""
    return median_iqr(values[1:] if len(values) > 1 else values)[0]


def part_a(row_sets: Sequence[RowSet], peer_dir: Path, *, warm_up: bool = True) -> tuple[list, dict, list]:
    """Rows, summary entries and notes of part (a); ``warm_up`` reads every row's files into the page cache."""
    rows: list[dict[str, Any]] = []
    summary: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for row_set in row_sets:
        name = row_set.name
        set_rows, steady, rounds = _part_a_set(row_set, peer_dir, warm_up)
        rows += set_rows

        def over(row: str, other: str | None, rounds: dict[str, list[float]] = rounds) -> list[float] | None:
            """``row``'s samples/s over ``other``'s, round by round (interleaved: paired), first epoch off."""
            return paired_ratios(rounds[row], rounds[other]) if row in rounds and other in rounds else None

        peers = {n: v for n, v in steady.items() if n in loader_peers.PEERS}
        best = max(peers, key=peers.__getitem__) if peers else None
        missing = "; ".join(f"{r['row']}: {r['skipped']}" for r in set_rows if "skipped" in r)
        no_peer = f"no peer could run ({missing})"
        kaisoku = steady["kaisoku"]
        ffcv_missing = next((r["skipped"] for r in set_rows if r["row"] == "ffcv" and "skipped" in r), "")
        profile = {
            k: v for k, v in next(r for r in set_rows if r["part"] == "profile").items() if k.endswith("_us")
        }
        summary[f"kaisoku_vs_ffcv_{name}"] = goal(
            kaisoku / steady["ffcv"] if "ffcv" in steady else None,
            ">= 1.3" if name == "imagenet-like" else ">= 1.0",
            samples=over("kaisoku", "ffcv"),
            unit="rounds",
            reason=ffcv_missing,
            ffcv_first_epoch=next(
                (r.get("first_epoch_samples_per_s") for r in set_rows if r["row"] == "ffcv"), None
            ),
            profile_us=profile,
        )
        summary[f"kaisoku_own_format_vs_ffcv_{name}"] = goal(
            steady["kaisoku-own-format"] / steady["ffcv"] if "ffcv" in steady else None,
            ">= 1.3" if name == "imagenet-like" else ">= 1.0",
            samples=over("kaisoku-own-format", "ffcv"),
            unit="rounds",
            reason=ffcv_missing,
            formats="each on its own: kaisoku's pack re-encoded q90 4:2:0, FFCV's .beton re-encoded q90",
            profile_us=profile,
        )
        # No JIT or other warm-up to pay: each round, a loader built afresh times its first epoch, paired
        # with the steady row's epoch of the same round (interleaved, so the machine's drift cancels).
        summary[f"kaisoku_first_epoch_vs_steady_{name}"] = goal(
            None,
            ">= 0.9",
            samples=over("kaisoku-first-epoch", "kaisoku"),
            unit="rounds",
            run_first_epoch_vs_steady=round(
                next(r["first_epoch_samples_per_s"] for r in set_rows if r["row"] == "kaisoku") / kaisoku, 3
            ),
        )
        per_sample = next(r for r in set_rows if r["row"] == "kaisoku-per-sample")
        summary[f"kaisoku_batch_vs_per_sample_{name}"] = goal(
            kaisoku / steady["kaisoku-per-sample"],
            ">= 1.0",
            samples=over("kaisoku", "kaisoku-per-sample"),
            unit="rounds",
            pixel_max_abs_diff=per_sample.get("pixel_max_abs_diff_vs_batch"),
            pixel_mean_abs_diff=per_sample.get("pixel_mean_abs_diff_vs_batch"),
            resizer=resizer(),
        )
        if "kaisoku-raw" in steady:
            summary.update(_raw_pixel_goals(name, set_rows, steady, over))
        if row_set.images.name == "imagenet-like":
            summary[f"kaisoku_exact_vs_full_decode_limit_{name}"] = goal(
                kaisoku / steady["limit"], ">= 0.95", samples=over("kaisoku", "limit"), unit="rounds"
            )
        else:
            summary[f"kaisoku_vs_limit_{name}"] = goal(
                kaisoku / steady["limit"], ">= 0.9", samples=over("kaisoku", "limit"), unit="rounds"
            )
        gpu_row = next((r for r in set_rows if r["row"] == "kaisoku-gpu-decode"), None)
        host_row = next(r for r in set_rows if r["row"] == "kaisoku")
        summary[f"gpu_decode_vs_host_{name}"] = goal(
            steady["kaisoku-gpu-decode"] / kaisoku if "kaisoku-gpu-decode" in steady else None,
            ">= 1.0",
            samples=over("kaisoku-gpu-decode", "kaisoku"),
            unit="rounds",
            reason="" if gpu_row is not None and "skipped" not in gpu_row else "no CUDA device",
            host_cpu_us_per_sample=(gpu_row or {}).get("cpu_us_per_sample"),
            host_path_cpu_us_per_sample=host_row.get("cpu_us_per_sample"),
            pixel_max_abs_diff=(gpu_row or {}).get("pixel_max_abs_diff_vs_host"),
            pixel_mean_abs_diff=(gpu_row or {}).get("pixel_mean_abs_diff_vs_host"),
        )
        simplejpeg_peer = steady.get("imagefolder-simplejpeg")
        summary[f"kaisoku_vs_imagefolder_simplejpeg_{name}"] = goal(
            kaisoku / simplejpeg_peer if simplejpeg_peer else None,
            ">= 1.25",
            samples=over("kaisoku", "imagefolder-simplejpeg"),
            unit="rounds",
            reason="" if simplejpeg_peer else f"imagefolder-simplejpeg could not run ({missing})",
        )
        summary[f"kaisoku_vs_best_peer_{name}"] = goal(
            kaisoku / peers[best] if best else None,
            ">= 1.5",
            samples=over("kaisoku", best),
            unit="rounds",
            reason="" if best else no_peer,
            best_peer=best,
            peers_measured=sorted(peers),
            profile_us=profile,
        )
        if best:
            notes.append(f"{name}: best peer {best} at {peers[best]:.0f} samples/s (steady state)")
    return rows, summary, notes


def _read_tree(roots: Sequence[Path]) -> int:
    """Read every file under ``roots`` once (into the page cache); return the bytes read."""
    total = 0
    for root in roots:
        for path in sorted(Path(root).rglob("*")) if Path(root).is_dir() else [Path(root)]:
            if path.is_file():
                with open(path, "rb", buffering=0) as handle:
                    while chunk := handle.read(8 << 20):
                        total += len(chunk)
    return total


def batch_pixel_diff(
    image_set: ImageSet, transform: ImageLabelTransform, count: int = 256
) -> tuple[int, float]:
    """Largest and mean absolute pixel difference of the batch path (one batch of ``count`` samples) against
    the per-sample path, same keys (so the same crop boxes and flips)."""
    blobs = [loader_peers.read_bytes(path) for path, _ in image_set.shuffled_files()[:count]]
    spec = transform.spec
    batch = np.empty((len(blobs), 3, spec.size, spec.size), dtype=np.uint8)
    decode_batch_into(blobs, spec, seed=transform.seed, epoch=1, indices=np.arange(len(blobs)), out=batch)
    reference = np.empty_like(batch)
    for index, data in enumerate(blobs):
        augment_into(
            decode_image(data), spec, seed=transform.seed, epoch=1, index=index, out=reference[index]
        )
    diff = np.abs(batch.astype(np.int16) - reference.astype(np.int16))
    return int(diff.max()), float(diff.mean())


def gpu_pixel_diff(
    image_set: ImageSet, transform: ImageLabelTransform, count: int = 256
) -> tuple[int, float]:
    """Largest and mean absolute pixel difference of decoding on the CUDA device (one batch of ``count``
    samples) against the host batch path, same keys (so the same crop boxes and flips)."""
    blobs = [loader_peers.read_bytes(path) for path, _ in image_set.shuffled_files()[:count]]
    spec, indices = transform.spec, np.arange(len(blobs))
    host = np.empty((len(blobs), 3, spec.size, spec.size), dtype=np.uint8)
    decode_batch_into(blobs, spec, seed=transform.seed, epoch=1, indices=indices, out=host)
    encoded = encode_batch(blobs, spec, seed=transform.seed, epoch=1, indices=indices)
    device = decode_on_device(encoded, torch.device("cuda")).cpu().numpy()
    diff = np.abs(device.astype(np.int16) - host.astype(np.int16))
    return int(diff.max()), float(diff.mean())


def gpu_decode_loader(pack_dir: Path, transform: ImageLabelTransform) -> ShardLoader:
    """The :class:`ShardLoader` ``kaisoku train --data.decode gpu`` builds on a CUDA device (as
    :func:`~kaisoku_bench.imagesets.production_loader` for the host path)."""
    cfg = Config()
    cfg.data.path = str(pack_dir)
    cfg.data.global_batch = BATCH
    cfg.data.workers = WORKERS
    cfg.data.decode = "gpu"
    cfg.train.seed = SEED
    cfg.train.epochs = 10**6
    dataset = ShardedDataset(pack_dir, transform=transform, decode_images=False)
    return shard_loader(plan_run(cfg, 1), World(), torch.device("cuda"), dataset)


def _on_cuda(loader: ShardLoader) -> Any:
    """``loader``'s batches decoded on the CUDA device as the trainer moves them; the device synchronised at
    the end, so that the epoch's time holds every decode."""
    for images, labels in loader:
        yield images.to("cuda", non_blocking=True), labels
    torch.cuda.synchronize()


def _no_crop_in_spdl() -> loader_peers.PeerLoader:
    raise loader_peers.PeerMissing(
        "SPDL's load_image_batch applies one filter to a whole batch: no per-sample random crop"
    )


def _peer_builders(row_set: RowSet, peer_dir: Path) -> dict[str, Callable[[], loader_peers.PeerLoader]]:
    images, crop = row_set.images, row_set.images.size if row_set.crop else 0
    files = images.shuffled_files()
    stem = images.folder.parent.name
    builders: dict[str, Callable[[], loader_peers.PeerLoader]] = {
        "imagefolder-pil": lambda: loader_peers.imagefolder(
            images.folder, decoder="pil", batch=BATCH, workers=WORKERS, crop=crop
        ),
        "imagefolder-simplejpeg": lambda: loader_peers.imagefolder(
            images.folder, decoder="simplejpeg", batch=BATCH, workers=WORKERS, crop=crop
        ),
        "litdata": lambda: loader_peers.litdata(
            files,
            loader_peers.format_folder(peer_dir, stem, "litdata"),
            batch=BATCH,
            workers=WORKERS,
            crop=crop,
        ),
    }
    if not crop:
        builders["spdl"] = lambda: loader_peers.spdl(
            files, batch=BATCH, workers=WORKERS, size=images.size, seed=SEED
        )
    else:
        builders["spdl"] = _no_crop_in_spdl
    if not crop:  # these two peers do decode + flip only
        builders["webdataset"] = lambda: loader_peers.webdataset(
            files, loader_peers.format_folder(peer_dir, stem, "webdataset"), batch=BATCH, workers=WORKERS
        )
        builders["mds"] = lambda: loader_peers.mds(
            files, loader_peers.format_folder(peer_dir, stem, "mds"), batch=BATCH, workers=WORKERS
        )
    return builders


def _raw_pixel_goals(
    name: str,
    set_rows: list[dict[str, Any]],
    steady: dict[str, float],
    over: Callable[[str, str | None], list[float] | None],
) -> dict[str, dict[str, Any]]:
    """The raw-pixel figures of a set: kaisoku against FFCV, each on raw pixels, and against kaisoku's own
    JPEG format (whether ``pack --raw-side`` pays, and for how many bytes)."""
    row_of = {r["row"]: r for r in set_rows}
    ffcv_raw = row_of.get("ffcv-raw", {})
    return {
        f"kaisoku_raw_vs_ffcv_raw_{name}": goal(
            steady["kaisoku-raw"] / steady["ffcv-raw"] if "ffcv-raw" in steady else None,
            ">= 1.0",
            samples=over("kaisoku-raw", "ffcv-raw"),
            unit="rounds",
            reason=ffcv_raw.get("skipped", ""),
            formats="each on raw pixels: kaisoku pack --raw-side, FFCV's write_mode raw",
        ),
        f"kaisoku_raw_vs_own_format_{name}": goal(
            steady["kaisoku-raw"] / steady["kaisoku-own-format"],
            ">= 1.0",
            samples=over("kaisoku-raw", "kaisoku-own-format"),
            unit="rounds",
            bytes_vs_own_format=round(
                row_of["kaisoku-raw"]["pack_bytes"] / row_of["kaisoku-own-format"]["pack_bytes"], 2
            ),
        ),
    }


_FFCV_DECODERS = {
    "ffcv": "libjpeg-turbo (FFCV, re-encoded q90)",
    "ffcv-raw": "raw pixels (FFCV, write_mode raw)",
}
"""What each FFCV row decodes with, as the table says."""


def _ffcv_epoch(ffcv: loader_peers.FFCVRow, record: _RowRecord, size: int) -> float:
    """One epoch of an FFCV row; its samples, CPU and batch shape recorded in ``record``."""
    samples, seconds, cpu = ffcv.epoch()
    record.samples.append(samples)
    record.cpu_us.append(cpu / samples * 1e6)
    record.shape = f"uint8[{BATCH},3,{size},{size}] (ToTorchImage)"
    return samples / seconds


def _part_a_set(
    row_set: RowSet, peer_dir: Path, warm_up: bool
) -> tuple[list[dict], dict[str, float], dict[str, list[float]]]:
    """The rows of one image set, each row's steady-state samples/s, and its samples/s per round after
    the first epoch."""
    image_set = row_set.images
    size = image_set.size
    cores = len(os.sched_getaffinity(0))
    records: dict[str, _RowRecord] = {}
    runs: dict[str, Callable[[], float]] = {}
    rows: list[dict[str, Any]] = []
    epochs = iter(range(1, 10**6))
    transform = row_set.transform
    # kaisoku on its own preferred format, as FFCV's row reads FFCV's re-encoded file (and, for tiny images,
    # on raw pixels, as FFCV's raw row reads them)
    packs = {"kaisoku": image_set.pack_dir, "kaisoku-own-format": own_format_pack(image_set)}
    if row_set.raw:
        packs["kaisoku-raw"] = raw_pixel_pack(image_set)
    kaisoku_rows = {
        "kaisoku": production_loader(image_set.pack_dir, transform),  # data.loader batch, the default
        "kaisoku-per-sample": production_loader(image_set.pack_dir, transform, batch_path="threads"),
        **{name: production_loader(packs[name], transform) for name in packs if name != "kaisoku"},
    }
    if torch.cuda.is_available():  # data.decode gpu: the same set decoded on the device
        gpu_loader = gpu_decode_loader(image_set.pack_dir, transform)
        records["kaisoku-gpu-decode"] = _RowRecord(
            "kaisoku-gpu-decode", f"nvJPEG ({jpeg_decoder_library()}, batched)", []
        )
        runs["kaisoku-gpu-decode"] = lambda: _time_epoch(
            _on_cuda(epoch_of(gpu_loader, next(epochs))), records["kaisoku-gpu-decode"], size
        )
        kaisoku_rows["kaisoku-gpu-decode"] = gpu_loader
    else:
        rows.append(
            {"part": "a", "size": row_set.name, "row": "kaisoku-gpu-decode", "skipped": "no CUDA device"}
        )
    records["kaisoku-first-epoch"] = _RowRecord(
        "kaisoku-first-epoch", _kaisoku_decoder("kaisoku-first-epoch"), []
    )

    def first_epoch() -> float:
        """The first epoch of a loader built as ``kaisoku train`` builds it, afresh (its dataset's shards
        opened, its decoding workers started and its batch ring allocated within the epoch)."""
        fresh = production_loader(image_set.pack_dir, transform)
        try:
            return _time_epoch(epoch_of(fresh, next(epochs)), records["kaisoku-first-epoch"], size)
        finally:
            fresh.close()

    runs["kaisoku-first-epoch"] = first_epoch
    for name, loader in kaisoku_rows.items():
        if name == "kaisoku-gpu-decode":
            continue
        records[name] = _RowRecord(name, _kaisoku_decoder(name), [])
        runs[name] = lambda n=name, ld=loader: _time_epoch(epoch_of(ld, next(epochs)), records[n], size)
    peers: list[loader_peers.PeerLoader] = []
    for name, build in _peer_builders(row_set, peer_dir).items():
        try:
            start = time.perf_counter()
            peer = build()
            log(f"{name} ready for {image_set.name} in {time.perf_counter() - start:.1f} s")
        except loader_peers.PeerMissing as missing:
            rows.append({"part": "a", "size": row_set.name, "row": name, "skipped": str(missing)})
            continue
        peers.append(peer)
        records[name] = _RowRecord(name, peer.decoder, [])
        runs[name] = lambda p=peer: _time_epoch(p.make(), records[p.name], size)
    for ffcv_name in ("ffcv", "ffcv-raw") if row_set.raw else ("ffcv",):
        try:
            if not row_set.ffcv:
                raise loader_peers.PeerMissing("not run with --quick (its first epoch compiles for ~30 s)")
            ffcv = loader_peers.FFCVRow(
                image_set.shuffled_files(),
                loader_peers.format_folder(peer_dir, image_set.folder.parent.name, ffcv_name),
                batch=BATCH,
                workers=WORKERS,
                crop=size if row_set.crop else 0,
                raw=ffcv_name == "ffcv-raw",
            )
        except loader_peers.PeerMissing as missing:
            rows.append({"part": "a", "size": row_set.name, "row": ffcv_name, "skipped": str(missing)})
            continue
        records[ffcv_name] = _RowRecord(ffcv_name, _FFCV_DECODERS[ffcv_name], [])
        runs[ffcv_name] = functools.partial(_ffcv_epoch, ffcv, records[ffcv_name], size)
        peers.append(loader_peers.PeerLoader(ffcv_name, ffcv_name, lambda: [], close=ffcv.close))
    blobs = [loader_peers.read_bytes(path) for path, _ in image_set.shuffled_files()]
    blobs = blobs[: max(256, len(blobs) // 4)]  # a quarter of the set: the limit is a rate
    records["limit"] = _RowRecord("limit", "simplejpeg", [])

    def limit() -> float:
        records["limit"].samples.append(len(blobs))
        records["limit"].shape = f"uint8[3,{size},{size}] arrays, 1 thread x {cores} cores"
        cpu_start = cpu_seconds()
        rate = limit_rate(blobs, transform, cores, next(epochs))
        records["limit"].cpu_us.append((cpu_seconds() - cpu_start) / len(blobs) * 1e6)
        return rate

    runs["limit"] = limit
    if warm_up:  # every row reads warm data: bring all of its files into the page cache first
        stem = image_set.folder.parent.name
        _read_tree([image_set.folder, *packs.values(), *peer_dir.glob(f"{stem}-*")])
    for record in records.values():
        record.samples.clear()
        record.cpu_us.clear()
    log(f"part (a) {row_set.name}: {len(runs)} rows x {row_set.rounds} interleaved epochs")
    results = interleaved(runs, row_set.rounds)
    for peer in peers:
        peer.close()
    for loader in kaisoku_rows.values():
        loader.close()
    steady = {name: _steady(values) for name, values in results.items()}
    limit_cpu = statistics.median(records["limit"].cpu_us)
    for name, values in results.items():
        _, iqr = median_iqr(values[1:] if len(values) > 1 else values)
        cpu_us = statistics.median(records[name].cpu_us)
        row: dict[str, Any] = {
            "part": "a",
            "size": row_set.name,
            "row": name,
            "decoder": records[name].decoder,
            "yields": records[name].shape,
            "samples_per_epoch": int(statistics.median(records[name].samples)),
            "samples_per_s": round(steady[name], 1),
            "first_epoch_samples_per_s": round(values[0], 1),
            "iqr": round(iqr, 1),
            "runs": [round(v, 1) for v in values],
            "vs_limit": round(steady[name] / steady["limit"], 3),
            "cpu_us_per_sample": round(cpu_us, 1),
            "cpu_vs_limit": round(limit_cpu / cpu_us, 3),
        }
        if name in packs:
            row["pack_bytes"] = read_index(packs[name]).nbytes
        if name == "kaisoku-gpu-decode":
            largest, mean = gpu_pixel_diff(image_set, transform)
            row["pixel_max_abs_diff_vs_host"], row["pixel_mean_abs_diff_vs_host"] = largest, round(mean, 4)
        if name == "kaisoku-per-sample":
            largest, mean = batch_pixel_diff(image_set, transform)
            row["pixel_max_abs_diff_vs_batch"], row["pixel_mean_abs_diff_vs_batch"] = largest, round(mean, 4)
        rows.append(row)
    # Where the microseconds go: the stages' own cost on one thread, beside each row's CPU per sample.
    profile_epoch = next(epochs)
    rows.append(
        loader_profile.profile_row(
            row_set.name,
            loader_profile.stage_us(blobs, transform, profile_epoch),
            loader_profile.stage_us(
                loader_profile.pack_images(packs["kaisoku-own-format"], len(blobs)), transform, profile_epoch
            ),
            {r["row"]: r["cpu_us_per_sample"] for r in rows if "cpu_us_per_sample" in r},
        )
    )
    return rows, steady, {name: values[1:] for name, values in results.items()}


# -------------------------------------------------------------------------------------------------- part (b)


# --------------------------------------------------------------------------------------------------- plot


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a_rows = [r for r in rows if r["part"] == "a" and "samples_per_s" in r]
    fig, ax = plt.subplots(1, 1, figsize=(7, 4.5))
    sizes = list(dict.fromkeys(r["size"] for r in a_rows))
    names = list(dict.fromkeys(r["row"] for r in a_rows))
    width = 0.8 / max(1, len(sizes))
    for k, size in enumerate(sizes):
        values = [
            next((r["samples_per_s"] for r in a_rows if r["size"] == size and r["row"] == n), 0)
            for n in names
        ]
        ax.bar(np.arange(len(names)) + k * width, values, width, label=size)
    ax.set_xticks(np.arange(len(names)) + width * (len(sizes) - 1) / 2, names, rotation=30, ha="right")
    ax.set_ylabel("samples/s (median)")
    ax.set_title("(a) warm local data, 2 workers, batch 256")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------- run


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Measure the warm-local-data rows and the index; write ``loader.json`` (and ``loader.png``) under
    ``out_dir``."""
    torch.set_num_threads(1)
    root = data_root()
    root.mkdir(parents=True, exist_ok=True)
    if quick:
        row_sets = [
            RowSet(image_set(1024, 64, "1MiB"), crop=False, rounds=2, ffcv=False, raw=True),
            RowSet(image_set(1024, 64, "1MiB"), crop=True, rounds=2, ffcv=False, raw=True),
            RowSet(image_set(1024, 96, "2MiB"), crop=False, rounds=2, ffcv=False),
            RowSet(photo_set(400), crop=True, rounds=2, ffcv=False),
        ]
    else:
        row_sets = [
            RowSet(image_set(20000, 64, "8MiB"), crop=False, rounds=5, raw=True),
            RowSet(image_set(20000, 64, "8MiB"), crop=True, rounds=5, raw=True),
            RowSet(image_set(20000, 160, "16MiB"), crop=False, rounds=4),
            RowSet(image_set(20000, 160, "16MiB"), crop=True, rounds=4),
            RowSet(photo_set(5000), crop=True, rounds=4),
        ]
    rows, summary, notes = part_a(row_sets, root / "peers", warm_up=not quick)
    index_rows, index_summary = index_part(root, 1_000_000 if quick else 10_000_000, 1 if quick else 3)
    rows += index_rows
    summary.update(index_summary)
    # Memory: the largest plain set and the ImageNet-like set (the quick run: its photo set).
    memory_sets = [s for s in row_sets if s.name in ("160px", "imagenet-like")]
    memory_rows, memory_summary = memory_part(
        [(s.name, s.images.pack_dir, s.images.size, s.crop) for s in memory_sets],
        1 if quick else 3,
        ("batch", "threads") if quick else ("batch", "threads", "processes"),
    )
    rows += memory_rows
    summary.update(memory_summary)
    notes.append(
        "samples/s is the steady state: the median of the interleaved epochs after each row's first, whose "
        "rate is first_epoch_samples_per_s (start-up; kaisoku compiles nothing, so its first epoch runs at "
        "speed apart from starting its workers). kaisoku's rows are the ShardLoader kaisoku train builds "
        "(engine.data_build.shard_loader from a Config: global shuffle, batch 256, 2 decoding worker "
        "processes, kept across epochs, writing whole batches into shared batch buffers). The limit is single-thread in-process decode + augment over "
        "the bytes in memory, times the cores. On a machine shared with other jobs wall-clock rates "
        "measure the CPU share each row gets; cpu_us_per_sample is recorded beside them."
    )
    return record_and_show(
        NAME, out_dir, summary, rows, columns=_COLUMNS, quick=quick, notes=" | ".join(notes), plot=_plot
    )


_COLUMNS = {
    "size": "size", "row": "row", "decoder": "decoder", "samples_per_s": "samples/s",
    "first_epoch_samples_per_s": "1st epoch", "iqr": "IQR",
    "vs_limit": "vs limit", "cpu_us_per_sample": "CPU us/sample", "cpu_vs_limit": "CPU vs limit",
    "skipped": "skipped", "open_s": "open s", "private_bytes_per_record": "private B/record",
    "workers": "workers", "mib_per_worker": "MiB/worker",
    "decoder_us": "decoder us", "batch_call_us": "batch call us",
    "kaisoku_outside_stages_us": "kaisoku rest us", "ffcv_outside_stages_us": "FFCV rest us",
}  # fmt: skip

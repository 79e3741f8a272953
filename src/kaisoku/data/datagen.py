"""A procedurally drawn image-classification dataset, written as real JPEG files in class folders.

Ten shape classes drawn with colour, size, position, rotation and noise jitter: learnable by a small
ResNet in minutes on a CPU, but not trivially. Every image is a pure function of (seed, split, index),
so the same call always writes the same bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_text

CLASSES: tuple[str, ...] = (
    "circle",
    "square",
    "triangle",
    "cross",
    "ring",
    "hbars",
    "vbars",
    "diamond",
    "star",
    "checker",
)

_MANIFEST = "manifest.json"
#: Bumped whenever the drawing changes, so that a cached demo set from an older version is not reused.
GENERATOR_VERSION = 2


def _polygon(cx: float, cy: float, radius: float, angle: float, corners: int, inner: float = 0.0) -> list:
    points = []
    steps = corners * (2 if inner else 1)
    for k in range(steps):
        r = radius if not inner or k % 2 == 0 else radius * inner
        theta = angle + 2 * math.pi * k / steps
        points.append((cx + r * math.cos(theta), cy + r * math.sin(theta)))
    return points


def draw_sample(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Draw one HWC uint8 RGB image of class ``label``."""
    scale = 4  # draw large, then downsample: anti-aliased edges like a photo's
    big = size * scale
    background = tuple(int(v) for v in rng.integers(0, 256, 3))
    foreground = tuple(int(v) for v in rng.integers(0, 256, 3))
    # Keep the shape visible: push the foreground away from the background where they are close.
    if sum(abs(a - b) for a, b in zip(background, foreground)) < 240:
        foreground = tuple(255 - v for v in background)
    image = Image.new("RGB", (big, big), background)
    draw = ImageDraw.Draw(image)
    radius = big * rng.uniform(0.22, 0.38)
    cx = big * rng.uniform(0.3, 0.7)
    cy = big * rng.uniform(0.3, 0.7)
    angle = rng.uniform(0, 2 * math.pi)
    width = max(2, int(radius * rng.uniform(0.18, 0.3)))
    name = CLASSES[label]
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if name == "circle":
        draw.ellipse(box, fill=foreground)
    elif name == "square":
        draw.polygon(_polygon(cx, cy, radius, angle, 4), fill=foreground)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, radius, angle, 3), fill=foreground)
    elif name == "cross":
        for theta in (angle, angle + math.pi / 2):
            dx, dy = radius * math.cos(theta), radius * math.sin(theta)
            draw.line((cx - dx, cy - dy, cx + dx, cy + dy), fill=foreground, width=width)
    elif name == "ring":
        draw.ellipse(box, outline=foreground, width=width)
    elif name in ("hbars", "vbars"):
        bars = int(rng.integers(2, 4))
        for k in range(bars):
            offset = -radius + (2 * radius) * (k + 0.5) / bars
            if name == "hbars":
                draw.line((cx - radius, cy + offset, cx + radius, cy + offset), fill=foreground, width=width)
            else:
                draw.line((cx + offset, cy - radius, cx + offset, cy + radius), fill=foreground, width=width)
    elif name == "diamond":
        points = [(cx, cy - radius), (cx + radius * 0.6, cy), (cx, cy + radius), (cx - radius * 0.6, cy)]
        draw.polygon(points, fill=foreground)
    elif name == "star":
        draw.polygon(_polygon(cx, cy, radius, angle, 5, inner=0.45), fill=foreground)
    elif name == "checker":
        cells = 3
        cell = 2 * radius / cells
        for i in range(cells):
            for j in range(cells):
                if (i + j) % 2 == 0:
                    x0, y0 = cx - radius + i * cell, cy - radius + j * cell
                    draw.rectangle((x0, y0, x0 + cell, y0 + cell), fill=foreground)
    small = np.asarray(image.resize((size, size), Image.Resampling.BILINEAR), dtype=np.float32)
    noise = rng.normal(0.0, rng.uniform(4, 16), small.shape)
    return np.clip(small + noise, 0, 255).astype(np.uint8)


def encode_jpeg(image: np.ndarray, quality: int = 90) -> bytes:
    """Encode an HWC uint8 RGB image as JPEG bytes."""
    import simplejpeg

    return simplejpeg.encode_jpeg(np.ascontiguousarray(image), quality=quality, colorspace="RGB")


def sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of one sample, keyed by (seed, split, index) alone."""
    split_key = {"train": 0, "val": 1}.get(split, 2)
    return np.random.Generator(np.random.PCG64([seed, split_key, index]))


def _write_range(root: str, split: str, start: int, stop: int, size: int, seed: int) -> int:
    for index in range(start, stop):
        label = index % len(CLASSES)
        image = draw_sample(label, size, sample_rng(seed, split, index))
        path = Path(root) / split / CLASSES[label] / f"{index:07d}.jpg"
        path.write_bytes(encode_jpeg(image))
    return stop - start


def generate(
    root: str | os.PathLike[str],
    *,
    count: int,
    size: int = 40,
    val_count: int | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write ``count`` training and ``val_count`` validation JPEGs under ``root/{train,val}/<class>/``.

    The folder is built beside ``root`` and renamed into place when complete, so a crash never leaves a
    half-written dataset where a reader would take it for a whole one.
    """
    root = Path(root).expanduser()
    if count < len(CLASSES):
        raise KaisokuError(f"datagen: --count {count} is below the {len(CLASSES)} classes; use at least that")
    if size < 8:
        raise KaisokuError(f"datagen: --size {size} is too small; use 8 pixels or more")
    val_count = max(len(CLASSES), count // 10) if val_count is None else val_count
    if root.exists() and any(root.iterdir()):
        raise KaisokuError(f"datagen: {root} is not empty; choose a new folder or delete it")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    for split in ("train", "val"):
        for name in CLASSES:
            (staging / split / name).mkdir(parents=True, exist_ok=True)
    chunk = 500
    jobs = [
        (str(staging), split, start, min(start + chunk, total), size, seed)
        for split, total in (("train", count), ("val", val_count))
        for start in range(0, total, chunk)
    ]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            done = _write_range(*job)
            if progress:
                progress(done)
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for done in pool.map(_write_range, *zip(*jobs)):
                if progress:
                    progress(done)
    manifest = {"classes": list(CLASSES), "train": count, "val": val_count, "size": size, "seed": seed}
    atomic_write_text(staging / _MANIFEST, json.dumps(manifest, indent=2) + "\n")
    if root.exists():
        root.rmdir()
    os.replace(staging, root)
    return root


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_demo_dataset(
    cache_dir: str | os.PathLike[str], *, count: int = 8000, size: int = 40, seed: int = 0
) -> Path:
    """The demo dataset under ``cache_dir``, generated on first use; safe when several ranks ask at once.

    Generating says what and where in one line first (it takes seconds; later runs reuse the set).
    """
    cache = Path(cache_dir).expanduser()
    root = cache / f"shapes-v{GENERATOR_VERSION}-{count}-{size}px-seed{seed}"
    with _locked(cache / ".datagen.lock"):
        if not (root / _MANIFEST).exists():
            if root.exists():
                shutil.rmtree(root)
            print(
                f"kaisoku: generating the demo dataset once ({count:,} training images of {len(CLASSES)} "
                f"shapes, {size} px, as JPEG folders) into {root}; later runs reuse it",
                flush=True,
            )
            generate(root, count=count, size=size, seed=seed)
    return root

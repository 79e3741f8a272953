"""What ``kaisoku pack`` and ``kaisoku train`` read: image-folder trees, ``.npz`` arrays, dicts.

One image-folder scanner serves both commands, so training on a folder and packing it see the same
images with the same labels. Its rules (:func:`scan_image_tree`):

* ``ROOT/<class>/**/<image>``: each folder directly under ``ROOT`` is a class, labelled by its position
  among the sorted class names; its images are found recursively (sub-folders too), in sorted order.
* When every folder under ``ROOT`` is a split name (:data:`SPLIT_NAMES`: train, val, valid, validation,
  test), ``ROOT`` is a tree of splits ``ROOT/<split>/<class>/...`` and all splits share one label
  mapping, the sorted union of their class names.
* Images are the files with one of :data:`IMAGE_EXTENSIONS`, in any case (``.JPG`` too); hidden files
  and folders (a leading dot) and every other file are ignored. A class folder without images is an
  error naming it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.shards.codecs import check_image, image_format
from kaisoku.data.shards.format import Field
from kaisoku.errors import KaisokuError

SPLIT_NAMES = ("train", "val", "valid", "validation", "test")
"""Folder names that make an ImageFolder source a tree of splits (``SRC/<split>/<class>/...``)."""

VAL_SPLIT_NAMES = ("val", "valid", "validation", "test")
"""Split names taken as the validation set, in order of preference."""

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".bmp", ".tif", ".tiff", ".webp", ".gif")
"""File extensions (any case) taken as images in an ImageFolder tree; other files are ignored."""

ImageItem = tuple[str, int, int]
"""An image of a scanned folder: (path relative to the scanned root, label, file size in bytes)."""


def class_folders(root: Path) -> list[str]:
    """The sorted names of the visible folders directly under ``root``."""
    return sorted(
        entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith(".")
    )


def image_folder_splits(root: Path) -> list[str]:
    """The split folders of ``root`` when every folder in it is a split name (train, val, ...), else []."""
    if not root.is_dir():
        return []
    folders = class_folders(root)
    return folders if folders and all(name in SPLIT_NAMES for name in folders) else []


def scan_image_folder(root: Path, classes: Sequence[str] | None = None) -> tuple[list[str], list[ImageItem]]:
    """Class names (sorted) and ``(relative path, label, file size)`` of every image under ``root``.

    ``classes`` fixes the label mapping (shared by the splits of a tree); a class folder it names
    may then be absent. A tree without class folders or images, or a class folder without images,
    is an error naming the folder.
    """
    if not root.is_dir():
        raise KaisokuError(f"source {root} is not a directory")
    names = list(classes) if classes is not None else class_folders(root)
    if not names:
        raise KaisokuError(
            f"source {root} has no class folders; an ImageFolder tree is SRC/<class>/<image files>"
        )
    items: list[ImageItem] = []
    for label, name in enumerate(names):
        if classes is not None and not (root / name).is_dir():
            continue
        found = 0
        for directory, subdirs, files in os.walk(root / name, followlinks=True):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
            base = Path(directory)
            for file_name in sorted(files):
                if file_name.startswith(".") or not file_name.lower().endswith(IMAGE_EXTENSIONS):
                    continue
                path = base / file_name
                try:
                    size = path.stat().st_size
                except OSError as error:
                    raise KaisokuError(f"cannot read image {path}: {error.strerror or error}") from None
                items.append((path.relative_to(root).as_posix(), label, size))
                found += 1
        if found == 0:
            raise KaisokuError(
                f"class folder {root / name} holds no images ({', '.join(IMAGE_EXTENSIONS)}); "
                "add images or remove the folder"
            )
    if not items:
        raise KaisokuError(f"source {root} holds no images")
    return names, items


@dataclass(frozen=True)
class ImageTree:
    """A scanned image folder: class names and, per split, its images (relative to ``root / split``).

    A folder without split folders has the single split ``""``.
    """

    root: Path
    classes: tuple[str, ...]
    splits: dict[str, list[ImageItem]]

    def split_root(self, split: str) -> Path:
        """The folder that ``split``'s relative paths start from."""
        return self.root / split if split else self.root

    def files(self, split: str) -> list[str]:
        """Full paths of ``split``'s images, in scan order."""
        base = self.split_root(split)
        return [str(base / relative) for relative, _, _ in self.splits[split]]


def scan_image_tree(root: Path) -> ImageTree:
    """Scan ``root`` by the rules in this module's docstring: one split, or a tree of splits."""
    splits = image_folder_splits(root)
    if not splits:
        classes, items = scan_image_folder(root)
        return ImageTree(root, tuple(classes), {"": items})
    classes = sorted({name for split in splits for name in class_folders(root / split)})
    scanned = {split: scan_image_folder(root / split, classes)[1] for split in splits}
    return ImageTree(root, tuple(classes), scanned)


def read_image(path: Path, *, verify: bool) -> tuple[bytes | None, str | None]:
    """An image file's bytes, or None and why it cannot be used (unreadable, or not decodable when
    ``verify``)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        return None, f"cannot read image {path}: {error.strerror or error}"
    if verify:
        try:
            check_image(data, name=str(path))
        except KaisokuError as error:
            return None, str(error)
    return data, None


def npz_splits(path: Path) -> dict[str, tuple[str, str]]:
    """The ``x_<split>``/``y_<split>`` key pairs of a ``.npz``, by split name, checked for completeness."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            keys = list(archive.files)
    except (OSError, ValueError) as error:
        raise KaisokuError(f"cannot read {path} as a .npz archive: {error}") from None
    xs = {k[2:]: k for k in keys if k.startswith("x_") and len(k) > 2}
    ys = {k[2:]: k for k in keys if k.startswith("y_") and len(k) > 2}
    if not xs and not ys:
        raise KaisokuError(
            f"{path} has no x_<split>/y_<split> arrays (found {', '.join(keys) or 'nothing'}); "
            "name them e.g. x_train and y_train"
        )
    unpaired = sorted(set(xs) ^ set(ys))
    if unpaired:
        raise KaisokuError(
            f"{path}: split(s) {', '.join(unpaired)} have x_ without y_ or y_ without x_; give both arrays"
        )
    return {split: (xs[split], ys[split]) for split in sorted(xs)}


def npz_split(path: Path, archive: Any, split: str, x_key: str, y_key: str) -> tuple[np.ndarray, np.ndarray]:
    """The ``x`` and ``y`` arrays of one split of an open ``.npz``, checked to pair up row by row."""
    try:
        x, y = archive[x_key], archive[y_key]
    except ValueError as error:
        raise KaisokuError(f"{path}: cannot load {x_key}/{y_key} without pickle: {error}") from None
    if x.ndim < 1 or y.ndim < 1 or len(x) != len(y):
        raise KaisokuError(
            f"{path}: {x_key} has {len(x) if x.ndim else 0} rows but {y_key} has "
            f"{len(y) if y.ndim else 0}; they must match"
        )
    if len(x) == 0:
        raise KaisokuError(f"{path}: split {split!r} is empty")
    return x, y


def array_fields(x: np.ndarray, y: np.ndarray) -> tuple[Field, Field]:
    """The schema of an ``(x, y)`` pair: ``image`` for uint8 rows of shape HW, HW1 or HW3 (else ``x``),
    ``label`` for 1-D integers (else an array ``y``)."""
    row = x.shape[1:]
    is_image = x.dtype == np.uint8 and (len(row) == 2 or (len(row) == 3 and row[2] in (1, 3)))
    x_field = Field(name="image" if is_image else "x", kind="array", dtype=x.dtype.str, shape=tuple(row))
    if y.ndim == 1 and np.issubdtype(y.dtype, np.integer):
        y_field = Field(name="label", kind="int")
    else:
        y_field = Field(name="y", kind="array", dtype=y.dtype.str, shape=tuple(y.shape[1:]))
    return x_field, y_field


def infer_fields(sample: Mapping[str, Any]) -> tuple[Field, ...]:
    """A schema for samples like ``sample``: int -> int, str -> str, JPEG/PNG bytes -> image, other
    bytes -> bytes, numpy arrays and scalars -> array (dtype and shape of this sample)."""
    if not isinstance(sample, Mapping) or not sample:
        raise KaisokuError(
            f"samples must be non-empty dicts of field name -> value, got {type(sample).__name__}"
        )
    fields = []
    for name, value in sample.items():
        if isinstance(value, bool | np.bool_):
            raise KaisokuError(f"field {name!r} is a bool; store it as an int")
        if isinstance(value, int | np.integer):
            fields.append(Field(name=name, kind="int"))
        elif isinstance(value, str):
            fields.append(Field(name=name, kind="str"))
        elif isinstance(value, bytes | bytearray | memoryview):
            kind = "image" if image_format(value) is not None else "bytes"
            fields.append(Field(name=name, kind=kind))
        elif isinstance(value, np.ndarray | np.generic):
            array = np.asarray(value)
            fields.append(Field(name=name, kind="array", dtype=array.dtype.str, shape=tuple(array.shape)))
        else:
            raise KaisokuError(
                f"field {name!r} holds a {type(value).__name__}; use int, str, bytes or numpy arrays"
            )
    return tuple(fields)

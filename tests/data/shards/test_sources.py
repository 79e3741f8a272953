"""The one image-folder scanner: what ``kaisoku pack`` and ``kaisoku train`` on a folder both read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.loading.folder import split_train_val
from kaisoku.data.shards.format import read_index
from kaisoku.data.shards.sources import IMAGE_EXTENSIONS, scan_image_folder, scan_image_tree
from kaisoku.data.shards.writer import pack
from kaisoku.errors import KaisokuError
from tests.data.shards.test_writer import CLASSES, image_array, make_image_folder, png_bytes


def test_scan_image_folder_labels_sorted_classes(tmp_path: Path) -> None:
    files = make_image_folder(tmp_path / "src")
    classes, items = scan_image_folder(tmp_path / "src")
    assert classes == list(CLASSES)
    assert sorted(rel for rel, _, _ in items) == sorted(files)
    for relative, label, size in items:
        assert label == CLASSES.index(relative.split("/")[0])
        assert size == len(files[relative])


def test_scan_is_recursive_case_insensitive_and_skips_hidden_and_other_files(tmp_path: Path) -> None:
    root = tmp_path / "src"
    png = png_bytes(image_array(1))
    for relative in (
        "cat/a.PNG",
        "cat/deeper/b.png",
        "cat/.hidden.png",
        "cat/.dot/c.png",
        "cat/notes.txt",
        "dog/d.TIFF",
    ):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(png)
    classes, items = scan_image_folder(root)
    assert classes == ["cat", "dog"]
    assert [(rel, label) for rel, label, _ in items] == [
        ("cat/a.PNG", 0),
        ("cat/deeper/b.png", 0),
        ("dog/d.TIFF", 1),
    ]
    assert ".tiff" in IMAGE_EXTENSIONS and ".gif" in IMAGE_EXTENSIONS


def test_split_tree_shares_one_label_mapping(tmp_path: Path) -> None:
    png = png_bytes(image_array(2))
    for relative in ("train/cat/a.png", "train/dog/b.png", "val/dog/c.png", "val/emu/d.png"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_bytes(png)
    tree = scan_image_tree(tmp_path)
    assert tree.classes == ("cat", "dog", "emu")
    assert [label for _, label, _ in tree.splits["val"]] == [1, 2]
    assert tree.files("train") == [str(tmp_path / "train/cat/a.png"), str(tmp_path / "train/dog/b.png")]


def test_training_and_packing_see_the_same_images(tmp_path: Path) -> None:
    root = tmp_path / "src"
    png = png_bytes(image_array(3))
    for split, count in (("train", 3), ("val", 2)):
        for label, name in enumerate(CLASSES):
            for i in range(count):
                path = root / split / name / ("sub" if i == 2 else "") / f"{label}-{i}.PNG"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(png)
    train, val = split_train_val(root, 0.1, seed=0)
    pack(root, tmp_path / "dst", workers=0, progress=False, shuffle=False)
    for split, files in (("train", train), ("val", val)):
        index = read_index(tmp_path / "dst" / split)
        assert index.num_samples == len(files)
        assert list(index.classes) == list(files.classes)
        assert np.array_equal(index.columns["label"], files.labels)
    assert len(train) == 3 * len(CLASSES) and len(val) == 2 * len(CLASSES)


def test_split_tree_without_train_is_an_error(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "src" / "val")
    with pytest.raises(KaisokuError, match="no train/"):
        split_train_val(tmp_path / "src", 0.1, seed=0)

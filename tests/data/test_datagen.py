"""The generated shapes dataset: real JPEG files, deterministic, never half-written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kaisoku.data.datagen import CLASSES, ensure_demo_dataset, generate
from kaisoku.data.loading.transforms import decode_image
from kaisoku.errors import KaisokuError


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.jpg")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def test_generate_writes_decodable_jpegs_in_class_folders(tmp_path: Path) -> None:
    root = generate(tmp_path / "a", count=40, size=24, val_count=20, workers=1)
    assert sorted(p.name for p in (root / "train").iterdir()) == sorted(CLASSES)
    files = sorted((root / "train").rglob("*.jpg"))
    assert len(files) == 40
    assert len(list((root / "val").rglob("*.jpg"))) == 20
    image = decode_image(files[0].read_bytes())
    assert image.shape == (24, 24, 3)


def test_generate_is_deterministic_and_seeded(tmp_path: Path) -> None:
    a = generate(tmp_path / "a", count=20, size=16, workers=1)
    b = generate(tmp_path / "b", count=20, size=16, workers=2)
    c = generate(tmp_path / "c", count=20, size=16, seed=1, workers=1)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_refuses_non_empty_folder_and_tiny_count(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(KaisokuError, match="is not empty"):
        generate(tmp_path / "full", count=20, size=16)
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    with pytest.raises(KaisokuError, match="below the 10 classes"):
        generate(tmp_path / "small", count=3, size=16)


def test_ensure_demo_dataset_generates_once_saying_what_and_where_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = ensure_demo_dataset(tmp_path, count=20, size=16)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and "generating the demo dataset once (20 training images" in said[0], said
    assert f"into {first};" in said[0] and "16 px" in said[0]
    stamp = (first / "manifest.json").stat().st_mtime_ns
    second = ensure_demo_dataset(tmp_path, count=20, size=16)
    assert first == second
    assert (second / "manifest.json").stat().st_mtime_ns == stamp
    assert capsys.readouterr().out == ""  # reused: nothing said

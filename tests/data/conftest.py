"""Fixtures shared by the data tests."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kaisoku.data.shards.writer import pack
from tests.data.shards.test_writer import make_image_folder


@pytest.fixture
def packed(tmp_path: Path) -> Path:
    """A small ImageFolder pack with several shards."""
    make_image_folder(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "dst", shard_bytes=3000, workers=0, progress=False)
    return tmp_path / "dst"


@pytest.fixture
def ram_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"kaisoku-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)

"""The shard layout and the versioned index."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.format import FORMAT_VERSION, INDEX_NAME, Field, read_index
from kaisoku.data.inspect import inspect_dataset
from kaisoku.data.writer import pack
from kaisoku.errors import KaisokuError


def _edit_index(path: Path, change: dict) -> None:
    document = json.loads((path / INDEX_NAME).read_text())
    document.update(change)
    (path / INDEX_NAME).write_text(json.dumps(document))


def test_field_validation() -> None:
    with pytest.raises(KaisokuError, match="unknown kind"):
        Field(name="a", kind="pickle")
    with pytest.raises(KaisokuError, match="numeric"):
        Field(name="a", kind="array", dtype="|O", shape=(2,))
    with pytest.raises(KaisokuError, match="dtype and a shape"):
        Field(name="a", kind="array")
    with pytest.raises(KaisokuError, match="takes no dtype"):
        Field(name="a", kind="int", dtype="<i8")


def test_index_round_trip(packed: Path) -> None:
    index = read_index(packed)
    assert index.version == FORMAT_VERSION
    assert read_index(packed / INDEX_NAME).dumps() == index.dumps()
    assert (packed / INDEX_NAME).read_text() == index.dumps()
    assert index.shard_starts()[-1] == index.num_samples
    for shard_id, shard in enumerate(index.shards):
        data = index.shard_path(shard_id).read_bytes()
        assert len(data) == shard.nbytes and zlib.crc32(data) == shard.crc32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": FORMAT_VERSION + 1}, "newer kaisoku; upgrade"),
        ({"version": 0}, "re-pack"),
        ({"format": "other"}, "not a kaisoku shard index"),
        ({"num_samples": 5}, "num_samples"),
        ({"codec": "rar"}, "unknown codec"),
        ({"fields": [{"name": "x", "kind": "array", "dtype": "|O", "shape": [1]}]}, "numeric"),
    ],
)
def test_read_index_rejects_bad_documents(packed: Path, change: dict, message: str) -> None:
    _edit_index(packed, change)
    with pytest.raises(KaisokuError, match=message):
        read_index(packed)


def test_read_index_rejects_damaged_shard_entries(packed: Path) -> None:
    document = json.loads((packed / INDEX_NAME).read_text())
    document["shards"][0]["file"] = "../../etc/passwd"
    (packed / INDEX_NAME).write_text(json.dumps(document))
    with pytest.raises(KaisokuError, match="bad file name"):
        read_index(packed)
    document["shards"][0]["file"] = "shard-00000.kshard"
    document["shards"][0]["offsets"][1] = 10**9
    (packed / INDEX_NAME).write_text(json.dumps(document))
    with pytest.raises(KaisokuError, match="offsets"):
        read_index(packed)
    del document["shards"][0]["offsets"]
    (packed / INDEX_NAME).write_text(json.dumps(document))
    with pytest.raises(KaisokuError, match="damaged.*offsets"):
        read_index(packed)


def test_read_index_missing_and_corrupt(tmp_path: Path, packed: Path) -> None:
    with pytest.raises(KaisokuError, match="does not exist"):
        read_index(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KaisokuError, match="no index.json.*kaisoku pack"):
        read_index(tmp_path / "empty")
    text = (packed / INDEX_NAME).read_text()
    (packed / INDEX_NAME).write_text(text[: len(text) // 2])
    with pytest.raises(KaisokuError, match="not valid JSON"):
        read_index(packed)


def test_read_index_on_split_layout_names_the_splits(tmp_path: Path) -> None:
    np.savez(
        tmp_path / "d.npz",
        x_a=np.zeros((2, 2)),
        y_a=np.zeros(2, int),
        x_b=np.ones((2, 2)),
        y_b=np.ones(2, int),
    )
    pack(tmp_path / "d.npz", tmp_path / "dst", workers=0, progress=False)
    with pytest.raises(KaisokuError, match=r"several splits \(a, b\)"):
        read_index(tmp_path / "dst")
    text = inspect_dataset(tmp_path / "dst", verify=True).text
    assert "npz:a" in text and "npz:b" in text

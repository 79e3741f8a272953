"""The shard layout and the versioned index."""

from __future__ import annotations

import json
import logging
import pickle
import zlib
from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.shards.format import FORMAT_VERSION, INDEX_NAME, Field, read_index, upgrade_index
from kaisoku.data.shards.inspect import inspect_dataset
from kaisoku.data.shards.tables import TABLES_NAME
from kaisoku.data.shards.writer import pack
from kaisoku.errors import KaisokuError


def write_version_1(path: Path) -> None:
    """Rewrite the index at ``path`` as format version 1 (per-record lists inside index.json), as packs
    made before version 2 are."""
    document = json.loads((path / INDEX_NAME).read_text())
    index = read_index(path)
    document["version"] = 1
    del document["tables"]
    document["columns"] = {name: column.tolist() for name, column in index.columns.items()}
    for entry, shard in zip(document["shards"], index.shards, strict=True):
        entry["offsets"] = shard.offsets.tolist()
        entry["record_crc32"] = shard.record_crc32.tolist()
    (path / INDEX_NAME).write_text(json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n")
    (path / TABLES_NAME).unlink()


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
    document["shards"][0]["bytes"] += 7
    (packed / INDEX_NAME).write_text(json.dumps(document))
    with pytest.raises(
        KaisokuError, match=r"index.tables does not match.*shard-00000.kshard end at \d+ bytes"
    ):
        read_index(packed)
    document["shards"][0]["bytes"] -= 7
    document["shards"][0]["samples"] += 1
    document["num_samples"] += 1
    (packed / INDEX_NAME).write_text(json.dumps(document))
    with pytest.raises(KaisokuError, match="table 'offsets' in .*index.tables has .* entries"):
        read_index(packed)


def test_tables_file_damage_is_named(packed: Path) -> None:
    tables = packed / TABLES_NAME
    data = tables.read_bytes()
    tables.write_bytes(data[:-8])
    with pytest.raises(KaisokuError, match=f"{TABLES_NAME} has {len(data) - 8} bytes.*says {len(data)}"):
        read_index(packed)
    layout = json.loads((packed / INDEX_NAME).read_text())["tables"]["tables"]["offsets"]
    damaged = bytearray(data)
    second = layout["start"] + 8  # record 1's offset: make it smaller than record 0's
    damaged[second : second + 8] = (0).to_bytes(8, "little")
    tables.write_bytes(bytes(damaged))
    with pytest.raises(
        KaisokuError, match="does not match the shards: offsets of shard-00000.kshard do not rise"
    ):
        read_index(packed)
    tables.unlink()
    with pytest.raises(KaisokuError, match=f"{TABLES_NAME} is missing"):
        read_index(packed)


def test_index_pickles_by_path_and_maps_shared_tables(packed: Path) -> None:
    index = read_index(packed)
    assert index.version == 2 and (packed / TABLES_NAME).is_file()
    assert index.shards[0].offsets.base is not None  # a view of the mapped file, not a copy
    blob = pickle.dumps(index)
    assert len(blob) < 2000  # no per-record array travels with it
    again = pickle.loads(blob)
    assert again.dumps() == index.dumps()
    assert np.array_equal(again.columns["label"], index.columns["label"])


def test_version_1_reads_with_a_note_and_upgrades(packed: Path, caplog: pytest.LogCaptureFixture) -> None:
    v2 = read_index(packed)
    shard_bytes = {s.file: (packed / s.file).read_bytes() for s in v2.shards}
    write_version_1(packed)
    with caplog.at_level(logging.WARNING, logger="kaisoku.data.shards.format"):
        v1 = read_index(packed)
        read_index(packed)
    notes = [r.getMessage() for r in caplog.records if "version 1" in r.getMessage()]
    assert len(notes) == 1 and "kaisoku pack --upgrade" in notes[0]
    assert v1.version == 1 and v1.num_samples == v2.num_samples
    for old, new in zip(v1.shards, v2.shards, strict=True):
        assert np.array_equal(old.offsets, new.offsets) and np.array_equal(old.record_crc32, new.record_crc32)
    upgraded, was = upgrade_index(packed)
    assert was == 1 and upgraded.version == 2
    assert read_index(packed).dumps() == v2.dumps()
    assert {s.file: (packed / s.file).read_bytes() for s in v2.shards} == shard_bytes
    assert upgrade_index(packed)[1] == 2  # already current: left alone


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


def test_cli_pack_upgrade_and_inspect_show_the_version(packed: Path, capsys: pytest.CaptureFixture) -> None:
    from kaisoku.cli import cmd_inspect, cmd_pack

    write_version_1(packed)
    assert cmd_inspect([str(packed)]) == 0
    assert "version 1" in capsys.readouterr().out
    assert cmd_pack(["--upgrade", str(packed)]) == 0
    assert "upgraded from version 1 to version 2" in capsys.readouterr().out
    assert cmd_inspect([str(packed), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"version {FORMAT_VERSION}" in out and "verify    ok" in out

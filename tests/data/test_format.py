"""Record layout, the versioned index, checksums, sizes and ``inspect``."""

from __future__ import annotations

import importlib.util
import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.codecs import available_codecs, get_codec
from kaisoku.data.format import (
    FORMAT_VERSION,
    INDEX_NAME,
    CorruptRecordError,
    Field,
    RecordCodec,
    check_record,
    format_bytes,
    inspect_dataset,
    inspect_summary,
    parse_bytes,
    read_index,
    record_view,
)
from kaisoku.data.writer import pack, pack_records
from kaisoku.errors import ConfigError, KaisokuError
from tests.data.test_writer import make_image_folder


@pytest.fixture
def packed(tmp_path: Path) -> Path:
    """A small ImageFolder pack with several shards."""
    make_image_folder(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "dst", shard_bytes=3000, workers=0, progress=False)
    return tmp_path / "dst"


def _edit_index(path: Path, change: dict) -> None:
    document = json.loads((path / INDEX_NAME).read_text())
    document.update(change)
    (path / INDEX_NAME).write_text(json.dumps(document))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("64MiB", 64 * 2**20),
        ("2GiB", 2 * 2**30),
        ("2gib", 2 * 2**30),
        ("1.5G", int(1.5 * 2**30)),
        ("500MB", 500 * 10**6),
        ("4096", 4096),
        ("10 KiB", 10240),
        ("3k", 3072),
        ("1e3", 1000),
        ("7B", 7),
        (123, 123),
    ],
)
def test_parse_bytes(text: str | int, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "-5", "12 parsecs", "1..2G", "nan", -1, True])
def test_parse_bytes_rejects(text: str | int) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(text)


def test_format_bytes() -> None:
    assert format_bytes(12) == "12 B"
    assert format_bytes(64 * 2**20) == "64.0 MiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"


def test_field_validation() -> None:
    with pytest.raises(KaisokuError, match="unknown kind"):
        Field(name="a", kind="pickle")
    with pytest.raises(KaisokuError, match="numeric"):
        Field(name="a", kind="array", dtype="|O", shape=(2,))
    with pytest.raises(KaisokuError, match="dtype and a shape"):
        Field(name="a", kind="array")
    with pytest.raises(KaisokuError, match="takes no dtype"):
        Field(name="a", kind="int", dtype="<i8")


@pytest.mark.parametrize("codec", ["raw", "zstd", "lz4"])
def test_record_round_trip(codec: str) -> None:
    if codec not in available_codecs():
        pytest.skip(f"{codec} not installed")
    fields = (
        Field(name="image", kind="image"),
        Field(name="label", kind="int"),
        Field(name="text", kind="str"),
        Field(name="blob", kind="bytes"),
        Field(name="x", kind="array", dtype="<f4", shape=(2, 3)),
    )
    sample = {
        "image": b"\xff\xd8\xff" + b"j" * 100,
        "label": -7,
        "text": "héllo " * 20,
        "blob": b"\0" * 500,
        "x": np.arange(6, dtype=np.float32).reshape(2, 3),
    }
    encoder = RecordCodec(fields, codec)
    data, logical = encoder.encode(sample)
    raw_data, raw_logical = RecordCodec(fields, "raw").encode(sample)
    assert logical == raw_logical == len(raw_data)
    if codec != "raw":
        assert len(data) < len(raw_data)
        assert b"j" * 100 in data  # images are never compressed again
    decoded = encoder.decode(data)
    assert decoded["image"] == sample["image"] and decoded["label"] == -7
    assert decoded["text"] == sample["text"] and decoded["blob"] == sample["blob"]
    np.testing.assert_array_equal(decoded["x"], sample["x"])
    assert decoded["x"].flags.writeable
    with pytest.raises(KaisokuError, match="label"):
        encoder.encode({**sample, "label": "seven"})
    with pytest.raises(KaisokuError, match="no field 'x'"):
        encoder.encode({k: v for k, v in sample.items() if k != "x"})


def test_codec_errors() -> None:
    with pytest.raises(KaisokuError, match="unknown codec"):
        get_codec("snappy")
    if importlib.util.find_spec("lz4") is None:
        with pytest.raises(KaisokuError, match="pip install lz4"):
            get_codec("lz4")


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


def test_record_view_detects_flipped_byte_and_truncation(packed: Path) -> None:
    index = read_index(packed)
    data = bytearray(index.shard_path(1).read_bytes())
    record = index.shards[1].samples - 1
    data[int(index.shards[1].offsets[record]) + 9] ^= 0x01
    with pytest.raises(CorruptRecordError, match=f"shard-00001.kshard record {record} .*checksum") as caught:
        record_view(index, data, 1, record)
    assert caught.value.file == "shard-00001.kshard" and caught.value.record == record
    assert record_view(index, data, 1, record, verify=False)  # the caller may opt out
    with pytest.raises(CorruptRecordError, match="truncated"):
        record_view(index, data[:-5], 1, record)
    good = record_view(index, index.shard_path(1).read_bytes(), 1, 0)
    assert check_record(index, bytes(good), 1, 0) == good
    with pytest.raises(CorruptRecordError, match="bytes"):
        check_record(index, bytes(good)[:-1], 1, 0)


def test_inspect_summary_and_verify(packed: Path) -> None:
    index = read_index(packed)
    text = inspect_summary(packed, verify=True)
    assert f"{index.num_samples:,} in {len(index.shards):,} shards" in text
    assert "classes   3: cat, dog, emu" in text
    assert "verify    ok" in text
    assert "verify" not in inspect_summary(packed)


def test_inspect_verify_reports_each_damage(packed: Path) -> None:
    index = read_index(packed)
    # A flipped byte in shard 0 record 2, a truncated shard 1, a missing shard 2.
    path0 = index.shard_path(0)
    data = bytearray(path0.read_bytes())
    damaged = index.shards[0].samples // 2
    data[int(index.shards[0].offsets[damaged]) + 5] ^= 0x40
    path0.write_bytes(bytes(data))
    path1 = index.shard_path(1)
    path1.write_bytes(path1.read_bytes()[:-3])
    index.shard_path(2).unlink()
    report = inspect_dataset(packed, verify=True)
    assert not report.ok
    joined = "\n".join(report.problems)
    assert f"shard-00000.kshard: record {damaged} (sample {damaged}," in joined
    assert "checksum mismatch" in joined
    last = index.shards[1].samples - 1
    assert f"shard-00001.kshard: record {last} " in joined and "cut off" in joined
    assert "shard-00002.kshard: missing" in joined
    assert "FAILED" in report.text
    with pytest.raises(KaisokuError, match="verification problems"):
        inspect_summary(packed, verify=True)
    # Without verify, the summary reads the index only.
    assert inspect_dataset(packed).ok


def test_inspect_records_pack(tmp_path: Path) -> None:
    pack_records(({"v": i, "s": str(i)} for i in range(5)), tmp_path / "d", progress=False)
    text = inspect_summary(tmp_path / "d", verify=True)
    assert "fields    v (int), s (str)" in text
    assert "v         5 distinct, 0..4" in text

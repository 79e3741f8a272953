"""The record codec and the per-record checksums."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.shards.codecs import available_codecs, get_codec
from kaisoku.data.shards.format import Field, read_index
from kaisoku.data.shards.records import CorruptRecordError, RecordCodec, check_record, record_view
from kaisoku.errors import KaisokuError


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
    assert isinstance(decoded["image"], bytes)  # a copy: the caller may keep it past the shard's buffer
    # views: the stored image (never compressed) comes back uncopied, a view of the record's own buffer
    buffer = bytearray(data)
    viewed = encoder.decode(memoryview(buffer), views=True)
    assert isinstance(viewed["image"], memoryview) and viewed["image"].obj is buffer
    assert bytes(viewed["image"]) == sample["image"] and viewed["label"] == -7
    assert viewed["text"] == sample["text"] and bytes(viewed["blob"]) == sample["blob"]
    if codec != "raw":  # a compressed field is new bytes either way
        assert isinstance(viewed["blob"], bytes)
    np.testing.assert_array_equal(viewed["x"], sample["x"])
    assert viewed["x"].flags.writeable  # arrays stay writable copies
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

"""``kaisoku inspect``: the summary and ``--verify``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kaisoku.data.shards.format import INDEX_NAME, read_index
from kaisoku.data.shards.inspect import inspect_dataset, inspect_summary
from kaisoku.data.shards.tables import TABLES_NAME
from kaisoku.data.shards.writer import pack_records
from kaisoku.errors import KaisokuError


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
    assert f"the index says {index.shards[1].nbytes} (truncated): records {last}..{last} " in joined
    assert "shard-00002.kshard: missing" in joined
    assert report.count == len(report.problems) == 3
    assert "verify    FAILED: 3 problems" in report.text
    with pytest.raises(KaisokuError, match="verification problems"):
        inspect_summary(packed, verify=True)
    # Without verify, the summary reads the index only.
    assert inspect_dataset(packed).ok


def test_inspect_records_pack(tmp_path: Path) -> None:
    pack_records(({"v": i, "s": str(i)} for i in range(5)), tmp_path / "d", progress=False)
    text = inspect_summary(tmp_path / "d", verify=True)
    assert "fields    v (int), s (str)" in text
    assert "v         5 distinct, 0..4" in text


def test_verify_checks_the_tables_crc(packed: Path) -> None:
    tables = packed / TABLES_NAME
    crc_start = json.loads((packed / INDEX_NAME).read_text())["tables"]["tables"]["record_crc32"]
    data = bytearray(tables.read_bytes())
    data[crc_start["start"]] ^= 0xFF  # a record checksum: the offsets still tile the shards
    tables.write_bytes(bytes(data))
    report = inspect_dataset(packed, verify=True)
    assert any(TABLES_NAME in p and "CRC32" in p for p in report.problems)


def test_verify_of_a_truncated_shard_counts_what_it_lists(tmp_path: Path) -> None:
    """A shard cut to a third, plus 14 flipped records in another: the FAILED count is the problems listed."""
    pack_records(
        ({"v": i, "s": "x" * 50} for i in range(400)), tmp_path / "d", progress=False, shard_bytes=8000
    )
    index = read_index(tmp_path / "d")
    cut = index.shard_path(0)
    cut.write_bytes(cut.read_bytes()[: index.shards[0].nbytes // 3])
    flipped = index.shard_path(1)
    data = bytearray(flipped.read_bytes())
    for record in range(14):
        data[int(index.shards[1].offsets[record]) + 3] ^= 0x01
    flipped.write_bytes(bytes(data))
    report = inspect_dataset(tmp_path / "d", verify=True)
    lines = report.text.splitlines()
    failed = next(i for i, line in enumerate(lines) if line.startswith("verify    FAILED"))
    listed = [line.strip() for line in lines[failed + 1 :]]
    # One line for the cut shard, 10 records, then one line standing for the other 4.
    assert len(listed) == 12 and listed[-1].endswith("4 more records with a checksum mismatch (not listed)")
    assert "(truncated): records " in listed[0] and "cut off" in listed[0]
    assert report.count == 1 + 10 + 4
    assert f"verify    FAILED: {report.count} problems" in report.text
    with pytest.raises(
        KaisokuError, match=f"^{re.escape(str(tmp_path / 'd'))}: 15 verification problems, first: .*truncated"
    ):
        inspect_summary(tmp_path / "d", verify=True)


def test_a_well_formed_index_whose_labels_pass_its_classes_is_damaged_data(
    packed: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``classes`` cut to 2 names while labels go to 2: verify and train both stop naming the field, exit 3
    (a label past the list would reach the loss as a class the model lacks)."""
    from tests.train_harness import kaisoku_in_process

    index_path = packed / INDEX_NAME
    document = json.loads(index_path.read_text())
    document["classes"] = document["classes"][:2]
    index_path.write_text(json.dumps(document))
    expected = (
        f"kaisoku: error: index {index_path} is damaged: field 'label' goes up to 2, but 'classes' names 2 "
        "(labels 0..1); re-pack the dataset"
    )
    verified = kaisoku_in_process(capfd, "inspect", str(packed), "--verify")
    assert verified.returncode == 3, verified.stderr
    assert verified.stderr.strip().splitlines() == [expected]
    run = tmp_path / "run"
    trained = kaisoku_in_process(
        capfd, "train", "--data.path", str(packed), "--nproc", "1", "--run-dir", str(run)
    )
    assert trained.returncode == 3, trained.stderr
    cause, hint = trained.stderr.strip().splitlines()
    assert cause == expected.removesuffix("; re-pack the dataset")
    assert hint.startswith(f"kaisoku: check the dataset with `kaisoku inspect {packed} --verify` and re-pack")
    assert not (run / "checkpoints").exists()

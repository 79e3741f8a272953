"""MetricsLogger's metrics.jsonl, its no-op mode on other ranks, messages, the summary and peak memory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kaisoku.engine.metrics import MetricsLogger, peak_memory_mib, print_summary, summary_rows


def _logger(run_dir: Path | None, *, enabled: bool = True, **options: bool) -> MetricsLogger:
    settings = {"progress": False, "tensorboard": False, **options}
    return MetricsLogger(run_dir, enabled=enabled, total_steps=10, **settings)


def _lines(run_dir: Path) -> list[dict]:
    """The records as logged, without the time stamps every line carries."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        assert isinstance(line.pop("time"), str) and line.pop("elapsed_s") >= 0
    return lines


def test_non_finite_values_become_null_with_a_flag_and_every_line_has_the_time(tmp_path: Path) -> None:
    metrics = _logger(tmp_path)
    metrics.log({"step": 3, "loss": float("nan"), "lr": float("inf"), "samples_per_s": 10.0})
    metrics.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (line,) = [json.loads(raw) for raw in text.splitlines()]
    assert line["loss"] is None and line["lr"] is None and line["nonfinite"] == ["loss", "lr"]
    assert line["time"].endswith("+00:00") and line["elapsed_s"] >= 0


def test_each_record_is_one_json_line_readable_before_close(tmp_path: Path) -> None:
    run_dir = tmp_path / "run" / "nested"
    metrics = _logger(run_dir)
    metrics.log({"event": "start", "world_size": 2})
    metrics.log({"step": 1, "epoch": 0, "loss": 2.25, "lr": 0.1})
    # Flushed line by line: a reader (or a killed run) sees every record logged so far.
    assert _lines(run_dir) == [
        {"event": "start", "world_size": 2},
        {"step": 1, "epoch": 0, "loss": 2.25, "lr": 0.1},
    ]
    assert list(_lines(run_dir)[1]) == ["step", "epoch", "loss", "lr"]  # keys in the order given
    metrics.close()
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 2


def test_a_new_logger_appends_to_the_run_s_file(tmp_path: Path) -> None:
    first = _logger(tmp_path)
    first.log({"step": 1})
    first.close()
    resumed = _logger(tmp_path)
    resumed.log({"step": 2})
    resumed.close()
    assert _lines(tmp_path) == [{"step": 1}, {"step": 2}]


def test_records_after_close_are_dropped(tmp_path: Path) -> None:
    metrics = _logger(tmp_path)
    metrics.log({"step": 1})
    metrics.close()
    metrics.log({"step": 2})
    metrics.close()  # closing twice is harmless
    assert _lines(tmp_path) == [{"step": 1}]


def test_disabled_logger_on_other_ranks_writes_and_prints_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    metrics = _logger(run_dir, enabled=False, progress=True, tensorboard=True)
    metrics.log({"step": 1, "loss": 1.0})
    metrics.advance(1, loss=1.0, rate=5.0)
    metrics.message("hello from rank 1")
    metrics.close()
    assert not metrics.enabled
    assert not run_dir.exists()
    assert capsys.readouterr() == ("", "")


def test_without_a_run_dir_nothing_is_written_but_messages_print(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    metrics = _logger(None)
    metrics.log({"step": 1})
    metrics.message("checkpoint somewhere")
    metrics.close()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == "checkpoint somewhere\n"


def test_progress_bar_advances_and_messages_print_above_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = _logger(tmp_path, progress=True)
    metrics.advance(3, loss=0.5, rate=120.0)
    metrics.message("resumed from step 3")
    metrics.close()
    out = capsys.readouterr().out
    assert "resumed from step 3" in out
    assert "3/10" in out and "loss 0.5000" in out and "120 samples/s" in out
    # The bar writes to the terminal only; the metrics file holds only what was logged.
    assert not (tmp_path / "metrics.jsonl").read_text()


def test_tensorboard_gets_the_numeric_scalars_or_a_hint_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = _logger(tmp_path, tensorboard=True)
    metrics.log({"step": 4, "loss": 1.5, "event": "val"})
    metrics.close()
    assert _lines(tmp_path) == [{"step": 4, "loss": 1.5, "event": "val"}]
    if importlib.util.find_spec("tensorboard") is None:
        assert "tensorboard is not installed; pip install tensorboard" in capsys.readouterr().err
        assert not (tmp_path / "tensorboard").exists()
    else:
        events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
        assert events and events[0].stat().st_size > 0


def test_print_summary_is_a_table_with_floats_to_four_digits(capsys: pytest.CaptureFixture[str]) -> None:
    print_summary({"steps": 40, "val_acc": 0.876543, "device": "cpu"})
    out = capsys.readouterr().out
    assert "kaisoku train: summary" in " ".join(out.split())  # the title may wrap to the table's width
    assert "metric" in out and "value" in out
    lines = {
        line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines() if "│" in line
    }
    assert lines == {"steps": "40", "val_acc": "0.8765", "device": "cpu"}


def test_peak_memory_on_cpu_is_the_resident_high_water_mark_in_mib() -> None:
    # The high-water mark may be reset (clear_refs) by interval measurements, never below the current RSS.
    status = Path("/proc/self/status").read_text()
    rss_mib = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024
    peak = peak_memory_mib(torch.device("cpu"))
    assert peak >= rss_mib * 0.99
    # A touched 64 MiB buffer shows up in the high-water mark (units are MiB, not KiB or bytes).
    buffer = torch.ones(16 * 2**20, dtype=torch.float32)  # every page written
    assert peak_memory_mib(torch.device("cpu")) >= buffer.numel() * buffer.element_size() / 2**20
    assert peak < 1024 * 1024  # far below a TiB: not bytes or KiB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peak_memory_on_cuda_is_max_allocated_in_mib() -> None:
    device = torch.device("cuda")
    buffer = torch.empty(8 * 2**20, dtype=torch.float32, device=device)  # 32 MiB
    assert peak_memory_mib(device) == torch.cuda.max_memory_allocated(device) / 2**20
    assert peak_memory_mib(device) >= 32
    del buffer


def test_a_resumed_run_drops_the_lines_after_its_checkpoint_and_marks_the_resume(tmp_path: Path) -> None:
    lines = [{"event": "start"}, *({"step": s, "loss": 1.0 / s} for s in range(1, 8))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 8, "lo')
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=10, progress=False, tensorboard=False)
    logger.log({"event": "start"})
    logger.continue_from(4, restart=1)
    logger.log({"step": 5, "loss": 0.5})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 2, 3, 4, 5]  # each step once: 5..8 of the killed attempt are gone
    assert [r for r in records if r.get("event") == "resume"][0] == {**records[-2], "step": 4, "restart": 1}


def test_the_summary_shows_io_counters_only_for_the_data_path_in_play() -> None:
    summary = {
        "steps": 10,
        "final_loss": 0.5,
        "skipped_records": 0.0,
        "source_bytes": 9.0,
        "exchanged_bytes": 0.0,
    }
    assert [k for k, _ in summary_rows(summary)] == ["steps", "final_loss"]
    assert [k for k, _ in summary_rows(summary, staging=True)] == ["steps", "final_loss", "source_bytes"]
    shown = [k for k, _ in summary_rows({**summary, "skipped_records": 2.0}, exchange=True)]
    assert shown == ["steps", "final_loss", "skipped_records", "exchanged_bytes"]

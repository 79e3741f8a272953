"""engine/report.py: `kaisoku report RUN_DIR` on a run that crashed mid-line, checked by parsing its page."""

from __future__ import annotations

import base64
import datetime
import io
import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from kaisoku.cli import main
from kaisoku.engine.report import finish_line, write_report
from tests.fs_harness import refusing_folder


class _Images(HTMLParser):
    """Collects the data URIs of <img> tags and the text of <h2> headings."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.headings: list[str] = []
        self._in_h2 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.sources.append(dict(attrs)["src"] or "")
        self._in_h2 = tag == "h2"

    def handle_data(self, data: str) -> None:
        if self._in_h2:
            self.headings.append(data)
            self._in_h2 = False


def _crashed_run(run_dir: Path) -> None:
    lines = [
        {"event": "start", "world_size": 2, "device": "cpu"},
        {"step": 0, "epoch": 0, "shuffle_quality": 0.93},
        *[
            {
                "step": s,
                "loss": 2.0 / s,
                "lr": 0.1 * s,
                "samples_per_s": 100.0 + s,
                "data_wait_fraction": 0.1,
                "peak_memory_mib": 500.0 + s,
            }
            for s in range(1, 6)
        ],  # fmt: skip
        {"step": 6, "loss": None, "nonfinite": ["loss"], "lr": 0.6},
        {"step": 4, "event": "validation", "seconds": 0.2, "val_loss": 1.0, "val_accuracy": 0.5},
        {"step": 5, "event": "epoch", "skipped_records": 3.0},
        {"step": 4, "event": "rollback", "from_step": 6, "lr_scale": 0.5},
    ]
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 7, "lo'  # torn by the crash
    (run_dir / "metrics.jsonl").write_text(text)
    (run_dir / "config.toml").write_text('run_dir = "x"\n[train]\nepochs = 2.0\n')


def test_the_report_of_a_crashed_run_embeds_readable_plots_events_and_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _crashed_run(run_dir)
    page = write_report(run_dir)
    parser = _Images()
    text = page.read_text()
    parser.feed(text)
    assert parser.headings == ["Status", "Plots", "Events", "Environment", "Resolved config"]
    # loss, val accuracy, lr, samples/s, data wait, peak memory, shuffle quality, skipped records, and each
    # other validation figure (here the validation loss)
    assert len(parser.sources) == 9
    assert (run_dir / "report" / "val_loss.png").exists()
    for source in parser.sources:
        assert source.startswith("data:image/png;base64,")
        image = Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1])))
        image.verify()
        assert image.format == "PNG" and image.size[0] > 100
    assert sorted(p.name for p in (run_dir / "report").glob("*.png"))[0] == "data_wait_fraction.png"
    assert "rollback" in text and "from_step=6" in text and "epochs = 2.0" in text
    assert "torch" in text and "world size" in text


def test_kaisoku_report_command_and_the_final_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    _crashed_run(run_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(run_dir)])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"wrote {run_dir / 'report.html'}"
    line = finish_line({"steps": 6, "val_accuracy": 0.5, "skipped_records": 3.0}, run_dir)
    assert line == (
        f"kaisoku: done at step 6; val accuracy 50.00%; 3 records skipped; "
        f"run folder {run_dir} (metrics.jsonl); report {run_dir / 'report.html'}"
    )
    line = finish_line({"steps": 6, "skipped_records": 2.0, "val_skipped_records": 1}, run_dir)
    assert "; 3 records skipped (1 in validation); " in line
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path / "nothing")])
    assert exit_info.value.code == 1
    assert "holds no kaisoku run" in capsys.readouterr().err


def test_status_times_are_local_date_times(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _crashed_run(run_dir)
    started = 1_700_000_000.0
    (run_dir / "run.json").write_text(
        json.dumps({"status": "failed", "started": started, "ended": started + 90})
    )
    text = write_report(run_dir).read_text()
    shown = datetime.datetime.fromtimestamp(started).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    assert f"<th>started</th><td>{shown}</td>" in text
    assert "<th>duration</th><td>90.0 s</td>" in text
    assert "1700000000" not in text


def test_the_report_on_a_nearly_full_disk_is_one_line_and_leaves_no_truncated_png(tmp_path: Path) -> None:
    with refusing_folder(tmp_path / "mnt", "full") as run_dir:
        _crashed_run(run_dir)
        free = shutil.disk_usage(run_dir).free
        (run_dir.parent / "filler").write_bytes(b"x" * max(0, free - 12 * 1024))  # room for a PNG or two
        result = subprocess.run(
            [sys.executable, "-m", "kaisoku", "report", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert lines[0].startswith(f"kaisoku: error: cannot write the run report to {run_dir}: no space left")
        for png in (run_dir / "report").glob("*"):
            assert png.suffix == ".png", png  # no temp file left
            Image.open(png).verify()  # every PNG there is whole
        assert not (run_dir / "report.html").exists()

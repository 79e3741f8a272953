"""Every measured figure ``benchmarks/README.md`` quotes comes from a record in ``benchmarks/results``.

A quoted figure carries a marker right after it (and its unit)::

    452.7 µs<!-- record: cosmoflow.json summary/loader_rate_vs_uncompressed_min/raw_us_per_sample -->

The path walks the record's JSON by ``/``-separated keys; ``rows[codec=zstd,row=loader]`` picks the first
row with those values; `` scale=100`` after the path multiplies the value (a fraction quoted in percent).
The figure must equal the record's value rounded to the figure's decimals. A measured figure (a time, a
rate or a kernel count) without a marker fails, and so does a ``results/.../*.json`` the README names that
does not exist.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.bench.schema import RECORDED

README = RECORDED.parents[1] / "benchmarks" / "README.md"

MARKER = re.compile(r"<!-- record: (?P<file>\S+\.json) (?P<path>\S+)(?: scale=(?P<scale>[\d.]+))? -->")
#: The figure before a marker: a number, then at most a short unit (no digits) before the marker.
FIGURE_BEFORE = re.compile(r"(?P<number>-?\d[\d,]*(?:\.\d+)?)(?P<unit>[^\d<>]{0,16})$")
#: What a measured figure looks like in prose: a number with a unit of time, rate or kernels.
MEASURED = re.compile(
    r"(?<![\w.-])(?P<number>\d[\d,]*(?:\.\d+)?)\s?(?P<unit>µs|ms|samples/s|images/s|files/s|GB/s|MB/s|kernels)\b"
)
#: Units of a setup value rather than a measurement when the words after them say so (a link's delay or
#: its queue).
SETUP_AFTER = re.compile(r"^[^.;]{0,40}\b(RTT|delay|queue)\b")


def _select(node: Any, segment: str) -> Any:
    match = re.fullmatch(r"(?P<key>[^\[]+)\[(?P<where>[^\]]+)\]", segment)
    if match is None:
        return node[segment]
    wanted = dict(pair.split("=", 1) for pair in match["where"].split(","))
    for item in node[match["key"]]:
        if all(str(item.get(key)) == value for key, value in wanted.items()):
            return item
    raise KeyError(f"no {match['key']} entry with {wanted}")


def record_value(results: Path, file: str, path: str) -> Any:
    """The value at ``path`` (``/``-separated keys, ``name[key=value,...]`` to pick a row) of ``file``."""
    node: Any = json.loads((results / file).read_text())
    for segment in path.split("/"):
        node = _select(node, segment)
    return node


def quoted_figures(text: str) -> list[tuple[int, str, str, str, float]]:
    """(line, figure as written, file, path, scale) of every marker in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for marker in MARKER.finditer(line):
            before = FIGURE_BEFORE.search(line[: marker.start()])
            figure = before["number"] if before else ""
            found.append((number, figure, marker["file"], marker["path"], float(marker["scale"] or 1)))
    return found


def unmarked_figures(text: str) -> list[str]:
    """Measured-looking figures with no marker right after them (``line: figure``)."""
    missing = []
    in_code = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        for figure in MEASURED.finditer(line):
            after = line[figure.end() :]
            if after.lstrip(" )").startswith("<!-- record:") or SETUP_AFTER.search(after):
                continue
            missing.append(f"line {number}: {figure.group(0)}")
    return missing


def figure_matches(figure: str, value: float) -> bool:
    """Whether ``figure`` is ``value`` rounded to the figure's decimals."""
    decimals = len(figure.split(".", 1)[1]) if "." in figure else 0
    return abs(float(figure.replace(",", "")) - value) <= 0.5 * 10.0**-decimals + 1e-9


def check_readme(text: str, results: Path) -> list[str]:
    """Every problem of ``text`` against the records in ``results``: a stale or unreadable quoted figure,
    a measured figure without a record, a named record that does not exist."""
    problems = []
    for line, figure, file, path, scale in quoted_figures(text):
        if not figure:
            problems.append(f"line {line}: a record marker for {file} {path} follows no figure")
            continue
        try:
            value = record_value(results, file, path)
        except (OSError, KeyError, TypeError, ValueError) as error:
            problems.append(f"line {line}: {figure} quotes {file} {path}, which does not hold it ({error})")
            continue
        if not isinstance(value, (int, float)) or not figure_matches(figure, float(value) * scale):
            problems.append(f"line {line}: {figure} but {file} {path} holds {value!r} (x{scale:g})")
    problems += [f"{where}: a measured figure without a record marker" for where in unmarked_figures(text)]
    for named in sorted(set(re.findall(r"results/([\w/.-]+\.json)", text))):
        if not (results / named).is_file():
            problems.append(f"results/{named} is named but not recorded")
    return problems


def test_every_figure_of_the_readme_matches_its_record() -> None:
    problems = check_readme(README.read_text(), RECORDED)
    assert not problems, "\n".join(problems)


def test_the_check_fails_a_stale_figure_an_unmarked_one_and_a_missing_record(tmp_path: Path) -> None:
    (tmp_path / "h200").mkdir()
    record = {
        "summary": {"speed": {"value": 1.2746, "per_codec": {"delta@log1p:0.1": 0.425}}},
        "rows": [{"row": "loader", "codec": "zstd", "decode_us_per_sample": 363.8}],
    }
    (tmp_path / "h200" / "optim.json").write_text(json.dumps(record))
    good = (
        "The ratio is 1.27<!-- record: h200/optim.json summary/speed/value --> and zstd decodes in "
        "363.8 µs<!-- record: h200/optim.json rows[row=loader,codec=zstd]/decode_us_per_sample -->, at "
        "42.5%<!-- record: h200/optim.json summary/speed/per_codec/delta@log1p:0.1 scale=100 --> of raw; "
        "a link with 2 ms RTT; see results/h200/optim.json.\n"
    )
    assert check_readme(good, tmp_path) == []
    stale = good.replace("1.27<!--", "1.30<!--")
    assert any(
        "1.30 but h200/optim.json summary/speed/value holds 1.2746" in p
        for p in check_readme(stale, tmp_path)
    )
    unmarked = good + "fused SGD launches 6 kernels per step.\n"
    assert check_readme(unmarked, tmp_path) == [
        "line 2: 6 kernels: a measured figure without a record marker"
    ]
    missing = good + "compile ran too: results/h200/compile.json.\n"
    assert check_readme(missing, tmp_path) == ["results/h200/compile.json is named but not recorded"]
    absent = good.replace("summary/speed/value", "summary/speed/median")
    assert any("does not hold it" in p for p in check_readme(absent, tmp_path))


@pytest.mark.parametrize(
    ("figure", "value", "same"), [("0.55", 0.554, True), ("0.65", 0.554, False), ("3,158", 3158.2, True)]
)
def test_a_figure_is_its_value_rounded_to_its_decimals(figure: str, value: float, same: bool) -> None:
    assert figure_matches(figure, value) is same

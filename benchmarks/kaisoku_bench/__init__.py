"""Benchmarks behind ``kaisoku bench NAME``.

Each benchmark module exposes ``run(quick: bool, out_dir: Path) -> dict`` that measures, prints a
table, writes ``<out_dir>/<name>.json`` through :func:`kaisoku_bench.common.write_result` (and a PNG
where a picture helps) and returns the record. :func:`main` is the command line: where results may go,
the tree's state, ``--strict``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kaisoku.command_parser import CommandParser
from kaisoku.errors import ConfigError
from kaisoku_bench import gpu
from kaisoku_bench.common import (
    RESULTS,
    check_out_dir,
    dirt,
    end_run,
    source_repo,
    start_run,
    unmet_goals,
)

#: Benchmark name -> module of ``kaisoku_bench``.
BENCHMARKS: dict[str, str] = {
    "engine": "kaisoku_bench.engine",
    "loader": "kaisoku_bench.loader",
    "slowfs": "kaisoku_bench.slowfs",
    "optim": "kaisoku_bench.optim",
    "largebatch": "kaisoku_bench.largebatch",
    "parallel": "kaisoku_bench.parallel",
    "kfac": "kaisoku_bench.kfac",
    "compile": "kaisoku_bench.compile",
    "memory": "kaisoku_bench.memory",
    "precision": "kaisoku_bench.precision",
    "plan": "kaisoku_bench.plan",
    "vit": "kaisoku_bench.vit",
    "cosmoflow": "kaisoku_bench.cosmoflow",
    "cluster": "kaisoku_bench.cluster",
    "shard": "kaisoku_bench.shard",
    "throughput": "kaisoku_bench.throughput",
    "checkpoint": "kaisoku_bench.checkpoint",
}

#: Benchmarks made of cases that ``--case`` may pick one of.
CASES: dict[str, tuple[str, ...]] = {"kfac": ("mnist", "resnet10-shapes")}


def run_benchmark(name: str, quick: bool, out_dir: Path) -> dict[str, Any]:
    """Import benchmark ``name`` and run it."""
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark '{name}'; choose one of: {', '.join(sorted(BENCHMARKS))}")
    try:
        module = importlib.import_module(BENCHMARKS[name])
    except ModuleNotFoundError as error:
        if error.name != BENCHMARKS[name]:
            raise
        raise ConfigError(f"benchmark '{name}' is not part of this version of kaisoku") from None
    return module.run(quick=quick, out_dir=out_dir)


def parser() -> argparse.ArgumentParser:
    """The parser of ``kaisoku bench``."""
    p = CommandParser(
        prog="kaisoku bench",
        description="Run a benchmark; its record goes to OUT/<name>.json (see benchmarks/README.md).",
    )
    p.add_argument(
        "name",
        help=f"one of: {', '.join(BENCHMARKS)}; or gpu (kaisoku bench gpu --help: every GPU row in one run)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short smoke run (under a minute); writes to a new temporary folder unless --out is given, "
        "never into benchmarks/results",
    )
    p.add_argument("--out", default="", help=f"folder for the JSON and plots (full runs: {RESULTS})")
    p.add_argument("--strict", action="store_true", help="exit 1 when any goal of the summary is not met")
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help=f"record into {RESULTS} from a tree with uncommitted changes (the diff's sha256 is recorded)",
    )
    p.add_argument(
        "--mnist", default="", help="the MNIST .npz archive (default: $KAISOKU_MNIST, shared/data)"
    )
    p.add_argument(
        "--case",
        default="",
        help="run one case of a benchmark with several (kfac: "
        + ", ".join(CASES["kfac"])
        + "); default: every case this machine can run",
    )
    return p


def resolve_out(out: str, *, quick: bool, allow_dirty: bool, repo: Path, name: str) -> Path:
    """The folder a run writes to; ConfigError where the rules forbid it.

    A quick run writes to a new temporary folder unless ``out`` is given, and never into a recorded-results
    folder. A full run writes to ``benchmarks/results`` by default and refuses to record there from a
    tree whose code differs from the commit (changed tracked files, new source files) unless
    ``allow_dirty`` (:func:`~kaisoku_bench.common.check_out_dir`).
    """
    if quick and not out:
        return Path(tempfile.mkdtemp(prefix=f"kaisoku-bench-{name}-"))
    path = Path(out) if out else repo / RESULTS
    check_out_dir(path, quick=quick, allow_dirty=allow_dirty, repo=repo)
    return path


def main(argv: Sequence[str]) -> int:
    """``kaisoku bench NAME [--quick] [--out DIR] [--strict] [--allow-dirty] [--mnist PATH]``.

    Returns the exit code: 0, or 1 under ``--strict`` when a goal is not met. ``kaisoku bench gpu ...`` is
    :func:`kaisoku_bench.gpu.main`: every row that needs a GPU, in one run.
    """
    if list(argv[:1]) == ["gpu"]:
        return gpu.main(argv[1:])
    args = parser().parse_args(list(argv))
    if args.name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark '{args.name}'; choose one of: {', '.join(sorted(BENCHMARKS))}")
    mnist = Path(args.mnist).expanduser() if args.mnist else None
    if mnist is not None and not mnist.is_file():
        raise ConfigError(f"--mnist: no file at {mnist}")
    out_dir = resolve_out(
        args.out, quick=args.quick, allow_dirty=args.allow_dirty, repo=source_repo(), name=args.name
    )
    if args.case and args.case not in CASES.get(args.name, ()):
        known = CASES.get(args.name)
        raise ConfigError(
            f"--case {args.case}: "
            + (
                f"kaisoku bench {args.name} has the cases {', '.join(known)}"
                if known
                else f"kaisoku bench {args.name} has no cases"
            )
        )
    info = start_run(argv, quick=args.quick, mnist=mnist, case=args.case, allow_dirty=args.allow_dirty)
    if info.tree.dirty:
        print(
            f"kaisoku bench: the tree is dirty ({dirt(info.tree)}); recording diff sha256 {info.tree.diff_sha256}",
            file=sys.stderr,
        )
    try:
        record = run_benchmark(args.name, quick=args.quick, out_dir=out_dir)
    finally:
        end_run()
    print(f"kaisoku bench {args.name}: wrote {out_dir / (args.name + '.json')}")
    unmet = unmet_goals(record.get("summary", {}))
    if args.strict and unmet:
        print(f"kaisoku bench {args.name} --strict: goals not met: {', '.join(unmet)}", file=sys.stderr)
        return 1
    return 0

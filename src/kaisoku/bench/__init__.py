"""Benchmarks behind ``kaisoku bench NAME``.

Each benchmark module exposes ``run(quick: bool, out_dir: Path) -> dict`` that measures, prints a
table, writes ``<out_dir>/<name>.json`` through :func:`kaisoku.bench.common.write_result` (and a PNG
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

from kaisoku.bench.common import end_run, source_repo, start_run, tree_state, unmet_goals
from kaisoku.command_parser import CommandParser
from kaisoku.errors import ConfigError

#: Benchmark name -> module under ``kaisoku.bench``.
BENCHMARKS: dict[str, str] = {
    "engine": "kaisoku.bench.engine",
    "loader": "kaisoku.bench.loader",
    "slowfs": "kaisoku.bench.slowfs",
    "optim": "kaisoku.bench.optim",
    "largebatch": "kaisoku.bench.largebatch",
    "parallel": "kaisoku.bench.parallel",
    "kfac": "kaisoku.bench.kfac",
    "compile": "kaisoku.bench.compile",
    "memory": "kaisoku.bench.memory",
    "precision": "kaisoku.bench.precision",
    "plan": "kaisoku.bench.plan",
    "vit": "kaisoku.bench.vit",
    "cosmoflow": "kaisoku.bench.cosmoflow",
    "shard": "kaisoku.bench.shard",
}

#: Where recorded results live, relative to a checkout.
RESULTS = Path("benchmarks") / "results"

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
    p.add_argument("name", help=f"one of: {', '.join(BENCHMARKS)}")
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


def protected_dirs(repo: Path) -> list[Path]:
    """The recorded-results folders: the checkout's and the working directory's ``benchmarks/results``."""
    return list(dict.fromkeys([(repo / RESULTS).resolve(), (Path.cwd() / RESULTS).resolve()]))


def _inside(path: Path, folders: Sequence[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved == folder or folder in resolved.parents for folder in folders)


def resolve_out(out: str, *, quick: bool, allow_dirty: bool, repo: Path, name: str) -> Path:
    """The folder a run writes to; ConfigError where the rules forbid it.

    A quick run writes to a new temporary folder unless ``out`` is given, and never into a recorded-results
    folder. A full run writes to ``benchmarks/results`` by default and refuses to record there from a
    tree whose tracked files differ from the commit unless ``allow_dirty``.
    """
    protected = protected_dirs(repo)
    if quick:
        if not out:
            return Path(tempfile.mkdtemp(prefix=f"kaisoku-bench-{name}-"))
        if _inside(Path(out), protected):
            raise ConfigError(
                f"kaisoku bench --quick never writes into {RESULTS}; pass another --out or none (a temporary folder)"
            )
        return Path(out)
    path = Path(out) if out else repo / RESULTS
    if _inside(path, protected) and not allow_dirty:
        if tree_state(repo).dirty:
            raise ConfigError(
                f"refusing to record into {RESULTS}: tracked files have uncommitted changes; commit them, "
                "pass --out elsewhere, or --allow-dirty to record the diff's sha256"
            )
    return path


def main(argv: Sequence[str]) -> int:
    """``kaisoku bench NAME [--quick] [--out DIR] [--strict] [--allow-dirty] [--mnist PATH]``.

    Returns the exit code: 0, or 1 under ``--strict`` when a goal is not met.
    """
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
    info = start_run(argv, quick=args.quick, mnist=mnist, case=args.case)
    if info.tree.dirty:
        print(
            f"kaisoku bench: the tree is dirty; recording diff sha256 {info.tree.diff_sha256}",
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

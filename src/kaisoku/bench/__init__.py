"""Benchmarks behind ``kaisoku bench NAME``.

Each benchmark module exposes ``run(quick: bool, out_dir: Path) -> dict`` that measures, prints a
table, writes ``<out_dir>/<name>.json`` (and a PNG where a picture helps) and returns the record.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from kaisoku.errors import ConfigError

#: Benchmark name -> module under ``kaisoku.bench``.
BENCHMARKS: dict[str, str] = {
    "engine": "kaisoku.bench.engine",
    "loader": "kaisoku.bench.loader",
    "optim": "kaisoku.bench.optim",
    "largebatch": "kaisoku.bench.largebatch",
    "parallel": "kaisoku.bench.parallel",
    "kfac": "kaisoku.bench.kfac",
}


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

"""Byte sizes: one parser and one formatter, with one meaning everywhere in kaisoku.

``KiB/MiB/GiB/TiB`` and the bare ``K/M/G/T`` are powers of 1024 (as Slurm's ``--mem=16G`` and ``df -h``
read them); ``kB/MB/GB/TB`` are powers of 1000. Case does not matter, so ``"16G"`` and ``"16g"`` are both
16 GiB, and ``"16GB"`` is 16 * 10^9 bytes.
"""

from __future__ import annotations

import math
import re

from kaisoku.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """A byte count from an int or a string such as ``"64MiB"``, ``"2GiB"``, ``"1.5G"``, ``"500MB"``, ``"0"``.

    Raises :class:`ConfigError` (one line, with an example) on anything else or a negative size.
    """
    if isinstance(text, bool):
        raise ConfigError(f"not a byte size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"a byte size cannot be negative: {text}")
        return int(text)
    match = _SIZE.match(str(text).replace("_", ""))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"not a byte size: {text!r}; write a number with an optional unit, e.g. 64MiB, 2GiB, 500MB"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ConfigError(f"not a byte size: {text!r}")
    return int(round(value))


def format_bytes(size: int) -> str:
    """A byte count for humans, in binary units: ``"64.0 MiB"``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")

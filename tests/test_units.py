"""Byte sizes: one parser, one meaning (binary for bare K/M/G/T)."""

from __future__ import annotations

import pytest

from kaisoku.errors import ConfigError
from kaisoku.units import format_bytes, parse_bytes


def test_bare_and_binary_units_are_powers_of_1024_decimal_ones_of_1000() -> None:
    assert parse_bytes("16G") == 16 * 2**30
    assert parse_bytes("16g") == parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("0GiB") == parse_bytes("0") == 0


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

"""The user's parts named by import path (:mod:`kaisoku.parts`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kaisoku.errors import ConfigError
from kaisoku.parts import load_object


def test_import_path_finds_a_module_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As under ``python -m kaisoku``, also from the ``kaisoku`` console script (whose sys.path lacks the
    working directory)."""
    (tmp_path / "kaisoku_parts_here.py").write_text("def factory() -> int:\n    return 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.delitem(sys.modules, "kaisoku_parts_here", raising=False)
    assert load_object("kaisoku_parts_here:factory", "model.name")() == 7
    assert sys.path[-1] == os.getcwd()  # after everything installed: shadows nothing


def test_import_path_of_a_missing_module_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="^model.name: cannot import kaisoku_no_such_module "):
        load_object("kaisoku_no_such_module:net", "model.name")

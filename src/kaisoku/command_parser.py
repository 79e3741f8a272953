"""The argument parser of every ``kaisoku`` command: a usage error is one line and exits 2."""

from __future__ import annotations

import argparse

from kaisoku.errors import ConfigError


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise :class:`~kaisoku.errors.ConfigError` (one line, exit 2)
    instead of printing the usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Raise the usage error as a ConfigError prefixed with the command's name."""
        raise ConfigError(f"{self.prog}: {message}")

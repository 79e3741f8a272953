"""Errors that kaisoku reports to users as one line, without a traceback."""


class KaisokuError(Exception):
    """A user-facing error: bad input, a missing file, a mismatched configuration.

    The command line prints ``str(error)`` on one line and exits with ``exit_code``.
    """

    exit_code: int = 1


class ConfigError(KaisokuError):
    """A wrong preset, config key, override or value: exit code 2, as for a usage error."""

    exit_code = 2


class DamagedDataError(KaisokuError):
    """Damaged data: a packed dataset's index that contradicts itself, a checkpoint whose content checksums
    differ. Exit code 3, as ``kaisoku train`` gives for damaged data."""

    exit_code = 3

"""The slow shared file system of ``kaisoku bench slowfs`` and ``kaisoku bench plan``: the benchmark's data
folder served over sshfs from the storage host of a two-host :class:`~kaisoku.testing.cluster.ClusterBox`
(:class:`~kaisoku.testing.sshfs.SshfsMount`), mounted where the benchmark's processes read it.

Each link setting caps the storage host's link in both directions with a token bucket (20 ms queue) and
holds every chunk in the delay proxy for the setting's one-way delay; the page cache is dropped before
every epoch by the callers (:func:`kaisoku.plan.probe.drop_caches`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from kaisoku.plan.probe import can_drop_caches
from kaisoku.testing import cluster, sshfs

_CLIENT, _STORAGE = 0, 1
"""The box's hosts: the one whose link the mount's ssh uses, and the one sshd serves the folder from."""


@dataclass(frozen=True)
class LinkSetting:
    """One link configuration: rate cap in bit/s and the proxy's hold per direction in seconds."""

    rate_bits: int
    delay: float

    @property
    def rate_bytes(self) -> float:
        """The cap in bytes per second."""
        return self.rate_bits / 8.0

    def label(self) -> str:
        """e.g. ``1Gbit/s, RTT+2ms``."""
        rate = (
            f"{self.rate_bits / 1e9:g}Gbit/s" if self.rate_bits >= 1e9 else f"{self.rate_bits / 1e6:g}Mbit/s"
        )
        return f"{rate}, RTT+{2 * self.delay * 1e3:g}ms"


def unavailable_reason() -> str | None:
    """Why the slow-file-system setup cannot run here (None when it can)."""
    reason = cluster.unavailable_reason() or sshfs.unavailable_reason()
    if reason is None and not can_drop_caches():
        reason = "/proc/sys/vm/drop_caches is not writable"
    return reason


class SlowMount:
    """``served`` mounted at :attr:`mount` through sshfs over the capped, delayed link of a two-host box.

    Use as a context manager; :meth:`configure` sets the link (rate cap, proxy delay) and (re)mounts when
    the delay changes. Leaving it (or SIGTERM, or the process's exit) unmounts and removes the box.
    """

    def __init__(self, served: Path, *, timeout: float = 60.0) -> None:
        self.served = Path(served).resolve()
        self.timeout = timeout
        self._setting: LinkSetting | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SlowMount:
        with contextlib.ExitStack() as stack:
            self.box = stack.enter_context(cluster.ClusterBox(2))
            self.share = stack.enter_context(
                sshfs.SshfsMount(
                    self.box, self.served, storage=_STORAGE, client=_CLIENT, timeout=self.timeout
                )
            )
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def mount(self) -> Path:
        """Where the served folder is mounted."""
        return self.share.mount

    def configure(self, setting: LinkSetting) -> None:
        """Apply ``setting``: the rate cap at once; a new delay restarts the proxy and remounts."""
        if self._setting is None or self._setting.rate_bits != setting.rate_bits:
            link = cluster.Link(rate_mbit=setting.rate_bits / 1e6, queue_ms=20.0)
            self.box.reshape(_STORAGE, link)
        if self._setting is None or self._setting.delay != setting.delay:
            self.share.remount(setting.delay)
        self._setting = setting

    def path(self, local: Path) -> Path:
        """Where ``local`` (a path under the served directory) appears through the mount."""
        return self.share.path(local)


def sequential_read_seconds(path: Path, chunk: int = 8 << 20) -> tuple[float, int]:
    """Seconds and bytes of one sequential read of ``path`` in ``chunk``-sized reads (the stager's pattern)."""
    start = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while data := handle.read(chunk):
            total += len(data)
    return time.perf_counter() - start, total

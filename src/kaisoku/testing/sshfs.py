"""A folder served over sshfs from a storage host of a :class:`~kaisoku.testing.cluster.ClusterBox`, mounted
in this process's mount namespace: a slow shared file system on one machine (root only).

Topology (inside the box; the box removes all of it when it closes)::

    client host (box host c)                          storage host (box host s)
      ssh (spawned by sshfs) -- eth0 --- bridge --- eth0 :2222+c  delay proxy (:func:`serve_proxy`)
                                                                  |
                                                            127.0.0.1:22000+c  sshd (internal-sftp)

``sshfs`` itself runs in this process's mount namespace, so the mount is visible to this process and its
children (a benchmark's readers); only its ``ssh`` child lives on the client host, so every byte read
crosses the box's link between the two hosts (shaped by :meth:`ClusterBox.reshape`). Kernels without netem
cannot delay a link, so the round-trip latency comes from :class:`DelayLine`: the proxy stamps every chunk
it receives with a release time ``arrival + D`` and a separate sender thread forwards chunks when they are
due. The stream stays pipelined: a chunk that arrives while an earlier one waits is held for D from its own
arrival, not after the earlier one's release.

The served folder is any folder of this machine (the storage host sees the machine's file system), read
through the mount with ``dir_cache=no`` (sshfs's attribute and name cache off).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from kaisoku.testing.cluster import ClusterBox

_PROXY_PORT = 2222
_SSHD_PORT = 22000
_CHUNK = 256 * 1024
_SSHD = Path("/usr/sbin/sshd")


# ------------------------------------------------------------------------------------------------ delay line


class DelayLine:
    """Chunks held for ``delay`` seconds each, released in arrival order at ``arrival + delay``.

    Pure bookkeeping (the caller supplies the clock): :meth:`push` stamps a chunk, :meth:`pop_due` hands
    out every chunk whose release time has come. Release times never decrease, so the head is always the
    next one due; a chunk's wait does not add to the chunks behind it.
    """

    def __init__(self, delay: float) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay}")
        self.delay = float(delay)
        self._chunks: collections.deque[tuple[float, bytes]] = collections.deque()
        self._last_release = float("-inf")

    def __len__(self) -> int:
        return len(self._chunks)

    def push(self, chunk: bytes, now: float) -> float:
        """Hold ``chunk`` that arrived at ``now``; return its release time."""
        release = max(now + self.delay, self._last_release)  # a clock step back must not reorder
        self._last_release = release
        self._chunks.append((release, chunk))
        return release

    def next_release(self) -> float | None:
        """Release time of the head chunk, or None when empty."""
        return self._chunks[0][0] if self._chunks else None

    def pop_due(self, now: float) -> list[bytes]:
        """Every chunk due at ``now``, in arrival order (consecutive due chunks leave together)."""
        out: list[bytes] = []
        while self._chunks and self._chunks[0][0] <= now:
            out.append(self._chunks.popleft()[1])
        return out


class _Pump:
    """One direction of a proxied connection: a receiver thread feeds a DelayLine, a sender drains it."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        self.src, self.dst = src, dst
        self.line = DelayLine(delay)
        self.cond = threading.Condition()
        self.eof = False
        self.threads = [
            threading.Thread(target=self._receive, daemon=True),
            threading.Thread(target=self._send, daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _receive(self) -> None:
        try:
            while chunk := self.src.recv(_CHUNK):
                with self.cond:
                    self.line.push(chunk, time.monotonic())
                    self.cond.notify()
        except OSError:
            pass
        with self.cond:
            self.eof = True
            self.cond.notify()

    def _send(self) -> None:
        try:
            while True:
                with self.cond:
                    while True:
                        head = self.line.next_release()
                        if head is None:
                            if self.eof:
                                self.dst.shutdown(socket.SHUT_WR)
                                return
                            self.cond.wait()
                            continue
                        wait = head - time.monotonic()
                        if wait <= 0:
                            chunks = self.line.pop_due(time.monotonic())
                            break
                        self.cond.wait(wait)
                self.dst.sendall(b"".join(chunks))
        except OSError:
            pass


def serve_proxy(server: socket.socket, target: tuple[str, int], delay: float) -> None:
    """Accept connections on the listening ``server`` socket and relay each to ``target``, ``delay`` seconds
    per direction (runs until the process ends)."""
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection(target)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _Pump(client, upstream, delay)
        _Pump(upstream, client, delay)


# ----------------------------------------------------------------------------------------------- the mount


def unavailable_reason() -> str | None:
    """Why a folder cannot be served over sshfs here (None when it can), beside the box's own reasons."""
    missing = [tool for tool in ("sshfs", "ssh", "ssh-keygen", "fusermount3") if shutil.which(tool) is None]
    if not _SSHD.exists():
        missing.append("sshd")
    if missing:
        return f"missing {', '.join(missing)}: apt-get install openssh-server openssh-client sshfs"
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse (FUSE is needed for sshfs)"
    return None


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=30)


class SshfsMount:
    """``served`` served by sshd on host ``storage`` of ``box`` and mounted at :attr:`mount` through sshfs,
    whose ssh runs on host ``client``.

    Use as a context manager (inside the box's): :meth:`remount` (re)starts the delay proxy with a
    delay and mounts; :meth:`close` unmounts and stops sshfs, the proxy and sshd. ``timeout``: seconds a
    helper may take to start listening or to mount.
    """

    def __init__(
        self, box: ClusterBox, served: Path, *, storage: int, client: int, timeout: float = 60.0
    ) -> None:
        self.box = box
        self.served = Path(served).resolve()
        self.storage, self.client = storage, client
        self.timeout = timeout
        # One sshd and proxy per (storage, client) pair: several hosts may mount from one storage host.
        self.work = box.folder / f"sshfs-h{storage}-c{client}"
        self.sshd_port, self.proxy_port = _SSHD_PORT + client, _PROXY_PORT + client
        self.mount = self.work / "mnt"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._closed = False
        self._owner = os.getpid()  # forked children (DataLoader workers) inherit this object: never theirs

    @property
    def _address(self) -> str:
        return self.box.members[self.storage].address

    def __enter__(self) -> SshfsMount:
        try:
            self.work.mkdir()
            self._start_sshd()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmount and stop every helper; safe to call twice; a no-op in forked children."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        self._unmount()
        for name in ("proxy", "sshd"):
            self._stop(name)

    def _stop(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def _log(self, name: str) -> IO[bytes]:
        return open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the helper

    def _start_sshd(self) -> None:
        key, host_key = self.work / "client_key", self.work / "host_key"
        for path in (key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
        (self.work / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        config = self.work / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress 127.0.0.1:{self.sshd_port}",
                    f"HostKey {host_key}",
                    f"PidFile {self.work / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.work / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "UseDNS no",
                    "Subsystem sftp internal-sftp",
                    "LogLevel ERROR",
                    "",
                ]
            )
        )
        self._procs["sshd"] = self.box.popen(
            self.storage,
            [str(_SSHD), "-D", "-e", "-f", str(config)],
            cwd="/",
            stdout=subprocess.DEVNULL,
            stderr=self._log("sshd"),
        )
        self.box.wait_listening(self.storage, "127.0.0.1", self.sshd_port, what="sshd", timeout=self.timeout)

    def _start_proxy(self, delay: float) -> None:
        self._stop("proxy")
        argv = [
            sys.executable, "-m", "kaisoku.testing.sshfs", "proxy",
            "--listen", f"{self._address}:{self.proxy_port}", "--target", f"127.0.0.1:{self.sshd_port}",
            "--delay-ms", str(delay * 1e3),
        ]  # fmt: skip
        self._procs["proxy"] = self.box.popen(
            self.storage,
            argv,
            cwd="/",
            stdout=subprocess.DEVNULL,
            stderr=self._log("proxy"),
        )
        self.box.wait_listening(
            self.client, self._address, self.proxy_port, what="the delay proxy", timeout=self.timeout
        )

    def remount(self, delay: float) -> None:
        """(Re)mount with the proxy holding every chunk ``delay`` seconds per direction."""
        self._unmount()
        self._start_proxy(delay)
        self.mount.mkdir(exist_ok=True)
        ssh = " ".join(self.box.command(self.client, ["ssh"], cwd="/"))
        argv = [
            "sshfs", f"root@{self._address}:{self.served}", str(self.mount), "-f",
            "-p", str(self.proxy_port),
            "-o", f"ssh_command={ssh}",
            "-o", "dir_cache=no",
            "-o", f"IdentityFile={self.work / 'client_key'}",
            "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null",
            "-o", "Ciphers=aes128-gcm@openssh.com",
            "-o", "Compression=no",
            "-o", "LogLevel=ERROR",
            "-o", "ro",
        ]  # fmt: skip
        self._procs["sshfs"] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self._log("sshfs"))
        deadline = time.monotonic() + self.timeout
        while not os.path.ismount(self.mount):
            if self._procs["sshfs"].poll() is not None or time.monotonic() > deadline:
                log = (self.work / "sshfs.log").read_text(errors="replace").strip()
                raise RuntimeError(f"sshfs did not mount {self.served}: {log[-500:]}")
            time.sleep(0.05)

    def _unmount(self) -> None:
        if os.path.ismount(self.mount) and _run(["fusermount3", "-u", str(self.mount)]).returncode != 0:
            _run(["umount", "-l", str(self.mount)])
        self._stop("sshfs")

    def path(self, local: Path) -> Path:
        """Where ``local`` (a path under the served folder) appears through the mount."""
        return self.mount / Path(local).resolve().relative_to(self.served)


# ---------------------------------------------------------------------------------------------------- CLI


def _address_arg(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kaisoku.testing.sshfs proxy --listen H:P --target H:P --delay-ms D``."""
    parser = argparse.ArgumentParser(prog="python -m kaisoku.testing.sshfs")
    sub = parser.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy", help="relay TCP connections, holding each chunk D ms per direction")
    proxy.add_argument("--listen", type=_address_arg, required=True)
    proxy.add_argument("--target", type=_address_arg, required=True)
    proxy.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve_proxy(socket.create_server(args.listen), args.target, args.delay_ms / 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A slow shared file system on one machine, for ``kaisoku bench loader`` part (b).

Topology (all of it created here and removed on every exit path)::

    client namespace kzc<pid>                      server namespace kzs<pid>
      ssh (spawned by sshfs) -- veth 10.99.0.1 ---- veth 10.99.0.2:2222  delay proxy (this module)
      tbf rate cap on egress                        tbf rate cap on egress        |
                                                                         127.0.0.1:22  sshd (internal-sftp)

``sshfs`` itself runs in this process's mount namespace, so the mount is visible to the benchmark's
processes; only its ``ssh`` child lives in the client namespace. Each direction of the veth is capped by a
token bucket (``tc ... tbf``). This kernel has no netem, so the round-trip latency comes from
:class:`DelayLine`: the proxy stamps every chunk it receives with a release time ``arrival + D`` and a
separate sender thread forwards chunks when they are due. The stream stays pipelined: a chunk that arrives
while an earlier one waits is held for D from its own arrival, not after the earlier one's release.

The served directory is the benchmark's own data folder (both namespaces see the same file system), read
through the mount with ``dir_cache=no`` (sshfs's attribute and name cache off) and the page cache dropped
before every epoch by the caller (:func:`drop_caches`).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_CLIENT_ADDR = "10.99.0.1"
_SERVER_ADDR = "10.99.0.2"
_PREFIX_LEN = 30
_PROXY_PORT = 2222
_SSHD_PORT = 22
_CHUNK = 256 * 1024
_NS_NAME = re.compile(r"^kz[cs](\d+)$")
_DIR_PREFIX = "kaisoku-slowfs-"


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


# --------------------------------------------------------------------------------------------- availability


def _run(cmd: Sequence[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=timeout)


def unavailable_reason() -> str | None:
    """Why the slow-file-system setup cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, drop_caches, FUSE mounts)"
    missing = [tool for tool in ("ip", "tc", "sshfs", "ssh", "ssh-keygen") if shutil.which(tool) is None]
    if not Path("/usr/sbin/sshd").exists():
        missing.append("sshd")
    if missing:
        return f"missing {', '.join(missing)}: apt-get install openssh-server openssh-client sshfs iproute2"
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse (FUSE is needed for sshfs)"
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return "/proc/sys/vm/drop_caches is not writable"
    probe = f"kzs{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except (subprocess.SubprocessError, OSError) as error:
        return f"cannot create a network namespace ({_stderr(error)})"
    try:
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
              "rate", "1gbit", "burst", "128kb", "latency", "50ms"])  # fmt: skip
    except (subprocess.SubprocessError, OSError) as error:
        return f"tc tbf is not available ({_stderr(error)})"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _stderr(error: BaseException) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        return (
            (error.stderr or str(error)).strip().splitlines()[-1]
            if (error.stderr or "").strip()
            else str(error)
        )
    return str(error)


def drop_caches() -> None:
    """Flush dirty pages and drop the page cache, dentries and inodes (``echo 3 > drop_caches``)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as handle:
        handle.write("3\n")


def drop_caches_together(rank: int) -> None:
    """Every rank of the process group waits while rank 0 drops the page cache, so that all of them start
    the next timed epoch cold and at once."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        drop_caches()
    dist.barrier()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove namespaces and mounts this module left behind in runs whose process is gone."""
    removed: list[str] = []
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2].startswith("fuse") and _DIR_PREFIX in parts[1]:
            match = re.search(_DIR_PREFIX + r"(\d+)-", parts[1])
            if match and not _pid_alive(int(match.group(1))):
                _run(["umount", "-l", parts[1]], check=False)
                removed.append(parts[1])
    listing = _run(["ip", "netns", "list"], check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace(name)
            removed.append(name)
    return removed


def _kill_namespace(name: str) -> None:
    pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", name], check=False)


# ------------------------------------------------------------------------------------------------ the setup


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


class SlowMount:
    """``served`` mounted at :attr:`mount` through sshfs over a capped, delayed veth between two namespaces.

    Use as a context manager; :meth:`configure` sets the link (rate cap, proxy delay) and (re)mounts when
    the delay changes. :meth:`close` (also run at exit and on SIGTERM) unmounts, stops sshfs, the proxy and
    sshd, and deletes the namespaces.
    """

    def __init__(self, served: Path, *, log: Callable[[str], None] = print) -> None:
        self.served = Path(served).resolve()
        self.log = log
        pid = os.getpid()
        self.client_ns, self.server_ns = f"kzc{pid}", f"kzs{pid}"
        self.client_dev, self.server_dev = f"kzv{pid}c", f"kzv{pid}s"
        self.work = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{pid}-"))
        self.mount = self.work / "mnt"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._setting: LinkSetting | None = None
        self._closed = False
        self._previous_sigterm: object = None
        self._owner = os.getpid()  # forked children (DataLoader workers) inherit this object: never theirs

    # -- lifecycle

    def __enter__(self) -> SlowMount:
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            remove_stale()
            self._create_network()
            self._start_sshd()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if os.getpid() != self._owner:
            os._exit(128 + signum)  # a forked child being stopped: the setup is not its to remove
        self.close()
        raise SystemExit(128 + signum)

    def close(self) -> None:
        """Tear everything down; safe to call twice; a no-op in forked children."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        self._unmount()
        for name in ("proxy", "sshd"):
            self._stop(name)
        for ns in (self.client_ns, self.server_ns):
            _kill_namespace(ns)
        _run(["ip", "link", "del", self.client_dev], check=False)
        shutil.rmtree(self.work, ignore_errors=True)
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]
        atexit.unregister(self.close)

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

    # -- network

    def _ns(self, ns: str, *cmd: str) -> None:
        _run(["ip", "netns", "exec", ns, *cmd])

    def _create_network(self) -> None:
        for ns in (self.client_ns, self.server_ns):
            _run(["ip", "netns", "add", ns])
            self._ns(ns, "ip", "link", "set", "lo", "up")
        _run(["ip", "link", "add", self.client_dev, "netns", self.client_ns, "type", "veth",
              "peer", "name", self.server_dev, "netns", self.server_ns])  # fmt: skip
        for ns, dev, addr in (
            (self.client_ns, self.client_dev, _CLIENT_ADDR),
            (self.server_ns, self.server_dev, _SERVER_ADDR),
        ):
            self._ns(ns, "ip", "addr", "add", f"{addr}/{_PREFIX_LEN}", "dev", dev)
            self._ns(ns, "ip", "link", "set", dev, "up")

    def _set_rate(self, rate_bits: int) -> None:
        # Bucket of ~1 ms at the rate (at least 64 KiB, so a GSO segment fits); a short queue.
        burst = max(64 * 1024, int(rate_bits / 8 / 1000))
        for ns, dev in ((self.client_ns, self.client_dev), (self.server_ns, self.server_dev)):
            self._ns(ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", str(rate_bits),
                     "burst", str(burst), "latency", "20ms")  # fmt: skip

    # -- ssh

    def _start_sshd(self) -> None:
        key = self.work / "client_key"
        host_key = self.work / "host_key"
        for path in (key, host_key):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)])
        (self.work / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        config = self.work / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress 127.0.0.1:{_SSHD_PORT}",
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
        self._procs["sshd"] = subprocess.Popen(
            ["ip", "netns", "exec", self.server_ns, "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.work / "sshd.log", "wb"),  # noqa: SIM115 - lives as long as sshd
        )
        self._wait_port(self.server_ns, "127.0.0.1", _SSHD_PORT, "sshd")

    def _wait_port(self, ns: str, host: str, port: int, what: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        probe = f"import socket; socket.create_connection(('{host}', {port}), 1).close()"
        while time.monotonic() < deadline:
            if _run(["ip", "netns", "exec", ns, sys.executable, "-c", probe], check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not start listening on {host}:{port} in namespace {ns}")

    def _start_proxy(self, delay: float) -> None:
        self._stop("proxy")
        self._procs["proxy"] = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.server_ns,
                sys.executable,
                "-m",
                "kaisoku.bench.netfs",
                "proxy",
                "--listen",
                f"{_SERVER_ADDR}:{_PROXY_PORT}",
                "--target",
                f"127.0.0.1:{_SSHD_PORT}",
                "--delay-ms",
                str(delay * 1e3),
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=open(self.work / "proxy.log", "ab"),  # noqa: SIM115 - lives as long as the proxy
        )
        self._wait_port(self.client_ns, _SERVER_ADDR, _PROXY_PORT, "the delay proxy")

    def _mount(self) -> None:
        self.mount.mkdir(exist_ok=True)
        ssh = f"ip netns exec {self.client_ns} ssh"
        cmd = [
            "sshfs", f"root@{_SERVER_ADDR}:{self.served}", str(self.mount), "-f",
            "-p", str(_PROXY_PORT),
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
        self._procs["sshfs"] = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=open(self.work / "sshfs.log", "ab"),  # noqa: SIM115 - lives as long as sshfs
        )
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mount):
            if self._procs["sshfs"].poll() is not None or time.monotonic() > deadline:
                log = (self.work / "sshfs.log").read_text(errors="replace").strip()
                raise RuntimeError(f"sshfs did not mount {self.served}: {log[-500:]}")
            time.sleep(0.05)

    def _unmount(self) -> None:
        if os.path.ismount(self.mount):
            if _run(["fusermount3", "-u", str(self.mount)], check=False).returncode != 0:
                _run(["umount", "-l", str(self.mount)], check=False)
        self._stop("sshfs")

    # -- public

    def configure(self, setting: LinkSetting) -> None:
        """Apply ``setting``: the rate cap at once; a new delay restarts the proxy and remounts."""
        if self._setting is None or self._setting.delay != setting.delay:
            self._unmount()
            self._start_proxy(setting.delay)
            self._set_rate(setting.rate_bits)
            self._mount()
        elif self._setting.rate_bits != setting.rate_bits:
            self._set_rate(setting.rate_bits)
        self._setting = setting

    def path(self, local: Path) -> Path:
        """Where ``local`` (a path under the served directory) appears through the mount."""
        return self.mount / Path(local).resolve().relative_to(self.served)


def sequential_read_seconds(path: Path, chunk: int = 8 << 20) -> tuple[float, int]:
    """Seconds and bytes of one sequential read of ``path`` in ``chunk``-sized reads (the stager's pattern)."""
    start = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while data := handle.read(chunk):
            total += len(data)
    return time.perf_counter() - start, total


# ---------------------------------------------------------------------------------------------------- CLI


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kaisoku.bench.netfs proxy --listen H:P --target H:P --delay-ms D``."""
    parser = argparse.ArgumentParser(prog="python -m kaisoku.bench.netfs")
    sub = parser.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy", help="relay TCP connections, holding each chunk D ms per direction")
    proxy.add_argument("--listen", type=_address, required=True)
    proxy.add_argument("--target", type=_address, required=True)
    proxy.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve_proxy(socket.create_server(args.listen), args.target, args.delay_ms / 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A cluster in a box: N hosts on one Linux machine, for tests and ``kaisoku bench cluster`` (root only).

Topology (all of it created here and removed by :meth:`ClusterBox.close` on every exit path)::

    switch namespace kb<pid>x<n>sw: bridge br0
      |-- port p0 --veth-- eth0 10.213.0.1  host namespace kb<pid>x<n>h0 (hostname kbox-node0)
      |-- port p1 --veth-- eth0 10.213.0.2  host namespace kb<pid>x<n>h1 (hostname kbox-node1)
      ...

Each host has a network namespace (its own ``eth0`` on the bridge, its own loopback), and a persistent
mount and UTS namespace in which ``/dev/shm`` and the node-local disk (:attr:`ClusterBox.local_dir`, the
same path on every host, as on a real cluster) are private tmpfs mounts, ``/etc/hosts`` names every host,
and the shared data is a read-only bind of one folder (:attr:`ClusterBox.shared_dir`). Every other path
(the run folder, say) is the machine's own, which plays the shared, writable home file system.

Links are shaped with ``tc``: a token bucket (``tbf``) caps each direction of a host's port, and a delay
uses ``netem`` where the kernel has it (a box asked for a delay on a kernel without it is refused with
the reason). Traffic between ranks of one host stays on its loopback, unshaped: slower across hosts than
within, as on a cluster.

Shared storage is a read-only bind mount, not a file server in a storage namespace: NFS needs the
kernel's ``nfsd`` and NFS client, which kernels built without them (``CONFIG_NFSD``, ``CONFIG_NFS_FS``)
cannot have whatever userspace package is installed; the shared reads therefore do not cross the shaped
links. Where they must, :mod:`kaisoku.testing.sshfs` serves a folder from one host of the box over sshfs
(FUSE, no kernel file server), and :meth:`ClusterBox.reshape` sets that host's link between measurements.

Names carry this process's pid, so that :func:`remove_stale` can remove what a killed test left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ROOT = Path("/run/kaisoku-box")
_NAME = re.compile(r"^kb(\d+)x(\d+)(sw|h\d+)$")
_SUBNET = "10.213.0"
_SEQUENCE = itertools.count()
_TOOLS = ("ip", "tc", "unshare", "nsenter", "mount", "umount")


class BoxUnavailable(RuntimeError):
    """The box cannot be built on this machine; the message says why (tests skip with it)."""


@dataclass(frozen=True)
class Link:
    """The shaping of one host's link to the switch, applied to each direction."""

    rate_mbit: float = 0.0
    """Bandwidth cap in Mbit/s; 0: uncapped."""
    delay_ms: float = 0.0
    """One-way delay added in each direction (needs netem); a round trip between two hosts adds four."""
    queue_ms: float = 50.0
    """The longest a packet waits in the token bucket's queue before it is dropped (``tbf latency``)."""


@dataclass(frozen=True)
class Host:
    """One host of the box."""

    index: int
    name: str
    """Its hostname (resolvable on every host of the box)."""
    address: str
    """Its address on the bridge."""
    netns: str
    """Its network namespace (``ip netns``)."""
    mount_ns: Path
    uts_ns: Path


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


def _failure(error: BaseException) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        text = (error.stderr or "").strip() or str(error)
        return f"{' '.join(map(str, error.cmd))}: {text.splitlines()[-1]}"
    return str(error)


def unavailable_reason() -> str | None:
    """Why a box cannot be built here (None when it can): not Linux, not root, tools or kernel missing."""
    if not sys.platform.startswith("linux"):
        return "the cluster in a box needs Linux (network and mount namespaces)"
    if os.geteuid() != 0:
        return "the cluster in a box needs root (network and mount namespaces, tc)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the cluster in a box needs {', '.join(missing)}: apt-get install iproute2 util-linux mount"
    probe = f"kbprobe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except (subprocess.SubprocessError, OSError) as error:
        return f"cannot create a network namespace here ({_failure(error)})"
    try:
        _run(["ip", "-n", probe, "link", "add", "b0", "type", "bridge"])
        _run(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "v0", "root", "tbf",
              "rate", "100mbit", "burst", "64kb", "latency", "20ms"])  # fmt: skip
    except (subprocess.SubprocessError, OSError) as error:
        return f"bridges, veth pairs or tc tbf are missing here ({_failure(error)})"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (link delay)."""
    probe = f"kbnetem{os.getpid()}"
    if _run(["ip", "netns", "add", probe], check=False).returncode != 0:
        return False
    try:
        result = _run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "netem",
                "delay",
                "1ms",
            ],
            check=False,
        )
        return result.returncode == 0
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    listing = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.split()]


def _netns_pids(netns: str) -> list[int]:
    return [int(pid) for pid in _run(["ip", "netns", "pids", netns], check=False).stdout.split()]


def _mounts_under(folder: Path) -> list[str]:
    """Mount points at or below ``folder`` in this process's mount namespace, deepest first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(folder) or point.startswith(f"{folder}/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def _kill_netns(netns: str, *, rounds: int = 50) -> int:
    """SIGKILL every process in ``netns`` until none is left (bounded); the number killed."""
    killed: set[int] = set()
    for _ in range(rounds):
        pids = _netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.1)
    return len(killed)


def remove_stale() -> list[str]:
    """Remove namespaces, mounts and folders of boxes whose process is gone; what was removed."""
    removed: list[str] = []
    for name in _netns_names():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_netns(name)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    if _ROOT.is_dir():
        for folder in _ROOT.iterdir():
            match = re.match(r"^(\d+)x\d+$", folder.name)
            if match and not _pid_alive(int(match.group(1))):
                for point in _mounts_under(folder):
                    _run(["umount", "-l", point], check=False)
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(str(folder))
    return removed


@dataclass
class ClusterBox:
    """``hosts`` hosts on a bridge; use as a context manager (or call :meth:`close`).

    Args:
        hosts: number of hosts (1 to 200).
        shared: a folder every host sees read-only at :attr:`shared_dir`; None: none.
        link: the shaping of every host's link, or a ``{host index: Link}`` for hosts that differ
            (unlisted hosts are unshaped).
        local_size, shm_size: sizes of each host's node-local disk and ``/dev/shm`` (tmpfs ``size=``).
    """

    hosts: int
    shared: Path | None = None
    link: Link | Mapping[int, Link] = field(default_factory=Link)
    local_size: str = "256m"
    shm_size: str = "256m"
    members: list[Host] = field(init=False, default_factory=list)
    _procs: list[subprocess.Popen[Any]] = field(init=False, default_factory=list)
    _reshaped: dict[int, Link] = field(init=False, default_factory=dict)
    _previous_sigterm: Any = field(init=False, default=None)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"a box has 1 to 200 hosts, not {self.hosts}")
        self.tag = f"kb{os.getpid()}x{next(_SEQUENCE)}"
        self.folder = _ROOT / self.tag[2:]
        self.switch = f"{self.tag}sw"
        self._owner = os.getpid()

    # ------------------------------------------------------------------------------------------ paths

    @property
    def local_dir(self) -> Path:
        """The node-local disk: the same path on every host, a private tmpfs on each."""
        return self.folder / "local"

    @property
    def shared_dir(self) -> Path:
        """Where every host sees the shared folder, read-only."""
        return self.folder / "shared"

    def link_of(self, index: int) -> Link:
        """The shaping of host ``index``'s link (as :meth:`reshape` last set it)."""
        if index in self._reshaped:
            return self._reshaped[index]
        if isinstance(self.link, Link):
            return self.link
        return self.link.get(index, Link())

    # ------------------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> ClusterBox:
        reason = unavailable_reason()
        if reason is not None:
            raise BoxUnavailable(reason)
        if any(self.link_of(i).delay_ms > 0 for i in range(self.hosts)) and not netem_available():
            raise BoxUnavailable("link delay needs the kernel's netem qdisc, which this kernel lacks")
        # A box stopped by SIGTERM (a timeout, say) or left at exit is torn down all the same.
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            remove_stale()
            self._build()
        except BaseException as error:
            self.close()
            if isinstance(error, (subprocess.SubprocessError, OSError)):
                raise BoxUnavailable(f"could not build the box: {_failure(error)}") from error
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if os.getpid() != self._owner:
            os._exit(128 + signum)  # a forked child (a loader's worker) being stopped: not its box
        self.close()
        raise SystemExit(128 + signum)

    def _build(self) -> None:
        self.folder.mkdir(parents=True)
        # A private mount of its own, so the namespace files bound into it never propagate elsewhere.
        _run(["mount", "--bind", str(self.folder), str(self.folder)])
        _run(["mount", "--make-private", str(self.folder)])
        for sub in (self.local_dir, self.shared_dir):
            sub.mkdir()
        _run(["ip", "netns", "add", self.switch])
        _run(["ip", "-n", self.switch, "link", "set", "lo", "up"])
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        hosts_file = self.folder / "hosts"
        self.members = [
            Host(
                index=i,
                name=f"kbox-node{i}",
                address=f"{_SUBNET}.{i + 1}",
                netns=f"{self.tag}h{i}",
                mount_ns=self.folder / f"h{i}.mnt",
                uts_ns=self.folder / f"h{i}.uts",
            )
            for i in range(self.hosts)
        ]
        hosts_file.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.members)
        )
        resolv = self.folder / "resolv.conf"
        # No name server is reachable from the box: an unknown name fails at once instead of waiting.
        resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        for host in self.members:
            self._add_host(host, hosts_file, resolv)

    def _add_host(self, host: Host, hosts_file: Path, resolv: Path) -> None:
        ns, port = host.netns, f"p{host.index}"
        _run(["ip", "netns", "add", ns])
        _run(
            [
                "ip",
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
            ]
        )
        _run(["ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        for step in (["link", "set", "lo", "up"], ["link", "set", "eth0", "up"]):
            _run(["ip", "-n", ns, *step])
        _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
        _run(["ip", "-n", self.switch, "link", "set", port, "up"])
        link = self.link_of(host.index)
        self._shape(ns, "eth0", link)
        self._shape(self.switch, port, link)
        for path in (host.mount_ns, host.uts_ns):
            path.touch()
        mounts = [
            f"hostname {host.name}",
            f"mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm",
            f"mount -t tmpfs -o size={self.local_size},mode=1777 tmpfs {self.local_dir}",
            f"mount --bind {hosts_file} /etc/hosts",
            f"mount --bind {resolv} /etc/resolv.conf",
        ]
        if self.shared is not None:
            mounts += [
                f"mount --bind {Path(self.shared).resolve()} {self.shared_dir}",
                f"mount -o remount,bind,ro {self.shared_dir}",
            ]
        _run(
            ["unshare", f"--mount={host.mount_ns}", f"--uts={host.uts_ns}", "--propagation", "private",
             "sh", "-ec", "; ".join(mounts)]
        )  # fmt: skip

    def reshape(self, host: int, link: Link) -> None:
        """Shape host ``host``'s link as ``link`` from now on, both directions (its queues are emptied)."""
        member = self.members[host]
        if link.delay_ms > 0 and not netem_available():
            raise BoxUnavailable("link delay needs the kernel's netem qdisc, which this kernel lacks")
        for netns, device in ((member.netns, "eth0"), (self.switch, f"p{host}")):
            _run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", device, "root"], check=False)
            self._shape(netns, device, link)
        self._reshaped[host] = link

    def _shape(self, netns: str, device: str, link: Link) -> None:
        tc = ["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", device]
        parent = ["root"]
        if link.delay_ms > 0:
            _run([*tc, "root", "handle", "1:", "netem", "delay", f"{link.delay_ms}ms", "limit", "10000"])
            parent = ["parent", "1:"]
        if link.rate_mbit > 0:
            rate_bits = int(link.rate_mbit * 1e6)
            # A bucket of ~1 ms at the rate (at least 64 KiB, so a segment of offloaded TCP fits).
            burst = max(64 * 1024, rate_bits // 8 // 1000)
            _run([*tc, *parent, "handle", "2:", "tbf", "rate", str(rate_bits), "burst", str(burst),
                  "latency", f"{link.queue_ms:g}ms"])  # fmt: skip

    def close(self) -> None:
        """Kill every process in the box and remove its namespaces, mounts and folder; safe to call twice."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        for host in self.members:
            _kill_netns(host.netns)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for host in self.members:
            _run(["ip", "netns", "del", host.netns], check=False)
        _kill_netns(self.switch)
        _run(["ip", "netns", "del", self.switch], check=False)
        if self.folder.exists():
            for point in _mounts_under(self.folder):
                _run(["umount", point], check=False)
            shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            _ROOT.rmdir()  # only when no other box is left
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """What of this box still exists (namespaces, mounts, folder, processes); empty after close."""
        left = [name for name in _netns_names() if name.startswith(self.tag)]
        left += [f"mount {point}" for point in _mounts_under(self.folder)]
        if self.folder.exists():
            left.append(f"folder {self.folder}")
        left += [f"process {proc.pid}" for proc in self._procs if proc.poll() is None]
        return left

    # ---------------------------------------------------------------------------------------- running

    def command(
        self, host: int, argv: Sequence[str], *, cwd: Path | str | None = None, mount: bool = True
    ) -> list[str]:
        """``argv`` as a command that runs on host ``host`` (in its network, mount and UTS namespaces;
        ``mount=False``: its network only, seeing this machine's mounts, such as a host's sshfs mount)."""
        member = self.members[host]
        where = Path(cwd) if cwd is not None else Path.cwd()
        own = [f"--mount={member.mount_ns}", f"--uts={member.uts_ns}"] if mount else []
        return ["nsenter", f"--net=/run/netns/{member.netns}", *own, f"--wd={where}", "--", *argv]

    def popen(
        self,
        host: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        mount: bool = True,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``host`` (``mount`` as in :meth:`command`); :meth:`close` kills it if it
        still runs."""
        command = self.command(host, argv, cwd=cwd, mount=mount)
        proc = subprocess.Popen(command, env=dict(env or os.environ), **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, host: int, argv: Sequence[str], *, timeout: float = 60, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on host ``host`` to completion (output captured, not checked)."""
        return subprocess.run(
            self.command(host, argv),
            env=dict(env or os.environ),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def wait_listening(self, host: int, address: str, port: int, *, what: str, timeout: float = 15.0) -> None:
        """Return once ``address:port`` accepts a connection from host ``host``; raise RuntimeError naming
        ``what`` after ``timeout`` seconds."""
        probe = (
            "import socket, sys, time\n"
            f"deadline = time.monotonic() + {timeout}\n"
            "while time.monotonic() < deadline:\n"
            "    try:\n"
            f"        socket.create_connection(({address!r}, {port}), 1).close(); sys.exit(0)\n"
            "    except OSError: time.sleep(0.1)\n"
            "sys.exit(1)\n"
        )
        if self.run(host, [sys.executable, "-c", probe], timeout=timeout + 30).returncode != 0:
            raise RuntimeError(
                f"{what} did not start listening on {address}:{port} (seen from {self.members[host].name}) "
                f"within {timeout:g} s"
            )

    def pids(self, host: int) -> list[int]:
        """The processes running on host ``host``."""
        return _netns_pids(self.members[host].netns)

    def kill_host(self, host: int) -> int:
        """Lose host ``host``: SIGKILL every process on it at once; the number killed."""
        return _kill_netns(self.members[host].netns)

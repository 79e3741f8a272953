"""The cluster in a box: private disks, /dev/shm and hostnames per host, a read-only shared folder, shaped
links, connectivity over the bridge, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kaisoku.testing.cluster import BoxUnavailable, ClusterBox, Link, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture
def box(tmp_path: Path) -> Iterator[ClusterBox]:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("on the shared file system\n")
    with ClusterBox(2, shared=shared, link=Link(rate_mbit=200)) as built:
        yield built
    assert built.leftovers() == []


def _sh(box: ClusterBox, host: int, script: str) -> subprocess.CompletedProcess[str]:
    return box.run(host, ["sh", "-c", script], timeout=30)


@pytest.mark.timeout(120)
def test_hosts_have_their_own_name_disk_and_shm(box: ClusterBox) -> None:
    names = [_sh(box, i, "hostname").stdout.strip() for i in range(2)]
    assert names == ["kbox-node0", "kbox-node1"]
    assert _sh(box, 0, f"echo zero > {box.local_dir}/mine && echo zero > /dev/shm/kbox-mine").returncode == 0
    assert _sh(box, 0, f"cat {box.local_dir}/mine /dev/shm/kbox-mine").stdout.split() == ["zero", "zero"]
    # Neither the other host nor the machine itself sees host 0's node-local files.
    assert _sh(box, 1, f"ls {box.local_dir}; ls /dev/shm/kbox-mine").stdout.strip() == ""
    assert not (box.local_dir / "mine").exists()
    assert not Path("/dev/shm/kbox-mine").exists()


@pytest.mark.timeout(120)
def test_shared_folder_is_read_only_on_every_host(box: ClusterBox) -> None:
    for host in range(2):
        assert _sh(box, host, f"cat {box.shared_dir}/data.txt").stdout == "on the shared file system\n"
        written = _sh(box, host, f"touch {box.shared_dir}/new")
        assert written.returncode != 0 and "Read-only" in written.stderr


@pytest.mark.timeout(120)
def test_hosts_reach_each_other_by_name_over_shaped_links(box: ClusterBox) -> None:
    server = (
        "import socket; s = socket.create_server(('0.0.0.0', 29777)); c, a = s.accept(); "
        "c.sendall(socket.gethostname().encode()); c.close()"
    )
    listening = box.popen(0, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    client = (
        "import socket, time\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        c = socket.create_connection(('kbox-node0', 29777), 2); break\n"
        "    except OSError: time.sleep(0.1)\n"
        "print(c.recv(100).decode(), c.getpeername()[0])\n"
    )
    answer = box.run(1, [sys.executable, "-c", client], timeout=60)
    assert answer.stdout.split() == ["kbox-node0", "10.213.0.1"], answer.stderr
    listening.wait(30)
    qdiscs = _sh(box, 1, "tc qdisc show dev eth0").stdout
    assert "tbf" in qdiscs and "200Mbit" in qdiscs
    box.reshape(1, Link(rate_mbit=50, queue_ms=20))
    assert box.link_of(1) == Link(rate_mbit=50, queue_ms=20) and box.link_of(0) == Link(rate_mbit=200)
    qdiscs = _sh(box, 1, "tc qdisc show dev eth0").stdout
    assert "50Mbit" in qdiscs and "200Mbit" not in qdiscs and "lat 20ms" in qdiscs


@pytest.mark.timeout(120)
def test_close_kills_processes_and_removes_everything(tmp_path: Path) -> None:
    box = ClusterBox(2)
    with box:
        sleeper = box.popen(1, ["sleep", "300"])
        assert sleeper.pid in box.pids(1)  # nsenter execs the command in place
        assert box.kill_host(1) >= 1
        assert box.pids(1) == []
        box.popen(0, ["sleep", "300"])
        assert box.pids(0)
    assert box.leftovers() == []
    assert sleeper.poll() is not None


@pytest.mark.timeout(60)
def test_delay_without_netem_is_refused_with_the_reason() -> None:
    from kaisoku.testing.cluster import netem_available

    if netem_available():
        with ClusterBox(2, link=Link(delay_ms=1)) as box:
            assert "netem" in _sh(box, 0, "tc qdisc show dev eth0").stdout
        assert box.leftovers() == []
    else:
        with pytest.raises(BoxUnavailable, match="netem"), ClusterBox(2, link=Link(delay_ms=1)):
            pass

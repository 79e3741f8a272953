"""A folder served over sshfs from a storage host of a cluster in a box: the delay proxy's release-time
scheduling and loopback relay (no root needed), and a real mount over a shaped link (root)."""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path

import pytest

from kaisoku.testing.cluster import ClusterBox, Link, unavailable_reason
from kaisoku.testing.sshfs import DelayLine, SshfsMount, serve_proxy
from kaisoku.testing.sshfs import unavailable_reason as sshfs_unavailable_reason

MOUNT_REASON = unavailable_reason() or sshfs_unavailable_reason()


def test_each_chunk_is_held_from_its_own_arrival() -> None:
    line = DelayLine(0.001)
    assert line.push(b"a", 10.0) == pytest.approx(10.001)
    assert line.push(b"b", 10.0005) == pytest.approx(10.0015)  # pipelined: not 10.002
    assert line.pop_due(10.0009) == []
    assert line.pop_due(10.0012) == [b"a"]
    assert line.next_release() == pytest.approx(10.0015)
    assert line.pop_due(10.0015) == [b"b"]
    assert line.next_release() is None and len(line) == 0


def test_due_chunks_leave_together_in_arrival_order() -> None:
    line = DelayLine(0.002)
    for k, now in enumerate((1.0, 1.0001, 1.0002)):
        line.push(bytes([k]), now)
    assert line.pop_due(5.0) == [b"\x00", b"\x01", b"\x02"]


def test_zero_delay_releases_at_arrival_and_order_survives_a_clock_step_back() -> None:
    line = DelayLine(0.0)
    assert line.push(b"x", 3.0) == 3.0
    assert line.pop_due(3.0) == [b"x"]
    held = DelayLine(0.001)
    first = held.push(b"1", 2.0)
    second = held.push(b"2", 1.5)  # a clock that stepped back must not put "2" before "1"
    assert second >= first
    assert held.pop_due(second) == [b"1", b"2"]


def test_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay"):
        DelayLine(-0.001)


def _echo_once(server: socket.socket) -> None:
    conn, _ = server.accept()
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


@pytest.mark.timeout(30)
def test_proxy_relays_a_stream_intact_in_both_directions() -> None:
    echo = socket.create_server(("127.0.0.1", 0))
    proxy = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_echo_once, args=(echo,), daemon=True).start()
    threading.Thread(target=serve_proxy, args=(proxy, echo.getsockname(), 0.001), daemon=True).start()
    payload = bytes(range(256)) * 4096  # 1 MiB, many chunks in flight
    with socket.create_connection(proxy.getsockname()) as client:
        sender = threading.Thread(target=lambda: (client.sendall(payload), client.shutdown(socket.SHUT_WR)))
        sender.start()
        received = bytearray()
        while chunk := client.recv(65536):
            received += chunk
        sender.join(10)
    assert bytes(received) == payload


@pytest.mark.skipif(MOUNT_REASON is not None, reason=MOUNT_REASON or "")
@pytest.mark.timeout(180)
def test_served_folder_reads_through_the_shaped_link_and_nothing_is_left(tmp_path: Path) -> None:
    served = tmp_path / "served"
    (served / "sub").mkdir(parents=True)
    payload = bytes(range(256)) * 2048  # 512 KiB
    (served / "sub" / "data.bin").write_bytes(payload)
    with ClusterBox(2) as box, SshfsMount(box, served, storage=1, client=0) as share:
        box.reshape(1, Link(rate_mbit=300, queue_ms=20))
        share.remount(0.001)
        seen = share.path(served / "sub" / "data.bin")
        assert seen.parent.parent == share.mount and seen.read_bytes() == payload
        with pytest.raises(OSError):
            (share.mount / "new").write_bytes(b"x")  # mounted read-only
        # The bytes came from the storage host's eth0, through its token bucket at the asked rate.
        stats = box.run(1, ["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout
        assert "300Mbit" in stats and "latency 20ms" in stats.replace("lat ", "latency ")
        sent = int(stats.split("Sent ")[1].split()[0])
        assert sent > len(payload)
        share.remount(0.0)  # a new delay: the proxy restarts and the folder is mounted again
        assert seen.read_bytes() == payload
    assert box.leftovers() == []
    mounts = subprocess.run(["cat", "/proc/mounts"], capture_output=True, text=True).stdout
    assert str(share.mount) not in mounts

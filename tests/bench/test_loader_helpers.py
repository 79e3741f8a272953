"""The delay proxy of the slow-file-system benchmark: release-time scheduling and a loopback relay."""

from __future__ import annotations

import socket
import threading

import pytest

from kaisoku.bench.netfs import DelayLine, serve_proxy


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

"""The router's HTTP/2 framing and its limits (its behaviour under load is tested against real Triton in
test_local_runtime)."""

from __future__ import annotations

import asyncio
import json
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, free_base_port
from tritonctl.deploy.router import GOAWAY, HEADER, HEADERS, PREFACE, Router, goaway_frame, parse_header
from tritonctl.deploy.runtime import http_ok, put_json

SETTINGS = HEADER.pack((0 << 8) | 0x4, 0, 0)  # an empty SETTINGS frame: what a server sends first


def test_frame_headers_parse_and_goaway_names_the_last_stream():
    head = HEADER.pack((16384 << 8) | HEADERS, 0x5, 0x80000000 | 7)  # the reserved bit set on the stream id
    assert parse_header(head) == (16384, HEADERS, 0x5, 7)
    frame = goaway_frame(41)
    assert parse_header(frame[:9]) == (8, GOAWAY, 0, 0)
    assert struct.unpack(">II", frame[9:]) == (41, 0)  # last stream 41, NO_ERROR


def test_a_port_that_cannot_be_bound_leaves_no_route(tmp_path):
    """The router refuses the route (OSError to the caller) and keeps nothing that would claim the port."""

    async def scenario() -> None:
        router = Router("127.0.0.1", tmp_path / "routes.json")
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", 0))
            squatter.listen()
            port = squatter.getsockname()[1]
            with pytest.raises(OSError):
                await router.set_backends(port, ["127.0.0.1:1"])
        assert router.describe() == {}
        assert await router.set_backends(port, []) == {"port": port, "backends": [], "drained": 0, "timed_out": 0}

    asyncio.run(scenario())


class _Backend(socketserver.BaseRequestHandler):
    """An HTTP/2 server's first words (SETTINGS), then it reads until the connection ends, counting bytes."""

    received = 0

    def handle(self) -> None:
        self.request.sendall(SETTINGS)
        while chunk := self.request.recv(1 << 16):
            _Backend.received += len(chunk)


def _client(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(PREFACE)
    return sock


def _closed(sock: socket.socket) -> bool:
    """Whether the router closed the connection without sending anything (a reset counts)."""
    try:
        return sock.recv(9) == b""
    except ConnectionResetError:
        return True


def _frames_until_closed(sock: socket.socket) -> list[int]:
    """The types of the frames that arrive until the router closes the connection."""
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    types, pos = [], 0
    while pos + 9 <= len(data):
        length, ftype, _, _ = parse_header(data, pos)
        types.append(ftype)
        pos += 9 + length
    return types


@pytest.fixture
def limited_router(tmp_path):
    """A router process with small limits, one route to a backend that speaks first; (route port, process)."""
    backend = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Backend)
    backend.daemon_threads = True
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    control = free_base_port(2)
    route = control + 1
    router = subprocess.Popen(
        [sys.executable, "-m", "tritonctl.deploy.router", "--control-port", str(control),
         "--routes", str(tmp_path / "r.json"), "--max-connections", "3", "--idle-timeout", "2", "--max-frame", "16384"],
        cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not http_ok(f"http://127.0.0.1:{control}/routes"):
        assert time.monotonic() < deadline and router.poll() is None, "the router did not start"
        time.sleep(0.05)
    ok, answer = put_json(f"http://127.0.0.1:{control}/routes/{route}", {"backends": [
        f"127.0.0.1:{backend.server_address[1]}"]}, 10)  # fmt: skip
    assert ok, answer
    yield route, router
    router.terminate()
    router.wait()
    backend.shutdown()


def test_connections_over_the_limit_are_closed_before_a_backend_is_dialled(limited_router):
    route, router = limited_router
    held = [_client(route) for _ in range(3)]
    for sock in held:
        assert sock.recv(9) == SETTINGS  # forwarded from the backend
    extra = _client(route)
    began = time.monotonic()
    assert _closed(extra) and time.monotonic() - began < 2  # closed at once, nothing forwarded
    held.pop().close()
    time.sleep(0.3)
    with _client(route) as again:
        assert again.recv(9) == SETTINGS  # a freed slot serves again
    for sock in held:
        sock.close()
    router.terminate()
    assert "connection(s) refused" in router.communicate(timeout=10)[1]


def test_an_idle_connection_is_sent_goaway_and_closed(limited_router):
    route, _ = limited_router
    with _client(route) as sock:
        began = time.monotonic()
        assert _frames_until_closed(sock) == [0x4, GOAWAY]
        assert 2 <= time.monotonic() - began < 6


def test_a_headers_frame_over_the_limit_ends_its_connection(limited_router):
    route, _ = limited_router
    with _client(route) as sock:
        assert sock.recv(9) == SETTINGS
        sock.sendall(HEADER.pack((((1 << 24) - 1) << 8) | HEADERS, 0, 1) + b"x" * 1000)  # announces 16 MiB
        began = time.monotonic()
        assert _closed(sock) and time.monotonic() - began < 2


def test_a_large_data_frame_is_passed_on_as_it_arrives(limited_router):
    """A DATA frame far over the limit is legal HTTP/2 (gRPC raises the frame size): the router forwards
    its start before the rest exists, so it never holds the frame."""
    route, _ = limited_router
    with _client(route) as sock:
        assert sock.recv(9) == SETTINGS
        _Backend.received = 0
        sock.sendall(HEADER.pack((8 << 20) << 8, 0, 1) + b"x" * (2 << 20))  # 2 of its 8 MiB
        deadline = time.monotonic() + 5
        while _Backend.received < (2 << 20) + 9:  # the header and what came of the payload
            assert time.monotonic() < deadline, f"only {_Backend.received} bytes passed on"
            time.sleep(0.01)


def test_a_control_request_that_never_ends_is_answered_408(tmp_path):
    """A slow control client is cut off after the timeout, and the router goes on answering."""
    from tritonctl.deploy.local import ROUTER_FILE, LocalRuntime

    runtime = LocalRuntime(None, tmp_path)
    try:
        runtime.route("127.0.0.1", free_base_port(1), [])
        port = json.loads((tmp_path / ROUTER_FILE).read_text())["control_port"]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"PUT /routes/20000 HTTP/1.1\r\nContent-Length: 10\r\n\r\n")  # and never the body
            assert slow.recv(64).startswith(b"HTTP/1.1 408")
        assert runtime.router_ok()
    finally:
        runtime.shutdown()

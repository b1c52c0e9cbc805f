"""The router's HTTP/2 framing (its behaviour under load is tested against real Triton in test_local_runtime)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from tritonctl.router import GOAWAY, HEADER, HEADERS, Router, goaway_frame, parse_header


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

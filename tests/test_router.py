"""The router's HTTP/2 framing (its behaviour under load is tested against real Triton in test_local_runtime)."""

from __future__ import annotations

import struct

from tritonctl.router import GOAWAY, HEADER, HEADERS, goaway_frame, parse_header


def test_frame_headers_parse_and_goaway_names_the_last_stream():
    head = HEADER.pack((16384 << 8) | HEADERS, 0x5, 0x80000000 | 7)  # the reserved bit set on the stream id
    assert parse_header(head) == (16384, HEADERS, 0x5, 7)
    frame = goaway_frame(41)
    assert parse_header(frame[:9]) == (8, GOAWAY, 0, 0)
    assert struct.unpack(">II", frame[9:]) == (41, 0)  # last stream 41, NO_ERROR

"""The router: one stable gRPC address per model in front of its Triton instances.

Why it exists: on SIGTERM Triton unloads its models first and closes its gRPC endpoint
last, so requests on a client's open connection to an instance being stopped fail with
"unknown model" (measured with `--reuse-grpc-port`: docs/architecture.md, "The router").
A gRPC client only moves to another server when its connection ends, and Triton offers no
way to end connections without unloading. The router ends them the HTTP/2 way instead.

It forwards bytes between clients and instances, reading HTTP/2 frame headers (never the
headers' content) to know which streams (RPCs) are open. Switching a model to new
backends sends new connections there at once; every connection to a backend that left the
set is drained: at the next frame boundary the router sends the client a GOAWAY naming the
last stream it forwarded, drops anything the client opens after it (gRPC clients retry
such refused streams on a new connection, transparently), waits for the forwarded streams
to finish and closes. The old instance can then be stopped with nothing in flight.

Run as `python -m tritonctl.deploy.router --host H --control-port P --routes FILE`: model ports
listen on H, the control endpoint on P of `--control-host` (127.0.0.1 unless given: it has no
authentication). It takes `PUT /routes/<port>` with {"backends": ["host:port", ...]} and answers
once the connections to removed backends have drained, with what it did. Ports are 1024-65535
and backends are on this machine (127.0.0.1, localhost or H); anything else is answered 400.
Routes are saved to FILE, so a restarted router serves the same addresses.

Limits (`Limits`, each a flag): at most `--max-connections` client connections at once (one
more is closed before a backend connection is opened for it); a connection that carries no
frame either way for `--idle-timeout` seconds is drained (GOAWAY, then closed); a frame
other than DATA announcing more than `--max-frame` bytes ends its connection, and DATA
frames are passed on as they arrive, so no connection holds more than a read. A control
request must arrive whole within 5 seconds, with at most 64 header lines. The open-files
limit is raised to its hard limit, and the connection limit kept under it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http
import itertools
import json
import resource
import signal
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tritonctl.files import write_json_atomic

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADER = struct.Struct(">I B I")  # length (24 bits) and type packed in the first 4 bytes, flags, stream id
DATA, HEADERS, RST_STREAM, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x0, 0x1, 0x3, 0x7, 0x8, 0x9
END_STREAM, END_HEADERS = 0x1, 0x4
DRAIN_TIMEOUT_S = 30.0
PORTS = range(1024, 65536)  # what a route or a backend may use
MAX_BODY = 1 << 16  # bytes of a control request's body
READ_SIZE = 1 << 18  # bytes asked of a connection per read
CONTROL_TIMEOUT_S = 5.0  # a control request must arrive whole within this
MAX_CONTROL_HEADERS = 64
IDLE_DRAIN_S = 5.0  # an idle connection's streams (if any) get this long to finish after its GOAWAY


@dataclass(frozen=True)
class Limits:
    """What one client may hold of the router."""

    max_connections: int = 512
    idle_timeout_s: float = 300.0
    max_frame: int = 1 << 20  # a frame other than DATA (headers, settings); DATA is passed on in pieces


class FrameTooLarge(ConnectionError):
    """A peer sent a frame header announcing more than the limit: its connection ends."""


def parse_header(raw: bytes, offset: int = 0) -> tuple[int, int, int, int]:
    """(payload length, type, flags, stream id) of the 9-byte HTTP/2 frame header at `offset` of `raw`."""
    length_type, flags, stream = HEADER.unpack_from(raw, offset)
    return length_type >> 8, length_type & 0xFF, flags, stream & 0x7FFFFFFF


def window_update_frame(increment: int) -> bytes:
    """A connection-level WINDOW_UPDATE giving back `increment` bytes of flow-control window."""
    return HEADER.pack((4 << 8) | WINDOW_UPDATE, 0, 0) + struct.pack(">I", increment)


def goaway_frame(last_stream: int) -> bytes:
    """A GOAWAY (NO_ERROR) telling the client that streams above `last_stream` were not processed."""
    return HEADER.pack((8 << 8) | GOAWAY, 0, 0) + struct.pack(">II", last_stream, 0)


@dataclass(eq=False)
class Connection:
    """One client connection and its backend connection."""

    backend: str
    client_w: asyncio.StreamWriter
    backend_w: asyncio.StreamWriter
    open_streams: set[int] = field(default_factory=set)
    max_stream: int = 0
    last_stream: int | None = None  # set once a GOAWAY went out: streams above it are dropped
    server_started: asyncio.Event = field(default_factory=asyncio.Event)  # the server's preface went out
    to_client: asyncio.Lock = field(default_factory=asyncio.Lock)  # frames to the client go out whole
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    active: float = field(default_factory=time.monotonic)  # when a frame last went either way
    idle: bool = False  # drained for idleness (once)

    def settle(self) -> None:
        if self.last_stream is not None and not self.open_streams:
            self.drained.set()


async def _pump(coroutine) -> None:
    """Run one direction of a connection; a closed or reset side just ends it."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, OSError):
        await coroutine


async def _frames(reader: asyncio.StreamReader, max_frame: int):
    """What each read brings, cut at frame boundaries: lists of pieces (bytes, type, flags, stream id,
    whether the piece starts its frame, whether it ends it).

    A frame other than DATA comes whole, once all of it has arrived; one announcing more than
    `max_frame` bytes raises FrameTooLarge at its header. A DATA frame is passed on as it
    arrives, in pieces: gRPC raises the frame size as a connection's bandwidth estimate grows
    (one 602 KB DATA frame per demo ResNet18 request was seen), up to HTTP/2's 16 MiB, and a
    connection then holds no more than a read, READ_SIZE, whatever the client announces.

    Reading what has arrived, up to READ_SIZE, rather than frame by frame, takes a few reads per
    request: 1.2 ms of the router's CPU per demo request instead of 1.4 (`bench/router_overhead.py`)."""
    pending = b""  # the start of a frame whose header or (not DATA) payload has not all arrived
    passing: tuple[int, int, int, int] | None = None  # a DATA frame in pieces: type, flags, stream, bytes left
    while True:
        chunk = await reader.read(READ_SIZE)
        if not chunk:
            raise asyncio.IncompleteReadError(pending, None)
        data = pending + chunk if pending else chunk
        pieces, pos = [], 0
        if passing is not None:
            ftype, flags, stream, left = passing
            pos = min(left, len(data))
            pieces.append((data[:pos], ftype, flags, stream, False, pos == left))
            passing = None if pos == left else (ftype, flags, stream, left - pos)
        while passing is None and len(data) - pos >= 9:
            length, ftype, flags, stream = parse_header(data, pos)
            end = pos + 9 + length
            if end <= len(data):
                pieces.append((data[pos:end], ftype, flags, stream, True, True))
                pos = end
            elif ftype == DATA:
                pieces.append((data[pos:], ftype, flags, stream, True, False))
                passing, pos = (ftype, flags, stream, end - len(data)), len(data)
            elif length > max_frame:
                raise FrameTooLarge(f"a frame of {length} bytes, over the limit of {max_frame}")
            else:
                break
        pending = data[pos:]
        if pieces:
            yield pieces


async def _client_to_backend(conn: Connection, reader: asyncio.StreamReader, max_frame: int) -> None:
    conn.backend_w.write(await reader.readexactly(len(PREFACE)))
    async for pieces in _frames(reader, max_frame):
        conn.active = time.monotonic()
        for piece, ftype, _, stream, first, _ in pieces:
            if conn.last_stream is not None and stream > conn.last_stream:
                # Opened after our GOAWAY: refused, the client retries it elsewhere. Its DATA still
                # counted against the connection's flow-control window: give that back.
                payload = len(piece) - 9 * first
                if ftype == DATA and payload:
                    async with conn.to_client:
                        conn.client_w.write(window_update_frame(payload))
                continue
            if first and ftype == HEADERS and stream not in conn.open_streams and stream > conn.max_stream:
                conn.open_streams.add(stream)
                conn.max_stream = stream
            elif ftype == RST_STREAM:
                conn.open_streams.discard(stream)
                conn.settle()
            conn.backend_w.write(piece)  # at once, not after the batch: an RST_STREAM goes out before its drain closes
        await conn.backend_w.drain()


async def _backend_to_client(conn: Connection, reader: asyncio.StreamReader, max_frame: int) -> None:
    """Forward frames; a frame in pieces and a header block (HEADERS and its CONTINUATIONs) go out
    without a GOAWAY inside them, and a stream ends only once its last frame is complete."""
    ending: int | None = None  # the stream a header block in progress ends, if it does
    inside = False  # the last piece forwarded leaves a frame or a header block open
    held = False  # the client side's lock: held from a read's first piece to its last, across open frames and blocks
    try:
        async for pieces in _frames(reader, max_frame):
            conn.active = time.monotonic()
            if not held:
                await conn.to_client.acquire()
                held = True
            ended = []
            for piece, ftype, flags, stream, _, last in pieces:
                conn.client_w.write(piece)
                in_block = ftype in (HEADERS, CONTINUATION) and not flags & END_HEADERS
                inside = not last or in_block
                if not last:
                    continue
                if (ftype in (DATA, HEADERS) and flags & END_STREAM) or ftype == RST_STREAM:
                    ending = stream
                if ending is not None and not in_block:
                    ended.append(ending)
                    ending = None
            await conn.client_w.drain()
            if not inside:
                conn.to_client.release()
                held = False
            conn.server_started.set()
            if ended:
                conn.open_streams.difference_update(ended)
                conn.settle()
    finally:
        if held:
            conn.to_client.release()


async def drain(conn: Connection, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """GOAWAY the client, wait for its forwarded streams to finish, close; whether it finished in time."""

    async def goaway_then_wait() -> None:
        await conn.server_started.wait()  # a GOAWAY must not precede the server's SETTINGS
        if not conn.drained.is_set():
            async with conn.to_client:
                conn.last_stream = conn.max_stream
                conn.client_w.write(goaway_frame(conn.last_stream))
                await conn.client_w.drain()
            conn.settle()
        await conn.drained.wait()

    try:
        await asyncio.wait_for(goaway_then_wait(), timeout_s)
        return True
    except (TimeoutError, ConnectionError, OSError):
        return False
    finally:
        conn.client_w.close()
        conn.backend_w.close()


def _port(text: str, what: str) -> int:
    port = int(text) if text.isdigit() else -1
    if port not in PORTS:
        raise ValueError(f"{what} {text!r} is not a port in {PORTS.start}-{PORTS.stop - 1}")
    return port


def parse_route(path: str, body: bytes, local_hosts: set[str]) -> tuple[int, list[str]]:
    """The port and backends of a `PUT /routes/<port>` request; ValueError (one line) for anything else:
    a port outside PORTS, a backend not `host:port` with its host in `local_hosts`."""
    port = _port(path.removeprefix("/routes/"), "route port")
    try:
        backends = json.loads(body)["backends"]
    except (ValueError, TypeError, KeyError):
        raise ValueError('the body must be JSON {"backends": ["host:port", ...]}') from None
    if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
        raise ValueError('"backends" must be a list of "host:port"')
    for backend in backends:
        host, _, backend_port = backend.rpartition(":")
        if host not in local_hosts:
            raise ValueError(f"backend {backend!r} is not on {' or '.join(sorted(local_hosts))}")
        _port(backend_port, f"backend {backend!r}:")
    return port, backends


@dataclass(eq=False)
class Route:
    port: int
    backends: list[str]
    connections: set[Connection] = field(default_factory=set)
    server: asyncio.Server | None = None
    turn: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> str | None:
        return self.backends[next(self.turn) % len(self.backends)] if self.backends else None


class Router:
    def __init__(self, host: str, routes_file: Path, limits: Limits = Limits()):
        self.host = host
        self.routes_file = routes_file
        self.limits = limits
        self.routes: dict[int, Route] = {}
        self.clients = 0  # client connections open now, on every route
        self.refused = 0  # client connections closed at once for the connection limit, since the last report
        self.reported = 0.0  # when the refusals were last written to the log

    async def restore(self) -> None:
        """Serve the saved routes again; a port that cannot be bound is reported and left out."""
        if self.routes_file.exists():
            for port, backends in json.loads(self.routes_file.read_text()).items():
                try:
                    await self.set_backends(int(port), backends)
                except OSError as exc:
                    print(f"router: cannot listen on port {port} again: {exc}", file=sys.stderr, flush=True)

    def _save(self) -> None:
        write_json_atomic(self.routes_file, {str(p): r.backends for p, r in self.routes.items()})

    async def _connect(self, route: Route) -> tuple[str, asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to one of the route's backends that is still one once connected (a switch may
        happen while connecting), None when there is none."""
        for _ in range(3):
            backend = route.pick()
            if backend is None:
                return None
            host, port = backend.rsplit(":", 1)
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                continue
            if backend in route.backends:
                return backend, reader, writer
            writer.close()
        return None

    def _refuse(self, client_w: asyncio.StreamWriter) -> None:
        """Close a client connection over the limit; say so in the log at most every 10 seconds."""
        client_w.close()
        self.refused += 1
        if time.monotonic() - self.reported >= 10:
            print(
                f"router: {self.refused} connection(s) refused: {self.clients} open, "
                f"the limit is {self.limits.max_connections}",
                file=sys.stderr,
                flush=True,
            )
            self.refused, self.reported = 0, time.monotonic()

    async def _serve(self, route: Route, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.clients >= self.limits.max_connections:
            self._refuse(client_w)
            return
        self.clients += 1
        try:
            await self._forward(route, client_r, client_w)
        finally:
            self.clients -= 1

    async def _forward(self, route: Route, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        connected = await self._connect(route)
        if connected is None:
            client_w.close()
            return
        backend, backend_r, backend_w = connected
        conn = Connection(backend, client_w, backend_w)
        route.connections.add(conn)
        pumps = [
            asyncio.create_task(_pump(_client_to_backend(conn, client_r, self.limits.max_frame))),
            asyncio.create_task(_pump(_backend_to_client(conn, backend_r, self.limits.max_frame))),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            route.connections.discard(conn)
            conn.open_streams.clear()
            conn.server_started.set()  # a drain waiting on a connection that ended goes through
            conn.drained.set()
            client_w.close()
            backend_w.close()

    async def set_backends(self, port: int, backends: list[str]) -> dict:
        """Route `port` to `backends` (none: close the listener); drain connections to removed ones."""
        route = self.routes.get(port)
        if route is None:
            if not backends:
                return {"port": port, "backends": [], "drained": 0, "timed_out": 0}
            route = Route(port, [])
            route.server = await asyncio.start_server(  # raises OSError when the port is taken: no route kept
                lambda r, w: self._serve(route, r, w), self.host, port, reuse_address=True
            )
            self.routes[port] = route
        removed = set(route.backends) - set(backends)
        route.backends = list(backends)
        leaving = [c for c in route.connections if c.backend in removed]
        if not backends:
            route.server.close()
            del self.routes[port]
        self._save()
        results = await asyncio.gather(*(drain(c) for c in leaving))
        return {"port": port, "backends": backends, "drained": sum(results), "timed_out": len(results) - sum(results)}

    async def close_idle(self) -> None:
        """Every second: drain the connections that carried no frame for the idle timeout."""
        draining: set[asyncio.Task] = set()
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for route in list(self.routes.values()):
                for conn in list(route.connections):
                    if now - conn.active > self.limits.idle_timeout_s and not conn.idle:
                        conn.idle = True
                        task = asyncio.create_task(drain(conn, IDLE_DRAIN_S))
                        draining.add(task)
                        task.add_done_callback(draining.discard)

    def describe(self) -> dict:
        return {
            str(p): {"backends": r.backends, "connections": [c.backend for c in r.connections]}
            for p, r in sorted(self.routes.items())
        }

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A minimal HTTP/1.1 control endpoint: GET /routes, PUT /routes/<port>."""
        try:
            method, path, body = await asyncio.wait_for(_read_request(reader), CONTROL_TIMEOUT_S)
            if method == "GET" and path == "/routes":
                status, answer = 200, self.describe()
            elif method == "PUT" and path.startswith("/routes/"):
                port, backends = parse_route(path, body, {"127.0.0.1", "localhost", self.host})
                status, answer = 200, await self.set_backends(port, backends)
            else:
                status, answer = 404, {"error": f"no such endpoint: {method} {path}"}
        except TimeoutError:
            status, answer = 408, {"error": f"the request did not arrive whole within {CONTROL_TIMEOUT_S:g} s"}
        except (ValueError, KeyError, IndexError, TypeError, OSError, EOFError) as exc:
            status, answer = 400, {"error": " ".join(str(exc).split()) or type(exc).__name__}
        payload = json.dumps(answer).encode()
        writer.write(
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + payload
        )
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    """Method, path and body of one HTTP/1.1 request; ValueError for one over the limits."""
    method, path = (await reader.readline()).decode().split()[:2]
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        if len(headers) == MAX_CONTROL_HEADERS:
            raise ValueError(f"more than {MAX_CONTROL_HEADERS} header lines")
        key, _, value = line.decode().partition(":")
        headers[key.strip().lower()] = value.strip()
    length = int(headers.get("content-length", 0))
    if not 0 <= length <= MAX_BODY:
        raise ValueError(f"Content-Length {length} is not 0-{MAX_BODY}")
    return method, path, await reader.readexactly(length)


def raise_open_files(limits: Limits) -> Limits:
    """Raise the open-files limit to its hard limit; the limits with the connection limit under it
    (each client connection holds two descriptors, its own and its backend's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        soft = 1 << 16 if hard == resource.RLIM_INFINITY else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fits = max(1, (soft - 64) // 2)
    if limits.max_connections > fits:
        print(f"router: at most {fits} connections fit the open-files limit of {soft}", file=sys.stderr, flush=True)
        return Limits(fits, limits.idle_timeout_s, limits.max_frame)
    return limits


async def run(
    host: str, control_port: int, routes_file: Path, control_host: str = "127.0.0.1", limits: Limits = Limits()
) -> None:
    router = Router(host, routes_file, raise_open_files(limits))
    await router.restore()
    control = await asyncio.start_server(router.control, control_host, control_port, reuse_address=True)
    reaper = asyncio.create_task(router.close_idle())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with control:
        await stop.wait()
    reaper.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description="tritonctl's per-model gRPC router (started by `tritonctl apply`)")
    parser.add_argument("--host", default="127.0.0.1", help="address of the model ports (clients connect here)")
    parser.add_argument(
        "--control-host", default="127.0.0.1", help="address of the control endpoint (no authentication)"
    )
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--routes", type=Path, required=True, help="routes file (read at start, written on change)")
    default = Limits()
    parser.add_argument(
        "--max-connections", type=int, default=default.max_connections, help="client connections at once, all ports"
    )
    parser.add_argument(
        "--idle-timeout", type=float, default=default.idle_timeout_s, help="seconds without a frame before a drain"
    )
    parser.add_argument("--max-frame", type=int, default=default.max_frame, help="largest HTTP/2 frame but DATA, bytes")
    args = parser.parse_args()
    limits = Limits(args.max_connections, args.idle_timeout, args.max_frame)
    asyncio.run(run(args.host, args.control_port, args.routes, args.control_host, limits))


if __name__ == "__main__":
    main()

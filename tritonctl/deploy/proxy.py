"""HAProxy in front of every model: one stable gRPC address per model, balanced per request.

One HAProxy (master-worker) serves a deployment: a frontend per model on the model's port
(HTTP/2 without TLS, as gRPC clients speak it) and a backend per model with a server per
placement, weighted as the plan says (`balance`), sending gRPC over HTTP/2 to the instance's own gRPC port
and health-checked on its Triton HTTP ready endpoint. Its configuration is rendered from the
routes (`render_config`, deterministic) and written to the state folder with the runtime socket
and the master's pid.

Changing a model's servers goes through HAProxy's runtime API, with no reload and no client
reconnect (`ProxyApi.set_servers`): add the new server, wait until its check passes, drain the
old one, wait until it holds no request, then delete it. Only a change in the set of model
ports (a model added or removed), or in how a model's requests are dealt (`balance`), rewrites
the configuration and reloads (the old worker finishes what it holds). HAProxy also exports Prometheus
metrics on a loopback port.
"""

from __future__ import annotations

import csv
import io
import re
import socket
import time
from dataclasses import dataclass

from tritonctl.errors import TritonctlError

DRAIN_TIMEOUT_S = 30.0  # the longest a drained server may keep requests before it is cut off
CHECK_TIMEOUT_S = 15.0  # the longest a new server may take to pass its health check
MAX_WEIGHT = 256  # HAProxy's weights are 0-256
MAX_CONNECTIONS = 1024  # client connections at once, over all models
# Inference requests are large (a 224x224 float image is 602 KB) where HAProxy's defaults (16 KB buffers, a 64 KB
# HTTP/2 window) suit web pages. Larger buffers cost less CPU and less tail at load, with glibc told to keep the memory
# HAProxy frees (above its mmap threshold it maps and unmaps each buffer). HAProxy 2.6.12 corrupts its heap when a
# server is deleted with buffers of 512 KB or more, not with 256 KB; 3.0.11 does not. So a whole request (1 MB) from
# HAProxy 3.0, 256 KB before (docs/evaluation.md#buffers-that-hold-a-request).
BUFFER_BYTES = 1 << 18
LARGE_BUFFER_BYTES = 1 << 20
LARGE_BUFFERS_FROM = (3, 0)
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's default: a larger block is mapped by malloc and unmapped by free
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
WINDOW_BYTES = 1 << 20
IDLE_TIMEOUT_S = 300  # a client connection that carries nothing for this long is closed
REQUEST_TIMEOUT_S = 300  # the longest an instance may take to answer a request
# Every request leaves HAProxy stamped with when it arrived (ms since the epoch); tritonserver forwards the header to
# the model as a request parameter, so that an instance with `runtime.reject_late` can refuse what can only be late.
ARRIVAL_HEADER = "tritonctl-arrival-ms"


@dataclass(frozen=True)
class Server:
    """One placement behind a model's address: the instance's own ports and its weight (1-256)."""

    name: str
    host: str
    port: int  # the instance's gRPC port: requests go here
    check_port: int  # the instance's HTTP port: health-checked on /v2/health/ready
    weight: int


Routes = dict[int, list[Server]]  # model port -> its servers


def haproxy_weights(weights: list[float]) -> list[int]:
    """The plan's weights as HAProxy's (proportional, the largest 256, none below 1)."""
    top = max(weights, default=0.0)
    if top <= 0:
        return [1] * len(weights)
    return [max(1, round(MAX_WEIGHT * w / top)) for w in weights]


def server_name(uid: str) -> str:
    """An instance's uid as an HAProxy server name (letters, digits and - _ . : only)."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", uid)


def backend(port: int) -> str:
    return f"port{port}"


def balance(servers: list[Server]) -> str:
    """How a model's requests are dealt to its servers. Replicas of equal weight: to the one with the fewest
    requests in progress, a shorter queue than taking turns. Unequal weights: weighted round robin, which keeps
    the plan's split at any load (least-connections would send every request of a light load to the heaviest)."""
    return "leastconn" if len({s.weight for s in servers}) <= 1 else "roundrobin"


def server_options(server: Server) -> str:
    """The options of a server line, the same in the configuration and in `add server`."""
    return (
        f"{server.host}:{server.port} weight {server.weight} proto h2 "
        f"check port {server.check_port} check-proto h1 inter 1s fastinter 250ms rise 1 fall 2"
    )


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) from `haproxy -v`'s first line ("HAProxy version 2.6.12-1+deb12u4 ..."), or None."""
    found = re.search(r"HA-?Proxy version (\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2])) if found else None


def image_version(image: str) -> tuple[int, int] | None:
    """(major, minor) from an HAProxy image's tag ("haproxy:3.0", "haproxy:3.0.11-alpine"), None where the tag does
    not say (no tag, "lts", a digest)."""
    if "@" in image:
        return None
    found = re.match(r"(\d+)\.(\d+)", image.rpartition("/")[2].partition(":")[2])
    return (int(found[1]), int(found[2])) if found else None


def buffer_bytes(version: tuple[int, int] | None) -> int:
    """HAProxy's buffer size for this version of it: a whole request where it keeps such buffers through a `del
    server`, 256 KB otherwise (and where the version is not known)."""
    return LARGE_BUFFER_BYTES if version is not None and version >= LARGE_BUFFERS_FROM else BUFFER_BYTES


def image_buffer(image: str) -> int:
    """The buffer size for HAProxy run from this container image (`buffer_bytes` of its tag's version)."""
    return buffer_bytes(image_version(image))


def environment(buffer: int) -> dict[str, str]:
    """What HAProxy's environment adds for buffers of `buffer` bytes: glibc keeping the memory of those it would map."""
    return dict(MALLOC_ENV) if buffer > MMAP_THRESHOLD_BYTES else {}


def render_config(
    routes: Routes, host: str, api: str, metrics: str, resolve: bool = False, buffer: int = BUFFER_BYTES
) -> str:
    """HAProxy's configuration for these routes: model ports listen on `host`, the runtime API on `api`
    (a unix socket path, or `ipv4@host:port`), Prometheus metrics on `metrics` (host:port), buffers of `buffer`
    bytes (`buffer_bytes`). With `resolve`, servers are host names (Kubernetes Services) that HAProxy resolves
    with the system's resolvers, again while it runs, and it starts while one does not resolve yet."""
    lines = [
        "# Rendered by tritonctl from the deployment's routes; rewritten on every change.",
        "global",
        f"    stats socket {api} mode 600 level admin",
        f"    maxconn {MAX_CONNECTIONS}",
        "    nbthread 1",
        f"    tune.bufsize {buffer}",
        f"    tune.h2.initial-window-size {WINDOW_BYTES}",
        f"    hard-stop-after {DRAIN_TIMEOUT_S + 5:.0f}s",
        "",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        f"    timeout client {IDLE_TIMEOUT_S}s",
        f"    timeout server {REQUEST_TIMEOUT_S}s",
        "    timeout http-request 5s",
        "    timeout check 2s",
        "",
        *(["resolvers system", "    parse-resolv-conf", "    hold valid 10s", ""] if resolve else []),
        "frontend metrics",
        f"    bind {metrics}",
        "    http-request use-service prometheus-exporter if { path /metrics }",
        "    http-request return status 404",
    ]
    for port in sorted(routes):
        lines += [
            "",
            f"frontend {backend(port)}",
            f"    bind {host}:{port} proto h2",
            f"    http-request set-header {ARRIVAL_HEADER} %[date(0,ms)]",
            f"    default_backend {backend(port)}",
            "",
            f"backend {backend(port)}",
            f"    balance {balance(routes[port])}",
            "    option httpchk GET /v2/health/ready",
            *(["    default-server resolvers system init-addr last,libc,none"] if resolve else []),
            *(f"    server {s.name} {server_options(s)}" for s in sorted(routes[port], key=lambda s: s.name)),
        ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ServerStat:
    name: str
    status: str  # UP, DOWN, MAINT, DRAIN, "UP 1/2" (going down) ...
    weight: int
    current: int  # requests in progress


def parse_stat(text: str) -> dict[str, dict[str, ServerStat]]:
    """`show stat` CSV as {backend: {server: stat}} (servers only)."""
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    out: dict[str, dict[str, ServerStat]] = {}
    for row in rows:
        if row.get("svname") in (None, "FRONTEND", "BACKEND") or not row.get("pxname"):
            continue
        stat = ServerStat(row["svname"], row["status"], int(row["weight"] or 0), int(row["scur"] or 0))
        out.setdefault(row["pxname"], {})[stat.name] = stat
    return out


class ProxyApi:
    """HAProxy's runtime API at `address` (a unix socket path, or host:port)."""

    def __init__(self, address: str, timeout_s: float = 5.0):
        self.address = address
        self.timeout_s = timeout_s

    def __call__(self, command: str) -> str:
        """Send one command and return HAProxy's answer; TritonctlError where nothing answers."""
        if ":" in self.address and not self.address.startswith("/"):
            host, port = self.address.rsplit(":", 1)
            family, target = socket.AF_INET, (host, int(port))
        else:
            family, target = socket.AF_UNIX, self.address
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout_s)
                sock.connect(target)
                sock.sendall(command.encode() + b"\n")
                chunks = []
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
        except OSError as exc:
            raise TritonctlError(f"HAProxy's runtime API at {self.address} did not answer {command!r}: {exc}") from None
        return b"".join(chunks).decode(errors="replace")

    def answers(self) -> bool:
        try:
            return "pxname" in self("show stat")
        except TritonctlError:
            return False

    def worker_pid(self) -> int | None:
        """The pid of the worker answering the runtime API (a reload replaces it); None where nothing answers."""
        try:
            info = self("show info")
        except TritonctlError:
            return None
        return next((int(line.split(":", 1)[1]) for line in info.splitlines() if line.startswith("Pid:")), None)

    def servers(self) -> dict[str, dict[str, ServerStat]]:
        return parse_stat(self("show stat"))

    def _must(self, command: str, *expected: str) -> None:
        answer = self(command).strip()
        if expected and not any(e in answer for e in expected):
            raise TritonctlError(f"HAProxy refused {command!r}: {answer or 'no answer'}")

    def set_servers(self, port: int, servers: list[Server]) -> dict:
        """Make `servers` the model port's backend, with no reload: new servers are added and must pass their
        health check first; weights are updated; servers that leave are drained, then deleted. Returns how many
        servers were added and drained, and how many were cut off at the drain timeout."""
        name = backend(port)
        current = self.servers().get(name, {})
        wanted = {s.name: s for s in servers}
        added = [s for s in servers if s.name not in current]
        for s in added:
            self._must(f"add server {name}/{s.name} {server_options(s)}", "New server registered")
            self._must(f"enable health {name}/{s.name}")
            self._must(f"enable server {name}/{s.name}")
        self._wait_up(name, [s.name for s in added])
        for s in servers:
            if s.name in current and current[s.name].weight != s.weight:
                self._must(f"set server {name}/{s.name} weight {s.weight}")
        leaving = [n for n in current if n not in wanted]
        for n in leaving:
            self._must(f"set server {name}/{n} state drain")
        cut = self._drain(name, leaving)
        for n in leaving:
            self._must(f"set server {name}/{n} state maint")
            if n in cut:
                self._must(f"shutdown sessions server {name}/{n}")
            self._delete(name, n)
        return {"added": len(added), "drained": len(leaving), "timed_out": len(cut)}

    def _wait_up(self, name: str, servers: list[str]) -> None:
        deadline = time.monotonic() + CHECK_TIMEOUT_S
        while servers:
            stats = self.servers().get(name, {})
            down = [n for n in servers if not stats.get(n, ServerStat(n, "", 0, 0)).status.startswith("UP")]
            if not down:
                return
            if time.monotonic() > deadline:
                raise TritonctlError(
                    f"HAProxy's health check of {', '.join(down)} ({name}) did not pass within {CHECK_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.1)

    def _drain(self, name: str, servers: list[str]) -> set[str]:
        """Wait until the servers hold no request; those still busy at DRAIN_TIMEOUT_S."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            stats = self.servers().get(name, {})
            busy = {n for n in servers if n in stats and stats[n].current > 0}
            if not busy or time.monotonic() > deadline:
                return busy
            time.sleep(0.05)

    def _delete(self, name: str, server: str) -> None:
        """`del server`, which HAProxy refuses while the server holds idle connections: retried for a while."""
        deadline = time.monotonic() + 10
        while True:
            answer = self(f"del server {name}/{server}").strip()
            if "deleted" in answer.lower():
                return
            if time.monotonic() > deadline:
                raise TritonctlError(f"HAProxy did not delete server {name}/{server}: {answer}")
            time.sleep(0.1)

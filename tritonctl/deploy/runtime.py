"""What every runtime (local processes now, Docker Compose next) offers the apply logic."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from tritonctl.deploy.proxy import ARRIVAL_HEADER
from tritonctl.planning.plan import LoadedPlan
from tritonctl.triton.render import Launch

CONTROL_HEADER = "tritonctl-key"  # the HTTP header; gRPC clients send GRPC_CONTROL_HEADER
GRPC_CONTROL_HEADER = f"triton-grpc-protocol-{CONTROL_HEADER}"  # Triton prefixes the key it checks over gRPC
# Triton's APIs that answer only requests carrying the deployment's key: those that load code or touch the
# host (model load with file overrides, shared-memory regions, trace and log files). Inference, health,
# metadata, model configuration and statistics stay open: read-only, and perf_analyzer needs them.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")


class StartError(Exception):
    """An instance did not come up; the runtime has already cleaned up after it. `crashed`: its process died
    of a signal while starting, which a second start may not repeat (a flaky abort, not a bad config)."""

    def __init__(self, message: str, crashed: bool = False):
        super().__init__(message)
        self.crashed = crashed


@dataclass
class InstanceRecord:
    """A running Triton instance as a runtime started it: enough to find, probe and stop it."""

    uid: str
    instance: str
    model: str
    device: str
    share: int
    units: int
    config_hash: str
    host: str
    grpc_port: int
    http_port: int
    metrics_port: int
    pid: int
    start_ticks: int
    folder: str
    log: str
    share_mechanism: str
    cgroup: str | None = None
    process_hash: str = ""  # empty in state files written before in-place reconfiguration existed
    backend_port: int = 0  # the instance's own gRPC port behind the model's stable `grpc_port` (0: none)

    @classmethod
    def launched(cls, launch: Launch, **started) -> InstanceRecord:
        """The record of `launch` once a runtime has started it: what the launch fixes (instance, model, device,
        share, hashes, the model's port) from it, the rest (uid, host, ports, process, log) from `started`."""
        return cls(
            instance=launch.instance,
            model=launch.model,
            device=launch.device,
            share=launch.share,
            units=launch.units,
            config_hash=launch.config_hash,
            process_hash=launch.process_hash,
            grpc_port=launch.grpc_port,
            **started,
        )


@dataclass(frozen=True)
class Health:
    alive: bool
    server_ready: bool
    model_ready: bool

    @property
    def label(self) -> str:
        if not self.alive:
            return "dead"
        return "ready" if self.server_ready and self.model_ready else "not ready"


def http_ok(url: str) -> bool:
    """Whether a Triton HTTP endpoint (health, readiness) answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def server_flags(key: str) -> list[str]:
    """tritonserver flags every runtime starts an instance with: RESTRICTED_APIS, over gRPC and HTTP, answer only
    requests carrying `key`; the proxy's arrival stamp reaches the model as a request parameter."""
    rule = f"{','.join(RESTRICTED_APIS)}:{CONTROL_HEADER}={key}"
    return [
        f"--grpc-restricted-protocol={rule}",
        f"--http-restricted-api={rule}",
        f"--grpc-header-forward-pattern=^{ARRIVAL_HEADER}$",
    ]


def load_model(url: str, model: str, timeout_s: float, key: str) -> str | None:
    """Ask Triton (explicit model control) to (re)load `model` from its repository, sending the control
    `key`; the error, or None.

    Triton keeps serving the loaded version until the new one is ready (warm-up included),
    and keeps it when the new one fails to load.
    """
    request = urllib.request.Request(
        f"{url}/v2/repository/models/{model}/load", data=b"{}", headers={CONTROL_HEADER: key}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return None
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read()).get("error", str(exc))
        except ValueError:
            return str(exc)
    except (urllib.error.URLError, OSError) as exc:
        return f"no answer from {url}: {exc}"


def route_summary(port: int, backends: list[str], done: dict) -> str:
    """One line on a route the proxy took (`done`: servers drained, and cut off at the drain timeout)."""
    moved = f", drained {done['drained']} server(s)" if done.get("drained") else ""
    late = f", {done['timed_out']} cut off at the drain timeout" if done.get("timed_out") else ""
    return f"port {port} -> {', '.join(backends) or 'closed'}{moved}{late}"


class Runtime(Protocol):
    name: str
    rehearses: bool
    """Whether the runtime only prints what it would do (a dry run): apply then walks through every
    step with it and saves nothing. False for a runtime that cannot pretend (local processes)."""

    def prepare(self, loaded: LoadedPlan, write: bool) -> LoadedPlan:
        """The plan as this runtime deploys it, with what the runtime needs besides the repositories
        written when `write` (the Compose project); raises TritonctlError for a plan it cannot deploy."""

    def start(
        self,
        launch: Launch,
        folder: Path,
        host: str,
        log_dir: Path,
        timeout_s: float,
        on_spawn: Callable[[InstanceRecord], None] | None = None,
    ) -> InstanceRecord:
        """Start the instance and return once its model is loaded and warmed; raise StartError otherwise.

        `on_spawn` is called with the record as soon as the process exists, so a caller can
        persist it before waiting: a crash during the wait then leaves no unrecorded instance.
        """

    def reconfigure(self, record: InstanceRecord, timeout_s: float) -> None:
        """Reload the running model from its repository (batch or queue delay changed); StartError on failure."""

    def route(self, host: str, port: int, backends: list[tuple[InstanceRecord, float]]) -> str:
        """Send the model address `port` to these instances, each with its weight (none: close it); returns
        once the instances no longer in the set hold no request, with a line saying what moved."""

    def stop(self, record: InstanceRecord) -> None:
        """Stop the instance, letting in-flight requests finish first."""

    def proxy_ok(self) -> bool:
        """Whether the proxy that serves the model addresses answers."""

    def proxy_info(self) -> str:
        """One line on the proxy: where its runtime API and metrics are."""

    def proxy_metrics_url(self) -> str | None:
        """Where the proxy's Prometheus metrics are (None: not running)."""

    def shutdown(self) -> None:
        """Stop what the runtime runs beside the instances, once none is left (the proxy)."""

    def health(self, record: InstanceRecord) -> Health: ...


K = TypeVar("K")


def stop_all(
    runtime: Runtime, records: Mapping[K, InstanceRecord], stopped: Callable[[K], None] = lambda _: None
) -> None:
    """Stop these instances at once, calling `stopped` with each one's key (in this thread) as soon as it has: each
    drains on its own, and a Triton takes seconds to exit even idle, so they stop in the time of the slowest."""
    if not records:
        return
    with ThreadPoolExecutor(max_workers=len(records)) as pool:
        futures = {pool.submit(runtime.stop, record): key for key, record in records.items()}
        for future in as_completed(futures):
            future.result()
            stopped(futures[future])

"""What every runtime (local processes now, Docker Compose next) offers the apply logic."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tritonctl.render import Launch


class StartError(Exception):
    """An instance did not come up; the runtime has already cleaned up after it."""


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


class Runtime(Protocol):
    name: str

    def start(self, launch: Launch, folder: Path, host: str, log_dir: Path, timeout_s: float) -> InstanceRecord:
        """Start the instance and return once its model is ready; raise StartError otherwise."""

    def stop(self, record: InstanceRecord) -> None:
        """Stop the instance, letting in-flight requests finish first."""

    def health(self, record: InstanceRecord) -> Health: ...

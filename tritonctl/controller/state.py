"""What the controller runs and has decided: controller.json, /state, and /metrics in Prometheus's format."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tritonctl.files import write_json_atomic

CONTROLLER_FILE = "controller.json"
APPLY_QUIET_S = 600.0  # the longest an apply under way may go without the controller saving its state


@dataclass
class Decision:
    time: float
    kind: str  # "batch" (BDA, reloads), "replan" (policy, swaps), "operator" (plan file), "adopt", "heal",
    # "error", "deferred"
    reason: str
    plan: str = ""
    took_s: float = 0.0


@dataclass
class ControllerState:
    """What the controller runs and has decided: controller.json, /state."""

    plan: str  # the plan applied last
    source: str = ""  # the plan file the operator gave: when it changes, it is applied
    source_digest: str = ""
    target: str = ""  # the plan being applied ("" when none): re-applied after a crash
    policy: str = "search"
    started: float = field(default_factory=time.time)
    planned_rates: dict[str, float] = field(default_factory=dict)
    estimated_rates: dict[str, float | None] = field(default_factory=dict)
    queue_ms: dict[str, float | None] = field(default_factory=dict)
    # at the proxy, per model: requests/s, errors/s (connection errors, 5xx) and requests queued there now
    proxy_rates: dict[str, float | None] = field(default_factory=dict)
    proxy_errors: dict[str, float | None] = field(default_factory=dict)
    proxy_queued: dict[str, float] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)  # model -> ticks its change has lasted (- falling)
    applies: int = 0
    last_change: float = 0.0
    steps: list[str] = field(default_factory=list)  # the current (or last) apply's steps
    decisions: list[dict] = field(default_factory=list)
    # when the controller last saved its state, which it does every tick of `interval_s` and as an apply begins: long
    # before now, it has stopped (`running`)
    heartbeat: float = 0.0
    interval_s: float = 0.0
    stopped: float = 0.0  # when it stopped (Ctrl-C, SIGTERM); 0 while it runs

    def running(self, now: float) -> bool:
        """Whether the controller runs: not stopped, and heard from within three ticks and ten seconds, or within
        APPLY_QUIET_S while it applies a plan (starting instances says nothing for minutes)."""
        quiet = APPLY_QUIET_S if self.target else 3 * self.interval_s + 10
        return not self.stopped and now - self.heartbeat <= quiet

    def record(self, decision: Decision) -> None:
        self.decisions = [*self.decisions[-19:], asdict(decision)]


def save_controller_state(state_dir: Path, state: ControllerState) -> None:
    write_json_atomic(state_dir / CONTROLLER_FILE, asdict(state))


def load_controller_state(state_dir: Path) -> ControllerState | None:
    try:
        return ControllerState(**json.loads((state_dir / CONTROLLER_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def prometheus(state: ControllerState) -> bytes:
    """The controller's state as Prometheus exposition (rates in requests per second, times in seconds)."""
    applies = CounterMetricFamily("tritonctl_applies", "Plans the controller applied")
    applies.add_metric([], state.applies)
    busy = GaugeMetricFamily("tritonctl_apply_in_progress", "1 while the controller applies a plan")
    busy.add_metric([], int(bool(state.target)))
    estimated = GaugeMetricFamily(
        "tritonctl_model_estimated_requests_per_second", "Arrival rate measured over the window", labels=["model"]
    )
    planned = GaugeMetricFamily(
        "tritonctl_model_planned_requests_per_second", "Arrival rate the applied plan is sized for", labels=["model"]
    )
    queue = GaugeMetricFamily("tritonctl_model_queue_seconds", "Mean wait in Triton's queue", labels=["model"])
    for model, rate in state.estimated_rates.items():
        if rate is not None:
            estimated.add_metric([model], rate)
    for model, rate in state.planned_rates.items():
        planned.add_metric([model], rate)
    for model, ms in state.queue_ms.items():
        if ms is not None:
            queue.add_metric([model], ms / 1000)
    errors = GaugeMetricFamily(
        "tritonctl_model_proxy_errors_per_second", "Requests HAProxy failed (connection errors, 5xx)", labels=["model"]
    )
    for model, rate in state.proxy_errors.items():
        if rate is not None:
            errors.add_metric([model], rate)
    families = [applies, busy, estimated, planned, queue, errors]

    class Snapshot(Collector):
        def collect(self):
            return families

    registry = CollectorRegistry()
    registry.register(Snapshot())
    return generate_latest(registry)

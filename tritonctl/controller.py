"""The controller sidecar: watch the instances' metrics, re-plan as rates move, apply.

Every tick it reads each instance's Triton metrics endpoint (Prometheus text), estimates
each model's arrival rate over a sliding window and its queue, and compares the rates
with those the applied plan was sized for. A model whose rate stays beyond the threshold
for `confirm` ticks (and no change in the last `cooldown_s`) triggers the InSS two-layer
logic: BDA on the current placement and shares first, which needs no new process (batch
sizes reload in place); only when BDA finds no feasible batch does the configured policy
re-plan placement and shares (shadow swaps). Each applied plan is saved in the state
folder; `controller.json` there says what the controller runs and has decided, and the
same is served as JSON (/state) and Prometheus metrics (/metrics).

Dead parts are healed: an instance whose process died, or a router that stopped answering,
is noticed at the next tick and the plan applied last is applied again (the same start path
as `apply`, warm-up included); the affected models' rates are unknown (None) until a new
window of samples has come in, so a gap in traffic is never taken for a fall in load.

The operator keeps control: when the plan file the controller was started with changes
(a new `tritonctl plan`, an edit), the controller applies it and sizes from there. Without
a latency model it only follows that file and reports rates.

Killed and restarted, it re-applies the last plan it meant to apply: running instances
that match are kept (adopted), a half-done swap is finished, nothing is duplicated.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from tritonctl.deploy.apply import apply_plan
from tritonctl.deploy.runtime import InstanceRecord, Runtime
from tritonctl.deploy.state import load_state
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.files import sha256_file, write_json_atomic
from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.latency.queueing import warm_tables
from tritonctl.planning.plan import LoadedPlan, Plan, load_plan, relative_to, save_plan
from tritonctl.planning.planner import make_plan, predict
from tritonctl.planning.policies import Choice, Demand
from tritonctl.planning.policies.bda import bda, explain, with_batches
from tritonctl.spec import load_cluster

CONTROLLER_FILE = "controller.json"
HTTP_TIMEOUT_S = 5.0  # the state endpoint closes a connection that sends nothing for this long
HTTP_MAX_CLIENTS = 16  # connections the state endpoint serves at once; more are closed unanswered
PENDING = "nv_inference_pending_request_count"  # requests queued or running in the instance (a gauge)


@dataclass(frozen=True)
class ControllerConfig:
    interval_s: float = 1.0
    """Seconds between ticks (metrics scrapes)."""
    window_s: float = 4.0
    """Arrival rates are averaged over this many seconds."""
    threshold: float = 0.25
    """A rate this far from the planned one (relative) counts as changed ..."""
    min_delta_rps: float = 1.0
    """... and at least this far in requests per second (ignores noise on small rates)."""
    confirm: int = 2
    """Consecutive ticks a rise must last before the controller acts (hysteresis)."""
    confirm_down: int = 5
    """Consecutive ticks a fall must last: shrinking is never urgent, flapping is costly."""
    cooldown_s: float = 10.0
    """Seconds after an applied change before the next one (no flapping)."""
    headroom: float = 1.1
    """Plans are sized for the estimated rate times this."""


# ---- metrics and rates ---------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Triton's Prometheus text -> model -> metric -> value, summed over versions (Triton's counters and
    gauges named nv_inference_*; ValueError for text that is not Prometheus exposition)."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("nv_inference_"):
            continue
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is not None and sample.name in (family.name, f"{family.name}_total"):
                metrics = out.setdefault(model, {})
                metrics[family.name] = metrics.get(family.name, 0.0) + sample.value
    return out


def scrape(record: InstanceRecord) -> dict[str, float] | None:
    """The instance's counters for its model, None when its metrics endpoint does not answer."""
    url = f"http://{record.host}:{record.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return parse_metrics(response.read().decode()).get(record.model, {})
    except (urllib.error.URLError, OSError, ValueError):
        return None


@dataclass
class RateEstimator:
    """Arrival rates and queueing per model from cumulative counters of instances that come and go."""

    window_s: float
    last: dict[str, dict[str, float]] = field(default_factory=dict)  # uid -> counters at the previous tick
    samples: dict[str, deque] = field(default_factory=dict)  # model -> (time, requests, queue_us)

    def update(self, now: float, counters: dict[str, tuple[str, dict[str, float]]]) -> None:
        """`counters`: uid -> (model, counters). A new instance counts from its first sample on.

        Arrivals are completions plus the growth of the pending queue, so an overloaded
        instance (which completes fewer than arrive) does not hide its load.
        """
        arrived: dict[str, float] = {}
        queued: dict[str, float] = {}
        for uid, (model, values) in counters.items():
            before = self.last.get(uid, values)
            done = values.get("nv_inference_request_success", 0) + values.get("nv_inference_request_failure", 0)
            earlier = before.get("nv_inference_request_success", 0) + before.get("nv_inference_request_failure", 0)
            growth = values.get(PENDING, 0) - before.get(PENDING, 0)
            arrived[model] = arrived.get(model, 0.0) + max(0.0, done - earlier + growth)
            queue = values.get("nv_inference_queue_duration_us", 0) - before.get("nv_inference_queue_duration_us", 0)
            queued[model] = queued.get(model, 0.0) + max(0.0, queue)
        self.last = {uid: values for uid, (_, values) in counters.items()}
        for model in arrived:
            series = self.samples.setdefault(model, deque())
            series.append((now, arrived[model], queued[model]))
            while series and series[0][0] < now - self.window_s:
                series.popleft()

    def span(self, model: str) -> float:
        series = self.samples.get(model)
        return series[-1][0] - series[0][0] if series and len(series) > 1 else 0.0

    def rate(self, model: str) -> float | None:
        """Requests per second over the window (None until it spans one tick)."""
        span = self.span(model)
        if span <= 0:
            return None
        return sum(s[1] for s in list(self.samples[model])[1:]) / span

    def queue_ms(self, model: str) -> float | None:
        """Average time a request waited in Triton's queue over the window."""
        series = list(self.samples.get(model, ()))[1:]
        requests = sum(s[1] for s in series)
        return sum(s[2] for s in series) / requests / 1000 if requests else None


# ---- decisions (pure) ----------------------------------------------------------------


def changed_rates(
    planned: dict[str, float], estimated: dict[str, float | None], cfg: ControllerConfig
) -> dict[str, float]:
    """The models whose estimated rate is beyond the threshold of the planned one -> estimate.

    Beyond means past the relative threshold, the absolute minimum, and three standard
    deviations of a Poisson count over the window (at 5 req/s a 4 s window counts 20 +- 4.5
    requests, so 25 % alone would fire on noise).
    """
    out = {}
    for model, rate in estimated.items():
        if rate is None or model not in planned:
            continue
        noise = 3 * math.sqrt(max(planned[model], 0.1) / cfg.window_s)
        if abs(rate - planned[model]) > max(cfg.threshold * planned[model], cfg.min_delta_rps, noise):
            out[model] = rate
    return out


@dataclass(frozen=True)
class Outage:
    """What is down: instances whose process is gone, and whether the router does not answer."""

    dead: tuple[InstanceRecord, ...] = ()
    router: bool = False

    def __bool__(self) -> bool:
        return bool(self.dead or self.router)

    def __str__(self) -> str:
        lines = [f"{r.uid} ({r.model}) died" for r in self.dead]
        return "; ".join(lines + ["the router does not answer"] * self.router)


def outage(silent: list[InstanceRecord], runtime: Runtime, routed: bool) -> Outage:
    """Among `silent` instances (their metrics did not answer), those whose process is gone; the router
    when `routed` (the deployment has instances) and it does not answer."""
    dead = tuple(r for r in silent if not runtime.health(r).alive)
    return Outage(dead, routed and not runtime.router_ok())


def with_rates(plan: Plan, rates: dict[str, float]) -> Plan:
    return plan.model_copy(
        update={"models": [m.model_copy(update={"rate": round(rates.get(m.name, m.rate), 2)}) for m in plan.models]}
    )


def rebatch(plan: Plan, lm: LatencyModel) -> tuple[Plan | None, str]:
    """InSS's first layer: BDA on the plan's placement and shares at its (new) rates.

    Returns the plan with BDA's batches and queue delays, or None and why BDA failed (or why
    it does not apply: BDA sizes one instance per model).
    """
    if plan.sharing != "spatial" or plan.turns or any(len(m.placements) != 1 for m in plan.models):
        return None, "BDA sizes one instance per model on shared devices; this plan has replicas or turns"
    demands = [Demand(m.name, m.slo_ms, m.rate, m.memory_mb) for m in plan.models]
    placement = {
        m.name: Choice(m.placements[0].device, m.placements[0].share, m.placements[0].batch) for m in plan.models
    }
    decision = bda(placement, demands, plan.devices, lm)
    if not decision.ok:
        return None, explain(decision)
    chosen = {name: choices[0] for name, choices in with_batches(placement, decision.batches, demands, lm).items()}
    sized = {name: {"batch": c.batch, "queue_delay_us": c.queue_delay_us} for name, c in chosen.items()}
    models = [
        m.model_copy(update={"placements": [m.placements[0].model_copy(update=sized[m.name])]}) for m in plan.models
    ]
    return plan.model_copy(
        update={
            "models": predict(
                models, lm, log=lambda _: None, sharing=plan.sharing, turns=frozenset(plan.turns), devices=plan.devices
            )
        }
    ), ""


def rebase(plan: Plan, old_dir: Path, new_dir: Path) -> Plan:
    """The plan with its relative paths rewritten for a file in `new_dir` instead of `old_dir`."""

    def move(path: str) -> str:
        return relative_to(old_dir / path, new_dir)

    runtime = plan.runtime.model_copy(
        update={"repository_dir": move(plan.runtime.repository_dir), "state_dir": move(plan.runtime.state_dir)}
    )
    return plan.model_copy(
        update={
            "cluster_file": move(plan.cluster_file),
            "runtime": runtime,
            "models": [m.model_copy(update={"onnx": move(m.onnx)}) for m in plan.models],
        }
    )


# ---- the loop ------------------------------------------------------------------------


def _digest(path: Path) -> str:
    """The file's content hash, "" while it cannot be read (an editor replacing it)."""
    try:
        return sha256_file(path)
    except OSError:
        return ""


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
    pending: dict[str, int] = field(default_factory=dict)  # model -> ticks its change has lasted (- falling)
    applies: int = 0
    last_change: float = 0.0
    steps: list[str] = field(default_factory=list)  # the current (or last) apply's steps
    decisions: list[dict] = field(default_factory=list)

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
    families = [applies, busy, estimated, planned, queue]

    class Snapshot(Collector):
        def collect(self):
            return families

    registry = CollectorRegistry()
    registry.register(Snapshot())
    return generate_latest(registry)


class _BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server serving at most HTTP_MAX_CLIENTS connections at once; more are closed."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(HTTP_MAX_CLIENTS)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class Controller:
    def __init__(
        self,
        plan_path: Path,
        runtime: Runtime,
        lm: LatencyModel | None,
        policy: str,
        cfg: ControllerConfig = ControllerConfig(),
        log: Callable[[str], None] = print,
    ):
        self.runtime, self.lm, self.cfg, self.log = runtime, lm, cfg, log
        loaded = load_plan(plan_path)
        self.state_dir = loaded.state_dir
        self.plans_dir = self.state_dir / "plans"
        self.estimator = RateEstimator(cfg.window_s)
        self.lock = threading.Lock()  # guards self.state between the loop and the HTTP thread
        self.current: LoadedPlan | None = None  # the plan applied last, as loaded then
        self.refused_digest = ""  # an operator plan that failed to apply, not retried until it changes
        self.heal_after = 0.0  # monotonic time before which no heal is tried (after one that failed)
        source = str(loaded.path.resolve())
        previous = load_controller_state(self.state_dir)
        if previous is not None and previous.source == source and Path(previous.target or previous.plan).exists():
            self.state = previous
            resume = previous.target or previous.plan
            busy = f", {resume} was being applied" if previous.target else ""
            self.log(f"resuming: {previous.plan} was applied last{busy}")
        else:
            self.state = ControllerState(plan=source, source=source, source_digest=_digest(Path(source)))
            resume = self.state.plan
        self.state.policy = policy
        if lm is not None:  # before the instances start, so that it takes no CPU from their first requests
            self._warm_planner(loaded.resolve(loaded.plan.cluster_file))
        self._apply(Path(resume), Decision(time.time(), "adopt", "controller started: adopt or start the instances"))

    def _warm_planner(self, spec_path: Path) -> None:
        """Pay the planner's one-time costs now rather than in the first re-plan, which comes when the load has
        moved and the devices are busiest: loading the models' artifacts (imports, ONNX files) and building
        the queueing tables of every batch size."""
        began = time.monotonic()
        try:
            materialize(load_cluster(spec_path), log=lambda _: None)
        except TritonctlError as exc:  # the re-plan will say it again, with the decision it fails
            self.log(f"note: cannot prepare re-planning yet: {exc}")
            return
        warm_tables(MAX_BATCH)
        self.log(f"planner warmed in {time.monotonic() - began:.1f} s")

    # -- applying
    def _apply(self, path: Path, decision: Decision) -> bool:
        """Apply the plan at `path` and record the decision; a bad plan or a failed apply is recorded, not raised."""
        with self.lock:
            self.state.target, self.state.steps = str(path), []
            save_controller_state(self.state_dir, self.state)

        def log(line: str) -> None:
            self.log(line)
            with self.lock:
                self.state.steps.append(line.strip())

        began = time.monotonic()
        try:
            loaded = load_plan(path)
            apply_plan(loaded, self.runtime, log=log)
            self.current = loaded
            ok = True
        except TritonctlError as exc:
            decision.kind, decision.reason, ok = (
                "deferred" if "another apply holds the lock" in str(exc) else "error",
                f"{decision.reason}; not applied: {exc}",
                False,
            )
            self.log(f"error: {exc}")
        decision.plan, decision.took_s = str(path), round(time.monotonic() - began, 2)
        with self.lock:
            if ok:
                self.state.plan = str(path)
                self.state.applies += 1
                self.state.last_change = time.time()
                self.state.planned_rates = {m.name: m.rate for m in loaded.plan.models}
                self.state.pending = {}
            self.state.target = ""
            self.state.record(decision)
            save_controller_state(self.state_dir, self.state)
        return ok

    def _save(self, plan: Plan, kind: str) -> Path:
        self.plans_dir.mkdir(parents=True, exist_ok=True)
        path = self.plans_dir / f"plan-{self.state.applies + 1:04d}-{kind}.yaml"
        current = Path(self.state.plan)
        save_plan(rebase(plan, current.parent, path.parent), path)
        return path

    def _replan(self, current: LoadedPlan, rates: dict[str, float]) -> Plan:
        """The second layer: the configured policy on the cluster at the new rates."""
        spec_path = current.resolve(current.plan.cluster_file)
        scaled = load_cluster(spec_path).with_rates(lambda m: round(rates.get(m.name, m.rate), 2))
        artifacts = materialize(scaled, log=lambda _: None)
        return make_plan(scaled, artifacts, self.state.policy, current.path, self.lm, log=lambda _: None)

    # -- one tick
    def observe(self) -> tuple[dict[str, float | None], Outage]:
        """Each model's estimated rate (None: unknown), and what is down."""
        records = load_state(self.state_dir).instances
        counters = {}
        for uid, record in records.items():
            values = scrape(record)
            if values is not None:
                counters[uid] = (record.model, values)
        self.estimator.update(time.monotonic(), counters)
        broken = outage([r for uid, r in records.items() if uid not in counters], self.runtime, bool(records))
        hit = {r.model for r in (records.values() if broken.router else broken.dead)}
        for model in hit:  # its samples span the outage: start again once it serves
            self.estimator.samples.pop(model, None)
        models = {r.model for r in records.values()}
        estimated = {m: None if m in hit else self.estimator.rate(m) for m in models}
        with self.lock:
            self.state.estimated_rates = {m: None if r is None else round(r, 2) for m, r in estimated.items()}
            self.state.queue_ms = {
                m: None if (q := self.estimator.queue_ms(m)) is None else round(q, 2) for m in models
            }
        return estimated, broken

    def heal(self, broken: Outage) -> Decision | None:
        """Apply the plan applied last again when something is down; after a failed try, wait the cooldown."""
        if not broken or time.monotonic() < self.heal_after:
            return None
        decision = Decision(time.time(), "heal", f"{broken}: applying {Path(self.state.plan).name} again")
        self.log(f"decision: {decision.reason}")
        if not self._apply(Path(self.state.plan), decision):  # "deferred": another apply holds the lock
            wait = self.cfg.interval_s if decision.kind == "deferred" else self.cfg.cooldown_s
            self.heal_after = time.monotonic() + wait
        return decision

    def tick(self) -> Decision | None:
        estimated, broken = self.observe()
        if (healed := self.heal(broken)) is not None:
            return healed
        digest = _digest(Path(self.state.source))
        if digest and digest not in (self.state.source_digest, self.refused_digest):
            decision = Decision(time.time(), "operator", f"{self.state.source} changed: applying it")
            self.log(f"decision: {decision.reason}")
            if self._apply(Path(self.state.source), decision):
                self.state.source_digest = digest
            elif decision.kind == "error":
                self.refused_digest = digest  # not again until the file changes; "deferred" retries
            return decision
        if self.lm is None or self.current is None:
            return None
        current = self.current
        planned = {m.name: m.rate for m in current.plan.models}
        changed = changed_rates(planned, estimated, self.cfg)
        with self.lock:
            # consecutive ticks a change has lasted, signed by its direction: a flip starts again
            signs = {m: 1 if r > planned[m] else -1 for m, r in changed.items()}
            self.state.pending = {
                m: self.state.pending.get(m, 0) + sign if self.state.pending.get(m, 0) * sign > 0 else sign
                for m, sign in signs.items()
            }
            ready = {
                m: r
                for m, r in changed.items()
                if abs(self.state.pending[m]) >= (self.cfg.confirm if signs[m] > 0 else self.cfg.confirm_down)
            }
            cooling = time.time() - self.state.last_change < self.cfg.cooldown_s
            save_controller_state(self.state_dir, self.state)
        if not ready or cooling:
            return None
        rates = {m: max(0.1, r * self.cfg.headroom) for m, r in ready.items()}
        why = ", ".join(f"{m} {planned[m]:g} -> {ready[m]:.1f} req/s" for m in ready)
        began = time.monotonic()
        plan, failure = rebatch(with_rates(current.plan, rates), self.lm)
        if plan is not None:
            decision = Decision(time.time(), "batch", f"rates moved ({why}); BDA re-sized batches")
        else:
            self.log(f"BDA: {failure}; re-planning with {self.state.policy}")
            try:
                plan = self._replan(current, rates)
            except TritonctlError as exc:
                decision = Decision(time.time(), "error", f"rates moved ({why}); {self.state.policy} failed: {exc}")
                with self.lock:
                    self.state.record(decision)
                    self.state.last_change = time.time()  # do not retry every tick
                return decision
            decision = Decision(time.time(), "replan", f"rates moved ({why}); BDA: {failure}; {self.state.policy}")
        decision.reason += f" (decided in {1000 * (time.monotonic() - began):.0f} ms)"
        self.log(f"decision: {decision.reason}")
        self._apply(self._save(plan, decision.kind), decision)
        return decision

    def snapshot(self) -> dict:
        with self.lock:
            return asdict(self.state)

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        """Serve /state (JSON) and /metrics (Prometheus) on host:port in a daemon thread."""
        controller = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                if self.path == "/state":
                    body, kind = json.dumps(controller.snapshot(), indent=2).encode(), "application/json"
                elif self.path == "/metrics":
                    with controller.lock:
                        body, kind = prometheus(controller.state), CONTENT_TYPE_LATEST
                else:
                    self.send_error(404, "try /state or /metrics")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        Handler.timeout = HTTP_TIMEOUT_S
        server = _BoundedServer((host, port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def run(self, stop: threading.Event) -> None:
        """Tick until `stop`; a failing tick is recorded as an error decision, and the loop goes on."""
        while not stop.wait(self.cfg.interval_s):
            try:
                self.tick()
            except (TritonctlError, OSError) as exc:
                self.log(f"error: {exc}")
                with self.lock:
                    self.state.target = ""
                    self.state.record(Decision(time.time(), "error", f"tick failed: {exc}"))
                    save_controller_state(self.state_dir, self.state)

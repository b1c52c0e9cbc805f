"""The controller's loop: observe, heal, follow the operator's plan file, re-size or re-plan, apply; /state."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST

from tritonctl.controller.decide import ControllerConfig, Outage, changed_rates, rebase, rebatch, with_rates
from tritonctl.controller.metrics import ProxyRates, RateEstimator, scrape, scrape_proxy
from tritonctl.controller.state import (
    ControllerState,
    Decision,
    load_controller_state,
    prometheus,
    save_controller_state,
)
from tritonctl.deploy.apply import apply_plan
from tritonctl.deploy.runtime import InstanceRecord, Runtime
from tritonctl.deploy.state import load_state
from tritonctl.errors import TritonctlError
from tritonctl.files import sha256_file
from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.latency.queueing import warm_tables
from tritonctl.planning.plan import LoadedPlan, Plan, load_plan, save_plan
from tritonctl.planning.planner import chosen_turn_priority, chosen_turn_threads, make_plan, replan_artifacts
from tritonctl.spec import load_cluster

HTTP_TIMEOUT_S = 5.0  # the state endpoint closes a connection that sends nothing for this long
HTTP_MAX_CLIENTS = 16  # connections the state endpoint serves at once; more are closed unanswered


def _digest(path: Path) -> str:
    """The file's content hash, "" while it cannot be read (an editor replacing it)."""
    try:
        return sha256_file(path)
    except OSError:
        return ""


def outage(silent: list[InstanceRecord], runtime: Runtime, routed: bool) -> Outage:
    """Among `silent` instances (their metrics did not answer), those whose process is gone; the proxy
    when `routed` (the deployment has instances) and it does not answer."""
    dead = tuple(r for r in silent if not runtime.health(r).alive)
    return Outage(dead, routed and not runtime.proxy_ok())


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
        cfg: ControllerConfig = ControllerConfig(),  # noqa: B008 (frozen: one shared default is safe)
        log: Callable[[str], None] = print,
    ):
        self.runtime, self.lm, self.cfg, self.log = runtime, lm, cfg, log
        loaded = load_plan(plan_path)
        self.state_dir = loaded.state_dir
        self.plans_dir = self.state_dir / "plans"
        self.estimator = RateEstimator(cfg.window_s)
        self.proxy_rates = ProxyRates(cfg.window_s)
        self.lock = threading.Lock()  # guards self.state between the loop and the HTTP thread
        self.current: LoadedPlan | None = None  # the plan applied last, as loaded then
        self.refused_digest = ""  # an operator plan that failed to apply, not retried until it changes
        self.heal_after = 0.0  # monotonic time before which no heal is tried (after one that failed)
        source = str(loaded.path.resolve())
        previous = load_controller_state(self.state_dir)
        if previous is not None and previous.source == source and Path(previous.target or previous.plan).exists():
            self.state = previous
            self.state.stopped = 0.0
            resume = previous.target or previous.plan
            busy = f", {resume} was being applied" if previous.target else ""
            self.log(f"resuming: {previous.plan} was applied last{busy}")
        else:
            self.state = ControllerState(plan=source, source=source, source_digest=_digest(Path(source)))
            resume = self.state.plan
        self.state.policy, self.state.interval_s = policy, cfg.interval_s
        if lm is not None:  # before the instances start, so that it takes no CPU from their first requests
            self._warm_planner(loaded)
        self._apply(Path(resume), Decision(time.time(), "adopt", "controller started: adopt or start the instances"))

    def _warm_planner(self, loaded: LoadedPlan) -> None:
        """Pay the planner's one-time costs now rather than in the first re-plan, which comes when the load has
        moved and the devices are busiest: loading the models' artifacts (imports, ONNX files) and building
        the queueing tables of every batch size."""
        began = time.monotonic()
        try:
            replan_artifacts(loaded, load_cluster(loaded.resolve(loaded.plan.cluster_file)))
        except TritonctlError as exc:  # the re-plan will say it again, with the decision it fails
            self.log(f"note: cannot prepare re-planning yet: {exc}")
            return
        warm_tables(MAX_BATCH)
        self.log(f"planner warmed in {time.monotonic() - began:.1f} s")

    # -- applying
    def _apply(self, path: Path, decision: Decision) -> bool:
        """Apply the plan at `path` and record the decision; a bad plan or a failed apply is recorded, not raised."""
        with self.lock:
            self.state.target, self.state.steps, self.state.heartbeat = str(path), [], time.time()
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
        """The second layer: the configured policy on the cluster at the new rates, its CPU devices' instances
        taking turns by the priority and on the threads the current plan runs them on where the cluster leaves
        them to the planner."""
        spec_path = current.resolve(current.plan.cluster_file)
        cluster = load_cluster(spec_path)
        scaled = cluster.with_rates(lambda m: round(rates.get(m.name, m.rate), 2))
        scaled = scaled.with_turn_priority(chosen_turn_priority(cluster, current.plan))
        scaled = scaled.with_turn_threads(chosen_turn_threads(cluster, current.plan))
        artifacts = replan_artifacts(current, scaled)
        return make_plan(
            scaled, artifacts, self.state.policy, current.path, self.lm, log=lambda _: None,
            batching=current.plan.batching,
        )  # fmt: skip

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
        hit = {r.model for r in (records.values() if broken.proxy else broken.dead)}
        for model in hit:  # its samples span the outage: start again once it serves
            self.estimator.samples.pop(model, None)
        models = {r.model for r in records.values()}
        estimated = {m: None if m in hit else self.estimator.rate(m) for m in models}
        self._observe_proxy({r.grpc_port: r.model for r in records.values()})
        with self.lock:
            self.state.estimated_rates = {m: None if r is None else round(r, 2) for m, r in estimated.items()}
            self.state.queue_ms = {
                m: None if (q := self.estimator.queue_ms(m)) is None else round(q, 2) for m in models
            }
        return estimated, broken

    def _observe_proxy(self, models: dict[int, str]) -> None:
        """Requests and errors per second and queued requests at the proxy, per model (`models`: port -> model)."""
        counters = scrape_proxy(self.runtime.proxy_metrics_url())
        if counters is None:
            return
        self.proxy_rates.update(time.monotonic(), counters)
        rates = {models[port]: self.proxy_rates.rates(port) for port in counters if port in models}
        with self.lock:
            self.state.proxy_rates = {m: None if r is None else round(r[0], 2) for m, r in rates.items()}
            self.state.proxy_errors = {m: None if r is None else round(r[1], 2) for m, r in rates.items()}
            self.state.proxy_queued = {models[p]: v["queued"] for p, v in counters.items() if p in models}

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

    def applying(self) -> bool:
        return bool(self.state.target)

    def record_stop(self) -> None:
        """Save that the controller stopped, for `status`."""
        with self.lock:
            self.state.stopped = time.time()
            save_controller_state(self.state_dir, self.state)

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
            with self.lock:  # the heartbeat `status` reads
                self.state.heartbeat = time.time()
                save_controller_state(self.state_dir, self.state)

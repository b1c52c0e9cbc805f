"""Client side: where each model answers, an open-loop load generator over tritonclient.grpc, and a
closed loop that keeps one model busy (benchmarks).

The load generator sends Poisson arrivals at each model's rate with the ordinary Triton
gRPC client (async_infer), so what it measures is what any client would see.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from tritonctl.planning.plan import Plan
from tritonctl.spec import DTYPES, ZERO_INPUTS


@dataclass(frozen=True)
class Endpoint:
    """Where a client sends requests for one model."""

    model: str
    url: str
    input_name: str
    input_dtype: str
    input_shape: tuple[int, ...]
    output_name: str
    slo_ms: float
    rate: float


def concrete_shape(shape: list[int]) -> tuple[int, ...]:
    """A tensor shape to send, with any dynamic dimension (-1) set to 1."""
    return tuple(d if d > 0 else 1 for d in shape)


def endpoints(plan: Plan) -> list[Endpoint]:
    return [
        Endpoint(
            model=m.name,
            url=f"{plan.runtime.host}:{m.port}",
            input_name=m.inputs[0].name,
            input_dtype=m.inputs[0].dtype,
            input_shape=concrete_shape(m.inputs[0].shape),
            output_name=m.outputs[0].name,
            slo_ms=m.slo_ms,
            rate=m.rate,
        )
        for m in plan.models
    ]


@dataclass
class LoadResult:
    model: str
    slo_ms: float
    duration_s: float
    sent_at_s: list[float] = field(default_factory=list)  # when each request went out, since the start
    latencies_ms: list[float] = field(default_factory=list)
    answered_at_s: list[float] = field(default_factory=list)  # when each answer came, since the start
    errors: list[str] = field(default_factory=list)
    failed_at_s: list[float] = field(default_factory=list)  # when each error came, since the start
    unanswered: int = 0  # requests the schedule sent whose answer never came within the run (not in sent_at_s)

    @property
    def sent(self) -> int:
        return len(self.sent_at_s) + self.unanswered

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    @property
    def throughput(self) -> float:
        return self.ok / self.duration_s

    def percentile(self, q: float, window: tuple[float, float] | None = None) -> float:
        """The q-th latency percentile, of the requests answered within `window` (seconds since the start) if given."""
        lat = self.latencies_ms
        if window is not None:
            lat = [x for x, t in zip(lat, self.answered_at_s, strict=True) if window[0] <= t <= window[1]]
        return float(np.percentile(lat, q)) if lat else float("nan")

    @property
    def within_slo(self) -> float:
        if not self.sent:
            return float("nan")
        return sum(1 for lat in self.latencies_ms if lat <= self.slo_ms) / self.sent

    def summary(self) -> dict:
        """What `format_results` prints of this model, as numbers (None where no request was answered)."""

        def number(x: float) -> float | None:
            return None if x != x else round(x, 3)  # NaN -> None

        return {
            "model": self.model,
            "slo_ms": self.slo_ms,
            "duration_s": self.duration_s,
            "sent": self.sent,
            "ok": self.ok,
            "failed": self.sent - self.ok,
            "offered_rps": round(self.sent / self.duration_s, 3),
            "ok_rps": round(self.throughput, 3),
            **{f"p{q}_ms": number(self.percentile(q)) for q in (50, 95, 99)},
            "within_slo": number(self.within_slo),
            "first_error": self.errors[0] if self.errors else None,
        }


def random_input(rng: np.random.Generator, shape: list[int], dtype: str) -> np.ndarray:
    """Uniform random input: floats in [0, 1), every byte value for uint8 (an image's), zeros for other integers
    (`ZERO_INPUTS`: indices, valid for any table)."""
    if dtype in ZERO_INPUTS:
        return np.zeros(shape, dtype)
    if dtype == "uint8":
        return rng.integers(0, 256, shape, dtype=np.uint8)
    return rng.random(shape).astype(dtype)


def random_request(endpoint: Endpoint, rng: np.random.Generator) -> grpcclient.InferInput:
    """A batch-1 request of uniform random input for the endpoint's model."""
    data = random_input(rng, [1, *endpoint.input_shape], endpoint.input_dtype)
    request = grpcclient.InferInput(
        endpoint.input_name, list(data.shape), DTYPES[data.dtype.name].removeprefix("TYPE_")
    )
    request.set_data_from_numpy(data)
    return request


def closed_loop(endpoint: Endpoint, stop: threading.Event, latencies_ms: list[float] | None = None) -> None:
    """One request after another until `stop`, each one's latency (ms) appended to `latencies_ms`."""
    request = random_request(endpoint, np.random.default_rng(0))
    with grpcclient.InferenceServerClient(endpoint.url) as client:
        while not stop.is_set():
            began = time.perf_counter()
            client.infer(endpoint.model, [request])
            if latencies_ms is not None:
                latencies_ms.append(1000 * (time.perf_counter() - began))


def _drive(endpoint: Endpoint, rate: float, duration_s: float, seed: int, out: LoadResult, origin: float) -> None:
    rng = np.random.default_rng(seed)
    infer_input = random_request(endpoint, rng)  # drawn first: the arrivals below follow from the same stream
    lock = threading.Lock()
    outstanding = threading.Semaphore(0)
    with grpcclient.InferenceServerClient(endpoint.url) as client:
        outputs = [grpcclient.InferRequestedOutput(endpoint.output_name)]

        def done(sent_at: float, result, error) -> None:  # tritonclient calls back with result=, error=
            now = time.perf_counter()
            with lock:
                if error is None:
                    out.latencies_ms.append((now - sent_at) * 1000)
                    out.answered_at_s.append(now - origin)
                else:
                    out.errors.append(str(error))
                    out.failed_at_s.append(now - origin)
            outstanding.release()

        start = time.perf_counter()
        next_at = start + rng.exponential(1 / rate)
        while next_at < start + duration_s:
            time.sleep(max(0.0, next_at - time.perf_counter()))
            sent_at = time.perf_counter()
            client.async_infer(
                endpoint.model,
                [infer_input],
                outputs=outputs,
                callback=functools.partial(done, sent_at),
                client_timeout=max(10.0, 20 * endpoint.slo_ms / 1000),
            )
            out.sent_at_s.append(sent_at - origin)
            next_at += rng.exponential(1 / rate)
        for _ in range(out.sent):
            if not outstanding.acquire(timeout=30):
                out.errors.append("no answer within 30 s")
                break


def run_load(targets: list[Endpoint], duration_s: float, rate_scale: float = 1.0, seed: int = 0) -> list[LoadResult]:
    """Send Poisson traffic to every endpoint at once for `duration_s`; one result per model."""
    results = [LoadResult(t.model, t.slo_ms, duration_s) for t in targets]
    origin = time.perf_counter()
    threads = [
        threading.Thread(
            target=_drive, args=(t, max(t.rate * rate_scale, 0.1), duration_s, seed + i, r, origin), daemon=True
        )
        for i, (t, r) in enumerate(zip(targets, results, strict=True))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def format_results(results: list[LoadResult], simulated: Mapping[str, float] | None = None) -> str:
    """One line per model: offered and achieved rate, latency percentiles, share within the SLO, failures
    (errors and requests never answered). With `simulated` (the plan's simulated p99 per model, at the rates
    loaded), that p99 beside the measured one and how far the measured one is off it."""
    head = (
        f"{'model':18} {'sent':>6} {'ok':>6} {'failed':>6} {'offered/s':>9} {'ok/s':>7} {'p50 ms':>8} "
        f"{'p95 ms':>8} {'p99 ms':>8} {'SLO ms':>7} {'in SLO':>7}"
    ) + (f" {'sim p99':>8} {'off':>6}" if simulated else "")
    lines = [head, "-" * len(head)]
    for r in results:
        p99 = r.percentile(99)
        line = (
            f"{r.model:18} {r.sent:6d} {r.ok:6d} {r.sent - r.ok:6d} {r.sent / r.duration_s:9.1f} "
            f"{r.throughput:7.1f} {r.percentile(50):8.1f} {r.percentile(95):8.1f} {p99:8.1f} "
            f"{r.slo_ms:7.0f} {100 * r.within_slo:6.1f}%"
        )
        if simulated:
            sim = simulated.get(r.model)
            answered = not math.isnan(p99)  # nan: nothing was answered
            line += f" {sim:8.1f} {100 * (p99 / sim - 1):+5.0f}%" if sim and answered else f" {'-':>8} {'-':>6}"
        lines.append(line)
    if simulated:
        lines.append("sim p99: the plan's simulated p99 at these rates; off: the measured p99 against it")
    return "\n".join(lines)

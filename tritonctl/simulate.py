"""`tritonctl simulate`: replay a workload against a plan, request by request, in simulated time.

Every instance is one executor behind Triton's dynamic batcher: a batch starts as soon as
the executor is free and either `batch` requests wait or the oldest has waited the queue
delay; it then takes what is queued, up to `batch`. A batch's execution time comes from
the fitted latency model, next to whichever co-runners on the same device are busy when
it starts. With `drop`, a request that can no longer meet its SLO when its batch forms is
dropped instead of served. Requests still queued when the simulated time ends count as
arrived but neither served nor dropped, so an overloaded plan shows its real throughput.

The simulation advances batch by batch, not request by request: arrivals are numpy arrays,
a queue is a pair of indices into them, and the latencies of a batch's requests are one
vector operation. Starts are processed in time order across instances, so the busy
co-runners a batch sees are exactly those whose batches cover its start.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from tritonctl.latency.model import LatencyModel
from tritonctl.plan import Plan


@dataclass
class _Instance:
    model: str
    device: str
    share: int
    batch: int
    delay_ms: float
    slo_ms: float
    arrivals: np.ndarray  # ms, sorted
    head: int = 0  # first request not yet taken into a batch
    free_at: float = 0.0
    running: tuple[float, int] = (-1.0, 0)  # (end, batch) of the batch in flight
    latencies: list[np.ndarray] = field(default_factory=list)
    dropped: int = 0


@dataclass(frozen=True)
class ModelResult:
    model: str
    arrived: int
    served: int
    good: int  # served within the SLO
    dropped: int
    mean_ms: float
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class SimResult:
    duration_s: float
    models: list[ModelResult]
    devices_used: int
    requests: int
    wall_s: float

    @property
    def throughput(self) -> float:
        return sum(m.served for m in self.models) / self.duration_s

    @property
    def goodput(self) -> float:
        return sum(m.good for m in self.models) / self.duration_s


def poisson_arrivals(rate: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (ms) of a Poisson process at `rate` per second over `duration_s`."""
    if rate <= 0:
        return np.empty(0)
    count = rng.poisson(rate * duration_s)
    return np.sort(rng.uniform(0.0, 1000.0 * duration_s, count))


def _next_start(inst: _Instance) -> float | None:
    """When the instance's next batch starts, given its queue and executor (None: no more work)."""
    if inst.head >= len(inst.arrivals):
        return None
    first = inst.arrivals[inst.head]
    full_at = inst.arrivals[inst.head + inst.batch - 1] if inst.head + inst.batch - 1 < len(inst.arrivals) else np.inf
    ready = min(full_at, first + inst.delay_ms)
    return max(inst.free_at, ready)


def simulate(
    plan: Plan,
    lm: LatencyModel,
    duration_s: float,
    seed: int = 0,
    drop: bool = False,
    rate_scale: float = 1.0,
) -> SimResult:
    """Poisson traffic at each model's rate (split evenly over its replicas) for `duration_s`."""
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    instances: list[_Instance] = []
    for model in plan.models:
        for p in model.placements:
            rate = model.rate * rate_scale / len(model.placements)
            instances.append(
                _Instance(
                    model.name,
                    p.device,
                    p.share,
                    p.batch,
                    p.queue_delay_us / 1000,
                    model.slo_ms,
                    poisson_arrivals(rate, duration_s, rng),
                )
            )
    by_device: dict[str, list[_Instance]] = {}
    for inst in instances:
        by_device.setdefault(inst.device, []).append(inst)
    exec_cache: dict[tuple, float] = {}
    heap = [(t, i) for i, inst in enumerate(instances) if (t := _next_start(inst)) is not None]
    heapq.heapify(heap)
    horizon_ms = 1000.0 * duration_s
    while heap:
        start, i = heapq.heappop(heap)
        if start >= horizon_ms:  # what is still queued at the end stays unserved
            continue
        inst = instances[i]
        queued_until = int(np.searchsorted(inst.arrivals, start, side="right"))
        take = min(inst.batch, queued_until - inst.head)
        busy = tuple(
            sorted(
                (o.model, o.share, o.running[1])
                for o in by_device[inst.device]
                if o is not inst and o.running[0] > start
            )
        )
        key = (inst.model, take, inst.share, busy)
        exec_ms = exec_cache.get(key)
        if exec_ms is None:
            exec_ms = exec_cache[key] = lm.t_inf(inst.model, take, inst.share, busy)
        batch = inst.arrivals[inst.head : inst.head + take]
        inst.head += take
        if drop:
            keep = batch + inst.slo_ms >= start + exec_ms
            inst.dropped += int(take - keep.sum())
            batch = batch[keep]
            if batch.size == 0:  # the whole batch was dropped: the executor stays free
                nxt = _next_start(inst)
                if nxt is not None:
                    heapq.heappush(heap, (nxt, i))
                continue
        end = start + exec_ms
        inst.free_at = end
        inst.running = (end, take)
        inst.latencies.append(end - batch)
        nxt = _next_start(inst)
        if nxt is not None:
            heapq.heappush(heap, (nxt, i))
    results = []
    for model in plan.models:
        mine = [inst for inst in instances if inst.model == model.name]
        lat = np.concatenate([x for inst in mine for x in inst.latencies] or [np.empty(0)])
        results.append(
            ModelResult(
                model=model.name,
                arrived=sum(len(inst.arrivals) for inst in mine),
                served=len(lat),
                good=int((lat <= model.slo_ms).sum()),
                dropped=sum(inst.dropped for inst in mine),
                mean_ms=float(lat.mean()) if len(lat) else float("nan"),
                p50_ms=float(np.percentile(lat, 50)) if len(lat) else float("nan"),
                p99_ms=float(np.percentile(lat, 99)) if len(lat) else float("nan"),
            )
        )
    return SimResult(
        duration_s=duration_s,
        models=results,
        devices_used=len(by_device),
        requests=sum(r.arrived for r in results),
        wall_s=time.perf_counter() - started,
    )


def format_sim(result: SimResult) -> str:
    head = f"{'model':18} {'arrived':>8} {'served':>8} {'in SLO':>7} {'dropped':>8} {'p50 ms':>8} {'p99 ms':>8}"
    lines = [head, "-" * len(head)]
    for m in result.models:
        lines.append(
            f"{m.model:18} {m.arrived:8d} {m.served:8d} {100 * m.good / max(m.arrived, 1):6.1f}% "
            f"{m.dropped:8d} {m.p50_ms:8.1f} {m.p99_ms:8.1f}"
        )
    lines.append(
        f"throughput {result.throughput:.1f}/s, goodput {result.goodput:.1f}/s on {result.devices_used} "
        f"device(s); {result.requests} requests simulated in {result.wall_s:.2f} s "
        f"({result.requests / max(result.wall_s, 1e-9):,.0f}/s)"
    )
    return "\n".join(lines)

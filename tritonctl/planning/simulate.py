"""`tritonctl simulate`: replay a workload against a plan, request by request, in simulated time.

Every instance sits behind Triton's dynamic batcher: a batch starts as soon as its executor
is free and either `batch` requests wait or the oldest has waited the queue delay; it then
takes what is queued, up to `batch`. A batch's time comes from the fitted latency model,
drawn around that prediction (a median) with the spread the profile measured
(`LatencyModel.sigma`), plus the wake-up the profile measured for an instance idle since its
last batch (`LatencyModel.wake_ms`; an instance's first batch counts as after a long idle), or with
`wake="device"` since the device's last batch (none beside a batch in flight; bench/wake_scope.py
compares the two against perf_analyzer).

Under spatial sharing each instance has its own executor and the prediction is the one next
to whichever co-runners on the device are busy when the batch starts. Under temporal sharing
(the whole plan, or the devices it lists under `turns`) the instances of a device have the
whole device each. A GPU gives it to one batch's GPU part at a time, in the order the batches
became ready; a batch's host part (`LatencyModel.host_ms`, what calibration measured Triton and
the glue adding) runs beside the others' (checked against perf_analyzer: bench/gpu_simulated.py).
A CPU runs every instance's batch at once and the kernel's scheduler shares the cores among
them: processor sharing, each instance on its threads of `shares.turn_layout`, all at full
speed while their threads fit the cores; beyond, the cores go by the instances' priority ranks
(`shares.turn_ranks`: the tighter SLO first, each rank weighing `shares.IDLE_STEP` times the
next), or in proportion to the threads where they are not ranked. A short batch that starts
beside a long one is slowed, not queued behind it; and every batch takes the interference of
the batches in flight when it starts, as a split device's does (the latency model's cache
pressure and scheduling terms, `LatencyModel.t_inf` `in_turns`; what it changes against
perf_analyzer: bench/turn_interference.py).

With `drop`, a request that can no longer meet its SLO when its batch forms is dropped
instead of served (knowing the batch's drawn latency, or under processor sharing its time
alone: an oracle; `runtime.reject_late` goes by the instance's fastest recent run).
Requests arrive for `duration_s`; batches go on starting for one SLO after that,
so that the last requests are judged like the others (a batched instance holds its last
requests for up to its queue delay). What is still queued then counts as arrived but neither
served nor dropped, so an overloaded plan shows its real throughput.

Arrivals are Poisson at each model's rate, or replayed from a trace (CSV `model,time_s`);
a model's requests are dealt to its replicas in turn, as HAProxy deals them: smooth weighted
round robin, each replica taking its weight's part at even intervals (`deal`). Where a model's
replicas weigh alike, HAProxy sends each request to the one with the fewest in progress
(`deploy.proxy.balance`), which queues them no longer than taking turns does.

`latency_error` X stands for a latency model that is off: every batch of model i runs (1 + e_i) times
as long as predicted, e_i drawn once per model uniformly in [-X, X] from the seed (a stream of its own,
so the arrivals are those of the same seed without errors). A fixed error per model, not noise per
batch, is what a mis-fitted profile does: the model is systematically slower (or faster) than every
plan expects, and a policy that sized its share to the prediction's edge misses its SLO throughout.

The simulation advances batch by batch, not request by request: arrivals are numpy arrays,
a queue is a pair of indices into them, and the latencies of a batch's requests are one
vector operation. Starts are processed in time order across instances, so the busy
co-runners a batch sees are exactly those whose batches cover its start. Devices never
interact, so a CPU device in turns is simulated on its own, from one batch's start or end to
the next, each batch in flight doing its speed's part of its time alone in between.
"""

from __future__ import annotations

import bisect
import csv
import heapq
import math
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from tritonctl.errors import TritonctlError
from tritonctl.latency.model import LatencyModel
from tritonctl.planning.plan import Plan, PlannedModel
from tritonctl.shares import Turn, rank_weight

MAX_ARRIVALS = 10_000_000  # a simulation holds every arrival in memory; ten million take minutes


@dataclass
class _Executor:
    free_at: float = 0.0
    running: tuple[float, int] = (-1.0, 0)  # (end, batch) of the batch in flight


@dataclass
class _Instance:
    model: str
    device: str
    share: int
    batch: int
    delay_ms: float
    slo_ms: float
    arrivals: np.ndarray  # ms, sorted
    executor: _Executor
    # The whole GPU it takes turns with: a batch's GPU part runs there one at a time, its host part
    # (`LatencyModel.host_ms`) beside the others' batches.
    gpu: _Executor | None = None
    times: list[float] = field(default_factory=list)  # the arrivals as a list: scalar lookups are cheaper
    head: int = 0  # first request not yet taken into a batch
    batches: list[tuple[int, int, float]] = field(default_factory=list)  # (first served, count, end) per batch
    dropped: int = 0
    idle_since: float = -math.inf  # when its last batch ended: what it waits for next is its wake-up

    def __post_init__(self) -> None:
        self.times = self.arrivals.tolist()

    def latencies(self) -> np.ndarray:
        """Every served request's latency, from the batches' records."""
        if not self.batches:
            return np.empty(0)
        first, count, end = (np.array(x) for x in zip(*self.batches, strict=True))
        offsets = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        return np.repeat(end, count) - self.arrivals[np.repeat(first, count) + offsets]


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
    replicas: tuple[tuple[int, int], ...]  # (arrived, served) per placement, in the plan's order


@dataclass(frozen=True)
class SimResult:
    duration_s: float
    models: list[ModelResult]
    devices_used: int
    requests: int
    wall_s: float
    latency_errors: dict[str, float] = field(default_factory=dict)  # e_i per model (empty without errors)

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


def read_trace(path: Path) -> dict[str, np.ndarray]:
    """A trace file: CSV with a header `model,time_s`, one request per row; times in seconds from 0."""
    times: dict[str, list[float]] = {}
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or not {"model", "time_s"} <= set(reader.fieldnames):
                raise TritonctlError("a trace needs the columns model,time_s", file=path)
            for line, row in enumerate(reader, start=2):
                try:
                    t = float(row["time_s"])
                except (TypeError, ValueError):
                    raise TritonctlError(
                        f"time_s {row['time_s']!r} is not a number", file=path, field=f"line {line}"
                    ) from None
                if not math.isfinite(t) or t < 0:
                    raise TritonctlError(f"time_s {t} is not a time from 0", file=path, field=f"line {line}")
                times.setdefault(row["model"], []).append(1000.0 * t)
    except OSError as exc:
        raise TritonctlError(f"cannot read the trace ({exc.strerror})", file=path) from None
    return {m: np.sort(np.array(ts)) for m, ts in times.items()}


def _normals(rng: np.random.Generator, block: int = 4096) -> Iterator[float]:
    """The generator's standard normals one by one, drawn in blocks (the same numbers, a fraction of the cost)."""
    while True:
        yield from rng.standard_normal(block).tolist()


def _next_start(inst: _Instance) -> float | None:
    """When the instance's next batch starts, given its queue and executor (None: no more work)."""
    times, head = inst.times, inst.head
    if head >= len(times):
        return None
    last = head + inst.batch - 1
    ready = min(times[last], times[head] + inst.delay_ms) if last < len(times) else times[head] + inst.delay_ms
    return max(inst.executor.free_at, ready)


def _arrivals(
    plan: Plan, duration_s: float, rate_scale: float, trace: dict[str, np.ndarray] | None, seed: int
) -> dict[str, list[np.ndarray]]:
    """Each model's arrivals (ms), dealt to its replicas in turn (`deal`)."""
    out = {}
    for model in plan.models:
        # one stream per model, named by it: every plan of a cluster sees the same arrivals (common random numbers)
        rng = np.random.default_rng([seed, zlib.crc32(model.name.encode())])
        if trace is None:
            times = poisson_arrivals(model.rate * rate_scale, duration_s, rng)
        else:
            times = trace.get(model.name, np.empty(0))
            times = times[times < 1000.0 * duration_s]
        replica = deal([p.weight for p in model.placements], len(times))
        out[model.name] = [times[replica == k] for k in range(len(model.placements))]
    return out


def deal(weights: list[float], count: int) -> np.ndarray:
    """Which replica each of `count` requests in arrival order goes to: smooth weighted round robin (every
    replica gains its weight, the one ahead takes the request and gives back the sum), so each takes its part
    of the requests at even intervals; alike weights take turns."""
    if len(set(weights)) <= 1:
        return np.arange(count) % max(1, len(weights))
    ahead, total, out = [0.0] * len(weights), sum(weights), np.empty(count, np.int64)
    for i in range(count):
        ahead = [a + w for a, w in zip(ahead, weights, strict=True)]
        k = max(range(len(ahead)), key=ahead.__getitem__)
        ahead[k] -= total
        out[i] = k
    return out


def _woken(inst: _Instance, device: list[_Instance], start: float, wake: str, beside: tuple) -> float:
    """Since when the batch that starts at `start` has been idle, for its wake-up: the instance's last batch's end
    (`wake` "instance"), or the device's: `start` beside a batch in flight (`beside`, the co-runners busy at
    `start`), else the last end of any batch there."""
    if wake == "instance":
        return inst.idle_since
    return start if beside else max(other.idle_since for other in device)


def _gpu_turn(gpu: _Executor, start: float, exec_ms: float, host_ms: float) -> float:
    """How long a batch of `exec_ms` alone, `host_ms` of it the host's, takes from `start` when it takes turns with
    the whole `gpu`: its host part first, beside the others' batches, then its GPU part once the GPU is free."""
    host = min(host_ms, exec_ms)
    return max(start + host, gpu.free_at) + exec_ms - host - start


def _take(inst: _Instance, start: float) -> int:
    """How many requests the instance's batch that starts at `start` takes: those queued, up to its batch size."""
    return min(inst.batch, bisect.bisect_right(inst.times, start, inst.head) - inst.head)


def _serve(inst: _Instance, take: int, start: float, exec_ms: float, drop: bool) -> int:
    """Take `take` requests off the queue for a batch of `exec_ms` from `start`; with `drop`, drop those it
    would serve late (the oldest: a prefix). Returns the first one served (`inst.head`: all were dropped)."""
    head = inst.head
    inst.head += take
    if not drop:
        return head
    first = bisect.bisect_left(inst.times, start + exec_ms - inst.slo_ms, head, head + take)
    inst.dropped += first - head
    return first


def _speeds(weights: list[float], threads: list[int], cores: float) -> list[float]:
    """Each running batch's speed (a part of its speed alone, on its threads) while the kernel shares `cores`
    among the batches by their weights (`shares.rank_weight`): in proportion to the weights, none more cores
    than its threads, what a capped one leaves going to the others (water-filling; alike weights and k threads
    each: min(1, cores / (k n)) each)."""
    speeds = [0.0] * len(weights)
    left, rest = cores, sum(weights)
    for i in sorted(range(len(weights)), key=lambda i: threads[i] / weights[i]):  # the first capped come first
        used = min(threads[i], left * weights[i] / rest)
        speeds[i] = used / threads[i]
        left, rest = left - used, rest - weights[i]
    return speeds


def _share_cores(
    instances: list[_Instance],
    draw: Callable[[_Instance, int, tuple, float], float],
    horizon_ms: float,
    drop: bool,
    cores: float,
    threads: list[int],
    weights: list[float],
    wake: str,
) -> None:
    """One CPU device of `cores` in turns: every instance's batch runs at once on its `threads`, at the speed
    `_speeds` gives it by the instances' `weights` among the batches in flight (all at full speed while
    their threads fit the cores). A batch's work is its time beside the batches in flight when it starts
    (`draw`); it ends when the speeds it ran at have done it."""
    now = 0.0
    ready = [(t, k) for k, inst in enumerate(instances) if (t := _next_start(inst)) is not None]
    heapq.heapify(ready)
    running: list[list] = []  # per batch in flight: [work left (ms at full speed), instance, first served, count, size]
    busy = 0  # the threads of the batches in flight
    speeds_of: dict[tuple[int, ...], list[float]] = {}  # the instances in flight, in order -> their speeds
    while ready or running:
        speeds = None  # all at full speed
        if busy > cores:
            key = tuple(b[1] for b in running)
            speeds = speeds_of.get(key) or speeds_of.setdefault(
                key, _speeds([weights[k] for k in key], [threads[k] for k in key], cores)
            )
        first_done, left = None, math.inf  # the batch that ends first, and the wall time until it does
        for i, batch in enumerate(running):
            t = batch[0] if speeds is None else batch[0] / speeds[i]
            if t < left:
                first_done, left = batch, t
        end = now + left
        step = min(end, ready[0][0]) - now if ready else left
        for i, batch in enumerate(running):
            batch[0] -= step if speeds is None else speeds[i] * step
        now += step
        if ready and ready[0][0] < end:
            start, k = heapq.heappop(ready)
            inst = instances[k]
            if start >= horizon_ms + inst.slo_ms:  # what is still queued now could only be late: it stays unserved
                continue
            take = _take(inst, start)
            beside = (
                tuple(sorted((instances[b[1]].model, instances[b[1]].share, b[4]) for b in running)) if running else ()
            )
            exec_ms = draw(inst, take, beside, start - _woken(inst, instances, start, wake, beside))
            first = _serve(inst, take, start, exec_ms, drop)
            if first < inst.head:
                running.append([exec_ms, k, first, inst.head - first, take])
                busy += threads[k]
                continue
        else:
            running.remove(first_done)
            _, k, first, count, _ = first_done
            busy -= threads[k]
            inst = instances[k]
            inst.batches.append((first, count, now))
            inst.idle_since = inst.executor.free_at = now
        nxt = _next_start(inst)
        if nxt is not None:
            heapq.heappush(ready, (nxt, k))


def latency_errors(plan: Plan, seed: int, latency_error: float) -> dict[str, float]:
    """The fixed error e_i per model of the plan that `simulate` draws for `seed` within +-`latency_error` (none
    without one): model i's batches run (1 + e_i) times as long as predicted."""
    if not latency_error:
        return {}
    draws = np.random.default_rng([seed, 1]).uniform(-latency_error, latency_error, len(plan.models))
    return {m.name: float(e) for m, e in zip(plan.models, draws, strict=True)}


def simulate(
    plan: Plan,
    lm: LatencyModel,
    duration_s: float,
    seed: int = 0,
    drop: bool = False,
    rate_scale: float = 1.0,
    trace: dict[str, np.ndarray] | None = None,
    latency_error: float = 0.0,
    wake: str = "instance",
) -> SimResult:
    """Poisson traffic at each model's rate (or the `trace`) for `duration_s`; batches off the latency
    model by a fixed factor per model within +-`latency_error`."""
    if not 0 <= latency_error < 1:
        raise TritonctlError(f"latency error {latency_error} must be in [0, 1)", field="--latency-error")
    if wake not in ("instance", "device"):
        raise TritonctlError(f"wake {wake!r} must be 'instance' or 'device'")
    expected = duration_s * rate_scale * sum(m.rate for m in plan.models) if trace is None else 0.0
    if expected > MAX_ARRIVALS:
        raise TritonctlError(
            f"{duration_s:g} s at {rate_scale:g}x the plan's rates is about {expected:,.0f} requests, more than the "
            f"{MAX_ARRIVALS:,} a simulation holds: simulate less time or a lower rate scale",
            field="--duration",
        )
    started = time.perf_counter()
    arrivals = _arrivals(plan, duration_s, rate_scale, trace, seed)
    errors = latency_errors(plan, seed, latency_error)
    spread = _normals(np.random.default_rng([seed, 2]))  # each batch's draw around the predicted latency
    exec_cache: dict[tuple, tuple[float, float]] = {}  # -> (predicted batch time, its spread's sigma)

    def draw(inst: _Instance, take: int, busy: tuple, idle_ms: float, in_turns: bool = False) -> float:
        """One batch's time: the prediction next to the `busy` co-runners (`in_turns`: their interference alone,
        the cores' sharing is the caller's), drawn around, plus the wake-up after `idle_ms`."""
        key = (inst.model, take, inst.share, busy, in_turns)
        cached = exec_cache.get(key)
        if cached is None:
            predicted = lm.t_inf(inst.model, take, inst.share, busy, in_turns) * (1 + errors.get(inst.model, 0.0))
            cached = exec_cache[key] = (predicted, lm.sigma(inst.model, take))
        exec_ms, sigma = cached
        if sigma:
            exec_ms *= math.exp(sigma * next(spread))
        return exec_ms + lm.wake_ms(inst.model, idle_ms)

    kinds = {d.id: d.kind for d in plan.devices}
    shared = {d.id: _Executor() for d in plan.devices}
    layout = plan.turn_layout()
    instances: list[_Instance] = []
    turn_of: dict[int, Turn] = {}  # instance (its index) taking turns with a CPU -> how it runs
    for model in plan.models:
        for k, p in enumerate(model.placements):
            gpu_turns = plan.takes_turns(p.device) and kinds[p.device] == "gpu"
            turn = layout[p.instance] if plan.takes_turns(p.device) and kinds[p.device] == "cpu" else None
            if turn is not None:
                turn_of[len(instances)] = turn
            instances.append(
                _Instance(
                    model.name,
                    p.device,
                    turn.share if turn is not None else p.share,
                    p.batch,
                    p.queue_delay_us / 1000,
                    model.slo_ms,
                    arrivals[model.name][k],
                    _Executor(),
                    shared[p.device] if gpu_turns else None,
                )
            )
    by_device: dict[str, list[_Instance]] = {}
    for inst in instances:
        by_device.setdefault(inst.device, []).append(inst)
    horizon_ms = 1000.0 * duration_s
    cores_in_turns = [d for d in by_device if plan.takes_turns(d) and kinds[d] == "cpu"]  # in the plan's order:
    for device in cores_in_turns:  # they draw from one stream, so the same seed gives the same run
        held = [turn_of[i] for i, inst in enumerate(instances) if inst.device == device]
        threads = [turn.threads for turn in held]
        cores = max(plan.device(device).cores, *threads)  # fewer cores than threads already slow each batch alone
        weights = [rank_weight(turn.rank) for turn in held]
        _share_cores(by_device[device], partial(draw, in_turns=True), horizon_ms, drop, cores, threads, weights, wake)
    heap = [
        (t, i)
        for i, inst in enumerate(instances)
        if inst.device not in cores_in_turns and (t := _next_start(inst)) is not None
    ]
    heapq.heapify(heap)
    while heap:
        start, i = heapq.heappop(heap)
        inst = instances[i]
        if start >= horizon_ms + inst.slo_ms:  # what is still queued now could only be late: it stays unserved
            continue
        take = _take(inst, start)
        busy = (
            ()
            if inst.gpu is not None
            else tuple(
                sorted(
                    (o.model, o.share, o.executor.running[1])
                    for o in by_device[inst.device]
                    if o is not inst and o.executor.running[0] > start
                )
            )
        )
        exec_ms = draw(inst, take, busy, start - _woken(inst, by_device[inst.device], start, wake, busy))
        if inst.gpu is not None:
            exec_ms = _gpu_turn(inst.gpu, start, exec_ms, lm.host_ms(inst.model, take))
        first = _serve(inst, take, start, exec_ms, drop)
        if first < inst.head:  # else the whole batch was dropped: the executor stays free
            end = start + exec_ms
            if inst.gpu is not None:
                inst.gpu.free_at = end
            inst.idle_since = inst.executor.free_at = end
            inst.executor.running = (end, take)
            inst.batches.append((first, inst.head - first, end))
        nxt = _next_start(inst)
        if nxt is not None:
            heapq.heappush(heap, (nxt, i))
    results = []
    for model in plan.models:
        mine = [inst for inst in instances if inst.model == model.name]
        lat = np.concatenate([inst.latencies() for inst in mine])
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
                replicas=tuple((len(inst.arrivals), sum(c for _, c, _ in inst.batches)) for inst in mine),
            )
        )
    return SimResult(
        duration_s=duration_s,
        models=results,
        devices_used=len(by_device),
        requests=sum(r.arrived for r in results),
        wall_s=time.perf_counter() - started,
        latency_errors=errors,
    )


SIMULATED_REQUESTS = 50_000  # behind a plan's simulated figures: thousands a model, so that each p99 is steady
SIMULATED_S = (2.0, 3600.0)  # the simulated time that takes, within these bounds
SIMULATED_MEETS = 0.99  # a model the simulation answers this part of within its SLO meets it


def with_simulation(plan: Plan, lm: LatencyModel) -> Plan:
    """The plan with each model's `simulated_in_slo` and `simulated_p99_ms` from a seeded simulation at its rates
    (neither for a model without traffic):
    what a load generator should measure, where a placement's own prediction (eq. 2 at its predicted batch time)
    leaves out the spread of batch times and the wake-up of an idle instance."""
    total = sum(m.rate for m in plan.models)
    if not total:
        return plan
    result = simulate(plan, lm, duration_s=min(max(SIMULATED_REQUESTS / total, SIMULATED_S[0]), SIMULATED_S[1]))
    models = []
    for model, outcome in zip(plan.models, result.models, strict=True):
        if not outcome.arrived:  # a model without traffic: nothing to judge
            models.append(model)
            continue
        answered = outcome.served and outcome.served >= SIMULATED_MEETS * outcome.arrived
        update = {
            "simulated_in_slo": round(outcome.good / max(outcome.arrived, 1), 4),
            "simulated_p99_ms": round(outcome.p99_ms, 3) if answered else None,
        }
        models.append(model.model_copy(update=update))
    return plan.model_copy(update={"models": models})


def simulated_misses(plan: Plan) -> list[PlannedModel]:
    """The models a simulated plan answers less than SIMULATED_MEETS of within their SLO."""
    return [m for m in plan.models if m.simulated_in_slo is not None and m.simulated_in_slo < SIMULATED_MEETS]


def format_sim(result: SimResult) -> str:
    head = f"{'model':18} {'arrived':>8} {'served':>8} {'in SLO':>7} {'dropped':>8} {'p50 ms':>8} {'p99 ms':>8}"
    lines = [head, "-" * len(head)]
    for m in result.models:
        if m.arrived:
            judged = f"{100 * m.good / m.arrived:6.1f}% {m.dropped:8d} {m.p50_ms:8.1f} {m.p99_ms:8.1f}"
        else:  # no arrival: nothing to judge
            judged = f"{'-':>7} {0:8d} {'-':>8} {'-':>8}"
        lines.append(f"{m.model:18} {m.arrived:8d} {m.served:8d} {judged}")
    if result.latency_errors:
        lines.append(
            "latency model errors: " + ", ".join(f"{m} {100 * e:+.1f}%" for m, e in result.latency_errors.items())
        )
    lines.append(
        f"throughput {result.throughput:.1f}/s, goodput {result.goodput:.1f}/s on {result.devices_used} "
        f"device(s); {result.requests} requests simulated in {result.wall_s:.2f} s "
        f"({result.requests / max(result.wall_s, 1e-9):,.0f}/s)"
    )
    return "\n".join(lines)

"""Task latency with queueing, InSS eq. 2.

A task of model i arrives when G tasks are already queued, so the queued work including it
is W = G + 1 (tasks are of batch size 1). With batch size b and execution time t_inf of a
batch, and exec the time left of the batch running when it arrives:

    W >= b:  T = exec + ceil(W / b) * t_inf                 (waits behind earlier batches)
    W <  b:  T = max(exec, (b - W) / rate) + t_inf          (waits for the batch to fill)

`eq2` is that formula. `sample_task_latency` applies it to every task of a seeded Poisson
arrival sequence, taking G and exec from a batch server that runs full batches of b.

Planners ask this question thousands of times, so `task_latency` answers from a table. The
answer scales: with time measured in units of t_inf, latency depends only on the batch and
the load rho = rate * t_inf / b, so T = t_inf * F_b(rho). For each batch, F_b is sampled
once on a grid of loads and interpolated; what is tabulated is rho * F_b(rho), which stays
finite as rho -> 0 where waiting for a batch to fill dominates (T ~ (b - 1) / rate).
Besides mean and p99 the table keeps a ladder of quantiles, so that `in_slo` can say which
part of the tasks finish within an SLO, and `goodput` how many requests per second do.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

SAMPLE_TASKS = 2000
OVERLOAD_LOSS = 0.05  # see `goodput`
# Loads at which F_b is sampled: log-spaced, denser towards saturation where F_b is steep.
_LOADS = np.unique(np.concatenate([np.geomspace(1e-3, 0.9, 240), 1 - np.geomspace(0.1, 2e-3, 80)]))
# Quantile levels of the latency distribution kept per load, for the share of tasks within an SLO.
LEVELS = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0])


_QUEUEING = contextvars.ContextVar("queueing", default=True)


@contextlib.contextmanager
def without_queueing() -> Iterator[None]:
    """Within it a task takes its batch's time alone: no wait for the batch to fill or for the batches ahead
    (still overloaded from a load of 1). The queueing model switched off, for `bench --ablate`."""
    token = _QUEUEING.set(False)
    try:
        yield
    finally:
        _QUEUEING.reset(token)


@functools.lru_cache(maxsize=8)
def _unit_arrivals(seed: int, tasks: int) -> np.ndarray:
    """Poisson arrival times at rate 1, fixed per seed so that every query sees the same sample."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0, tasks))


def eq2(queued_with_task, batch: int, t_inf_ms: float, exec_left_ms, rate: float):
    """InSS eq. 2: the latency (ms) of tasks that find `queued_with_task - 1` tasks queued (scalars or arrays)."""
    behind = exec_left_ms + np.ceil(queued_with_task / batch) * t_inf_ms
    filling = np.maximum(exec_left_ms, 1000.0 * (batch - queued_with_task) / rate) + t_inf_ms
    return np.where(queued_with_task >= batch, behind, filling)


@dataclass(frozen=True)
class TaskLatency:
    mean_ms: float
    p99_ms: float
    stable: bool  # False when the arrival rate exceeds what batches of b can serve


def sample_latencies(rate: float, batch: int, t_inf_ms: float, seed: int = 0, tasks: int = SAMPLE_TASKS) -> np.ndarray:
    """Task latencies (ms) of a seeded Poisson arrival sequence at `rate` by eq. 2 (the load must be below 1)."""
    arrivals = _unit_arrivals(seed, tasks) * (1000.0 / rate)  # ms
    # The batch server: batch k holds tasks [k*b, (k+1)*b) and starts when its last task has
    # arrived and the previous batch is done: end_k = max(end_{k-1}, A_k) + t, whose closed
    # form is end_k = (k+1) t + max_{j<=k} (A_j - j t).
    n_batches = tasks // batch
    last_arrivals = arrivals[batch - 1 :: batch][:n_batches]
    k = np.arange(n_batches)
    ends = (k + 1) * t_inf_ms + np.maximum.accumulate(last_arrivals - k * t_inf_ms)
    starts = ends - t_inf_ms
    # Just before each arrival: the last batch started, the time it has left, the tasks queued. A
    # batch starting at the very arrival of its last task must not count as started before it:
    # the closed form can land a rounding error early, hence the tolerance.
    last = np.searchsorted(starts, arrivals - 1e-9 * t_inf_ms, side="left") - 1
    exec_left = np.where(last >= 0, np.maximum(0.0, ends[np.maximum(last, 0)] - arrivals), 0.0)
    queued = np.maximum(0, np.arange(tasks) - (last + 1) * batch)
    return eq2(queued + 1, batch, t_inf_ms, exec_left, rate)


def sample_batcher_latencies(
    rate: float, t_inf_ms: Sequence[float], delay_ms: float, seed: int = 0, tasks: int = SAMPLE_TASKS
) -> np.ndarray:
    """Task latencies (ms) of a seeded Poisson arrival sequence at `rate` through Triton's dynamic batcher: the
    instance, once free, runs what is queued (at most len(t_inf_ms), the batch) as soon as a whole batch waits
    or the oldest request has waited `delay_ms`; a batch of k takes t_inf_ms[k - 1]. With no limit on the wait
    its batches are those of eq. 2's batch server, whose formula waits the mean time to fill one. The sequence
    runs a batch beyond the `tasks` it reports, so that the last of them do not wait out the delay for requests
    that never come."""
    batch, times = len(t_inf_ms), list(t_inf_ms)
    arrivals = (_unit_arrivals(seed, tasks + batch) * (1000.0 / rate)).tolist()  # ms; Python floats: a loop reads them
    latencies = np.empty(tasks)
    head, free = 0, 0.0
    while head < tasks:
        start = max(free, min(arrivals[head + batch - 1], arrivals[head] + delay_ms))
        taken = min(batch, bisect.bisect_right(arrivals, start) - head)
        free = start + times[taken - 1]
        for k in range(head, min(head + taken, tasks)):
            latencies[k] = free - arrivals[k]
        head += taken
    return latencies


def batcher_latency(
    rate: float, t_inf_ms: tuple[float, ...], delay_ms: float, slo_ms: float
) -> tuple[TaskLatency, float]:
    """Mean and p99 latency, and the share of requests within `slo_ms`, through the dynamic batcher
    (`sample_batcher_latencies`); not stable where full batches cannot keep up with the rate. Without the
    queueing model (`without_queueing`), a request takes the full batch's time."""
    if not _QUEUEING.get():
        return TaskLatency(t_inf_ms[-1], t_inf_ms[-1], True), float(t_inf_ms[-1] <= slo_ms)
    return _batcher_latency(rate, t_inf_ms, delay_ms, slo_ms)


@functools.lru_cache(maxsize=1024)
def _batcher_latency(
    rate: float, t_inf_ms: tuple[float, ...], delay_ms: float, slo_ms: float
) -> tuple[TaskLatency, float]:
    if rate <= 0:
        return TaskLatency(t_inf_ms[0], t_inf_ms[0], True), float(t_inf_ms[0] <= slo_ms)
    if rate * t_inf_ms[-1] / 1000.0 >= len(t_inf_ms):
        return TaskLatency(math.inf, math.inf, False), 0.0
    latencies = sample_batcher_latencies(rate, t_inf_ms, delay_ms)
    within = float(np.mean(latencies <= slo_ms))
    return TaskLatency(float(latencies.mean()), float(np.percentile(latencies, 99)), True), within


@functools.lru_cache(maxsize=1024)  # off the tables' loads (nearly saturated) a planner asks the same again
def sample_task_latency(
    rate: float, batch: int, t_inf_ms: float, seed: int = 0, tasks: int = SAMPLE_TASKS
) -> TaskLatency:
    """Mean and p99 task latency under Poisson arrivals at `rate` (requests/s), by eq. 2 on a sample."""
    if rate <= 0:
        return TaskLatency(t_inf_ms, t_inf_ms, True)
    if rate * t_inf_ms / 1000.0 >= batch:
        return TaskLatency(math.inf, math.inf, False)
    latencies = sample_latencies(rate, batch, t_inf_ms, seed, tasks)
    return TaskLatency(float(latencies.mean()), float(np.percentile(latencies, 99)), True)


@functools.lru_cache(maxsize=64)
def _table(batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rho * F_b(rho) for the mean, the p99 and every quantile of LEVELS at every load of `_LOADS` (t_inf = 1 ms)."""
    samples = [sample_latencies(rho * batch * 1000.0, batch, 1.0) for rho in _LOADS]
    mean = _LOADS * np.array([x.mean() for x in samples])
    p99 = _LOADS * np.array([np.percentile(x, 99) for x in samples])
    quantiles = _LOADS[:, None] * np.array([np.quantile(x, LEVELS) for x in samples])
    return mean, p99, quantiles


_LOAD_LIST, _LEVEL_LIST = _LOADS.tolist(), LEVELS.tolist()


@functools.lru_cache(maxsize=64)
def _ladders(batch: int) -> list[list[float]]:
    """`_table`'s quantiles of `batch` as Python lists, one ladder per load, for `in_slo`."""
    return _table(batch)[2].tolist()


def warm_tables(max_batch: int) -> None:
    """Build the tables of batches 1..`max_batch` now (tens of milliseconds each) rather than on first use."""
    for batch in range(1, max_batch + 1):
        _table(batch)


def task_latency(rate: float, batch: int, t_inf_ms: float) -> TaskLatency:
    """Mean and p99 task latency under Poisson arrivals at `rate` (requests/s): `sample_task_latency`
    interpolated from its table for the batch (p99 within 2.5%, mean within 1%; a few microseconds)."""
    rho = rate * t_inf_ms / (1000.0 * batch)
    if rho >= 1:
        return TaskLatency(math.inf, math.inf, False)
    if not _QUEUEING.get():
        return TaskLatency(t_inf_ms, t_inf_ms, True)
    if not _LOADS[0] <= rho <= _LOADS[-1]:  # nearly idle or nearly saturated: sample it
        return sample_task_latency(rate, batch, t_inf_ms)
    mean, p99, _ = _table(batch)
    scale = t_inf_ms / rho
    return TaskLatency(float(np.interp(rho, _LOADS, mean)) * scale, float(np.interp(rho, _LOADS, p99)) * scale, True)


@functools.lru_cache(maxsize=4)
def _p99_rows(max_batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The p99 column of `_table` for batches 1..max_batch, one row each; each row's slopes between loads; 1000 x
    the batch; and where each row starts in the two flattened."""
    rows = np.stack([_table(b)[1] for b in range(1, max_batch + 1)])
    slopes = (rows[:, 1:] - rows[:, :-1]) / (_LOADS[1:] - _LOADS[:-1])
    batches = np.arange(max_batch)  # batch - 1
    return rows, slopes, 1000.0 * (batches + 1), batches * rows.shape[1], batches * slopes.shape[1]


def p99s(rate: float, t_inf_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`task_latency`'s p99 and stability for batches 1, 2 ... len(t_inf_ms) at once, batch b taking
    t_inf_ms[b - 1]: the same values (the table read as `np.interp` reads it), for a scan over batch sizes."""
    n = len(t_inf_ms)
    if rate <= 0:
        return t_inf_ms.astype(float), np.ones(n, dtype=bool)
    (rows, slopes, per_batch, row_starts, slope_starts), loads = _p99_rows(n), _LOADS
    rho = rate * t_inf_ms / per_batch
    stable = rho < 1
    if not _QUEUEING.get():
        return np.where(stable, t_inf_ms, np.inf), stable
    j = np.searchsorted(loads, rho, side="right") - 1  # -1 below the table, len(loads) - 1 at or beyond its end
    inside = 0 <= j.min() and j.max() < len(loads) - 1
    np.clip(j, 0, len(loads) - 2, out=j)
    p99 = (slopes.take(slope_starts + j) * (rho - loads.take(j)) + rows.take(row_starts + j)) * (t_inf_ms / rho)
    if inside:
        return p99, stable
    p99[~stable] = np.inf
    for k in np.flatnonzero(stable & ((rho < loads[0]) | (rho >= loads[-1]))):  # at or beyond the table's ends
        if rho[k] == loads[-1]:
            p99[k] = rows[k, -1] * (t_inf_ms[k] / rho[k])
        else:  # nearly idle or nearly saturated
            p99[k] = sample_task_latency(rate, int(k + 1), float(t_inf_ms[k])).p99_ms
    return p99, stable


@functools.lru_cache(maxsize=1)
def _p99_lists(max_batch: int) -> tuple[list[list[float]], list[list[float]]]:
    """`_p99_rows`' rows and slopes as Python lists, for `p99_of`."""
    rows, slopes, *_ = _p99_rows(max_batch)
    return rows.tolist(), slopes.tolist()


def p99_of(rate: float, batch: int, t_inf_ms: float, max_batch: int) -> float:
    """One entry of `p99s` (batch `batch` of 1 ... `max_batch`), computed as `p99s` computes it in Python floats:
    a scan's binary search reads a few of its batch sizes, and numpy's cost per call would be most of the answer."""
    if rate <= 0:
        return t_inf_ms
    rho = rate * t_inf_ms / (1000.0 * batch)
    if not rho < 1:
        return math.inf
    if not _QUEUEING.get():
        return t_inf_ms
    loads = _LOAD_LIST
    rows, slopes = _p99_lists(max_batch)
    if rho == loads[-1]:
        return rows[batch - 1][-1] * (t_inf_ms / rho)
    if rho < loads[0] or rho > loads[-1]:  # nearly idle or nearly saturated
        return sample_task_latency(rate, batch, t_inf_ms).p99_ms
    j = bisect.bisect_right(loads, rho) - 1
    return (slopes[batch - 1][j] * (rho - loads[j]) + rows[batch - 1][j]) * (t_inf_ms / rho)


class P99Scan(Sequence[float]):
    """`p99s(rate, times)[0]` read entry by entry (index batch - 1), each computed when first read (`p99_of`)."""

    def __init__(self, rate: float, times: list[float]):
        self.rate, self.times = rate, times
        self._p99: list[float | None] = [None] * len(times)

    def __len__(self) -> int:
        return len(self.times)

    def __getitem__(self, k: int) -> float:  # type: ignore[override]  # an index from 0, no slices
        p99 = self._p99[k]
        if p99 is None:
            p99 = self._p99[k] = p99_of(self.rate, k + 1, self.times[k], len(self.times))
        return p99


def in_slo(rate: float, batch: int, t_inf_ms: float, slo_ms: float) -> float:
    """The share of tasks whose latency by eq. 2 is within `slo_ms`, under Poisson arrivals at `rate`
    (0 when the rate overloads batches of this size; see `goodput` for what is served then)."""
    if rate <= 0:
        return 1.0 if t_inf_ms <= slo_ms else 0.0
    rho = rate * t_inf_ms / (1000.0 * batch)
    if rho >= 1:
        return 0.0
    if not _QUEUEING.get():
        return 1.0 if t_inf_ms <= slo_ms else 0.0
    if not _LOADS[0] <= rho <= _LOADS[-1]:
        return _sampled_in_slo(rate, batch, t_inf_ms, slo_ms)
    # The ladder of the quantiles at rho, interpolated between the two loads around it, read where the SLO falls
    # on it as np.interp reads it (the same value): in Python floats, a few entries of it, since a planner asks
    # this thousands of times a decision and numpy's cost per call would be most of the answer's.
    loads, ladders, levels = _LOAD_LIST, _ladders(batch), _LEVEL_LIST
    i = min(bisect.bisect_right(loads, rho) - 1, len(loads) - 2)
    w, scale = (rho - loads[i]) / (loads[i + 1] - loads[i]), t_inf_ms / rho
    v, below, above = 1 - w, ladders[i], ladders[i + 1]
    low, high = 0, len(levels)  # the first rung above the SLO
    while low < high:
        mid = (low + high) // 2
        if (v * below[mid] + w * above[mid]) * scale <= slo_ms:
            low = mid + 1
        else:
            high = mid
    if low == 0:
        return levels[0]
    j = low - 1
    rung = (v * below[j] + w * above[j]) * scale
    if low == len(levels) or rung == slo_ms:
        return levels[j]
    step = (v * below[low] + w * above[low]) * scale - rung
    return (levels[low] - levels[j]) / step * (slo_ms - rung) + levels[j]


@functools.lru_cache(maxsize=1024)
def _sampled_in_slo(rate: float, batch: int, t_inf_ms: float, slo_ms: float) -> float:
    """`in_slo` off the tables' loads, from a sample (kept, as `sample_task_latency`)."""
    return float((sample_latencies(rate, batch, t_inf_ms) <= slo_ms).mean())


def goodput(rate: float, batch: int, t_inf_ms: float, slo_ms: float) -> float:
    """Requests per second served within `slo_ms` by one instance at `rate`, batch `batch`, t_inf `t_inf_ms`
    (see `goodputs`)."""
    return goodputs(rate, batch, t_inf_ms, slo_ms)[0]


def goodputs(rate: float, batch: int, t_inf_ms: float, slo_ms: float) -> tuple[float, float]:
    """(goodput, in-turn goodput): requests per second served within `slo_ms` by one instance at `rate`, batch
    `batch`, t_inf `t_inf_ms`, and the first of the two estimates below alone.

    The larger of two estimates. Every task served in its turn: the rate times the share
    within the SLO (`in_slo`, 0 once the rate overloads the batches). Requests that can no
    longer make their SLO rejected (Triton's queue timeout, the simulator's --drop): the
    instance serves full batches back to back, b / t_inf per second, as long as a request
    may wait at least one batch's time (SLO - t_inf >= t_inf), less OVERLOAD_LOSS for the
    batches that leave short or late near saturation.
    """
    if t_inf_ms > slo_ms:
        return 0.0, 0.0
    served = rate * in_slo(rate, batch, t_inf_ms, slo_ms)
    return max(served, refusing_goodput(rate, batch, t_inf_ms, slo_ms)), served


def refusing_goodput(rate: float, batch: int, t_inf_ms: float, slo_ms: float) -> float:
    """`goodputs`' second estimate: requests per second served within `slo_ms` by an instance that refuses what
    can no longer make it, running full batches back to back."""
    if t_inf_ms > slo_ms:
        return 0.0
    capacity = 1000.0 * batch / t_inf_ms
    return (1 - OVERLOAD_LOSS) * min(rate, capacity) * min(1.0, (slo_ms - t_inf_ms) / t_inf_ms)

"""Task latency with queueing, InSS eq. 2.

A task of model i arrives when G tasks are already queued, so the queued work including it
is W = G + 1 (tasks are of batch size 1). With batch size b and execution time t_inf of a
batch, and exec the time left of the batch running when it arrives:

    W >= b:  T = exec + ceil(W / b) * t_inf                 (waits behind earlier batches)
    W <  b:  T = max(exec, (b - W) / rate) + t_inf          (waits for the batch to fill)

`eq2` is that formula. `task_latency` applies it to every task of a seeded Poisson arrival
sequence, taking G and exec from a batch server that runs full batches of b, and returns
the mean and a high percentile, which is what the planner compares with the SLO.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

SAMPLE_TASKS = 2000


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


def task_latency(rate: float, batch: int, t_inf_ms: float, seed: int = 0, tasks: int = SAMPLE_TASKS) -> TaskLatency:
    """Mean and p99 task latency under Poisson arrivals at `rate` (requests/s), by eq. 2."""
    if rate <= 0:
        return TaskLatency(t_inf_ms, t_inf_ms, True)
    if rate * t_inf_ms / 1000.0 >= batch:
        return TaskLatency(math.inf, math.inf, False)
    arrivals = _unit_arrivals(seed, tasks) * (1000.0 / rate)  # ms
    # The batch server: batch k holds tasks [k*b, (k+1)*b) and starts when its last task has
    # arrived and the previous batch is done: end_k = max(end_{k-1}, A_k) + t, whose closed
    # form is end_k = (k+1) t + max_{j<=k} (A_j - j t).
    n_batches = tasks // batch
    last_arrivals = arrivals[batch - 1 :: batch][:n_batches]
    k = np.arange(n_batches)
    ends = (k + 1) * t_inf_ms + np.maximum.accumulate(last_arrivals - k * t_inf_ms)
    starts = ends - t_inf_ms
    # Just before each arrival: the last batch started, the time it has left, the tasks queued.
    last = np.searchsorted(starts, arrivals, side="left") - 1
    exec_left = np.where(last >= 0, np.maximum(0.0, ends[np.maximum(last, 0)] - arrivals), 0.0)
    queued = np.maximum(0, np.arange(tasks) - (last + 1) * batch)
    latencies = eq2(queued + 1, batch, t_inf_ms, exec_left, rate)
    return TaskLatency(float(latencies.mean()), float(np.percentile(latencies, 99)), True)

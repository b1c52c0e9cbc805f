"""One rule from a share to what it means: cores, onnxruntime threads, a CFS quota or a cgroup weight, and
how instances that take turns with a device share it (their threads and priority ranks). Rendering, the latency
model, the simulator, the policies and the runtimes all follow it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class Device(Protocol):
    """What the rule reads of a device (a plan's `Device` has it)."""

    kind: str
    cores: float
    units: int
    turn_priority: str
    turn_threads: str


# A short CFS period keeps a quota from turning into long stalls: with 100 ms a run that
# outlasts its period's quota waits for the next period (bimodal latency); 10 ms spreads it.
CFS_PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # cgroup v1 refuses cfs_quota_us below 1 ms


def cpu_cores(device: Device, share: int) -> float:
    return device.cores * share / device.units


def threads_for_cores(cores: float) -> int:
    """onnxruntime threads for a CPU share of `cores`: rounded half up.

    Not rounded up: measured here, two threads under a 1.2-core quota ran a batch slower
    than one thread under a 1.0-core quota (threads throttled mid-operator stall each other).
    """
    return max(1, math.floor(cores + 0.5))


def threads_for(device: Device, share: int) -> int:
    return threads_for_cores(cpu_cores(device, share))


def turn_threads(device: Device, sharing: int) -> int:
    """onnxruntime threads of each of `sharing` CPU instances that take turns with a whole device: between them
    never more than its cores, one at least. Oversubscribed, the threads of one parallel operator wait for each
    other at its barrier while the kernel runs another instance's threads (measured: four 2-thread instances on
    2 cores served ResNet18's p99 at 4x the prediction). Rounded like a share's threads: a device left 1.7
    cores by reservations still runs one instance on 2 threads."""
    return threads_for_cores(device.cores / sharing)


def turn_share(device: Device, sharing: int) -> int:
    """The share each of `sharing` instances taking turns with a device runs like while it runs: on a CPU the
    cores its threads can use, on a GPU all of it."""
    if device.kind != "cpu":
        return device.units
    return _threads_share(device, turn_threads(device, sharing))


def _threads_share(device: Device, threads: int) -> int:
    return min(device.units, round(device.units * threads / device.cores))


def turn_slots(device: Device, sharing: int) -> float:
    """How many of `sharing` instances taking turns with a device run at once at full speed: on a CPU as many
    as their threads leave cores for, a fraction where reservations leave part of a core (1.7 cores, one
    thread each: 1.7), one at least (fewer cores than threads already slow each instance: `turn_share`); on
    a GPU one (its batches queue)."""
    if device.kind != "cpu":
        return 1
    return max(1.0, min(sharing, device.cores / turn_threads(device, sharing)))


# How the runtime ranks instances taking turns with a CPU (`deploy.share`): each rank below the first runs in a cgroup
# nested in one marked idle (`cpu.idle`). The kernel weighs an idle group 3 against a default group's 1024 and
# preempts it at once for a waking task that is not in one, so a rank runs on what the ranks above it leave.
IDLE_STEP = 1024 / 3
MAX_WEIGHT = 10_000  # cgroup v2's largest cpu.weight
# SLOs closer than this share a rank: a strict order between 75 and 76 ms queued one behind the other for nothing
# (bench/results/turn-ladder/random-1-1-every-slo-a-rank.md).
RANK_RATIO = 1.5


def turn_ranks(device: Device, slos: list[float]) -> list[int] | None:
    """The priority ranks of instances taking turns with a CPU device, by their models' SLOs (None: all alike,
    the kernel's default). Deadline-monotonic (`turn_priority: slo`): 0 for the tightest SLO; in SLO order, an
    SLO at least `RANK_RATIO` times its rank's tightest starts the next rank. When more instances are busy than
    the cores hold, the kernel runs the higher rank first, so a model whose SLO leaves a few milliseconds over
    its batch is not queued behind a model with time to spare."""
    if device.kind != "cpu" or device.turn_priority != "slo":
        return None
    rank_of, rank, first = {}, -1, 0.0
    for slo in sorted(set(slos)):
        if rank < 0 or slo >= RANK_RATIO * first:
            rank, first = rank + 1, slo
        rank_of[slo] = rank
    return None if rank == 0 else [rank_of[slo] for slo in slos]


def rank_weight(rank: int | None) -> float:
    """An instance's CPU weight against a rank-0 one while both are busy (1 where unranked)."""
    return 1.0 if rank is None else IDLE_STEP**-rank


@dataclass(frozen=True)
class Turn:
    """How one instance taking turns with a device runs: its onnxruntime threads (a CPU's; 1 on a GPU), the share
    it runs like while it runs (`turn_share`'s, or its own threads' cores), and its priority rank (None: none)."""

    threads: int
    share: int
    rank: int | None


def turn_layout(device: Device, slos: list[float]) -> list[Turn]:
    """How each instance (its model's SLO) taking turns with `device` runs. Every instance on `turn_threads`,
    ranked by `turn_ranks`, except with `device.turn_threads: lightest` the one instance of the lowest rank,
    where only one is: it runs on a thread per core. It only takes the cores the higher ranks leave it (the
    kernel runs them first), so its threads do not stall theirs, and while they are idle a long batch of a
    loose SLO runs on every core instead of one."""
    if device.kind != "cpu":
        return [Turn(1, device.units, None)] * len(slos)
    ranks = turn_ranks(device, slos)
    threads = [turn_threads(device, len(slos))] * len(slos)
    if device.turn_threads == "lightest" and ranks is not None and ranks.count(max(ranks)) == 1:
        threads[ranks.index(max(ranks))] = threads_for_cores(device.cores)
    return [Turn(k, _threads_share(device, k), None if ranks is None else ranks[i]) for i, k in enumerate(threads)]


def cpu_weight(device: Device, share: int) -> int:
    """A CPU share as a cgroup weight: 10000 (the largest) for the whole device, in proportion below."""
    return max(1, round(MAX_WEIGHT * share / device.units))

"""BDA, the batch decision algorithm of InSS (Algorithm 1), and the `bda` policy built on it.

For a fixed placement and shares, BDA binary-searches each model's batch size in 1..32 for
the largest one that keeps the device's memory (constraint 1b), the SLO through the
queueing model of eq. 2 (1c) and a throughput at least the arrival rate (1d). Latency,
memory and throughput all grow with the batch, which is what makes the search valid.

One deviation from the paper's pseudo-code: where a batch meets memory and SLO but not the
rate, Algorithm 1 stops searching (`else break`); here the search goes on among larger
batches, which can reach the rate while still meeting the SLO. Stopping would report a
model infeasible that has a feasible batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.latency.queueing import P99Scan, p99s, task_latency
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError
from tritonctl.planning.policies.spread import spread


@dataclass(frozen=True)
class BatchDecision:
    batches: dict[str, int]
    ok: bool  # False: some model has no batch meeting every constraint (the flag of Algorithm 1)
    infeasible: dict[str, str]  # model -> which constraint failed, for the ones without a batch


def memory_at(demand: Demand, batch: int, lm: LatencyModel) -> float:
    """A model's memory at `batch`: the demand's footprint at batch 1 (the spec's override or the
    profile's) plus what the profile says each larger batch adds."""
    return demand.memory_mb + lm.footprint_mb(demand.name, batch) - lm.footprint_mb(demand.name, 1)


def broken_constraint(
    name: str,
    batch: int,
    placement: dict[str, Choice],
    demands: dict[str, Demand],
    batches: dict[str, int],
    devices: dict[str, Device],
    lm: LatencyModel,
) -> str | None:
    """The first constraint `batch` breaks for model `name` ('memory', 'slo', 'rate'), or None."""
    return next(batch_checks(name, placement, demands, batches, devices, lm, (batch,)))[1]


# `prompt_batch`: the rate a served batch should still keep the SLO at, x the model's; p99s within PROMPT_TIE of
# the least tie, and the larger batch is served
PROMPT_RATE, PROMPT_TIE = 1.5, 0.1

# Every batch size's time, p99 (each computed when first read) and stability of a model at a share beside its
# co-runners, at a rate: what a scan reads, kept by whoever scans the same layouts again (search's Judge). Keyed by
# `_scan_key`.
Scans = dict[tuple, tuple[list[float], P99Scan, list[bool]]]


def _scan_key(name: str, share: int, others: tuple[tuple[str, int, int], ...], rate: float, lm: LatencyModel):
    """What a scan depends on: the co-runners' batches only where the MLP predicts (the InSS formula reads their
    shares alone)."""
    return name, share, others if lm.reads_corunner_batches else tuple((m, s) for m, s, _ in others), rate


def _beside(name, placement, demands, batches, devices, lm) -> tuple[tuple[tuple[str, int, int], ...], float]:
    """Model `name`'s co-runners (model, share, batch) at `batches`, and the memory its device leaves it."""
    others = corunners(name, placement, batches)
    return others, devices[placement[name].device].memory_mb - sum(memory_at(demands[m], b, lm) for m, _, b in others)


def _scan(
    name: str,
    share: int,
    others: tuple[tuple[str, int, int], ...],
    demand: Demand,
    lm: LatencyModel,
    scans: Scans | None,
) -> tuple[list[float], P99Scan, list[bool]]:
    """Model `name`'s batch times, p99s and stability for every batch size at `share` beside `others`, kept in
    `scans` where given."""
    key = _scan_key(name, share, others, demand.rate, lm)
    scan = scans.get(key) if scans is not None else None
    if scan is None:
        times, rate = lm.t_infs(name, share, others).tolist(), demand.rate
        stable = [rate <= 0 or rate * t / (1000.0 * b) < 1 for b, t in enumerate(times, 1)]  # as `p99s` reads it
        scan = times, P99Scan(rate, times), stable
        if scans is not None:
            scans[key] = scan
    return scan


def _why(over: bool, stable: bool, p99_ms: float, slo_ms: float) -> str | None:
    """The first constraint a batch size breaks: 'memory', 'rate' (unstable: its batches serve fewer requests per
    second than arrive), 'slo'; or None."""
    return "memory" if over else "rate" if not stable else "slo" if p99_ms > slo_ms else None


def batch_rows(
    name: str,
    placement: dict[str, Choice],
    demands: dict[str, Demand],
    batches: dict[str, int],
    devices: dict[str, Device],
    lm: LatencyModel,
    scans: Scans | None = None,
) -> tuple[list[bool], list[float], P99Scan, list[bool]]:
    """Every batch size of model `name` beside its co-runners at `batches`, indexed by batch - 1: whether it
    breaks device memory, its batch time, p99 and stability (one scan, kept in `scans` where given)."""
    demand = demands[name]
    others, left = _beside(name, placement, demands, batches, devices, lm)
    footprints = lm.footprints_mb(name)
    over = [demand.memory_mb + f - footprints[0] > left for f in footprints]  # `memory_at`, as it computes it
    return over, *_scan(name, placement[name].share, others, demand, lm, scans)


def batch_checks(
    name: str,
    placement: dict[str, Choice],
    demands: dict[str, Demand],
    batches: dict[str, int],
    devices: dict[str, Device],
    lm: LatencyModel,
    sizes: Iterable[int] | None = None,
    scans: Scans | None = None,
) -> Iterator[tuple[int, str | None, float]]:
    """For each batch size of `sizes` (default 1 ... MAX_BATCH), model `name` beside its co-runners at `batches`:
    the size, the first constraint it breaks ('memory', 'slo', 'rate') or None, and its batch time (ms; inf where
    memory breaks). Every size at once where `sizes` is the default (`LatencyModel.t_infs`, `queueing.P99Scan`),
    kept in `scans` where given."""
    demand, share = demands[name], placement[name].share
    if sizes is None:
        every = batch_rows(name, placement, demands, batches, devices, lm, scans)
        rows = zip(range(1, MAX_BATCH + 1), *every, strict=True)
    else:
        others, left = _beside(name, placement, demands, batches, devices, lm)
        rows = (_one(name, b, share, others, demand, left, lm) for b in sizes)
    for batch, over, exec_ms, p99_ms, stable in rows:
        yield batch, _why(over, stable, p99_ms, demand.slo_ms), math.inf if over else exec_ms


def _one(name, batch, share, others, demand, left, lm) -> tuple[int, bool, float, float, bool]:
    """One batch size as `batch_checks` reads it: (batch, over memory, batch time, p99, stable)."""
    if memory_at(demand, batch, lm) > left:
        return batch, True, math.inf, math.inf, False
    exec_ms = lm.t_inf(name, batch, share, others)
    task = task_latency(demand.rate, batch, exec_ms)
    return batch, False, exec_ms, task.p99_ms, task.stable


def bda(
    placement: dict[str, Choice],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
    scans: Scans | None = None,
) -> BatchDecision:
    """Algorithm 1: the largest feasible batch per model, in model order, others at their current batch. The
    binary search reads one scan over every batch size per model (kept in `scans` where given)."""
    by_name = {d.name: d for d in demands}
    by_id = {d.id: d for d in devices}
    batches = {d.name: placement[d.name].batch for d in demands}
    infeasible: dict[str, str] = {}
    for demand in demands:
        over, _, p99, stable = batch_rows(demand.name, placement, by_name, batches, by_id, lm, scans)
        low, high, found, reason = 1, MAX_BATCH, None, ""
        while low <= high:
            mid = (low + high) // 2
            broken = _why(over[mid - 1], stable[mid - 1], p99[mid - 1], demand.slo_ms)
            if broken in ("memory", "slo"):
                high, reason = mid - 1, broken
            elif broken == "rate":
                low, reason = mid + 1, broken
            else:
                found, low = mid, mid + 1
        if found is None:
            infeasible[demand.name] = reason
        else:
            batches[demand.name] = found
    return BatchDecision(batches, not infeasible, infeasible)


def queue_delay_us(batch: int, rate: float, slo_ms: float, exec_ms: float) -> int:
    """Triton's max queue delay: long enough to fill the batch at the rate, never past the SLO's slack."""
    if batch <= 1 or rate <= 0:
        return 0
    fill_ms = 1000.0 * (batch - 1) / rate
    return int(1000 * max(0.0, min(fill_ms, slo_ms - exec_ms)))


def corunners(name: str, placement: dict[str, Choice], batches: dict[str, int]) -> tuple[tuple[str, int, int], ...]:
    """(model, share, batch) of everything placed beside `name` on its device."""
    device = placement[name].device
    return tuple((m, c.share, batches[m]) for m, c in placement.items() if m != name and c.device == device)


def throughput(placement: dict[str, Choice], batches: dict[str, int], lm: LatencyModel) -> float:
    """Problem (1)'s objective: requests per second the placement serves, sum of b / t_inf."""
    return sum(
        1000 * batches[n] / lm.t_inf(n, batches[n], c.share, corunners(n, placement, batches))
        for n, c in placement.items()
    )


def prompt_batch(name: str, share: int, largest: int, others: tuple, demand: Demand, lm: LatencyModel) -> int:
    """The batch a model is served at with `plan --batching prompt`, of 1 .. `largest` (BDA's): of those that
    would still meet the SLO at PROMPT_RATE times its rate by eq. 2 (where none would, of those that meet it at the
    rate), the one with the least p99 at its rate, the largest within PROMPT_TIE of it; `largest` itself where it
    misses the SLO (a partial service keeps the batch that serves most in time)."""
    times = lm.t_infs(name, share, others)[:largest]
    p99, stable = p99s(demand.rate, times)
    if not stable[largest - 1] or p99[largest - 1] > demand.slo_ms:
        return largest
    ahead, _ = p99s(demand.rate * PROMPT_RATE, times)
    fits = ahead <= demand.slo_ms
    candidates = np.where(fits if fits.any() else p99 <= demand.slo_ms, p99, np.inf)
    return int(np.flatnonzero(candidates <= candidates.min() * (1 + PROMPT_TIE))[-1]) + 1


def with_batches(
    placement: dict[str, Choice], batches: dict[str, int], demands: list[Demand], lm: LatencyModel
) -> dict[str, list[Choice]]:
    """The placement as a policy's answer: BDA's batches, and queue delays that fill them within the SLO."""
    out = {}
    for demand in demands:
        choice, batch = placement[demand.name], batches[demand.name]
        exec_ms = lm.t_inf(demand.name, batch, choice.share, corunners(demand.name, placement, batches))
        delay = queue_delay_us(batch, demand.rate, demand.slo_ms, exec_ms)
        out[demand.name] = [Choice(choice.device, choice.share, batch, delay)]
    return out


def eager(choices: dict[str, list[Choice]]) -> dict[str, list[Choice]]:
    """`choices` with no queue delay on any placement that splits its device: Triton's dynamic batcher then starts
    a batch as soon as the instance is free, of what is queued up to BDA's batch, so batches grow only with the
    load (the simulator and the plan's predictions run them so: `queueing.batcher_latency`)."""
    return {name: [c if c.turns else replace(c, queue_delay_us=0) for c in cs] for name, cs in choices.items()}


def prompted(choices: dict[str, list[Choice]], demands: list[Demand], lm: LatencyModel) -> dict[str, list[Choice]]:
    """`choices` served at `prompt_batch` instead of the largest batch BDA allows: every placement that splits its
    device (not one taking turns), at its part of the model's rate, with the queue delay that fills it.

    The largest batch buys the most throughput for the share, and with the queue delay that fills it every
    request waits up to the SLO's slack for its batch. Where the rate is below what the share serves, a smaller
    batch that fills sooner answers sooner, at the cost of that throughput (docs/gpu.md has both measured)."""
    by_name = {d.name: d for d in demands}
    split = [(name, k, c) for name, cs in choices.items() for k, c in enumerate(cs) if not c.turns]
    out = {name: list(cs) for name, cs in choices.items()}
    for name, k, c in split:
        others = tuple((m, o.share, o.batch) for m, j, o in split if o.device == c.device and (m, j) != (name, k))
        weights = sum(x.weight for x in choices[name])
        d = by_name[name]
        demand = Demand(name, d.slo_ms, d.rate * c.weight / weights, d.memory_mb)
        batch = prompt_batch(name, c.share, c.batch, others, demand, lm)
        delay = queue_delay_us(batch, demand.rate, demand.slo_ms, lm.t_inf(name, batch, c.share, others))
        out[name][k] = replace(c, batch=batch, queue_delay_us=delay)
    return out


def explain(decision: BatchDecision) -> str:
    why = {"memory": "device memory", "slo": "its SLO", "rate": "its arrival rate"}
    return "no batch size serves " + "; ".join(f"{m} within {why[r]}" for m, r in decision.infeasible.items())


def bda_policy(demands: list[Demand], devices: list[Device], lm: LatencyModel | None) -> dict[str, list[Choice]]:
    """The spread placement and equal shares, with batch sizes and queue delays from BDA."""
    if lm is None:
        raise PlacementError("policy bda needs a fitted latency model: pass --latency-model")
    placement = {name: choices[0] for name, choices in spread(demands, devices, lm).items()}
    decision = bda(placement, demands, devices, lm)
    if not decision.ok:
        raise PlacementError(explain(decision) + " on this placement")
    return with_batches(placement, decision.batches, demands, lm)

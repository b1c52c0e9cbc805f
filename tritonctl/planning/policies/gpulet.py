"""Gpulet (Choi et al., USENIX ATC'22): elastic partitioning (Algorithm 1) and GPU scaling (Algorithm 2).

A GPU is split into at most two gpulets of the sizes Gpulet uses (20/40/50/60/80/100% of
it). Models are taken in ascending order of rate x SLO; while a model has rate left, it
gets a gpulet of size p_ideal = min(p_eff, p_req): p_eff the size with the most throughput
per unit of GPU, p_req the smallest size that carries the remaining rate. FINDBESTFIT takes
the smallest free gpulet at least that large (splitting a whole GPU into p_ideal and the
rest) on which some batch keeps the batch latency, with Gpulet's own pairwise interference
estimate against the other gpulet of that GPU, under SLO / 2; the batch is the largest such
one, and its queue timeout SLO / 2 (InSS section 6.1 describes the baseline so). A model
that outgrows one gpulet gets several replicas, each sized for the rate it takes. GPU
scaling starts with one GPU and adds one at a time up to the cluster's devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError

SIZES = (20, 40, 50, 60, 80, 100)  # gpulet sizes, percent of a device


@dataclass
class _Gpulet:
    device: Device
    size: int  # units
    model: str | None = None
    batch: int = 0
    rate: float = 0.0  # the part of the model's rate it is given


def _units(device: Device, percent: int) -> int:
    return max(1, round(device.units * percent / 100))


def _max_batch(lm: LatencyModel, demand: Demand, size: int, partner: tuple[tuple[str, int, int], ...]) -> int | None:
    """The largest batch whose latency, with Gpulet's interference estimate, stays under SLO / 2."""
    best = None
    for b in range(1, MAX_BATCH + 1):
        if lm.t_inf_gpulet(demand.name, b, size, partner) > demand.slo_ms / 2:
            break
        best = b
    return best


def _rate_at(lm: LatencyModel, demand: Demand, size: int) -> float:
    """What a gpulet of `size` carries alone at its largest SLO / 2 batch (0 when no batch fits)."""
    b = _max_batch(lm, demand, size, ())
    return 0.0 if b is None else 1000 * b / lm.t_inf_gpulet(demand.name, b, size)


def _elastic_partitioning(
    demands: list[Demand], devices: list[Device], lm: LatencyModel
) -> tuple[list[_Gpulet], dict[str, float]]:
    """Algorithm 1 on `devices`: the gpulets handed out and, per model, the rate it could not place."""
    free = [_Gpulet(d, d.units) for d in devices]  # unpartitioned GPUs to begin with
    used: list[_Gpulet] = []
    memory = {d.id: d.memory_mb for d in devices}
    split = {d.id: False for d in devices}
    left: dict[str, float] = {}
    for demand in sorted(demands, key=lambda d: (d.rate * d.slo_ms, d.name)):
        rate = demand.rate
        while rate > 1e-9:
            candidates = {_units(devices[0], p) for p in SIZES}
            carried = {s: _rate_at(lm, demand, s) for s in candidates}
            p_eff = max(candidates, key=lambda s: (carried[s] / s, -s))
            p_req = min((s for s in candidates if carried[s] >= rate), default=None)
            p_ideal = p_eff if p_req is None else min(p_eff, p_req)
            gpulet = _find_best_fit(p_ideal, demand, free, used, split, memory, lm)
            if gpulet is None:
                break
            capacity = (
                1000 * gpulet.batch / lm.t_inf_gpulet(demand.name, gpulet.batch, gpulet.size, _partner(gpulet, used))
            )
            gpulet.rate = min(rate, capacity)
            rate -= gpulet.rate
        if rate > 1e-9:
            left[demand.name] = rate
    return used, left


def _partner(gpulet: _Gpulet, used: list[_Gpulet]) -> tuple[tuple[str, int, int], ...]:
    return tuple((g.model, g.size, g.batch) for g in used if g.device.id == gpulet.device.id and g is not gpulet)


def _find_best_fit(
    p_ideal: int,
    demand: Demand,
    free: list[_Gpulet],
    used: list[_Gpulet],
    split: dict[str, bool],
    memory: dict[str, int],
    lm: LatencyModel,
) -> _Gpulet | None:
    """FINDBESTFIT: the smallest free gpulet of at least p_ideal with a batch under SLO / 2."""
    for gpulet in sorted(free, key=lambda g: (g.size, g.device.index)):
        if gpulet.size < p_ideal or memory[gpulet.device.id] < demand.memory_mb:
            continue
        size = p_ideal if not split[gpulet.device.id] else gpulet.size
        partner = _partner(gpulet, used)
        batch = _max_batch(lm, demand, size, partner)
        if batch is None:
            continue
        free.remove(gpulet)
        if not split[gpulet.device.id]:
            split[gpulet.device.id] = True
            if gpulet.size > size:
                free.append(_Gpulet(gpulet.device, gpulet.size - size))
        taken = _Gpulet(gpulet.device, size, demand.name, batch)
        used.append(taken)
        memory[gpulet.device.id] -= demand.memory_mb
        return taken
    return None


def gpulet(demands: list[Demand], devices: list[Device], lm: LatencyModel | None) -> dict[str, list[Choice]]:
    """Algorithm 2: elastic partitioning on 1, 2, ... GPUs until every model's rate is placed."""
    if lm is None:
        raise PlacementError("policy gpulet needs a fitted latency model: pass --latency-model")
    for n in range(1, len(devices) + 1):
        used, left = _elastic_partitioning(demands, devices[:n], lm)
        if not left:
            break
    if left:
        raise PlacementError(
            "Gpulet cannot place "
            + ", ".join(f"{rate:.1f}/s of {name}" for name, rate in left.items())
            + f" on {len(devices)} devices"
        )
    by_name = {d.name: d for d in demands}
    out: dict[str, list[Choice]] = {}
    for g in used:
        delay = int(1000 * by_name[g.model].slo_ms / 2)
        out.setdefault(g.model, []).append(Choice(g.device.id, g.size, g.batch, delay, weight=g.rate))
    return out

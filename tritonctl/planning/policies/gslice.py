"""GSLICE (Dhakal et al., ACM SoCC 2020): shares from the knee, then self-tuning of shares and batches.

Each model starts at its knee: the share past which one more step of the device speeds a
batch of one up by less than `KNEE_GAIN`. Models go first-fit, heaviest first, onto the
devices. Then GSLICE's self-tuning loop runs on what it observes, average latency and
throughput, without any interference estimate (GSLICE has none): each model's batch is the
largest whose average latency (the batch's run plus the mean wait to fill it) stays within
the SLO; a model whose throughput falls short of its rate gets one more step of share,
from the device's free units or from a model on the same device that keeps its rate with
one step less. It stops when nothing changes (InSS section 6.1: "adjusts the allocation
of GPU resources and batch sizes by traversing the average latency and throughput").
"""

from __future__ import annotations

from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError
from tritonctl.planning.policies.bda import queue_delay_us

STEP_PERCENT = 5  # share step, percent of a device
KNEE_GAIN = 0.05
MAX_ROUNDS = 200


def _knee(name: str, device: Device, lm: LatencyModel) -> int:
    step = max(1, round(device.units * STEP_PERCENT / 100))
    share = step
    while share + step <= device.units and lm.t_inf(name, 1, share + step) < (1 - KNEE_GAIN) * lm.t_inf(name, 1, share):
        share += step
    return share


def _average_ms(demand: Demand, batch: int, share: int, lm: LatencyModel) -> float:
    """What GSLICE watches: a batch's run time plus the mean wait for it to fill at the rate."""
    fill = 1000 * (batch - 1) / (2 * demand.rate) if demand.rate > 0 else 0.0
    return lm.t_inf(demand.name, batch, share) + fill


def _batch(demand: Demand, share: int, lm: LatencyModel) -> int | None:
    best = None
    for b in range(1, MAX_BATCH + 1):
        if _average_ms(demand, b, share, lm) > demand.slo_ms:
            break
        best = b
    return best


def _throughput(demand: Demand, share: int, lm: LatencyModel) -> float:
    b = _batch(demand, share, lm)
    return 0.0 if b is None else 1000 * b / lm.t_inf(demand.name, b, share)


def gslice(demands: list[Demand], devices: list[Device], lm: LatencyModel | None) -> dict[str, list[Choice]]:
    if lm is None:
        raise PlacementError("policy gslice needs a fitted latency model: pass --latency-model")
    step = max(1, round(devices[0].units * STEP_PERCENT / 100))
    where: dict[str, Device] = {}
    share: dict[str, int] = {}
    free = {d.id: d.units for d in devices}
    memory = {d.id: d.memory_mb for d in devices}
    for d in sorted(demands, key=lambda d: (-d.rate * lm.t_inf(d.name, 1, devices[0].units), d.name)):
        knee = _knee(d.name, devices[0], lm)
        fits = [x for x in devices if memory[x.id] >= d.memory_mb and free[x.id] >= step]
        if not fits:
            raise PlacementError(f"GSLICE has no device with room for {d.name}")
        device = next((x for x in fits if free[x.id] >= knee), max(fits, key=lambda x: free[x.id]))
        where[d.name], share[d.name] = device, min(knee, free[device.id])
        free[device.id] -= share[d.name]
        memory[device.id] -= d.memory_mb
    by_name = {d.name: d for d in demands}
    for _ in range(MAX_ROUNDS):
        changed = False
        for d in demands:
            if _throughput(d, share[d.name], lm) >= d.rate:
                continue
            device = where[d.name].id
            if free[device] < step:  # take a step from a neighbour that keeps its rate without it
                donor = next(
                    (
                        n
                        for n in share
                        if n != d.name
                        and where[n].id == device
                        and share[n] > step
                        and _throughput(by_name[n], share[n] - step, lm) >= by_name[n].rate
                    ),
                    None,
                )
                if donor is None:
                    continue
                share[donor] -= step
                free[device] += step
            share[d.name] += step
            free[device] -= step
            changed = True
        if not changed:
            break
    short = [d.name for d in demands if _throughput(d, share[d.name], lm) < d.rate]
    if short:
        raise PlacementError(f"GSLICE cannot reach the rate of {', '.join(short)}")
    out = {}
    for d in demands:
        b = _batch(d, share[d.name], lm)
        delay = queue_delay_us(b, d.rate, d.slo_ms, lm.t_inf(d.name, b, share[d.name]))
        out[d.name] = [Choice(where[d.name].id, share[d.name], b, delay)]
    return out

"""iGniter (Xu et al., IEEE TPDS 2022): minimum shares from the latency model, placement by least interference.

Each model's batch is what arrives in half its SLO, b = ceil(rate x SLO / 2), and its
lower share r_lower the smallest that runs that batch alone within SLO / 2 (so a request
waits at most SLO / 2 for its batch to fill and SLO / 2 for it to run). Models are placed
in descending order of r_lower; each goes to the device in use where, after raising the
shares of everything there step by step until every model's predicted latency (with
interference) is back under SLO / 2, the interference added is least; a new device is
opened only when no device in use can take it. iGniter trusts its predictions fully: it
provisions exactly what they say is needed, no more (ETH thesis section 5.1.3; InSS
section 6.1). Here the predictions come from tritonctl's fitted model, whose interference
terms extend iGniter's own.
"""

from __future__ import annotations

import math

from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError

STEP_PERCENT = 2  # share increment while raising shares, percent of a device


def _batch(demand: Demand) -> int:
    return min(MAX_BATCH, max(1, math.ceil(demand.rate * demand.slo_ms / 2000)))


def _lower_share(demand: Demand, batch: int, device: Device, lm: LatencyModel) -> int | None:
    """The smallest share running `batch` alone within SLO / 2 and at the arrival rate."""
    for share in range(1, device.units + 1):
        t = lm.t_inf(demand.name, batch, share)
        if t <= demand.slo_ms / 2 and 1000 * batch / t >= demand.rate:
            return share
    return None


def _fit(
    hosted: dict[str, int], demands: dict[str, Demand], batches: dict[str, int], device: Device, lm: LatencyModel
) -> dict[str, int] | None:
    """Raise shares on one device until every model's latency with interference is under SLO / 2."""
    shares = dict(hosted)
    step = max(1, round(device.units * STEP_PERCENT / 100))
    while sum(shares.values()) <= device.units:
        late = [
            n for n in shares if lm.t_inf(n, batches[n], shares[n], _others(n, shares, batches)) > demands[n].slo_ms / 2
        ]
        if not late:
            return shares
        for n in late:
            shares[n] += step
    return None


def _others(name: str, shares: dict[str, int], batches: dict[str, int]) -> tuple[tuple[str, int, int], ...]:
    return tuple((m, s, batches[m]) for m, s in shares.items() if m != name)


def _interference(shares: dict[str, int], batches: dict[str, int], lm: LatencyModel) -> float:
    """Relative latency added by co-location, summed over the device's models."""
    return sum(
        lm.t_inf(n, batches[n], s, _others(n, shares, batches)) / lm.t_inf(n, batches[n], s) - 1
        for n, s in shares.items()
    )


def igniter(demands: list[Demand], devices: list[Device], lm: LatencyModel | None) -> dict[str, list[Choice]]:
    if lm is None:
        raise PlacementError("policy igniter needs a fitted latency model: pass --latency-model")
    by_name = {d.name: d for d in demands}
    batches = {d.name: _batch(d) for d in demands}
    lower = {}
    for d in demands:
        share = _lower_share(d, batches[d.name], devices[0], lm)
        if share is None:
            raise PlacementError(f"iGniter finds no share that runs {d.name} at batch {batches[d.name]} within SLO / 2")
        lower[d.name] = share
    placed: dict[str, dict[str, int]] = {}  # device id -> model -> share
    memory = {d.id: d.memory_mb for d in devices}
    for d in sorted(demands, key=lambda d: (-lower[d.name], d.name)):
        options = []
        for device in devices:
            hosted = placed.get(device.id)
            if hosted is None or memory[device.id] < d.memory_mb:
                continue
            shares = _fit({**hosted, d.name: lower[d.name]}, by_name, batches, device, lm)
            if shares is not None:
                before = _interference(hosted, batches, lm)
                options.append((_interference(shares, batches, lm) - before, device.index, device, shares))
        if not options:  # open a new device
            device = next((x for x in devices if x.id not in placed and x.memory_mb >= d.memory_mb), None)
            if device is None:
                raise PlacementError(f"iGniter has no device left for {d.name}")
            options.append((0.0, device.index, device, {d.name: lower[d.name]}))
        _, _, device, shares = min(options, key=lambda o: o[:2])
        placed[device.id] = shares
        memory[device.id] -= d.memory_mb
    delay = {d.name: int(1000 * d.slo_ms / 2) for d in demands}
    return {
        name: [Choice(device_id, share, batches[name], delay[name] if batches[name] > 1 else 0)]
        for device_id, shares in placed.items()
        for name, share in shares.items()
    }

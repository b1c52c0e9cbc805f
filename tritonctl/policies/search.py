"""A search-based stand-in for the InSS scheduler: local search over placements and shares, BDA inside.

InSS decides placement and shares with a trained SAC-Discrete agent and batch sizes with
BDA. Until that agent exists (the `inss` policy), this policy searches the same space
directly: from a few starting placements (LPT by work, spread) it climbs, taking the best neighbour each round
- move 5, 10 or 25 units of share between two models on a device, move a model to another
device, or swap two models across devices - judged by BDA (exact for a fixed placement):
first fewer models without a feasible batch, then how close those come to one, then more
total throughput sum b / t_inf (problem (1)). It stops at a local optimum or after `MAX_EVALUATIONS` placements judged
(a count, not a clock, so that a plan does not depend on the machine's speed).
"""

from __future__ import annotations

from collections.abc import Iterator

from tritonctl.latency.model import LatencyModel
from tritonctl.plan import Device
from tritonctl.policies.base import Choice, Demand, PlacementError
from tritonctl.policies.bda import bda, explain, shortfall, throughput, with_batches
from tritonctl.policies.spread import spread

STEP = 5  # share grid, in units
MOVES = (STEP, 2 * STEP, 5 * STEP)  # share moved between two models at a time: large steps jump over plateaus
MAX_EVALUATIONS = 300

Placement = dict[str, tuple[str, int]]  # model -> (device id, share)


def _split(names: list[str], weights: dict[str, float], units: int, floor: dict[str, int]) -> dict[str, int] | None:
    """Shares on a STEP grid in proportion to `weights`, each at least its floor, adding up to at most `units`."""
    if sum(max(floor[n], STEP) for n in names) > units:
        return None
    total = sum(weights[n] for n in names) or 1.0
    shares = {n: max(floor[n], STEP * int(units * weights[n] / total / STEP)) for n in names}
    while sum(shares.values()) > units:  # the floors pushed it over: trim the largest
        largest = max(names, key=lambda n: shares[n])
        shares[largest] -= STEP
    return shares


def _starts(
    demands: list[Demand], devices: list[Device], lm: LatencyModel, work: dict[str, float], floor: dict[str, int]
) -> Iterator[Placement]:
    """Models by decreasing work onto the device with the least work so far (LPT), shares in proportion
    to work; then spread's placement with equal shares and with shares in proportion to work."""
    load = {d.id: 0.0 for d in devices}
    memory = {d.id: d.memory_mb for d in devices}
    lpt: dict[str, str] = {}
    for d in sorted(demands, key=lambda d: (-work[d.name], d.name)):
        fits = [x for x in devices if memory[x.id] >= d.memory_mb] or devices
        device = min(fits, key=lambda x: (load[x.id], x.index))
        lpt[d.name], load[device.id], memory[device.id] = (
            device.id,
            load[device.id] + work[d.name],
            memory[device.id] - d.memory_mb,
        )
    spread_choice = {n: c[0] for n, c in spread(demands, devices, lm).items()}
    for assignment in (lpt, {n: c.device for n, c in spread_choice.items()}):
        placement: Placement = {}
        for device in devices:
            names = [n for n, dev in assignment.items() if dev == device.id]
            shares = _split(names, work, device.units, floor) if names else {}
            if shares is None:
                break
            placement.update({n: (device.id, s) for n, s in shares.items()})
        else:
            yield placement
    yield {n: (c.device, c.share) for n, c in spread_choice.items()}


def _neighbours(
    placement: Placement, devices: list[Device], work: dict[str, float], floor: dict[str, int]
) -> Iterator[Placement]:
    units = {d.id: d.units for d in devices}
    names = sorted(placement)
    for a in names:  # move share between two models on one device, in small and large steps
        for b in names:
            (dev_a, sa), (dev_b, sb) = placement[a], placement[b]
            for step in MOVES:
                if a != b and dev_a == dev_b and sb - step >= max(floor[b], STEP):
                    yield {**placement, a: (dev_a, sa + step), b: (dev_b, sb - step)}
    for a in names:  # move a model; both devices re-split in proportion to work
        for device in devices:
            if device.id == placement[a][0]:
                continue
            moved = dict(placement)
            for dev, group in (
                (placement[a][0], [n for n in names if placement[n][0] == placement[a][0] and n != a]),
                (device.id, [n for n in names if placement[n][0] == device.id] + [a]),
            ):
                shares = _split(group, work, units[dev], floor) if group else {}
                if shares is None:
                    break
                moved.update({n: (dev, s) for n, s in shares.items()})
            else:
                yield moved
    for i, a in enumerate(names):  # swap two models across devices, shares stay with the device
        for b in names[i + 1 :]:
            (dev_a, sa), (dev_b, sb) = placement[a], placement[b]
            if dev_a != dev_b and sb >= floor[a] and sa >= floor[b]:
                yield {**placement, a: (dev_b, sb), b: (dev_a, sa)}


def search(demands: list[Demand], devices: list[Device], lm: LatencyModel | None) -> dict[str, list[Choice]]:
    if lm is None:
        raise PlacementError("policy search needs a fitted latency model: pass --latency-model")
    evaluations = 0
    floor = {d.name: lm.models[d.name].share_range[0] for d in demands}
    by_name = {d.name: d for d in demands}
    work = {d.name: max(d.rate, 1e-3) * lm.t_inf(d.name, 1, devices[0].units) for d in demands}

    def judge(placement: Placement):
        nonlocal evaluations
        evaluations += 1
        choices = {n: Choice(dev, share) for n, (dev, share) in placement.items()}
        decision = bda(choices, demands, devices, lm)
        short = sum(shortfall(n, choices, decision.batches, by_name, lm)[0] for n in decision.infeasible)
        return (len(decision.infeasible), short, -throughput(choices, decision.batches, lm)), decision

    best = None
    for start in _starts(demands, devices, lm, work, floor):
        current, (score, decision) = start, judge(start)
        while evaluations < MAX_EVALUATIONS:
            improved = None
            for candidate in _neighbours(current, devices, work, floor):
                candidate_score, candidate_decision = judge(candidate)
                if candidate_score < score and (improved is None or candidate_score < improved[1]):
                    improved = (candidate, candidate_score, candidate_decision)
                if evaluations >= MAX_EVALUATIONS:
                    break
            if improved is None:
                break
            current, score, decision = improved
        if best is None or score < best[1]:
            best = (current, score, decision)
    placement, _, decision = best
    if not decision.ok:
        raise PlacementError(explain(decision) + " on the best placement the search found")
    choices = {n: Choice(dev, share) for n, (dev, share) in placement.items()}
    return with_batches(choices, decision.batches, demands, lm)

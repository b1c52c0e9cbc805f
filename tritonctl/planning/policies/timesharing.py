"""Time sharing: whole devices and batching only, no spatial sharing (the baseline of InSS section 6).

Instances on a device take turns with all of it, as in Nexus's squishy bin packing: in a
duty cycle of length d every model runs one batch, so model i needs b_i >= rate_i x d to
keep up, and a request waits at most one cycle before its batch runs: d + t_i(b_i) <= SLO_i.
For a set of models on a device the batches follow from d by a fixed point (d = sum of the
batches' run times, b_i = ceil(rate_i x d)). Models go heaviest first onto the device where
they fit with the most latency slack left; a model too heavy for one device alone is split
into replicas of equal rate on separate devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.latency.queueing import goodputs
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError
from tritonctl.planning.policies.bda import memory_at
from tritonctl.shares import Turn, rank_weight, turn_layout, turn_share, turn_slots

STRETCH_ROUNDS = 3  # rounds of the fixed point between how busy instances taking turns are and how long they take


def schedule(
    group: list[Demand], device: Device, lm: LatencyModel, in_part: bool = False
) -> tuple[float, dict[str, int]] | None:
    """The duty cycle and batches that keep every model of `group` at its rate and SLO on `device`, or None.

    On a CPU each instance runs on its threads of `turn_layout` and `turn_slots` of them run at once, so a
    cycle is their batches' time over the slots, and batches do not wait for each other's turns: the SLO is left
    to the queueing of `turn_service_ms` (a GPU's batch waits up to a cycle, so the cycle bounds it). With
    `in_part`, a CPU instance that keeps up at no batch runs the one serving the most requests per second (what
    it then serves in time is its queueing's to say) rather than leaving the device without a schedule."""
    share, slots = turn_share(device, len(group)), turn_slots(device, len(group))
    if device.kind == "cpu":  # each instance keeps up on its own: the smallest batch that does
        shares = _shares(group, device)
        batches = {
            d.name: _keeps_up(d, s, lm) or (_fastest(d, s, lm) if in_part else None)
            for d, s in zip(group, shares, strict=True)
        }
        if any(b is None for b in batches.values()):
            return None
        return sum(lm.t_inf(d.name, batches[d.name], s) for d, s in zip(group, shares, strict=True)) / slots, batches
    batches = {d.name: 1 for d in group}
    for _ in range(100):
        cycle = gpu_cycle([(d.name, batches[d.name]) for d in group], share, lm) / slots
        needed = {d.name: max(1, math.ceil(d.rate * cycle / 1000)) for d in group}
        if any(b > MAX_BATCH for b in needed.values()):
            return None
        if needed == batches:
            break
        batches = {n: max(b, needed[n]) for n, b in batches.items()}  # batches only grow: the point is reached
    else:
        return None
    if any(cycle + lm.t_inf(d.name, batches[d.name], share) > d.slo_ms for d in group):
        return None
    return cycle, batches


def gpu_cycle(members: list[tuple[str, int]], share: int, lm: LatencyModel) -> float:
    """The duty cycle of (model, batch) members taking turns with a GPU: their batches' GPU parts one after
    another, each batch's host part (`LatencyModel.host_ms`) beside the others' turns; never shorter than the
    longest batch alone."""
    alone = [lm.t_inf(model, batch, share) for model, batch in members]
    gpu = sum(t - min(lm.host_ms(model, batch), t) for (model, batch), t in zip(members, alone, strict=True))
    return max(gpu, *alone)


def widest_schedule(
    group: list[Demand], device: Device, lm: LatencyModel, at_rates: tuple[float, dict[str, int]] | None = None
) -> tuple[float, dict[str, int]] | None:
    """The highest multiple of the group's rates (to 1%) whose duty cycle on `device` still keeps every model at
    its rate and SLO, and that cycle's batches: the largest batches worth forming; None where 1x has no schedule
    (`at_rates`: the schedule at 1x where the caller has it)."""
    at = {1.0: at_rates if at_rates is not None else schedule(group, device, lm)}

    def fits(scale: float) -> bool:
        if scale not in at:
            at[scale] = schedule([Demand(d.name, d.slo_ms, d.rate * scale, d.memory_mb) for d in group], device, lm)
        return at[scale] is not None

    if not fits(1.0):
        return None
    low, high = 1.0, 2.0
    while fits(high) and high < 2**10:
        low, high = high, 2 * high
    while high - low > 0.01 * low:
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, at[low][1]


def widest_turns(
    choices: dict[str, list[Choice]], demands: list[Demand], devices: list[Device], lm: LatencyModel, temporal: bool
) -> dict[str, list[Choice]]:
    """`choices` with every GPU taken in turns (all devices where `temporal`) served eagerly: each member's batch
    the largest worth forming (`widest_schedule`), no queue delay, so that Triton's batcher starts a batch as soon as
    the instance is free and batches grow with the load. Other placements are left as they are."""
    rates = {d.name: d for d in demands}
    out = {name: list(cs) for name, cs in choices.items()}
    for device in (d for d in devices if d.kind == "gpu"):
        members = [
            (name, k)
            for name, cs in choices.items()
            for k, c in enumerate(cs)
            if c.device == device.id and (c.turns or temporal)
        ]
        group = []
        for name, k in members:
            d, weights = rates[name], [c.weight for c in choices[name]]
            group.append(Demand(name, d.slo_ms, d.rate * weights[k] / sum(weights), d.memory_mb))
        widest = widest_schedule(group, device, lm) if group else None
        if widest is None:
            continue
        for name, k in members:
            out[name][k] = replace(out[name][k], batch=widest[1][name], queue_delay_us=0)
    return out


def _keeps_up(d: Demand, share: int, lm: LatencyModel) -> int | None:
    """The smallest batch at which one instance at `share` is busy less than 90% of the time at the model's rate."""
    for batch in range(1, MAX_BATCH + 1):
        if d.rate * lm.t_inf(d.name, batch, share) < 0.9 * 1000 * batch:
            return batch
    return None


def _fastest(d: Demand, share: int, lm: LatencyModel) -> int:
    """The batch at which one instance at `share` serves the most requests per second."""
    return max(range(1, MAX_BATCH + 1), key=lambda batch: batch / lm.t_inf(d.name, batch, share))


def turn_service_ms(members: list[tuple[str, int, float, float]], device: Device, lm: LatencyModel) -> list[float]:
    """How long one batch of each (model, batch, rate, SLO) member, taking turns with `device`, holds its instance.

    A GPU runs the turns' GPU parts one after another: a batch waits for the others' (the duty cycle,
    `gpu_cycle`), so the cycle is what each batch costs. A CPU runs them at once, each on its threads of
    `shares.turn_layout`: a batch takes its time alone on them, stretched while the busy
    instances' threads are more than the cores (`_stretch`), and at least to what the cores
    the others leave it on average allow (`_left`), each other instance busy for the
    part of the time its own rate and stretched batches keep it so (a fixed point, a few rounds
    from the times alone). Under deadline-monotonic ranks (`shares.turn_ranks`) a batch is
    stretched only by the instances of its own rank or a higher one: the kernel runs the
    higher ranks first."""
    layout = turn_layout(device, [slo for *_, slo in members])
    alone = [lm.t_inf(model, batch, turn.share) for (model, batch, _, _), turn in zip(members, layout, strict=True)]
    if device.kind != "cpu":
        return [gpu_cycle([(model, batch) for model, batch, _, _ in members], layout[0].share, lm)] * len(members)
    weights = [rank_weight(turn.rank) for turn in layout]
    held = alone
    for _ in range(STRETCH_ROUNDS):
        busy = [min(1.0, rate * t / (1000 * batch)) for (_, batch, rate, _), t in zip(members, held, strict=True)]
        held = []
        for i, t in enumerate(alone):
            ahead = [(b, layout[j].threads) for j, b in enumerate(busy) if j != i and weights[j] >= weights[i]]
            held.append(t * max(_stretch(ahead, layout[i].threads, device.cores), _left(ahead, layout[i], device)))
    return held


def _left(ahead: list[tuple[float, int]], turn: Turn, device: Device) -> float:
    """How many times as long as alone a batch takes at least on the cores the instances `ahead` (busy with
    their probability, on their threads) leave it on average: work is conserved, so where they keep more than
    `cores - threads` busy, the batch runs on what is left (infinite where nothing is)."""
    left = device.cores - sum(p * k for p, k in ahead)
    return math.inf if left <= 0 else max(1.0, turn.threads / left)


@dataclass(frozen=True)
class Turns:
    """What a set of models taking turns with one device serves: per model its goodput (every copy together)
    and the same with every request served in its turn, the batches, the duty cycle and sum b / t."""

    served: dict[str, float]
    in_turn: dict[str, float]
    batches: dict[str, int]
    cycle: float
    capacity: float


def turn_outcome(members: list[tuple[Demand, int]], device: Device, lm: LatencyModel, in_part: bool = False) -> Turns:
    """Members (model, copies) taking turns with `device`, each copy at its part of the model's rate: a batch
    server holding its instance for `turn_service_ms` per batch, with its queueing (eq. 2). Nothing is served
    where the schedule finds no batches (`schedule`, `in_part` as there) or the batches do not fit the device's
    memory."""
    group = [Demand(d.name, d.slo_ms, d.rate / copies, d.memory_mb) for d, copies in members for _ in range(copies)]
    plan = schedule(group, device, lm, in_part)
    batches = plan[1] if plan is not None else {d.name: 1 for d in group}
    fits = plan is not None and sum(memory_at(d, batches[d.name], lm) for d in group) <= device.memory_mb
    if not fits:
        zero = {d.name: 0.0 for d, _ in members}
        return Turns(zero, dict(zero), batches, 0.0, 0.0)
    service = turn_service_ms([(d.name, batches[d.name], d.rate, d.slo_ms) for d in group], device, lm)
    held = dict(zip((d.name for d in group), service, strict=True))  # a model's copies hold alike
    served, in_turn = {}, {}
    for d, copies in members:
        each = goodputs(d.rate / copies, batches[d.name], held[d.name], d.slo_ms)
        served[d.name], in_turn[d.name] = copies * each[0], copies * each[1]
    if device.kind == "gpu":  # what the duty cycle carries at its largest batches, at the rates' proportions
        widest = widest_schedule(group, device, lm, plan)
        capacity = widest[0] * sum(d.rate for d in group)
    else:
        capacity = sum(1000 * batches[d.name] / t for d, t in zip(group, service, strict=True))
    return Turns(served, in_turn, batches, plan[0], capacity)


def turn_choices(
    members: list[tuple[Demand, int]], device: Device, outcome: Turns, lm: LatencyModel
) -> dict[str, list[Choice]]:
    """The placements of members taking turns with `device`: each copy with all of it, batched as planned, its
    batcher waiting at most what one cycle leaves of the SLO (as time-sharing's)."""
    instances = [d for d, copies in members for _ in range(copies)]
    share = dict(zip((d.name for d in instances), _shares(instances, device), strict=True))  # copies run alike
    out = {}
    for d, copies in members:
        batch = outcome.batches[d.name]
        exec_ms = lm.t_inf(d.name, batch, share[d.name])
        delay = int(1000 * max(0.0, d.slo_ms - outcome.cycle - exec_ms)) if batch > 1 else 0
        out[d.name] = [Choice(device.id, device.units, batch, delay, turns=True)] * copies
    return out


def _shares(group: list[Demand], device: Device) -> list[int]:
    """The share each instance of `group` taking turns with `device` runs like (`shares.turn_layout`)."""
    return [turn.share for turn in turn_layout(device, [d.slo_ms for d in group])]


def _stretch(others: list[tuple[float, int]], threads: int, cores: float) -> float:
    """How many times as long as alone a batch on `threads` takes while each other instance is busy with its
    probability, on its threads: the cores (at least the batch's own threads) shared in proportion to the
    threads busy at once, averaged over which others are busy (the Poisson binomial of their threads). The mean
    of the slowdown, not the slowdown of the mean number busy: with 1.8 cores and a thread each, one other busy
    in two turns costs a batch 5%, not nothing."""
    count = [1.0]  # probability of each number of the others' threads busy (Python floats: a few, asked often)
    for p, k in others:
        grown = [c * (1 - p) for c in count] + [0.0] * k
        for m, c in enumerate(count):
            grown[m + k] += c * p
        count = grown
    top = max(cores, threads)
    return sum(c * max(1.0, (threads + m) / top) for m, c in enumerate(count))


def _slack(group: list[Demand], planned: tuple[float, dict[str, int]], device: Device, lm: LatencyModel) -> float:
    cycle, batches = planned
    shares = _shares(group, device)
    return min(d.slo_ms - cycle - lm.t_inf(d.name, batches[d.name], s) for d, s in zip(group, shares, strict=True))


def time_sharing(demands: list[Demand], devices: list[Device], lm: LatencyModel | None) -> dict[str, list[Choice]]:
    if lm is None:
        raise PlacementError("policy time-sharing needs a fitted latency model: pass --latency-model")
    units = devices[0].units
    pieces: list[Demand] = []  # one per replica, at the replica's rate
    for d in demands:
        for replicas in range(1, len(devices) + 1):
            piece = Demand(d.name, d.slo_ms, d.rate / replicas, d.memory_mb)
            if schedule([piece], devices[0], lm) is not None:
                pieces.extend([piece] * replicas)
                break
        else:
            raise PlacementError(f"time sharing cannot serve {d.name} even with a whole device per replica")
    groups: dict[str, list[Demand]] = {x.id: [] for x in devices}
    memory = {x.id: x.memory_mb for x in devices}
    for piece in sorted(pieces, key=lambda p: (-p.rate * lm.t_inf(p.name, 1, units), p.name)):
        options = []
        for x in devices:
            group = groups[x.id]
            if memory[x.id] < piece.memory_mb or any(g.name == piece.name for g in group):
                continue
            planned = schedule([*group, piece], x, lm)
            if planned is not None:
                options.append((-_slack([*group, piece], planned, x, lm), x.index, x.id))
        if not options:
            raise PlacementError(f"time sharing finds no device with time left for {piece.name}")
        device_id = min(options)[2]
        groups[device_id].append(piece)
        memory[device_id] -= piece.memory_mb
    out: dict[str, list[Choice]] = {}
    by_id = {x.id: x for x in devices}
    for device_id, group in groups.items():
        if not group:
            continue
        cycle, batches = schedule(group, by_id[device_id], lm)
        for d, share in zip(group, _shares(group, by_id[device_id]), strict=True):
            # Triton's batcher waits at most what one cycle leaves of the SLO for a batch to fill.
            delay = int(1000 * max(0.0, d.slo_ms - cycle - lm.t_inf(d.name, batches[d.name], share)))
            batch = batches[d.name]
            out.setdefault(d.name, []).append(Choice(device_id, units, batch, delay if batch > 1 else 0))
    return out

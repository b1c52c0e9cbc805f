"""Local search over placements and shares, BDA inside: the scheduler the trained `inss` actor learns from.

InSS decides placement and shares with a trained agent and batch sizes with BDA. This
policy searches that space directly, widened by one choice per device: split it into
shares (spatial sharing, MPS or CPU quotas) or let its models take turns with all of it
(temporal sharing: on a GPU the duty cycles of `timesharing`; on a CPU every instance at
once on the threads `shares.turn_threads` leaves it, without a quota that idles cores
another instance could use). On a device whose share buys few distinct speeds taking turns
can serve models that no split can; elsewhere splitting wins. Every plan of `spread` and
`time-sharing` (without replicas) is a point of this space, and both are among the starting
points.

From the starts (LPT by work, spread, time-sharing, everything alone where it fits) it
climbs, taking the best neighbour each round: move 5, 10 or 25 units of share between two
models on a device, move a model to another device, swap two models across devices,
switch a device between splitting and taking turns, or run one instance more or fewer of a
model taking turns with a CPU (replicas behind the proxy, each with its part of the rate).
Batches come from BDA on split devices
(exact for a fixed placement) and from the duty cycle on shared-in-turn ones; a model BDA
finds no feasible batch for keeps the batch that serves most of its requests within the
SLO on that placement (partial service, stated in the plan as a predicted miss) instead of
being dropped from the plan. A placement is judged by its predicted goodput first -
requests per second within their SLOs, `queueing.goodput` per model - then by the
goodput if every request were served in its turn (no late request rejected), then by the
fewest instances (a replica costs memory and CPU the model does not see), then by total
throughput sum b / t_inf (problem (1)). The second key matters where a model is overloaded:
`queueing.goodput` credits it with what its capacity would serve by rejecting late requests,
the same for every share that keeps its capacity above its rate, and without the key the
climb stalls on that plateau short of the share that serves it in time. Judging by goodput rather than by
the number of models BDA can serve fully matters when the devices cannot carry every
model: a plan that serves a heavy model at 90% beats one that leaves it out. A model that
no placement serves at all is left to the planner to shed.

It stops at a local optimum or after `MAX_EVALUATIONS` placements looked at (a count, not a
clock, so that a plan does not depend on the machine's speed). A neighbour is given up unjudged
once what its devices' batch times allow them to serve cannot beat the best neighbour so far
(`Judge.beats`): the climb finds what judging every neighbour in full finds.

Then, only where the best placement serves some model short of its rate, a replica phase
climbs again from it (and from time-sharing's plan where that splits a model into
replicas) on a budget of its own, with two more moves: a model served short takes a
replica on a device that has none of its replicas, or a model with several gives one up.
A model's replicas share its rate evenly (the proxy balances by equal weights) and the
device gaining or losing one re-splits; a placement's keys are its replicas
(`replica_key`). Devices do not interact, so a placement is judged device by device. Where
every model is served, plans are those of the climb alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

from tritonctl.latency.model import LatencyModel
from tritonctl.latency.queueing import goodput, goodputs
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError
from tritonctl.planning.policies.bda import Scans, batch_rows, bda, corunners, with_batches
from tritonctl.planning.policies.spread import spread
from tritonctl.planning.policies.timesharing import Turns, time_sharing, turn_choices, turn_outcome
from tritonctl.shares import threads_for_cores

STEP = 5  # share grid, in units
MOVES = (STEP, 2 * STEP, 5 * STEP)  # share moved between two models at a time: large steps jump over plateaus
MAX_EVALUATIONS = 300
TURNS = 0  # the share of a model on a device whose models take turns with all of it
GOODPUT_TIE = 1e-4  # goodputs within this part of the offered load tie, and throughput decides

MAX_COPIES = 8  # instances of one model taking turns with one CPU device, at most


class Spot(NamedTuple):
    """Where a candidate placement puts a model: a device, its share in units (or TURNS), and how many instances
    of it take turns with that device (more than one only on a CPU, where replicas beat threads: two 1-thread
    instances serve about 1.9x one instance's requests on 2 cores, and a queue served by two is shorter)."""

    device: str
    share: int
    copies: int = 1


Placement = dict[str, Spot]  # replica (`replica_key`) -> where it runs
REPLICA = "#"  # a model's second, third ... replica in a placement is "name#2", "name#3" (no model name holds "#")


def replica_key(name: str, k: int) -> str:
    """The placement key of model `name`'s replica `k` (0: the model's own name)."""
    return name if k == 0 else f"{name}{REPLICA}{k + 1}"


def model_of(key: str) -> str:
    """The model a placement key is a replica of."""
    return key.partition(REPLICA)[0]


def replica_counts(placement: Placement) -> Counter[str]:
    """How many replicas (placement keys) each model has."""
    return Counter(model_of(key) for key in placement)


def canonical(placement: Placement, devices: list[Device]) -> Placement:
    """The same placement with each model's replicas keyed in device order (equal placements, equal keys)."""
    if not any(REPLICA in key for key in placement):  # one replica a model: already canonical
        return placement
    index = {d.id: k for k, d in enumerate(devices)}
    spots: dict[str, list[Spot]] = {}
    for key, spot in placement.items():
        spots.setdefault(model_of(key), []).append(spot)
    return {
        replica_key(name, k): spot
        for name, mine in spots.items()
        for k, spot in enumerate(sorted(mine, key=lambda s: index[s.device]))
    }


def max_copies(device: Device) -> int:
    """Instances of one model that may take turns with `device`: one a core on a CPU, its cores rounded as a
    share's threads are (1.96 cores left by reservations still run two), one on a GPU (whose turns run one
    after another, so a second instance adds nothing)."""
    return 1 if device.kind != "cpu" else min(MAX_COPIES, threads_for_cores(device.cores or 1))


def _split(names: list[str], weights: dict[str, float], units: int, floor: dict[str, int]) -> dict[str, int] | None:
    """Shares on a STEP grid in proportion to `weights`, each at least its floor, adding up to at most `units`
    (all three keyed as `names`)."""
    if sum(max(floor[n], STEP) for n in names) > units:
        return None
    total = sum(weights[n] for n in names) or 1.0
    shares = {n: max(floor[n], STEP * int(units * weights[n] / total / STEP)) for n in names}
    while sum(shares.values()) > units:  # the floors pushed it over: trim the largest
        largest = max(names, key=lambda n: shares[n])
        shares[largest] -= STEP
    return shares


def _turns(placement: Placement, device: str) -> bool:
    return any(spot.device == device and spot.share == TURNS for spot in placement.values())


def _resplit(
    placement: Placement, device: Device, names: list[str], work: dict[str, float], floor: dict[str, int]
) -> Placement | None:
    """`names` as the models of `device`, in turns if it already takes turns, else split in proportion to work."""
    if not names:
        return {}
    if _turns(placement, device.id) or len(names) == 1:  # models that stay keep their copies
        copies = {n: placement[n].copies if placement[n].device == device.id else 1 for n in names}
        return normal({n: Spot(device.id, TURNS, copies[n]) for n in names}, [device])
    shares = _split(names, work, device.units, floor)
    return None if shares is None else {n: Spot(device.id, s) for n, s in shares.items()}


def _starts(
    demands: list[Demand], devices: list[Device], lm: LatencyModel, work: dict[str, float], floor: dict[str, int]
) -> Iterator[Placement]:
    """LPT by work (models by decreasing work onto the least-loaded device), split in proportion to work and
    in turns; spread's placement with its equal shares, split in proportion to work and in turns; and
    time-sharing's plan where it has one replica per model."""
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
    assignments = [lpt]
    try:
        spread_choice = {n: c[0] for n, c in spread(demands, devices, lm).items()}
        yield {n: Spot(c.device, c.share) for n, c in spread_choice.items()}
        assignments.append({n: c.device for n, c in spread_choice.items()})
    except PlacementError:
        pass
    try:
        shared = time_sharing(demands, devices, lm)
        if all(len(c) == 1 for c in shared.values()):
            yield normal({n: Spot(c[0].device, TURNS) for n, c in shared.items()}, devices)
            assignments.append({n: c[0].device for n, c in shared.items()})
    except PlacementError:
        pass
    for assignment in assignments:
        for turns in (False, True):
            placement: Placement = {}
            for device in devices:
                names = [n for n, dev in assignment.items() if dev == device.id]
                if turns and len(names) > 1:
                    placement.update({n: Spot(device.id, TURNS) for n in names})
                    continue
                shares = _split(names, work, device.units, floor) if names else {}
                if shares is None:
                    break
                placement.update({n: Spot(device.id, s) for n, s in shares.items()})
            else:
                yield normal(placement, devices)


def normal(placement: Placement, devices: list[Device]) -> Placement:
    """A single instance alone on a device taking turns has all of it."""
    units = {d.id: d.units for d in devices}
    count: dict[str, int] = {}
    for spot in placement.values():
        count[spot.device] = count.get(spot.device, 0) + spot.copies
    return {
        n: Spot(spot.device, units[spot.device]) if spot.share == TURNS and count[spot.device] == 1 else spot
        for n, spot in placement.items()
    }


def _keyed(placement: Placement, work: dict[str, float], floor: dict[str, int]) -> tuple[dict, dict]:
    """Work and share floor per placement key: a replica's work is its part of its model's."""
    count = replica_counts(placement)
    return (
        {k: work[model_of(k)] / count[model_of(k)] for k in placement},
        {k: floor[model_of(k)] for k in placement},
    )


def _holds(placement: Placement, device: str, key: str) -> bool:
    """Whether `device` runs a replica of `key`'s model other than `key` (replicas of one model take separate
    devices; on one device a model runs more instances as copies)."""
    return any(k != key and model_of(k) == model_of(key) and s.device == device for k, s in placement.items())


def _neighbours(
    placement: Placement,
    devices: list[Device],
    work: dict[str, float],
    floor: dict[str, int],
    short: frozenset[str] = frozenset(),
    copies: bool = True,
) -> Iterator[Placement]:
    """Every placement one move away (see the module docstring); models in `short` (served short of their
    rate) may take a replica more, on a device that has none of theirs; without `copies`, no model takes a
    second instance on a device."""
    by_id = {d.id: d for d in devices}
    names = sorted(placement)
    keyed_work, keyed_floor = _keyed(placement, work, floor)
    for a in names:  # move share between two models on one split device, in small and large steps
        for b in names:
            (dev_a, sa, _), (dev_b, sb, _) = placement[a], placement[b]
            for step in MOVES:
                if a != b and dev_a == dev_b and sa != TURNS and sb - step >= max(keyed_floor[b], STEP):
                    yield {**placement, a: Spot(dev_a, sa + step), b: Spot(dev_b, sb - step)}
    for a in names:  # move a model; a split device re-splits in proportion to work
        origin = placement[a].device
        for device in devices:
            if device.id == origin or _holds(placement, device.id, a):
                continue
            moved = {n: spot for n, spot in placement.items() if n != a}
            for dev, group in (
                (origin, [n for n in names if placement[n].device == origin and n != a]),
                (device.id, [n for n in names if placement[n].device == device.id] + [a]),
            ):
                shares = _resplit(placement, by_id[dev], group, keyed_work, keyed_floor)
                if shares is None:
                    break
                moved.update(shares)
            else:
                yield canonical(normal(moved, devices), devices)
    for i, a in enumerate(names):  # swap two models across devices, shares (and copies) stay with the device
        for b in names[i + 1 :]:
            (dev_a, sa, ca), (dev_b, sb, cb) = placement[a], placement[b]
            if (
                dev_a != dev_b
                and (sb == TURNS or sb >= keyed_floor[a])
                and (sa == TURNS or sa >= keyed_floor[b])
                and not (_holds(placement, dev_b, a) or _holds(placement, dev_a, b))
            ):
                yield canonical({**placement, a: Spot(dev_b, sb, cb), b: Spot(dev_a, sa, ca)}, devices)
    for device in devices:  # switch a device between split shares and turns
        group = [n for n in names if placement[n].device == device.id]
        if len(group) < 2:
            continue
        if _turns(placement, device.id):
            shares = _split(group, keyed_work, device.units, keyed_floor)
            if shares is not None:
                yield {**placement, **{n: Spot(device.id, s) for n, s in shares.items()}}
        else:
            yield {**placement, **{n: Spot(device.id, TURNS) for n in group}}
    for a in names:  # one instance more or fewer of a model taking turns with a CPU (or alone on one)
        spot, device = placement[a], by_id[placement[a].device]
        alone = spot.share == device.units and sum(s.device == device.id for s in placement.values()) == 1
        if copies and (spot.share == TURNS or alone) and spot.copies < max_copies(device):
            yield {**placement, a: Spot(device.id, TURNS, spot.copies + 1)}
        if spot.copies > 1:
            yield normal({**placement, a: Spot(device.id, TURNS, spot.copies - 1)}, devices)
    yield from _replica_moves(placement, devices, work, floor, short)


def _replica_moves(
    placement: Placement, devices: list[Device], work: dict[str, float], floor: dict[str, int], short: frozenset
) -> Iterator[Placement]:
    """A replica more of a model in `short` on a device without one (the rest of its rate split evenly), and
    one replica fewer of a model with several; the device gaining or losing it re-splits in proportion to work."""
    for name in sorted(short):
        held = {s.device for k, s in placement.items() if model_of(k) == name}
        new = replica_key(name, len(held))
        for device in devices:
            if device.id in held:
                continue
            grown = {**placement, new: Spot(device.id, TURNS if _turns(placement, device.id) else STEP)}
            keyed_work, keyed_floor = _keyed(grown, work, floor)
            group = [k for k, s in grown.items() if s.device == device.id]
            shares = _resplit(grown, device, group, keyed_work, keyed_floor)
            if shares is not None:
                yield canonical(normal({**grown, **shares}, devices), devices)
    by_id, count = {d.id: d for d in devices}, replica_counts(placement)
    for gone in sorted(placement):
        if count[model_of(gone)] < 2:
            continue
        left = {k: s for k, s in placement.items() if k != gone}
        keyed_work, keyed_floor = _keyed(left, work, floor)
        device = by_id[placement[gone].device]
        group = [k for k, s in left.items() if s.device == device.id]
        shares = _resplit(left, device, group, keyed_work, keyed_floor)
        if shares is not None:
            yield canonical(normal({**left, **shares}, devices), devices)


def _partial(
    placement: dict[str, Choice],
    batches: dict[str, int],
    infeasible: dict[str, str],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
    memo: dict,
    scans: Scans | None = None,
) -> dict[str, int]:
    """Batches for a placement after BDA. A model with feasible batches takes the one serving most requests per
    second: BDA's largest feasible batch assumes throughput grows with the batch, which on a CPU stops being true
    past batch 8-16 (more latency for less throughput). A model BDA found none for takes the one with the most
    predicted goodput on this placement.

    Batches that break device memory are never taken; where every batch does, batch 1 stays
    (its goodput then counts as 0).
    """
    by_name = {d.name: d for d in demands}
    by_id = {d.id: d for d in devices}
    out = dict(batches)
    for name in by_name:
        if name not in infeasible:  # BDA's largest feasible batch, or a smaller feasible one serving more per second
            key = ("feasible", name, by_name[name].rate, placement[name].share, corunners(name, placement, out))
            if key not in memo:
                best_b, best_rate, slo_ms = out[name], 0.0, by_name[name].slo_ms
                over, times, p99, stable = batch_rows(name, placement, by_name, out, by_id, lm, scans)
                for b in range(1, len(times) + 1):  # a p99 is computed only where the batch would serve more
                    faster = b / times[b - 1] > best_rate * (1 + 1e-9)
                    if faster and not over[b - 1] and stable[b - 1] and p99[b - 1] <= slo_ms:
                        best_b, best_rate = b, b / times[b - 1]
                memo[key] = best_b
            out[name] = memo[key]
    for name in infeasible:
        demand, best = by_name[name], (0.0, 1)
        others = corunners(name, placement, out)
        key = (name, demand.rate, placement[name].share, others)  # the same device layout recurs across placements
        if key not in memo:
            over, times, _, _ = batch_rows(name, placement, by_name, out, by_id, lm, scans)
            for b, (too_big, exec_ms) in enumerate(zip(over, times, strict=True), 1):
                if too_big:
                    break  # memory grows with the batch
                if min(demand.rate, 1000 * b / exec_ms) * (1 + 1e-9) <= best[0] + 1e-3:
                    continue  # no goodput above what this batch size completes, nor above the rate
                g = goodput(demand.rate, b, exec_ms, demand.slo_ms)
                if g > best[0] + 1e-3:
                    best = (g, b)
            memo[key] = best[1]
        out[name] = memo[key]
    return out


class Judged(NamedTuple):
    """What a placement yields: its score (lower is better), batches per placement key, goodput per model (its
    replicas' together), and per device taken in turns its members with the duty cycle's outcome."""

    score: tuple
    batches: dict[str, int]
    served: dict[str, float]
    taking_turns: dict[str, tuple]


class _Device(NamedTuple):
    """What one device's members yield (devices do not interact): batches, goodput and in-turn goodput per
    member, its requests per second sum b / t_inf per member split, the duty cycle's outcome where they take
    turns."""

    batches: dict[str, int]
    served: dict[str, float]
    in_turn: dict[str, float]
    throughput: dict[str, float]
    turns: Turns | None = None


class Judge:
    """Judges placements of `demands` on `devices` (cached), as search ranks them: by predicted goodput
    (`queueing.goodput` per model), then by the goodput if every request were served in its turn, then by the
    fewest instances, then by total throughput sum b / t_inf (problem (1)); see the module docstring.

    A placement's keys are its replicas (`replica_key`): a model with several takes its rate in equal parts.
    With `in_part`, a CPU taken in turns by an instance that keeps up at no batch is judged by what it serves in
    part (`timesharing.schedule`), not as serving nothing: what a placement serves, rather than what to plan."""

    def __init__(self, demands: list[Demand], devices: list[Device], lm: LatencyModel, in_part: bool = False):
        self.demands, self.devices, self.lm, self.in_part = demands, devices, lm, in_part
        self.by_name = {d.name: d for d in demands}
        self.order = {d.name: k for k, d in enumerate(demands)}  # BDA sizes a device's models in model order
        self.quantum = max(1e-3, GOODPUT_TIE * sum(d.rate for d in demands))
        self.evaluations = 0
        self._seen: set[tuple] = set()
        self._most: dict[tuple, float] = {}  # `most_served` per device layout
        self._judged: dict[tuple, Judged] = {}
        self._memo: dict[tuple, int] = {}
        # every batch size of a model in a device layout, BDA's and the batches' scans: BDA on a placement of these
        # demands elsewhere may read and add to them
        self.scans: Scans = {}
        self._devices: dict[tuple, _Device] = {}  # one device's members: devices do not interact

    def __call__(self, placement: Placement) -> Judged:
        key = tuple(sorted(placement.items()))
        if key not in self._judged:
            self._count(key)
            self._judged[key] = self._judge(placement)
        return self._judged[key]

    def _count(self, key: tuple) -> None:
        """`evaluations` counts the placements looked at, each once, whether judged in full or given up."""
        if key not in self._seen:
            self._seen.add(key)
            self.evaluations += 1

    def pieces(self, placement: Placement) -> dict[str, Demand]:
        """Each key's demand, in model order: its model's, at the model's rate over its replicas."""
        count = replica_counts(placement)
        out = {}
        for key in sorted(placement, key=lambda k: (self.order[model_of(k)], k)):
            d = self.by_name[model_of(key)]
            out[key] = d if count[d.name] == 1 else Demand(d.name, d.slo_ms, d.rate / count[d.name], d.memory_mb)
        return out

    def beats(self, placement: Placement, best: tuple, slack: float = 0.0) -> Judged | None:
        """The placement's judgement, or None where it cannot score better than the score `best` with `slack`
        requests/s more: judged device by device, those judged before first, then those with the most requests, it
        is given up once its goodput with every device not yet judged serving the most it can (`most_served`) ranks
        below `best`'s less `slack` (the score's first term)."""
        key = tuple(sorted(placement.items()))
        if key in self._judged:
            return self._judged[key]
        self._count(key)
        pieces = self.pieces(placement)
        # the devices judged already first (they cost nothing), then those with the most requests (most can be lost)
        groups = sorted(
            self._groups(placement, pieces), key=lambda g: (g[3] not in self._devices, -sum(d.rate for d, _ in g[3]))
        )
        most = [self.most_served(spots, turns) for _, _, turns, spots in groups]
        bar, unjudged, served = best[0] + round(slack / self.quantum), sum(most), 0.0
        if -round(unjudged / self.quantum) > bar:
            return None
        for (device, members, turns, spots), most_here in zip(groups, most, strict=True):
            outcome = self._device(device, spots, turns)
            unjudged -= most_here
            served += sum(outcome.served[model_of(k)] for k in members)
            if -round((served + unjudged) / self.quantum) > bar:
                return None
        return self(placement)

    def most_served(self, members: tuple[tuple[Demand, Spot], ...], turns: bool) -> float:
        """The most one device's members can serve within their SLOs, from their batch times alone: on a split
        device each model its rate or the most requests per second its batches within the SLO complete, whichever
        is less (`queueing.goodputs` credits no more). Their rates where they take turns, and under a latency
        model whose times depend on the co-runners' batches (the MLP), which are not known before BDA."""
        if turns or self.lm.reads_corunner_batches:
            return sum(d.rate for d, _ in members)
        most = self._most.get(members)
        if most is None:
            total = 0.0
            for demand, spot in members:
                others = tuple((d.name, s.share, 1) for d, s in members if d is not demand)  # in `corunners`' order
                times = enumerate(self.lm.t_infs(demand.name, spot.share, others).tolist(), 1)
                total += min(demand.rate, 1000 * max((b / t for b, t in times if t <= demand.slo_ms), default=0))
            most = self._most[members] = total * (1 + 1e-9)  # above what the judgement's arithmetic rounds to
        return most

    def _groups(
        self, placement: Placement, pieces: dict[str, Demand]
    ) -> Iterator[tuple[Device, list[str], bool, tuple[tuple[Demand, Spot], ...]]]:
        """Per device, its split members and then those taking turns: (device, member keys, taking turns, their
        (demand, spot) pairs)."""
        for device in self.devices:
            keys = [k for k in pieces if placement[k].device == device.id]
            for turns in (False, True):
                members = [k for k in keys if (placement[k].share == TURNS) == turns]
                if members:
                    yield device, members, turns, tuple((pieces[k], placement[k]) for k in members)

    def _judge(self, placement: Placement) -> Judged:
        pieces = self.pieces(placement)
        batches: dict[str, int] = {}
        served, in_turn, throughputs = {d.name: 0.0 for d in self.demands}, {d.name: 0.0 for d in self.demands}, {}
        turn_capacities, taking_turns = [], {}
        for device, members, turns, spots in self._groups(placement, pieces):
            outcome = self._device(device, spots, turns)
            for k in members:
                name = model_of(k)
                batches[k] = outcome.batches[name]
                served[name] += outcome.served[name]
                in_turn[name] += outcome.in_turn[name]
                if not turns:
                    throughputs[k] = outcome.throughput[name]
            if turns:
                taking_turns[device.id] = (tuple((pieces[k], placement[k].copies) for k in members), outcome.turns)
                turn_capacities.append(outcome.turns.capacity)
        capacity = sum([*(throughputs[k] for k in pieces if k in throughputs), *turn_capacities])  # sum b / t_inf
        # an instance more costs memory and CPU the latency model does not see: only goodput pays for one
        instances = sum(spot.copies for spot in placement.values())
        quantum = self.quantum
        score = (-round(sum(served.values()) / quantum), -round(sum(in_turn.values()) / quantum), instances, -capacity)
        return Judged(score, batches, served, taking_turns)

    def _device(self, device: Device, members: tuple[tuple[Demand, Spot], ...], turns: bool) -> _Device:
        """One device's split members (BDA, or the best partial batch) or members taking turns (the duty cycle),
        cached by the device's layout."""
        if members not in self._devices:  # the spots name the device and whether it is taken in turns
            self._devices[members] = self._judge_turns(device, members) if turns else self._judge_split(device, members)
        return self._devices[members]

    def _judge_split(self, device: Device, members: tuple[tuple[Demand, Spot], ...]) -> _Device:
        lm, here = self.lm, [d for d, _ in members]
        choices = {d.name: Choice(device.id, spot.share) for d, spot in members}
        decision = bda(choices, here, self.devices, lm, self.scans)  # Algorithm 1 sizes beside the device's models
        infeasible = decision.infeasible
        batches = _partial(choices, decision.batches, infeasible, here, self.devices, lm, self._memo, self.scans)
        # meeting the SLO at p99 (BDA's constraint) counts as serving the whole rate, as in problem (1)
        served = {d.name: d.rate for d in here if d.name not in infeasible}
        in_turn = dict(served)  # the same, with every request served in its turn (nothing rejected)
        for d in here:
            if d.name in infeasible:
                t = lm.t_inf(d.name, batches[d.name], choices[d.name].share, corunners(d.name, choices, batches))
                fits = infeasible[d.name] != "memory"
                served[d.name], in_turn[d.name] = goodputs(d.rate, batches[d.name], t, d.slo_ms) if fits else (0, 0)
        rates = {
            n: 1000 * batches[n] / lm.t_inf(n, batches[n], c.share, corunners(n, choices, batches))
            for n, c in choices.items()
        }
        return _Device(batches, served, in_turn, rates)

    def _judge_turns(self, device: Device, members: tuple[tuple[Demand, Spot], ...]) -> _Device:
        outcome = turn_outcome([(d, spot.copies) for d, spot in members], device, self.lm, self.in_part)
        return _Device(outcome.batches, outcome.served, outcome.in_turn, {}, outcome)

    def choices(self, placement: Placement) -> dict[str, list[Choice]]:
        """The plan of a placement, per model its replicas: BDA's (or the best partial) batches on split devices
        with queue delays that fill them, the duty cycle's choices on devices taken in turns."""
        judged, by_id, pieces = self(placement), {d.id: d for d in self.devices}, self.pieces(placement)
        out: dict[str, list[Choice]] = {}
        for device in self.devices:
            split = [k for k in pieces if placement[k].device == device.id and placement[k].share != TURNS]
            choices = {model_of(k): Choice(device.id, placement[k].share) for k in split}
            batches = {model_of(k): judged.batches[k] for k in split}
            for name, chosen in with_batches(choices, batches, [pieces[k] for k in split], self.lm).items():
                out.setdefault(name, []).extend(chosen)
        for device_id, (members, turns) in judged.taking_turns.items():
            for name, chosen in turn_choices(list(members), by_id[device_id], turns, self.lm).items():
                out.setdefault(name, []).extend(chosen)
        return {d.name: out[d.name] for d in self.demands if d.name in out}


def climb(
    demands: list[Demand], devices: list[Device], lm: LatencyModel, replicas: bool = True, copies: bool = True
) -> tuple[Placement, Judge]:
    """The best placement the climb finds from every start (see the module docstring), and its judge; with
    `replicas` False every model has one device (what the trained actor can express), and with `copies` False no
    model has two instances on one device."""
    work, floor = _work_and_floor(demands, devices, lm)
    judge = Judge(demands, devices, lm)
    starts = sorted((judge(p).score, k, p) for k, p in enumerate(_starts(demands, devices, lm, work, floor)))
    best = None
    for score, _, current in starts:
        found = _ascend(
            judge, current, score, lambda p: _neighbours(p, devices, work, floor, copies=copies), MAX_EVALUATIONS
        )
        if best is None or found[1] < best[1]:
            best = found
    if replicas and _short(judge, best[0]):  # the replica phase, on a budget of its own
        limit = judge.evaluations + MAX_EVALUATIONS
        replicated = [p for p in _replicated(demands, devices, lm) if copies or not _doubled(p)]
        for current in [best[0], *replicated]:
            found = _ascend(
                judge,
                current,
                judge(current).score,
                lambda p: _neighbours(p, devices, work, floor, frozenset(_short(judge, p)), copies),
                limit,
            )
            if found[1] < best[1]:
                best = found
    return best[0], judge


def grow_replicas(judge: Judge, placement: Placement) -> Placement:
    """`placement` with replicas added where a model is served short of its rate (and given up where that serves
    more): steepest ascent over the replica moves alone. A device gaining or losing a replica re-splits; every
    other model stays where it is (a trained actor places one replica a model, this adds the rest). `placement`
    itself where it serves every model whole."""
    if not _short(judge, placement):
        return placement
    work, floor = _work_and_floor(judge.demands, judge.devices, judge.lm)
    found, _ = _ascend(
        judge,
        placement,
        judge(placement).score,
        lambda p: _replica_moves(p, judge.devices, work, floor, frozenset(_short(judge, p))),
        judge.evaluations + MAX_EVALUATIONS,
    )
    return found


def _work_and_floor(
    demands: list[Demand], devices: list[Device], lm: LatencyModel
) -> tuple[dict[str, float], dict[str, int]]:
    """Per model the device time its rate asks for at batch 1 (what shares are split in proportion to) and the
    least share it runs at."""
    work = {d.name: max(d.rate, 1e-3) * lm.t_inf(d.name, 1, devices[0].units) for d in demands}
    return work, {d.name: lm.models[d.name].share_range[0] for d in demands}


def _ascend(
    judge: Judge, current: Placement, score: tuple, neighbours: Callable[[Placement], Iterator[Placement]], limit: int
) -> tuple[Placement, tuple]:
    """Steepest ascent from `current`: the best neighbour while it improves, until `judge` has looked at `limit`
    placements (a neighbour that cannot beat the best so far is given up unjudged, `Judge.beats`)."""
    while judge.evaluations < limit:
        improved = None
        for candidate in neighbours(current):
            bar = score if improved is None else improved[1]
            verdict = judge.beats(candidate, bar)
            if verdict is not None and verdict.score < bar:
                improved = (candidate, verdict.score)
            if judge.evaluations >= limit:
                break
        if improved is None:
            break
        current, score = improved
    return current, score


def _replicated(demands: list[Demand], devices: list[Device], lm: LatencyModel) -> list[Placement]:
    """Time-sharing's plan where it splits a model into replicas (none otherwise: it is among the starts)."""
    try:
        shared = time_sharing(demands, devices, lm)
    except PlacementError:
        return []
    if all(len(c) == 1 for c in shared.values()):
        return []
    spots = {replica_key(n, k): Spot(c.device, TURNS) for n, cs in shared.items() for k, c in enumerate(cs)}
    return [canonical(normal(spots, devices), devices)]


def _doubled(placement: Placement) -> bool:
    """Whether a model has two replicas on one device (time-sharing's replicas taking turns with one CPU)."""
    return len({(model_of(k), s.device) for k, s in placement.items()}) < len(placement)


def _short(judge: Judge, placement: Placement) -> list[str]:
    """The models `placement` serves short of their rate (beyond the tie margin)."""
    served = judge(placement).served
    return [d.name for d in judge.demands if served[d.name] < d.rate - judge.quantum]


def search(
    demands: list[Demand], devices: list[Device], lm: LatencyModel | None, replicas: bool = True, copies: bool = True
) -> dict[str, list[Choice]]:
    if lm is None:
        raise PlacementError("policy search needs a fitted latency model: pass --latency-model")
    placement, judge = climb(demands, devices, lm, replicas, copies)
    unserved = sorted(n for n, g in judge(placement).served.items() if g <= 0)  # per model, its replicas together
    if unserved:
        raise PlacementError(
            f"no placement the search found serves {', '.join(unserved)} within its SLO at all", shed=unserved
        )
    return judge.choices(placement)

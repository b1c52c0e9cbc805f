"""The optimum over search's space of device layouts, by a mixed-integer program (HiGHS): the yardstick.

Each device is either split (every model on it at a share on the STEP grid, with a batch) or
taken in turns by a set of models with all of it (on a CPU with copies of a model), as in
`search`. A model may be split into replicas on up to MAX_REPLICAS devices, at most one a
device, each with an equal part of its rate (as search's replica phase splits it, and the proxy
balances equal weights): every option and turn set below exists once per replica count, its
model's demand at that part of the rate. The objective is goodput: requests per second within
the SLO, as search judges a plan. A model served on a split device counts its whole rate (its
p99 by eq. 2 within the SLO at its rate, BDA's constraint); a model taking turns counts what
`turn_outcome` says it serves.

Split devices. A binary per option (model, device, share, batch). The InSS latency model is
linear in what the co-runners bring (`LatencyModel.t_inf`): t = io + run (1 + alpha_i u_i sum_j
l_j) + n_ops (a N + b) once N >= 2 models share the device (u_i the instance's duty on a CPU
where the model weighs by it, else 1), where a co-runner's cache
pressure l_j depends on its share alone and N counts the options chosen on the device. Each
option carries the longest batch time at which its batch still meets the SLO at the model's
rate (the p99 of eq. 2 grows with it), so the option holds iff the sum of its co-runners'
terms stays under what that leaves: a big-M row enforced when the option is chosen and the
device shared. The CPU contention term (threads beyond cores) is not linear: every solution
is checked against the full latency model, a split it breaks is cut off (a no-good row, on
every device of its kind and at any larger part of the rates; a model late beside its
co-runners is cut off beside them at any batch of theirs, which its batch time does not
read), and the program is solved again, until a solution holds or the best that held is
within GAP of the bound (`solve`).
Of an option's batches only those that no other batch of the same share dominates (holds in
every context it holds in, in no more memory) are kept; the plan takes BDA's batches on the
chosen placement (the largest that hold: the most throughput).

Devices taken in turns. Every set of models (with copies on a CPU, at most `max_copies`; each
member at one of its replica counts) is evaluated once per kind of device with the code search
judges with; a binary per (device, set). Where the sets would outnumber MAX_TURN_SETS, models
taking turns have fewer replica counts (`turn_replicas`; eight models on a GPU: up to two).

A binary per (model, replica count) says how many replicas the model has; exactly that many of
its options and memberships are chosen, on as many devices.

Not in this space: a model served in part (late requests) on a split device, which search may
plan, so its goodput can exceed this optimum where some model cannot be served whole; and more
than MAX_REPLICAS replicas of a model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import highspy

from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.latency.queueing import task_latency
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError, PolicyLimit
from tritonctl.planning.policies.bda import bda, broken_constraint, memory_at, with_batches
from tritonctl.planning.policies.search import max_copies
from tritonctl.planning.policies.timesharing import Turns, turn_choices, turn_outcome

STEP = 5  # share grid, in device units (search's)
MAX_REPLICAS = 3  # devices a model's rate may be split across
TIME_LIMIT_S = 300.0
TIE = 1e-7  # goodputs this close (relative) are one: the solver's rounding
GAP = 0.005  # where checking CPU contention cuts off solution after solution: done once the best checked is this close
MAX_OPTIONS = 200_000  # binaries the program may hold: beyond, the cluster is refused before solving
MAX_TURN_SETS = 20_000  # sets of models (with copies) taking turns, per kind of device


@dataclass(frozen=True)
class Option:
    """One model at one share and batch on one device, and what its batch time leaves for co-runners."""

    model: str
    device: str
    share: int
    batch: int
    replicas: int  # the model's replicas: this one serves that part of its rate
    memory_mb: float
    pressure: float  # the cache pressure it puts on its co-runners (l_j)
    per_pressure: float  # ms its batch takes longer per unit of its co-runners' pressure (run x alpha_i x u_i)
    per_corunner: float  # ms it takes longer per model on the device, once shared (n_ops x a)
    shared_ms: float  # ms it takes longer once shared at all (n_ops x b)
    slack_ms: float  # ms of co-runners' terms its SLO allows (longest batch time less the time alone)


@dataclass(frozen=True)
class Outcome:
    """What the solver found: the plan, its goodput, the best bound on any plan's, and how it ended."""

    choices: dict[str, list[Choice]]
    goodput: float
    bound: float
    status: str
    seconds: float
    cuts: int

    @property
    def gap(self) -> float:
        return 0.0 if self.bound <= 0 else max(0.0, (self.bound - self.goodput) / self.bound)

    @property
    def proven(self) -> bool:
        return self.gap <= 1e-9

    def leaving_out(self, unserved: list[str]) -> PlacementError:
        """The error that sheds the models this outcome leaves out, calling it the optimum only where proven."""
        found = "the optimum" if self.proven else f"the best plan found (gap {100 * self.gap:.2f}%)"
        return PlacementError(f"{found} leaves {', '.join(unserved)} unserved", shed=unserved)

    def summary(self) -> str:
        proven = "optimal" if self.proven else f"best found, gap {100 * self.gap:.2f}% ({self.status})"
        cuts = f", {self.cuts} split(s) cut off by CPU contention" if self.cuts else ""
        return (
            f"optimal policy: goodput {self.goodput:.2f} requests/s, bound {self.bound:.2f}: {proven} "
            f"in {self.seconds:.1f} s{cuts}"
        )


def longest_batch_ms(demand: Demand, batch: int, low: float) -> float:
    """The longest batch time (ms) at which batches of `batch` keep the model's p99 (eq. 2) within its SLO at its
    rate; below `low` when even that breaks it (bisection: the p99 grows with the batch time)."""

    def holds(t: float) -> bool:
        task = task_latency(demand.rate, batch, t)
        return task.stable and task.p99_ms <= demand.slo_ms

    if not holds(low):
        return low - 1.0
    high = min(demand.slo_ms, 1000.0 * batch / demand.rate if demand.rate > 0 else demand.slo_ms)
    if holds(high):
        return high
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return low


def part(demand: Demand, replicas: int) -> Demand:
    """What one of a model's `replicas` replicas is asked to serve: its part of the rate."""
    return dataclasses.replace(demand, rate=demand.rate / replicas)


def split_options(model: Demand, device: Device, lm: LatencyModel, pressure: float, replicas: int) -> list[Option]:
    """The options of one of a model's `replicas` replicas on a split device that hold at least alone, dominated
    batches left out (`pressure`: the most its co-runners can put on it)."""
    demand = part(model, replicas)
    p, d, margin = lm.models[demand.name], lm.device, lm.margin_of(demand.name)
    out = []
    for share in range(max(STEP, math.ceil(p.share_range[0] / STEP) * STEP), device.units + 1, STEP):
        candidates = []
        for batch in range(1, MAX_BATCH + 1):
            memory = memory_at(demand, batch, lm)
            if memory > device.memory_mb:
                break
            alone = lm.t_inf(demand.name, batch, share) / (1 + margin)
            slack = longest_batch_ms(demand, batch, alone * (1 + margin)) / (1 + margin) - alone
            if slack < 0:
                continue
            run = lm.run_ms(demand.name, batch, share)
            candidates.append(
                Option(
                    demand.name,
                    device.id,
                    share,
                    batch,
                    replicas,
                    memory,
                    lm.cache_pressure(demand.name, share),
                    run * p.alpha_cache * (lm.duty(share) if d.pressure_by_duty else 1.0),
                    p.n_ops * d.sched_a,
                    p.n_ops * d.sched_b,
                    slack,
                )
            )
        out += _undominated(candidates, pressure)
    return out


def _undominated(options: list[Option], pressure: float) -> list[Option]:
    """Options of one share no other dominates: another holds wherever this one does (its slack less its terms,
    linear in the co-runners' pressure, is at least this one's at none and at the most there can be) in no more
    memory."""

    def room(o: Option, pressure: float) -> float:
        return o.slack_ms - o.shared_ms - o.per_pressure * pressure

    def dominates(a: Option, b: Option) -> bool:
        if a.memory_mb > b.memory_mb or a.per_corunner > b.per_corunner:
            return False
        return all(room(a, x) >= room(b, x) for x in (0.0, pressure))

    def beaten(o: Option) -> bool:  # of two that dominate each other, the larger batch stays
        return any(dominates(k, o) and (not dominates(o, k) or k.batch > o.batch) for k in options if k is not o)

    return [o for o in options if not beaten(o)]


Member = tuple[Demand, int, int]  # a model taking turns: its demand at its part of the rate, copies, replicas


def turn_replicas(models: int, device: Device, most: int) -> int:
    """The most replicas a model taking turns with `device` may have: `most`, fewer where the sets of `models`
    would outnumber MAX_TURN_SETS (at least 1)."""
    while most > 1 and (1 + most * max_copies(device)) ** models - 1 > MAX_TURN_SETS:
        most -= 1
    return most


def turn_sets(demands: list[Demand], device: Device, replicas: int) -> list[tuple[Member, ...]]:
    """Every non-empty set of models (each with 1..max_copies copies, as one of 1..`replicas` replicas) that could
    take turns with `device`."""
    picks = [(0, 0), *itertools.product(range(1, replicas + 1), range(1, max_copies(device) + 1))]
    count = (len(picks) ** len(demands)) - 1
    if count > MAX_TURN_SETS:
        raise PolicyLimit(
            f"{count:,} sets of models could take turns with one device (more than {MAX_TURN_SETS:,}): the cluster "
            "is too large for the optimal policy"
        )
    out = []
    for combo in itertools.product(picks, repeat=len(demands)):
        members = tuple((part(d, k), c, k) for d, (k, c) in zip(demands, combo, strict=True) if c)
        if members and sum(d.memory_mb * c for d, c, _ in members) <= device.memory_mb:
            out.append(members)
    return out


def _quiet_highs() -> highspy.Highs:
    """A HiGHS instance that prints nothing: its constructor writes a banner to the process's stdout (file
    descriptor 1, below Python), which would break `--format json`, so the descriptor points at /dev/null
    meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    return h


def _kind(device: Device) -> tuple:
    return (device.kind, device.units, device.cores, device.memory_mb)


class _Program:
    """The mixed-integer program over the options and turn sets, solved (again after each cut) by HiGHS."""

    def __init__(self, demands: list[Demand], devices: list[Device], lm: LatencyModel):
        self.demands = demands
        self.h = h = _quiet_highs()
        replicas = min(len(devices), MAX_REPLICAS)
        options: list[Option] = []
        turns: list[tuple[Device, tuple[Member, ...], Turns]] = []
        splits: dict[tuple, list[Option]] = {}  # identical devices: evaluated once
        evaluated: dict[tuple, list] = {}
        for device in devices:
            key = _kind(device)
            if key not in evaluated:
                # refuses a cluster with too many sets before any work
                sets = turn_sets(demands, device, turn_replicas(len(demands), device, replicas))
                most = sum(max(lm.cache_pressure(d.name, s) for s in (1, device.units)) for d in demands)
                splits[key] = [
                    o for d in demands for k in range(1, replicas + 1) for o in split_options(d, device, lm, most, k)
                ]
                evaluated[key] = [(s, turn_outcome([(d, c) for d, c, _ in s], device, lm)) for s in sets]
            options += [dataclasses.replace(o, device=device.id) for o in splits[key]]
            # a member served not at all is better left out of its set
            turns += [(device, m, out) for m, out in evaluated[key] if all(g > 0 for g in out.served.values())]
        if len(options) + len(turns) > MAX_OPTIONS:
            raise PolicyLimit(
                f"{len(options) + len(turns):,} choices of share, batch and turns (more than "
                f"{MAX_OPTIONS:,}): the cluster is too large for the optimal policy"
            )
        self.options: list[tuple[Option, highspy.highs_var]] = [(o, h.addBinary()) for o in options]
        self.index = {(o.device, o.model, o.share, o.batch, o.replicas): x for o, x in self.options}
        self.at_share: dict[tuple[str, str, int], list[highspy.highs_var]] = {}  # every batch and replica count
        for o, x in self.options:
            self.at_share.setdefault((o.device, o.model, o.share), []).append(x)
        self.batch_blind = not lm.reads_corunner_batches
        self.kinds = {device.id: _kind(device) for device in devices}
        self.turns = [(device, m, out, h.addBinary()) for device, m, out in turns]
        self._replica_rows(replicas, devices)
        previous = None  # (kind, measure) of the device before: identical devices hold non-increasing measures
        for device in devices:
            here = [(o, x) for o, x in self.options if o.device == device.id]
            turns_here = [x for dev, _, _, x in self.turns if dev.id == device.id]
            if not here and not turns_here:  # nothing fits on it
                previous = None
                continue
            count = sum(x for _, x in here)  # models split on the device
            taken = sum(turns_here)  # 1 when a set takes turns with it
            measure = count + len(demands) * taken
            if turns_here:
                h.addConstr(taken <= 1)
                h.addConstr(measure <= len(demands))  # taken in turns: nothing split on it
            if previous is not None and previous[0] == _kind(device):
                h.addConstr(measure <= previous[1])
            previous = (_kind(device), measure)
            if here:
                self._split_rows(device, here, count)
        rate = {d.name: d.rate for d in demands}
        objective = sum(rate[o.model] / o.replicas * x for o, x in self.options)
        objective += sum(sum(out.served.values()) * x for _, _, out, x in self.turns)
        self.objective = objective

    def _replica_rows(self, replicas: int, devices: list[Device]) -> None:
        """Each model has one replica count k (or none): exactly k of its options and memberships of that count are
        chosen, at most one on a device."""
        h = self.h
        self.several: list[highspy.highs_var] = []  # the binaries of replica counts above 1
        by_count: dict[tuple[str, int], list] = {}  # (model, k) -> its choices as one of k replicas
        by_device: dict[tuple[str, str], list] = {}  # (model, device) -> its choices there
        for o, x in self.options:
            by_count.setdefault((o.model, o.replicas), []).append(x)
            by_device.setdefault((o.model, o.device), []).append(x)
        for device, members, _, x in self.turns:
            for d, _, k in members:
                by_count.setdefault((d.name, k), []).append(x)
                by_device.setdefault((d.name, device.id), []).append(x)
        for d in self.demands:
            counts = {k: h.addBinary() for k in range(1, replicas + 1) if by_count.get((d.name, k))}
            if counts:
                h.addConstr(sum(counts.values()) <= 1)
            for k, y in counts.items():
                h.addConstr(sum(by_count[d.name, k]) - k * y == 0)
            self.several += [y for k, y in counts.items() if k > 1]
            for device in devices:
                if len(by_device.get((d.name, device.id), ())) > 1:
                    h.addConstr(sum(by_device[d.name, device.id]) <= 1)

    def _split_rows(self, device: Device, here: list, count) -> None:
        """Shares and memory within the device; each chosen option's batch time within its SLO's slack."""
        h, n = self.h, len(self.demands)
        h.addConstr(sum(o.share * x for o, x in here) <= device.units)
        h.addConstr(sum(o.memory_mb * x for o, x in here) <= device.memory_mb)
        shared = h.addBinary()
        h.addConstr(count - 1 <= (n - 1) * shared)
        top = sum(max((o.pressure for o, _ in here if o.model == d.name), default=0.0) for d in self.demands)
        pressure = h.addVariable(lb=0.0, ub=top)  # sum of the chosen options' cache pressure
        corunners = h.addVariable(lb=0.0, ub=n)  # how many are chosen
        h.addConstr(pressure - sum(o.pressure * x for o, x in here) == 0)
        h.addConstr(corunners - count == 0)
        for o, x in here:
            # chosen and shared: per_pressure x (P - its own) + per_corunner x N + shared_ms <= slack
            need = o.per_pressure * (pressure - o.pressure * x) + o.per_corunner * corunners + o.shared_ms
            big = o.per_pressure * top + o.per_corunner * n + o.shared_ms - o.slack_ms
            if big > 0:
                h.addConstr(need - o.slack_ms <= big * (2 - x - shared))

    def allow_replicas(self, allowed: bool) -> None:
        """Let models take several replicas, or hold every one to one (the variables stay: cuts carry over)."""
        for y in self.several:
            self.h.changeColBounds(y.index, 0.0, 1.0 if allowed else 0.0)

    def start_from_last(self) -> None:
        """Start the next solve from the last solution (the checked optimum of the stage before)."""
        self.h.setSolution(self.h.getSolution())

    def solve(self, deadline: float) -> tuple[str, float, float]:
        h = self.h
        h.setOptionValue("time_limit", max(1.0, deadline - time.monotonic()))
        h.setOptionValue("mip_rel_gap", 0.0)
        h.maximize(self.objective)
        info = h.getInfo()
        status = h.modelStatusToString(h.getModelStatus())
        return status, info.objective_function_value, info.mip_dual_bound

    def chosen(self) -> tuple[list[Option], list[tuple[Device, tuple, Turns]]]:
        h = self.h
        options = [o for o, x in self.options if h.val(x) > 0.5]
        turns = [(dev, m, out) for dev, m, out, x in self.turns if h.val(x) > 0.5]
        return options, turns

    def cut(self, options: list[Option], late: list[Option]) -> None:
        """Forbid a split the full latency model breaks, on every device of the broken one's kind: these models
        at these shares and batches together, each at its rate here or a larger part of it (fewer replicas: a
        batch that breaks an SLO at a rate breaks it at any higher one). Where the InSS formula predicts, a model
        whose SLO or rate breaks (`late`) breaks it beside the others at their shares whatever their batches and
        parts of the rates, so each such model is cut off beside every one of those: one row in place of a row
        per batch of each co-runner."""
        broken = options[0].device
        for device in (d for d, kind in self.kinds.items() if kind == self.kinds[broken]):
            for culprit in late if self.batch_blind and late else [None]:
                xs = [self._variants(device, o, culprit is not None and o is not culprit) for o in options]
                if all(xs):  # each of them can be chosen there
                    self.h.addConstr(sum(x for chosen in xs for x in chosen) <= len(options) - 1)

    def _variants(self, device: str, o: Option, any_batch: bool) -> list[highspy.highs_var]:
        """The binaries of `o` on `device` at its part of the rate or a larger one; `any_batch`: at its share with
        any batch and part of the rate."""
        if any_batch:
            return self.at_share.get((device, o.model, o.share), [])
        found = [self.index.get((device, o.model, o.share, o.batch, k)) for k in range(1, o.replicas + 1)]
        return [x for x in found if x is not None]


def _broken_splits(
    options: list[Option], demands: list[Demand], devices: list[Device], lm: LatencyModel
) -> list[tuple[list[Option], list[Option]]]:
    """The options of every split device on which the full latency model breaks a constraint, each with those of
    them whose SLO or rate breaks (not memory, which the co-runners' batches move)."""
    by_name = {d.name: d for d in demands}
    by_id = {d.id: d for d in devices}
    out = []
    for device in devices:
        here = [o for o in options if o.device == device.id]
        parts = {o.model: part(by_name[o.model], o.replicas) for o in here}
        placement = {o.model: Choice(o.device, o.share) for o in here}
        batches = {o.model: o.batch for o in here}
        why = {o.model: broken_constraint(o.model, o.batch, placement, parts, batches, by_id, lm) for o in here}
        if any(why.values()):
            out.append((here, [o for o in here if why[o.model] in ("slo", "rate")]))
    return out


def solve(
    demands: list[Demand], devices: list[Device], lm: LatencyModel, time_limit_s: float = TIME_LIMIT_S
) -> Outcome:
    """The goodput-optimal layout within `time_limit_s` (the best found and its gap when the limit ends it).

    Every solution is checked against the full latency model and the splits it breaks are cut off before solving
    again. First with one replica a model (a small program, solved quickly), then with replicas, starting from that
    optimum: so where the limit ends the second, the best checked plan is at least the first's optimum, and the gap
    is against the second's bound (the sum of the rates if it never finished one solve). Each solve's optimum bounds
    every plan's goodput (cuts remove only broken splits), so the search also ends once the best checked plan is
    within GAP of it."""
    began = time.monotonic()
    deadline = began + time_limit_s
    program = _Program(demands, devices, lm)
    best: tuple[float, list[Option], list] | None = None  # the best checked solution: goodput, options, turns
    bound, status, cuts = sum(d.rate for d in demands), "Time limit reached", 0
    for replicas in (False, True) if program.several else (False,):
        full = replicas or not program.several  # the program is the whole space: its optima bound every plan
        program.allow_replicas(replicas)
        if best is not None:
            program.start_from_last()
        while time.monotonic() < deadline:
            status, value, found_bound = program.solve(deadline)
            if status == "Empty":  # no option holds even alone: nothing can be served
                status, value, found_bound = "Optimal", 0.0, 0.0
            elif status not in ("Optimal", "Time limit reached") or not math.isfinite(value):
                raise PolicyLimit(
                    f"the solver found no plan for {len(demands)} models on {len(devices)} devices within "
                    f"{time_limit_s:g} s ({status})"
                )
            if full:
                bound = min(bound, found_bound if status != "Optimal" else value)
            options, turns = program.chosen()
            broken = _broken_splits(options, demands, devices, lm)
            if not broken:
                if best is None or value > best[0] * (1 + TIE):  # replicas only where they serve more
                    best = (value, options, turns)
                break
            for here, late in broken:
                program.cut(here, late)
            cuts += len(broken)
            status = "Time limit reached"
            if best is not None and full and best[0] >= bound * (1 - GAP):
                status = f"within {100 * GAP:g}% of the bound"
                break
    if best is None:
        raise PolicyLimit(f"the solver ran out of its {time_limit_s:g} s checking CPU contention ({cuts} cuts)")
    value, options, turns = best
    choices = _plan(options, turns, demands, devices, lm)
    return Outcome(choices, value, max(value, bound), status, time.monotonic() - began, cuts)


def _plan(
    options: list[Option],
    turns: list[tuple[Device, tuple[Member, ...], Turns]],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
) -> dict[str, list[Choice]]:
    """The chosen layout as placements, per model its replicas: BDA's batches on each split device (the solver's
    where BDA finds none)."""
    by_name = {d.name: d for d in demands}
    out: dict[str, list[Choice]] = {}
    for device in devices:
        here = [o for o in options if o.device == device.id]
        if not here:
            continue
        split = [part(by_name[o.model], o.replicas) for o in here]
        placement = {o.model: Choice(o.device, o.share, o.batch) for o in here}
        decision = bda(placement, split, [device], lm)
        batches = decision.batches if decision.ok else {o.model: o.batch for o in here}
        for name, chosen in with_batches(placement, batches, split, lm).items():
            out.setdefault(name, []).extend(chosen)
    for device, members, outcome in turns:
        for name, chosen in turn_choices([(d, c) for d, c, _ in members], device, outcome, lm).items():
            out.setdefault(name, []).extend(chosen)
    return {d.name: out[d.name] for d in demands if d.name in out}


def optimal(
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel | None,
    log: Callable[[str], None] = print,
) -> dict[str, list[Choice]]:
    if lm is None:
        raise PlacementError("policy optimal needs a fitted latency model: pass --latency-model")
    outcome = solve(demands, devices, lm)
    log(outcome.summary())
    unserved = [d.name for d in demands if d.name not in outcome.choices]
    if unserved:
        raise outcome.leaving_out(unserved)
    return outcome.choices

"""The optimum over search's space of device layouts, by a mixed-integer program (HiGHS): the yardstick.

Each device is either split (every model on it at a share on the STEP grid, with a batch) or
taken in turns by a set of models with all of it (on a CPU with copies of a model), as in
`search`. The objective is goodput: requests per second within the SLO, as search judges a
plan. A model served on a split device counts its whole rate (its p99 by eq. 2 within the SLO
at its rate, BDA's constraint); a model taking turns counts what `turn_outcome` says it serves.

Split devices. A binary per option (model, device, share, batch). The InSS latency model is
linear in what the co-runners bring (`LatencyModel.t_inf`): t = io + run (1 + alpha_i u_i sum_j
l_j) + n_ops (a N + b) once N >= 2 models share the device (u_i the instance's duty on a CPU
where the model weighs by it, else 1), where a co-runner's cache
pressure l_j depends on its share alone and N counts the options chosen on the device. Each
option carries the longest batch time at which its batch still meets the SLO at the model's
rate (the p99 of eq. 2 grows with it), so the option holds iff the sum of its co-runners'
terms stays under what that leaves: a big-M row enforced when the option is chosen and the
device shared. The CPU contention term (threads beyond cores) is not linear: every solution
is checked against the full latency model, a split it breaks is cut off (no-good row), and
the program is solved again. Of an option's batches only those that no other batch of the
same share dominates (holds in every context it holds in, in no more memory) are kept; the
plan takes BDA's batches on the chosen placement (the largest that hold: the most throughput).

Devices taken in turns. Every set of models (with copies on a CPU, at most `max_copies`) is
evaluated once per kind of device with the code search judges with; a binary per (device, set).

Not in this space: a model split into replicas on several devices, and a model served in
part (late requests) on a split device; search may do both, so its goodput can exceed this
optimum where some model cannot be served whole by one device.
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
TIME_LIMIT_S = 300.0
MAX_OPTIONS = 200_000  # binaries the program may hold: beyond, the cluster is refused before solving
MAX_TURN_SETS = 20_000  # sets of models (with copies) taking turns, per kind of device


@dataclass(frozen=True)
class Option:
    """One model at one share and batch on one device, and what its batch time leaves for co-runners."""

    model: str
    device: str
    share: int
    batch: int
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

    def summary(self) -> str:
        proven = "optimal" if self.gap <= 1e-9 else f"best found, gap {100 * self.gap:.2f}% ({self.status})"
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


def split_options(demand: Demand, device: Device, lm: LatencyModel, pressure: float) -> list[Option]:
    """The options of a model on a split device that hold at least alone, dominated batches left out (`pressure`:
    the most its co-runners can put on it)."""
    p, d = lm.models[demand.name], lm.device
    out = []
    for share in range(max(STEP, math.ceil(p.share_range[0] / STEP) * STEP), device.units + 1, STEP):
        candidates = []
        for batch in range(1, MAX_BATCH + 1):
            memory = memory_at(demand, batch, lm)
            if memory > device.memory_mb:
                break
            alone = lm.t_inf(demand.name, batch, share) / (1 + lm.margin)
            slack = longest_batch_ms(demand, batch, alone * (1 + lm.margin)) / (1 + lm.margin) - alone
            if slack < 0:
                continue
            run = lm.run_ms(demand.name, batch, share)
            candidates.append(
                Option(
                    demand.name,
                    device.id,
                    share,
                    batch,
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


def turn_sets(demands: list[Demand], device: Device) -> list[tuple[tuple[Demand, int], ...]]:
    """Every non-empty set of models (each with 1..max_copies copies) that could take turns with `device`."""
    copies = range(max_copies(device) + 1)
    count = (len(copies) ** len(demands)) - 1
    if count > MAX_TURN_SETS:
        raise PolicyLimit(
            f"{count:,} sets of models could take turns with one device (more than {MAX_TURN_SETS:,}): the cluster "
            "is too large for the optimal policy"
        )
    out = []
    for counts in itertools.product(copies, repeat=len(demands)):
        members = tuple((d, c) for d, c in zip(demands, counts, strict=True) if c)
        if members and sum(d.memory_mb * c for d, c in members) <= device.memory_mb:
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
        options: list[Option] = []
        turns: list[tuple[Device, tuple[tuple[Demand, int], ...], Turns]] = []
        splits: dict[tuple, list[Option]] = {}  # identical devices: evaluated once
        evaluated: dict[tuple, list] = {}
        for device in devices:
            key = _kind(device)
            if key not in evaluated:
                sets = turn_sets(demands, device)  # refuses a cluster with too many before any work
                most = sum(max(lm.cache_pressure(d.name, s) for s in (1, device.units)) for d in demands)
                splits[key] = [o for d in demands for o in split_options(d, device, lm, most)]
                evaluated[key] = [(s, turn_outcome(list(s), device, lm)) for s in sets]
            options += [dataclasses.replace(o, device=device.id) for o in splits[key]]
            # a member served not at all is better left out of its set
            turns += [(device, m, out) for m, out in evaluated[key] if all(g > 0 for g in out.served.values())]
        if len(options) + len(turns) > MAX_OPTIONS:
            raise PolicyLimit(
                f"{len(options) + len(turns):,} choices of share, batch and turns (more than "
                f"{MAX_OPTIONS:,}): the cluster is too large for the optimal policy"
            )
        self.options: list[tuple[Option, highspy.highs_var]] = [(o, h.addBinary()) for o in options]
        self.turns = [(device, m, out, h.addBinary()) for device, m, out in turns]
        rate = {d.name: d.rate for d in demands}
        for d in demands:
            ones = [x for o, x in self.options if o.model == d.name]
            ones += [x for _, m, _, x in self.turns if any(md.name == d.name for md, _ in m)]
            if ones:
                h.addConstr(sum(ones) <= 1)
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
        objective = sum(rate[o.model] * x for o, x in self.options)
        objective += sum(sum(out.served.values()) * x for _, _, out, x in self.turns)
        self.objective = objective

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

    def cut(self, options: list[Option]) -> None:
        """Forbid this set of options together (a split the full latency model breaks)."""
        xs = [x for o, x in self.options if o in options]
        self.h.addConstr(sum(xs) <= len(xs) - 1)


def _broken_split(
    options: list[Option], demands: list[Demand], devices: list[Device], lm: LatencyModel
) -> list[Option]:
    """The options of the first split device on which the full latency model breaks an SLO or rate ([] if none)."""
    by_name = {d.name: d for d in demands}
    by_id = {d.id: d for d in devices}
    for device in devices:
        here = [o for o in options if o.device == device.id]
        placement = {o.model: Choice(o.device, o.share) for o in here}
        batches = {o.model: o.batch for o in here}
        if any(broken_constraint(o.model, o.batch, placement, by_name, batches, by_id, lm) for o in here):
            return here
    return []


def solve(
    demands: list[Demand], devices: list[Device], lm: LatencyModel, time_limit_s: float = TIME_LIMIT_S
) -> Outcome:
    """The goodput-optimal layout within `time_limit_s` (the best found and its gap when the limit ends it)."""
    began = time.monotonic()
    deadline = began + time_limit_s
    program = _Program(demands, devices, lm)
    cuts = 0
    while True:
        status, value, bound = program.solve(deadline)
        if status not in ("Optimal", "Time limit reached") or not math.isfinite(value):
            raise PolicyLimit(
                f"the solver found no plan for {len(demands)} models on {len(devices)} devices within "
                f"{time_limit_s:g} s ({status})"
            )
        options, turns = program.chosen()
        broken = _broken_split(options, demands, devices, lm)
        if not broken:
            break
        program.cut(broken)
        cuts += 1
        if time.monotonic() > deadline:
            raise PolicyLimit(f"the solver ran out of its {time_limit_s:g} s checking CPU contention ({cuts} cuts)")
    choices = _plan(options, turns, demands, devices, lm)
    bound = value if status == "Optimal" else max(value, bound)
    return Outcome(choices, value, bound, status, time.monotonic() - began, cuts)


def _plan(
    options: list[Option],
    turns: list[tuple[Device, tuple, Turns]],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
) -> dict[str, list[Choice]]:
    """The chosen layout as placements: BDA's batches on the split devices (the solver's where BDA finds none)."""
    split = [d for d in demands if any(o.model == d.name for o in options)]
    placement = {o.model: Choice(o.device, o.share, o.batch) for o in options}
    decision = bda(placement, split, devices, lm)
    batches = decision.batches if decision.ok else {o.model: o.batch for o in options}
    out = with_batches(placement, batches, split, lm)
    for device, members, outcome in turns:
        out.update(turn_choices(list(members), device, outcome, lm))
    return out


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
        raise PlacementError(f"the optimum leaves {', '.join(unserved)} unserved", shed=unserved)
    return outcome.choices

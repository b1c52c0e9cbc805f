"""The optimum over search's space of device layouts, by a mixed-integer program (HiGHS): the yardstick.

Each device is either split (every model on it at a share on the STEP grid, with a batch) or
taken in turns by a set of models with all of it (on a CPU with copies of a model), as in
`search`. A model may be split into replicas on up to MAX_REPLICAS devices, at most one a
device, each with an equal part of its rate (as search's replica phase splits it, and the proxy
balances equal weights): every option and turn set below exists once per replica count, its
model's demand at that part of the rate. The objective is goodput: requests per second within
the SLO, as search judges a plan: the plan the solver finds is judged with BDA's batches
(`search.Judge`) and with its own, and keeps whichever serve more.

Split devices. A binary per option (model, device, share, batch, credit). The InSS latency model is
linear in what the co-runners bring (`LatencyModel.t_inf`): t = io + run (1 + alpha_i u_i sum_j
l_j) + n_ops (a N + b) once N >= 2 models share the device (u_i the instance's duty on a CPU
where the model weighs by it, else 1), where a co-runner's cache
pressure l_j depends on its share alone and N counts the options chosen on the device. Each
option carries the longest batch time at which it earns its credit, so the option holds iff the
sum of its co-runners' terms stays under what that leaves: a big-M row enforced when the option
is chosen and the device shared. A model served whole (its p99 by eq. 2 within the SLO at its
rate, BDA's constraint) is credited its rate. A model served in part (search keeps the batch
serving most requests within the SLO, `queueing.goodput`) has an option per interval of batch
times (`part_levels`), credited at least what any batch time in it serves (goodput falls as the
batch time grows), in steps of PART_STEP of its rate rounded up. So the program's optimum bounds
every plan's goodput, and the plan it finds is judged for what it serves; the gap says how far
apart the two are, within about two steps of the rates of the models served in part. The CPU
contention term (threads beyond cores) is not linear: every solution is checked against the
full latency model, an
option whose batch time there breaks its limit is cut off beside its co-runners (a no-good row,
on every device of its kind, with every option of its model, share and batch whose limit is
shorter, and its co-runners at any batch where the InSS formula predicts: their batches do not
move its time), and the program is solved again, until a solution holds or the best that held is
within GAP of the bound (`solve`). The solver starts from search's plan (`search.climb`, 0-2 s on
the shipped examples), as a MIP starts from a heuristic's solution: the plan returned serves at
least as much, and is search's where the solver finds none that serves more.
Of an option's batches and credits only those that no other of the same share dominates (credits
as much and holds in every context it holds in, in no more memory where memory can bind) are
kept, options served whole and in part apart (the program takes those in part last).

Devices taken in turns. Every set of models (with copies on a CPU, at most `max_copies`; each
member at one of its replica counts) is evaluated once per kind of device with the code search
judges with; a binary per (device, set). Where the sets would outnumber MAX_TURN_SETS, models
taking turns have fewer replica counts (`turn_replicas`; eight models on a GPU: up to two).

A binary per (model, replica count) says how many replicas the model has; exactly that many of
its options and memberships are chosen, on as many devices.

Not in this space: more than MAX_REPLICAS replicas of a model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import highspy
import numpy as np
from highspy import qsum

from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.latency.queueing import goodput, task_latency
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError, PolicyLimit
from tritonctl.planning.policies.bda import corunners, memory_at, with_batches
from tritonctl.planning.policies.search import TURNS, Judge, Placement, Spot, climb, max_copies, replica_key
from tritonctl.planning.policies.timesharing import Turns, turn_choices, turn_outcome

STEP = 5  # share grid, in device units (search's)
MAX_REPLICAS = 8  # devices a model's rate may be split across (every device of the shipped examples)
TIME_LIMIT_S = 300.0
TIE = 1e-7  # goodputs this close (relative) are one: the solver's rounding
GAP = 0.005  # where a solve is cut short (CPU contention, the time): done once the best judged is this close
SLICE_S = 30.0  # the last stage's first solve, after which its bound may show the best plan within GAP already
MAX_OPTIONS = 500_000  # binaries the program may hold: beyond, the cluster is refused before solving
MAX_TURN_SETS = 20_000  # sets of models (with copies) taking turns, per kind of device
PART_STEP = 0.05  # a model served in part is credited in steps of this part of its rate
T_STEP = 1.005  # the batch times at which that fall is looked for, each this much longer than the last


@dataclass(frozen=True)
class Option:
    """One model at one share and batch on one device, and what its batch time leaves for co-runners."""

    model: str
    device: str
    share: int
    batch: int
    replicas: int  # the model's replicas: this one serves that part of its rate
    whole: bool  # served whole (its p99 within the SLO at its part of the rate), or in part
    served: float  # requests/s it is credited: its part of the rate served whole, or the goodput it serves in part
    limit_ms: float  # the longest batch time (the model's margin in) at which it earns that
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
    searched: bool  # the plan is search's: the solver found none that serves more

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
        searched = ", search's plan" if self.searched else ""
        return (
            f"optimal policy: goodput {self.goodput:.2f} requests/s, bound {self.bound:.2f}: {proven}{searched} "
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


def part_levels(demand: Demand, batch: int, start: float) -> list[tuple[float, float]]:
    """(limit, credit) of `demand` served in part at `batch` with a batch time (ms) above `start`: intervals of batch
    times up to the SLO, each credited at least the goodput of every batch time in it, a multiple of PART_STEP of
    the rate but the first (the goodput at `start`). Goodput falls as the batch time grows, so an interval ends at
    the first time (on a T_STEP grid) whose goodput is below its credit's step down, and the next is credited the
    step at or above that goodput. On a common grid, the options of several batches compare."""
    rate, slo, step = demand.rate, demand.slo_ms, PART_STEP * demand.rate
    out: list[tuple[float, float]] = []
    t, credit = start, goodput(rate, batch, start, slo)
    steps = math.ceil(credit / step - 1e-9)  # the credit's step (at or above it)
    while credit > 0 and t < slo:
        g = credit
        while g >= (steps - 1) * step and t < slo:
            t = min(t * T_STEP, slo)
            g = goodput(rate, batch, t, slo)
        out.append((t, credit))
        steps = math.ceil(g / step - 1e-9)
        credit = steps * step
    return out


def most_pressure(model: str, demands: list[Demand], device: Device, lm: LatencyModel) -> Callable[[int], float]:
    """The most cache pressure `model`'s co-runners can put on it beside it at a share: the shares they take fill
    at most the rest of the device (a knapsack over the STEP grid, each other model at one share or none)."""
    room = device.units // STEP
    most = [0.0] * (room + 1)  # the most pressure in c grid steps of share
    for d in demands:
        if d.name == model:
            continue
        first = max(1, math.ceil(lm.models[d.name].share_range[0] / STEP))
        pressures = {k: lm.cache_pressure(d.name, k * STEP) for k in range(first, room + 1)}
        most = [max([most[c]] + [most[c - k] + g for k, g in pressures.items() if k <= c]) for c in range(room + 1)]
    return lambda share: most[(device.units - share) // STEP]


def split_options(
    model: Demand,
    device: Device,
    lm: LatencyModel,
    pressure: Callable[[int], float],
    replicas: int,
    memory_binds: bool = True,
) -> list[Option]:
    """The options of one of a model's `replicas` replicas on a split device that hold at least alone, served whole
    and in part, dominated ones left out (`pressure`: the most its co-runners can put on it beside it at a share;
    `memory_binds`: whether the device's memory can bind, or more memory counts for nothing)."""
    demand = part(model, replicas)
    p, d, margin = lm.models[demand.name], lm.device, lm.margin_of(demand.name)
    shares = range(max(STEP, math.ceil(p.share_range[0] / STEP) * STEP), device.units + 1, STEP)
    fastest = {b: min(lm.t_inf(demand.name, b, s) for s in shares) for b in range(1, MAX_BATCH + 1)}
    # served in part beyond the longest batch time that serves it whole (the same at every share)
    levels = {b: part_levels(demand, b, max(t, longest_batch_ms(demand, b, t))) for b, t in fastest.items()}
    out = []
    for share in shares:
        candidates = []
        for batch in range(1, MAX_BATCH + 1):
            memory = memory_at(demand, batch, lm)
            if memory > device.memory_mb:
                break
            alone = lm.t_inf(demand.name, batch, share) / (1 + margin)
            longest = longest_batch_ms(demand, batch, alone * (1 + margin))
            credits = [(True, longest, demand.rate)] + [(False, t, g) for t, g in levels[batch] if t > longest]
            run = lm.run_ms(demand.name, batch, share)
            candidates += [
                Option(
                    demand.name,
                    device.id,
                    share,
                    batch,
                    replicas,
                    whole,
                    served,
                    limit,
                    memory,
                    lm.cache_pressure(demand.name, share),
                    run * p.alpha_cache * (lm.duty(share) if d.pressure_by_duty else 1.0),
                    p.n_ops * d.sched_a,
                    p.n_ops * d.sched_b,
                    limit / (1 + margin) - alone,
                )
                for whole, limit, served in credits
                if limit >= alone * (1 + margin)
            ]
        for whole in (True, False):  # each kind apart: the program takes models served in part last
            out += _undominated([o for o in candidates if o.whole == whole], pressure(share), memory_binds)
    return out


def _undominated(options: list[Option], pressure: float, memory_binds: bool) -> list[Option]:
    """Options of one share no other dominates: another credits as much and holds wherever this one does (its
    slack less its terms, linear in the co-runners' pressure, is at least this one's at none and at the most there
    can be), in no more memory where memory can bind; of two that dominate each other, the larger batch stays."""
    if len(options) < 2:
        return options
    served, memory, corunner, batch = (
        np.array([getattr(o, f) for o in options]) for f in ("served", "memory_mb", "per_corunner", "batch")
    )
    rooms = [np.array([o.slack_ms - o.shared_ms - o.per_pressure * x for o in options]) for x in (0.0, pressure)]
    at_least = served[:, None] >= served[None, :]  # [a, b]: a as good as b
    if memory_binds:
        at_least &= memory[:, None] <= memory[None, :]
    at_least &= corunner[:, None] <= corunner[None, :]
    for room in rooms:
        at_least &= room[:, None] >= room[None, :]
    np.fill_diagonal(at_least, False)
    beats = at_least & (~at_least.T | (batch[:, None] > batch[None, :]))
    return [o for o, beaten in zip(options, beats.any(axis=0), strict=True) if not beaten]


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
    # This heuristic solves sub-MIPs that solve their own; the presolve of a nested one (strengthenInequalities) does
    # not watch the time limit, and ran minutes past it on the H100 six models at 3x their rates.
    h.setOptionValue("mip_heuristic_run_root_reduced_cost", False)
    return h


def _largest_batch(demand: Demand, device: Device, lm: LatencyModel) -> int:
    """The largest batch of `demand` any option has: one that runs within its SLO alone on the whole device."""
    return max(
        (b for b in range(1, MAX_BATCH + 1) if lm.t_inf(demand.name, b, device.units) < demand.slo_ms), default=1
    )


def _kind(device: Device) -> tuple:
    return (device.kind, device.units, device.cores, device.memory_mb)


class _Program:
    """The mixed-integer program over the options and turn sets, solved (again after each cut) by HiGHS."""

    def __init__(
        self, demands: list[Demand], devices: list[Device], lm: LatencyModel, max_replicas: int = MAX_REPLICAS
    ):
        self.demands = demands
        self.h = h = _quiet_highs()
        replicas = min(len(devices), max_replicas)
        options: list[Option] = []
        turns: list[tuple[Device, tuple[Member, ...], Turns]] = []
        splits: dict[tuple, list[Option]] = {}  # identical devices: evaluated once
        evaluated: dict[tuple, list] = {}
        for device in devices:
            key = _kind(device)
            if key not in evaluated:
                # refuses a cluster with too many sets before any work
                sets = turn_sets(demands, device, turn_replicas(len(demands), device, replicas))
                binds = sum(memory_at(d, _largest_batch(d, device, lm), lm) for d in demands) > device.memory_mb
                splits[key] = []
                for d in demands:
                    most = most_pressure(d.name, demands, device, lm)  # the same for every replica count
                    for k in range(1, replicas + 1):
                        splits[key] += split_options(d, device, lm, most, k, binds)
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
        self.in_part = [x for o, x in self.options if not o.whole]
        self.at_batch: dict[tuple[str, str, int, int], list[tuple[Option, highspy.highs_var]]] = {}
        self.at_share: dict[tuple[str, str, int], list[highspy.highs_var]] = {}  # every batch, credit and replicas
        for o, x in self.options:
            self.at_batch.setdefault((o.device, o.model, o.share, o.batch), []).append((o, x))
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
            count = qsum(x for _, x in here)  # models split on the device
            taken = qsum(turns_here)  # 1 when a set takes turns with it
            measure = count + len(demands) * taken
            if turns_here:
                h.addConstr(taken <= 1)
                h.addConstr(measure <= len(demands))  # taken in turns: nothing split on it
            if previous is not None and previous[0] == _kind(device):
                h.addConstr(measure <= previous[1])
            previous = (_kind(device), measure)
            if here:
                self._split_rows(device, here, count)
        self.objective = qsum(
            [*(o.served * x for o, x in self.options), *(sum(out.served.values()) * x for _, _, out, x in self.turns)]
        )

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
                h.addConstr(qsum(counts.values()) <= 1)
            for k, y in counts.items():
                h.addConstr(qsum(by_count[d.name, k]) - k * y == 0)
            self.several += [y for k, y in counts.items() if k > 1]
            for device in devices:
                if len(by_device.get((d.name, device.id), ())) > 1:
                    h.addConstr(qsum(by_device[d.name, device.id]) <= 1)

    def _split_rows(self, device: Device, here: list, count) -> None:
        """Shares and memory within the device; each chosen option's batch time within its SLO's slack."""
        h, n = self.h, len(self.demands)
        h.addConstr(qsum(o.share * x for o, x in here) <= device.units)
        h.addConstr(qsum(o.memory_mb * x for o, x in here) <= device.memory_mb)
        shared = h.addBinary()
        h.addConstr(count - 1 <= (n - 1) * shared)
        top = sum(max((o.pressure for o, _ in here if o.model == d.name), default=0.0) for d in self.demands)
        pressure = h.addVariable(lb=0.0, ub=top)  # sum of the chosen options' cache pressure
        corunners = h.addVariable(lb=0.0, ub=n)  # how many are chosen
        h.addConstr(pressure - qsum(o.pressure * x for o, x in here) == 0)
        h.addConstr(corunners - count == 0)
        for o, x in here:
            # chosen and shared: per_pressure x (P - its own) + per_corunner x N + shared_ms <= slack
            need = o.per_pressure * (pressure - o.pressure * x) + o.per_corunner * corunners + o.shared_ms
            big = o.per_pressure * top + o.per_corunner * n + o.shared_ms - o.slack_ms
            if big > 0:
                h.addConstr(need - o.slack_ms <= big * (2 - x - shared))

    def allow(self, replicas: bool, in_part: bool) -> None:
        """Let models take several replicas, and be served in part on split devices, or not (the variables stay:
        cuts carry over)."""
        for xs, allowed in ((self.several, replicas), (self.in_part, in_part)):
            for x in xs:
                self.h.changeColBounds(x.index, 0.0, 1.0 if allowed else 0.0)

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
        value = self.h.getSolution().col_value  # read once: each `val` call copies the whole solution
        options = [o for o, x in self.options if value[x.index] > 0.5]
        turns = [(dev, m, out) for dev, m, out, x in self.turns if value[x.index] > 0.5]
        return options, turns

    def cut(self, options: list[Option], late: list[tuple[Option, float]]) -> None:
        """Forbid, on every device of the broken one's kind, each option of `late` (with the batch time the full
        latency model gives it there) beside the others: its model at its share and batch with any credit whose limit
        that time breaks, and any replica count (a batch time does not depend on the rate), beside the others at their
        shares and batches, or at any batch where the InSS formula predicts (it reads their shares alone). More
        co-runners only lengthen the time, so the row holds with any others beside them."""
        broken = options[0].device
        for device in (d for d, kind in self.kinds.items() if kind == self.kinds[broken]):
            for culprit, ms in late:
                xs = [
                    [
                        x
                        for o, x in self.at_batch.get((device, culprit.model, culprit.share, culprit.batch), ())
                        if o.limit_ms < ms
                    ],
                    *(self._beside(device, o) for o in options if o is not culprit),
                ]
                if all(xs):  # each of them can be chosen there
                    self.h.addConstr(qsum(x for chosen in xs for x in chosen) <= len(options) - 1)

    def _beside(self, device: str, o: Option) -> list[highspy.highs_var]:
        """The binaries of co-runner `o` on `device` that lengthen a batch time as it does: at its share and batch, or
        at its share with any batch where the co-runners' batches are not read."""
        if self.batch_blind:
            return self.at_share.get((device, o.model, o.share), [])
        return [x for _, x in self.at_batch.get((device, o.model, o.share, o.batch), ())]


def _late(options: list[Option], devices: list[Device], lm: LatencyModel) -> list[tuple[list[Option], list]]:
    """The options of every split device on which the full latency model breaks a limit, each with the options whose
    batch time breaks theirs and that time."""
    out = []
    for device in devices:
        here = [o for o in options if o.device == device.id]
        placement = {o.model: Choice(o.device, o.share) for o in here}
        batches = {o.model: o.batch for o in here}
        times = [(o, lm.t_inf(o.model, o.batch, o.share, corunners(o.model, placement, batches))) for o in here]
        late = [(o, ms) for o, ms in times if ms > o.limit_ms * (1 + 1e-9)]
        if late:
            out.append((here, late))
    return out


def solve(
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
    time_limit_s: float = TIME_LIMIT_S,
    from_search: bool = True,
    max_replicas: int = MAX_REPLICAS,
) -> Outcome:
    """The goodput-optimal layout within `time_limit_s` (the best found and its gap when the limit ends it).

    Every solution is checked against the full latency model and the options it breaks are cut off before solving
    again; one that holds is judged as search judges it. In stages, each starting from the last one's optimum: one
    replica a model, served whole (a small program, solved quickly); then with replicas; then with models served
    in part. A stage is solved only while the best judged plan serves less than every model's rate. So where the
    limit ends a stage, the best plan is at least the one before's optimum, and the gap is against the last stage's
    bound (the sum of the rates if it never finished one solve). Each solve's optimum, and the last stage's bound
    where a solve is cut short, bounds every plan's goodput (cuts remove only broken options), so the search also
    ends once the best judged plan is within GAP of it: the last stage first solves for SLICE_S, then on. The best
    plan starts as search's (unless not `from_search`), so where it serves every rate no program is built."""
    began = time.monotonic()
    deadline = began + time_limit_s
    offered = sum(d.rate for d in demands)
    best: tuple[float, dict[str, list[Choice]]] | None = None  # the best judged plan: goodput, plan
    if from_search:
        placement, judge = climb(demands, devices, lm)
        served = judge(placement).served
        if sum(served.values()) > 0:
            best = (sum(served.values()), {n: c for n, c in judge.choices(placement).items() if served[n] > 0})
    else:
        judge = Judge(demands, devices, lm)
    searched = best
    if best is not None and best[0] >= offered * (1 - TIE):  # search's plan serves every rate: nothing to gain
        return Outcome(best[1], best[0], best[0], "Optimal", time.monotonic() - began, 0, True)
    program = _Program(demands, devices, lm, max_replicas)
    bound, status, cuts = offered, "Time limit reached", 0
    stages = [(False, False), (True, False), (True, True)]
    stages = [s for k, s in enumerate(stages) if k == 0 or (s[0] and program.several) or (s[1] and program.in_part)]
    for k, (replicas, in_part) in enumerate(stages):
        if best is not None and best[0] >= offered * (1 - TIE):  # every model served whole: nothing to gain
            status, bound = "Optimal", best[0]
            break
        if status.startswith("within"):  # the stage before ended within GAP of the bound
            break
        full = k == len(stages) - 1  # the program is the whole space: its optima bound every plan
        program.allow(replicas, in_part)
        if k > 0:
            program.start_from_last()
        sliced = not full  # the last stage solves for SLICE_S first: its bound may already show the best close
        while time.monotonic() < deadline:
            until = deadline if sliced else min(deadline, time.monotonic() + SLICE_S)
            sliced = True
            status, value, found_bound = program.solve(until)
            if status == "Empty":  # no option holds even alone: nothing can be served
                status, value, found_bound = "Optimal", 0.0, 0.0
            elif status not in ("Optimal", "Time limit reached"):
                raise PolicyLimit(
                    f"the solver found no plan for {len(demands)} models on {len(devices)} devices within "
                    f"{time_limit_s:g} s ({status})"
                )
            if full:
                bound = min(bound, found_bound if status == "Time limit reached" else value)
            if math.isfinite(value):  # a solution to check (a time limit may leave none)
                options, turns = program.chosen()
                broken = _late(options, devices, lm)
                if not broken:
                    served, choices = _judged(options, turns, demands, devices, lm, judge)
                    if best is None or served > best[0] * (1 + TIE):  # replicas only where they serve more
                        best = (served, choices)
                    if status == "Optimal":
                        if served < value * (1 - TIE):  # credited for more than it serves: the gap says how much
                            status = "credits of models served in part"
                        break
                for here, late in broken:
                    program.cut(here, late)
                cuts += len(broken)
            status = "Time limit reached"
            if best is not None and best[0] >= bound * (1 - GAP):  # the bound: the rates, or the last stage's
                status = f"within {100 * GAP:g}% of the bound"
                break
    if best is None:
        raise PolicyLimit(f"the solver ran out of its {time_limit_s:g} s checking CPU contention ({cuts} cuts)")
    value, choices = best
    return Outcome(choices, value, max(value, bound), status, time.monotonic() - began, cuts, best is searched)


def _judged(
    options: list[Option],
    turns: list[tuple[Device, tuple[Member, ...], Turns]],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
    judge: Judge,
) -> tuple[float, dict[str, list[Choice]]]:
    """A solution's goodput and plan, each model's replicas together, judged as search judges a plan: with BDA's
    batches (search's judge) or the solver's, whichever serves more (BDA sizes a device's models one after another,
    and where the co-runners' batches move a batch time, the solver's may serve more). Models it serves nothing of
    are left out."""
    placement: Placement = {}
    count: Counter[str] = Counter()
    spots = [(o.model, Spot(o.device, o.share)) for o in options]
    spots += [(d.name, Spot(device.id, TURNS, copies)) for device, members, _ in turns for d, copies, _ in members]
    for name, spot in spots:
        placement[replica_key(name, count[name])] = spot
        count[name] += 1
    bda_served, bda_plan = judge(placement).served, judge.choices(placement)
    own_served, own_plan = _solvers(options, turns, demands, devices, lm)
    served, plan = (
        (bda_served, bda_plan) if sum(bda_served.values()) >= sum(own_served.values()) else (own_served, own_plan)
    )
    return sum(served.values()), {name: chosen for name, chosen in plan.items() if served[name] > 0}


def _solvers(
    options: list[Option],
    turns: list[tuple[Device, tuple[Member, ...], Turns]],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
) -> tuple[dict[str, float], dict[str, list[Choice]]]:
    """Goodput per model and the plan with the solver's batches: a model within its SLO counts its part of the
    rate, one served in part what its batch serves (`queueing.goodput`); in turns, what the duty cycle serves."""
    by_name = {d.name: d for d in demands}
    served = {d.name: 0.0 for d in demands}
    plan: dict[str, list[Choice]] = {}
    for device in devices:
        here = [o for o in options if o.device == device.id]
        placement = {o.model: Choice(o.device, o.share) for o in here}
        batches = {o.model: o.batch for o in here}
        for o in here:
            piece = part(by_name[o.model], o.replicas)
            t = lm.t_inf(o.model, o.batch, o.share, corunners(o.model, placement, batches))
            whole = task_latency(piece.rate, o.batch, t)
            holds = whole.stable and whole.p99_ms <= piece.slo_ms
            served[o.model] += piece.rate if holds else goodput(piece.rate, o.batch, t, piece.slo_ms)
        split = [part(by_name[o.model], o.replicas) for o in here]
        for name, chosen in with_batches(placement, batches, split, lm).items():
            plan.setdefault(name, []).extend(chosen)
    for device, members, outcome in turns:
        for d, _, _ in members:
            served[d.name] += outcome.served[d.name]
        for name, chosen in turn_choices([(d, c) for d, c, _ in members], device, outcome, lm).items():
            plan.setdefault(name, []).extend(chosen)
    return served, plan


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

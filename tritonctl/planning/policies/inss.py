"""The InSS two-layer scheduler TS (section 5): a trained actor for placement and shares, BDA for batch sizes;
and the pieces of its MDP (section 5.2) that training (`rl/`) shares with it.

Online (section 5.5, Workflow): BDA runs first on the current placement (spread's, the one a fresh deployment
starts from); only when BDA reports failure does the actor choose placement and shares, and batches are
decided on its choice: BDA's on devices it splits, the duty cycle's on devices whose models take turns (as
`search` decides them, `search.Judge`). The actor proposes up to PROPOSALS placements, its greedy one and
draws from its policy (no more once one serves every request within its SLO even with every model HEADROOM
slower): a factorised actor chooses each model's device and share on its own, and a draw often mends what the
greedy choices of two models get wrong together. Each is judged device by device and given up once it cannot
come within LEVEL of the offered load of the best so far, the current placement at first
(`search.Judge.beats`). The actor's placement is deployed unless the current one is predicted to serve more
than every proposal. Of the proposals predicted within LEVEL of the best and to serve as much as the current
one, the one that serves most within the SLOs with every model HEADROOM slower is deployed (then the predicted
score, then the order): two placements predicted alike can differ widely in what a latency model that is off
costs them. Where the one kept leaves some model unserved, search's placement is deployed instead (the
fallback). The actor places one replica a model: where its placement is deployed and serves every model but
some short of its rate, search's replica moves add (or give up) replicas on other devices, every model staying
where the actor put it (`search.grow_replicas`). The plan's notes say which was deployed and why.

The action space is search's: per model a device and either a share level or taking turns with the
device's other models with all of it (on a CPU with one instance or more). A trained actor is therefore
compared with `search` decision for decision, and can learn from it (`rl/imitate.py`).

Two additions to the paper, for robustness to a latency model that is off: level placements are ranked by
what they serve with every model HEADROOM (10%) slower (above; a CPU taken in turns by an instance that then
keeps up at no batch is counted for what it serves in part, where planning counts it as serving nothing), and
the deployed batches are those chosen for the model running HEADROOM slower, where they serve as much;
otherwise the prediction's own.

The MDP, for N models and K devices:

- state: per device the memory the previous decision uses (footprints at its batches, over the device's
  memory); per model the arrival rate (over the `rate_scale` fixed at training) and the queued work under
  the previous decision: Little's law gives rate x mean latency tasks in the queue, counted in units of the
  tasks that arrive within one SLO, i.e. mean latency / SLO, 1 where the queue grows without bound or the
  model is not deployed. All in [0, 1].
- action: per model a device head (K) and a placement head of `levels` share levels (level l is (l + 1) /
  levels of the device's units) then `copies` ways of taking turns (with 1 ... copies instances). A device
  most of whose models ask for turns is taken in turns by all of them; otherwise it is split, in proportion
  to the levels asked for where they add up to more than its units. Masked: devices the model does not fit
  on alone, levels below its profiled share.
- reward, eq. 3: r = (1 / N) sum_i (h_i / H_i - omega v_i), with H_i model i's throughput alone on a whole
  device at batch 1 and omega = 100 (section 6.1); h_i is what model i serves within its SLO (requests/s,
  `search.Judge`: its whole rate where BDA finds it a batch, else what its best batch serves in time, 0 where
  it does not fit in memory) and v_i = 1 - h_i / rate_i the share of its traffic it misses. Dividing by N
  puts clusters of different sizes on one scale ("normalisation of the reward", section 5.4).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from tritonctl.errors import TritonctlError
from tritonctl.files import file_identity
from tritonctl.latency.model import LatencyModel
from tritonctl.latency.queueing import task_latency
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError
from tritonctl.planning.policies.bda import BatchDecision, bda, corunners, memory_at
from tritonctl.planning.policies.search import (
    TURNS,
    Judge,
    Judged,
    Placement,
    Spot,
    climb,
    grow_replicas,
    max_copies,
    model_of,
    normal,
)
from tritonctl.planning.policies.spread import spread

SHARE_LEVELS = 20  # search's 5-unit grid on a device of 100 units
PENALTY = 100.0  # omega of eq. 3 (InSS section 6.1)
RATE_HEADROOM = 1.5  # rates observe as rate / (RATE_HEADROOM x the cluster's rate at training)
# Placements the actor proposes at a decision (its greedy one and draws from its policy); the one predicted to
# serve most within the SLOs is deployed
PROPOSALS = 16
# Batches are chosen to meet their SLOs with the model this much slower than predicted, where they serve as
# much; placements are judged on the prediction itself, and those level (LEVEL) ranked with the model this much slower.
HEADROOM = 0.1
# Placements predicted to serve within this part of the offered load of the best are level: of those, the one that
# serves most with every model HEADROOM slower is deployed
LEVEL = 0.005
FORMAT = "tritonctl-inss-policy/2"


@dataclass(frozen=True)
class Slot:
    """A device as the policy knows it: `copies`, how many instances of one model may take turns with it."""

    id: str
    units: int
    memory_mb: int
    copies: int

    @classmethod
    def of(cls, device: Device) -> Slot:
        return cls(device.id, device.units, device.memory_mb, max_copies(device))

    def same_kind(self, other: Slot) -> bool:
        return (self.units, self.memory_mb, self.copies) == (other.units, other.memory_mb, other.copies)


@dataclass(frozen=True)
class Layout:
    """What a policy is trained for and how its observations and actions are laid out (saved with it)."""

    cluster: str
    models: tuple[str, ...]
    devices: tuple[Slot, ...]
    levels: int
    rate_scale: tuple[float, ...]  # per model, the rate that observes as 1

    @classmethod
    def of(cls, cluster: str, demands: list[Demand], devices: list[Device], levels: int = SHARE_LEVELS) -> Layout:
        return cls(
            cluster,
            tuple(d.name for d in demands),
            tuple(Slot.of(d) for d in devices),
            levels,
            tuple(RATE_HEADROOM * d.rate for d in demands),
        )

    @property
    def copies(self) -> int:
        """Ways of taking turns a placement head offers: with 1 ... copies instances."""
        return max(s.copies for s in self.devices)

    @property
    def heads(self) -> list[int]:
        return [len(self.devices), self.levels + self.copies] * len(self.models)

    @property
    def obs_dim(self) -> int:
        return len(self.devices) + 2 * len(self.models)

    def metadata(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], path: Path) -> Layout:
        if meta.get("format") != FORMAT:
            raise TritonctlError(f"not a trained inss policy ({FORMAT}): train one with `tritonctl train`", file=path)
        return cls(
            meta["cluster"],
            tuple(meta["models"]),
            tuple(Slot(**d) for d in meta["devices"]),
            meta["levels"],
            tuple(meta["rate_scale"]),
        )

    def mismatch(self, models: list[str], devices: list[Device]) -> str | None:
        """How a cluster with these models and devices differs from the one trained for, or None. A device's units
        and cores may be fewer than at training (the CPU the planner reserves for requests varies with the rates):
        the actor's levels are parts of whatever a device has."""
        if tuple(models) != self.models:
            return f"it was trained for models {list(self.models)}, the cluster has {models}"
        if tuple((d.id, d.memory_mb) for d in devices) != tuple((s.id, s.memory_mb) for s in self.devices):
            here = tuple(map(Slot.of, devices))
            return f"it was trained for devices {_show(self.devices)}, the cluster has {_show(here)}"
        return None


def _show(slots: tuple[Slot, ...]) -> str:
    """The devices as `mismatch` compares them: by id and memory (their units may be fewer than at training)."""
    return ", ".join(f"{s.id} ({s.memory_mb} MB)" for s in slots)


def action_mask(layout: Layout, demands: list[Demand], lm: LatencyModel) -> np.ndarray:
    """Allowed choices, the heads' masks concatenated: per model the devices it fits on alone, the share levels
    at or above its profiled share (at least the top level) and every way of taking turns. Models absent from
    `demands` may take any."""
    by_name = {d.name: d for d in demands}
    parts = []
    for name in layout.models:
        demand = by_name.get(name)
        fits = [demand is None or demand.memory_mb <= s.memory_mb for s in layout.devices]
        floor = lm.models[name].share_range[0] / lm.device.units if demand else 0.0
        levels = [(k + 1) / layout.levels >= floor - 1e-9 for k in range(layout.levels)]
        levels[-1] = True
        parts += [fits if any(fits) else [True] * len(fits), levels + [True] * layout.copies]
    return np.concatenate([np.array(p, bool) for p in parts])


def decode(action, layout: Layout, demands: list[Demand], devices: list[Device]) -> Placement:
    """The placement an action stands for on `devices` (those of `layout`, with the units they have now), for the
    models in `demands` (see the module docstring)."""
    present = {d.name for d in demands}
    asked = {  # model -> (device index, placement head)
        name: (int(action[2 * i]), int(action[2 * i + 1])) for i, name in enumerate(layout.models) if name in present
    }
    placement: Placement = {}
    for k, slot in enumerate(map(Slot.of, devices)):
        here = {n: head for n, (dev, head) in asked.items() if dev == k}
        if 2 * sum(head >= layout.levels for head in here.values()) >= len(here):
            copies = {
                n: min(slot.copies, head - layout.levels + 1) if head >= layout.levels else 1
                for n, head in here.items()
            }
            placement.update({n: Spot(slot.id, TURNS, c) for n, c in copies.items()})
            continue
        units = {
            n: math.ceil(slot.units * (min(head, layout.levels - 1) + 1) / layout.levels) for n, head in here.items()
        }
        total = sum(units.values())
        if total > slot.units:
            units = {n: max(1, u * slot.units // total) for n, u in units.items()}
        placement.update({n: Spot(slot.id, u) for n, u in units.items()})
    return normal({d.name: placement[d.name] for d in demands}, devices)


def encode(placement: Placement, layout: Layout) -> np.ndarray:
    """The action that stands for `placement`, identical devices renumbered in the order of the first model each
    holds (so that equal placements get one action); -1 in the heads of models it leaves out."""
    slots = {s.id: k for k, s in enumerate(layout.devices)}
    renumbered: dict[str, int] = {}
    free = list(range(len(layout.devices)))
    for name in layout.models:  # the first model on a device takes the first free device of its kind
        if name in placement and placement[name].device not in renumbered:
            own = layout.devices[slots[placement[name].device]]
            k = next(k for k in free if layout.devices[k].same_kind(own))
            renumbered[placement[name].device] = k
            free.remove(k)
    action = np.full(2 * len(layout.models), -1, np.int64)
    for i, name in enumerate(layout.models):
        if name in placement:
            spot = placement[name]
            k = renumbered[spot.device]
            if spot.share == TURNS:
                head = layout.levels + spot.copies - 1
            else:
                head = min(layout.levels, max(1, round(spot.share * layout.levels / layout.devices[k].units))) - 1
            action[2 * i : 2 * i + 2] = k, head
    return action


def queued_work(demand: Demand, choice: Choice, batch: int, others, lm: LatencyModel) -> float:
    """Tasks queued under a decision in units of one SLO's arrivals: mean latency / SLO (Little's law), capped at 1."""
    if demand.rate <= 0:
        return 0.0
    task = task_latency(demand.rate, batch, lm.t_inf(demand.name, batch, choice.share, others))
    return min(1.0, task.mean_ms / demand.slo_ms) if task.stable else 1.0


def observe(
    layout: Layout,
    placement: dict[str, Choice],
    batches: dict[str, int],
    demands: list[Demand],
    lm: LatencyModel,
    undeployed: set[str] = frozenset(),
) -> np.ndarray:
    """The state s_t = {u_k, (lambda_i, G_i)} after a split decision (`placement` with `batches`); `undeployed`
    models (memory) count as fully queued. Models absent from `demands` observe as idle."""
    by_name = {d.name: d for d in demands}
    memory = dict.fromkeys((s.id for s in layout.devices), 0.0)
    for name, choice in placement.items():
        memory[choice.device] += memory_at(by_name[name], batches[name], lm)
    used = [min(1.0, memory[s.id] / s.memory_mb) for s in layout.devices]
    rates, queues = [], []
    for name, scale in zip(layout.models, layout.rate_scale, strict=True):
        demand = by_name.get(name)
        rates.append(0.0 if demand is None else min(1.0, demand.rate / scale))
        if demand is None:
            queues.append(0.0)
        elif name in undeployed:
            queues.append(1.0)
        else:
            others = corunners(name, placement, batches)
            queues.append(queued_work(demand, placement[name], batches[name], others, lm))
    return np.array(used + rates + queues, np.float32)


def peak_rps(demands: list[Demand], devices: list[Device], lm: LatencyModel) -> dict[str, float]:
    """H_i: throughput alone on a whole device at batch 1."""
    units = max(d.units for d in devices)
    return {d.name: 1000 / lm.t_inf(d.name, 1, units) for d in demands}


@dataclass(frozen=True)
class Outcome:
    """Eq. 3's terms of one decision, per model: h_i / H_i and v_i, and the reward."""

    throughput: dict[str, float]
    violation: dict[str, float]
    reward: float


def outcome(judged: Judged, demands: list[Demand], peak: dict[str, float], penalty: float) -> Outcome:
    """The reward of eq. 3 for a judged placement (see the module docstring)."""
    throughput = {d.name: judged.served[d.name] / peak[d.name] for d in demands}
    violation = {d.name: 1 - judged.served[d.name] / d.rate if d.rate > 0 else 0.0 for d in demands}
    reward = sum(throughput[d.name] - penalty * violation[d.name] for d in demands) / len(demands)
    return Outcome(throughput, violation, reward)


def current_placement(demands: list[Demand], devices: list[Device], lm: LatencyModel) -> dict[str, Choice]:
    """Spread's placement: where a fresh deployment starts and what the first layer tries BDA on."""
    return {name: choices[0] for name, choices in spread(demands, devices, lm).items()}


def undeployed(decision: BatchDecision) -> set[str]:
    """Models BDA cannot fit in their device's memory at any batch: not deployed."""
    return {n for n, why in decision.infeasible.items() if why == "memory"}


def state(
    layout: Layout,
    current: dict[str, Choice],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
    decision: BatchDecision | None = None,
) -> np.ndarray:
    """The state the actor decides in: the current placement with BDA's batches on it at the current rates
    (`decision`, where BDA has run on it already)."""
    decision = decision if decision is not None else bda(current, demands, devices, lm)
    return observe(layout, current, decision.batches, demands, lm, undeployed(decision))


def propose(
    act: Callable[[np.ndarray, np.ndarray], np.ndarray],
    layout: Layout,
    current: dict[str, Choice],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
) -> Placement:
    """The actor's greedy placement, `act(state, mask)`."""
    obs = state(layout, current, demands, devices, lm)
    return decode(act(obs, action_mask(layout, demands, lm)), layout, demands, devices)


def proposals(
    trained: Trained,
    current: dict[str, Choice],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
    decision: BatchDecision | None = None,
) -> list[Placement]:
    """Up to PROPOSALS distinct placements of the actor: its greedy one first, then draws from its policy
    (`decision`: BDA's on the current placement, where it has run)."""
    obs = state(trained.layout, current, demands, devices, lm, decision)
    mask = action_mask(trained.layout, demands, lm)
    out: list[Placement] = []
    for action in trained.actor.proposals(obs, mask, PROPOSALS):
        placement = decode(action, trained.layout, demands, devices)
        if placement not in out:
            out.append(placement)
    return out


@dataclass(frozen=True)
class Trained:
    """A trained actor with the layout it was trained for."""

    actor: Any  # actor.TrainedActor (torch, loaded on use)
    layout: Layout

    def other_device(self, lm: LatencyModel) -> str | None:
        """How `lm` describes another device than the latency model the actor learned from, or None (also where
        the file does not say which device that was)."""
        trained_on = self.actor.metadata.get("latency_model_device")
        here = lm.device.fingerprint
        if not (trained_on and trained_on.get("id")) or trained_on["id"] == here.get("id"):
            return None
        return (
            f"it learned from a latency model of {trained_on['model']} (id {trained_on['id']}), this one describes "
            f"{here.get('model', 'another device')} (id {here.get('id')}); train one on it with `tritonctl train`"
        )


def policy_metadata(layout: Layout, lm: LatencyModel, training: dict[str, Any]) -> dict[str, Any]:
    """What a trained actor's file carries: the layout, the device its latency model describes, how it was trained."""
    device = {"id": lm.device.fingerprint.get("id", ""), "model": lm.device.fingerprint.get("model", "")}
    return {**layout.metadata(), "latency_model_device": device, "training": training}


def default_policy_file(cluster: str) -> Path:
    """Where the trained policy of `cluster` ships: policies/ of tritonctl.rl (rl/policies/ in a checkout)."""
    return Path(str(resources.files("tritonctl.rl"))) / "policies" / f"{cluster}.pt"


@functools.lru_cache(maxsize=1)  # a re-plan reuses the actor it loaded last, while its file is unchanged
def _actor(path: Path, *identity: int):
    from tritonctl.planning.policies.actor import TrainedActor  # torch loads only when a trained policy is used

    try:
        return TrainedActor.load(path)
    except Exception as exc:  # a torch file of another kind, truncated, or not one at all
        lines = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {lines[0]}" if len(lines) == 1 and len(lines[0]) <= 160 else type(exc).__name__
        raise TritonctlError(f"not a trained policy that `tritonctl train` writes ({why})", file=path) from None


def load_trained(path: Path, cluster: str, models: list[str], devices: list[Device]) -> Trained:
    """The policy in `path`, refused unless trained for these models and devices."""
    if not path.is_file():
        raise TritonctlError(
            f"no trained inss policy for cluster {cluster!r}: train one with `tritonctl train CLUSTER.yaml "
            f"--latency-model MODEL.json --policy-file {path}` (see rl/README.md), or pass --policy-file",
            file=path,
        )
    actor = _actor(path.resolve(), *file_identity(path))
    layout = Layout.from_metadata(actor.metadata, path)
    why = layout.mismatch(models, devices)
    if why:
        raise TritonctlError(
            f"this policy was trained for cluster {layout.cluster!r} and does not fit {cluster!r}: {why}; "
            "train one for this cluster with `tritonctl train`",
            file=path,
        )
    return Trained(actor, layout)


@dataclass(frozen=True)
class Decision:
    """What the two layers decided: the placement, whose it is ('current': spread's; 'actor'; 'search': the
    fallback), why, and the plan of it (batches with HEADROOM where they serve as much)."""

    placement: Placement
    source: str
    why: str
    choices: dict[str, list[Choice]]


def _served(judged: Judged) -> float:
    return sum(judged.served.values())


def slower_judge(judge: Judge) -> Judge:
    """`judge` with every model HEADROOM slower than its latency model predicts, judging what a placement then
    serves: a CPU taken in turns by an instance that no longer keeps up serves it in part (`Judge`'s `in_part`)."""
    return Judge(judge.demands, judge.devices, judge.lm.slower(HEADROOM), in_part=True)


def robust_choices(placement: Placement, judge: Judge, slower: Judge) -> dict[str, list[Choice]]:
    """The plan of `placement` with batches chosen for every model HEADROOM slower than predicted (`slower`), where
    those are predicted to serve as much as the prediction's own (`judge`'s); else the prediction's."""
    if _served(slower(placement)) >= _served(judge(placement)) - judge.quantum:
        return slower.choices(placement)
    return judge.choices(placement)


def level_of(judged: list[tuple[Placement, Judged]], current: Judged, window: float) -> list[tuple[Placement, Judged]]:
    """Of judged proposals, those level with the best (the least score): predicted to serve within `window`
    requests/s of it, and to score at least as well as the `current` placement."""
    if not judged:
        return []
    best = _served(min((j for _, j in judged), key=lambda j: j.score))
    return [(p, j) for p, j in judged if _served(j) >= best - window and j.score <= current.score]


def most_robust(level: list[tuple[Placement, Judged]], slower: Judge) -> int:
    """Which of `level` (placements predicted level, in order of preference) serves most within the SLOs with
    every model HEADROOM slower; the predicted score, then the order, break ties."""
    held = [-round(_served(slower(p)) / slower.quantum) for p, _ in level]
    return min(range(len(level)), key=lambda k: (held[k], level[k][1].score, k))


def decide(demands: list[Demand], devices: list[Device], lm: LatencyModel, trained: Trained | None) -> Decision:
    """BDA on the current (spread) placement; when it fails, the actor's placement, unless the current one is
    predicted to serve more within the SLOs (see the module docstring)."""
    current = current_placement(demands, devices, lm)
    as_spots = {n: Spot(c.device, c.share) for n, c in current.items()}
    judge = Judge(demands, devices, lm)
    slower = slower_judge(judge)
    first = bda(current, demands, devices, lm, judge.scans)  # the judge reads these scans again
    if first.ok:
        why = "BDA finds batches that meet every SLO on the current (spread) placement"
        return Decision(as_spots, "current", why, robust_choices(as_spots, judge, slower))
    if trained is None:
        raise PlacementError("BDA fails on the current placement and inss has no trained policy (tritonctl train)")
    offered, theirs = sum(d.rate for d in demands), judge(as_spots)
    window = LEVEL * offered
    candidates: list[Placement] = []
    judged: list[tuple[Placement, Judged]] = []  # proposals that may be level with the best (the others given up)
    best = theirs
    for candidate in proposals(trained, current, demands, devices, lm, first):
        candidates.append(candidate)
        verdict = judge.beats(candidate, best.score, slack=window)
        if verdict is None:
            continue
        judged.append((candidate, verdict))
        best = min(best, verdict, key=lambda j: j.score)
        if _served(verdict) >= offered - judge.quantum and _served(slower(candidate)) >= offered - judge.quantum:
            break  # serves every request within its SLO even with the model slower: none serves more
    ahead = min((j for _, j in judged), key=lambda j: j.score, default=None)  # the actor's best predicted
    if ahead is None:
        why = (
            f"none of the actor's {len(candidates)} placements is predicted to serve as many requests within the "
            f"SLOs as the current one ({_served(theirs):,.1f}/s): the current one is kept"
        )
        placement, source = as_spots, "current"
    elif theirs.score < ahead.score:
        why = (
            f"the actor's best placement is predicted to serve {_served(ahead):,.1f} requests/s within the SLOs, "
            f"the current one {_served(theirs):,.1f}: the current one is kept"
        )
        placement, source = as_spots, "current"
    else:
        level = level_of(judged, theirs, window)
        proposal, mine = level[most_robust(level, slower)]
        if len(candidates) == 1 and _served(mine) >= offered - judge.quantum:
            which = "the actor's greedy placement serves every request in time"
        elif len(candidates) == 1:
            which = "the actor proposes one placement"
        else:
            rank = "its greedy one" if proposal == candidates[0] else f"proposal {candidates.index(proposal) + 1}"
            which = f"of the actor's {len(candidates)} placements judged, {rank} is deployed"
        why = (
            f"BDA fails on the current placement; {which}: {_served(mine):,.1f} requests/s within the SLOs "
            f"predicted (the current one {_served(theirs):,.1f})"
        )
        if len(level) > 1:
            why += (
                f"; of the {len(level)} predicted within {LEVEL:.1%} of the offered load of the best, it serves most "
                f"with every model {HEADROOM:.0%} slower ({_served(slower(proposal)):,.1f})"
            )
        if _served(mine) < _served(theirs):
            why += "; level within search's tie margin, where search's tie-breaks favour the actor's"
        placement, source = proposal, "actor"
    unserved = sorted(n for n, g in judge(placement).served.items() if g <= 0)
    if unserved:  # the fallback: search's placement, where it serves every model
        fallback, judge = climb(demands, devices, lm)
        still = sorted(n for n, g in judge(fallback).served.items() if g <= 0)
        if still:
            raise PlacementError(
                f"neither the trained policy's placement, the current one nor search's serves {', '.join(still)} "
                "at all",
                shed=still,
            )
        why = (
            f"{why}; but it leaves {', '.join(unserved)} unserved: search's placement is deployed, "
            f"{_served(judge(fallback)):,.1f} requests/s within the SLOs predicted"
        )
        placement, source = fallback, "search"  # search's judge has these demands, devices and model: `slower` holds
    elif source == "actor":
        grown = grow_replicas(judge, placement)
        if grown != placement:
            changed = sorted({model_of(k) for k in {*grown, *placement} if grown.get(k) != placement.get(k)})
            why += (
                f"; replicas of {', '.join(changed)} changed by search's replica moves: "
                f"{_served(judge(grown)):,.1f} requests/s within the SLOs predicted"
            )
            placement = grown
    return Decision(placement, source, why, robust_choices(placement, judge, slower))


def inss(
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel | None,
    trained: Trained | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, list[Choice]]:
    """The InSS scheduler's plan: `decide`'s placement with its batches; says whose placement it deployed."""
    if lm is None:
        raise PlacementError("policy inss needs a fitted latency model: pass --latency-model")
    chosen = decide(demands, devices, lm, trained)
    whose = {"actor": "the actor's placement", "current": "the current (spread) placement"}.get(
        chosen.source, "search's placement"
    )
    log(f"inss deployed {whose}: {chosen.why}")
    return chosen.choices

"""The InSS two-layer scheduler TS (section 5): a trained SAC-Discrete actor for placement and shares, BDA
for batch sizes; and the pieces of its MDP (section 5.2) that training (`rl/env.py`) shares with it.

Online (section 5.5, Workflow): BDA runs first on the current placement (spread's, the one a fresh
deployment starts from); only when BDA reports failure does the actor choose placement and shares, and
BDA runs again on its choice. When BDA fails there too, InSS deploys its decision all the same, its
violations priced into the reward the actor was trained on; here the placement eq. 3 rates higher of
the actor's and the current one is deployed (a reallocation that the latency model predicts to do worse
is not made), models without a feasible batch at the batch that comes closest to one (`bda.shortfall`).
Only a placement that does not fit in memory is refused (the planner then sheds a model).

One addition to the paper, for robustness to a latency model that is off: the deployed batches are BDA's
for the model running HEADROOM (10%) slower than predicted, where BDA finds batches for that; otherwise
BDA's own. The placement decision and eq. 3 still use the prediction itself. With +-10% errors injected
into the simulator this keeps `inss` under 1% mean violations on the InSS setups (`bench/latency_error.py`).

The MDP, for N models and K devices:

- state: per device the memory the previous decision uses (footprints at its batches, over the device's
  memory); per model the arrival rate (over the `rate_scale` fixed at training) and the queued work under
  the previous decision: Little's law gives rate x mean latency tasks in the queue, counted in units of the
  tasks that arrive within one SLO, i.e. mean latency / SLO, 1 where the queue grows without bound or the
  model is not deployed. All in [0, 1].
- reward, eq. 3: r = (1 / N) sum_i (h_i / H_i - omega v_i), with H_i model i's throughput alone on a
  whole device at batch 1 and omega = 100 (section 6.1). Per model: BDA finds a batch: h_i = b_i / t_inf
  (problem (1)'s objective), v_i = 0 (its p99 meets the SLO); no batch fits in memory (constraint 1b):
  not deployed, h_i = 0, v_i = 1; no batch meets the SLO or the rate: v_i = 1 - 1 / s_i, with s_i >= 1
  how far it is from a feasible batch (`bda.shortfall`), to first order the share of its traffic it would
  have to shed, and h_i = (1 - v_i) x rate, what it serves within the SLO. Dividing by N puts clusters
  of different sizes on one scale ("normalisation of the reward", section 5.4).
- action: per model a device head (K) and a share-level head (`levels`: level l is (l + 1) / levels of the
  device's units). Where the levels on a device add up to more than its units, the device is split in
  proportion to them. Masked: devices the model does not fit on alone, levels below its profiled share.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from tritonctl.errors import TritonctlError
from tritonctl.latency.model import LatencyModel
from tritonctl.latency.queueing import task_latency
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError
from tritonctl.planning.policies.bda import BatchDecision, bda, corunners, explain, memory_at, shortfall, with_batches
from tritonctl.planning.policies.spread import spread

SHARE_LEVELS = 10
PENALTY = 100.0  # omega of eq. 3 (InSS section 6.1)
RATE_HEADROOM = 1.5  # rates observe as rate / (RATE_HEADROOM x the cluster's rate at training)
# Batches are chosen to meet their SLOs with the model this much slower than predicted, where BDA finds such
# a batch (`with_headroom`); placements are still judged on the prediction itself.
HEADROOM = 0.1
FORMAT = "tritonctl-inss-policy/1"


@dataclass(frozen=True)
class Slot:
    """A device as the policy knows it."""

    id: str
    units: int
    memory_mb: int


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
            tuple(Slot(d.id, d.units, d.memory_mb) for d in devices),
            levels,
            tuple(RATE_HEADROOM * d.rate for d in demands),
        )

    @property
    def heads(self) -> list[int]:
        return [len(self.devices), self.levels] * len(self.models)

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
        """How a cluster with these models and devices differs from the one trained for, or None."""
        wanted = tuple(Slot(d.id, d.units, d.memory_mb) for d in devices)
        if tuple(models) != self.models:
            return f"it was trained for models {list(self.models)}, the cluster has {models}"
        if wanted != self.devices:
            return f"it was trained for devices {_show(self.devices)}, the cluster has {_show(wanted)}"
        return None


def _show(slots: tuple[Slot, ...]) -> str:
    return ", ".join(f"{s.id} ({s.units} units, {s.memory_mb} MB)" for s in slots)


def action_mask(layout: Layout, demands: list[Demand], lm: LatencyModel) -> np.ndarray:
    """Allowed choices, the heads' masks concatenated: per model the devices it fits on alone and the share
    levels at or above its profiled share (at least the top level). Models absent from `demands` may take any."""
    by_name = {d.name: d for d in demands}
    parts = []
    for name in layout.models:
        demand = by_name.get(name)
        fits = [demand is None or demand.memory_mb <= s.memory_mb for s in layout.devices]
        floor = lm.models[name].share_range[0] / lm.device.units if demand else 0.0
        levels = [(k + 1) / layout.levels >= floor - 1e-9 for k in range(layout.levels)]
        levels[-1] = True
        parts += [fits if any(fits) else [True] * len(fits), levels]
    return np.concatenate([np.array(p, bool) for p in parts])


def decode(action, layout: Layout, demands: list[Demand]) -> dict[str, Choice]:
    """The placement an action stands for, for the models in `demands`; oversubscribed devices split in
    proportion to the levels asked for."""
    present = {d.name for d in demands}
    asked: dict[str, tuple[int, int]] = {}  # model -> (device index, units asked)
    for i, name in enumerate(layout.models):
        if name in present:
            k, level = int(action[2 * i]), int(action[2 * i + 1])
            asked[name] = (k, math.ceil(layout.devices[k].units * (level + 1) / layout.levels))
    placement = {}
    for k, slot in enumerate(layout.devices):
        here = {n: units for n, (dev, units) in asked.items() if dev == k}
        total = sum(here.values())
        for name, units in here.items():
            share = units if total <= slot.units else max(1, units * slot.units // total)
            placement[name] = Choice(slot.id, share)
    return {d.name: placement[d.name] for d in demands}


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
    """The state s_t = {u_k, (lambda_i, G_i)} after a decision (`placement` with `batches`); `undeployed`
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


@dataclass(frozen=True)
class Outcome:
    """What one decision yields: BDA's batches and eq. 3's terms per model."""

    decision: BatchDecision
    throughput: dict[str, float]  # h_i / H_i
    violation: dict[str, float]  # v_i
    reward: float

    @property
    def undeployed(self) -> set[str]:
        return undeployed(self.decision)


def undeployed(decision: BatchDecision) -> set[str]:
    """Models BDA cannot fit in their device's memory at any batch: not deployed."""
    return {n for n, why in decision.infeasible.items() if why == "memory"}


def peak_rps(demands: list[Demand], devices: list[Device], lm: LatencyModel) -> dict[str, float]:
    """H_i: throughput alone on a whole device at batch 1."""
    units = max(d.units for d in devices)
    return {d.name: 1000 / lm.t_inf(d.name, 1, units) for d in demands}


def outcome(
    placement: dict[str, Choice],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
    peak: dict[str, float],
    penalty: float,
) -> Outcome:
    """BDA on the placement, then the reward of eq. 3 (see the module docstring)."""
    decision = bda(placement, demands, devices, lm)
    by_name = {d.name: d for d in demands}
    throughput, violation = {}, {}
    for d in demands:
        why, batch = decision.infeasible.get(d.name), decision.batches[d.name]
        if why is None:
            t = lm.t_inf(d.name, batch, placement[d.name].share, corunners(d.name, placement, decision.batches))
            violation[d.name], served = 0.0, 1000 * batch / t
        elif why == "memory":
            violation[d.name], served = 1.0, 0.0
        else:
            violation[d.name] = 1 - 1 / shortfall(d.name, placement, decision.batches, by_name, lm)[0]
            served = (1 - violation[d.name]) * d.rate
        throughput[d.name] = served / peak[d.name]
    reward = sum(throughput[n] - penalty * violation[n] for n in by_name) / len(demands)
    return Outcome(decision, throughput, violation, reward)


def propose(
    act: Callable[[np.ndarray, np.ndarray], np.ndarray],
    layout: Layout,
    current: dict[str, Choice],
    decision: BatchDecision,
    demands: list[Demand],
    lm: LatencyModel,
) -> dict[str, Choice]:
    """The actor's placement, `act(state, mask)`, seeing the current placement with BDA's `decision` on it."""
    obs = observe(layout, current, decision.batches, demands, lm, undeployed(decision))
    return decode(act(obs, action_mask(layout, demands, lm)), layout, demands)


@dataclass(frozen=True)
class Trained:
    """A trained actor with the layout it was trained for."""

    actor: Any  # actor.TrainedActor (torch, loaded on use)
    layout: Layout


def default_policy_file(cluster: str) -> Path:
    """Where the trained policy of `cluster` ships: policies/ of tritonctl.rl (rl/policies/ in a checkout)."""
    return Path(str(resources.files("tritonctl.rl"))) / "policies" / f"{cluster}.pt"


def load_trained(path: Path, cluster: str, models: list[str], devices: list[Device]) -> Trained:
    """The policy in `path`, refused unless trained for these models and devices."""
    from tritonctl.planning.policies.actor import TrainedActor  # torch loads only when a trained policy is used

    if not path.is_file():
        raise TritonctlError(
            f"no trained inss policy for cluster {cluster!r}: train one with `tritonctl train CLUSTER.yaml "
            f"--latency-model MODEL.json --policy-file {path}` (see rl/README.md), or pass --policy-file",
            file=path,
        )
    try:
        actor = TrainedActor.load(path)
    except Exception as exc:  # a torch file of another kind, truncated, or not one at all
        raise TritonctlError(f"cannot load a trained policy ({type(exc).__name__}: {exc})", file=path) from None
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
    """What the two layers decided: the placement, whose it is ('current': spread's, or 'actor'), its batches
    (BDA's with headroom, and for a model without a feasible batch the one closest to one), and eq. 3's
    outcome of each placement judged (none where BDA served the current one)."""

    placement: dict[str, Choice]
    source: str
    batches: dict[str, int]
    judged: dict[str, Outcome]


def with_headroom(
    placement: dict[str, Choice], nominal: BatchDecision, demands: list[Demand], devices: list[Device], lm: LatencyModel
) -> dict[str, int]:
    """BDA's batches, each replaced by the one BDA picks for a model HEADROOM slower than predicted where that
    finds one: a batch at the edge of the SLO as predicted misses it when the model is a little slower."""
    at_nominal = {n: dataclasses.replace(c, batch=nominal.batches[n]) for n, c in placement.items()}
    # co-runners at the batches they will run; the headroom on top of any margin the plan already has
    robust = bda(at_nominal, demands, devices, lm.with_margin(min(0.99, (1 + lm.margin) * (1 + HEADROOM) - 1)))
    return {
        n: robust.batches[n] if n not in robust.infeasible and n not in nominal.infeasible else b
        for n, b in nominal.batches.items()
    }


def decide(demands: list[Demand], devices: list[Device], lm: LatencyModel, trained: Trained | None) -> Decision:
    """BDA on the current (spread) placement; when it fails, the actor's placement and shares, then BDA again;
    when that fails too, the better of the two by eq. 3 (see the module docstring). Batches with HEADROOM."""
    current = {name: choices[0] for name, choices in spread(demands, devices, lm).items()}
    decision = bda(current, demands, devices, lm)
    if decision.ok:
        return Decision(current, "current", with_headroom(current, decision, demands, devices, lm), {})
    if trained is None:
        raise PlacementError("BDA fails on the current placement and inss has no trained policy (tritonctl train)")
    placements = {
        "actor": propose(trained.actor.act, trained.layout, current, decision, demands, lm),
        "current": current,
    }
    peak = peak_rps(demands, devices, lm)
    judged = {k: outcome(p, demands, devices, lm, peak, PENALTY) for k, p in placements.items()}
    source = "actor" if judged["actor"].decision.ok else max(judged, key=lambda k: judged[k].reward)
    result, placement = judged[source], placements[source]
    if result.undeployed:
        raise PlacementError(explain(result.decision) + " on the current placement or the trained policy's")
    by_name, batches = {d.name: d for d in demands}, result.decision.batches
    closest = {n: shortfall(n, placement, batches, by_name, lm)[1] for n in result.decision.infeasible}
    robust = with_headroom(placement, result.decision, demands, devices, lm)
    return Decision(placement, source, {**robust, **closest}, judged)


def inss(
    demands: list[Demand], devices: list[Device], lm: LatencyModel | None, trained: Trained | None = None
) -> dict[str, list[Choice]]:
    """The InSS scheduler's plan: `decide`'s placement and batches, with queue delays that fill them."""
    if lm is None:
        raise PlacementError("policy inss needs a fitted latency model: pass --latency-model")
    chosen = decide(demands, devices, lm, trained)
    return with_batches(chosen.placement, chosen.batches, demands, lm)

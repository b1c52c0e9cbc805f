"""The InSS two-layer scheduler TS (section 5): a trained SAC-Discrete actor for placement and shares, BDA
for batch sizes; and the pieces of its MDP (section 5.2) that training (`rl/env.py`) shares with it.

Online (section 5.5, Workflow): BDA runs first on the current placement (spread's, the one a fresh
deployment starts from); only when BDA reports failure does the actor choose placement and shares, and
BDA runs again on its choice.

The MDP, for N models and K devices:

- state: per device the memory the previous decision uses (footprints at its batches, over the device's
  memory); per model the arrival rate (over the `rate_scale` fixed at training) and the queued work under
  the previous decision: Little's law gives rate x mean latency tasks in the queue, counted in units of the
  tasks that arrive within one SLO, i.e. mean latency / SLO, 1 where the queue grows without bound or the
  model is not deployed. All in [0, 1].
- action: per model a device head (K) and a share-level head (`levels`: level l is (l + 1) / levels of the
  device's units). Where the levels on a device add up to more than its units, the device is split in
  proportion to them. Masked: devices the model does not fit on alone, levels below its profiled share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tritonctl.errors import TritonctlError
from tritonctl.latency.model import LatencyModel
from tritonctl.latency.queueing import task_latency
from tritonctl.plan import Device
from tritonctl.policies.base import Choice, Demand, PlacementError
from tritonctl.policies.bda import BatchDecision, bda, corunners, explain, with_batches
from tritonctl.policies.spread import spread

SHARE_LEVELS = 10
RATE_HEADROOM = 1.5  # rates observe as rate / (RATE_HEADROOM x the cluster's rate at training)
POLICY_DIR = Path(__file__).resolve().parent.parent.parent / "rl" / "policies"
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
            show = lambda slots: ", ".join(f"{s.id} ({s.units} units, {s.memory_mb} MB)" for s in slots)  # noqa: E731
            return f"it was trained for devices {show(self.devices)}, the cluster has {show(wanted)}"
        return None


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
        memory[choice.device] += (
            by_name[name].memory_mb + lm.footprint_mb(name, batches[name]) - lm.footprint_mb(name, 1)
        )
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


def propose(
    act: Callable[[np.ndarray, np.ndarray], np.ndarray],
    layout: Layout,
    current: dict[str, Choice],
    decision: BatchDecision,
    demands: list[Demand],
    lm: LatencyModel,
) -> dict[str, Choice]:
    """The actor's placement, `act(state, mask)`, seeing the current placement with BDA's `decision` on it."""
    undeployed = {n for n, why in decision.infeasible.items() if why == "memory"}
    obs = observe(layout, current, decision.batches, demands, lm, undeployed)
    return decode(act(obs, action_mask(layout, demands, lm)), layout, demands)


@dataclass(frozen=True)
class Trained:
    """A trained actor with the layout it was trained for, loaded from `path`."""

    actor: Any  # rl.sac.TrainedActor
    layout: Layout
    path: Path


def default_policy_file(cluster: str) -> Path:
    return POLICY_DIR / f"{cluster}.pt"


def load_trained(path: Path, cluster: str, models: list[str], devices: list[Device]) -> Trained:
    """The policy in `path`, refused unless trained for these models and devices."""
    from rl.sac import TrainedActor  # torch loads only when a trained policy is used

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
    return Trained(actor, layout, path)


def inss(
    demands: list[Demand], devices: list[Device], lm: LatencyModel | None, trained: Trained | None = None
) -> dict[str, list[Choice]]:
    """BDA on the current (spread) placement; when it fails, the actor's placement and shares, then BDA again."""
    if lm is None:
        raise PlacementError("policy inss needs a fitted latency model: pass --latency-model")
    if trained is None:
        raise PlacementError("policy inss needs a trained policy (tritonctl train)")
    current = {name: choices[0] for name, choices in spread(demands, devices, lm).items()}
    decision = bda(current, demands, devices, lm)
    if decision.ok:
        return with_batches(current, decision.batches, demands, lm)
    placement = propose(trained.actor.act, trained.layout, current, decision, demands, lm)
    decision = bda(placement, demands, devices, lm)
    if not decision.ok:
        raise PlacementError(explain(decision) + " on the placement the trained policy chose")
    return with_batches(placement, decision.batches, demands, lm)

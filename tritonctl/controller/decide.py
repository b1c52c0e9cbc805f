"""The controller's decisions, pure: which rates moved, BDA on the current placement, plans moved between folders."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tritonctl.deploy.runtime import InstanceRecord
from tritonctl.latency.model import LatencyModel
from tritonctl.planning.plan import Plan, relative_to
from tritonctl.planning.planner import predicted
from tritonctl.planning.policies import Choice, Demand
from tritonctl.planning.policies.bda import bda, eager, explain, prompted, with_batches


@dataclass(frozen=True)
class ControllerConfig:
    interval_s: float = 1.0
    """Seconds between ticks (metrics scrapes)."""
    window_s: float = 4.0
    """Arrival rates are averaged over this many seconds."""
    threshold: float = 0.25
    """A rate this far from the planned one (relative) counts as changed ..."""
    min_delta_rps: float = 1.0
    """... and at least this far in requests per second (ignores noise on small rates)."""
    confirm: int = 2
    """Consecutive ticks a rise must last before the controller acts (hysteresis)."""
    confirm_down: int = 5
    """Consecutive ticks a fall must last: shrinking is never urgent, flapping is costly."""
    cooldown_s: float = 10.0
    """Seconds after an applied change before the next one (no flapping)."""
    headroom: float = 1.1
    """Plans are sized for the estimated rate times this."""


def changed_rates(
    planned: dict[str, float], estimated: dict[str, float | None], cfg: ControllerConfig
) -> dict[str, float]:
    """The models whose estimated rate is beyond the threshold of the planned one -> estimate.

    Beyond means past the relative threshold, the absolute minimum, and three standard
    deviations of a Poisson count over the window (at 5 req/s a 4 s window counts 20 +- 4.5
    requests, so 25 % alone would fire on noise).
    """
    out = {}
    for model, rate in estimated.items():
        if rate is None or model not in planned:
            continue
        noise = 3 * math.sqrt(max(planned[model], 0.1) / cfg.window_s)
        if abs(rate - planned[model]) > max(cfg.threshold * planned[model], cfg.min_delta_rps, noise):
            out[model] = rate
    return out


@dataclass(frozen=True)
class Outage:
    """What is down: instances whose process is gone, and whether the proxy does not answer."""

    dead: tuple[InstanceRecord, ...] = ()
    proxy: bool = False

    def __bool__(self) -> bool:
        return bool(self.dead or self.proxy)

    def __str__(self) -> str:
        lines = [f"{r.uid} ({r.model}) died" for r in self.dead]
        return "; ".join(lines + ["the proxy does not answer"] * self.proxy)


def with_rates(plan: Plan, rates: dict[str, float]) -> Plan:
    return plan.model_copy(
        update={"models": [m.model_copy(update={"rate": round(rates.get(m.name, m.rate), 2)}) for m in plan.models]}
    )


def rebatch(plan: Plan, lm: LatencyModel) -> tuple[Plan | None, str]:
    """InSS's first layer: BDA on the plan's placement and shares at its (new) rates.

    Returns the plan with BDA's batches and queue delays (served as the plan's `batching` says), or None and why
    BDA failed (or why it does not apply: BDA sizes one instance per model).
    """
    if plan.sharing != "spatial" or plan.turns or any(len(m.placements) != 1 for m in plan.models):
        return None, "BDA sizes one instance per model on shared devices; this plan has replicas or turns"
    demands = [Demand(m.name, m.slo_ms, m.rate, m.memory_mb) for m in plan.models]
    placement = {
        m.name: Choice(m.placements[0].device, m.placements[0].share, m.placements[0].batch) for m in plan.models
    }
    decision = bda(placement, demands, plan.devices, lm)
    if not decision.ok:
        return None, explain(decision)
    served = with_batches(placement, decision.batches, demands, lm)
    if plan.batching == "prompt":
        served = prompted(served, demands, lm)
    elif plan.batching == "eager":
        served = eager(served)
    chosen = {name: choices[0] for name, choices in served.items()}
    sized = {name: {"batch": c.batch, "queue_delay_us": c.queue_delay_us} for name, c in chosen.items()}
    models = [
        m.model_copy(update={"placements": [m.placements[0].model_copy(update=sized[m.name])]}) for m in plan.models
    ]
    return predicted(plan.model_copy(update={"models": models}), lm), ""


def rebase(plan: Plan, old_dir: Path, new_dir: Path) -> Plan:
    """The plan with its relative paths rewritten for a file in `new_dir` instead of `old_dir`."""

    def move(path: str) -> str:
        return relative_to(old_dir / path, new_dir)

    runtime = plan.runtime.model_copy(
        update={"repository_dir": move(plan.runtime.repository_dir), "state_dir": move(plan.runtime.state_dir)}
    )
    return plan.model_copy(
        update={
            "cluster_file": move(plan.cluster_file),
            "runtime": runtime,
            "models": [m.model_copy(update={"onnx": move(m.onnx)}) for m in plan.models],
        }
    )

"""The energy objective (EAIS): on the placement and shares a policy chose, the SM clock and batch sizes that serve
every model within its SLO with the fewest joules.

EAIS picks, per model, the batch and clock with the most images per joule (1 / energy per image) that meets the
SLO. Models sharing a GPU share its clock, and a plan's GPUs are alike, so one clock serves the plan: for each
clock of the energy model's grid, the latency model carried to it (`energy.clocked`) decides the batch sizes
that meet every SLO (BDA), and each model then takes, of the sizes that still meet every constraint beside its
co-runners, the one with the least energy per image. The clock kept is the one whose predicted power, the sum
over models of rate x energy per image, is least. Energy per image is the whole GPU's, measured with the model
alone at that batch and clock: co-located models are counted at those values (an estimate; `tritonctl load`
measures the real joules per request on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonctl.errors import TritonctlError
from tritonctl.latency.energy import EnergyModel, clocked
from tritonctl.latency.model import LatencyModel
from tritonctl.planning.plan import Device, Plan
from tritonctl.planning.policies.base import Choice, Demand
from tritonctl.planning.policies.bda import batch_checks, bda, with_batches


@dataclass(frozen=True)
class EnergyDecision:
    clock_mhz: int
    choices: dict[str, list[Choice]]
    lm: LatencyModel  # the latency model at the clock, for the plan's predictions
    joules_per_request: dict[str, float]
    power_w: float  # predicted: sum of rate x joules per request

    def explain(self) -> str:
        per = ", ".join(f"{m} {j * 1000:.1f} mJ" for m, j in self.joules_per_request.items())
        return (
            f"energy objective: SM clock {self.clock_mhz} MHz, predicted {self.power_w:.0f} W of inference "
            f"({per} per request)"
        )


def at_clock(
    clock: int,
    placement: dict[str, Choice],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
    energy: EnergyModel,
    sources: dict[str, str],
) -> EnergyDecision | None:
    """The placement's batches of least energy at one SM clock, or None where no batches keep every SLO there."""
    lm_f = clocked(lm, energy, clock, sources)
    decision = bda(placement, demands, devices, lm_f)
    if not decision.ok:
        return None
    batches = dict(decision.batches)
    by_name, by_id = {d.name: d for d in demands}, {d.id: d for d in devices}
    for _ in range(2):  # a co-runner's new batch changes the others' interference: a second pass settles it
        for d in demands:
            feasible = [
                b for b, broken, _ in batch_checks(d.name, placement, by_name, batches, by_id, lm_f) if broken is None
            ]
            if feasible:
                batches[d.name] = min(feasible, key=lambda b: energy.joules_per_image(sources[d.name], b, clock))
    for d in demands:  # every model still within every constraint at the final batches
        if next(batch_checks(d.name, placement, by_name, batches, by_id, lm_f, (batches[d.name],)))[1] is not None:
            return None
    joules = {d.name: energy.joules_per_image(sources[d.name], batches[d.name], clock) for d in demands}
    power = sum(d.rate * joules[d.name] for d in demands)
    return EnergyDecision(clock, with_batches(placement, batches, demands, lm_f), lm_f, joules, power)


def least_energy(
    choices: dict[str, list[Choice]],
    demands: list[Demand],
    devices: list[Device],
    lm: LatencyModel,
    energy: EnergyModel,
    sources: dict[str, str],
) -> EnergyDecision:
    """The clock and batches of least predicted power for the policy's placement; TritonctlError where no clock
    of the grid serves every model within its SLO, or a placement is not one GPU instance per model."""
    if any(d.kind != "gpu" for d in devices):
        raise TritonctlError("the energy objective plans GPUs (SM clocks); this cluster has CPU devices")
    missing = sorted({sources.get(d.name, d.name) for d in demands} - set(energy.models))
    if missing:
        raise TritonctlError(
            f"the energy model has no measurements of {', '.join(missing)} "
            f"(its models: {', '.join(sorted(energy.models))})"
        )
    if any(len(cs) != 1 for cs in choices.values()):
        raise TritonctlError("the energy objective plans one instance per model; the policy placed replicas")
    placement = {name: cs[0] for name, cs in choices.items()}
    served = [d for d in demands if d.name in placement]
    best = None
    for clock in energy.clocks:
        decision = at_clock(clock, placement, served, devices, lm, energy, sources)
        if decision is not None and (best is None or decision.power_w < best.power_w):
            best = decision
    if best is None:
        raise TritonctlError(
            f"no SM clock from {energy.clocks[0]} to {energy.clocks[-1]} MHz serves every model within its SLO "
            "on this placement"
        )
    return best


def plan_joules(plan: Plan, energy: EnergyModel, sources: dict[str, str]) -> float | None:
    """The energy model's joules per request of a plan, its placements' rates weighting each one's energy per image
    at its batch and the plan's clock (the grid's top where none is locked); None where a model was not measured."""
    clocks = {d.id: d.clock_mhz or energy.clocks[-1] for d in plan.devices}
    total = weight = 0.0
    for model, placement in plan.instances():
        source = sources.get(model.name, model.name)
        if source not in energy.models:
            return None
        rate = model.rate_of(placement)
        total += rate * energy.joules_per_image(source, placement.batch, clocks[placement.device])
        weight += rate
    return total / weight if weight else None

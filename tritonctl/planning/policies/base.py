"""The types every policy shares: what a model demands, what a policy chooses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tritonctl.latency.model import LatencyModel
from tritonctl.planning.plan import Device


@dataclass(frozen=True)
class Demand:
    """What a policy needs to know about a model."""

    name: str
    slo_ms: float
    rate: float
    memory_mb: int


@dataclass(frozen=True)
class Choice:
    """One placement a policy chose for a model."""

    device: str
    share: int
    batch: int = 1
    queue_delay_us: int = 0
    weight: float = 1.0  # the part of the model's traffic this replica is sized for, relative to its others
    turns: bool = False  # takes turns with the device's other `turns` replicas, each with all of it (share = units)


class PlacementError(Exception):
    """The policy found no placement that fits; the message says why, `shed` which models to leave out
    (empty: the planner picks the model with the most work)."""

    def __init__(self, message: str, shed: list[str] | tuple[str, ...] = ()):
        super().__init__(message)
        self.shed = tuple(shed)


class PolicyLimit(Exception):
    """The policy cannot take on this cluster at all (too large for it): no model is to blame."""


# models, devices, the fitted latency model (None without a profile) -> placements per model
Policy = Callable[[list[Demand], list[Device], LatencyModel | None], dict[str, list[Choice]]]


@dataclass(frozen=True)
class PolicyInfo:
    fn: Policy
    help: str
    sharing: str = "spatial"  # "temporal": every instance gets its whole device, instances take turns
    trained: bool = False  # needs a trained policy file: the planner loads it and passes it as `trained=`
    logs: bool = False  # says how it went (a solver's bound and gap): the planner passes its `log=`
    latency_model: bool = True  # decides with a fitted latency model (spread alone does without)

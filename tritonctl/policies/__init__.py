"""Placement policies and the one interface they share.

A policy is a pure function: given what each model needs and the devices, it returns,
for every model, its placements (device, share in device units, batch size, queue delay,
and a prediction where it has a latency model). `planner.make_plan` wraps that into a Plan.
"""

from __future__ import annotations

from tritonctl.policies.base import Choice, Demand, PlacementError, Policy
from tritonctl.policies.bda import bda_policy
from tritonctl.policies.optimal import optimal
from tritonctl.policies.spread import spread

POLICIES: dict[str, tuple[Policy, str]] = {
    "spread": (spread, "spread models over devices, equal shares per device, batch 1"),
    "bda": (bda_policy, "spread's placement and shares, batch sizes by InSS's BDA (needs --latency-model)"),
    "optimal": (optimal, "exact optimum of problem (1) on a 5-unit share grid, BDA batches; small clusters only"),
}

__all__ = ["POLICIES", "Choice", "Demand", "PlacementError", "Policy"]

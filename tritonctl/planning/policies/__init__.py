"""Placement policies and the one interface they share.

A policy is a pure function: given what each model needs and the devices, it returns,
for every model, its placements (device, share in device units, batch size, queue delay,
and the part of the model's traffic each replica takes). `planner.make_plan` wraps that
into a Plan. Baselines follow their papers; see each module's docstring.
"""

from __future__ import annotations

from tritonctl.planning.policies.base import Choice, Demand, PlacementError, Policy, PolicyInfo, PolicyLimit
from tritonctl.planning.policies.bda import bda_policy
from tritonctl.planning.policies.gpulet import gpulet
from tritonctl.planning.policies.gslice import gslice
from tritonctl.planning.policies.igniter import igniter
from tritonctl.planning.policies.inss import inss
from tritonctl.planning.policies.optimal import optimal
from tritonctl.planning.policies.search import search
from tritonctl.planning.policies.spread import spread
from tritonctl.planning.policies.timesharing import time_sharing

POLICIES: dict[str, PolicyInfo] = {
    "spread": PolicyInfo(
        spread, "spread models over devices, equal shares per device, batch 1 (no latency model)", latency_model=False
    ),
    "bda": PolicyInfo(bda_policy, "spread's placement and shares, batch sizes by InSS's BDA (Algorithm 1)"),
    "search": PolicyInfo(
        search,
        "local search over placements, shares and turns, BDA batches (what the inss actor learns from); a model served"
        " short of its rate may take replicas on other devices",
    ),
    "inss": PolicyInfo(
        inss,
        "InSS two-layer scheduler: BDA on the current placement, else a trained actor's placement (tritonctl train),"
        " with replicas where it serves a model short; search's where neither serves every model",
        trained=True,
        logs=True,
    ),
    "gpulet": PolicyInfo(gpulet, "Gpulet: elastic partitioning into two gpulets per device, GPU scaling"),
    "gslice": PolicyInfo(gslice, "GSLICE: knee shares, self-tuned by average latency and throughput"),
    "igniter": PolicyInfo(igniter, "iGniter: minimum shares from the latency model, least-interference placement"),
    "time-sharing": PolicyInfo(
        time_sharing, "whole devices taken in turns, batching only (no spatial sharing)", sharing="temporal"
    ),
    "optimal": PolicyInfo(
        optimal,
        "the goodput optimum over search's layouts (split on a 5-unit grid, or in turns; up to 8 replicas a model;"
        " models served in part), by an integer program",
        logs=True,
    ),
}

__all__ = ["POLICIES", "Choice", "Demand", "PlacementError", "Policy", "PolicyInfo", "PolicyLimit"]

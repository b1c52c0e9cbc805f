"""The exact optimum of InSS problem (1) over discrete choices, for small clusters: the yardstick.

Every placement of models on devices (one instance per model, as in (1e)) and every split
of each device into shares on a grid of `STEP` units is tried; BDA (exact for a fixed
placement, since latency, memory and throughput grow with the batch) picks the batch
sizes. The plan with the highest total throughput sum_i b_i / t_inf that meets memory,
SLO and rate for every model wins. Shares below a model's profiled range are skipped (the
latency model only extrapolates there). The search is exponential, so it refuses clusters
beyond `MAX_CANDIDATES` combinations.
"""

from __future__ import annotations

import itertools
import math

from tritonctl.latency.model import LatencyModel
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError, PolicyLimit
from tritonctl.planning.policies.bda import bda, throughput, with_batches

STEP = 5  # share grid, in device units
MAX_CANDIDATES = 20_000


def _count(models: int, devices: list[Device]) -> int:
    """How many (placement, share split) candidates there are: n positive grid shares summing to at most
    m grid steps can be chosen in C(m, n) ways."""
    if len(devices) ** models > 10 * MAX_CANDIDATES:
        return len(devices) ** models  # already too many placements alone
    total = 0
    for assignment in itertools.product(range(len(devices)), repeat=models):
        count = 1
        for k, device in enumerate(devices):
            count *= math.comb(device.units // STEP, assignment.count(k))
        total += count
    return total


def _splits(n: int, units: int) -> list[tuple[int, ...]]:
    """Every way to give n models positive shares on the grid that add up to at most `units`."""
    levels = range(STEP, units + 1, STEP)
    return [s for s in itertools.product(levels, repeat=n) if sum(s) <= units]


def optimal(demands: list[Demand], devices: list[Device], lm: LatencyModel | None) -> dict[str, list[Choice]]:
    if lm is None:
        raise PlacementError("policy optimal needs a fitted latency model: pass --latency-model")
    names = [d.name for d in demands]
    candidates = _count(len(demands), devices)
    if candidates > MAX_CANDIDATES:
        raise PolicyLimit(
            f"{candidates:,} candidate plans (more than {MAX_CANDIDATES:,}): the cluster is too "
            "large for the optimal policy"
        )
    best: tuple[float, dict[str, Choice], dict[str, int]] | None = None
    for assignment in itertools.product(range(len(devices)), repeat=len(demands)):
        groups = [[n for n, k in zip(names, assignment, strict=True) if k == dev] for dev in range(len(devices))]
        split_options = [_splits(len(group), devices[k].units) if group else [()] for k, group in enumerate(groups)]
        for splits in itertools.product(*split_options):
            placement = {
                name: Choice(devices[k].id, share)
                for k, (group, split) in enumerate(zip(groups, splits, strict=True))
                for name, share in zip(group, split, strict=True)
            }
            if any(placement[n].share < lm.models[n].share_range[0] for n in names):
                continue  # below the profiled shares the latency model only extrapolates: not trusted here
            decision = bda(placement, demands, devices, lm)
            if not decision.ok:
                continue
            total = throughput(placement, decision.batches, lm)
            if best is None or total > best[0]:
                best = (total, placement, decision.batches)
    if best is None:
        raise PlacementError("no placement, share split and batch sizes serve every model within its SLO and rate")
    return with_batches(best[1], best[2], demands, lm)

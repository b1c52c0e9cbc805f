"""Decision times of the policies and the simulator's speed, for the figures in docs/evaluation.md.

    python bench/decision_time.py

Policies on the InSS eight-model, four-device setup (examples/inss-scaled/eight-4.yaml with
the SCALED latency model): the one-time cost of the queueing tables, BDA per call on the
spread placement, and each policy's warm planning time (median of 3; a policy that finds
no plan for all eight models is timed to its failure, as the planner's first attempt). For
`inss` (with the trained rl/policies/inss-eight-4.pt) also its online decision alone (`inss.decide`:
BDA on the current placement, the actor's proposals judged, search's replica moves tried on the one deployed;
median of 50), the same without the replica moves, and over 50 held-out rate vectors (each model's rate
drawn in 0.5-1.2x, as the controller meets them). Every timed run is at rates no earlier one had (the
setup's x (1 + k 1e-9) for the k-th: the same decisions), so that what the planners keep between calls
for given rates (sampled latencies near saturation) counts as it would in a re-plan, not once for all
runs; what they keep whatever the rates (the latency model's batch times per device layout) stays warm.
Simulator: requests simulated per second of wall time for the CPU demo's batch-1 plans
(the slowest case: one batch per request), the CPU split into quotas
(bench/results/cpu-demo/plan-spread.yaml) and in turns (plan-search.yaml: processor
sharing, two events per batch), at 1x and 10x their rates, with drops. Run it on a quiet
machine.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import load_plan
from tritonctl.planning.planner import demands_of, devices_of
from tritonctl.planning.policies import POLICIES, PlacementError, PolicyLimit
from tritonctl.planning.policies.base import Demand
from tritonctl.planning.policies.bda import bda
from tritonctl.planning.policies.inss import decide, default_policy_file, load_trained
from tritonctl.planning.policies.spread import spread
from tritonctl.planning.simulate import simulate
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
HELD_OUT_SEED = 20


def timed(fn, *args) -> float:
    """Milliseconds `fn(*args)` takes (to its failure where it finds no plan)."""
    started = time.perf_counter()
    try:
        fn(*args)
    except (PlacementError, PolicyLimit):
        pass
    return 1000 * (time.perf_counter() - started)


def main() -> None:
    lm = load_latency_model(REPO / "profiles/inss-scaled/latency-model.json")
    cluster = load_cluster(REPO / "examples/inss-scaled/eight-4.yaml")
    devices = devices_of(cluster)
    demands = demands_of(cluster, {}, lm)
    placement = {n: c[0] for n, c in spread(demands, devices, lm).items()}
    first = timed(lambda: bda(placement, demands, devices, lm))
    print(f"queueing tables and first BDA (once per process): {first:.0f} ms")
    calls = 200
    started = time.perf_counter()
    for _ in range(calls):
        bda(placement, demands, devices, lm)
    print(f"BDA, eight models: {1000 * (time.perf_counter() - started) / calls:.2f} ms per call")
    runs_so_far = itertools.count(1)

    def fresh() -> list[Demand]:
        """The setup's demands at rates no run had before, the same to nine digits."""
        k = next(runs_so_far)
        return [replace(d, rate=d.rate * (1 + k * 1e-9)) for d in demands]

    name = cluster.spec.name
    trained = load_trained(default_policy_file(name), name, [d.name for d in demands], devices)
    for name, info in POLICIES.items():
        fn = partial(info.fn, trained=trained) if info.trained else info.fn
        fn = partial(fn, log=lambda _: None) if info.logs else fn
        runs = [timed(fn, fresh(), devices, lm) for _ in range(3)]
        print(f"  {name:13} {statistics.median(runs):8.1f} ms")
    runs = [timed(decide, fresh(), devices, lm, trained) for _ in range(50)]
    print(f"inss online decision (BDA, the actor's proposals judged), eight models: {statistics.median(runs):.2f} ms")
    inss_module = sys.modules[decide.__module__]
    grow = inss_module.grow_replicas
    inss_module.grow_replicas = lambda judge, placement: placement
    try:
        runs = [timed(decide, fresh(), devices, lm, trained) for _ in range(50)]
    finally:
        inss_module.grow_replicas = grow
    print(f"  the same without search's replica moves: {statistics.median(runs):.2f} ms")
    rng = np.random.default_rng(HELD_OUT_SEED)
    draws = [rng.uniform(0.5, 1.2, len(demands)) for _ in range(50)]
    held_out = [[replace(d, rate=d.rate * x) for d, x in zip(demands, f, strict=True)] for f in draws]
    runs = [timed(decide, d, devices, lm, trained) for d in held_out]
    print(f"  over 50 held-out rate vectors (0.5-1.2x): median {statistics.median(runs):.2f} ms, max {max(runs):.2f}")
    demo_lm = load_latency_model(REPO / "profiles/cpu-demo/latency-model.json")
    for policy, sharing in (("spread", "split"), ("search", "in turns")):
        demo = load_plan(REPO / f"bench/results/cpu-demo/plan-{policy}.yaml").plan
        for scale, seconds in ((1.0, 4000), (10.0, 400)):
            result = simulate(demo, demo_lm, seconds, drop=True, rate_scale=scale)
            print(
                f"simulator, batch-1 plan, CPU {sharing}, at {scale:g}x: {result.requests / result.wall_s:,.0f} "
                f"requests/s (goodput {result.goodput:.1f}/s)"
            )


if __name__ == "__main__":
    main()

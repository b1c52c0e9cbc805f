"""Decision times of the policies and the simulator's speed, for the figures in docs/evaluation.md.

    python bench/decision_time.py

Policies on the InSS eight-model, four-device setup (examples/inss-scaled/eight-4.yaml with
the SCALED latency model): the one-time cost of the queueing tables, BDA per call on the
spread placement, and each policy's warm planning time (median of 3; a policy that finds
no plan for all eight models is timed to its failure, as the planner's first attempt). For
`inss` (with the trained rl/policies/inss-eight-4.pt) also its online decision alone (`inss.decide`:
BDA on the current placement, the actor's proposals judged, search's replica moves tried on the one deployed;
median of 50), and the same without the replica moves.
Simulator: requests simulated per second of wall time for the CPU demo's batch-1 plans
(the slowest case: one batch per request), the CPU split into quotas
(bench/results/cpu-demo/plan-spread.yaml) and in turns (plan-search.yaml: processor
sharing, two events per batch), at 1x and 10x their rates, with drops. Run it on a quiet
machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import load_plan
from tritonctl.planning.planner import demands_of, devices_of
from tritonctl.planning.policies import POLICIES, PlacementError, PolicyLimit
from tritonctl.planning.policies.bda import bda
from tritonctl.planning.policies.inss import decide, default_policy_file, load_trained
from tritonctl.planning.policies.spread import spread
from tritonctl.planning.simulate import simulate
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent


def timed(fn) -> float:
    started = time.perf_counter()
    try:
        fn()
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
    name = cluster.spec.name
    trained = load_trained(default_policy_file(name), name, [d.name for d in demands], devices)
    for name, info in POLICIES.items():
        fn = partial(info.fn, trained=trained) if info.trained else info.fn
        fn = partial(fn, log=lambda _: None) if info.logs else fn
        runs = [timed(lambda fn=fn: fn(demands, devices, lm)) for _ in range(3)]
        print(f"  {name:13} {statistics.median(runs):8.1f} ms")
    runs = [timed(lambda: decide(demands, devices, lm, trained)) for _ in range(50)]
    print(f"inss online decision (BDA, the actor's proposals judged), eight models: {statistics.median(runs):.2f} ms")
    inss_module = sys.modules[decide.__module__]
    grow = inss_module.grow_replicas
    inss_module.grow_replicas = lambda judge, placement: placement
    try:
        runs = [timed(lambda: decide(demands, devices, lm, trained)) for _ in range(50)]
    finally:
        inss_module.grow_replicas = grow
    print(f"  the same without search's replica moves: {statistics.median(runs):.2f} ms")
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

"""Simulator against the real local Triton: the same plan, the same Poisson rates.

    python bench/sim_vs_real.py [--duration 60] [--scales 1 2 3]

Plans the CPU demo cluster with the committed latency model, applies it on the real local
Triton, drives it with open-loop Poisson traffic from tritonclient.grpc at each rate scale,
replays the requests it sent (their send times) through the simulator, and prints goodput
and p99 side by side. The deployment is stopped at the end. Run it on a quiet machine: it
measures latency.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tritonctl.cli import main as tritonctl
from tritonctl.client import endpoints, run_load
from tritonctl.latency.model import load_latency_model
from tritonctl.plan import load_plan
from tritonctl.simulate import simulate

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "examples" / "cpu-demo" / "cluster.yaml"
MODEL = REPO / "profiles" / "cpu-demo" / "latency-model.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per rate scale")
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 2.0, 3.0], help="rate multipliers")
    args = parser.parse_args()
    plan_path = CLUSTER.parent / "plan.yaml"
    assert tritonctl(["plan", str(CLUSTER), "--latency-model", str(MODEL)]) == 0
    assert tritonctl(["apply", str(plan_path)]) == 0
    plan = load_plan(plan_path).plan
    lm = load_latency_model(MODEL)
    rows = []
    try:
        for scale in args.scales:
            real = {r.model: r for r in run_load(endpoints(plan), args.duration, scale)}
            # the simulator replays the very requests the real run sent, so both judge the same arrivals
            trace = {m: 1000.0 * np.array(sorted(r.sent_at_s)) for m, r in real.items()}
            sim = {m.model: m for m in simulate(plan, lm, args.duration, trace=trace).models}
            for name in real:
                r, s = real[name], sim[name]
                rows.append(
                    (
                        scale,
                        name,
                        r.within_slo * r.sent / args.duration,
                        s.good / args.duration,
                        r.percentile(99),
                        s.p99_ms,
                    )
                )
    finally:
        tritonctl(["down", str(plan_path)])
    head = f"{'scale':>5} {'model':14} {'goodput real':>12} {'sim':>8} {'gap':>7} {'p99 real ms':>11} {'sim':>8}"
    print(f"\n{head} {'gap':>7}")
    for scale, name, g_real, g_sim, p_real, p_sim in rows:
        print(
            f"{scale:5.1f} {name:14} {g_real:12.2f} {g_sim:8.2f} {100 * (g_sim / g_real - 1):+6.1f}% "
            f"{p_real:11.1f} {p_sim:8.1f} {100 * (p_sim / p_real - 1):+6.1f}%"
        )


if __name__ == "__main__":
    main()

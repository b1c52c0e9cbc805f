"""The best plan against the naive one on the real local Triton: goodput at the same Poisson rates.

    python bench/real_goodput.py [--duration 60] [--scales 1 3 4] [--policy search] [--reject-late]

For each rate scale, the CPU demo cluster is planned twice at its rates times the scale:
naively (`spread`: one instance per model, equal shares, batch 1, the skeleton's plan) and
with `--policy` on the committed latency model. Each plan is applied on the real Triton
in turn and driven by open-loop Poisson traffic from tritonclient.grpc; goodput is the
requests answered within their SLO per second. With `--reject-late`, both plans have Triton
reject a request that can no longer meet its SLO (`runtime.reject_late`); rejected requests
count as failed. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cpu_demo import CLUSTER, MODEL, REPO, applied

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import save_plan
from tritonctl.planning.planner import make_plan
from tritonctl.spec import load_cluster
from tritonctl.triton.client import endpoints, run_load

PLANS = REPO / ".tritonctl" / "real-goodput"


def goodput(plan_path: Path, duration_s: float) -> tuple[float, float, int]:
    """(goodput req/s, worst p99 ms, failed requests) of the plan applied on the real Triton."""
    with applied(plan_path) as loaded:
        results = run_load(endpoints(loaded.plan), duration_s)
    good = sum(r.within_slo * r.sent for r in results) / duration_s
    return good, max(r.percentile(99) for r in results), sum(len(r.errors) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per plan and scale")
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0, 4.0], help="rate multipliers")
    parser.add_argument("--policy", default="search", help="the plan to compare with the naive one")
    parser.add_argument("--reject-late", action="store_true", help="both plans reject requests that would be late")
    args = parser.parse_args()
    cluster = load_cluster(CLUSTER)
    artifacts = materialize(cluster, log=lambda _: None)
    lm = load_latency_model(MODEL)
    rows = []
    for scale in args.scales:
        scaled = cluster.with_rates(lambda m, k=scale: m.rate * k).with_runtime(reject_late=args.reject_late)
        measured = {}
        for policy in ("spread", args.policy):
            path = PLANS / f"plan-{policy}-x{scale:g}.yaml"
            plan = make_plan(scaled, artifacts, policy, path, lm, log=lambda _: None)
            save_plan(plan, path)
            measured[policy] = goodput(path, args.duration)
        rows.append((scale, sum(m.rate for m in scaled.spec.models), measured["spread"], measured[args.policy]))
        print(f"\n{'scale':>5} {'offered/s':>9} {'naive goodput':>13} {args.policy + ' goodput':>15} {'ratio':>6}")
        for scale_, offered, naive, best in rows:
            print(
                f"{scale_:5.1f} {offered:9.1f} {naive[0]:13.1f} {best[0]:15.1f} {best[0] / max(naive[0], 1e-9):6.2f}"
                f"   (p99 {naive[1]:.0f} / {best[1]:.0f} ms, failed {naive[2]} / {best[2]})",
                flush=True,
            )


if __name__ == "__main__":
    main()

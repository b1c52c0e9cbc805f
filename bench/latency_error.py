"""Robustness to a latency model that is off: SLO violations of the plans when every model runs up to 10%
slower or faster than predicted (`simulate --latency-error`), for the InSS setups.

    python bench/latency_error.py [--error 0.10] [--seeds 5] [--policies inss igniter search] [--margins 0 0.1]
        [--vectors N]

Each policy plans each setup once with the exact (SCALED) latency model, and once more per latency
margin (`tritonctl plan --latency-margin`: batches planned as if they ran 1 + margin times as long as
predicted); each plan is then simulated
60 s with drops, once per seed, every seed drawing a new fixed error per model uniformly in [-X, X].
Reported per setup and policy: SLO violations (late, dropped and never-served requests, those of
unserved models included, as `tritonctl bench` counts them) without errors, and their mean and worst
over the seeds with errors, and how many seeds miss more than 1% of requests: of all, of the plans that hold
without errors (missing less than 1% of their requests: an error can only add to what a plan beyond capacity
already misses), and those where the error itself costs more than a point (the draw's violations less
the plan's own without errors).

With `--vectors N`, each setup is planned at N rate vectors nobody picked instead of its own rates (every
model's rate times a draw in [0.5, 1.2], seeded as bench/inss_choice.py's held-out vectors), and the figures
are over all N plans: the exact violations' mean, and the mean, worst and count over 1% of the N x seeds
draws with errors.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from inss_choice import held_out_factors

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.compare import arrived_requests
from tritonctl.planning.planner import make_plan
from tritonctl.planning.simulate import simulate
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
SETUPS = ("six-4", "eight-4", "eight-5")
DURATION_S = 60.0
HELD = 0.01  # a plan missing less than this part of its requests without errors holds


def violations(plan, cluster, lm, seed: int, error: float) -> tuple[float, float]:
    """Simulated goodput and the share of requests not served within their SLO."""
    sim = simulate(plan, lm, DURATION_S, seed=seed, drop=True, latency_error=error)
    return sim.goodput, 1 - sum(m.good for m in sim.models) / max(1, arrived_requests(sim, plan, cluster))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--error", type=float, default=0.10, help="largest error per model (default 0.10)")
    parser.add_argument("--seeds", type=int, default=5, help="error draws per plan (default 5)")
    parser.add_argument("--policies", nargs="+", default=["inss", "igniter", "search"])
    parser.add_argument("--margins", nargs="+", type=float, default=[0.0], help="latency margins to plan with")
    parser.add_argument("--vectors", type=int, default=0, help="plan at this many drawn rate vectors per setup")
    args = parser.parse_args()
    lm = load_latency_model(REPO / "profiles/inss-scaled/latency-model.json")
    print(
        f"| setup | policy | margin | goodput, exact | violations, exact | with +-{100 * args.error:g}%: mean | worst "
        "| draws over 1% | plans that hold: draws over 1% | error costs over 1 point |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for setup in SETUPS:
        cluster = load_cluster(REPO / f"examples/inss-scaled/{setup}.yaml")
        artifacts = materialize(cluster, log=lambda _: None)
        clusters = rate_vectors(cluster, args.vectors) if args.vectors else [cluster]
        for policy in args.policies:
            for margin in args.margins:
                goodputs, exact, off = [], [], []  # off: (the plan's violations without errors, with a draw's)
                for workload in clusters:
                    plan = make_plan(
                        workload, artifacts, policy, Path("plan.yaml"), lm.with_margin(margin), log=lambda _: None
                    )
                    goodput, missed = violations(plan, workload, lm, 0, 0.0)
                    goodputs.append(goodput)
                    exact.append(missed)
                    off += [(missed, violations(plan, workload, lm, seed, args.error)[1]) for seed in range(args.seeds)]
                held = [v for missed, v in off if missed < HELD]
                print(
                    f"| {setup} | {policy} | {100 * margin:g}% | {statistics.mean(goodputs):.1f} | "
                    f"{100 * statistics.mean(exact):.2f}% | {100 * statistics.mean(v for _, v in off):.2f}% | "
                    f"{100 * max(v for _, v in off):.2f}% | {sum(v > 0.01 for _, v in off)} | "
                    f"{sum(v > 0.01 for v in held)} of {len(held)} | {sum(v - missed > 0.01 for missed, v in off)} |",
                    flush=True,
                )


def rate_vectors(cluster, count: int) -> list:
    """`count` copies of `cluster` at bench/inss_choice.py's held-out rate vectors (rates rounded to 0.001/s)."""
    names, out = [m.name for m in cluster.spec.models], []
    for factors in held_out_factors(count, len(names)):
        factor = dict(zip(names, factors, strict=True))
        out.append(cluster.with_rates(lambda m, factor=factor: round(m.rate * factor[m.name], 3)))
    return out


if __name__ == "__main__":
    main()

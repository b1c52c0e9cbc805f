"""Does ranking level proposals by the goodput with every model slower pick the plan that holds up when the
latency model is off? The scaled CPU InSS setups (SYNTHETIC), each at its own rates with its trained actor.

    python bench/level_proposals.py [--seeds 20] [--out bench/results/level-proposals.md] [--beyond]

For each setup, the actor's proposals that `inss.decide` counts as level (predicted to serve within
`inss.LEVEL` of the offered load of the best proposal, and as much as the current placement), each planned
alone by `inss` (with its batches and the replicas `search`'s moves add, as if it were the one deployed) and
simulated 60 s with a fixed +-10% error per model, `--seeds` draws (bench/latency_error.py): its predicted
goodput, its goodput with every model `inss.HEADROOM` slower (`inss.slower_judge`, what `inss` ranks level
proposals by), the mean and worst share of requests missed, and how many draws miss more than 1%. The one
`inss` deploys is marked. Simulation only, seeded: the figures do not depend on the CPU.

With `--beyond`, on each setup where the deployed plan misses more than 1% in some draw, also every placement
one of `search`'s moves away from the deployed one that is predicted level with it (within `inss.LEVEL` of the
offered load), each planned and simulated as above, and `optimal`'s plan: whether any plan near the deployed
one, or the predicted optimum, holds in every draw.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
from pathlib import Path

from latency_error import violations

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.planner import demands_of, devices_of, make_plan
from tritonctl.planning.policies.search import Judge, Spot, _neighbours, _work_and_floor
from tritonctl.spec import load_cluster

inss_module = importlib.import_module("tritonctl.planning.policies.inss")  # the package exports a function `inss`

REPO = Path(__file__).resolve().parent.parent
SETUPS = ("six-4", "eight-4", "eight-5")
ERROR = 0.10


def level_proposals(demands, devices, lm, trained) -> tuple[list[tuple[int, dict]], int | None]:
    """The actor's proposals (numbered from 1) that `decide` counts as level, and the number of the one it deploys
    (None where it deploys another placement)."""
    judge = Judge(demands, devices, lm)
    current = inss_module.current_placement(demands, devices, lm)
    theirs = judge({n: Spot(c.device, c.share) for n, c in current.items()})
    proposals = inss_module.proposals(trained, current, demands, devices, lm)
    judged = [(p, judge(p)) for p in proposals]
    window = inss_module.LEVEL * sum(d.rate for d in demands)
    level = [(proposals.index(p) + 1, p) for p, _ in inss_module.level_of(judged, theirs, window)]
    if inss_module.decide(demands, devices, lm, trained).source != "actor":
        return level, None
    pick = inss_module.most_robust([(p, judge(p)) for _, p in level], inss_module.slower_judge(judge))
    return level, level[pick][0]


def simulated(plan, cluster, lm, seeds: int) -> list[float]:
    """The share of requests `plan` misses in each of `seeds` error draws."""
    return [violations(plan, cluster, lm, seed, ERROR)[1] for seed in range(seeds)]


def beyond(setup: str, cluster, artifacts, demands, devices, trained, lm, seeds: int) -> list[str]:
    """Rows for the level neighbours of the deployed placement and for `optimal`'s plan (see the docstring). Each
    neighbour is planned as the one `decide` deploys (not proposed: `decide` would weigh it against the current
    placement)."""
    base, judge = inss_module.decide(demands, devices, lm, trained).placement, Judge(demands, devices, lm)
    slow = inss_module.slower_judge(judge)
    trained_decide = inss_module.decide
    work, floor = _work_and_floor(demands, devices, lm)
    bar = sum(judge(base).served.values()) - inss_module.LEVEL * sum(d.rate for d in demands)
    level = [n for n in _neighbours(base, devices, work, floor) if sum(judge(n).served.values()) >= bar]
    worst, held = [], 0
    for placement in level:
        fixed = inss_module.Decision(placement, "actor", "", inss_module.robust_choices(placement, judge, slow))
        inss_module.decide = lambda *_, fixed=fixed: fixed
        try:
            plan = make_plan(cluster, artifacts, "inss", Path("plan.yaml"), lm, log=lambda _: None)
        finally:
            inss_module.decide = trained_decide
        off = simulated(plan, cluster, lm, seeds)
        worst.append(max(off))
        held += max(off) <= 0.01
        print(f"  {setup} neighbour {len(worst)} of {len(level)}: worst draw {100 * max(off):.2f}%", flush=True)
    plan = make_plan(cluster, artifacts, "optimal", Path("plan.yaml"), lm, log=lambda _: None)
    off = simulated(plan, cluster, lm, seeds)
    return [
        f"| {setup} | {len(level)} level neighbours of the deployed placement | {held} | "
        f"{100 * min(worst, default=float('nan')):.2f}% |",
        f"| {setup} | optimal's plan | {int(max(off) <= 0.01)} | {100 * max(off):.2f}% "
        f"({sum(v > 0.01 for v in off)} draws over 1%) |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20, help="error draws per plan (default 20)")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/level-proposals.md")
    parser.add_argument("--beyond", action="store_true", help="also the deployed plan's level neighbours and optimal")
    args = parser.parse_args()
    lm = load_latency_model(REPO / "profiles/inss-scaled/latency-model.json")
    lines = [
        "# Level proposals of the trained actor under +-10% latency errors (SYNTHETIC scaled latency model)",
        "",
        f"`python bench/level_proposals.py --seeds {args.seeds}{' --beyond' if args.beyond else ''}`: simulation "
        "only, seeded; "
        f"{args.seeds} error draws per plan, 60 s each.",
        "",
        "| setup | proposal | deployed | predicted req/s | with every model 10% slower | violations with +-10%: mean "
        "| worst | draws over 1% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    missing = []  # the setups whose deployed plan misses more than 1% in a draw
    for setup in SETUPS:
        cluster = load_cluster(REPO / f"examples/inss-scaled/{setup}.yaml")
        artifacts = materialize(cluster, log=lambda _: None)
        demands, devices = demands_of(cluster, artifacts, lm), devices_of(cluster)
        name = cluster.spec.name
        trained = inss_module.load_trained(
            inss_module.default_policy_file(name), name, [d.name for d in demands], devices
        )
        level, chosen = level_proposals(demands, devices, lm, trained)
        judge = Judge(demands, devices, lm)
        slow = inss_module.slower_judge(judge)
        original = inss_module.proposals
        for k, placement in level:
            inss_module.proposals = lambda *_, placement=placement: [placement]
            try:
                plan = make_plan(cluster, artifacts, "inss", Path("plan.yaml"), lm, log=lambda _: None)
            finally:
                inss_module.proposals = original
            off = simulated(plan, cluster, lm, args.seeds)
            deployed = "yes" if k == chosen else ""
            if deployed and max(off) > 0.01:
                missing.append((setup, cluster, artifacts, demands, devices, trained))
            lines.append(
                f"| {setup} | {k} | {deployed} | {sum(judge(placement).served.values()):.1f} | "
                f"{sum(slow(placement).served.values()):.1f} | {100 * statistics.mean(off):.2f}% | "
                f"{100 * max(off):.2f}% | {sum(v > 0.01 for v in off)} |"
            )
            print(lines[-1], flush=True)
    if args.beyond and missing:
        lines += [
            "",
            f"`--beyond`: plans near the deployed one, and the optimum, on the setups where it misses more than 1% "
            f"in a draw ({args.seeds} draws each)",
            "",
            "| setup | plans | hold in every draw | the best one's worst draw |",
            "|---|---|---|---|",
        ]
        for row in missing:
            lines += beyond(*row, lm, args.seeds)
            print(*lines[-2:], sep="\n", flush=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()

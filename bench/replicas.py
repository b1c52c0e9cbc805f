"""Replicas across devices: `search` as it plans (a model served short of its rate may take a replica on
another device) beside `search` with one replica per model, judged by the latency model and by the simulator.

    python bench/replicas.py    # simulation only (no Triton); about 10 minutes on 2 cores

On the shipped setups (the InSS setups on the H100 profile and on the scaled CPU one, the CPU demo, the
four torchvision models) at 1, 1.25, 1.5, 2 and 3 times their rates, and on RANDOM rate vectors per InSS
setup that nobody picked (each model's rate its setup's x a draw uniform in 0.5-2.5, seeded): each
plan's goodput as `search` predicts it (requests/s within the SLOs) and as the simulator measures it
(SIM_S seconds, late requests dropped, SEEDS arrival seeds pooled), the latter on the plan's own latency
model: what the replicas buy where the latency model is right. Writes bench/results/replicas.md.
"""

from __future__ import annotations

import dataclasses
import statistics
from functools import partial
from pathlib import Path

import numpy as np

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.planner import make_plan
from tritonctl.planning.policies import POLICIES
from tritonctl.planning.policies.search import search
from tritonctl.planning.simulate import simulate
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
SETUPS = [
    *((f"examples/inss-gpu/{n}.yaml", "profiles/inss-gpu") for n in ("six-4", "eight-4", "eight-5")),
    *((f"examples/inss-scaled/{n}.yaml", "profiles/inss-scaled") for n in ("six-4", "eight-4", "eight-5")),
    ("examples/cpu-demo/cluster.yaml", "profiles/cpu-demo"),
    ("examples/torchvision-four/cluster.yaml", "profiles/torchvision-four"),
]
SCALES = (1.0, 1.25, 1.5, 2.0, 3.0)
RANDOM = 8  # rate vectors drawn per InSS setup
SIM_S, SEEDS = 20.0, (0, 1)
ONE = "search-one-replica"  # search with one replica per model, for this comparison only


def planned(cluster, artifacts, lm, policy: str, path: Path) -> tuple[float, float, int]:
    """(predicted goodput, simulated goodput, replicas beyond one per model) of `policy`'s plan."""
    plan = make_plan(cluster, artifacts, policy, path, lm, log=lambda _: None)
    predicted = sum(p.predicted.in_slo_rps for _, p in plan.instances())
    simulated = statistics.mean(simulate(plan, lm, SIM_S, seed=s, drop=True).goodput for s in SEEDS)
    extra = sum(len({p.device for p in m.placements}) - 1 for m in plan.models)
    return predicted, simulated, extra


def main() -> None:
    POLICIES[ONE] = dataclasses.replace(POLICIES["search"], fn=partial(search, replicas=False))
    rows = []
    for cluster_file, profile in SETUPS:
        base = load_cluster(REPO / cluster_file)
        lm = load_latency_model(REPO / profile / "latency-model.json")
        artifacts = materialize(base, log=lambda _: None)
        draws = [(f"x{s:g}", {m.name: s for m in base.spec.models}) for s in SCALES]
        if "inss" in cluster_file:
            rng = np.random.default_rng(sum(map(ord, cluster_file)))
            for k in range(RANDOM):
                draws.append((f"random {k}", {m.name: float(rng.uniform(0.5, 2.5)) for m in base.spec.models}))
        for label, factors in draws:
            cluster = base.with_rates(lambda m, f=factors: m.rate * f[m.name])
            one = planned(cluster, artifacts, lm, ONE, Path("/tmp/replicas-one.yaml"))
            many = planned(cluster, artifacts, lm, "search", Path("/tmp/replicas-many.yaml"))
            offered = sum(m.rate for m in cluster.spec.models)
            rows.append((cluster_file.removeprefix("examples/").removesuffix(".yaml"), label, offered, one, many))
            print(f"{rows[-1][0]:24} {label:9} predicted {one[0]:10,.1f} -> {many[0]:10,.1f}  "
                  f"simulated {one[1]:10,.1f} -> {many[1]:10,.1f}  replicas +{many[2]}", flush=True)  # fmt: skip
    write(rows)


def write(rows) -> None:
    lines = [
        "# Replicas across devices: search with them and with one replica per model",
        "",
        "`python bench/replicas.py` (simulation only: the plans' own latency models, "
        f"{SIM_S:g} simulated seconds, seeds {', '.join(map(str, SEEDS))} pooled, late requests dropped). "
        "Goodput in requests/s within the SLOs; `one` = one replica per model, `replicas` = as `search` plans.",
        "",
        "| setup | rates | offered | predicted one | predicted replicas | simulated one | simulated replicas "
        "| change (simulated) | replicas added |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for setup, label, offered, one, many in rows:
        change = (many[1] / one[1] - 1) if one[1] else 0.0
        lines.append(
            f"| {setup} | {label} | {offered:,.1f} | {one[0]:,.1f} | {many[0]:,.1f} | {one[1]:,.1f} | {many[1]:,.1f} "
            f"| {100 * change:+.1f}% | {many[2]} |"
        )
    changed = [r for r in rows if r[3] != r[4]]
    ratios = [r[4][1] / r[3][1] for r in changed if r[3][1]]
    lines += [
        "",
        f"Of {len(rows)} workloads, {len(changed)} are planned differently ({sum(r[4][2] > 0 for r in rows)} with "
        "replicas on several devices; the replica phase also climbs on from where the first one stopped); "
        "the rest plan as with one replica per model (every model served, or no better placement found).",
    ]
    if ratios:
        lines.append(
            f"Where planned differently, simulated goodput x{statistics.mean(ratios):.3f} on average "
            f"(x{min(ratios):.3f} to x{max(ratios):.3f}; higher on {sum(r > 1.001 for r in ratios)}, "
            f"lower on {sum(r < 0.999 for r in ratios)}), predicted by the plan x"
            f"{statistics.mean(r[4][0] / r[3][0] for r in changed):.3f} on average."
        )
    (REPO / "bench/results/replicas.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

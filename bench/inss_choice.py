"""Which placement `tritonctl plan --policy inss` deploys on the InSS setups, and why.

    python bench/inss_choice.py

At each setup's rates: BDA on spread's placement (the current one); where it fails, the
trained actor's proposal, and eq. 3's reward of both (the larger is deployed). Per model,
whether BDA finds a batch on the deployed placement. SYNTHETIC scaled latency model.
"""

from __future__ import annotations

from pathlib import Path

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planner import demands_of, devices_of
from tritonctl.policies.bda import bda
from tritonctl.policies.inss import PENALTY, default_policy_file, load_trained, outcome, peak_rps, propose
from tritonctl.policies.spread import spread
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    lm = load_latency_model(REPO / "profiles/inss-scaled/latency-model.json")
    for setup in ("six-4", "eight-4", "eight-5"):
        cluster = load_cluster(REPO / f"examples/inss-scaled/{setup}.yaml")
        demands = demands_of(cluster, materialize(cluster, log=lambda _: None), lm)
        devices = devices_of(cluster)
        current = {name: choices[0] for name, choices in spread(demands, devices, lm).items()}
        decision = bda(current, demands, devices, lm)
        if decision.ok:
            print(f"{setup}: BDA serves spread's placement; the actor is not asked")
            continue
        trained = load_trained(
            default_policy_file(cluster.spec.name), cluster.spec.name, [d.name for d in demands], devices
        )
        proposal = propose(trained.actor.act, trained.layout, current, decision, demands, lm)
        peak = peak_rps(demands, devices, lm)
        mine, theirs = (outcome(p, demands, devices, lm, peak, PENALTY) for p in (proposal, current))
        chosen = "the actor's" if mine.decision.ok or mine.reward >= theirs.reward else "spread's"  # as inss()
        print(
            f"{setup}: BDA fails on spread's placement ({', '.join(sorted(decision.infeasible))}); eq. 3: actor "
            f"{mine.reward:.2f} ({len(mine.decision.infeasible)} without a batch), spread {theirs.reward:.2f} "
            f"({len(theirs.decision.infeasible)} without a batch) -> {chosen} placement deployed"
        )


if __name__ == "__main__":
    main()

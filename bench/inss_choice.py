"""Which placement `tritonctl plan --policy inss` deploys on the InSS setups, and why.

    python bench/inss_choice.py

At each setup's rates: BDA on spread's placement (the current one); where it fails, the
trained actor's proposal, and eq. 3's reward of both (`inss.decide`, the larger is deployed).
SYNTHETIC scaled latency model.
"""

from __future__ import annotations

from pathlib import Path

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.planner import demands_of, devices_of
from tritonctl.planning.policies.inss import decide, default_policy_file, load_trained
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
WHOSE = {"actor": "the actor's", "current": "spread's"}


def main() -> None:
    lm = load_latency_model(REPO / "profiles/inss-scaled/latency-model.json")
    for setup in ("six-4", "eight-4", "eight-5"):
        cluster = load_cluster(REPO / f"examples/inss-scaled/{setup}.yaml")
        demands = demands_of(cluster, materialize(cluster, log=lambda _: None), lm)
        devices = devices_of(cluster)
        trained = load_trained(
            default_policy_file(cluster.spec.name), cluster.spec.name, [d.name for d in demands], devices
        )
        chosen = decide(demands, devices, lm, trained)
        if not chosen.judged:
            print(f"{setup}: BDA serves spread's placement; the actor is not asked")
            continue
        actor, current = chosen.judged["actor"], chosen.judged["current"]
        print(
            f"{setup}: BDA fails on spread's placement ({', '.join(sorted(current.decision.infeasible))}); eq. 3: "
            f"actor {actor.reward:.2f} ({len(actor.decision.infeasible)} without a batch), spread "
            f"{current.reward:.2f} ({len(current.decision.infeasible)} without a batch) -> {WHOSE[chosen.source]} "
            "placement deployed"
        )


if __name__ == "__main__":
    main()

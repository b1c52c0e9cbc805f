"""What the number of the actor's proposals buys: `inss`'s decision time against its goodput and how often it deploys
the actor's placement, on held-out rates.

    python bench/proposal_count.py [--setups eight-4 six-4 eight-5] [--counts 16 8 4 1] [--vectors 60] [--out FILE]
    python bench/proposal_count.py --setups eight-4 --policy-file rl/runs/inss-eight-4-finetune/policy.pt

For each InSS setup of examples/inss-scaled/ (SCALED latency model, SYNTHETIC) with its trained policy, and each
count of proposals (`inss.PROPOSALS`, 16 as shipped): `inss.decide` on `--vectors` held-out rate vectors (every
model's rate drawn in 0.5-1.2x, a fixed seed), its median decision time (warm, this machine), the goodput it is
predicted to serve (`search.Judge`) as a share of `search`'s on the same vector (mean and lowest), and on how many
vectors the actor's placement was deployed (a decision leaving a model unserved serves nothing, as in
bench/inss_choice.py, whose helpers this reads). `--policy-file` judges another actor of one setup (a fine-tuned
one, say). The counts are timed one after the other, not paired: compare them
within one run, on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from inss_choice import decided_served, decision, inss_module, served, timed

from tritonctl.latency.device import cpu_fingerprint
from tritonctl.latency.model import load_latency_model
from tritonctl.latency.queueing import warm_tables
from tritonctl.planning.planner import demands_of, devices_of
from tritonctl.planning.policies.search import climb
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
SEED = 20


def rows(setup: str, counts: list[int], vectors: int, policy_file: Path | None = None) -> list[str]:
    lm = load_latency_model(REPO / "profiles/inss-scaled/latency-model.json")
    cluster = load_cluster(REPO / f"examples/inss-scaled/{setup}.yaml")
    devices, base = devices_of(cluster), demands_of(cluster, {}, lm)
    name = cluster.spec.name
    policy_file = policy_file or inss_module.default_policy_file(name)
    trained = inss_module.load_trained(policy_file, name, [d.name for d in base], devices)
    warm_tables(32)
    decision(base, devices, lm, trained)  # torch's first call
    rng = np.random.default_rng(SEED)
    workloads = [[replace(d, rate=d.rate * x) for d, x in zip(base, rng.uniform(0.5, 1.2, len(base)), strict=True)]
                 for _ in range(vectors)]  # fmt: skip
    searched = [served(climb(demands, devices, lm)[0], demands, devices, lm) for demands in workloads]
    out = []
    for count in counts:
        times, shares, actor = [], [], 0
        for demands, theirs in zip(workloads, searched, strict=True):
            chosen, ms = timed(lambda demands=demands, count=count: decision(demands, devices, lm, trained, count))
            times.append(ms)
            shares.append(decided_served(chosen, demands, devices, lm) / theirs)
            actor += chosen is not None and chosen.source == "actor"
        out.append(
            f"| {setup} | {count} | {statistics.median(times):.1f} ms | {100 * np.mean(shares):.2f}% | "
            f"{100 * min(shares):.2f}% | {actor} of {vectors} |"
        )
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", nargs="+", default=["eight-4", "six-4", "eight-5"])
    parser.add_argument("--counts", nargs="+", type=int, default=[16, 8, 4, 1], help="proposals per decision")
    parser.add_argument("--vectors", type=int, default=60, help="held-out rate vectors per setup")
    parser.add_argument("--out", type=Path, help="write the table here too (markdown)")
    parser.add_argument("--policy-file", type=Path, help="with one setup: the actor to judge (default: rl/policies/)")
    args = parser.parse_args()
    if any(c < 1 for c in args.counts):
        parser.error("--counts must be 1 or more")
    if args.policy_file and len(args.setups) != 1:
        parser.error("--policy-file needs --setups naming one setup")
    cpu = cpu_fingerprint()
    head = [
        f"`python bench/proposal_count.py {' '.join(sys.argv[1:])}` ({cpu['model']}, "
        f"L1d {cpu['caches'].get('L1 Data')}, CPU id {cpu['id']}; SYNTHETIC setups on the SCALED latency model)",
        "",
        "| setup | proposals | median decision | goodput / search's, mean | lowest | actor's placement deployed |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    table = [row for setup in args.setups for row in rows(setup, args.counts, args.vectors, args.policy_file)]
    if args.out:
        args.out.write_text("\n".join([*head, *table]) + "\n")


if __name__ == "__main__":
    main()

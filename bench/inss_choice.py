"""Where the trained `inss` actor decides, and how close its placements come to `search`'s, on every setup with one.

    python bench/inss_choice.py [--workloads 100] [--out bench/results/inss-choice.md]
    python bench/inss_choice.py --setup cpu-demo --policy-file rl/runs/cpu-demo-sac/policy.pt --out OUT

Setups: the CPU demo, the InSS setups on the scaled CPU profile (SYNTHETIC) and on the H100
profile, each with its actor in rl/policies/. For each:

- at the setup's own rates: whose placement `inss` deploys (`inss.decide`) and why, and the
  goodput it is predicted to serve (`search.Judge`) beside search's and the optimum's; and
  whose placement it deploys with the actor's greedy proposal alone, and its goodput;
- on `--workloads` held-out rate vectors (every model's rate drawn uniformly in 0.5-1.2x its
  own, from a seed training never used, all models present): the mean and the lowest of inss's
  predicted goodput as a share of search's on the same vector, the same with the actor's greedy
  placement alone (one proposal instead of `inss.PROPOSALS`), how often the actor's placement
  was deployed, and the median planning time of `inss` and `search` (warm, this machine).
A decision whose placement leaves some model unserved (the planner would shed one and decide again)
counts as serving nothing.

`--setup NAME --policy-file FILE` judges another actor of one setup (the SAC-Discrete one, say).
Run it on a quiet machine: the times are wall times.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from tritonctl.latency.device import cpu_fingerprint
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.planner import demands_of, devices_of
from tritonctl.planning.policies import POLICIES, PlacementError
from tritonctl.planning.policies.search import TURNS, Judge, Placement, Spot, climb, replica_key
from tritonctl.spec import Cluster, load_cluster

inss_module = importlib.import_module("tritonctl.planning.policies.inss")  # the package exports a function `inss`

REPO = Path(__file__).resolve().parent.parent
SETUPS = [
    ("examples/cpu-demo/cluster.yaml", "profiles/cpu-demo/latency-model.json"),
    *(
        (f"examples/inss-scaled/{s}.yaml", "profiles/inss-scaled/latency-model.json")
        for s in ("six-4", "eight-4", "eight-5")
    ),
    *((f"examples/inss-gpu/{s}.yaml", "profiles/inss-gpu/latency-model.json") for s in ("six-4", "eight-4", "eight-5")),
]
SEED = 20_261_126  # held-out workloads: training draws its own from seeds (seed, d)


def served(placement, demands, devices, lm) -> float:
    return sum(Judge(demands, devices, lm)(placement).served.values())


def decision(demands, devices, lm, trained, proposals: int | None = None):
    """`inss.decide` (with `proposals` of the actor's at most, where given); None where its placement leaves a model
    unserved (the planner would shed one and decide again)."""
    default = inss_module.PROPOSALS
    inss_module.PROPOSALS = proposals or default
    try:
        return inss_module.decide(demands, devices, lm, trained)
    except PlacementError:
        return None
    finally:
        inss_module.PROPOSALS = default


def decided_served(chosen, demands, devices, lm) -> float:
    """What the placement a decision deploys is predicted to serve; 0 where it found none serving every model."""
    return 0.0 if chosen is None else served(chosen.placement, demands, devices, lm)


def _source(chosen) -> str:
    return "none serving every model" if chosen is None else chosen.source


def timed(fn):
    """(what `fn` returns, None where it finds no placement serving every model; its wall time in ms)."""
    started = time.perf_counter()
    try:
        out = fn()
    except PlacementError:
        out = None
    return out, 1000 * (time.perf_counter() - started)


def as_placement(choices: dict) -> Placement:
    """A policy's plan as search's placement: per model a replica a device, its instances there as copies."""
    out = {}
    for name, chosen in choices.items():
        for k, device in enumerate(dict.fromkeys(c.device for c in chosen)):
            here = [c for c in chosen if c.device == device]
            out[replica_key(name, k)] = Spot(device, TURNS if here[0].turns else here[0].share, len(here))
    return out


def held_out_factors(count: int, models: int) -> list[np.ndarray]:
    """`count` held-out rate vectors, each model's rate factor drawn uniformly in [0.5, 1.2] (seeded)."""
    rng = np.random.default_rng(SEED)
    return [rng.uniform(0.5, 1.2, models) for _ in range(count)]


def setup_rows(cluster: Cluster, lm_file: str, workloads: int, policy_file: Path | None) -> tuple[str, str]:
    lm = load_latency_model(REPO / lm_file)
    devices, demands = devices_of(cluster), demands_of(cluster, {}, lm)
    name = cluster.spec.name
    path = policy_file or inss_module.default_policy_file(name)
    trained = inss_module.load_trained(path, name, [d.name for d in demands], devices)
    chosen = decision(demands, devices, lm, trained)
    search_placement, _ = climb(demands, devices, lm)
    optimum = POLICIES["optimal"].fn(demands, devices, lm, log=lambda _: None)
    optimal_placement = as_placement(optimum)
    mine, theirs = decided_served(chosen, demands, devices, lm), served(search_placement, demands, devices, lm)
    best = served(optimal_placement, demands, devices, lm)
    alone = decision(demands, devices, lm, trained, proposals=1)
    alone_share = decided_served(alone, demands, devices, lm) / theirs
    at_rates = (
        f"| {name} | {_source(chosen)} | {mine:,.1f} | {theirs:,.1f} | {best:,.1f} | {100 * mine / theirs:.2f}% | "
        f"{100 * mine / best:.2f}% | {_source(alone)}, {100 * alone_share:.2f}% | {chosen.why if chosen else ''} |"
    )
    shares, greedy, actor, inss_ms, search_ms = [], [], 0, [], []
    plan_inss = partial(POLICIES["inss"].fn, trained=trained, log=lambda _: None)
    for factors in held_out_factors(workloads, len(demands)):
        drawn = [replace(d, rate=d.rate * f) for d, f in zip(demands, factors, strict=True)]
        chosen, _ = timed(lambda drawn=drawn: decision(drawn, devices, lm, trained))
        _, ms = timed(lambda drawn=drawn: plan_inss(drawn, devices, lm))
        inss_ms.append(ms)
        (placement, _), ms = timed(lambda drawn=drawn: climb(drawn, devices, lm))
        search_ms.append(ms)
        reference = served(placement, drawn, devices, lm) or 1.0
        shares.append(decided_served(chosen, drawn, devices, lm) / reference)
        actor += chosen is not None and chosen.source == "actor"
        alone = decision(drawn, devices, lm, trained, proposals=1)
        greedy.append(decided_served(alone, drawn, devices, lm) / reference)
    held_out = (
        f"| {name} | {workloads} | {100 * np.mean(shares):.2f}% | {100 * min(shares):.1f}% | "
        f"{sum(s >= 0.98 for s in shares)} | {100 * np.mean(greedy):.2f}% | {actor} | "
        f"{statistics.median(inss_ms):.1f} | {statistics.median(search_ms):.1f} |"
    )
    return at_rates, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=int, default=100, help="held-out rate vectors per setup (default 100)")
    parser.add_argument("--out", default=str(REPO / "bench/results/inss-choice.md"), help="the table (markdown)")
    parser.add_argument("--setup", help="only the setup of this cluster name")
    parser.add_argument("--policy-file", type=Path, help="with --setup: the actor to judge (default: rl/policies/)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    setups = [(load_cluster(REPO / c), m) for c, m in SETUPS]
    setups = [(c, m) for c, m in setups if args.setup in (None, c.spec.name)]
    if args.policy_file and len(setups) != 1:
        parser.error("--policy-file needs --setup naming one setup")
    rows = [setup_rows(c, m, args.workloads, args.policy_file) for c, m in setups]
    for row in rows:
        print(*row, sep="\n")
    command = " ".join(["python bench/inss_choice.py", *sys.argv[1:]])
    cpu = cpu_fingerprint()
    cpu = (
        f"{cpu['model']}, L1d {cpu['caches'].get('L1 Data')} / L2 {cpu['caches'].get('L2 Unified')}, CPU id {cpu['id']}"
    )
    text = "\n".join(
        [
            f"# inss against search, predicted goodput (`{command}`; {cpu}, one torch thread)",
            "",
            "The inss-* setups on profiles/inss-scaled are SYNTHETIC.",
            "",
            "## At each setup's own rates",
            "",
            "| setup | deployed | inss req/s | search req/s | optimal req/s | inss of search | inss of optimal | "
            "greedy proposal alone: deployed, of search | why |",
            "|---|---|---|---|---|---|---|---|---|",
            *(r[0] for r in rows),
            "",
            f"## Held-out rate vectors (each model 0.5-1.2x its rate, seed {SEED})",
            "",
            "| setup | vectors | inss of search, mean | lowest | vectors at >= 98% | greedy proposal alone, mean | "
            "actor's placement deployed | inss ms (median) | search ms (median) |",
            "|---|---|---|---|---|---|---|---|---|",
            *(r[1] for r in rows),
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()

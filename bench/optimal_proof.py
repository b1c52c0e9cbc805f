"""The `optimal` policy on every shipped example: its goodput, the bound it proved, the gap and the time, beside
what `search`'s plan serves.

    python bench/optimal_proof.py [--out bench/results/optimal.md] [--time-limit 300] [--rows N ...]
        [--max-replicas 8]

Each example with the latency model it is benchmarked with (the CPU demo with its committed
profile, the InSS setups with the H100 profile and the SCALED CPU profile, whose setups are
SYNTHETIC), at its own rates; then the H100 setups at the higher rates where `search` splits
models into replicas across GPUs (bench/results/replicas.md) and serves some in part, so that
the optimum is seen with them. Goodput here is what the latency model predicts (requests/s
within the SLOs), as search judges a plan (`search.Judge`): the best plan's (the solver starts from
search's and says whose it returns), and search's own as a share of the bound, which no plan
of search's space exceeds. Run it on a quiet machine; it says which CPU.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from tritonctl.export import materialize
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.planner import demands_of, devices_of, reserve_for_requests
from tritonctl.planning.policies.search import climb
from tritonctl.spec import load_cluster

solver = importlib.import_module("tritonctl.planning.policies.optimal")  # the package exports the function
ROOT = Path(__file__).resolve().parent.parent
GPU = "profiles/inss-gpu/latency-model.json"
SETUPS = [  # cluster, latency model, rate scale
    ("examples/cpu-demo/cluster.yaml", "profiles/cpu-demo/latency-model.json", 1),
    ("examples/torchvision-four/cluster.yaml", "profiles/torchvision-four/latency-model.json", 1),
    *((f"examples/inss-gpu/{s}.yaml", GPU, 1) for s in ("six-4", "eight-4", "eight-5")),
    ("examples/inss-gpu/cluster.yaml", GPU, 1),
    *(
        (f"examples/inss-scaled/{s}.yaml", "profiles/inss-scaled/latency-model.json", 1)
        for s in ("six-4", "eight-4", "eight-5")
    ),
    ("examples/inss-gpu/six-4.yaml", GPU, 1.5),
    ("examples/inss-gpu/six-4.yaml", GPU, 3),
    ("examples/inss-gpu/eight-5.yaml", GPU, 1.5),
]


def replicas(choices: dict) -> str:
    """The models placed on more than one device, with how many."""
    return ", ".join(f"{n} x{len(d)}" for n, cs in choices.items() if len(d := {c.device for c in cs}) > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/optimal.md")
    parser.add_argument("--time-limit", type=float, default=solver.TIME_LIMIT_S)
    parser.add_argument("--rows", nargs="+", type=int, help="only these rows of the table (1 = the first setup)")
    parser.add_argument("--max-replicas", type=int, default=solver.MAX_REPLICAS, help="devices a model may span")
    args = parser.parse_args()
    cpu = cpu_fingerprint()
    lines = [
        f"CPU: {cpu['model']}, {cpu['caches'].get('L1 Data', '?')} L1d / {cpu['caches'].get('L2 Unified', '?')} L2, "
        f"{cpu['logical_cpus']} logical CPUs, id {cpu['id']}",
        "",
        "| cluster | latency model | rates | models x devices | optimal goodput | bound | gap | status | solve s "
        "| plan | replicas (models split across devices) | search's goodput | search of bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cluster_file, model_file, scale in [s for k, s in enumerate(SETUPS, 1) if not args.rows or k in args.rows]:
        cluster = load_cluster(ROOT / cluster_file).with_rates(lambda m, scale=scale: m.rate * scale)
        lm = load_latency_model(ROOT / model_file)
        artifacts = materialize(cluster, log=lambda _: None)
        planned = reserve_for_requests(cluster, lm, lambda _: None, None) if cluster.kind == "cpu" else cluster
        demands, devices = demands_of(planned, artifacts, lm), devices_of(planned)  # the cores make_plan plans with
        outcome = solver.solve(demands, devices, lm, args.time_limit, max_replicas=args.max_replicas)
        placement, judge = climb(demands, devices, lm)
        searched = sum(judge(placement).served.values())
        row = (
            f"| {cluster_file} | {model_file} | x{scale:g} | {len(demands)} x {len(devices)} | {outcome.goodput:.2f} | "
            f"{outcome.bound:.2f} | {100 * outcome.gap:.2f}% | {outcome.status} | {outcome.seconds:.1f} | "
            f"{'search' if outcome.searched else 'solver'} | {replicas(outcome.choices) or '-'} | {searched:.2f} | "
            f"{100 * searched / outcome.bound:.1f}% |"
        )
        print(row, flush=True)
        lines.append(row)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()

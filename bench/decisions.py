"""Record what `inss` and `search` decide on every setup with a trained actor, to check that a change meant to
make deciding faster decides the same.

    python bench/decisions.py record OUT.json [--vectors 40] [--search 5]
    python bench/decisions.py compare A.json B.json

`record`: for each setup of bench/inss_choice.py (the CPU demo, the InSS setups on the scaled
CPU profile, SYNTHETIC, and on the H100 profile), `inss.decide` at the setup's own rates and at
`--vectors - 1` rate vectors drawn in 0.5-1.2x (a fixed seed): the placement, whose it is, why,
and every choice (device, share, batch, queue delay, weight); `search`'s choices at the first
`--search`. `compare`: the decisions two records differ in, exit 1 where any does. Record with each
version of the code (a git worktree of the other commit, the same script) and compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from inss_choice import SETUPS

from tritonctl.latency.model import load_latency_model
from tritonctl.planning.planner import demands_of, devices_of
from tritonctl.planning.policies import PlacementError
from tritonctl.planning.policies.inss import decide, default_policy_file, load_trained
from tritonctl.planning.policies.search import search
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
SEED = 7


def _choices(choices: dict) -> dict[str, list[str]]:
    return {model: [repr(c) for c in cs] for model, cs in choices.items()}


def record(vectors: int, with_search: int) -> dict[str, list]:
    out = {}
    for cluster_file, model_file in SETUPS:
        lm, cluster = load_latency_model(REPO / model_file), load_cluster(REPO / cluster_file)
        devices, base = devices_of(cluster), demands_of(cluster, {}, lm)
        name = cluster.spec.name
        trained = load_trained(default_policy_file(name), name, [d.name for d in base], devices)
        rng = np.random.default_rng(SEED)
        for k in range(vectors):
            scale = rng.uniform(0.5, 1.2, len(base)) if k else np.ones(len(base))
            demands = [replace(d, rate=d.rate * x) for d, x in zip(base, scale, strict=True)]
            try:
                chosen = decide(demands, devices, lm, trained)
                row = [sorted(chosen.placement.items()), chosen.source, chosen.why, _choices(chosen.choices)]
            except PlacementError as exc:
                row = ["refused", str(exc)]
            if k < with_search:
                try:
                    row.append(_choices(search(demands, devices, lm)))
                except PlacementError as exc:
                    row.append(str(exc))
            out[f"{name}/{k}"] = json.loads(json.dumps(row, default=str))
        print(f"{name}: {vectors} decisions", file=sys.stderr)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record every setup's decisions to a JSON file")
    rec.add_argument("out", type=Path)
    rec.add_argument("--vectors", type=int, default=40, help="rate vectors per setup, its own rates first")
    rec.add_argument("--search", type=int, default=5, help="of those, how many also record search's plan")
    cmp = sub.add_parser("compare", help="the decisions two records differ in")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        args.out.write_text(json.dumps(record(args.vectors, args.search), indent=1))
        return 0
    a, b = (json.loads(p.read_text()) for p in (args.a, args.b))
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    for key in differ:
        print(f"{key}: differs")
    print(f"{len(differ)} of {len(a.keys() | b.keys())} decisions differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

"""Clusters nobody tuned for: models, SLOs and rates drawn at random over a profiled set of models.

    python bench/random_clusters.py BASE_CLUSTER --latency-model LM --out DIR [--count 3] [--seed 0]

Each cluster takes 3 to all of BASE_CLUSTER's models (its exports, so the latency model made on this
CPU covers them), an SLO per model of 3-8x its batch-1 latency with the whole device, and rates that put
a load of 0.3-1.0 on the machine (the device-seconds per second its requests take at batch 1 with the
whole device, split between the models by a flat Dirichlet draw). The draws are seeded; the files and
a table of what was drawn go to DIR.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import yaml

from tritonctl.latency.model import load_latency_model
from tritonctl.spec import load_cluster


def draw(base: dict, lm, rng: np.random.Generator, name: str) -> tuple[dict, float]:
    """One cluster drawn from `base` (a cluster file's content); returns it and the load it puts on the machine."""
    models = base["models"]
    k = int(rng.integers(3, len(models) + 1))
    chosen = [models[i] for i in sorted(rng.choice(len(models), size=k, replace=False))]
    units = base["devices"][0]["units"]
    alone_ms = {m["name"]: lm.t_inf(m["name"], 1, units) for m in chosen}
    load = float(rng.uniform(0.3, 1.0))
    split = rng.dirichlet(np.ones(k))
    drawn = []
    for m, part in zip(chosen, split, strict=True):
        slo = round(float(rng.uniform(3, 8)) * alone_ms[m["name"]])
        rate = round(1000 * load * float(part) / alone_ms[m["name"]], 1)
        drawn.append({**m, "slo_ms": slo, "rate": max(rate, 0.5)})
    return {**base, "name": name, "models": drawn}, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path)
    parser.add_argument("--latency-model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base_cluster = load_cluster(args.base)
    base = yaml.safe_load(args.base.read_text())
    runtime = base_cluster.spec.runtime
    lm = load_latency_model(args.latency_model)
    rng = np.random.default_rng(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["| cluster | load | models (SLO ms, req/s) |", "|---|---|---|"]
    for i in range(args.count):
        name = f"random-{args.seed}-{i}"
        cluster, load = draw(base, lm, rng, name)
        here = args.out.resolve()
        cluster["runtime"] = {  # the base's folders as seen from the new file, named after it; ports of its own
            "repository_dir": os.path.relpath(base_cluster.resolve(runtime.repository_dir).with_name(name), here),
            "export_dir": os.path.relpath(base_cluster.resolve(runtime.export_dir), here),
            "state_dir": os.path.relpath(base_cluster.resolve(runtime.state_dir).with_name(name), here),
            "base_port": runtime.base_port + 10 * (i + 1),
        }
        (args.out / f"{name}.yaml").write_text(
            "# Drawn by bench/random_clusters.py (seeded): not tuned by hand.\n"
            + yaml.safe_dump(cluster, sort_keys=False)
        )
        models = ", ".join(f"{m['name']} ({m['slo_ms']}, {m['rate']})" for m in cluster["models"])
        lines.append(f"| {name} | {load:.2f} | {models} |")
    (args.out / "clusters.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

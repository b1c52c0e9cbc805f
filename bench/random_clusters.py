"""Clusters nobody tuned for: models, SLOs and rates drawn at random from a pool of torchvision models.

    python bench/random_clusters.py --out DIR [--count 3] [--seed 0] [--pool NAME ...] [--base-port 8300]
        [--load-threads 1]

Each cluster takes 3 to 6 models of the pool (torchvision architectures with seeded random weights, all
light enough for a 2-core CPU), exported to ONNX by tritonctl. Each model's batch-1 latency alone on the
CPU is measured here with onnxruntime (the median of 20 runs, `inss_scaled.measure_ms`), on 2 threads and
on 1; its SLO is drawn at 8-20x the 2-thread time (`SLO_TIMES`), and the rates put a load of 0.3-1.0 on
the machine's cores: the CPU-seconds per second the requests take at their 1-thread time (what one
inference costs a core, not counting the server around it), divided by the cores and split between the
models by a flat Dirichlet draw. With `--load-threads 2` the load is counted by the 2-thread time over
the whole machine instead (about half the CPU the requests take: such clusters ask more than the cores
hold). The draws are seeded; the cluster files, a table of what was drawn and `pool.yaml` (the whole
pool, exported) go to DIR. Profile each cluster from scratch before planning it (`tritonctl profile`,
`tritonctl fit`), then measure it with bench/real_load.py.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import yaml
from inss_scaled import measure_ms

from tritonctl.export import materialize
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.spec import load_cluster

POOL = (
    "mobilenet_v2",
    "mnasnet1_0",
    "efficientnet_b0",
    "resnet18",
    "mobilenet_v3_large",
    "shufflenet_v2_x1_0",
    "squeezenet1_1",
    "regnet_y_400mf",
)
REPO = Path(__file__).resolve().parent.parent
# An SLO's multiple of the batch-1 latency on both cores. At 3-8x no deployment served any drawn cluster even at
# a tenth of its rates: taking turns, a model runs on one thread (1.5-2x as long), and each request also
# waits for the server's front end, the proxy and the wake-up of an idle instance (2-4 ms on this CPU).
SLO_TIMES = (8, 20)


def draw(
    pool: list[str], two: dict[str, float], cost: dict[str, float], cores: int, rng: np.random.Generator
) -> tuple[list[dict], float]:
    """Models, SLOs and rates of one cluster from each model's batch-1 time on two threads (ms) and the
    core-milliseconds `cost` of one request on `cores`; returns its models and the load they put on them."""
    k = int(rng.integers(3, min(6, len(pool)) + 1))
    chosen = [pool[i] for i in sorted(rng.choice(len(pool), size=k, replace=False))]
    load = float(rng.uniform(0.3, 1.0))
    split = rng.dirichlet(np.ones(k))
    models = []
    for name, part in zip(chosen, split, strict=True):
        slo = round(float(rng.uniform(*SLO_TIMES)) * two[name])
        rate = max(0.5, round(1000 * cores * load * float(part) / cost[name], 1))
        models.append({"name": name, "source": name, "input": {"shape": [3, 224, 224]}, "slo_ms": slo, "rate": rate})
    return models, load


def cluster_file(name: str, models: list[dict], out: Path, base_port: int) -> dict:
    here = out.resolve()
    return {
        "name": name,
        "devices": [{"kind": "cpu", "count": 1, "cores": os.cpu_count() or 1, "units": 100, "memory_mb": 8192}],
        "models": models,
        "runtime": {
            "repository_dir": os.path.relpath(REPO / "model_repository" / name, here),
            "export_dir": os.path.relpath(REPO / "model_repository" / "exports", here),
            "state_dir": os.path.relpath(REPO / ".tritonctl" / name, here),
            "base_port": base_port,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool", nargs="+", default=list(POOL), help="torchvision architectures to draw from")
    parser.add_argument("--base-port", type=int, default=8300, help="cluster i's models listen from here + 10 i")
    parser.add_argument(
        "--load-threads",
        type=int,
        choices=(1, 2),
        default=1,
        help="count the load by each model's time on 1 thread over the cores (default), or on 2 over the machine",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pool = [{"name": n, "source": n, "input": {"shape": [3, 224, 224]}, "slo_ms": 1000, "rate": 1} for n in args.pool]
    (args.out / "pool.yaml").write_text(yaml.safe_dump(cluster_file("pool", pool, args.out, args.base_port - 10)))
    artifacts = materialize(load_cluster(args.out / "pool.yaml"))
    two, one = ({n: measure_ms(artifacts[n].path, 1, 20, threads=k) for n in args.pool} for k in (2, 1))
    cores = os.cpu_count() or 1
    cost, over = (one, cores) if args.load_threads == 1 else (two, 1)
    rng = np.random.default_rng(args.seed)
    cpu = cpu_fingerprint()
    lines = [
        f"CPU: {cpu['model']} (id {cpu['id']}), {cores} cores",
        "Batch-1 latency alone, onnxruntime on 2 / 1 threads (ms): "
        + ", ".join(f"{n} {two[n]:.1f} / {one[n]:.1f}" for n in args.pool),
        "",
        "| cluster | load | models (SLO ms, req/s) |",
        "|---|---|---|",
    ]
    for i in range(args.count):
        name = f"random-{args.seed}-{i}"
        models, load = draw(args.pool, two, cost, over, rng)
        (args.out / f"{name}.yaml").write_text(
            "# Drawn by bench/random_clusters.py (seeded): not tuned by hand.\n"
            + yaml.safe_dump(cluster_file(name, models, args.out, args.base_port + 10 * i), sort_keys=False)
        )
        listed = ", ".join(f"{m['name']} ({m['slo_ms']}, {m['rate']})" for m in models)
        lines.append(f"| {name} | {load:.2f} | {listed} |")
    (args.out / "clusters.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Which threads `search` gives instances taking turns with a CPU where a cluster leaves `turn_threads` unset.

    python bench/turn_threads_choice.py [--out bench/results/turn-threads-choice.md]

The five clusters bench/priority.sh measured with `turn_threads: even` and `lightest` side by side (their latency
models calibrated on the 32 KB L1d EPYC VM, 1x their reference load there), at 1-4x: per scale, each setting's plan
as `tritonctl plan` makes it (simulated goodput within the SLOs, the models predicted to miss) and which one
`planner.simulated_plan` keeps. Then the demo on the calibration `make demo` made on the 32 KB L1d EPYC VM (CPU id
d91040252a88; bench/results/demo-threads), at the scales `tritonctl demo` tries, with the demo's margin: what it
deploys there. Planning and simulation only, seeded: nothing is measured.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tritonctl.cli.demo import demo_margin
from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.planner import (
    models_predicted_to_miss,
    search_with_copies,
    servable_scale,
    simulated_goodput,
    simulated_plan,
)
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
CLUSTERS = ("random-0-1", "random-0-0", "random-0-2", "torchvision-four", "cpu-demo")
SCALES = (1, 2, 3, 4)
DEMO_CALIBRATION = REPO / "bench/results/demo-threads/latency-model-calibrated.json"


def row(cluster, artifacts, lm, scale: float) -> str:
    scaled = cluster.with_rates(lambda m: m.rate * scale)
    plans = {
        t: search_with_copies(scaled.with_turn_threads(t), artifacts, cluster.path, lm, lambda _: None)
        for t in ("even", "lightest")
    }
    kept = simulated_plan(scaled, artifacts, "search", cluster.path, lm, log=lambda _: None)
    offered = sum(m.rate for m in scaled.spec.models)
    cells = []
    for p in plans.values():
        missed = models_predicted_to_miss(p) + [f"{u.name} unserved" for u in p.unserved]
        cells.append(f"{simulated_goodput(p):.2f} ({', '.join(missed) or 'none'})")
    return f"| {scale:g} | {offered:.2f} | {' | '.join(cells)} | {kept.devices[0].turn_threads} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/turn-threads-choice.md")
    args = parser.parse_args()
    head = (
        "| scale | offered req/s | even: simulated req/s within the SLOs (predicted to miss) | lightest: the same "
        "| kept |\n|---|---|---|---|---|"
    )
    lines = [
        "# turn_threads chosen by `search` (python bench/turn_threads_choice.py; planning and simulation only)",
        "",
    ]
    for name in CLUSTERS:
        folder = REPO / "bench/results/overload" / name
        cluster = load_cluster(folder / "cluster.yaml")
        artifacts = materialize(cluster, log=lambda _: None)
        lm = load_latency_model(folder / "latency-model-calibrated.json")
        lines += [f"## {name} (bench/results/overload/{name}, 1x its reference load)", "", head]
        lines += [row(cluster, artifacts, lm, s) for s in SCALES]
        lines.append("")
        print(f"{name} done", flush=True)
    demo = load_cluster(REPO / "examples/cpu-demo/cluster.yaml")
    artifacts = materialize(demo, log=lambda _: None)
    lm = load_latency_model(DEMO_CALIBRATION)
    margin = demo_margin(lm.meta)
    lm = lm.with_margin(margin)
    scale = servable_scale(demo, artifacts, lm, "search")
    lines += [
        f"## The demo on the 32 KB L1d EPYC VM's calibration ({DEMO_CALIBRATION.relative_to(REPO)}), "
        f"{100 * margin:.0f}% margin",
        "",
        f"`tritonctl demo` deploys {scale:g}x there (the largest multiple of 0.05 predicted and simulated within "
        "every SLO). At its scales:",
        "",
        head.replace("| scale | offered", "| x the demo's rates | offered"),
    ]
    lines += [row(demo, artifacts, lm, s) for s in (0.05, 0.1, 0.15, 0.2, 0.25)]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()

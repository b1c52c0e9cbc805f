"""Goodput against offered load, beyond what the plan serves, with and without refusing late requests.

    python bench/overload.py CLUSTER --latency-model LM --out DIR [--rate-scale S] [--scales 0.5 1 2 3]
        [--duration 15] [--deployments naive-serveall naive best-serveall best] [--offline]

1x is the cluster's rates times S: by default the largest multiple of 0.05 at which `search` plans every
model within its SLO on this CPU by LM (profiled or calibrated here), in eq. 2 and in simulation
(`planner.servable_scale`); written as DIR/cluster.yaml.
bench/real_load.py then loads each deployment at every scale of that, with tritonctl's client only:
perf_analyzer stops at the first refused request, and overloaded instances refuse what can only be late
(runtime.reject_late, on by default; the `-serveall` deployments serve every request, however late).
Writes DIR/overload.md (per deployment the capacity, goodput at every scale, and the slowest model's p99)
and DIR/goodput.png, beside real_load's results.json and summary.md; with `--offline`, only those two, from
DIR/results.json. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from cpu_demo import REPO
from matplotlib.figure import Figure
from real_load import Row, capacity

from tritonctl.export import materialize
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.planner import servable_scale
from tritonctl.spec import load_cluster


def sized_cluster(cluster_path: Path, lm_path: Path, out: Path, scale: float | None) -> tuple[Path, float]:
    """The cluster at `scale` x its rates (None: those `search` serves on this CPU), written to out/cluster.yaml,
    and the scale."""
    if scale is None:
        cluster = load_cluster(cluster_path)
        scale = servable_scale(cluster, materialize(cluster, log=print), load_latency_model(lm_path), "search")
        if scale == 0:
            raise SystemExit(f"{cluster_path}: search serves none of 0.05-1x its rates on this CPU by {lm_path}")
        chosen = f"what search serves on {cpu_fingerprint()['model']} by {lm_path.name}"
    else:
        chosen = "given as --rate-scale"
    spec = yaml.safe_load(cluster_path.read_text())
    name = f"{spec['name']}-overload"
    spec["name"] = name
    for model in spec["models"]:
        model["rate"] = round(model["rate"] * scale, 2)
    here = out.resolve()
    spec["runtime"] = {
        **spec.get("runtime", {}),
        "repository_dir": os.path.relpath(REPO / "model_repository" / name, here),
        "export_dir": os.path.relpath(REPO / "model_repository" / "exports", here),
        "state_dir": os.path.relpath(REPO / ".tritonctl" / name, here),
    }
    path = out / "cluster.yaml"
    head = f"# {cluster_path} at {scale:g}x its rates as 1x, {chosen} (bench/overload.py)\n"
    path.write_text(head + yaml.safe_dump(spec, sort_keys=False))
    return path, scale


def goodput(rows: list[Row], deployment: str, scale: float) -> float:
    return sum(r.good_rps for r in rows if (r.deployment, r.scale) == (deployment, scale))


def offered(rows: list[Row], deployment: str, scale: float) -> float:
    return sum(r.offered_rps for r in rows if (r.deployment, r.scale) == (deployment, scale))


def report(rows: list[Row], heading: str) -> str:
    scales = sorted({r.scale for r in rows})
    deployments = list(dict.fromkeys(r.deployment for r in rows))
    lines = [
        f"# Beyond capacity: {heading}",
        "",
        f"CPU: {cpu_fingerprint()['model']}; tritonctl's client. Goodput: requests/s answered within their SLO, of"
        " those offered. Capacity: the highest scale with every model >= 99% within its SLO (a refused request"
        " counts as late).",
        "",
        "| deployment | capacity | " + " | ".join(f"x{s:g}" for s in scales) + " |",
        "|" + "---|" * (2 + len(scales)),
    ]
    for deployment in deployments:
        cells = [f"{goodput(rows, deployment, s):.1f} of {offered(rows, deployment, s):.1f}" for s in scales]
        lines.append(f"| {deployment} | {capacity(rows, deployment, 'tritonctl'):g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The slowest model's p99 of the requests it answered (ms; refused requests are not in it), and its share",
        "of requests answered within the SLO:",
        "",
        "| deployment | " + " | ".join(f"x{s:g}" for s in scales) + " |",
        "|" + "---|" * (1 + len(scales)),
    ]
    for deployment in deployments:
        cells = []
        for s in scales:
            worst = max((r for r in rows if (r.deployment, r.scale) == (deployment, s)), key=lambda r: r.p99_ms)
            cells.append(f"{worst.p99_ms:.0f} {worst.model} {100 * worst.in_slo:.0f}%")
        lines.append(f"| {deployment} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, title: str) -> None:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for deployment in dict.fromkeys(r.deployment for r in rows):
        scales = sorted({r.scale for r in rows if r.deployment == deployment})
        ax.plot(
            [offered(rows, deployment, s) for s in scales],
            [goodput(rows, deployment, s) for s in scales],
            marker="o",
            label=deployment,
        )
    top = max(offered(rows, r.deployment, r.scale) for r in rows)
    ax.plot([0, top], [0, top], color="grey", linestyle=":", label="all within the SLO")
    ax.set_xlabel("offered, requests/s (all models)")
    ax.set_ylabel("goodput, requests/s within the SLO")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_real_load(cluster: Path, args: argparse.Namespace) -> None:
    subprocess.run(
        [sys.executable, str(Path(__file__).parent / "real_load.py"), str(cluster), "--latency-model",
         str(args.latency_model), "--out", str(args.out), "--deployments", *args.deployments, "--scales",
         *map(str, args.scales), "--duration", str(args.duration), "--tools", "tritonctl"],
        check=True,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cluster", type=Path)
    parser.add_argument("--latency-model", type=Path, required=True, help="profiled or calibrated on this CPU")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--rate-scale", type=float, help="1x = the cluster's rates x this (default: what search serves here)"
    )
    parser.add_argument("--scales", nargs="+", type=float, default=[0.5, 1.0, 2.0, 3.0])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of traffic per run")
    parser.add_argument("--deployments", nargs="+", default=["naive-serveall", "naive", "best-serveall", "best"])
    parser.add_argument("--offline", action="store_true", help="only rewrite the report from DIR/results.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.offline:
        cluster, scale = sized_cluster(args.cluster, args.latency_model, args.out, args.rate_scale)
        print(f"1x = {scale:g}x the rates of {args.cluster}")
        run_real_load(cluster, args)
    rows = [Row(**r) for r in json.loads((args.out / "results.json").read_text())]
    heading = (args.out / "cluster.yaml").read_text().splitlines()[0].removeprefix("# ").split(", ")[0]
    text = report(rows, heading)
    (args.out / "overload.md").write_text(text + "\n![goodput against offered load](goodput.png)\n")
    plot(rows, args.out / "goodput.png", f"{heading.split('/')[-1]} (tritonctl's client)")
    print(text)


if __name__ == "__main__":
    main()

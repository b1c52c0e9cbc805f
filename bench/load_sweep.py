"""How much load each policy carries within its SLOs: the InSS setups swept over a rate scale.

    python bench/load_sweep.py [--setups six-4 eight-4 eight-5] [--scales 0.5 0.6 ...] [--margins 0 0.1]

Every rate of a setup is multiplied by the scale; at each scale every policy plans (against the
latency model with each margin: `tritonctl plan --latency-margin`) and its plan is simulated 60 s
with drops on the exact model, as `tritonctl bench` does. Written to the output folder: sweep.csv
(every point), sweep.md (goodput and SLO violations per policy and scale, and the highest scale
each policy serves with violations under 1%) and one plot per setup and margin.

The setups are examples/inss-scaled/*.yaml on profiles/inss-scaled (SYNTHETIC: scaled from the
CPU profile, see bench/inss_scaled.py), scale 1 being their stated rates.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

from matplotlib.figure import Figure

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.compare import OWN, BenchRow, run_policies
from tritonctl.planning.planner import POLICIES
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
TARGET = 0.01  # violations under 1% (issues 4 and 5)


def carried(points: dict[float, BenchRow]) -> float | None:
    """The highest scale whose violations are under the target, and every lower scale's too."""
    best = None
    for k in sorted(points):
        if points[k].error or points[k].violations >= TARGET:
            break
        best = k
    return best


def plot(setup: str, margin: float, results: dict[str, dict[float, BenchRow]], out: Path) -> None:
    fig = Figure(figsize=(10, 4))
    good, bad = fig.subplots(1, 2)
    for policy, points in results.items():
        ks = sorted(k for k, r in points.items() if not r.error)
        style = "-o" if policy in OWN else "--."
        good.plot(ks, [points[k].goodput_rps for k in ks], style, label=policy)
        bad.plot(ks, [100 * points[k].violations for k in ks], style, label=policy)
    bad.axhline(100 * TARGET, color="grey", linewidth=0.8)
    bad.set_yscale("symlog", linthresh=1)
    good.set(xlabel="rate scale (1 = the setup's rates)", ylabel="simulated goodput, req/s")
    bad.set(xlabel="rate scale (1 = the setup's rates)", ylabel="SLO violations, % (1% line)")
    good.legend(fontsize=7)
    fig.suptitle(f"inss-{setup}, latency margin {100 * margin:g}% (SYNTHETIC scaled latency model)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=["six-4", "eight-4", "eight-5"])
    parser.add_argument("--scales", nargs="+", type=float, default=[0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1])
    parser.add_argument("--margins", nargs="+", type=float, default=[0.0, 0.1])
    parser.add_argument("--policies", nargs="+", default=[p for p in POLICIES if p != "optimal"])
    parser.add_argument("--duration", type=float, default=60.0, help="simulated seconds per point (default 60)")
    parser.add_argument("-o", "--output", default=str(REPO / "bench/results/load-sweep"))
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_latency_model(REPO / "profiles/inss-scaled/latency-model.json")
    csv_rows, summary = [], []
    for setup in args.setups:
        cluster = load_cluster(REPO / f"examples/inss-scaled/{setup}.yaml")
        artifacts = materialize(cluster, log=lambda _: None)
        offered = sum(m.rate for m in cluster.spec.models)
        for margin in args.margins:
            results: dict[str, dict[float, BenchRow]] = {p: {} for p in args.policies}
            for k in args.scales:
                print(f"{setup} margin {margin:g} scale {k:g} ...", file=sys.stderr, flush=True)
                with tempfile.TemporaryDirectory() as plans:
                    rows = run_policies(
                        cluster.with_rates(lambda m, k=k: round(m.rate * k, 3)),
                        artifacts,
                        lm,
                        args.policies,
                        Path(plans),
                        args.duration,
                        margin=margin,
                    )
                for row in rows:
                    results[row.policy][k] = row
                    csv_rows.append(
                        {
                            "setup": setup,
                            "margin": margin,
                            "scale": k,
                            "offered_rps": round(k * offered, 1),
                            "policy": row.policy,
                            "goodput_rps": round(row.goodput_rps, 1),
                            "violations": round(row.violations, 5),
                            "drops": round(row.drops, 5),
                            "unserved": row.unserved,
                            "error": row.error,
                        }
                    )
            plot(setup, margin, results, out / f"sweep-{setup}-margin{margin:g}.png")
            summary.append((setup, margin, offered, results))
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(csv_rows[0]))
        writer.writeheader()
        writer.writerows(csv_rows)
    lines = [
        "# Load sweep of the InSS setups (SYNTHETIC scaled latency model)",
        "",
        "`python bench/load_sweep.py " + " ".join(sys.argv[1:]) + "`; simulated "
        f"{args.duration:g} s per point with drops. Cells: goodput req/s (SLO violations). "
        "'carries' is the highest scale served with violations under 1% at it and every lower scale.",
    ]
    for setup, margin, offered, results in summary:
        lines += [
            "",
            f"## {setup}, latency margin {100 * margin:g}% (scale 1 = {offered:.1f} req/s offered)",
            "",
            "| policy | carries | " + " | ".join(f"x{k:g}" for k in args.scales) + " |",
            "|---|---|" + "---|" * len(args.scales),
        ]
        for policy, points in results.items():
            cells = [
                "failed" if points[k].error else f"{points[k].goodput_rps:.0f} ({100 * points[k].violations:.1f}%)"
                for k in args.scales
            ]
            best = carried(points)
            lines.append(f"| {policy} | {'-' if best is None else f'x{best:g}'} | " + " | ".join(cells) + " |")
        lines += ["", f"![{setup}](sweep-{setup}-margin{margin:g}.png)"]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

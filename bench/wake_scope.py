"""Whose idle time a wake-up follows: the instance's or the device's? Checked against every committed real-load run.

    python bench/wake_scope.py [--out bench/results/wake-scope.md]

The profile measures a model's wake-up alone: how much longer a request takes after its instance sat idle. On a
device where other instances are busy, the cores are not idle when the instance wakes. This replays the plans of
the real-load runs on both 2-vCPU EPYC VMs (each plan as measured, at its rates, with the latency model it was
planned with) in the simulator three ways: the wake-up after the instance's own idle time, after the device's
(none beside a batch in flight), and none; and compares each with the p99 perf_analyzer measured for every model
and scale that had at least 99% of its requests within its SLO. The best and the naive plans are replayed (the
hand-written deployment has no plan). Simulation only, seeded: nothing is measured again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from real_load import plan_file
from turn_interference import RUNS as LADDER_48K
from turn_interference import WITHIN, error_cells

from tritonctl.latency.ablation import no_wake
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import load_plan
from tritonctl.planning.simulate import simulate

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench/results"
VM_48K, VM_32K = "48 KB L1d (119710fb3a34)", "32 KB L1d (d8ac1dffd5bf)"
# (VM, results folder, the latency model its plans were made with)
RUNS = [(VM_48K, folder, lm) for folder, lm, _ in LADDER_48K] + [
    (VM_48K, f"native-48k/{name}", f"profiles/{name}/latency-model.json")
    for name in ("torchvision-four", "random-0-0", "random-0-1", "random-0-2", "random-1-0", "random-1-1", "random-1-2")
]
RUNS += [(VM_48K, "native-48k/cpu-demo", "bench/results/native-48k/cpu-demo/latency-model-calibrated.json")]
RUNS += [
    (VM_32K, f"native/{name}", f"bench/results/profiles-epyc-32k/{profile}/latency-model.json")
    for name, profile in (
        ("torchvision-four", "torchvision-four-limited"),
        ("random-0-1", "random-0-1"),
        ("cpu-demo", "cpu-demo-limited"),
        ("random-0-0", "random-0-0-limited"),
        ("random-0-2", "random-0-2-limited"),
    )
]
DEPLOYMENTS = ("best-replan", "best", "naive")
SIMULATED_S = 300
HOWS = ("the instance's idle time", "the device's idle time", "no wake-up")


def simulated_p99s(plan, lm) -> dict[str, dict[str, float]]:
    runs = {
        HOWS[0]: simulate(plan, lm, SIMULATED_S, drop=True),
        HOWS[1]: simulate(plan, lm, SIMULATED_S, drop=True, wake="device"),
        HOWS[2]: simulate(plan, no_wake(lm), SIMULATED_S, drop=True),
    }
    return {how: {m.model: m.p99_ms for m in run.models} for how, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "wake-scope.md")
    args = parser.parse_args()
    rows = []  # (VM, folder, deployment, scale, model, measured p99, {how: simulated p99})
    for vm, folder, lm_path in RUNS:
        measured = json.loads((RESULTS / folder / "results.json").read_text())
        lm = load_latency_model(REPO / lm_path)
        for deployment in DEPLOYMENTS:
            for scale in sorted({r["scale"] for r in measured if r["deployment"] == deployment}):
                path = plan_file(RESULTS / folder, deployment, scale)
                points = [
                    r
                    for r in measured
                    if (r["deployment"], r["scale"], r["tool"]) == (deployment, scale, "perf_analyzer")
                    and r["p99_ms"] is not None
                    and r["in_slo"] >= 0.99
                ]
                if not path.exists() or not points:
                    continue
                simulated = simulated_p99s(load_plan(path).plan, lm)
                for r in points:
                    sims = {how: s[r["model"]] for how, s in simulated.items()}
                    rows.append((vm, folder, deployment, scale, r["model"], r["p99_ms"], sims))
        print(f"  {folder}: {sum(row[1] == folder for row in rows)} points", flush=True)
    args.out.write_text(report(rows))
    print(args.out.read_text())


def report(rows: list[tuple]) -> str:
    lines = [
        "# Wake-up after whose idle time: measured p99 (perf_analyzer) against the simulated one",
        "",
        "`python bench/wake_scope.py`: the committed best and naive plans of the real-load runs on both EPYC VMs,",
        "each model and scale with at least 99% of its requests within its SLO; error = simulated / measured - 1.",
        "",
        "| VM | wake-up after | points | median abs. error | within 25% | mean error |",
        "|---|---|---|---|---|---|",
    ]
    for vm in (VM_48K, VM_32K, "both"):
        mine = [row for row in rows if vm in ("both", row[0])]
        for how in HOWS:
            lines.append(f"| {vm} | {how} | " + error_cells([sims[how] / p99 - 1 for *_, p99, sims in mine]) + " |")
    lines += ["", "Within 25% per run:", "", "| run | points | " + " | ".join(HOWS) + " |", "|---|---|---|---|---|"]
    for folder in dict.fromkeys(row[1] for row in rows):
        mine = [row for row in rows if row[1] == folder]
        counts = [sum(abs(sims[how] / p99 - 1) <= WITHIN for *_, p99, sims in mine) for how in HOWS]
        lines.append(f"| {folder} | {len(mine)} | " + " | ".join(str(c) for c in counts) + " |")
    lines += [
        "",
        "| run | plan | scale | model | measured p99 ms | " + " | ".join(HOWS) + " |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, folder, deployment, scale, model, p99, sims in rows:
        cells = " | ".join(f"{sims[h]:.1f} ({100 * (sims[h] / p99 - 1):+.0f}%)" for h in HOWS)
        lines.append(f"| {folder} | {deployment} | {scale:g}x | {model} | {p99:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

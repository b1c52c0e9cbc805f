"""Does the simulator predict measured p99s of CPUs taken in turns better with the batches in flight interfering?

    python bench/turn_interference.py [--out bench/results/turn-interference.md]

Replays every committed best plan of the real-load runs on the 48 KB L1d EPYC VM (CPU id 119710fb3a34; each plan
at the rates it was made and measured for, with the latency model it was planned with) in the simulator twice:
as it simulates now, each batch slowed by the batches in flight when it starts (the latency model's cache pressure
and scheduling terms, `LatencyModel.t_inf` `in_turns`) besides sharing the cores with them, and with the cores'
sharing alone (the model's interference terms zeroed: `ablation.no_interference`; on a CPU taken in turns that is
the simulation without the interference). Against each the p99 perf_analyzer measured, for every model and scale
that had at least 99% of its requests within its SLO (beyond, a p99 measures the overload, not the plan). The
simulation only, seeded: nothing is measured again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from real_load import plan_file

from tritonctl.latency.ablation import no_interference
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import load_plan
from tritonctl.planning.simulate import simulate

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench/results"
# (results folder, the latency model its best plans were made with, the deployment's name there)
RUNS = [
    ("ladder-48k/torchvision-four", "profiles/torchvision-four/latency-model.json", "best-replan"),
    ("ladder-48k/torchvision-four-simulated", "profiles/torchvision-four/latency-model.json", "best-replan"),
    ("ladder-48k/cpu-demo", "bench/results/native-48k/cpu-demo/latency-model-calibrated.json", "best-replan"),
    ("ladder-48k/random-1-0", "profiles/random-1-0/latency-model.json", "best-replan"),
    ("ladder-48k/random-1-1", "profiles/random-1-1/latency-model.json", "best-replan"),
    ("ladder-48k/random-1-2", "profiles/random-1-2/latency-model.json", "best-replan"),
    ("ladder-48k/random-2-0", "profiles/random-2-0/latency-model.json", "best-replan"),
    ("ladder-48k/random-2-1", "profiles/random-2-1/latency-model.json", "best-replan"),
    ("demo/side-by-side", "bench/results/demo/side-by-side/latency-model-calibrated.json", "best"),
]
SIMULATED_S = 600
WITHIN = 0.25  # the prediction target: measured p99 within 25% of the simulated one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "turn-interference.md")
    args = parser.parse_args()
    rows = []
    for folder, lm_path, deployment in RUNS:
        measured = json.loads((RESULTS / folder / "results.json").read_text())
        lm = load_latency_model(REPO / lm_path)
        models = {"with interference": lm, "cores' sharing alone": no_interference(lm)}
        for scale in sorted({r["scale"] for r in measured if r["deployment"] == deployment}):
            path = plan_file(RESULTS / folder, deployment, scale)
            if not path.exists():
                continue
            plan = load_plan(path).plan
            simulated = {
                how: {m.model: m.p99_ms for m in simulate(plan, model, SIMULATED_S, drop=True).models}
                for how, model in models.items()
            }
            for r in measured:
                if (r["deployment"], r["scale"], r["tool"]) != (deployment, scale, "perf_analyzer"):
                    continue
                if r["p99_ms"] is None or r["in_slo"] < 0.99:
                    continue
                sims = {how: s[r["model"]] for how, s in simulated.items()}
                rows.append((folder, scale, r["model"], r["p99_ms"], sims))
    args.out.write_text(report(rows))
    print(args.out.read_text())


def error_cells(errors: list[float]) -> str:
    """Table cells of simulated-against-measured errors: points | median abs. error | within 25% | mean error."""
    errors = np.array(errors)
    within = np.abs(errors) <= WITHIN
    return (
        f"{len(errors)} | {100 * np.median(np.abs(errors)):.1f}% | {within.sum()} ({within.mean():.0%}) | "
        f"{100 * errors.mean():+.1f}%"
    )


def report(rows: list[tuple]) -> str:
    hows = list(rows[0][4])
    lines = [
        "# Measured p99 (perf_analyzer) against the simulated one, CPUs taken in turns",
        "",
        "`python bench/turn_interference.py`: the committed best plans of the real-load runs on the 48 KB L1d",
        "EPYC VM, each model and scale with at least 99% of its requests within its SLO; error = simulated /",
        "measured - 1.",
        "",
        "| simulation | points | median abs. error | within 25% | mean error |",
        "|---|---|---|---|---|",
    ]
    for how in hows:
        lines.append(f"| {how} | " + error_cells([sims[how] / p99 - 1 for *_, p99, sims in rows]) + " |")
    lines += ["", f"Per run, {hows[0]}:", "", "| run | points | within 25% |", "|---|---|---|"]
    for folder in dict.fromkeys(row[0] for row in rows):
        errors = [sims[hows[0]] / p99 - 1 for f, _, _, p99, sims in rows if f == folder]
        lines.append(f"| {folder} | {len(errors)} | {sum(abs(e) <= WITHIN for e in errors)} |")
    lines += ["", "| run | scale | model | measured p99 ms | " + " | ".join(hows) + " |", "|---|---|---|---|---|---|"]
    for folder, scale, model, p99, sims in rows:
        cells = " | ".join(f"{sims[h]:.1f} ({100 * (sims[h] / p99 - 1):+.0f}%)" for h in hows)
        lines.append(f"| {folder} | {scale:g}x | {model} | {p99:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

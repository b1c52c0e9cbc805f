"""Where a plan's simulated latencies part from the measured ones: the best plan of a committed benchmark run
(its `plan-best-replan.yaml`, as deployed at 1x), simulated under each given profile's latency model with and
without its wake-up term, beside what perf_analyzer measured at 1x (the run's `results.json`). Simulation only:
nothing is measured again.

    python bench/prediction_sources.py RUN --profiles PROFILE [PROFILE ...] [--duration 600] [--out FILE]

RUN is a folder of bench/real_load.py (bench/native.sh writes them); each PROFILE a profile folder with its
`latency-model.json`. Prints (and with --out writes) one markdown table: per model p50 / p99 in ms, and the
simulated p99's difference from the measured one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tritonctl.latency.ablation import no_wake
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import load_plan
from tritonctl.planning.simulate import simulate


def measured(run: Path) -> dict[str, tuple[float, float]]:
    """(p50, p99) ms per model of the best plan at 1x under perf_analyzer."""
    rows = json.loads((run / "results.json").read_text())
    return {
        r["model"]: (r["p50_ms"], r["p99_ms"])
        for r in rows
        if r["deployment"] == "best-replan" and r["tool"] == "perf_analyzer" and r["scale"] == 1.0
    }


def table(run: Path, profiles: list[Path], duration_s: float) -> list[str]:
    plan = load_plan(run / "plan-best-replan.yaml").plan
    truth = measured(run)
    names = [m.name for m in plan.models]
    lines = [
        f"Simulated {duration_s:g} s (seed 0) against perf_analyzer at 1x, `{run}`: p50 / p99 ms (p99 difference).",
        "",
        "| latency model | wake-up | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
        "| measured (perf_analyzer) | | " + " | ".join(f"{truth[n][0]:.1f} / {truth[n][1]:.1f}" for n in names) + " |",
    ]
    for profile in profiles:
        lm = load_latency_model(profile / "latency-model.json")
        for wake, model in (("fitted", lm), ("none", no_wake(lm))):
            result = {m.model: m for m in simulate(plan, model, duration_s).models}
            cells = [
                f"{result[n].p50_ms:.1f} / {result[n].p99_ms:.1f} ({100 * (result[n].p99_ms / truth[n][1] - 1):+.0f}%)"
                for n in names
            ]
            lines.append(f"| {profile.name} | {wake} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a bench/real_load.py results folder")
    parser.add_argument("--profiles", type=Path, nargs="+", required=True, help="profile folders")
    parser.add_argument("--duration", type=float, default=600.0, help="simulated seconds (default 600)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    text = "\n".join(table(args.run, args.profiles, args.duration)) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()

"""The simulator against every committed GPU run under perf_analyzer, the hand-written deployment included.

    python bench/gpu_simulated.py [--out bench/results/gpu-calibrated/simulated.md]

Each run folder of bench/results/gpu-calibrated holds the plans it applied and what perf_analyzer measured for every
deployment and rate scale (bench/gpu_calibrated.py on an H200). This replays each deployment in the simulator with
the calibrated latency model at the same rates: the plans as applied (each model at its MPS share) and the
hand-written deployment as what it is to the simulator, every model on the whole GPU taking turns with it (no MPS),
Triton's dynamic batching up to 32 with no queue delay. Per model and scale: p99 measured and simulated, the share
within the SLO both ways; per deployment the capacity both ways (the highest scale at which every model has at least
99% of its requests within its SLO), and what was answered with the host work it took. Then the plans `search` makes
of examples/gpu-one on that model (`--batching fill` and `eager`), simulated at 1-3x its rates: what a GPU host is
to measure next. Simulation only, seeded: nothing is measured again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from real_load import HANDWRITTEN_GPU_BATCH, plan_file

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import Plan, load_plan
from tritonctl.planning.planner import make_plan
from tritonctl.planning.simulate import simulate
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "bench/results/gpu-calibrated"
LATENCY_MODEL = REPO / "profiles/inss-gpu/latency-model.714aeecb5682.json"
SIMULATED_S = 60  # 400 requests/s a model: about 100,000 requests at 1x
MEETS = 0.99
CLUSTER = REPO / "examples/gpu-one/cluster.yaml"
SCALES = (1.0, 1.5, 2.0, 2.5, 3.0)


def handwritten(plan: Plan) -> Plan:
    """The hand-written GPU deployment as a plan: every model on the whole GPU, taking turns with it."""
    models = [
        m.model_copy(
            update={
                "placements": [
                    p.model_copy(update={"share": 100, "batch": HANDWRITTEN_GPU_BATCH, "queue_delay_us": 0})
                    for p in m.placements
                ]
            }
        )
        for m in plan.models
    ]
    return plan.model_copy(update={"models": models, "sharing": "temporal", "turns": []})


def capacity(rows: list[dict], key: str) -> float:
    """The highest scale with every model at least MEETS within its SLO (by `key`), 0 where none."""
    met = [s for s in sorted({r["scale"] for r in rows}) if all(r[key] >= MEETS for r in rows if r["scale"] == s)]
    return max(met, default=0.0)


def host_work(measured: list[dict], lm) -> list[str]:
    """Per deployment and scale, the requests/s answered over all models, and the calibrated per-image host term
    (`LatencyModel.host_ms`'s c1) times each model's answered rate, summed: seconds of host work a second."""
    lines = ["| deployment | scale | answered, all models | per-image host work |", "|---|---|---|---|"]
    for deployment in dict.fromkeys(r["deployment"] for r in measured):
        for scale in sorted({r["scale"] for r in measured if r["deployment"] == deployment}):
            rows = [r for r in measured if (r["deployment"], r["scale"]) == (deployment, scale)]
            if any(r["ok_rps"] != r["ok_rps"] for r in rows):  # nan: perf_analyzer stopped
                continue
            answered = sum(r["ok_rps"] for r in rows)
            work = sum(r["ok_rps"] * (lm.host_ms(r["model"], 1) - lm.host_ms(r["model"], 0)) for r in rows) / 1000
            lines.append(f"| {deployment} | {scale:g}x | {answered:,.0f}/s | {work:.2f} s/s |")
    return lines


def planned_now(lm) -> list[str]:
    """The plans search makes of examples/gpu-one on `lm` (fill and eager batching), simulated at SCALES."""
    cluster = load_cluster(CLUSTER)
    artifacts = materialize(cluster, log=lambda _: None)
    lines = ["", "## search's plans of examples/gpu-one on this model, simulated", ""]
    for batching in ("fill", "eager"):
        plan = make_plan(
            cluster, artifacts, "search", CLUSTER.parent / "plan.yaml", lm, lambda _: None, batching=batching
        )
        how = ", ".join(f"{m.name} share {p.share} batch {p.batch}" for m, p in plan.instances())
        turns = "the whole GPU in turns, no MPS" if plan.takes_turns(plan.devices[0].id) else "MPS shares"
        lines += [
            f"`--batching {batching}`: {turns}; {how}",
            "",
            "| scale | " + " | ".join(m.name for m in plan.models) + " |",
        ]
        lines.append("|---" * (len(plan.models) + 1) + "|")
        rows = []
        for scale in SCALES:
            result = simulate(plan, lm, SIMULATED_S, rate_scale=scale).models
            rows += [{"scale": scale, "simulated_in_slo": m.good / max(m.arrived, 1)} for m in result]
            cells = [f"{m.p99_ms:.0f} ms, {100 * m.good / max(m.arrived, 1):.0f}%" for m in result]
            lines.append(f"| {scale:g}x | " + " | ".join(cells) + " |")
        lines += ["", f"- capacity {capacity(rows, 'simulated_in_slo'):g}x simulated", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RUNS / "simulated.md")
    args = parser.parse_args()
    lm = load_latency_model(LATENCY_MODEL)
    lines = [
        "# The simulator against the H200 runs",
        "",
        "`python bench/gpu_simulated.py`: every deployment of the committed runs replayed in the simulator with",
        f"`{LATENCY_MODEL.relative_to(REPO)}` at the measured rates ({SIMULATED_S} s, seeded); measured by",
        "perf_analyzer on the H200. Per model: p99 ms measured / simulated, and % within the SLO measured /",
        "simulated. Capacity: the highest scale at which every model has 99% within its SLO.",
    ]
    for folder in sorted(p for p in RUNS.iterdir() if (p / "results.json").exists()):
        measured = [r for r in json.loads((folder / "results.json").read_text()) if r["tool"] == "perf_analyzer"]
        deployments = list(dict.fromkeys(r["deployment"] for r in measured))
        planned = next(d for d in deployments if d != "handwritten")
        models = list(dict.fromkeys(r["model"] for r in measured))
        lines += ["", f"## {folder.name}", "", "| deployment | scale | " + " | ".join(models) + " |"]
        lines.append("|---" * (len(models) + 2) + "|")
        summary = []
        for deployment in deployments:
            plan = load_plan(plan_file(folder, planned)).plan
            plan = handwritten(plan) if deployment == "handwritten" else plan
            rows = [r for r in measured if r["deployment"] == deployment]
            for scale in sorted({r["scale"] for r in rows}):
                sim = {m.model: m for m in simulate(plan, lm, SIMULATED_S, rate_scale=scale).models}
                cells = []
                for r in (r for r in rows if r["scale"] == scale):
                    m = sim[r["model"]]
                    r["simulated_in_slo"] = m.good / max(m.arrived, 1)
                    p99 = "—" if r["p99_ms"] != r["p99_ms"] else f"{r['p99_ms']:.0f}"  # nan: perf_analyzer stopped
                    cells.append(
                        f"{p99} / {m.p99_ms:.0f} ms, {100 * r['in_slo']:.0f} / {100 * r['simulated_in_slo']:.0f}%"
                    )
                lines.append(f"| {deployment} | {scale:g}x | " + " | ".join(cells) + " |")
            summary.append(
                f"- {deployment}: capacity {capacity(rows, 'in_slo'):g}x measured, "
                f"{capacity(rows, 'simulated_in_slo'):g}x simulated"
            )
        lines += ["", *summary, "", *host_work(measured, lm)]
    lines += planned_now(lm)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

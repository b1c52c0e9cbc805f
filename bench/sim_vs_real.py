"""Simulator against the real local Triton: the same plan, the same Poisson rates.

    python bench/sim_vs_real.py [--duration 60] [--scales 0.5 0.75 1]  # real run, then the comparison
    python bench/sim_vs_real.py --offline                              # the comparison from the saved run
    python bench/sim_vs_real.py --results bench/results/sim-vs-real-60s --offline   # another saved run
    python bench/sim_vs_real.py --pool RUN RUN ...                     # the mean over saved runs of one plan

Plans the CPU demo cluster with `search` (what `make demo` deploys) on the committed latency
model, applies it on the real local Triton, drives it with open-loop Poisson traffic from
tritonclient.grpc at each rate scale (through HAProxy, or with `--direct` at the
instances' own ports: the simulator does not model the proxy), replays the requests it
sent (their send times) through the simulator, and prints goodput and p99 side by side,
with a bootstrap interval of the real p99 (how far it moves by chance alone, for that many
requests). The deployment is stopped at the end. Run it on a quiet machine: it measures
latency. What the real run measured is kept in `--results` (bench/results/sim-vs-real/
unless told: the plan it applied, and per scale the trace of sent requests and every
answered request's latency), so `--offline` compares a changed simulator or latency model
with the same real run and plan.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from pathlib import Path

import numpy as np
from cpu_demo import MODEL, REPO, applied, plan_demo

from tritonctl.deploy.state import straight_to_instances
from tritonctl.latency.model import LatencyModel, load_latency_model
from tritonctl.planning.plan import load_plan
from tritonctl.planning.simulate import read_trace, simulate
from tritonctl.triton.client import endpoints, run_load

RESULTS = REPO / "bench" / "results" / "sim-vs-real"


def measure(plan_path: Path, duration_s: float, scales: list[float], results: Path, direct: bool) -> None:
    """Apply the plan, load it at every scale and save the sent requests and the answers' latencies; `direct`:
    at the instances' own gRPC ports rather than the models' addresses (HAProxy)."""
    results.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plan_path, results / "plan.yaml")
    with applied(plan_path) as loaded:
        targets = endpoints(loaded.plan)
        if direct:
            targets = straight_to_instances(targets, loaded.state_dir)
        for scale in scales:
            real = run_load(targets, duration_s, scale)
            with open(results / f"trace-x{scale:g}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["model", "time_s"])
                writer.writerows((r.model, f"{t:.6f}") for r in real for t in sorted(r.sent_at_s))
            with open(results / f"latency-x{scale:g}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["model", "latency_ms"])
                writer.writerows((r.model, f"{x:.3f}") for r in real for x in r.latencies_ms)
            print(f"x{scale:g}: {sum(r.sent for r in real)} sent, {sum(len(r.errors) for r in real)} failed")
    run = {"duration_s": duration_s, "scales": scales, "path": "direct" if direct else "proxy"}
    (results / "run.json").write_text(json.dumps(run) + "\n")


def bootstrap_p99(latencies: np.ndarray, rng: np.random.Generator, rounds: int = 1000) -> tuple[float, float]:
    """The 5th and 95th percentiles of the p99 over resamples of the measured latencies: how far the real p99
    of this many requests moves by chance alone."""
    resamples = rng.choice(latencies, size=(rounds, len(latencies)))
    p99s = np.percentile(resamples, 99, axis=1)
    return float(np.percentile(p99s, 5)), float(np.percentile(p99s, 95))


def _cells(results: Path, lm: LatencyModel) -> dict[tuple[float, str], tuple[float, float, float, float, list[float]]]:
    """Per (scale, model) of a saved real run: real and simulated goodput and p99, and the answered requests'
    latencies (ms)."""
    run = json.loads((results / "run.json").read_text())
    duration = run["duration_s"]
    plan = load_plan(results / "plan.yaml").plan
    slo = {m.name: m.slo_ms for m in plan.models}
    cells = {}
    for scale in run["scales"]:
        trace = read_trace(results / f"trace-x{scale:g}.csv")
        latencies: dict[str, list[float]] = {}
        with open(results / f"latency-x{scale:g}.csv", newline="") as f:
            for row in csv.DictReader(f):
                latencies.setdefault(row["model"], []).append(float(row["latency_ms"]))
        sim = {m.model: m for m in simulate(plan, lm, duration, trace=trace).models}
        for name, lat in latencies.items():
            g_real = sum(x <= slo[name] for x in lat) / duration
            cells[scale, name] = (
                g_real,
                sim[name].good / duration,
                float(np.percentile(lat, 99)),
                sim[name].p99_ms,
                lat,
            )
    return cells


def compare(results: Path) -> str:
    """The saved real run against the simulator replaying its requests on the saved plan, as a table."""
    head = f"{'scale':>5} {'model':14} {'goodput real':>12} {'sim':>8} {'gap':>7} {'p99 real ms':>11} {'sim':>8}"
    head += f" {'gap':>7} {'real p99, 90% bootstrap':>23}"
    lines = [head]
    rng = np.random.default_rng(0)
    for (scale, name), (g_real, g_sim, p_real, p_sim, lat) in _cells(results, load_latency_model(MODEL)).items():
        low, high = bootstrap_p99(np.array(lat), rng)
        lines.append(
            f"{scale:5g} {name:14} {g_real:12.2f} {g_sim:8.2f} {100 * (g_sim / g_real - 1):+6.1f}% "
            f"{p_real:11.1f} {p_sim:8.1f} {100 * (p_sim / p_real - 1):+6.1f}% {low:15.1f} - {high:5.1f}"
        )
    return "\n".join(lines)


def pooled(runs: list[Path]) -> str:
    """Several saved real runs of one plan on one path: per cell, the plain mean over runs (each run weighs the same,
    whatever its length) of the real and simulated goodput and p99. One run's real p99 moves by up to 20% between
    runs of the same requests: the machine changes."""
    missing = [str(run) for run in runs if not (run / "run.json").is_file()]
    if missing:
        raise SystemExit(f"not saved real runs (no run.json): {', '.join(missing)}")
    plans = {(run / "plan.yaml").read_text() for run in runs}
    paths = {json.loads((run / "run.json").read_text()).get("path", "proxy") for run in runs}
    if len(plans) != 1 or len(paths) != 1:
        raise SystemExit("the runs applied different plans or went different paths (proxy, direct): not one mean")
    lm = load_latency_model(MODEL)
    per_run = [_cells(run, lm) for run in runs]
    head = f"{'scale':>5} {'model':14} {'runs':>4} {'goodput real':>12} {'sim':>8} {'gap':>7} {'p99 real ms':>11}"
    head += f" {'sim':>8} {'gap':>7} {'real p99 of one run':>19}"
    lines = [f"# mean over {len(runs)} runs: {', '.join(run.name for run in runs)}", head]
    for key in sorted(set().union(*per_run)):
        cells = [c[key] for c in per_run if key in c]
        g_real, g_sim, p_real, p_sim = (float(np.mean([c[i] for c in cells])) for i in range(4))
        lines.append(
            f"{key[0]:5g} {key[1]:14} {len(cells):4} {g_real:12.2f} {g_sim:8.2f} {100 * (g_sim / g_real - 1):+6.1f}% "
            f"{p_real:11.1f} {p_sim:8.1f} {100 * (p_sim / p_real - 1):+6.1f}% "
            f"{min(c[2] for c in cells):9.1f} - {max(c[2] for c in cells):5.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per rate scale")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.5, 0.75, 1.0], help="rate multipliers")
    parser.add_argument("--offline", action="store_true", help="compare with the saved real run, start nothing")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the real run (default: %(default)s)")
    parser.add_argument("--direct", action="store_true", help="send to the instances' own ports, not through HAProxy")
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        metavar="RUN",
        help="saved runs of one plan and path: per cell, the mean over runs",
    )
    args = parser.parse_args()
    if args.pool:
        print(pooled(args.pool))
        return
    if not args.offline:
        measure(plan_demo(), args.duration, args.scales, args.results, args.direct)
    table = compare(args.results)
    (args.results / "table.txt").write_text(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()

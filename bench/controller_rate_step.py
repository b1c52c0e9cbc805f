"""The controller under a rate step, on the real local Triton.

    python bench/controller_rate_step.py [--duration 40] [--step-at 10] [--factor 2]

The CPU demo cluster is planned with `bda` (the committed latency model) and handed to
`tritonctl controller`, run as its own process, with its own ports and state. Poisson
traffic at the demo rates runs for `--duration` seconds; at `--step-at` one more client
starts sending to the first model, so its rate becomes `--factor` times the planned one.
Reported: when the controller decided and when its change was applied, counted from the
step; the decision it took; requests sent and failed; p99 per model before and after.
Writes `step.md` beside a copy of the controller's decisions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from cpu_demo import CLUSTER, MODEL, REPO

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import save_plan
from tritonctl.planning.planner import make_plan
from tritonctl.spec import load_cluster
from tritonctl.triton.client import LoadResult, endpoints, run_load

WORK = REPO / ".tritonctl" / "controller-bench"


def controller_state(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "controller.json").read_text())
    except (OSError, ValueError):
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of traffic (default 40)")
    parser.add_argument("--step-at", type=float, default=10.0, help="second at which the step comes (default 10)")
    parser.add_argument("--factor", type=float, default=2.0, help="the first model's rate after the step (x)")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the demo rates (default 1)")
    parser.add_argument("--policy", default="bda", help="the plan the controller starts from (default bda)")
    parser.add_argument("--base-port", type=int, default=8400, help="first model port (default 8400)")
    parser.add_argument("-o", "--output", default=str(REPO / "bench" / "results" / "controller"), help="output folder")
    args = parser.parse_args()
    demo = load_cluster(CLUSTER)
    state_dir = WORK / "state"
    cluster = demo.with_rates(lambda m: m.rate * args.rate_scale).with_runtime(
        base_port=args.base_port, state_dir=str(state_dir)
    )
    plan_path = WORK / "plan.yaml"
    subprocess.run([sys.executable, "-m", "tritonctl", "down", str(plan_path)], capture_output=True, check=False)
    (state_dir / "controller.json").unlink(missing_ok=True)
    lm = load_latency_model(MODEL)
    plan = make_plan(cluster, materialize(cluster, log=lambda _: None), args.policy, plan_path, lm, log=lambda _: None)
    save_plan(plan, plan_path)
    log = (WORK / "controller.log").open("w")
    ctl = subprocess.Popen(
        [sys.executable, "-m", "tritonctl", "controller", str(plan_path), "--latency-model", str(MODEL), "--port", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        while controller_state(state_dir).get("applies", 0) < 1:
            if ctl.poll() is not None:
                sys.exit(f"the controller exited; see {WORK / 'controller.log'}")
            time.sleep(0.5)
        targets = endpoints(plan)
        first = targets[0]
        extra: list[LoadResult] = []
        results: list[LoadResult] = []
        base = threading.Thread(target=lambda: results.extend(run_load(targets, args.duration)))
        base.start()
        time.sleep(args.step_at)
        step = time.time()
        stepped = dataclasses.replace(first, rate=first.rate * (args.factor - 1))
        more = threading.Thread(target=lambda: extra.extend(run_load([stepped], args.duration - args.step_at, seed=7)))
        more.start()
        base.join()
        more.join()
        decisions = [d for d in controller_state(state_dir).get("decisions", []) if d["time"] >= step]
    finally:
        ctl.terminate()
        ctl.wait()
        subprocess.run([sys.executable, "-m", "tritonctl", "down", str(plan_path)], capture_output=True, check=False)
    report(args, results, extra, decisions, step, Path(args.output))


def report(args, results: list[LoadResult], extra: list[LoadResult], decisions: list[dict], step: float, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    failed = sum(len(r.errors) for r in results + extra)
    lines = [
        "# Controller under a rate step (real Triton, CPU)",
        "",
        f"`python bench/controller_rate_step.py --duration {args.duration:g} --step-at {args.step_at:g} "
        f"--factor {args.factor:g} --rate-scale {args.rate_scale:g} --policy {args.policy}`; 2-core VM, local runtime.",
        "",
        f"At t = {args.step_at:g} s the first model's rate goes to {args.factor:g}x its planned rate.",
        f"Requests sent: {sum(r.sent for r in results + extra)}, failed: **{failed}**.",
        "",
    ]
    if decisions:
        d = decisions[0]
        lines += [
            f"First decision {d['time'] - step:.1f} s after the step: {d['kind']}: {d['reason']}",
            f"Applied {d['time'] + d['took_s'] - step:.1f} s after the step (the apply took {d['took_s']:g} s).",
        ]
    else:
        lines.append("The controller took no decision after the step.")
    before, after = (0.0, args.step_at), (args.step_at, args.duration)
    lines += ["", "| model | SLO ms | p99 before step | p99 after step |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.model} | {r.slo_ms:g} | {r.percentile(99, before):.1f} | {r.percentile(99, after):.1f} |")
    lines += ["", "Decisions after the step:", "", "```", json.dumps(decisions, indent=2), "```", ""]
    (out / "step.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

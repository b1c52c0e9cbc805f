"""kill -9 of a Triton instance, then of HAProxy, under load: the controller heals both.

    python bench/self_heal.py [--duration 40] [--rate-scale 0.1] [-o bench/results/self-heal]

The CPU demo cluster is planned with `spread` at --rate-scale x its rates and handed to
`tritonctl controller`, which applies it. Open-loop Poisson traffic at the planned rates
then runs through tritonclient.grpc while one instance (the first model's) is killed with
SIGKILL at a quarter of the run and HAProxy at five eighths. Nothing else touches the
deployment. Reported per kill: when the controller decided to heal, how long its apply
took, when the killed model answered a request sent after the kill again, and the requests
that failed in between. Writes `self-heal.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cpu_demo import CLUSTER, REPO

from tritonctl.deploy.apply import down
from tritonctl.deploy.local import LocalRuntime
from tritonctl.deploy.state import load_state
from tritonctl.export import materialize
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.planning.plan import load_plan, save_plan
from tritonctl.planning.planner import make_plan
from tritonctl.spec import load_cluster
from tritonctl.triton.binary import find_tritonserver
from tritonctl.triton.client import LoadResult, endpoints, format_results, run_load

WORK = REPO / ".tritonctl" / "self-heal-bench"


def served_again(result: LoadResult, since_s: float) -> float:
    """Seconds from `since_s` to the first answer to a request sent after it (inf: none came)."""
    answered = [
        at for at, ms in zip(result.answered_at_s, result.latencies_ms, strict=True) if at - ms / 1000 >= since_s
    ]
    return min(answered) - since_s if answered else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument(
        "--rate-scale", type=float, default=0.1, help="x the demo's rates (default: what a 2-core VM serves)"
    )
    parser.add_argument("--base-port", type=int, default=8400, help="first model port (default 8400)")
    parser.add_argument("-o", "--out", type=Path, default=REPO / "bench" / "results" / "self-heal")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    demo = load_cluster(CLUSTER).with_rates(lambda m: round(m.rate * args.rate_scale, 2))
    spec = demo.with_runtime(base_port=args.base_port, state_dir=str(WORK / "state"))  # beside a demo deployment
    plan_path = WORK / "plan.yaml"
    plan = make_plan(spec, materialize(spec, log=lambda _: None), "spread", plan_path, log=lambda _: None)
    save_plan(plan, plan_path)
    loaded = load_plan(plan_path)
    log = (WORK / "controller.log").open("w")
    ctl = subprocess.Popen(
        [sys.executable, "-m", "tritonctl", "controller", str(plan_path), "--port", "0", "--interval", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    controller_file = loaded.state_dir / "controller.json"
    try:
        deadline = time.monotonic() + 120
        while not (controller_file.exists() and json.loads(controller_file.read_text()).get("applies")):
            assert time.monotonic() < deadline and ctl.poll() is None, "the controller did not apply the plan"
            time.sleep(0.2)
        targets = endpoints(loaded.plan)
        victim = targets[0].model
        results: list = []
        origin = time.time()
        load = threading.Thread(target=lambda: results.extend(run_load(targets, args.duration, 1.0, seed=7)))
        load.start()
        kills = []
        time.sleep(args.duration / 4)
        (record,) = [r for r in load_state(loaded.state_dir).instances.values() if r.model == victim]
        os.kill(record.pid, signal.SIGKILL)
        kills.append((f"instance {record.instance}", time.time() - origin))
        time.sleep(args.duration * 3 / 8)
        proxy = json.loads((loaded.state_dir / "haproxy.json").read_text())
        os.killpg(proxy["pid"], signal.SIGKILL)  # HAProxy's master and worker
        kills.append(("proxy", time.time() - origin))
        load.join()
        decisions = [d for d in json.loads(controller_file.read_text())["decisions"] if d["kind"] == "heal"]
    finally:
        ctl.terminate()
        ctl.wait()
        down(loaded.state_dir, LocalRuntime(find_tritonserver(), loaded.state_dir), log=lambda _: None)
    by_model = {r.model: r for r in results}
    lines = [
        "# Self-healing under load (tritonctl controller, real Triton)",
        "",
        f"`python bench/self_heal.py --duration {args.duration:g} --rate-scale {args.rate_scale:g}` on "
        f"{cpu_fingerprint()['model']} ({os.cpu_count()} vCPU): the CPU demo cluster at {args.rate_scale:g}x "
        "its rates, `spread` plan, controller interval 1 s, Poisson traffic from tritonctl's client throughout.",
        "",
        "| kill -9 of | at s | heal decided after s | heal apply took s | served again after s | failed requests |",
        "|---|---|---|---|---|---|",
    ]
    for (what, at), decision in zip(kills, decisions, strict=False):
        watched = [by_model[victim]] if what.startswith("instance") else results
        again = max(served_again(r, at) for r in watched)
        until = min(at + again, args.duration)
        failed = sum(sum(1 for t in r.failed_at_s if at <= t <= until + 1) for r in results)
        lines.append(
            f"| {what} | {at:.1f} | {decision['time'] - origin - at:.1f} | {decision['took_s']:.1f} | "
            f"{again:.1f} | {failed} |"
        )
    lines += ["", "Whole run, per model:", "", "```", format_results(results), "```", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "self-heal.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

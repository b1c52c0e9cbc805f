"""`tritonctl demo` while another process burns one core, checked by tritonctl's client and by perf_analyzer.

    python bench/burned_core.py [--duration 30] [-o bench/results/burned-core]

A Python busy loop (`while True: pass`, one core) runs from before the demo's calibration to the
end. The demo's calibrated latency model is deleted first, so the calibration, the rate the demo
picks and the plan all see the busy core. The demo then loads its plan with tritonctl's client,
and perf_analyzer loads it again; the deployment is stopped at the end. Writes `burned-core.md`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from cpu_demo import CLUSTER, REPO

from tritonctl.latency.device import cpu_fingerprint
from tritonctl.spec import load_cluster


def tritonctl(*argv: str) -> str:
    run = subprocess.run([sys.executable, "-m", "tritonctl", *argv], capture_output=True, text=True, cwd=REPO)
    if run.returncode not in (0, 1):
        raise SystemExit(f"tritonctl {' '.join(argv)} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return run.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of traffic per tool (default 30)")
    parser.add_argument("-o", "--out", type=Path, default=REPO / "bench" / "results" / "burned-core")
    args = parser.parse_args()
    state = load_cluster(CLUSTER).resolve(load_cluster(CLUSTER).spec.runtime.state_dir)
    for calibrated in state.glob("latency-model.*.json"):
        calibrated.unlink()
    plan = CLUSTER.parent / "plan.yaml"
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        demo = tritonctl("demo", "--duration", f"{args.duration:g}")
        perf = tritonctl("load", str(plan), "--tool", "perf_analyzer", "--duration", f"{args.duration:g}")
    finally:
        burner.kill()
        tritonctl("down", str(plan))
    said = ("serves the demo", "held-out", "reserving")
    picked = [line for line in demo.splitlines() if any(part in line for part in said)]
    own = demo[demo.index("sending Poisson traffic") :].split("\n\nThe deployment")[0]
    lines = [
        "# The demo with one core burned",
        "",
        f"`python bench/burned_core.py --duration {args.duration:g}` on {cpu_fingerprint()['model']} "
        f"({os.cpu_count()} vCPU): a Python busy loop on one core from the calibration to the end.",
        "",
        *picked,
        "",
        "tritonctl's client:",
        "",
        "```",
        own.strip(),
        "```",
        "",
        "perf_analyzer:",
        "",
        "```",
        perf.strip(),
        "```",
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "burned-core.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

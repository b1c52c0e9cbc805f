"""onnxruntime's spinning intra-op threads on a shared CPU: the demo's best plan with spinning on and off.

    python bench/ort_spinning.py [--duration 20] [--policy search]

The CPU demo cluster is planned with `--policy` on the committed latency model and applied on
the real local Triton twice: with onnxruntime's default (intra-op threads spin while they wait
for work, TRITONCTL_ORT_SPINNING=1) and with tritonctl's rendering (no spinning). Each run
gets the same open-loop Poisson traffic from tritonclient.grpc; the table gives the CPU
seconds the Python backend stubs (where onnxruntime runs) used per request and the share of
each model's requests answered within its SLO. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cpu_demo import REPO, applied, plan_demo

from tritonctl.deploy.local import cpu_seconds
from tritonctl.triton.client import endpoints, run_load

PLAN = REPO / ".tritonctl" / "ort-spinning" / "plan.yaml"
STUB = "triton_python_b"  # the Python backend stub's process name, as the kernel truncates it


def stub_cpu_s() -> float:
    """CPU seconds (user + system) used so far by every running Python backend stub."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == STUB:
                total += cpu_seconds(int(proc.name))
        except OSError:
            continue  # gone meanwhile
    return total


def measure(spinning: str, duration_s: float) -> tuple[float, list]:
    os.environ["TRITONCTL_ORT_SPINNING"] = spinning
    with applied(PLAN) as loaded:
        before = stub_cpu_s()
        results = run_load(endpoints(loaded.plan), duration_s)
        used = stub_cpu_s() - before
    return used / max(1, sum(r.ok for r in results)), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of traffic per run")
    parser.add_argument("--policy", default="search", help="the plan to apply")
    args = parser.parse_args()
    plan_demo(args.policy, out=PLAN)
    rows = [(spinning, *measure(spinning, args.duration)) for spinning in ("1", "0")]
    names = [r.model for r in rows[0][2]]
    print(f"\n{'spinning':>8} {'stub CPU ms/request':>19} {'goodput/s':>9} " + " ".join(f"{n:>14}" for n in names))
    for spinning, cpu, results in rows:
        good = sum(r.within_slo * r.sent for r in results) / args.duration
        print(
            f"{'on' if spinning == '1' else 'off':>8} {1000 * cpu:19.1f} {good:9.1f} "
            + " ".join(f"{100 * r.within_slo:13.1f}%" for r in results)
        )
    print("(per model: requests answered within the SLO)")


if __name__ == "__main__":
    main()

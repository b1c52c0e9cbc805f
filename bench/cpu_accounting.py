"""Where the CPU goes while the demo plan serves its load: CPU seconds per process, against the simulator's work.

    python bench/cpu_accounting.py [--duration 60] [--rate-scale 1]

Applies the CPU demo's `search` plan (what `make demo` deploys) on the real local Triton,
drives it with open-loop Poisson traffic from tritonclient.grpc (this process) at the
scaled demo rates, and reads every process's user + system CPU time from /proc before and
after. Printed: CPU seconds of the load generator, HAProxy, the tritonserver processes
and their Python-backend processes (which run the models), and the device time the
simulator counts as work for the same requests (each request's batch time alone plus its
wake-up), in CPU seconds on the device's cores. The deployment is stopped at the end. Run
it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from cpu_demo import MODEL, applied, plan_demo

from tritonctl.deploy.local import cpu_seconds
from tritonctl.latency.model import load_latency_model
from tritonctl.triton.client import endpoints, run_load


def every_process() -> dict[int, tuple[str, float]]:
    """(command line, user + system CPU seconds) of every process now."""
    out = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:  # gone meanwhile
            continue
        out[pid] = (cmd, cpu_seconds(pid))
    return out


def group(cmd: str) -> str:
    if "triton_python_backend_stub" in cmd:
        return "Python-backend processes (the models)"
    if "tritonserver" in cmd:
        return "tritonserver"
    if "haproxy" in cmd:
        return "proxy"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiplier of the demo rates")
    args = parser.parse_args()
    with applied(plan_demo()) as loaded:
        plan = loaded.plan
        before, mine = every_process(), os.times()
        started = time.perf_counter()
        results = run_load(endpoints(plan), args.duration, args.rate_scale)
        wall = time.perf_counter() - started
        after, mine_after = every_process(), os.times()
    used = {"load generator (this process)": mine_after.user + mine_after.system - mine.user - mine.system}
    for pid, (cmd, seconds) in after.items():
        if pid == os.getpid():
            continue
        key = group(cmd)
        used[key] = used.get(key, 0.0) + seconds - before.get(pid, (cmd, 0.0))[1]
    device = plan.devices[0]
    lm = load_latency_model(MODEL)
    work_ms = sum(
        len(r.latencies_ms) * (lm.t_inf(r.model, 1, device.units) + lm.wake_ms(r.model, 1000 / r.throughput))
        for r in results
        if r.throughput
    )
    answered = sum(len(r.latencies_ms) for r in results)
    print(f"\n{answered} requests answered in {wall:.1f} s at {args.rate_scale:g}x the demo rates")
    print(f"CPU seconds ({device.cores:g} cores x {wall:.0f} s = {device.cores * wall:.0f} available):")
    for key, seconds in sorted(used.items(), key=lambda kv: -kv[1]):
        print(f"  {seconds:7.1f}  {key}")
    print(
        f"  {device.cores * work_ms / 1000:7.1f}  the simulator's work for the same requests "
        "(batch time alone + wake-up at the mean gap, on every core)"
    )


if __name__ == "__main__":
    main()

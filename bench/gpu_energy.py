"""The energy objective on the GPU, measured: the throughput-first plan and the energy plan of examples/gpu-one,
each applied through the local runtime (real Triton under MPS) and loaded by perf_analyzer at the planned rates,
the GPU's energy counter read around each load.

    bash bench/gpu_host.sh gpu_energy.py OUT [--duration 20]     # on the GPU host

Both plans use search's placement and the H100 stand-in latency model calibrated to Triton on this GPU first
(`tritonctl calibrate`, about two minutes); the energy plan then takes the SM clock
and batch sizes of least predicted power (profiles/gpu-energy/energy-model.json, `tritonctl fit-energy`), and
its apply locks that clock. The energy plan is applied over the running throughput plan (a clock lock and
in-place reloads); `down` resets the clock. Writes OUT/summary.json and OUT/log.txt, and the two plans.
"""

from __future__ import annotations

import json
import sys
import time

from gpu_triton import CLUSTER, REPO, calibrated, gpu_description, start

ENERGY_MODEL = REPO / "profiles" / "gpu-energy" / "energy-model.json"


def main() -> None:
    args, out, run, work = start(420, "gpu-energy-work")
    plans = {"throughput": work / "plan-throughput.yaml", "energy": work / "plan-energy.yaml"}

    def plan():
        run.cli("export", str(CLUSTER))
        common = ["--policy", "search", "--latency-model", str(calibrated(run, work))]
        said = {"throughput": run.cli("plan", str(CLUSTER), *common, "-o", str(plans["throughput"]))}
        energy = ["--objective", "energy", "--energy-model", str(ENERGY_MODEL)]
        said["energy"] = run.cli("plan", str(CLUSTER), *common, *energy, "-o", str(plans["energy"]))
        for path in plans.values():
            (out / path.name).write_text(path.read_text())
        return {name: text.strip().splitlines()[-5:] for name, text in said.items()}

    if run.stage("plan", plan) is None:
        return

    def clock() -> str:
        return gpu_description("clocks.sm,clocks.max.sm,power.draw")

    def applied_and_loaded(name: str):
        t0 = time.monotonic()
        applied = run.cli("apply", str(plans[name]), "--accept-misses", timeout_s=300).strip().splitlines()[-3:]
        took = round(time.monotonic() - t0, 1)
        loaded_at = clock()
        text = run.cli(
            "load", str(plans[name]), "--tool", "perf_analyzer", "--duration", f"{args.duration:g}", "--format",
            "json", timeout_s=args.duration * 4 + 60,
        )  # fmt: skip
        return {"apply_s": took, "apply": applied, "clock_before_load": loaded_at, "load": json.loads(text)}

    run.stage("throughput plan", lambda: applied_and_loaded("throughput"), min_left_s=args.duration + 60)
    run.stage("energy plan", lambda: applied_and_loaded("energy"), min_left_s=args.duration + 40)
    run.stage(
        "down",
        lambda: {"down": run.cli("down", str(plans["energy"])).strip().splitlines()[-2:], "clock_after": clock()},
        min_left_s=5,
    )
    run.log("done")


if __name__ == "__main__":
    sys.exit(main())

"""The GPU runs' tables, from what they wrote: bench/results/gpu-triton and bench/results/gpu-energy.

    python bench/gpu_report.py [-o bench/results/gpu-report.md]

Both runs are on one H100 (the device lent here), through `bench/gpu_host.sh` (gpu_triton.py, gpu_energy.py):
real Triton from the trimmed bundle, one process per instance, MPS shares, HAProxy in front, perf_analyzer and
tritonctl's own client at the planned rates. Nothing here is measured again: this reads the committed files.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import yaml

from tritonctl.latency.energy import load as load_energy_model

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def _summary(run: str) -> dict:
    return json.loads((RESULTS / run / "summary.json").read_text())


def _plan(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def serving(lines: list[str]) -> None:
    run = _summary("gpu-triton")
    stages = run["stages"]
    plan = _plan(RESULTS / "gpu-triton" / "plan.yaml")
    replay = {}
    for line in stages["stand-in replay"]["result"]["tail"]:
        found = re.search(r" (\S+)-0: (\d+)/(\d+) served, p99 ([\d.]+) ms", line)
        if found:
            replay[found[1]] = (int(found[2]) / int(found[3]), float(found[4]))
    pa = {m["model"]: m for m in stages["perf_analyzer"]["result"]["models"]}
    own = {m["model"]: m for m in stages["own client"]["result"]["models"]}
    lines += [
        "## A tritonctl plan served by real Triton on the GPU",
        "",
        f"{run['host']['gpu']}; {run['host']['cpus']} CPU cores; torch {run['host']['torch']}. examples/gpu-one "
        "planned by search with the H100 stand-in latency model; `tritonctl apply` (local runtime: MPS daemon, one "
        "tritonserver per instance at its MPS share, the PyTorch CUDA-graph glue, HAProxy); 20 s of open-loop "
        "Poisson load at the planned rates, all four models at once.",
        "",
        "| model | share | batch | SLO ms | rate/s | predicted p99 | simulated p99 (in SLO) | stand-in replay p99 "
        "(served) | perf_analyzer ok/s | p50 | p99 | in SLO | own client p99 | in SLO |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in plan["models"]:
        p = m["placements"][0]
        a, o = pa[m["name"]], own[m["name"]]
        served, rp99 = replay.get(m["name"], (None, None))
        lines.append(
            f"| {m['name']} | {p['share']} | {p['batch']} | {m['slo_ms']:g} | {m['rate']:g} | "
            f"{p['predicted']['latency_ms']:.1f} | {m['simulated_p99_ms']:.1f} ({_pct(m['simulated_in_slo'])}) | "
            f"{rp99:.1f} ({_pct(served)}) | {a['ok_rps']:.0f} | {a['p50_ms']:.1f} | {a['p99_ms']:.1f} | "
            f"{_pct(a['within_slo'])} | {o['p99_ms']:.1f} | {_pct(o['within_slo'])} |"
        )
    swap = stages["swap under load"]["result"]
    lines += [
        "",
        f"Apply: {stages['apply']['result']['apply'][-1].strip()}. perf_analyzer: "
        f"{sum(m['ok'] for m in pa.values()):,} of {sum(m['sent'] for m in pa.values()):,} requests answered.",
        "",
        f"**Shadow swap and batch-only reload under load** (own client at {swap['rate_scale']:g} x the rates): "
        f"{swap['sent']} requests, **{swap['failed']} failed**; resnet50's share changed (a new process, warmed, "
        f"then the old one drained) in {swap['took_s']['swap']:.1f} s, then its batch reloaded in place in "
        f"{swap['took_s']['reload']:.1f} s.",
        "",
        "## Profile through real Triton against the stand-in",
        "",
        "Every model at share 25, closed loop, one request of the batch at a time through HAProxy and tritonctl's "
        "client (40 requests; the others idle), against the stand-in profile's solo p50 at the same point "
        "(profiles/inss-gpu: CUDA graphs in an MPS client, pinned host copies, no Triton, no gRPC).",
        "",
    ]
    rows = stages["profile through triton"]["result"]
    split = all("direct_p50_ms" in row for row in rows)  # straight to the instance, and Triton's own counters
    lines += [
        "| model | batch | Triton p50 ms | Triton p99 ms | stand-in p50 ms | Triton / stand-in |"
        + (" straight to the instance p50 ms | Triton's compute / queueing per request ms |" if split else ""),
        "|---" * (8 if split else 6) + "|",
    ]
    for row in rows:
        ratio = row["triton_p50_ms"] / row["standin_p50_ms"] if row["standin_p50_ms"] else None
        line = (
            f"| {row['model']} | {row['batch']} | {row['triton_p50_ms']:.2f} | {row['triton_p99_ms']:.2f} | "
            f"{row['standin_p50_ms']:.2f} | {ratio:.1f}x |"
        )
        if split:
            line += f" {row['direct_p50_ms']:.2f} | {row['server_compute_ms']:.2f} / {row['server_queue_ms']:.2f} |"
        lines.append(line)


def energy(lines: list[str]) -> None:
    run = _summary("gpu-energy")["stages"]
    plans = {n: _plan(RESULTS / "gpu-energy" / f"plan-{n}.yaml") for n in ("throughput", "energy")}
    model = load_energy_model(REPO / "profiles" / "gpu-energy" / "energy-model.json")
    lines += [
        "",
        "## Energy objective against the throughput-first plan",
        "",
        "The same placement (search, share 25 each); the energy plan's SM clock and batches from "
        "profiles/gpu-energy/energy-model.json, the clock locked by `tritonctl apply`. Each plan applied and loaded "
        "by perf_analyzer at the planned rates for 20 s; joules from NVML's total-energy counter around the load "
        "(the whole GPU, idle power included), per answered request. Predicted: the energy model's energy per image "
        "at each model's batch and the clock (the sweep's top clock where none is locked), weighted by the rates: "
        "the GPU busy with that model alone, so neither idle time nor co-location is in it.",
        "",
        "| plan | SM clock | batches | GPU joules | answered | mJ/request | predicted mJ/request | in SLO per model |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("throughput", "energy"):
        result = run[f"{name} plan"]["result"]
        load = result["load"]
        plan = plans[name]
        answered = sum(m["ok"] for m in load["models"])
        batches = "/".join(str(m["placements"][0]["batch"]) for m in plan["models"])
        clock_mhz = plan["devices"][0].get("clock_mhz") or model.clocks[-1]  # unlocked: the sweep's top clock
        predicted = [
            model.joules_per_image(m["source"], m["placements"][0]["batch"], clock_mhz) for m in plan["models"]
        ]
        rates = [m["rate"] for m in plan["models"]]
        mean = f"{1000 * sum(p * r for p, r in zip(predicted, rates, strict=True)) / sum(rates):.1f}"
        clock = plan["devices"][0].get("clock_mhz") or "driver's"
        in_slo = " / ".join(f"{m['model']} {_pct(m['within_slo'])}" for m in load["models"])
        lines.append(
            f"| {name} | {clock} (read {result['clock_before_load'].split(',')[0]}) | {batches} | "
            f"{load['gpu_joules']:.0f} | {answered} | {1000 * load['joules_per_request']:.1f} | {mean} | {in_slo} |"
        )
    t, e = (run[f"{n} plan"]["result"]["load"]["joules_per_request"] for n in ("throughput", "energy"))
    lines += ["", f"Energy per request: **{100 * (e / t - 1):+.0f}%** with the energy plan."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=str(RESULTS / "gpu-report.md"))
    args = parser.parse_args()
    lines = [
        "# Real Triton on an H100: the GPU runs' figures",
        "",
        "`python bench/gpu_report.py` (from the run folders).",
        "",
    ]
    serving(lines)
    energy(lines)
    Path(args.output).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

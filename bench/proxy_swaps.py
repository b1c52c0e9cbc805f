"""Consecutive shadow swaps through HAProxy while perf_analyzer loads every model.

    python bench/proxy_swaps.py [--swaps 20] [--rate-scale 0.15] [--latency-model LM] [--swap-seconds 6]
        [-o bench/results/proxy-swaps]

The CPU demo cluster at `--rate-scale` times its rates (0.15: what `spread` serves on a 2-vCPU
Intel Xeon) is planned with `spread`, or with `search` given a latency model of this CPU (the
one `make demo` calibrates serves the demo's own rates), and applied (own ports and state). NVIDIA perf_analyzer
(or tritonctl's client, `--tool tritonctl`) then sends Poisson traffic to every model at once
while `--swaps` applies alternate MobileNetV2's share between two values, each a shadow swap:
a new Triton process starts and warms, HAProxy adds it, drains the old one and deletes it, the
old process stops. Reported: each swap's duration, and per model over the whole run the requests
sent, failed, p99 and the share within the SLO. Writes `proxy-swaps-<tool>.md`, or with
`--swaps 0` (the same traffic, no swap: the baseline) `no-swaps-<tool>.md`.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import yaml
from cpu_demo import CLUSTER, REPO

from tritonctl.controller.metrics import scrape_proxy
from tritonctl.deploy.apply import apply_plan, down
from tritonctl.deploy.local import LocalRuntime
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import load_plan, save_plan
from tritonctl.planning.planner import make_plan
from tritonctl.spec import load_cluster
from tritonctl.triton.binary import find_tritonserver
from tritonctl.triton.client import endpoints, format_results, run_load
from tritonctl.triton.perf_analyzer import find_perf_analyzer, run_perf_analyzer

WORK = REPO / ".tritonctl" / "proxy-swaps"
LEAD_S = 10.0  # traffic before the first swap and after the last
SWAP_S = 6.0  # traffic allowed per swap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, default=20, help="shadow swaps to apply (default 20; 0: the baseline)")
    parser.add_argument("--rate-scale", type=float, default=0.15, help="times the demo's rates (default 0.15)")
    parser.add_argument("--base-port", type=int, default=8600, help="first model port (default 8600)")
    parser.add_argument("--tool", choices=["perf_analyzer", "tritonctl"], default="perf_analyzer", help="load")
    parser.add_argument(
        "--swap-seconds", type=float, default=SWAP_S, help=f"traffic allowed per swap (default {SWAP_S:g})"
    )
    parser.add_argument("--latency-model", type=Path, help="plan with `search` on this latency model (default: spread)")
    parser.add_argument("-o", "--out", type=Path, default=REPO / "bench" / "results" / "proxy-swaps")
    args = parser.parse_args()
    cluster = (
        load_cluster(CLUSTER)
        .with_rates(lambda m: m.rate * args.rate_scale)
        .with_runtime(base_port=args.base_port, state_dir=str(WORK / "state"))
    )
    base = WORK / "plan.yaml"
    lm = load_latency_model(args.latency_model) if args.latency_model else None
    policy = "spread" if lm is None else "search"
    save_plan(make_plan(cluster, materialize(cluster, log=lambda _: None), policy, base, lm, log=lambda _: None), base)
    data = yaml.safe_load(base.read_text())
    share = data["models"][0]["placements"][0]["share"]
    taken_in_turns = share == data["devices"][0]["units"]  # then every instance has the whole device
    variants = []
    for i, value in enumerate((share - 2, share)):
        if taken_in_turns:  # the device shrinks by two units, so each instance taking turns is swapped
            data["devices"][0]["units"] = value
            for model in data["models"]:
                for placement in model["placements"]:
                    placement["share"] = value
        else:
            data["models"][0]["placements"][0]["share"] = value
        variants.append(base.with_name(f"plan-{i}.yaml"))
        variants[-1].write_text(yaml.safe_dump(data, sort_keys=False))
    loaded = load_plan(base)
    runtime = LocalRuntime(find_tritonserver(loaded.plan.runtime.tritonserver), loaded.state_dir)
    perf_analyzer = find_perf_analyzer() if args.tool == "perf_analyzer" else None
    apply_plan(loaded, runtime, log=lambda _: None)
    took: list[float] = []
    try:
        duration = 2 * LEAD_S + args.swap_seconds * (args.swaps or 20)  # the baseline runs as long as 20 swaps
        results: list = []
        failed: list[str] = []
        targets = endpoints(loaded.plan)

        def send() -> None:
            try:
                results.extend(
                    run_perf_analyzer(perf_analyzer, targets, duration, 1.0, WORK / "perf_analyzer")
                    if perf_analyzer
                    else run_load(targets, duration, 1.0)
                )
            except TritonctlError as exc:
                failed.append(str(exc))

        load = threading.Thread(target=send)
        load.start()
        started = time.monotonic()
        time.sleep(LEAD_S)
        for i in range(args.swaps):
            began = time.monotonic()
            apply_plan(load_plan(variants[i % 2]), runtime, log=lambda _: None)
            took.append(time.monotonic() - began)
            print(f"swap {i + 1}: {took[-1]:.1f} s", flush=True)
            time.sleep(max(0.0, args.swap_seconds - took[-1]))
        outlasted = time.monotonic() - started > duration  # the last swap ended after the traffic
        load.join()
        at_proxy = scrape_proxy(runtime.proxy_metrics_url()) or {}  # HAProxy's own count, whatever the client says
    finally:
        down(loaded.state_dir, runtime, log=lambda _: None)
    table = format_results(results) if results else f"{args.tool} stopped: {failed[0]}"
    names = {m.port: m.name for m in loaded.plan.models}
    counted = ", ".join(
        f"{names[port]} {v['requests']:.0f} requests, {v['errors']:.0f} errors" for port, v in sorted(at_proxy.items())
    )
    lines = [
        f"# Shadow swaps through HAProxy under {args.tool}"
        if args.swaps
        else f"# The same traffic, no swap ({args.tool})",
        "",
        f"`python bench/proxy_swaps.py --swaps {args.swaps} --rate-scale {args.rate_scale:g} --tool {args.tool}"
        + (f" --latency-model {args.latency_model}` on " if lm else "` on ")
        + "{model} (id {id}): ".format(**cpu_fingerprint())
        + f"the demo cluster at {args.rate_scale:g}x "
        f"its rates, `{policy}` plan; "
        + ("the device taken in turns (every instance's share)" if taken_in_turns else "MobileNetV2's share")
        + f" alternating {share - 2} / {share} units.",
        "",
        (
            f"{len(took)} swaps, {min(took):.1f}-{max(took):.1f} s each (median {sorted(took)[len(took) // 2]:.1f} s), "
            if took
            else "No swap (the baseline), "
        )
        + f"during {duration:.0f} s of {args.tool}'s traffic"
        + (" (the swaps outlasted it: raise --swap-seconds):" if outlasted else ":"),
        "",
        "```",
        table,
        "```",
        "",
        f"HAProxy's own counters over the run (errors: 5xx answers, failed connections and responses): {counted}.",
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"proxy-swaps-{args.tool}.md" if args.swaps else f"no-swaps-{args.tool}.md"
    (args.out / name).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

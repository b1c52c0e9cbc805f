"""Shadow swaps and in-place reloads on the real local Triton while Poisson traffic flows.

    python bench/swap_under_load.py [--duration 45] [--rate-scale 1] [-o bench/results/swap]

The CPU demo cluster is planned with `spread` (equal shares, batch 1) and applied. Open-loop
Poisson traffic at the demo rates then runs through tritonclient.grpc, one address per
model, while three changes are applied, each once the previous one has settled:

1. swap one:  mobilenet_v2's share changes: a new process starts, warms, takes the traffic,
              the old one drains and stops;
2. reload:    mobilenet_v2's batch size and queue delay change: reloaded in place;
3. swap all:  every model's share changes at once.

Reported per change: how long it took, and each model's p99 latency over the requests
answered while it ran (against the SLO); for the whole run, failed requests. Writes
`swap.md` and `timeline.png` (latency of every request over time, changes shaded).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import yaml
from cpu_demo import CLUSTER, REPO
from matplotlib.figure import Figure

from tritonctl.deploy.apply import apply_plan, down
from tritonctl.deploy.local import LocalRuntime
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.planning.plan import load_plan, save_plan
from tritonctl.planning.planner import make_plan
from tritonctl.spec import load_cluster
from tritonctl.triton.binary import find_tritonserver
from tritonctl.triton.client import LoadResult, endpoints, run_load

WORK = REPO / ".tritonctl" / "swap-bench"


def variant(base: Path, name: str, changes: dict[str, dict]) -> Path:
    """A copy of the plan at `base` with placement fields changed per model (first placement)."""
    data = yaml.safe_load(base.read_text())
    for model in data["models"]:
        model["placements"][0].update(changes.get(model["name"], {}))
    path = base.with_name(f"plan-{name}.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of traffic (default 45)")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the demo rates (default 1)")
    parser.add_argument("--base-port", type=int, default=8300, help="first model port (default 8300)")
    parser.add_argument("-o", "--output", default=str(REPO / "bench" / "results" / "swap"), help="output folder")
    args = parser.parse_args()
    demo = load_cluster(CLUSTER)
    # Own ports and state, so it can run beside a demo deployment.
    cluster = demo.with_runtime(base_port=args.base_port, state_dir=str(WORK / "state"))
    WORK.mkdir(parents=True, exist_ok=True)
    base = WORK / "plan-base.yaml"
    plan = make_plan(cluster, materialize(cluster, log=lambda _: None), "spread", base, log=lambda _: None)
    save_plan(plan, base)
    shares = {m.name: m.placements[0].share for m in plan.models}
    first = plan.models[0].name
    plans = [
        ("swap one", variant(base, "swap-one", {first: {"share": shares[first] - 3}})),
        ("reload", variant(base, "reload", {first: {"share": shares[first] - 3, "batch": 2, "queue_delay_us": 2000}})),
        (
            "swap all",
            variant(
                base,
                "swap-all",
                {
                    m: {"share": s - 2, "batch": 2, "queue_delay_us": 2000} if m == first else {"share": s - 2}
                    for m, s in shares.items()
                },
            ),
        ),
    ]
    loaded = load_plan(base)
    triton = LocalRuntime(find_tritonserver(plan.runtime.tritonserver), loaded.state_dir)
    down(loaded.state_dir, triton, log=lambda _: None)
    apply_plan(loaded, triton, log=print)
    results: list[LoadResult] = []
    origin = time.perf_counter()
    load = threading.Thread(
        target=lambda: results.extend(run_load(endpoints(plan), args.duration, args.rate_scale)), daemon=True
    )
    load.start()
    windows = []
    for i, (name, path) in enumerate(plans):
        time.sleep(max(0.0, origin + 5 + i * args.duration / 3.5 - time.perf_counter()))
        began = time.perf_counter() - origin
        print(f"== {name} at t={began:.1f} s")
        try:
            apply_plan(load_plan(path), triton, log=print)
            outcome = "applied"
        except TritonctlError as exc:  # rolled back: the old instances keep serving; counted, not hidden
            print(f"error: {exc}")
            outcome = f"rolled back: {str(exc).splitlines()[0][-90:]}"
        windows.append((name, began, time.perf_counter() - origin, outcome))
    load.join()
    down(loaded.state_dir, triton, log=lambda _: None)
    report(results, windows, args, Path(args.output))


def report(results: list[LoadResult], windows: list, args, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    failed = sum(len(r.errors) for r in results)
    lines = [
        "# Shadow swaps and reloads under load (real Triton, CPU)",
        "",
        f"`python bench/swap_under_load.py --duration {args.duration:g} --rate-scale {args.rate_scale:g}`; "
        "2-core VM, local runtime, cgroup CPU quotas.",
        "",
        f"Requests sent: {sum(r.sent for r in results)}, failed: **{failed}**"
        + (f" (first: {next(e for r in results for e in r.errors)})" if failed else ""),
        "",
        "| change | outcome | start s | took s | failed | "
        + " | ".join(f"{r.model} p99 ms (SLO {r.slo_ms:g})" for r in results)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(results),
    ]
    for name, began, ended, outcome in windows:
        failed_in = sum(began <= t <= ended + 1 for r in results for t in r.failed_at_s)
        p99 = " | ".join(f"{r.percentile(99, (began, ended)):.1f}" for r in results)
        lines.append(f"| {name} | {outcome} | {began:.1f} | {ended - began:.1f} | {failed_in} | {p99} |")
    whole = " | ".join(f"{r.percentile(99):.1f}" for r in results)
    lines += [f"| (whole run) | | 0 | {args.duration:g} | {failed} | {whole} |", "", "![timeline](timeline.png)", ""]
    (out / "swap.md").write_text("\n".join(lines))
    print("\n".join(lines))
    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    for r in results:
        ax.scatter(r.answered_at_s, r.latencies_ms, s=4, label=f"{r.model} (SLO {r.slo_ms:g} ms)")
    for name, began, ended, _ in windows:
        ax.axvspan(began, ended, alpha=0.15, color="grey")
        ax.text(began, ax.get_ylim()[1] * 0.95, name, fontsize=8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("latency (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)


if __name__ == "__main__":
    main()

"""Does HAProxy's CPU weight matter? One plan, loaded with HAProxy at the largest cgroup weight (as `apply`
starts it), at the kernel's default weight, and bypassed (straight at the instances), in turn.

    python bench/proxy_priority.py CLUSTER --latency-model LM --out DIR [--scale 0.75] [--rounds 3]
        [--duration 20] [--tools perf_analyzer tritonctl]

Plans the cluster at its rates x `--scale` with `search` (as real_load.py's `best-replan`), applies it,
then runs `--rounds` rounds; in each, every path is loaded in turn by every tool (open-loop Poisson, all
models at once), HAProxy's cgroup weight set just before its runs. Per path, tool and model: p99 and the
share of requests within the SLO, each round, to DIR/results.json and DIR/summary.md. Needs writable
cgroups (root); run it on a quiet machine.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from real_load import plan_for, rounds_bench, rounds_cell, run_once, targets_of, write_rounds

from tritonctl.cli import main as tritonctl
from tritonctl.deploy import share
from tritonctl.deploy.local import PROXY_FILE
from tritonctl.planning.plan import load_plan
from tritonctl.shares import MAX_WEIGHT

DEFAULT_WEIGHT = 100  # cgroup v2's default cpu.weight (v1: cpu.shares 1024)
PATHS = {"haproxy-max": MAX_WEIGHT, "haproxy-default": DEFAULT_WEIGHT, "direct": None}


def main() -> None:
    args, raw, cpu, pa = rounds_bench(__doc__, 0.75, "proxy-priority.")  # perf_analyzer's logs in raw: not kept
    plan_path = plan_for("best", args.cluster, args.latency_model, args.out, args.scale)
    assert tritonctl(["apply", str(plan_path), "--accept-misses"]) == 0
    rows = []
    try:
        record = json.loads((load_plan(plan_path).state_dir / PROXY_FILE).read_text())
        if not record.get("cgroup"):
            raise SystemExit("HAProxy runs outside a cgroup here (cgroups not writable): nothing to compare")
        group = Path(record["cgroup"])
        for rnd in range(args.rounds):
            for name, weight in PATHS.items():
                if weight is not None:
                    share.set_weight(group, weight)
                targets = targets_of("best-direct" if weight is None else "best", plan_path, args.scale)
                for tool in args.tools:
                    for r in run_once(name, tool, args.scale, targets, {}, args, pa, raw):
                        rows.append({**asdict(r), "round": rnd})
    finally:
        tritonctl(["down", str(plan_path)])
        shutil.rmtree(raw, ignore_errors=True)
    write_rounds(args, rows, summary(rows, f"{cpu['model']} (id {cpu['id']})", args))


def summary(rows: list[dict], cpu: str, args) -> str:
    models = list(dict.fromkeys(r["model"] for r in rows))
    lines = [
        f"CPU: {cpu}; {args.cluster.name} at {args.scale:g}x its rates, {args.rounds} rounds of {args.duration:g} s",
        "",
        "Per model: p99 ms (median over the rounds, each round's in brackets), % within the SLO over all rounds",
        "",
        "| path | tool | " + " | ".join(models) + " |",
        "|" + "---|" * (2 + len(models)),
    ]
    for name in PATHS:
        for tool in args.tools:
            cells = [rounds_cell(rows, name, tool, m) for m in models]
            lines.append(f"| {name} | {tool} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

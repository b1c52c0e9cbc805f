"""Do the priority ranks of instances taking turns with a CPU hold under load? One plan, loaded with its
instances as `apply` starts them (each rank a level down the ladder of idle cgroups), then with each instance's
Triton server process (its front end) moved out of the ladder into one top-level cgroup and only its Python
backend stubs (the model) left ranked, then with the instances moved into flat cgroups weighing a tenth apart
by rank (what a kernel without `cpu.idle` gets), then into flat cgroups of the kernel's default weight
(unranked), each with its quota, in turn.

    python bench/turn_ladder.py CLUSTER --latency-model LM --out DIR [--scale 1] [--rounds 3]
        [--duration 20] [--tools perf_analyzer tritonctl]

Plans the cluster at its rates x `--scale` with `search` (as real_load.py's `best-replan`), applies it, then
runs `--rounds` rounds; in each, every arrangement is loaded in turn by every tool (open-loop Poisson, all
models at once), the instances' processes moved between cgroups just before its runs. Per arrangement, tool
and model: p99 and the share of requests within the SLO, each round, beside the plan's simulated p99, to
DIR/results.json and DIR/summary.md. Needs writable cgroups (root); run it on a quiet machine.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

from real_load import plan_for, predicted_p99, rounds_bench, rounds_cell, run_once, targets_of, write_rounds

from tritonctl.cli import main as tritonctl
from tritonctl.deploy import share
from tritonctl.deploy.state import load_state
from tritonctl.planning.plan import load_plan
from tritonctl.shares import MAX_WEIGHT

ARRANGEMENTS = ("ladder", "fronts", "weights", "alike")
DEFAULT_WEIGHT = 100  # cgroup v2's default cpu.weight (v1: cpu.shares 1024)


def move(pids: set[int], group: Path) -> None:
    for pid in pids:
        (group / "cgroup.procs").write_text(str(pid))


def main() -> None:
    args, raw, cpu, pa = rounds_bench(__doc__, 1.0, "turn-ladder.")  # perf_analyzer's logs in raw: not kept
    plan_path = plan_for("best", args.cluster, args.latency_model, args.out, args.scale)
    layout = load_plan(plan_path).plan.turn_layout()
    if not any(turn.rank for turn in layout.values()):
        raise SystemExit(f"{plan_path}: no instance takes turns below rank 0: nothing to compare")
    predicted = predicted_p99(plan_path)
    assert tritonctl(["apply", str(plan_path), "--accept-misses"]) == 0
    rows: list[dict] = []
    records = {r.instance: r for r in load_state(load_plan(plan_path).state_dir).instances.values()}
    ladder = {name: Path(r.cgroup) if r.cgroup else None for name, r in records.items()}  # as applied
    flat: dict[str, Path] = {}  # instance -> its flat cgroup
    fronts = None  # the Triton server processes' top-level cgroup
    stubs = {name: share.members(group) - {records[name].pid} for name, group in ladder.items() if group}

    def arrange(arrangement: str) -> None:
        for name, group in ladder.items():
            home = group if arrangement in ("ladder", "fronts") else flat[name]
            if arrangement in ("weights", "alike"):
                share.set_weight(home, weights[name] if arrangement == "weights" else DEFAULT_WEIGHT)
            move(stubs[name], home)
            move({records[name].pid}, fronts if arrangement == "fronts" else home)

    try:
        if not all(ladder.values()):
            raise SystemExit("the instances run outside cgroups here (cgroups not writable): nothing to compare")
        weights = {name: max(1, MAX_WEIGHT // 10 ** (layout[name].rank or 0)) for name in ladder}
        flat = {name: share.create(f"{group.name}.flat", *share.quota(group)) for name, group in ladder.items()}
        fronts = share.create(f"fronts.{load_plan(plan_path).plan.cluster}", None, None)
        targets = targets_of("best", plan_path, args.scale)
        for rnd in range(args.rounds):
            for arrangement in ARRANGEMENTS:
                arrange(arrangement)
                for tool in args.tools:
                    for r in run_once(arrangement, tool, args.scale, targets, predicted, args, pa, raw):
                        rows.append({**asdict(r), "round": rnd})
    finally:
        if flat and fronts:
            arrange("ladder")
        tritonctl(["down", str(plan_path)])
        for group in [*flat.values(), fronts]:
            share.remove(group)
        shutil.rmtree(raw, ignore_errors=True)
    write_rounds(args, rows, summary(rows, f"{cpu['model']} (id {cpu['id']})", args))


def summary(rows: list[dict], cpu: str, args) -> str:
    models = list(dict.fromkeys(r["model"] for r in rows))
    slo = {r["model"]: r["slo_ms"] for r in rows}
    simulated = {r["model"]: r["simulated_p99_ms"] for r in rows}
    lines = [
        f"CPU: {cpu}; {args.cluster.name} at {args.scale:g}x its rates, {args.rounds} rounds of {args.duration:g} s",
        "",
        "Per model: p99 ms (median over the rounds, each round's in brackets), % within the SLO over all rounds;",
        "a round where perf_analyzer stopped at a refused request counts 0% and no p99",
        "",
        "| arrangement | tool | " + " | ".join(f"{m} (SLO {slo[m]:g})" for m in models) + " |",
        "|" + "---|" * (2 + len(models)),
        "| the plan's simulation | | " + " | ".join(_ms(simulated[m]) for m in models) + " |",
    ]
    for arrangement in ARRANGEMENTS:
        for tool in args.tools:
            cells = [rounds_cell(rows, arrangement, tool, m) for m in models]
            lines.append(f"| {arrangement} | {tool} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()

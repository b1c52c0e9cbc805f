"""`tritonctl bench`: several policies on one cluster and workload, judged the same way.

Each policy plans the cluster with batches that fill up to their queue delay (`plan --batching
fill`, on a GPU too, unless `--batching` says otherwise; timed once the one-time queueing tables are
built), and its plan is simulated at the cluster's rates, a request that can only be late dropped
(`simulate --drop`). Reported per policy: planning time, models left unserved, placements the
latency model predicts to miss their SLO, planned capacity (sum of b / t_inf, the objective of InSS
problem (1)) and its share of a simple upper bound (every device's units spent on the model with the
best throughput per unit, interference ignored), the goodput the plan predicts and its share of the
`optimal` policy's plan's (where optimal is among the policies; optimal proves the optimum of eq.
2's goodput over search's layouts, while a plan's predictions run batches larger than one through
the dynamic batcher, so the share can pass 100%), and from the simulator throughput, goodput, SLO
violations, drops and devices used. The margins of the best of tritonctl's own policies over each
baseline are by simulated goodput (requests served within their SLO per second).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from tritonctl.errors import TritonctlError
from tritonctl.export import Artifact
from tritonctl.latency.ablation import ABLATIONS
from tritonctl.latency.energy import EnergyModel, clocked
from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.latency.queueing import warm_tables, without_queueing
from tritonctl.planning.energy import plan_joules
from tritonctl.planning.plan import Plan, save_plan
from tritonctl.planning.planner import devices_of, make_plan, sources_of
from tritonctl.planning.simulate import SimResult, simulate
from tritonctl.spec import Cluster


@dataclass(frozen=True)
class BenchRow:
    policy: str
    plan_ms: float
    capacity_rps: float
    of_bound: float
    throughput_rps: float
    goodput_rps: float
    violations: float  # share of arrived requests not served within the SLO
    drops: float
    devices: int
    unserved: int = 0
    predicted_misses: int = 0
    predicted_goodput_rps: float = 0.0  # what the plan itself predicts within the SLOs
    of_optimum: float | None = None  # predicted goodput over the optimal policy's (None: optimal not run)
    joules_per_request: float | None = None  # the energy model's estimate (GPU clusters benched with one)
    error: str = ""


OWN = ("search", "bda", "inss")  # tritonctl's policies; the rest are baselines or yardsticks
BASELINES = ("gpulet", "gslice", "igniter", "time-sharing", "spread")


def upper_bound_rps(cluster: Cluster, lm: LatencyModel) -> float:
    """Every device's units at the best throughput per unit any model reaches, interference ignored."""
    per_unit = max(
        1000 * b / lm.t_inf(m.name, b, s) / s
        for m in cluster.spec.models
        for b in range(1, MAX_BATCH + 1)
        for s in range(lm.models[m.name].share_range[0], lm.device.units + 1, 5)
    )
    return sum(d.units for d in devices_of(cluster)) * per_unit


def run_policies(
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    lm: LatencyModel,
    policies: list[str],
    out_dir: Path,
    duration_s: float,
    drop: bool = True,
    policy_file: Path | None = None,
    margin: float = 0.0,
    energy: EnergyModel | None = None,
    log: Callable[[str], None] = lambda _: None,
    batching: str = "fill",
) -> list[BenchRow]:
    """Plan with every policy (against `lm` with a latency margin, when one is given; batches as `batching`; plans
    saved in `out_dir`) and simulate each plan on `lm` itself at the cluster's rates, saying which policy is at work
    (`log`). With an `energy` model, each row says its joules per request too, and one more row is search's
    placement under the energy objective (simulated at its clock)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bound = upper_bound_rps(cluster, lm)
    planning_lm = lm.with_margin(margin)
    warm_tables(MAX_BATCH)  # the planning times below leave out this one-time cost
    rows = []
    for policy in policies:
        log(f"  {policy}: planning, then simulating {duration_s:g} s ...")
        row = _bench_row(policy, policy, cluster, artifacts, planning_lm, lm, out_dir, bound, duration_s, drop,
                         policy_file, energy, batching)  # fmt: skip
        rows.append(row)
    if energy is not None:
        label = "search, energy objective"
        planned = _plan(label, "search", cluster, artifacts, planning_lm, _plan_path(out_dir, label), energy=energy)
        plan = planned[1]
        sim_lm = lm if isinstance(plan, str) else clocked(lm, energy, plan.devices[0].clock_mhz, sources_of(cluster))
        rows.append(_simulated(planned, cluster, sim_lm, bound, duration_s, drop, energy))
    optimum = next((r.predicted_goodput_rps for r in rows if r.policy == "optimal" and not r.error), 0.0)
    return [dataclasses.replace(r, of_optimum=r.predicted_goodput_rps / optimum) if optimum > 0 else r for r in rows]


def run_ablations(
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    lm: LatencyModel,
    out_dir: Path,
    duration_s: float,
    policy: str = "search",
    drop: bool = True,
) -> list[BenchRow]:
    """`policy` planning with the whole latency model and with each ablation of it (ablation.py), every plan
    simulated on the whole model."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bound = upper_bound_rps(cluster, lm)
    warm_tables(MAX_BATCH)
    variants = {"whole model": lm} | {name: ablate(lm) for name, ablate in ABLATIONS.items()}
    rows = [
        _bench_row(f"{policy}, {name}", policy, cluster, artifacts, planning, lm, out_dir, bound, duration_s, drop)
        for name, planning in variants.items()
    ]
    with without_queueing():  # the planner's own model switched off while it plans
        plan_path = out_dir / f"plan-{policy}-no-queueing-model.yaml"
        planned = _plan(f"{policy}, no queueing model", policy, cluster, artifacts, lm, plan_path)
    return [*rows, _simulated(planned, cluster, lm, bound, duration_s, drop)]


def _bench_row(
    label: str,
    policy: str,
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    planning_lm: LatencyModel,
    lm: LatencyModel,
    out_dir: Path,
    bound: float,
    duration_s: float,
    drop: bool,
    policy_file: Path | None = None,
    energy: EnergyModel | None = None,
    batching: str = "fill",
) -> BenchRow:
    """One plan made by `policy` with `planning_lm` (saved in `out_dir`), simulated on `lm`; with an `energy`
    model, its joules per request too."""
    plan_path = _plan_path(out_dir, label)
    planned = _plan(label, policy, cluster, artifacts, planning_lm, plan_path, policy_file, batching=batching)
    return _simulated(planned, cluster, lm, bound, duration_s, drop, energy)


def _plan_path(out_dir: Path, label: str) -> Path:
    return out_dir / f"plan-{re.sub(r'[^A-Za-z0-9-]+', '-', label).strip('-')}.yaml"


def _plan(
    label: str,
    policy: str,
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    planning_lm: LatencyModel,
    plan_path: Path,
    policy_file: Path | None = None,
    energy: EnergyModel | None = None,
    batching: str = "fill",
) -> tuple[str, Plan | str, float]:
    """(label, the plan or why there is none, planning time in ms); the plan saved at `plan_path`."""
    try:
        started = time.perf_counter()
        plan = make_plan(
            cluster, artifacts, policy, plan_path, planning_lm, log=lambda _: None, policy_file=policy_file,
            energy=energy, batching=batching,
        )  # fmt: skip
    except TritonctlError as exc:
        return label, exc.message.splitlines()[0], 0.0
    plan_ms = 1000 * (time.perf_counter() - started)
    save_plan(plan, plan_path)
    return label, plan, plan_ms


def _simulated(
    planned: tuple[str, Plan | str, float],
    cluster: Cluster,
    lm: LatencyModel,
    bound: float,
    duration_s: float,
    drop: bool,
    energy: EnergyModel | None = None,
) -> BenchRow:
    """The bench row of a plan simulated on `lm` (or of the error that left no plan); with an `energy` model, the
    plan's joules per request by it."""
    label, plan, plan_ms = planned
    if isinstance(plan, str):
        return BenchRow(label, 0, 0, 0, 0, 0, 1, 0, 0, error=plan)
    capacity = sum(p.predicted.throughput_rps for _, p in plan.instances())
    sim = simulate(plan, lm, duration_s, drop=drop)
    arrived = arrived_requests(sim, plan, cluster)
    late = 1 - sum(m.good for m in sim.models) / arrived if arrived else 0.0  # nothing arrived: nothing late
    return BenchRow(
        policy=label,
        plan_ms=plan_ms,
        capacity_rps=capacity,
        of_bound=capacity / bound,
        throughput_rps=sim.throughput,
        goodput_rps=sim.goodput,
        violations=late,
        drops=sum(m.dropped for m in sim.models) / arrived if arrived else 0.0,
        devices=sim.devices_used,
        unserved=len(plan.unserved),
        predicted_misses=sum(not p.predicted.meets_slo for _, p in plan.instances()),
        predicted_goodput_rps=sum(p.predicted.in_slo_rps for _, p in plan.instances()),
        joules_per_request=None if energy is None else plan_joules(plan, energy, sources_of(cluster)),
    )


def arrived_requests(sim: SimResult, plan: Plan, cluster: Cluster) -> int:
    """What arrived in the simulation, the requests of models the plan leaves unserved included (their
    rate x the duration): these count as violations too."""
    unserved = {u.name for u in plan.unserved}
    lost = sum(round(m.rate * sim.duration_s) for m in cluster.spec.models if m.name in unserved)
    return sum(m.arrived for m in sim.models) + lost


def format_rows(rows: list[BenchRow]) -> str:
    """The bench table; a joules-per-request column where some row has the energy model's estimate."""
    joules = any(r.joules_per_request is not None for r in rows)
    head = (
        "| policy | plan ms | unserved | predicted misses | capacity req/s | of bound | predicted goodput | "
        "of optimum | throughput | goodput | SLO violations | drops | devices |"
        + (" mJ/request (predicted) |" if joules else "")
        + "\n"
        + "|---" * (13 + joules)
        + "|"
    )
    lines = [head]
    for r in rows:
        if r.error:
            lines.append(f"| {r.policy} | failed: {r.error} |" + " |" * (11 + joules))
            continue
        of_optimum = "-" if r.of_optimum is None else f"{100 * r.of_optimum:.1f}%"
        energy = (
            "" if not joules else " - |" if r.joules_per_request is None else f" {1000 * r.joules_per_request:.1f} |"
        )
        lines.append(
            f"| {r.policy} | {r.plan_ms:.1f} | {r.unserved} | {r.predicted_misses} | {r.capacity_rps:.1f} | "
            f"{100 * r.of_bound:.0f}% | {r.predicted_goodput_rps:.1f} | {of_optimum} | {r.throughput_rps:.1f} | "
            f"{r.goodput_rps:.1f} | "
            f"{100 * r.violations:.2f}% | {100 * r.drops:.2f}% | {r.devices} |{energy}"
        )
    return "\n".join(lines)


def margins(rows: list[BenchRow]) -> str:
    """The best of tritonctl's policies against each baseline and against optimal, by simulated goodput; then
    each of tritonctl's policies against the same."""
    ok = {r.policy: r for r in rows if not r.error}
    own = [ok[p] for p in OWN if p in ok]
    if not own:
        asked = {r.policy for r in rows}
        return (
            "No tritonctl policy produced a plan."
            if asked & set(OWN)
            else f"No policy of tritonctl's own ({', '.join(OWN)}) was asked for: nothing to compare against."
        )
    others = [name for name in (*BASELINES, "optimal") if name in ok and ok[name].goodput_rps > 0]

    def margin(mine: BenchRow, name: str) -> str:
        return f"{100 * (mine.goodput_rps / ok[name].goodput_rps - 1):+.1f}%"

    best = max(own, key=lambda r: r.goodput_rps)
    lines = [f"Best tritonctl policy: {best.policy} ({best.goodput_rps:.1f} req/s within SLO)."]
    lines += [f"- vs {name}: {margin(best, name)}" for name in others]
    if others:
        lines.append("Each of tritonctl's policies, by goodput:")
        lines += [f"- {r.policy}: " + ", ".join(f"vs {name} {margin(r, name)}" for name in others) for r in own]
    return "\n".join(lines)


def write_ablation(rows: list[BenchRow], cluster: Cluster, duration_s: float, out_dir: Path) -> Path:
    """The ablation rows as ablation.md in `out_dir`; its path."""
    whole = rows[0]
    lines = [
        f"# Ablations on {cluster.spec.name}",
        "",
        f"Each plan made with the latency model less one part, simulated {duration_s:g} s on the whole model at the "
        "cluster's rates (planned capacity and predicted goodput are the ablated model's own).",
        "",
        format_rows(rows),
        "",
    ]
    lines += [
        f"- {r.policy}: goodput {r.goodput_rps:.1f} req/s ({100 * (r.goodput_rps / whole.goodput_rps - 1):+.1f}% "
        f"against the whole model), SLO violations {100 * r.violations:.2f}%"
        for r in rows[1:]
        if not r.error and whole.goodput_rps > 0
    ]
    path = out_dir / "ablation.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_bench(
    rows: list[BenchRow],
    bound: float,
    cluster: Cluster,
    duration_s: float,
    out_dir: Path,
    margin: float,
    batching: str = "fill",
) -> None:
    """The table and plot of `run_policies`'s rows in `out_dir` (bench.md, bench.png)."""
    planned = (
        f"Planned with a latency margin of {100 * margin:g}% (batches {1 + margin:g} x as long as predicted); "
        if margin
        else ""
    )
    text = (
        f"# Policies on {cluster.spec.name}\n\n{planned}Planned with `--batching {batching}`; simulated "
        f"{duration_s:g} s at the cluster's rates, requests that can only be late dropped; upper bound "
        f"{bound:.1f} req/s.\n\n{format_rows(rows)}\n\n{margins(rows)}\n\n![bench](bench.png)\n"
    )
    (out_dir / "bench.md").write_text(text)
    ok = [r for r in rows if not r.error]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    x = range(len(ok))
    ax.bar([i - 0.2 for i in x], [r.capacity_rps for r in ok], width=0.4, label="planned capacity")
    ax.bar([i + 0.2 for i in x], [r.goodput_rps for r in ok], width=0.4, label="simulated goodput")
    ax.set_xticks(list(x), [r.policy for r in ok])
    ax.set(ylabel="requests / s", title=f"{cluster.spec.name}: policies side by side")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=110)

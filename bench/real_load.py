"""Deployments of one cluster side by side on the real local Triton, each under perf_analyzer and tritonctl's client.

    python bench/real_load.py CLUSTER --latency-model LM --out DIR
        [--deployments handwritten naive best] [--scales 0.5 1 1.5 2 3] [--duration 20]
        [--tools perf_analyzer tritonctl]

Deployments:
- handwritten: what a user writes by hand: one tritonserver, one Python-backend instance per
  model running onnxruntime on 1 thread, no batching, no quotas (rendered from the same exports);
  for a GPU cluster one instance per model on the whole GPU (no MPS), dynamic batching up to 32;
  `handwritten-batched` the same with Triton's dynamic batching up to HANDWRITTEN_CPU_BATCH on a CPU
  too, no queue delay (a batch of what is queued when the instance is free);
- naive: tritonctl's `spread` plan (equal shares, batch 1);
- best: `search`'s plan with the latency model, its batches filled (`plan --batching fill`);
- bda: BDA's batches on spread's equal shares (`plan --policy bda`);
- a suffix `-weight` or `-quota` sets the cluster's runtime.cpu_share for that plan, `-serveall`
  turns runtime.reject_late off (every request served, however late), `-late` sets it to `always`
  (every request that can only be late refused, overloaded or not), `-equal` lets instances
  taking turns with a CPU weigh alike (devices[].turn_priority: equal; by default the tighter SLO
  weighs more), `-lightest` runs the one instance that weighs least on a thread per core
  (devices[].turn_threads: lightest) and `-even` every instance on its even part of the cores
  (`even`; without either, `best` takes the planner's choice), `-ni`, `-nowake`,
  `-linear` or `-noqueue` plans with the latency model less its interference terms, its
  wake-up term, its LWR or the queueing model (latency/ablation.py), `-direct` sends the
  requests straight to the instances' own ports instead of the model ports (HAProxy), `-replan`
  plans for each scale's rates and applies that plan before loading it (a shadow swap, as the
  controller does when rates move), where other deployments keep the plan for 1x; `-prompt` and
  `-eager` serve the batches of `plan --batching prompt` or `eager`.

Each deployment is loaded at every rate scale (x the cluster's rates, all models at once,
open-loop Poisson) with every tool in turn, never two at once. Printed and written to
DIR/results.json and DIR/summary.md: per model offered and answered rate, p50/p95/p99, share
of requests within the SLO; per deployment and tool the capacity (the highest scale at which
every model has at least 99% of its requests answered within its SLO: its p99 counting a
refused or unanswered request as late, and a model the plan leaves out as never answered),
goodput at each scale, and at 1x the plan's predicted p99s (by eq. 2 and simulated) beside
the measured one. A re-planned deployment is loaded at each scale with the models its plan
for that scale serves. During the 1x run under perf_analyzer,
every process's CPU time is read from /proc (DIR/cpu-<deployment>.txt). Run it on a quiet
machine; it says which CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cpu_accounting import every_process, group

from tritonctl.cli import main as tritonctl
from tritonctl.deploy.local import free_ports
from tritonctl.deploy.state import straight_to_instances
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.latency.ablation import linear_running_time, no_interference, no_wake
from tritonctl.latency.device import cpu_fingerprint, gpu_fingerprint
from tritonctl.latency.model import load_latency_model
from tritonctl.latency.queueing import without_queueing
from tritonctl.planning.plan import Device, Placement, load_plan, save_plan
from tritonctl.planning.planner import make_plan, simulated_plan
from tritonctl.spec import Cluster, load_cluster
from tritonctl.triton.binary import find_tritonserver
from tritonctl.triton.client import Endpoint, LoadResult, endpoints, run_load
from tritonctl.triton.perf_analyzer import find_perf_analyzer, run_perf_analyzer
from tritonctl.triton.render import MODEL_VERSION, place_file, python_glue, render_config

ANSWERED_IN_SLO = 0.99  # a scale is served when every model answers this part of its requests within the SLO
HANDWRITTEN_GPU_BATCH = 32  # the largest batch a hand-written GPU deployment lets Triton's dynamic batcher form
HANDWRITTEN_CPU_BATCH = 4  # `handwritten-batched` on a CPU (most profiles serve the most at 2-8: batching_gain.py)


@dataclass
class Row:
    deployment: str
    tool: str
    scale: float
    model: str
    slo_ms: float
    offered_rps: float
    ok_rps: float
    good_rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    in_slo: float
    failed: int
    predicted_p99_ms: float | None  # the plan's eq. 2 p99 (the worst of the model's placements)
    simulated_p99_ms: float | None = None  # the plan's simulated p99 (simulate.with_simulation)


Predicted = tuple[float | None, float | None]  # a model's p99 by eq. 2 and simulated (None: none)


def row(deployment: str, tool: str, scale: float, r: LoadResult, predicted: Predicted) -> Row:
    return Row(
        deployment, tool, scale, r.model, r.slo_ms, r.sent / r.duration_s, r.throughput,
        r.within_slo * r.sent / r.duration_s, r.percentile(50), r.percentile(95), r.percentile(99),
        r.within_slo, r.sent - r.ok, *predicted,
    )  # fmt: skip


def unserved_rows(deployment: str, tools: list[str], scale: float, cluster: Cluster, served: set[str]) -> list[Row]:
    """The cluster's models the plan left out (the planner found no placement serving them): offered, never
    answered, the scale not served (`failed` -2)."""
    nan = float("nan")
    return [
        Row(deployment, tool, scale, m.name, m.slo_ms, m.rate * scale, 0.0, 0.0, nan, nan, nan, 0.0, -2, None)
        for tool in tools
        for m in cluster.spec.models
        if m.name not in served
    ]


def stopped_row(deployment: str, scale: float, target: Endpoint, predicted: Predicted) -> Row:
    """A perf_analyzer run that stopped (at a refused request, or failed): nothing measured, the scale not served."""
    nan = float("nan")
    return Row(deployment, "perf_analyzer", scale, target.model, target.slo_ms, target.rate * scale, nan, nan,
               nan, nan, nan, 0.0, -1, *predicted)  # fmt: skip


@contextlib.contextmanager
def handwritten(plan_path: Path, folder: Path, batched: bool = False) -> Iterator[list[Endpoint]]:
    """One tritonserver serving every model of the plan's exports, no quota or MPS share: on a CPU 1 onnxruntime
    thread each and batch 1 (`batched`: up to HANDWRITTEN_CPU_BATCH); on a GPU the whole GPU each, Triton's dynamic
    batching up to HANDWRITTEN_GPU_BATCH, served by tritonctl's GPU glue where this tritonserver has no onnxruntime
    backend. No queue delay: a batch is what is queued when the instance is free."""
    loaded = load_plan(plan_path)
    binary = find_tritonserver()
    if loaded.plan.target == "gpu":
        device = Device(id="gpu0", kind="gpu", index=0, memory_mb=1, units=100)
        batch, backend = HANDWRITTEN_GPU_BATCH, binary.gpu_backend()
    else:
        device, backend = Device(id="cpu", kind="cpu", index=0, memory_mb=1, units=1, cores=1.0), "python"
        batch = HANDWRITTEN_CPU_BATCH if batched else 1
    repo = folder / "models"
    for model in loaded.plan.models:
        placement = Placement(instance=f"{model.name}-0", device=device.id, share=device.units, batch=batch)
        version = repo / model.name / MODEL_VERSION
        version.mkdir(parents=True, exist_ok=True)
        config = render_config("handwritten", model, placement, device, gpu_backend=backend)
        (repo / model.name / "config.pbtxt").write_text(config)
        place_file(loaded.resolve(model.onnx), version / "model.onnx")
        if backend == "python":
            (version / "model.py").write_text(python_glue(device.kind))
    grpc, http, metrics = free_ports("127.0.0.1", 3)
    cmd = [str(binary.path), f"--model-repository={repo}", f"--grpc-port={grpc}", f"--http-port={http}",
           f"--metrics-port={metrics}", "--grpc-address=127.0.0.1", "--http-address=127.0.0.1",
           "--metrics-address=127.0.0.1", "--exit-timeout-secs=5"]  # fmt: skip
    if binary.backend_dir:
        cmd.append(f"--backend-directory={binary.backend_dir}")
    with (folder / "tritonserver.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **binary.env})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the hand-written tritonserver did not start: see {folder / 'tritonserver.log'}")
            time.sleep(0.5)
        yield [replace(e, url=f"127.0.0.1:{grpc}") for e in endpoints(loaded.plan)]
    finally:  # an overloaded server may hold thousands of queued requests: it gets 5 s to drain, then is killed
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def deployed(name: str, plan_path: Path, folder: Path) -> Iterator[list[Endpoint]]:
    if name.startswith("handwritten"):
        with handwritten(plan_path, folder, batched=name == "handwritten-batched") as targets:
            yield targets
        return
    assert tritonctl(["apply", str(plan_path), "--accept-misses"]) == 0
    try:
        yield targets_of(name, plan_path)
    finally:
        tritonctl(["down", str(plan_path)])


def targets_of(name: str, plan_path: Path, scale: float = 1.0) -> list[Endpoint]:
    """What the load generators send to for an applied plan made for its cluster's rates x `scale`: its models'
    addresses (the instances' own with `-direct`) at the cluster's 1x rates (the load scales them)."""
    loaded = load_plan(plan_path)
    targets = [replace(t, rate=t.rate / scale) for t in endpoints(loaded.plan)]
    return straight_to_instances(targets, loaded.state_dir) if name.endswith("-direct") else targets


def plan_file(out: Path, name: str, scale: float = 1.0) -> Path:
    """Where deployment `name`'s plan for the rates x `scale` is written in `out`."""
    return out / (f"plan-{name}.yaml" if scale == 1.0 else f"plan-{name}-x{scale:g}.yaml")


def plan_for(name: str, cluster_path: Path, lm_path: Path | None, out: Path, scale: float = 1.0) -> Path:
    """The plan of deployment `name` for the cluster's rates x `scale` (handwritten: the naive plan, for its exports
    and ports); the naive plan has predictions where the latency model covers the cluster."""
    base, *options = name.split("-")
    cluster = load_cluster(cluster_path)
    changes = {}
    ablations = {"ni": no_interference, "nowake": no_wake, "linear": linear_running_time}
    for option in options:
        changes.update({"weight": {"cpu_share": "weight"}, "quota": {"cpu_share": "quota"},
                        "serveall": {"reject_late": False}, "late": {"reject_late": "always"}, "direct": {},
                        "replan": {}, "noqueue": {}, "equal": {}, "lightest": {}, "even": {}, "prompt": {}, "eager": {},
                        **dict.fromkeys(ablations, {})}[option])  # fmt: skip
    cluster = cluster.with_runtime(**changes).with_rates(lambda m: m.rate * scale)
    device_changes = {
        "equal": {"turn_priority": "equal"},
        "lightest": {"turn_threads": "lightest"},
        "even": {"turn_threads": "even"},
    }
    if {"lightest", "even"} <= set(options):
        raise SystemExit(f"{name}: -lightest and -even are two settings of the same thing; take one")
    for option in set(options) & set(device_changes):
        devices = [d.model_copy(update=device_changes[option]) for d in cluster.spec.devices]
        cluster = Cluster(cluster.spec.model_copy(update={"devices": devices}), cluster.path)
    lm = load_latency_model(lm_path) if lm_path else None
    for option in options:
        if option in ablations and lm is not None:
            lm = ablations[option](lm)
    if lm is not None and not {m.name for m in cluster.spec.models} <= set(lm.models):
        lm = None
    if base in ("best", "bda") and lm is None:
        raise SystemExit(f"the {base} plan needs a latency model of every model of {cluster_path}")
    policy = {"best": "search", "bda": "bda"}.get(base, "spread")
    path = plan_file(out, name, scale)
    with without_queueing() if "noqueue" in options else contextlib.nullcontext():
        batching = next((o for o in options if o in ("prompt", "eager")), "fill")
        artifacts = materialize(cluster, log=lambda _: None)
        if lm is None:
            plan = make_plan(cluster, artifacts, policy, path, lm, log=print, batching=batching)
        else:
            plan = simulated_plan(cluster, artifacts, policy, path, lm, log=print, batching=batching)
    save_plan(plan, path)
    return path


def predicted_p99(plan_path: Path) -> dict[str, Predicted]:
    """Per model, the plan's predicted p99 by eq. 2 (the worst of its placements) and simulated."""
    out = {}
    for model in load_plan(plan_path).plan.models:
        values = [p.predicted.latency_ms for p in model.placements if p.predicted and p.predicted.latency_ms]
        out[model.name] = (max(values) if values else None, model.simulated_p99_ms)
    return out


def capacity(rows: list[Row], deployment: str, tool: str) -> float:
    """The highest scale up to which every scale had every model within ANSWERED_IN_SLO (0 if none)."""
    best = 0.0
    for scale in sorted({r.scale for r in rows if r.deployment == deployment and r.tool == tool}):
        cells = [r for r in rows if (r.deployment, r.tool, r.scale) == (deployment, tool, scale)]
        if not all(r.in_slo >= ANSWERED_IN_SLO for r in cells):
            break
        best = scale
    return best


LATER = "Loaded in later runs than the others, on the same CPU: "


def later_runs(out: Path) -> list[str]:
    """The deployments DIR/summary.md says were loaded in later runs (added with --add)."""
    summary_md = out / "summary.md"
    lines = summary_md.read_text().splitlines() if summary_md.is_file() else []
    return next((line.removeprefix(LATER).split(", ") for line in lines if line.startswith(LATER)), [])


def summary(rows: list[Row], cpu: str, added: list[str]) -> str:
    later = [LATER + ", ".join(added), ""] if added else []
    lines = [f"CPU: {cpu}", "", *later, "| deployment | tool | capacity (x rates) | " + " | ".join(
        f"goodput x{s:g}" for s in sorted({r.scale for r in rows})) + " |"]  # fmt: skip
    lines.append("|" + "---|" * (3 + len({r.scale for r in rows})))
    lowest = min(r.scale for r in rows)
    for deployment in dict.fromkeys(r.deployment for r in rows):
        for tool in dict.fromkeys(r.tool for r in rows):
            goods = []
            for scale in sorted({r.scale for r in rows}):
                cells = [r for r in rows if (r.deployment, r.tool, r.scale) == (deployment, tool, scale)]
                goods.append(f"{sum(r.good_rps for r in cells):.1f}/{sum(r.offered_rps for r in cells):.1f}")
            held = capacity(rows, deployment, tool)
            cap = f"{held:g}" if held else f"<{lowest:g}"  # no scale held: below the lowest loaded
            lines.append(f"| {deployment} | {tool} | {cap} | " + " | ".join(goods) + " |")
    models = list(dict.fromkeys(r.model for r in rows))
    lines += ["", "Per model at 1x: p99 ms measured (predicted by eq. 2 / simulated), % in SLO", "",
              "| deployment | tool | " + " | ".join(models) + " |", "|" + "---|" * (2 + len(models))]  # fmt: skip
    for deployment in dict.fromkeys(r.deployment for r in rows):
        for tool in dict.fromkeys(r.tool for r in rows):
            cells = {r.model: r for r in rows if (r.deployment, r.tool, r.scale) == (deployment, tool, 1.0)}
            text = [_cell(cells[m]) if m in cells else "-" for m in models]
            if cells:
                lines.append(f"| {deployment} | {tool} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def _cell(r: Row) -> str:
    known = r.predicted_p99_ms or r.simulated_p99_ms
    predicted = f" ({_ms(r.predicted_p99_ms)} / {_ms(r.simulated_p99_ms)})" if known else ""
    return f"{r.p99_ms:.0f}{predicted} {100 * r.in_slo:.0f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def cpu_table(before: dict, after: dict, seconds: float) -> str:
    used: dict[str, float] = {}
    for pid, (cmd, cpu) in after.items():
        start = before.get(pid, (cmd, 0.0))[1]
        name = group(cmd)
        if name == "other":
            name = "perf_analyzer" if "perf_analyzer" in cmd else ("this script" if pid == os.getpid() else "other")
        used[name] = used.get(name, 0.0) + cpu - start
    return "\n".join(f"{name:40} {value / seconds:6.2f} cores" for name, value in sorted(used.items()))


def rounds_bench(doc: str, scale: float, prefix: str) -> tuple[argparse.Namespace, Path, dict, Path | None]:
    """What a bench that loads one applied plan of a cluster in rounds starts from (proxy_priority.py,
    turn_ladder.py): its arguments, a folder for perf_analyzer's logs (not kept), the CPU, perf_analyzer."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cluster", type=Path)
    parser.add_argument("--latency-model", type=Path, required=True, help="profiled on this CPU")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scale", type=float, default=scale, help="the cluster's rates times this")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of traffic per run")
    parser.add_argument("--tools", nargs="+", default=["perf_analyzer", "tritonctl"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_fingerprint()
    print(f"CPU: {cpu['model']} (id {cpu['id']})")
    pa = find_perf_analyzer() if "perf_analyzer" in args.tools else None
    return args, Path(tempfile.mkdtemp(prefix=prefix)), cpu, pa


def rounds_cell(rows: list[dict], name: str, tool: str, model: str) -> str:
    """One model's cell of a rounds bench's summary: its p99 (median over the rounds, each round's in brackets,
    "-" where perf_analyzer stopped) and its share of requests within the SLO over all rounds."""
    mine = [r for r in rows if (r["deployment"], r["tool"], r["model"]) == (name, tool, model)]
    p99s = [r["p99_ms"] for r in mine if r["p99_ms"] == r["p99_ms"]]  # not NaN: measured
    within = sum(r["in_slo"] * r["offered_rps"] for r in mine) / sum(r["offered_rps"] for r in mine)
    rounds = ", ".join(f"{p:.0f}" if p == p else "-" for p in (r["p99_ms"] for r in mine))
    median = f"{statistics.median(p99s):.1f}" if p99s else "-"
    return f"{median} ({rounds}) {100 * within:.1f}%"


def write_rounds(args: argparse.Namespace, rows: list[dict], summary: str) -> None:
    """A rounds bench's rows to OUT/results.json and its summary to OUT/summary.md, and the summary printed."""
    (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "summary.md").write_text(summary)
    print(summary)


def run_once(name: str, tool: str, scale: float, targets, predicted, args, pa, folder: Path) -> list[Row]:
    """One deployment loaded at one scale by one tool: its rows (and, at 1x under perf_analyzer, CPU by process)."""
    before, started = every_process(), time.monotonic()
    if tool == "perf_analyzer":
        try:
            results = run_perf_analyzer(pa, targets, args.duration, scale, folder / f"pa-{scale:g}")
        except TritonctlError as exc:  # refused requests (or a failed run): this scale is not measured as served
            print(f"{name:14} {tool:13} x{scale:<4g} stopped: {exc.message[:160]}")
            return [stopped_row(name, scale, t, predicted.get(t.model, (None, None))) for t in targets]
    else:
        results = run_load(targets, args.duration, scale)
    if scale == 1.0 and tool == "perf_analyzer":
        table = cpu_table(before, every_process(), time.monotonic() - started)
        (args.out / f"cpu-{name}.txt").write_text(table + "\n")
    for r in results:
        print(
            f"{name:14} {tool:13} x{scale:<4g} {r.model:16} ok {r.throughput:6.1f}/s "
            f"p99 {r.percentile(99):8.1f} ms  in SLO {100 * r.within_slo:5.1f}%",
            flush=True,
        )
    return [row(name, tool, scale, r, predicted.get(r.model, (None, None))) for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cluster", type=Path)
    parser.add_argument("--latency-model", type=Path, help="profiled or calibrated on this CPU (for `best`)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deployments", nargs="+", default=["handwritten", "naive", "best"])
    parser.add_argument("--scales", nargs="+", type=float, default=[0.5, 1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of traffic per run")
    parser.add_argument("--tools", nargs="+", default=["perf_analyzer", "tritonctl"])
    parser.add_argument(
        "--add", action="store_true", help="keep DIR/results.json's rows of the other deployments (the summary says so)"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pa = find_perf_analyzer()
    raw = Path(tempfile.mkdtemp(prefix="real-load-"))
    cpu = cpu_fingerprint()["model"]
    if load_cluster(args.cluster).kind == "gpu":
        cpu += f"; GPU: {gpu_fingerprint()['model']}"
    print(f"CPU: {cpu}")
    rows: list[Row] = []
    if args.add:
        earlier = json.loads((args.out / "results.json").read_text())
        rows = [Row(**r) for r in earlier if r["deployment"] not in args.deployments]
    cluster = load_cluster(args.cluster)
    for name in args.deployments:
        by_hand = name.startswith("handwritten")
        plan_path = plan_for("naive" if by_hand else name, args.cluster, args.latency_model, args.out)
        predicted = {} if by_hand else predicted_p99(plan_path)
        folder = raw / name  # the hand-written repository, perf_analyzer's logs and exports: not kept
        folder.mkdir()
        with deployed(name, plan_path, folder) as targets:  # targets: the rates at 1x, scaled by the load
            for scale in args.scales:
                if "replan" in name.split("-")[1:]:
                    scaled = plan_for(name, args.cluster, args.latency_model, args.out, scale)
                    assert tritonctl(["apply", str(scaled), "--accept-misses"]) == 0
                    predicted = predicted_p99(scaled)
                    targets = targets_of(name, scaled, scale)  # what this scale's plan serves
                for tool in args.tools:
                    rows += run_once(name, tool, scale, targets, predicted, args, pa, folder)
                rows += unserved_rows(name, args.tools, scale, cluster, {t.model for t in targets})
        (args.out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    text = summary(rows, cpu, list(dict.fromkeys([*later_runs(args.out), *args.deployments])) if args.add else [])
    (args.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

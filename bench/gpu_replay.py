"""Plans on a real H100 against the simulator: goodput and p99 per model, by policy.

No Triton runs on the GPU hosts lent here, so each of a plan's instances is replayed by a stand-in
for a Triton instance: an MPS client at the instance's share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) with a CUDA
graph per batch size (profiler/gpu.py's), behind a dynamic batcher with the plan's preferred batch
and queue delay (a batch starts when the executor is free and `batch` requests wait or the oldest
has waited the delay; it takes up to `batch`). Requests arrive open-loop, Poisson at the instance's
part of its model's rate, generated inside the instance's process; a request's latency runs from
its arrival to the end of its batch (input copied from pinned host memory, output copied back).
There is no network and no gRPC. A plan's devices never interact, so its devices are replayed one
after another on the one GPU, each for `duration` seconds. The simulator then replays each model's
real arrivals (dealt to a model's replicas at random by weight, as it always does).

    python bench/gpu_replay.py spec PLAN... -o SPEC.json       # here: what to replay (keep the plans beside it)
    python3 bench/gpu_replay.py run SPEC.json --out DIR         # on the GPU host: DIR/spec.json, DIR/<policy>.npz
    python bench/gpu_replay.py compare DIR [--replays-root R]   # here: the simulator on the same arrivals
    python bench/gpu_replay.py plot DIR... -o FIG.png [--replays-root R]   # here: real against simulated

A replay stores each instance's latencies and the run's seed (`<policy>.npz`); the arrivals are drawn again
from the seed. The H100 runs' replays of the search plans are measured data, kept with the H100 profile in
profiles/inss-gpu/replays/<run folder name>/; the run folders in bench/results keep their summaries.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
REPLAYS_HELP = (
    "read each run's <policy>.npz from ROOT/<run folder name>/ instead of the run folder (the H100 runs' are in "
    "profiles/inss-gpu/replays/)"
)
sys.path.insert(0, str(REPO))


def spec(plans: list[Path], cluster_sources: dict[str, str], duration_s: float) -> dict:
    """The instances of each plan, by device, with what a replay needs (plain JSON: the GPU host has no pydantic)."""
    from tritonctl.planning.plan import load_plan

    out = {"duration_s": duration_s, "plans": []}
    for path in plans:
        plan = load_plan(path).plan
        devices: dict[str, list[dict]] = {}
        for m in plan.models:
            total = sum(p.weight for p in m.placements)
            for p in m.placements:
                devices.setdefault(p.device, []).append(
                    {
                        "instance": p.instance,
                        "model": m.name,
                        "source": cluster_sources[m.name],
                        "share": p.share,
                        "batch": p.batch,
                        "delay_ms": p.queue_delay_us / 1000,
                        "rate": m.rate * p.weight / total,
                        "slo_ms": m.slo_ms,
                    }
                )
        where = path.resolve()
        where = where.relative_to(REPO) if where.is_relative_to(REPO) else where  # REPO / an absolute path = it
        out["plans"].append({"path": str(where), "policy": plan.policy, "devices": devices})
    return out


# ---- on the GPU host ----------------------------------------------------------------------------------------


def next_batch(times: list[float], head: int, now: float, batch: int, delay_ms: float) -> tuple[int, float]:
    """Triton's dynamic batcher, free at `now` (ms), with the requests arrived at `times[head:]` not yet batched:
    (k, now) to start a batch of the k oldest now (`batch` wait, or the oldest has waited `delay_ms`), else
    (0, t) with t when that will first be so (or when the next request arrives)."""
    waiting = bisect.bisect_right(times, now, head) - head
    if waiting >= batch or (waiting and now >= times[head] + delay_ms):
        return min(waiting, batch), now
    due = times[head] + delay_ms if waiting else times[head]
    if head + batch - 1 < len(times):
        due = min(due, times[head + batch - 1])
    return 0, due


def arrivals_of(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """An instance's Poisson arrivals (ms since its start), drawn from its own seed: a replay stores only the
    latencies, and `compare` draws the arrivals again."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.uniform(0, 1000 * duration_s, rng.poisson(rate * duration_s)))


def instance_seed(seed: int, device: int, instance: int) -> int:
    """The seed of the `instance`-th instance on the plan's `device`-th device in a replay run with `seed`."""
    return seed + 100 * device + instance


def _instance(cfg: dict, duration_s: float, seed: int) -> None:
    """One instance: capture graphs, report ready, wait for the start time on stdin, replay, print results."""
    from tritonctl.profiler.gpu import _build, _setup_torch, batch_runner

    torch = _setup_torch()
    module = _build(torch, cfg["source"])
    pool = torch.cuda.graph_pool_handle()
    run = {k: batch_runner(torch, module, k, pool) for k in range(1, cfg["batch"] + 1)}
    for k in run:
        run[k]()
    arrivals = arrivals_of(cfg["rate"], duration_s, seed)
    times = arrivals.tolist()
    print("ready", flush=True)
    t0 = float(sys.stdin.readline())
    latency = np.full(len(times), np.nan)
    stop = 1000 * duration_s + cfg["slo_ms"]
    head = 0
    while head < len(times):
        now = 1000 * (time.time() - t0)
        if now > stop:
            break
        k, due = next_batch(times, head, now, cfg["batch"], cfg["delay_ms"])
        if k:
            run[k]()
            latency[head : head + k] = 1000 * (time.time() - t0) - arrivals[head : head + k]
            head += k
            continue
        wait = (due - now) / 1000
        if wait > 0.0005:
            time.sleep(wait - 0.0003)
    sys.stdout.write(json.dumps({"arrivals": arrivals.tolist(), "latency": latency.tolist()}) + "\n")
    sys.stdout.flush()


def _start(instances: list[dict], duration_s: float, seed: int, device: int, env: dict) -> list[subprocess.Popen]:
    """The instances of the plan's `device`-th device, each an MPS client with its graphs captured, ready to start."""
    procs = []
    try:
        for i, inst in enumerate(instances):  # every instance draws its own arrivals
            inst_seed = instance_seed(seed, device, i)
            cmd = [sys.executable, __file__, "instance", json.dumps(inst), str(duration_s), str(inst_seed)]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(inst["share"])},
                )
            )
        for inst, proc in zip(instances, procs, strict=True):
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"instance {inst['instance']} exited with code {proc.wait()} before it was ready")
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return procs


def run(spec_path: Path, out: Path, seed: int) -> None:
    from tritonctl.profiler.gpu import _start_mps, _stop_mps

    cfg = json.loads(spec_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spec_path, out / "spec.json")  # compare reads what was replayed from the results
    env = _start_mps(Path(tempfile.mkdtemp(prefix="tritonctl-mps-")))
    try:
        for plan in cfg["plans"]:
            arrays = {"seed": np.array(seed)}
            for d, (device, instances) in enumerate(plan["devices"].items()):
                procs = _start(instances, cfg["duration_s"], seed, d, env)
                t0 = time.time() + 0.5
                for proc in procs:
                    proc.stdin.write(f"{t0}\n")
                    proc.stdin.flush()
                for inst, proc in zip(instances, procs, strict=True):
                    result = json.loads(proc.stdout.readline())
                    proc.wait()
                    arrivals = np.array(result["arrivals"])
                    latency = arrays[f"{inst['instance']}:latency"] = np.array(result["latency"], dtype=np.float32)
                    served = latency[np.isfinite(latency)]
                    p99 = np.percentile(served, 99) if served.size else math.nan
                    print(
                        f"{plan['policy']} {device} {inst['instance']}: {served.size}/{arrivals.size} served, "
                        f"p99 {p99:.2f} ms (SLO {inst['slo_ms']})",
                        flush=True,
                    )
            np.savez_compressed(out / f"{plan['policy']}.npz", **arrays)
    finally:
        _stop_mps(env)


# ---- here: the simulator on the same arrivals ---------------------------------------------------------------


def _gap(sim: float, real: float) -> str:
    return f"{sim / real - 1:+.1%}" if real > 0 and math.isfinite(real) else "n/a"


@dataclass(frozen=True)
class Point:
    """One model of a replayed plan: what the GPU did and what the simulator says, per second and in ms."""

    policy: str
    model: str
    slo_ms: float
    real_good: float
    sim_good: float
    real_p99: float
    sim_p99: float


def replayed(results: Path, lm, replays: Path | None = None) -> tuple[dict, list[tuple[str, float, list[Point]]]]:
    """The spec of the replay in `results`, and per plan its policy, the cluster's offered rate and its points: the
    simulator fed each model's real arrivals (no drops). The latencies are read from `replays` (default: `results`)."""
    from tritonctl.planning.plan import load_plan
    from tritonctl.planning.simulate import simulate
    from tritonctl.spec import load_cluster

    try:
        cfg = json.loads((results / "spec.json").read_text())
    except OSError as exc:
        raise SystemExit(f"{results}: no spec.json of a replay ({exc.strerror})") from None
    out = []
    for plan_cfg in cfg["plans"]:
        try:
            data = np.load((replays or results) / f"{plan_cfg['policy']}.npz")
        except OSError:  # only the search plans' replays are committed; a run on a GPU host writes them all
            print(f"{replays or results}: no {plan_cfg['policy']}.npz: {plan_cfg['policy']} left out", file=sys.stderr)
            continue
        loaded = load_plan(REPO / plan_cfg["path"])
        plan = loaded.plan
        offered = sum(m.rate for m in load_cluster(loaded.resolve(plan.cluster_file)).spec.models)
        by_model: dict[str, tuple[list, list]] = {}
        for d, instances in enumerate(plan_cfg["devices"].values()):
            for i, inst in enumerate(instances):
                arr, lat = by_model.setdefault(inst["model"], ([], []))
                arr.append(arrivals_of(inst["rate"], cfg["duration_s"], instance_seed(int(data["seed"]), d, i)))
                lat.append(data[f"{inst['instance']}:latency"])
        trace = {m: np.sort(np.concatenate(a)) for m, (a, _) in by_model.items()}
        sim = {r.model: r for r in simulate(plan, lm, cfg["duration_s"], trace=trace).models}
        points = []
        for m in plan.models:
            lat = np.concatenate(by_model[m.name][1])
            served = lat[np.isfinite(lat)]
            points.append(
                Point(
                    plan.policy,
                    m.name,
                    m.slo_ms,
                    float((served <= m.slo_ms).sum()) / cfg["duration_s"],
                    sim[m.name].good / cfg["duration_s"],
                    float(np.percentile(served, 99)) if served.size else math.nan,
                    sim[m.name].p99_ms,
                )
            )
        out.append((plan.policy, offered, points))
    return cfg, out


def compare(results: Path, latency_model: Path, replays: Path | None = None) -> str:
    """The simulator on each replayed plan, fed each model's real arrivals, against what the GPU did."""
    from tritonctl.latency.model import load_latency_model

    cfg, plans = replayed(results, load_latency_model(latency_model), replays)
    lines = [
        f"Real: each plan's instances replayed on one H100 under MPS, device by device, {cfg['duration_s']:g} s each "
        "(bench/gpu_replay.py). Sim: `tritonctl simulate` on each model's real arrivals, no drops.",
        "",
        "| policy | model | real goodput/s | sim goodput/s | gap | real p99 ms | sim p99 ms | gap | SLO ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.policy} | {p.model} | {p.real_good:.0f} | {p.sim_good:.0f} | {_gap(p.sim_good, p.real_good)} | "
        f"{p.real_p99:.2f} | {p.sim_p99:.2f} | {_gap(p.sim_p99, p.real_p99)} | {p.slo_ms:g} |"
        for _, _, points in plans
        for p in points
    ]
    lines += [
        "",
        "| policy | real goodput/s | sim goodput/s | gap | real in SLO (of the cluster's offered rate) |",
        "|---|---|---|---|---|",
    ]
    for policy, offered, points in plans:
        real, sim = sum(p.real_good for p in points), sum(p.sim_good for p in points)
        lines.append(f"| {policy} | {real:.0f} | {sim:.0f} | {_gap(sim, real)} | {real / offered:.1%} |")
    return "\n".join(lines)


def plot(runs: list[Path], latency_model: Path, path: Path, replays_root: Path | None = None) -> None:
    """Real against simulated goodput and p99, every model of every replayed plan, with the +-20% band."""
    from matplotlib.figure import Figure

    from tritonctl.latency.model import load_latency_model

    lm = load_latency_model(latency_model)
    fig = Figure(figsize=(11, 5))
    axes = fig.subplots(1, 2)
    markers = {"search": "o", "gpulet": "^", "igniter": "s"}
    seen: dict[int, list[float]] = {0: [], 1: []}
    for run in runs:
        for policy, _, points in replayed(run, lm, replays_root / run.name if replays_root else None)[1]:
            label = f"{policy}, {run.name.removeprefix('gpu-replay-')}"
            for i, (real, sim) in enumerate((("real_good", "sim_good"), ("real_p99", "sim_p99"))):
                xs, ys = [getattr(p, real) for p in points], [getattr(p, sim) for p in points]
                seen[i] += [v for v in xs + ys if v > 0 and math.isfinite(v)]
                axes[i].scatter(xs, ys, marker=markers.get(policy, "x"), s=24, alpha=0.75, label=label)
    for i, what in enumerate(("goodput (requests/s within SLO)", "p99 latency (ms)")):
        line = np.geomspace(0.7 * min(seen[i]), 1.4 * max(seen[i]), 50)
        axes[i].plot(line, line, "k--", lw=1)
        axes[i].fill_between(line, 0.8 * line, 1.2 * line, color="0.85", zorder=0, label="within 20%")
        axes[i].set(
            xscale="log",
            yscale="log",
            xlim=(line[0], line[-1]),
            ylim=(line[0], line[-1]),
            xlabel=f"real {what}",
            ylabel=f"simulated {what}",
        )
    axes[1].legend(fontsize=7)
    fig.suptitle("Plans replayed on an H100 under MPS against the simulator (bench/gpu_replay.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("spec")
    p.add_argument("plans", nargs="+", type=Path)
    p.add_argument("--cluster", type=Path, required=True, help="the plans' cluster (torchvision sources)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per device (default 20)")
    p.add_argument("-o", "--output", type=Path, required=True)
    p = sub.add_parser("run")
    p.add_argument("spec", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("instance")
    p.add_argument("cfg")
    p.add_argument("duration", type=float)
    p.add_argument("seed", type=int)
    p = sub.add_parser("plot")
    p.add_argument("results", type=Path, nargs="+", help="folders `run` wrote")
    p.add_argument("--latency-model", type=Path, default=REPO / "profiles/inss-gpu/latency-model.json")
    p.add_argument("-o", "--output", type=Path, required=True, help="the figure (.png)")
    p.add_argument("--replays-root", type=Path, help=REPLAYS_HELP)
    p = sub.add_parser("compare")
    p.add_argument("results", type=Path, help="the folder `run` wrote (its spec.json and <policy>.npz)")
    p.add_argument("--latency-model", type=Path, default=REPO / "profiles/inss-gpu/latency-model.json")
    p.add_argument("-o", "--output", type=Path, help="also write the table here")
    p.add_argument("--replays-root", type=Path, help=REPLAYS_HELP)
    args = parser.parse_args()
    if args.step == "spec":
        import yaml

        sources = {m["name"]: m["source"] for m in yaml.safe_load(args.cluster.read_text())["models"]}
        args.output.write_text(json.dumps(spec(args.plans, sources, args.duration), indent=1))
    elif args.step == "run":
        run(args.spec, args.out, args.seed)
    elif args.step == "instance":
        _instance(json.loads(args.cfg), args.duration, args.seed)
    elif args.step == "plot":
        plot(args.results, args.latency_model, args.output, args.replays_root)
    else:
        table = compare(
            args.results, args.latency_model, args.replays_root / args.results.name if args.replays_root else None
        )
        print(table)
        if args.output:
            args.output.write_text(table + "\n")


if __name__ == "__main__":
    main()

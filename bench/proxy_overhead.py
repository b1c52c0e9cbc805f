"""What the proxy costs: the same deployment loaded through HAProxy and straight at the instances.

    python bench/proxy_overhead.py [--duration 12] [--rounds 2] [--policy search] [--rate-scale 1]
        [--tool tritonctl|perf_analyzer] [--perf FILE] [--images float32|uint8] [--router-from COMMIT] [--realtime]
        [--plan PLAN] [--tuned LINE ...]

Plans the CPU demo cluster (own ports and state) with `--policy` on the committed latency
model (`spread` needs none), applies it, then sends the demo's Poisson traffic (times
`--rate-scale`, from tritonctl's client or NVIDIA perf_analyzer: `--tool`) alternately to the
models' addresses (HAProxy) and to the instances' own gRPC ports, `--rounds` times each, and
prints p50 and p99 per model, and HAProxy's CPU time per request it forwarded (user + system
of its master and worker): in all, beyond what it uses idle (measured first, over `--duration`
with no traffic, and taken off over each round's wall time), and the kernel's part of it
(/proc's system time over user + system, in 10 ms ticks). With `--perf FILE`, the first round
through HAProxy is also recorded by Linux perf (call graphs of its worker) and FILE gets where
its CPU went. With `--images uint8` the models take their images as bytes (the cluster's
`input.dtype: uint8`): a request carries 150 KB instead of 602 KB. With `--router-from COMMIT`
each round also loads, between the two, the hand-written asyncio HTTP/2 router HAProxy replaced,
run as it was at COMMIT of this repository's history (`git show`; its last version is at
4945c89^), in front of the same instances (every replica of a model, dealt per connection, as it
did), and prints its CPU time per request measured the same way: the two proxies side by side.
With `--realtime` each round also loads the same HAProxy with its threads under SCHED_FIFO (priority 1; on a
kernel that budgets real-time time per cgroup, its group and the groups above it get 10% of each period), set
for that path only: whether waking it at once, ahead of the instances' threads, takes the hop off the p99.
With `--plan PLAN` the plan of any cluster is applied as written and loaded at its rates x `--rate-scale`
instead of the demo's (`--policy` and `--images` do not apply): what the proxy adds at another cluster's load.
With `--tuned LINE` (repeatable, e.g. `--tuned "tune.bufsize 1048576"`) each round also loads a second HAProxy,
started from the deployment's own configuration with these global lines on ports of its own, in the same cgroup
and with this script's environment (so `MALLOC_*` variables set here reach it and not the applied one): a tuning
measured beside the one tritonctl renders, in the same run.
Last, over every round pooled, each path's p50 and p99 per model and what a proxy adds to the
p99 of the instances' own ports, with its 95% bootstrap interval (one round's p99, of tens to
hundreds of requests, moves by more than the hop costs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from cpu_demo import CLUSTER, MODEL, REPO

from tritonctl.deploy import share
from tritonctl.deploy.apply import apply_plan, down
from tritonctl.deploy.local import (
    PROXY_CONFIG,
    PROXY_FILE,
    LocalRuntime,
    free_ports,
    group_cpu_seconds,
    group_pids,
    haproxy_binary,
    proc_stat_fields,
)
from tritonctl.deploy.proxy import ProxyApi
from tritonctl.deploy.share import V1_ROOT
from tritonctl.deploy.state import load_state, straight_to_instances
from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import LoadedPlan, load_plan, save_plan
from tritonctl.planning.planner import make_plan
from tritonctl.spec import Cluster, load_cluster
from tritonctl.triton.binary import find_tritonserver
from tritonctl.triton.client import Endpoint, endpoints, run_load
from tritonctl.triton.perf_analyzer import find_perf_analyzer, run_perf_analyzer

WORK = REPO / ".tritonctl" / "proxy-bench"


def group_ticks(group: int) -> tuple[int, int]:
    """(user, system) clock ticks used so far by every process of a process group."""
    fields = [f for f in map(proc_stat_fields, group_pids(group)) if f]
    return sum(int(f[11]) for f in fields), sum(int(f[12]) for f in fields)


def worker_of(master: int) -> int:
    """HAProxy's worker: the newest process of its master's group other than the master."""
    return max(pid for pid in group_pids(master) if pid != master)


def perf_record(pid: int, data: Path) -> subprocess.Popen:
    """Linux perf sampling `pid`'s call graphs into `data` until it is interrupted."""
    return subprocess.Popen(
        ["perf", "record", "-F", "2000", "-g", "-p", str(pid), "-o", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def perf_summary(data: Path) -> str:
    """Where the recorded CPU went: by binary (kernel or HAProxy), then the calls that include the most of it."""
    report = ["perf", "report", "-i", str(data), "--stdio"]
    by_dso = subprocess.run([*report, "--no-children", "--sort", "dso", "-g", "none"], capture_output=True, text=True)
    by_call = subprocess.run([*report, "--children", "--sort", "sym", "-g", "none"], capture_output=True, text=True)
    keep = [line for line in by_dso.stdout.splitlines() if "%" in line and not line.startswith("#")]
    calls = [line for line in by_call.stdout.splitlines() if "%" in line and not line.startswith("#")][:30]
    return "\n".join(["# by binary", *keep, "", "# calls, including what they call (top 30)", *calls]) + "\n"


def realtime_budget(cgroup: str | None, runtime_us: int) -> None:
    """Give HAProxy's cgroup (as its record names it) and each group above it `runtime_us` of real-time time a
    period (children first when taking it away, parents first when giving it), where the kernel budgets it per
    cgroup v1 cpu group."""
    if cgroup is None or not (V1_ROOT / "cpu.rt_runtime_us").exists():
        return
    upward = [g for g in (Path(cgroup), *Path(cgroup).parents) if g.is_relative_to(V1_ROOT) and g != V1_ROOT]
    for group in reversed(upward) if runtime_us else upward:
        (group / "cpu.rt_runtime_us").write_text(str(runtime_us))


def set_realtime(group: int, on: bool) -> None:
    """Every thread of a process group under SCHED_FIFO priority 1 (`on`), or back under SCHED_OTHER."""
    policy, param = (os.SCHED_FIFO, os.sched_param(1)) if on else (os.SCHED_OTHER, os.sched_param(0))
    for pid in group_pids(group):
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.sched_setscheduler(int(task.name), policy, param)


def wait_listening(proc: subprocess.Popen, ports: list[int], what: str) -> None:
    """Wait until `proc` listens on every port (10 s at most; then it is killed and the run stops)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            for port in ports:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"{what} did not start") from None
            time.sleep(0.1)


def start_router(
    commit: str, backends: dict[str, list[str]], routed: list[Endpoint]
) -> tuple[subprocess.Popen, list[Endpoint]]:
    """The hand-written router as it was at `commit`, serving each model of `routed` on a port of its own in
    front of `backends` (model -> its instances' host:port); the process (leading its own group) and the
    endpoints at its ports."""
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:tritonctl/deploy/router.py"], capture_output=True, text=True
    )
    if shown.returncode != 0:
        raise SystemExit(f"--router-from {commit}: no tritonctl/deploy/router.py there ({shown.stderr.strip()})")
    (WORK / "router.py").write_text(shown.stdout)
    *ports, control = free_ports("127.0.0.1", len(routed) + 1)
    routes = {str(port): backends[e.model] for port, e in zip(ports, routed, strict=True)}
    (WORK / "router-routes.json").write_text(json.dumps(routes))
    command = [sys.executable, str(WORK / "router.py"), "--host", "127.0.0.1", "--control-port", str(control)]
    proc = subprocess.Popen([*command, "--routes", str(WORK / "router-routes.json")], start_new_session=True)
    wait_listening(proc, ports, f"the router from {commit}")
    return proc, [dataclasses.replace(e, url=f"127.0.0.1:{port}") for port, e in zip(ports, routed, strict=True)]


def start_tuned(
    state_dir: Path, cgroup: str | None, tuning: list[str], routed: list[Endpoint]
) -> tuple[subprocess.Popen, list[Endpoint]]:
    """A second HAProxy from the deployment's own configuration with `tuning` (global lines, each replacing the line
    of its first word where there is one) on ports of its own, in HAProxy's cgroup: the process (leading its own
    group) and the endpoints at its ports."""
    text = (state_dir / PROXY_CONFIG).read_text()
    *ports, metrics = free_ports("127.0.0.1", len(routed) + 1)
    for port, e in zip(ports, routed, strict=True):
        text = text.replace(f":{e.url.rsplit(':', 1)[1]} proto h2", f":{port} proto h2")
    lines = text.splitlines()
    for tune in tuning:
        key = tune.split()[0]
        at = next((i for i, line in enumerate(lines) if line.split()[:1] == [key]), None)
        if at is None:
            lines.insert(lines.index("global") + 1, f"    {tune}")
        else:
            lines[at] = f"    {tune}"
    lines = [
        f"    stats socket {WORK / 'tuned.sock'} mode 600 level admin" if line.split()[:2] == ["stats", "socket"]
        else f"    bind 127.0.0.1:{metrics}" if line.strip().startswith("bind") and "proto h2" not in line
        else line
        for line in lines
    ]  # fmt: skip
    WORK.mkdir(parents=True, exist_ok=True)
    config = WORK / "tuned.cfg"
    config.write_text("\n".join(lines) + "\n")
    command = [haproxy_binary(), "-W", "-db", "-f", str(config)]
    group = None if cgroup is None else Path(cgroup)
    proc = subprocess.Popen(share.joining(group, command), start_new_session=True, stdin=subprocess.DEVNULL)
    wait_listening(proc, ports, f"the tuned HAProxy (configuration: {config})")
    api, deadline = ProxyApi(str(WORK / "tuned.sock")), time.monotonic() + 10
    while not all(stat.status == "UP" for servers in api.servers().values() for stat in servers.values()):
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the tuned HAProxy's servers did not pass their checks (configuration: {config})")
        time.sleep(0.1)
    return proc, [dataclasses.replace(e, url=f"127.0.0.1:{port}") for port, e in zip(ports, routed, strict=True)]


def added_p99(through: list[float], own: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """p99 of `through` less p99 of `own` (ms), and its 95% bootstrap interval (both resampled, seeded)."""
    a, b = np.asarray(through), np.asarray(own)
    rng = np.random.default_rng(0)
    deltas = [np.percentile(rng.choice(a, a.size), 99) - np.percentile(rng.choice(b, b.size), 99) for _ in range(draws)]
    low, high = np.percentile(deltas, [2.5, 97.5])
    return float(np.percentile(a, 99) - np.percentile(b, 99)), float(low), float(high)


def with_images(cluster: Cluster, dtype: str) -> Cluster:
    """`cluster` with every model's input of type `dtype` (uint8: images as bytes)."""
    models = [m.model_copy(update={"input": m.input.model_copy(update={"dtype": dtype})}) for m in cluster.spec.models]
    return Cluster(cluster.spec.model_copy(update={"models": models}), cluster.path)


def demo_plan(images: str, rate_scale: float, base_port: int, policy: str) -> LoadedPlan:
    """The demo cluster planned with `policy` at its rates x `rate_scale`, on its own ports and state."""
    cluster = (
        with_images(load_cluster(CLUSTER), images)
        .with_rates(lambda m: m.rate * rate_scale)
        .with_runtime(base_port=base_port, state_dir=str(WORK / "state"))
    )
    path = WORK / "plan.yaml"
    lm = None if policy == "spread" else load_latency_model(MODEL)
    artifacts = materialize(cluster, log=lambda _: None)
    save_plan(make_plan(cluster, artifacts, policy, path, lm, log=lambda _: None), path)
    return load_plan(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of traffic per round and path")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (proxy, [router,] [tuned,] direct)")
    parser.add_argument("--base-port", type=int, default=8500, help="first model port (default 8500)")
    parser.add_argument("--policy", help="the plan to load (default search, the demo's)")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the rates (default 1)")
    parser.add_argument("--tool", choices=["tritonctl", "perf_analyzer"], default="tritonctl", help="load generator")
    parser.add_argument("--perf", type=Path, help="record the first round through HAProxy with perf; summary here")
    parser.add_argument("--images", choices=["float32", "uint8"], help="the models' input type (default float32)")
    parser.add_argument("--router-from", metavar="COMMIT", help="also load the hand-written router of this commit")
    parser.add_argument("--realtime", action="store_true", help="also load HAProxy with its threads under SCHED_FIFO")
    parser.add_argument("--plan", type=Path, help="apply and load this plan (its rates x --rate-scale), not the demo")
    parser.add_argument(
        "--tuned", metavar="LINE", action="append", help="also load a second HAProxy with this global line (repeatable)"
    )
    args = parser.parse_args()
    if args.plan is not None and (args.policy or args.images):
        parser.error("--plan loads the plan as written: --policy and --images shape the demo's plan only")
    pa = find_perf_analyzer() if args.tool == "perf_analyzer" else None
    if args.plan is not None:
        loaded, scale = load_plan(args.plan), args.rate_scale
    else:
        loaded = demo_plan(args.images or "float32", args.rate_scale, args.base_port, args.policy or "search")
        scale = 1.0
    triton = LocalRuntime(find_tritonserver(loaded.plan.runtime.tritonserver), loaded.state_dir)
    apply_plan(loaded, triton, log=lambda _: None)
    proxy_record = json.loads((loaded.state_dir / PROXY_FILE).read_text())
    proxy_pid = proxy_record["pid"]
    router = tuned = None
    try:
        routed = endpoints(loaded.plan)
        direct = straight_to_instances(routed, loaded.state_dir)
        paths = [("proxy", routed, proxy_pid, "HAProxy")]
        if args.router_from:
            backends: dict[str, list[str]] = {}
            for r in load_state(loaded.state_dir).instances.values():
                backends.setdefault(r.model, []).append(f"{r.host}:{r.backend_port}")
            router, at_router = start_router(args.router_from, backends, routed)
            paths.append(("router", at_router, router.pid, "router"))
        if args.tuned:
            tuned, at_tuned = start_tuned(loaded.state_dir, proxy_record["cgroup"], args.tuned, routed)
            paths.append(("tuned", at_tuned, tuned.pid, "tuned HAProxy"))
        if args.realtime:
            realtime_budget(proxy_record["cgroup"], 100_000)
            paths.append(("proxy-rt", routed, proxy_pid, "HAProxy under SCHED_FIFO"))
        paths.append(("direct", direct, None, ""))
        idle: dict[str, float] = {}
        for name, _, group, label in paths[:-1]:
            if name == "proxy-rt":
                idle[name] = idle["proxy"]
                continue
            before = group_cpu_seconds(group)
            time.sleep(args.duration)
            idle[name] = (group_cpu_seconds(group) - before) / args.duration
            print(f"{label} idle: {1000 * idle[name]:.2f} ms of CPU per second")
        print(f"{'round':5} {'path':7} " + " ".join(f"{e.model + ' p50/p99 ms':>26}" for e in routed))
        pooled: dict[str, list[list[float]]] = {name: [[] for _ in routed] for name, *_ in paths}
        for round_ in range(args.rounds):
            for name, targets, proxy, label in paths:
                before, ticks = (group_cpu_seconds(proxy), group_ticks(proxy)) if proxy else (0.0, (0, 0))
                recording = name == "proxy" and round_ == 0 and args.perf
                if name == "proxy-rt":
                    set_realtime(proxy, True)
                if recording:
                    perf = perf_record(worker_of(proxy), WORK / "perf.data")
                began = time.monotonic()
                if pa is None:
                    results = run_load(targets, args.duration, scale, seed=round_)
                else:
                    with tempfile.TemporaryDirectory(prefix="proxy-overhead.") as logs:
                        results = run_perf_analyzer(pa, targets, args.duration, scale, Path(logs), seed=round_)
                if name == "proxy-rt":
                    set_realtime(proxy, False)
                if recording:
                    perf.send_signal(signal.SIGINT)
                    perf.wait()
                    args.perf.write_text(perf_summary(WORK / "perf.data"))
                cells = " ".join(f"{f'{r.percentile(50):.1f} / {r.percentile(99):.1f}':>26}" for r in results)
                for kept, r in zip(pooled[name], results, strict=True):
                    kept.extend(r.latencies_ms)
                forwarded = sum(len(r.latencies_ms) for r in results) if proxy else 0
                spent = group_cpu_seconds(proxy) - before if proxy else 0.0
                elapsed = time.monotonic() - began
                (user, system), (user0, system0) = group_ticks(proxy) if proxy else (0, 0), ticks
                used = (
                    f"  {label} CPU {1000 * spent / forwarded:.3f} ms/request"
                    f" ({1000 * (spent - idle[name] * elapsed) / forwarded:.3f} beyond idle,"
                    f" {100 * (system - system0) / max(1, user - user0 + system - system0):.0f}% in the kernel)"
                    if forwarded
                    else ""
                )
                print(f"{round_:5d} {name:7} {cells}{used}", flush=True)
        print("every round pooled: requests, p50 / p99 ms; through a proxy, the p99 it adds [95% bootstrap interval]")
        for name, *_ in paths:
            for e, through, own in zip(routed, pooled[name], pooled["direct"], strict=True):
                p50, p99 = np.percentile(through, [50, 99])
                added = "" if name == "direct" else " added {:+.1f} [{:+.1f}, {:+.1f}]".format(*added_p99(through, own))
                print(f"  {name:7} {e.model:14} {len(through):6d}  {p50:6.1f} / {p99:6.1f}{added}")
    finally:
        if args.realtime:
            set_realtime(proxy_pid, False)
            realtime_budget(proxy_record["cgroup"], 0)
        for proc in (router, tuned):
            if proc is not None:
                proc.terminate()
                proc.wait()
        down(loaded.state_dir, triton, log=lambda _: None)


if __name__ == "__main__":
    main()

"""What the proxy costs: the same deployment loaded through HAProxy and straight at the instances.

    python bench/proxy_overhead.py [--duration 12] [--rounds 2] [--policy search] [--rate-scale 1]

Plans the CPU demo cluster (own ports and state) with `--policy` on the committed latency
model (`spread` needs none), applies it, then sends the demo's Poisson traffic (times
`--rate-scale`) alternately to the models' addresses (HAProxy) and to the instances' own
gRPC ports, `--rounds` times each, and prints p50 and p99 per model, and HAProxy's CPU
time per request it forwarded (user + system of its master and worker, from /proc, in 10 ms
ticks), in all and beyond what it uses idle (measured first, over `--duration` with no traffic).
"""

from __future__ import annotations

import argparse
import json
import time

from cpu_demo import CLUSTER, MODEL, REPO

from tritonctl.deploy.apply import apply_plan, down
from tritonctl.deploy.local import PROXY_FILE, LocalRuntime, group_cpu_seconds
from tritonctl.deploy.state import straight_to_instances
from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import load_plan, save_plan
from tritonctl.planning.planner import make_plan
from tritonctl.spec import load_cluster
from tritonctl.triton.binary import find_tritonserver
from tritonctl.triton.client import endpoints, run_load

WORK = REPO / ".tritonctl" / "proxy-bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of traffic per round and path")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (proxy, direct)")
    parser.add_argument("--base-port", type=int, default=8500, help="first model port (default 8500)")
    parser.add_argument("--policy", default="search", help="the plan to load (default search, the demo's)")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the demo rates (default 1)")
    args = parser.parse_args()
    demo = load_cluster(CLUSTER)
    cluster = demo.with_rates(lambda m: m.rate * args.rate_scale).with_runtime(
        base_port=args.base_port, state_dir=str(WORK / "state")
    )
    path = WORK / "plan.yaml"
    lm = None if args.policy == "spread" else load_latency_model(MODEL)
    artifacts = materialize(cluster, log=lambda _: None)
    save_plan(make_plan(cluster, artifacts, args.policy, path, lm, log=lambda _: None), path)
    loaded = load_plan(path)
    triton = LocalRuntime(find_tritonserver(loaded.plan.runtime.tritonserver), loaded.state_dir)
    apply_plan(loaded, triton, log=lambda _: None)
    try:
        routed = endpoints(loaded.plan)
        direct = straight_to_instances(routed, loaded.state_dir)
        proxy = json.loads((loaded.state_dir / PROXY_FILE).read_text())["pid"]
        before = group_cpu_seconds(proxy)
        time.sleep(args.duration)
        idle = (group_cpu_seconds(proxy) - before) / args.duration
        print(f"HAProxy idle (health checks, timers): {1000 * idle:.2f} ms of CPU per second")
        print(f"{'round':5} {'path':7} " + " ".join(f"{e.model + ' p50/p99 ms':>26}" for e in routed))
        for round_ in range(args.rounds):
            for name, targets in (("proxy", routed), ("direct", direct)):
                before = group_cpu_seconds(proxy)
                results = run_load(targets, args.duration, seed=round_)  # the plan's rates are already scaled
                cells = " ".join(f"{f'{r.percentile(50):.1f} / {r.percentile(99):.1f}':>26}" for r in results)
                forwarded = sum(len(r.latencies_ms) for r in results) if name == "proxy" else 0
                spent = group_cpu_seconds(proxy) - before
                used = (
                    f"  HAProxy CPU {1000 * spent / forwarded:.3f} ms/request"
                    f" ({1000 * (spent - idle * args.duration) / forwarded:.3f} beyond idle)"
                    if forwarded
                    else ""
                )
                print(f"{round_:5d} {name:7} {cells}{used}", flush=True)
    finally:
        down(loaded.state_dir, triton, log=lambda _: None)


if __name__ == "__main__":
    main()

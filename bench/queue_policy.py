"""What a bound on Triton's queue does to the requests it never refuses: the client's latency beside Triton's own.

    python bench/queue_policy.py [--scales 0.5 1] [--duration 15] [--out bench/results/queue-policy]

The four torchvision models at twice their rates (`bench/results/real-load/overload/cluster.yaml`, the
profile of `profiles/torchvision-four`), planned by `search` and applied three ways in turn: `none` (no
queue policy), `bounded` (`runtime.reject_late`: Triton's `default_queue_policy.max_queue_size` set to the
requests that still fit the SLO, `render.queue_limit`) and `unreached` (the same rendering with a bound of
1000, which no request reaches at these rates). Each is loaded with tritonctl's client (perf_analyzer stops
at the first refused request) at every scale; per model: the client's p50/p99 and refusals, and from
Triton's statistics (`/v2/models/<m>/stats` of the instance, before and after) the requests it answered and
their mean queue and compute times. Writes `queue-policy.md`. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import urllib.request
from pathlib import Path

from cpu_demo import REPO
from real_load import plan_for

import tritonctl.triton.render as render
from tritonctl.cli import main as tritonctl
from tritonctl.deploy.state import load_state
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.planning.plan import load_plan
from tritonctl.triton.client import endpoints, run_load

CLUSTER = REPO / "bench/results/real-load/overload/cluster.yaml"
LATENCY_MODEL = REPO / "profiles/torchvision-four/latency-model.json"
UNREACHED = 1000  # a queue bound no request reaches at these rates


def server_stats(state_dir: Path) -> dict[str, dict[str, tuple[int, int]]]:
    """Per model, Triton's cumulative (count, ns) of successes, queue and compute_infer."""
    out = {}
    for record in load_state(state_dir).instances.values():
        url = f"http://{record.host}:{record.http_port}/v2/models/{record.model}/stats"
        with urllib.request.urlopen(url, timeout=5) as response:
            stats = json.load(response)["model_stats"][0]["inference_stats"]
        keys = ("success", "queue", "compute_infer")
        out[record.model] = {key: (stats[key]["count"], stats[key]["ns"]) for key in keys}
    return out


@contextlib.contextmanager
def queue_bound(variant: str):
    """`unreached`: render every queue bound as UNREACHED while the plan is applied."""
    if variant != "unreached":
        yield
        return
    planned = render.queue_limit
    render.queue_limit = lambda model, placement: UNREACHED
    try:
        yield
    finally:
        render.queue_limit = planned


def mean_ms(after: tuple[int, int], before: tuple[int, int]) -> float:
    return (after[1] - before[1]) / max(1, after[0] - before[0]) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", nargs="+", type=float, default=[0.5, 1.0])
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/queue-policy")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# A bound on Triton's queue, and the requests it does not refuse",
        "",
        f"`python bench/queue_policy.py` on {cpu_fingerprint()['model']}: the four torchvision models at 2x their "
        f"rates, `search`'s plan, tritonctl's client, {args.duration:g} s a scale.",
        "",
        "| queue policy | scale | model | client p50 / p99 ms | refused | Triton answered | Triton mean queue / "
        "compute ms |",
        "|---|---|---|---|---|---|---|",
    ]
    plans = Path(tempfile.mkdtemp(prefix="queue-policy-"))
    for variant, deployment in (("none", "best"), ("bounded", "best-late"), ("unreached", "best-late")):
        path = plan_for(deployment, CLUSTER, LATENCY_MODEL, plans)
        with queue_bound(variant):
            assert tritonctl(["apply", str(path), "--accept-misses"]) == 0
        loaded = load_plan(path)
        try:
            for scale in args.scales:
                before = server_stats(loaded.state_dir)
                results = run_load(endpoints(loaded.plan), args.duration, scale)
                after = server_stats(loaded.state_dir)
                for r in results:
                    a, b = after[r.model], before[r.model]
                    queue, compute = mean_ms(a["queue"], b["queue"]), mean_ms(a["compute_infer"], b["compute_infer"])
                    row = (
                        f"| {variant} | {scale:g}x | {r.model} | {r.percentile(50):.1f} / {r.percentile(99):.1f} | "
                        f"{r.sent - r.ok} of {r.sent} | {a['success'][0] - b['success'][0]} | "
                        f"{queue:.1f} / {compute:.1f} |"
                    )
                    print(row, flush=True)
                    lines.append(row)
        finally:
            tritonctl(["down", str(path)])
    (args.out / "queue-policy.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

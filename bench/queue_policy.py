"""What a bound on Triton's queue does to the requests it never refuses: the client's latency beside Triton's own.

    python bench/queue_policy.py [--scales 0.5 1] [--duration 15] [--out bench/results/queue-policy]

The four torchvision models at twice their rates (`bench/results/real-load/overload/cluster.yaml`, the
profile of `profiles/torchvision-four`), planned by `search` and applied three ways in turn: `none` (no
queue policy), `bounded` (Triton's `default_queue_policy.max_queue_size` set to the requests that still fit
the SLO, `queue_limit`) and `unreached` (a bound of 1000, which no request reaches at these rates). It
shows why `runtime.reject_late` refuses late requests in the model's glue, not by Triton's queue policy:
here the plans that reject late requests render the queue policy instead of the glue's refusal. Each is loaded with
tritonctl's client (perf_analyzer stops at the first refused request) at every scale; per model: the
client's p50/p99 and refusals, and from Triton's statistics (`/v2/models/<m>/stats` of the instance,
before and after) the requests it answered and their mean queue and compute times. Writes
`queue-policy.md`. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
import urllib.request
from pathlib import Path

from cpu_demo import REPO
from google.protobuf import text_format
from real_load import plan_for
from tritonclient.grpc import model_config_pb2

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


def queue_limit(model, placement) -> int | None:
    """How many requests a queue holds before the next can only be late: a request that finds k batches ahead of
    it starts after about k batch times (1000 x batch / predicted throughput: its time at the plan's load), so
    with more than (SLO - batch time) / batch time of them it is late. At least one batch; None without a
    prediction."""
    if placement.predicted is None or not placement.predicted.throughput_rps:
        return None
    batch_ms = 1000 * placement.batch / placement.predicted.throughput_rps
    batches = max(1, math.floor((model.slo_ms - batch_ms) / batch_ms)) if batch_ms < model.slo_ms else 1
    return batches * placement.batch


@contextlib.contextmanager
def queue_bound(variant: str):
    """While a plan is applied, render Triton's queue policy where the plan asks to reject late requests (not the
    glue's refusal): `bounded` by `queue_limit`, `unreached` by UNREACHED."""
    if variant == "none":
        yield
        return
    plain = render.render_config

    def bounded(cluster, model, placement, device, reject_late=False, threads=None):
        text = plain(cluster, model, placement, device, False, threads)
        limit = UNREACHED if variant == "unreached" else queue_limit(model, placement)
        if not reject_late or limit is None:
            return text
        head, body = text.split("\n", 1)
        config = text_format.Parse(body, model_config_pb2.ModelConfig())
        config.dynamic_batching.default_queue_policy.max_queue_size = limit
        return f"{head}\n{text_format.MessageToString(config)}"

    render.render_config = bounded
    try:
        yield
    finally:
        render.render_config = plain


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
    for variant, deployment in (("none", "best-serveall"), ("bounded", "best"), ("unreached", "best")):
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

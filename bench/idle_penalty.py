"""What a request costs after the instance has been idle, against back to back: the latency the profile misses.

    python bench/idle_penalty.py [--requests 60] [--gaps 0 0.05 0.2] [--busy]

The CPU demo is planned with `search` on the committed latency model and applied on the real
local Triton. For each model, one client sends single requests (batch 1) straight to its
instance (not through the proxy), waiting each gap between the answer and the next request,
and prints the median latency per gap. The profile's grid is measured back to back (gap 0), as
a closed-loop client does; open-loop traffic at the demo's rates leaves an instance idle for
tens of milliseconds between requests, which is why the profile also measures the wake-up
(wake.csv). With `--busy` the other two models are driven back to back meanwhile (one
client each, straight to their instances), as under load, where the profile's wake-up was
measured on an otherwise idle machine. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient
from cpu_demo import REPO, applied, plan_demo

from tritonctl.deploy.state import straight_to_instances
from tritonctl.triton.client import Endpoint, closed_loop, endpoints, random_request

PLAN = REPO / ".tritonctl" / "idle-penalty" / "plan.yaml"


def median_ms(endpoint: Endpoint, gap_s: float, requests: int) -> float:
    infer_input = random_request(endpoint, np.random.default_rng(0))
    outputs = [grpcclient.InferRequestedOutput(endpoint.output_name)]
    latencies = []
    with grpcclient.InferenceServerClient(endpoint.url) as client:
        for _ in range(requests):
            time.sleep(gap_s)
            start = time.perf_counter()
            client.infer(endpoint.model, [infer_input], outputs=outputs)
            latencies.append((time.perf_counter() - start) * 1000)
    return float(np.median(latencies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60, help="requests per model and gap")
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.0, 0.05, 0.2], help="idle seconds before each")
    parser.add_argument("--busy", action="store_true", help="keep the other models busy meanwhile")
    args = parser.parse_args()
    with applied(plan_demo(out=PLAN)) as loaded:
        targets = straight_to_instances(endpoints(loaded.plan), loaded.state_dir)
        rows = []
        for endpoint in targets:
            stop = threading.Event()
            others = [t for t in targets if t.model != endpoint.model] if args.busy else []
            load = [threading.Thread(target=closed_loop, args=(t, stop)) for t in others]
            for thread in load:
                thread.start()
            try:
                medians = [median_ms(endpoint, gap, args.requests) for gap in args.gaps]
                rows.append((endpoint.model, medians))
            finally:
                stop.set()
                for thread in load:
                    thread.join()
    print(f"\n{'model':14} " + " ".join(f"{f'p50 ms, gap {1000 * g:g} ms':>20}" for g in args.gaps))
    for model, medians in rows:
        print(f"{model:14} " + " ".join(f"{m:20.1f}" for m in medians))


if __name__ == "__main__":
    main()

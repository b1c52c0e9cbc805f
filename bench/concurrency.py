"""How much each demo model slows down when the others run at the same time on the CPU.

    python bench/concurrency.py [--seconds 15]

Applies the CPU demo's `search` plan (the three models taking turns with the whole CPU:
three tritonserver processes, each with the full quota), then drives each model closed-loop
(one request at a time, back to back, through tritonclient.grpc): alone, in every pair, and
all three at once. Printed: each model's median latency alone, and its slowdown in each
combination. Processor sharing with 1/n (the simulator's model of a CPU in turns) predicts
2x in a pair and 3x in the triple, if each model kept the cores busy alone. The deployment is
stopped at the end. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time

from cpu_demo import applied, plan_demo

from tritonctl.triton.client import Endpoint, closed_loop, endpoints

WARMUP = 3  # requests per model and run left out of the median


def medians(targets: list[Endpoint], seconds: float) -> dict[str, float]:
    """Every target driven back to back at once for `seconds`: each one's median latency (ms)."""
    stop = threading.Event()
    latencies: dict[str, list[float]] = {t.model: [] for t in targets}
    threads = [threading.Thread(target=closed_loop, args=(t, stop, latencies[t.model])) for t in targets]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return {m: statistics.median(x[WARMUP:]) for m, x in latencies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds per combination (default 15)")
    args = parser.parse_args()
    rows = []
    with applied(plan_demo()) as loaded:
        targets = endpoints(loaded.plan)
        alone = {t.model: medians([t], args.seconds)[t.model] for t in targets}
        for size in (2, 3):
            for combo in itertools.combinations(targets, size):
                together = medians(list(combo), args.seconds)
                rows.append([(m, together[m] / alone[m]) for m in together])
    print("\nmedian latency alone, back to back: " + ", ".join(f"{m} {ms:.1f} ms" for m, ms in alone.items()))
    print("slowdown with the others back to back at the same time (processor sharing with 1/n: 2x, 3x):")
    for row in rows:
        print("  " + " + ".join(m for m, _ in row) + ": " + ", ".join(f"{m} {x:.2f}x" for m, x in row))
        print(f"    work done per second, against the models one at a time: {sum(1 / x for _, x in row):.2f}")


if __name__ == "__main__":
    main()

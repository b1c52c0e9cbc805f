"""How much batching buys on this CPU: solo throughput at batch 1 against the best batch, per model and share.

    python bench/batching_gain.py [profiles/cpu-demo/measurements.csv]

Reads a profile's measurements (tritonctl profile); throughput = batch / mean latency.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "profiles" / "cpu-demo" / "measurements.csv"
    rates: dict[tuple[str, int], dict[int, float]] = {}
    for row in csv.DictReader(path.open()):
        if row["kind"] == "solo":
            batch = int(row["batch"])
            rates.setdefault((row["model"], int(row["share"])), {})[batch] = 1000 * batch / float(row["mean_ms"])
    print(f"{'model':14} {'share':>5} {'batch 1 req/s':>13} {'best batch':>10} {'req/s':>7} {'gain':>6}")
    for (model, share), by_batch in sorted(rates.items()):
        if 1 not in by_batch:
            continue
        best = max(by_batch, key=by_batch.get)
        gain = 100 * (by_batch[best] / by_batch[1] - 1)
        print(f"{model:14} {share:5d} {by_batch[1]:13.1f} {best:10d} {by_batch[best]:7.1f} {gain:+5.0f}%")


if __name__ == "__main__":
    main()

"""One table over several bench/real_load.py runs: per cluster and deployment, capacity under each tool, goodput
at 1x, and at 1x the worst error of the plan's simulated p99 (its eq. 2 p99 where a run has none) against
perf_analyzer's measured one.

    python bench/real_load_table.py DIR [DIR ...]

Each DIR is a real_load.py output folder (its results.json); the cluster is named after the folder.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from real_load import Row, capacity


def table(runs: dict[str, list[Row]]) -> str:
    lines = [
        "| cluster | deployment | capacity, perf_analyzer / tritonctl (x rates) | goodput at 1x, perf_analyzer / "
        "tritonctl (req/s of offered) | worst p99 at 1x, measured / predicted (ms) |",
        "|---|---|---|---|---|",
    ]
    for cluster, rows in runs.items():
        for deployment in dict.fromkeys(r.deployment for r in rows):
            lowest = min(r.scale for r in rows)
            caps = " / ".join(
                "-" if not any((r.deployment, r.tool) == (deployment, tool) for r in rows)
                else f"{capacity(rows, deployment, tool):g}" if capacity(rows, deployment, tool) else f"<{lowest:g}"
                for tool in ("perf_analyzer", "tritonctl")
            )  # fmt: skip
            goods = []
            for tool in ("perf_analyzer", "tritonctl"):
                cells = [r for r in rows if (r.deployment, r.tool, r.scale) == (deployment, tool, 1.0)]
                good, offered = sum(r.good_rps for r in cells), sum(r.offered_rps for r in cells)
                goods.append("-" if not cells or math.isnan(good) else f"{good:.1f} of {offered:.1f}")
            at_1x = [
                (r, r.simulated_p99_ms or r.predicted_p99_ms) for r in rows
                if (r.deployment, r.tool, r.scale) == (deployment, "perf_analyzer", 1.0)
                and (r.simulated_p99_ms or r.predicted_p99_ms)
            ]  # fmt: skip
            worst = max(at_1x, key=lambda x: abs(x[0].p99_ms / x[1] - 1), default=None)
            error = "-"
            if worst and not math.isnan(worst[0].p99_ms):
                (r, predicted) = worst
                error = f"{r.model} {r.p99_ms:.0f} / {predicted:.0f} ({100 * (r.p99_ms / predicted - 1):+.0f}%)"
            lines.append(f"| {cluster} | {deployment} | {caps} | {' / '.join(goods)} | {error} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    runs = {d.name: [Row(**r) for r in json.loads((d / "results.json").read_text())] for d in args.runs}
    print(table(runs), end="")


if __name__ == "__main__":
    main()

"""The CPU demo as the benchmarks on the real local Triton use it: its cluster, its committed latency
model, and a plan of it applied for the length of a block. (Benchmarks run as scripts, so bench/ is on
their import path.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tritonctl.cli import main as tritonctl
from tritonctl.planning.plan import LoadedPlan, load_plan

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "examples" / "cpu-demo" / "cluster.yaml"
MODEL = REPO / "profiles" / "cpu-demo" / "latency-model.json"


def plan_demo(policy: str = "search", out: Path | None = None) -> Path:
    """The demo cluster planned with `policy` on the committed latency model; returns the plan's path (`out`, or
    plan.yaml beside the cluster, where `make demo` writes it)."""
    path = out or CLUSTER.parent / "plan.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    assert tritonctl(["plan", str(CLUSTER), "--policy", policy, "--latency-model", str(MODEL), "-o", str(path)]) == 0
    return path


@contextlib.contextmanager
def applied(plan_path: Path) -> Iterator[LoadedPlan]:
    """The plan applied on the local Triton for the block, and stopped after it, whatever happens in it."""
    assert tritonctl(["apply", str(plan_path)]) == 0
    try:
        yield load_plan(plan_path)
    finally:
        tritonctl(["down", str(plan_path)])

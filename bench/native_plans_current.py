"""Whether the best plans the native benchmark served (bench/native.sh, measured under perf_analyzer and
tritonctl's client) are still the plans `search` makes: each cluster re-planned at each scale from the same
profile with the code as it is, placements (model, device, share, batch) compared with the committed plan.

    python bench/native_plans_current.py    # planning only, seconds; writes bench/results/native/plans-current.md
"""

from __future__ import annotations

from pathlib import Path

from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import Plan, load_plan
from tritonctl.planning.planner import make_plan
from tritonctl.spec import load_cluster

BENCH = Path(__file__).resolve().parent
PROFILES = {
    "torchvision-four": "torchvision-four-limited",
    "random-0-1": "random-0-1",
    "cpu-demo": "cpu-demo-limited",
    "random-0-0": "random-0-0-limited",
    "random-0-2": "random-0-2-limited",
}
SCALES = (1, 2, 3, 4)


def placements(plan: Plan) -> list[tuple]:
    return sorted((m.name, p.device, p.share, p.batch) for m in plan.models for p in m.placements)


def main() -> None:
    rows = []
    for name, profile in PROFILES.items():
        lm = load_latency_model(BENCH / f"results/profiles-epyc-32k/{profile}/latency-model.json")
        base = load_cluster(BENCH / f"results/overload/{name}/cluster.yaml")
        artifacts = materialize(base, log=lambda _: None)
        for scale in SCALES:
            served = BENCH / f"results/native/{name}/plan-best-replan{'' if scale == 1 else f'-x{scale}'}.yaml"
            cluster = base.with_rates(lambda m, s=scale: m.rate * s)
            now = make_plan(cluster, artifacts, "search", Path("/dev/null"), lm, log=lambda _: None)
            same = placements(now) == placements(load_plan(served).plan)
            rows.append(f"| {name} | {scale}x | {'the same' if same else 'different'} |")
            print(rows[-1], flush=True)
    same = sum("the same" in r for r in rows)
    text = "\n".join(
        [
            "# The native benchmark's best plans, planned again with the current code",
            "",
            "`python bench/native_plans_current.py`: placements (model, device, share, batch) against the served plan.",
            "",
            "| cluster | scale | placements |",
            "|---|---|---|",
            *rows,
            "",
            f"{same} of {len(rows)} the same.",
        ]
    )
    (BENCH / "results/native/plans-current.md").write_text(text + "\n")


if __name__ == "__main__":
    main()

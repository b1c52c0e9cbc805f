"""What leaving out the configurations no plan can use costs a profile's fit, on every committed CPU profile
that measured them all.

    python bench/profile_beyond.py [--out bench/results/profile-beyond.md]

`tritonctl profile` measures a model's solo configurations in waves of rising batch size and leaves out
every one with no more share and a larger batch than one already measured slower than twice the model's
SLO (profiler/grid.py). The committed profiles below measured everything, so what the rule leaves out is
known: each profile is fitted twice, on all its rows and on the rows the rule keeps (the slow ones as
floors, as `fit` does), and both fits are judged on the held-out rows the rule keeps. The left-out rows are
the check that matters: a left-out configuration predicted within its SLO could enter a plan, so the table
gives the fastest prediction among them, in SLOs. Fitting only: no measurement is made.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np

from tritonctl.latency.dataset import Dataset, load_dataset
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.report import evaluate
from tritonctl.profiler.grid import SLOWER_THAN_SLO, Member, coloc_runs, colocated, left_out, solo_runs
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
CLUSTERS = {  # a profile's cluster name -> the cluster file whose SLOs it was measured for
    "cpu-demo": "examples/cpu-demo/cluster.yaml",
    "torchvision-four": "examples/torchvision-four/cluster.yaml",
    **{f"random-0-{i}": f"bench/results/real-load/random/random-0-{i}.yaml" for i in range(3)},
}
PROFILES = [REPO / "profiles", REPO / "bench/results/profiles-epyc-32k"]


def limited(dataset: Dataset, slo: dict[str, float]) -> tuple[Dataset, list]:
    """The dataset as a profile with the rule would have measured it, and the solo rows it leaves out."""
    limits = {name: SLOWER_THAN_SLO * ms for name, ms in slo.items()}
    slow = [
        Member(r.model, r.share, r.batch)
        for r in dataset.rows
        if r.kind == "solo" and r.split == "train" and r.p50_ms > limits[r.model]
    ]
    units = dataset.rows[0].units
    runs = solo_runs(list(dataset.models), units) + coloc_runs(list(dataset.models), units)
    measured_colocated = colocated(runs)
    unused = {run.group for run in runs if left_out(run, slow, measured_colocated)}
    left = [r for r in dataset.rows if r.config_id in unused]
    kept = copy.copy(dataset)
    kept.rows = [r for r in dataset.rows if r.config_id not in unused]
    kept.metadata = {**dataset.metadata, "slower_than_ms": limits}
    return kept, left


def _errors(lm, dataset: Dataset) -> str:
    judged = evaluate(lm, dataset, None)
    out = []
    for kind in ("solo", "coloc"):
        e = 100 * np.array([x.error("inss") for x in judged if x.row.kind == kind])
        out.append(f"{np.median(e):.1f}% / {np.percentile(e, 95):.1f}%" if len(e) else "-")
    return " | ".join(out)


def rows() -> list[str]:
    out = []
    for folder in sorted(f for parent in PROFILES for f in parent.iterdir() if (f / "measurements.csv").exists()):
        dataset = load_dataset(folder)
        name = dataset.metadata.get("cluster")
        if dataset.metadata["device"].get("kind") != "cpu" or name not in CLUSTERS:
            continue
        if "slower_than_ms" in dataset.metadata:  # measured with the rule: what it left out is not known
            continue
        slo = {m.name: m.slo_ms for m in load_cluster(REPO / CLUSTERS[name]).spec.models}
        kept, dropped = limited(dataset, slo)
        quiet = {"log": lambda _: None}
        full, fewer = fit_latency_model(dataset, **quiet), fit_latency_model(kept, **quiet)
        solo = [r for r in dataset.rows if r.kind == "solo"]
        seconds = sum(r.reps * r.mean_ms for r in dropped) / 1000
        fastest = min(
            (fewer.t_inf(r.model, r.batch, r.share) / slo[r.model] for r in dropped),
            default=float("nan"),
        )
        where = f"{folder.parent.name}/{folder.name}"
        out.append(
            f"| {where} | {len(dropped)} of {len(solo)} | {seconds:.0f} s | {_errors(full, kept)} | "
            f"{_errors(fewer, kept)} | {fastest:.2f} |"
        )
    return out


def drift() -> list[str]:
    """Per profile measured with the rule, beside a full profile of the same cluster on the same device: how much
    slower its solo configurations measured than the full profile's same ones (median and range by batch size)."""
    out = []
    folders = [f for parent in PROFILES for f in sorted(parent.iterdir()) if (f / "measurements.csv").exists()]
    for limited_folder in folders:
        limited_set = load_dataset(limited_folder)
        if "slower_than_ms" not in limited_set.metadata:
            continue
        for full_folder in folders:
            full = load_dataset(full_folder)
            key = [(d.metadata.get("cluster"), d.metadata["device"]) for d in (full, limited_set)]
            if "slower_than_ms" in full.metadata or key[0] != key[1]:
                continue
            before = {(r.config_id, r.model): r.p50_ms for r in full.rows if r.kind == "solo"}
            ratios: dict[int, list[float]] = {}
            for r in limited_set.rows:
                if r.kind == "solo" and (r.config_id, r.model) in before:
                    ratios.setdefault(r.batch, []).append(r.p50_ms / before[(r.config_id, r.model)] - 1)
            medians = [100 * float(np.median(v)) for v in ratios.values()]
            every = 100 * float(np.median([x for v in ratios.values() for x in v]))
            out.append(
                f"| {limited_folder.parent.name}/{limited_folder.name} | {full_folder.parent.name}/{full_folder.name} "
                f"| {sum(map(len, ratios.values()))} | {every:+.1f}% | {min(medians):+.1f}% to {max(medians):+.1f}% |"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/profile-beyond.md")
    args = parser.parse_args()
    lines = [
        "# Leaving out the configurations no plan can use",
        "",
        f"`python bench/profile_beyond.py`: solo configurations with no more share and a larger batch than one "
        f"slower than {SLOWER_THAN_SLO:g}x the model's SLO, left out of committed profiles that measured them; "
        "the measuring time they took (batches alone, without warm-up); held-out errors (median / p95, on the "
        "held-out rows the rule keeps) of the fit on every row and of the fit on the kept rows with floors; the "
        "fastest prediction among the left-out configurations, in SLOs (above 1: none can enter a plan).",
        "",
        "| profile | left out | their time | all rows: solo | co-located | kept rows: solo | co-located "
        "| fastest left out (SLOs) |",
        "|---|---|---|---|---|---|---|---|",
        *rows(),
        "",
        "Profiles measured with the rule beside a full profile of the same cluster on the same device: how much "
        "slower the same solo configurations measured (median of all, and the range of the medians by batch size).",
        "",
        "| profile with the rule | full profile | configurations in both | median | by batch size |",
        "|---|---|---|---|---|",
        *drift(),
    ]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()

"""A SYNTHETIC profile dataset generated from a known latency formula, so fits can be checked against the truth."""

from __future__ import annotations

import random
from pathlib import Path

from tritonctl.latency.dataset import Dataset, Measurement, MemoryPoint, ModelFeatures, load_dataset
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.profiler.grid import coloc_runs, solo_runs
from tritonctl.shares import threads_for_cores

# The truth behind the synthetic datasets.
PER_SAMPLE_MS = {"alpha": 4.0, "beta": 9.0}
ALPHA_CACHE = {"alpha": 0.10, "beta": 0.05}


def true_latency(model: str, batch: int, share: int, corunners) -> float:
    cores = 2 * share / 100
    eff = min(cores, threads_for_cores(cores))
    run = (1.0 + PER_SAMPLE_MS[model] * batch**0.9) / eff
    pressure = sum(min(2 * s / 100, threads_for_cores(2 * s / 100)) for _, s, _ in corunners)
    duty = eff / threads_for_cores(cores)  # the co-runners are felt while the instance's threads may run
    return 0.5 + 0.001 * batch + run * (1 + ALPHA_CACHE[model] * pressure * duty)


def _rows(group: str, kind: str, split: str, members: list[tuple[str, int, int]]) -> list[Measurement]:
    """The measurements of one run: each member at the truth's latency beside the others."""
    rows = []
    for model, share, batch in members:
        others = tuple(m for m in members if m[0] != model)
        t = true_latency(model, batch, share, others)
        cores = 2 * share / 100
        rows.append(
            Measurement(
                config_id=group,
                kind=kind,
                split=split,
                model=model,
                batch=batch,
                share=share,
                units=100,
                cores=2.0,
                threads=threads_for_cores(cores),
                corunners=";".join(f"{m}:{s}:{b}" for m, s, b in others),
                n_colocated=len(members),
                reps=10,
                p50_ms=t,
                p95_ms=t,
                p99_ms=t,
                mean_ms=t,
                compute_ms=t - 0.5 - 0.001 * batch,
                queue_ms=0.1,
                rss_mb=300,
                cpu_util=min(cores, threads_for_cores(cores)),
            )
        )
    return rows


def synthetic_dataset(folder: Path, extra_coloc: int = 0) -> Dataset:
    """The profile, with `extra_coloc` more random co-located pairs (the MLP needs more than the grid's)."""
    features = [ModelFeatures(m, "0" * 64, 10, 64, 16, 1000, 5000) for m in PER_SAMPLE_MS]
    dataset = Dataset.create(
        folder,
        {
            "cluster": "test",
            "device": cpu_fingerprint(),
            "created": "synthetic",
            "share_mechanism": "synthetic",
            "complete": True,
            "duration_s": 0,
        },
        features,
    )
    rows = []
    for run in solo_runs(list(PER_SAMPLE_MS), 100) + coloc_runs(list(PER_SAMPLE_MS), 100):
        members = [(m.model, m.share, m.batch) for m in run.members]
        rows += _rows(run.group, run.kind, run.split, members)
    rng = random.Random(0)
    for k in range(extra_coloc):  # random pairs, one in five held out
        first = rng.choice(range(20, 81, 10))
        shares = (first, rng.choice(range(20, 101 - first, 10)))
        members = [(m, s, rng.choice((1, 2, 4, 8, 16))) for m, s in zip(PER_SAMPLE_MS, shares, strict=True)]
        rows += _rows(f"extra-{k}", "coloc", "heldout" if k % 5 == 0 else "train", members)
    memory = [MemoryPoint(m, 1, b, 100 + 5 * b) for m in PER_SAMPLE_MS for b in (1, 2, 4, 8, 16, 32)]
    dataset.append(rows, memory)
    return load_dataset(folder)

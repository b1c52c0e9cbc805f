"""How far a profile's held-out measurements repeat, against how far its fit is from them.

    python bench/profile_repeat.py PROFILE CLUSTER --out DIR      # quiet machine, a few minutes

Copies the profile to DIR/profile without its held-out solo rows and resumes `tritonctl profile CLUSTER` there,
which measures exactly those configurations again (and then the repeat rows, where the profile has none yet).
The training rows are untouched, so the fit is the profile's own; its held-out error is judged against the first
measurement, the second, and their mean, beside how far the two measurements are apart. Where the two are as far
apart as the fit is from either, the held-out error is the machine's spread, not the model's. Writes DIR/repeat.md.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import shutil
from pathlib import Path

import numpy as np

from tritonctl.cli import main as tritonctl
from tritonctl.latency.dataset import load_dataset
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.report import evaluate

CSV = "measurements.csv"


def held_out(folder: Path) -> dict[str, float]:
    """The p50 of every held-out solo configuration of a profile, by configuration id."""
    with open(folder / CSV, newline="") as f:
        return {
            r["config_id"]: float(r["p50_ms"]) for r in csv.DictReader(f) if r["config_id"].startswith("solo/heldout/")
        }


def summary(errors: list[float]) -> str:
    e = 100 * np.array(errors)
    return f"median {np.median(e):.1f}%, p95 {np.percentile(e, 95):.1f}%, max {e.max():.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("cluster", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    again = args.out / "profile"
    if again.exists():
        raise SystemExit(f"{again} exists: take a new --out")
    shutil.copytree(args.profile, again, ignore=shutil.ignore_patterns("report", "work", "latency-model*", "fit.txt"))
    with open(again / CSV, newline="") as f:
        rows = list(csv.reader(f))
    with open(again / CSV, "w", newline="") as f:
        csv.writer(f).writerows([r for r in rows if not r[0].startswith("solo/heldout/")])
    started = dt.datetime.now(dt.UTC)
    if tritonctl(["profile", str(args.cluster), "-o", str(again)]) != 0:
        return 1
    first, second = held_out(args.profile), held_out(again)
    both = sorted(set(first) & set(second))
    model = fit_latency_model(load_dataset(args.profile), log=lambda _: None)
    predicted = {e.row.config_id: e.inss for e in evaluate(model, load_dataset(args.profile), None)}
    apart = [abs(second[k] - first[k]) / first[k] for k in both]
    ratio = np.array([second[k] / first[k] for k in both])

    def fit_against(truth: dict[str, float]) -> str:
        return summary([abs(predicted[k] - truth[k]) / truth[k] for k in both])

    mean = {k: (first[k] + second[k]) / 2 for k in both}
    meta, here = json.loads((args.profile / "metadata.json").read_text()), cpu_fingerprint()
    lines = [
        f"# Held-out measurements of `{args.profile}` measured again",
        "",
        f"`python bench/profile_repeat.py {args.profile} {args.cluster} --out {args.out}`",
        "",
        f"First measured {meta.get('created')} on CPU id {meta['device'].get('id')}; again from "
        f"{started:%Y-%m-%dT%H:%M}Z on CPU id {here['id']} ({here['model']}).",
        "",
        f"| {len(both)} held-out solo configurations | \\|error\\| / measured p50 |",
        "|---|---|",
        f"| second measurement against the first | {summary(apart)} |",
        f"| the profile's fit against the first | {fit_against(first)} |",
        f"| the profile's fit against the second | {fit_against(second)} |",
        f"| the profile's fit against their mean | {fit_against(mean)} |",
        "",
        f"Second over first: median {np.median(ratio):.3f}, quartiles {np.percentile(ratio, 25):.3f} and "
        f"{np.percentile(ratio, 75):.3f}.",
        "",
    ]
    (args.out / "repeat.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

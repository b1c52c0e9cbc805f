"""Held-out errors of the latency model's forms on every committed profile with held-out rows: what each
part of the fit is worth, measured on data it never saw.

    python bench/fit_forms.py [--out bench/results/fit-forms.md]

Forms, each fitted to a profile's training rows (`fit_latency_model`):
- plane: the local fits of degree 1 only, the co-runners' pressure unweighed;
- quadratic: the local fits' degree (1 or 2) chosen with the bandwidth by cross-validation;
- quadratic, duty: that, and on a CPU the pressure weighed by each instance's own duty;
- quadratic, duty, relative: that, with the interference terms fitted to relative errors rather than to
  milliseconds (what `fit` does).
Errors are |predicted - observed| / observed of the median client latency of a batch, on the profile's
held-out rows, as `tritonctl fit --report` computes them. Fitting only: no measurement is made.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tritonctl.latency.dataset import load_dataset
from tritonctl.latency.fit import DEGREES, fit_latency_model
from tritonctl.latency.report import evaluate

REPO = Path(__file__).resolve().parent.parent
FORMS = {
    "plane": ((1,), False, False),
    "quadratic": (DEGREES, False, False),
    "quadratic, duty": (DEGREES, True, False),
    "quadratic, duty, relative": (DEGREES, True, True),
}
PROFILES = ("profiles", "bench/results/profiles-epyc-32k")  # committed profiles with held-out rows


def _summary(errors: list[float]) -> str:
    e = 100 * np.array(errors)
    return f"{np.median(e):.1f}% / {np.percentile(e, 95):.1f}%" if len(e) else "-"


def rows() -> list[str]:
    out = []
    for folder in sorted(f for top in PROFILES for f in (REPO / top).iterdir()):
        if not (folder / "measurements.csv").exists():
            continue
        dataset = load_dataset(folder)
        device = dataset.metadata["device"]
        l1d = device.get("caches", {}).get("L1 Data")
        where = device.get("model", "?") + (f", {l1d} L1d" if l1d else "")
        for form, (degrees, by_duty, relative) in FORMS.items():
            lm = fit_latency_model(
                dataset, log=lambda _: None, degrees=degrees, pressure_by_duty=by_duty, relative=relative
            )
            judged = evaluate(lm, dataset, None)
            solo = [e.error("inss") for e in judged if e.row.kind == "solo"]
            coloc = [e.error("inss") for e in judged if e.row.kind == "coloc"]
            out.append(f"| {folder.relative_to(REPO)} ({where}) | {form} | {_summary(solo)} | {_summary(coloc)} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/fit-forms.md")
    args = parser.parse_args()
    lines = [
        "# Held-out errors of the latency model's forms",
        "",
        "`python bench/fit_forms.py`: every committed profile with held-out rows, fitted four ways; "
        "median / p95 of the held-out errors (targets: solo 5% / 10%, co-located median 8%).",
        "",
        "| profile | form | solo median / p95 | co-located median / p95 |",
        "|---|---|---|---|",
        *rows(),
    ]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()

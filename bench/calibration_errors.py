"""How well calibration carries the demo's profile to another CPU, over every committed calibration log.

    python bench/calibration_errors.py [LOG ...] [--out bench/results/calibration-errors.md]

Each log is the output of `tritonctl calibrate` or of `tritonctl demo` where it calibrated: per point the
measured latency and the source model's prediction, and the held-out error before and after as calibrate
printed it. Beside what calibrate printed, the fitting points of each log are refitted with smaller factor forms
(k * batch^gamma * share^delta without gamma, without delta, k alone) and their held-out errors computed the
same way, on the source model's predictions as logged: whether three parameters on three points overfit.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
from pathlib import Path

import numpy as np

from profiler.calibrate import POINTS
from tritonctl.latency.model import load_latency_model

SOURCE = Path("profiles/cpu-demo/latency-model.json")
POINT = re.compile(r"^(\S+)\s+batch\s+(\d+) share\s+(\d+):\s+([\d.]+) ms,.*\(source model\s+([\d.]+) ms\)")
HELD_OUT = re.compile(
    r"held-out points \(\d+\): median \|error\| ([\d.]+)% before, ([\d.]+)% after; worst after ([\d.]+)%"
)
ROUNDS = re.compile(r"in its \d+ rounds: ([\d.]+)% apart \(median\), ([\d.]+)% at most")
CPU = re.compile(r"L1d (\S+) / L2 (\S+) CPU id ([0-9a-f]{12})")
FORMS = {
    "k, gamma, delta (shipped)": (True, True),
    "k, delta": (False, True),
    "k, gamma": (True, False),
    "k": (False, False),
}


def committed_logs() -> dict[Path, list[str]]:
    """Every committed CPU calibration log that printed its points, read once."""
    listed = subprocess.run(["git", "grep", "-l", "held-out points (", "--", "bench/results"], capture_output=True,
                            text=True, check=True).stdout.split()  # fmt: skip
    logs = {Path(p): _lines(Path(p)) for p in listed}
    return {p: lines for p, lines in logs.items() if _points(lines) and any("on this CPU" in x for x in lines)}


def _lines(path: Path) -> list[str]:
    return [re.sub(r"^\d\d:\d\d:\d\d ", "", line).strip() for line in path.read_text().splitlines()]


def _points(lines: list[str]) -> list[tuple[str, int, int, float, float]]:
    """(model, batch, share, measured ms, source ms) of every point the log printed."""
    return [(m[1], int(m[2]), int(m[3]), float(m[4]), float(m[5])) for line in lines if (m := POINT.match(line))]


def refit(lm, points, use_gamma: bool, use_delta: bool) -> list[float]:
    """Held-out errors (predicted / measured - 1) of the factor form fitted, as calibrate fits it, on the fitting
    points; a held-out point's prediction is its source running time times the factor, plus its upload."""
    fitting = {(b, round(f * 100)) for b, f in POINTS["cpu"][0]}
    full = lm.eff(lm.device.units)
    errors = []
    for name in sorted({p[0] for p in points}):
        mine = [p for p in points if p[0] == name]
        rows = []
        for _, b, s, measured, source in mine:
            if (b, s) in fitting:
                io = lm.io_ms(name, b)
                ratio = max(measured - io, 0.05 * measured) / max(source - io, 1e-6)
                rows.append((math.log(b), math.log(lm.eff(s) / full), math.log(ratio)))
        x = np.array(rows)
        terms = [np.ones(len(x))] + [x[:, i] for i, used in ((0, use_gamma), (1, use_delta)) if used]
        coef = iter(np.linalg.lstsq(np.column_stack(terms), x[:, 2], rcond=None)[0])
        log_k = next(coef)
        gamma, delta = (next(coef) if used else 0.0 for used in (use_gamma, use_delta))
        for _, b, s, measured, source in mine:
            if (b, s) not in fitting:
                io = lm.io_ms(name, b)
                predicted = io + (source - io) * math.exp(log_k) * b**gamma * (lm.eff(s) / full) ** delta
                errors.append(predicted / measured - 1)
    return errors


def _summary(errors: list[float]) -> str:
    sizes = sorted(abs(e) * 100 for e in errors)
    return f"{statistics.median(sizes):.1f}% / {sizes[-1]:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="*", type=Path, help="calibration logs (default: every committed one)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/calibration-errors.md"))
    args = parser.parse_args()
    lm = load_latency_model(SOURCE)
    logs = {path: _lines(path) for path in args.logs} if args.logs else committed_logs()
    texts = {path: "\n".join(lines) for path, lines in logs.items()}
    rows, pooled = [], {form: [] for form in FORMS}
    caches = {m[3]: f"{m[1]} / {m[2]}" for text in texts.values() for m in CPU.finditer(text)}
    for path, text in texts.items():
        held, spread = HELD_OUT.search(text), ROUNDS.search(text)
        cpu_id = next(iter(re.findall(r"CPU id ([0-9a-f]{12})", text) or re.findall(r"[0-9a-f]{12}", path.name)), "")
        machine = f"{caches.get(cpu_id, '?')} ({cpu_id})" if cpu_id else "not logged"
        points = _points(logs[path])
        refits = {form: refit(lm, points, *used) for form, used in FORMS.items()}
        for form, errors in refits.items():
            pooled[form] += errors
        rows.append(
            f"| [{path.parent.name}/{path.name}]({path.relative_to(args.out.parent)}) | {machine} | {held[1]}% | "
            f"{held[2]}% / {held[3]}% | {spread[1] + '% / ' + spread[2] + '%' if spread else '-'} | "
            + " | ".join(_summary(refits[form]) for form in FORMS)
            + " |"
        )
    out = [
        "# Calibration of the demo's profile to other CPUs, every committed log",
        "",
        "`python bench/calibration_errors.py` (the source: `profiles/cpu-demo/latency-model.json`, profiled on "
        "an Intel Xeon VM). Held-out errors: median / worst |predicted / measured - 1| over the six held-out "
        "points (two a model); rounds: how far apart one point's three rounds were (median / widest), the "
        "machine's own noise. The refitted columns fit each factor form to the same logged points (predictions: "
        "the source running time times the factor, plus the upload term of today's source model).",
        "",
        "| log | L1d / L2 (CPU id) | held-out before (median) | after, as printed (median / worst) | rounds | "
        + " | ".join(f"refit {form}" for form in FORMS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(FORMS),
        *rows,
        "",
        f"Pooled over {len(pooled['k'])} held-out points of {len(logs)} calibrations (median / worst): "
        + "; ".join(f"{form} {_summary(errors)}" for form, errors in pooled.items())
        + ".",
        "",
    ]
    args.out.write_text("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    main()

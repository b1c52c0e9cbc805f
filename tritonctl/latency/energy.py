"""EAIS's energy model: batch time and energy per image of each model over batch size x SM clock, fitted.

The measurements (`python3 -m tritonctl.profiler.energy` on a GPU host) sample a few batch sizes at a few
locked clocks. EAIS (Algorithm 1) completes them with fitted curves, in two passes:

1. per sampled batch size, over the clock f: the batch time by a rational function, T(f) = a / f + c (the part
   of the work that scales with the clock, and the part that does not), the energy per image by a one-term
   Fourier curve, E(f) = a0 + a1 cos(w f) + b1 sin(w f) (high at low clocks, where static power runs longer,
   and at high ones, where voltage rises), evaluated on a clock grid;
2. per grid clock, over the batch size b: the batch time by least squares on a line, T(b) = alpha b + beta, the
   energy per image by a power function, E(b) = p b^k + q, evaluated at every batch size 1..MAX_BATCH.

The clock of a point is the SM clock NVML read while it ran (a locked clock the power limit caps runs lower).
The result is a table per model: T[f][b] (ms) and E[f][b] (J per image), with each curve's leave-one-out error
on the samples, and `clocked` carries a latency model to a clock by the ratio T(b, f) / T(b, f_max).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonctl.errors import TritonctlError
from tritonctl.files import read_json, read_text, write_text_atomic
from tritonctl.latency.model import MAX_BATCH, LatencyModel, scaled

FORMAT = "tritonctl-energy-model/1"
COLUMNS = ("model", "batch", "sm_clock_read_mhz", "batch_ms", "joules_per_image")
NUMBERS = {"batch": int, "sm_clock_read_mhz": float, "batch_ms": float, "joules_per_image": float}  # in Sample's order
CLOCK_STEP_MHZ = 15  # the grid the plan chooses clocks on (H100 and A100 clocks step by 15 MHz)
MAX_SWEEP_BYTES = 64 << 20  # a sweep's CSV: a row per model, batch and clock measured


@dataclass(frozen=True)
class Sample:
    model: str
    batch: int
    clock_mhz: float
    batch_ms: float
    joules_per_image: float


def read_samples(path: Path) -> list[Sample]:
    """The rows of an energy sweep's CSV; TritonctlError naming the file, row and column of a bad one."""
    reader = csv.DictReader(io.StringIO(read_text(path, limit=MAX_SWEEP_BYTES), newline=""))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise TritonctlError(f"no column {', '.join(missing)} (an energy sweep's CSV)", file=path)
    samples = []
    for i, row in enumerate(reader, start=2):
        values = {column: _number(row[column], kind, path, i, column) for column, kind in NUMBERS.items()}
        bad = [column for column, value in values.items() if not value > 0]
        if bad or not 1 <= values["batch"] <= MAX_BATCH:
            raise TritonctlError(f"row {i}: {', '.join(bad) or 'batch'} out of range", file=path)
        samples.append(Sample(row["model"], *values.values()))
    if not samples:
        raise TritonctlError("no rows", file=path)
    return samples


def _number(text: str | None, kind: type, path: Path, row: int, column: str):
    try:
        return kind(text)
    except (TypeError, ValueError):
        what = "a whole number" if kind is int else "a number"
        raise TritonctlError(f"row {row}: column {column} is not {what} (got {text!r})", file=path) from None


# The nonlinear parameter of each curve (the Fourier frequency, the power's exponent) is searched on a grid, the
# others solved by least squares at each: separable least squares, deterministic and fast.
FREQUENCIES = 60  # Fourier frequencies tried: 1/8 to 3/4 of a period over the clock range (a U, or one bump)
EXPONENTS = np.linspace(-2.0, 0.0, 81)[:-1]  # power exponents tried (energy per image falls with the batch)


def _separable(design, ys: np.ndarray) -> tuple[float, np.ndarray]:
    """Least squares of ys (points x curves) on each candidate design (points x terms); the candidate whose
    summed squared error is least, and its coefficients (terms x curves)."""
    best = None
    for candidate, x in design:
        coef, *_ = np.linalg.lstsq(x, ys, rcond=None)
        err = float(np.sum((x @ coef - ys) ** 2))
        if best is None or err < best[0]:
            best = (err, candidate, coef)
    return best[1], best[2]


def fit_time_over_clock(clocks: np.ndarray, times: np.ndarray):
    """T(f) = a / f + c by least squares (linear in 1/f)."""
    a, c = np.polyfit(1.0 / clocks, times, 1)
    return lambda f: a / np.asarray(f, dtype=float) + c


def fit_energy_over_clock(clocks: np.ndarray, energy: np.ndarray):
    """E(f) = a0 + a1 cos(w f) + b1 sin(w f); with fewer than five clocks, a parabola (as many parameters as
    points would interpolate the noise)."""
    if len(clocks) < 5:
        coef = np.polyfit(clocks, energy, min(2, len(clocks) - 1))
        return lambda f: np.polyval(coef, np.asarray(f, dtype=float))
    span = float(clocks.max() - clocks.min())

    def terms(f, w):
        f = np.asarray(f, dtype=float)
        return np.stack([np.ones_like(f), np.cos(w * f), np.sin(w * f)], axis=-1)

    ws = np.linspace(0.25 * np.pi / span, 1.5 * np.pi / span, FREQUENCIES)
    w, coef = _separable(((w, terms(clocks, w)) for w in ws), energy[:, None])
    return lambda f: terms(f, w) @ coef[:, 0]


def fit_energy_over_batch(batches: np.ndarray, energy: np.ndarray):
    """E(b) = p b^k + q for each column of `energy` (points x curves): energy per image falls with the batch and
    levels off. Returns a function of b giving (len(b) x curves)."""
    terms = lambda b, k: np.stack([np.power(np.asarray(b, dtype=float), k), np.ones(len(b))], axis=-1)  # noqa: E731
    ks, coefs = [], []
    for column in energy.T:  # each clock picks its own exponent
        k, coef = _separable(((k, terms(batches, k)) for k in EXPONENTS), column[:, None])
        ks.append(k)
        coefs.append(coef[:, 0])
    return lambda b: np.stack([terms(b, k) @ c for k, c in zip(ks, coefs, strict=True)], axis=-1)


@dataclass
class ModelEnergy:
    """One model's completed tables: t_ms[i][b-1] and j_per_image[i][b-1] at clocks[i]."""

    t_ms: list[list[float]]
    j_per_image: list[list[float]]


@dataclass
class EnergyModel:
    clocks: list[int]  # MHz, ascending
    models: dict[str, ModelEnergy]  # by torchvision source (the name the sweep measured)
    errors: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> leave-one-clock-out errors
    meta: dict = field(default_factory=dict)

    def index(self, clock_mhz: int) -> int:
        if clock_mhz not in self.clocks:
            raise TritonctlError(
                f"clock {clock_mhz} MHz is not on the energy model's grid ({self.clocks[0]}-{self.clocks[-1]} MHz)"
            )
        return self.clocks.index(clock_mhz)

    def time_ms(self, model: str, batch: int, clock_mhz: int) -> float:
        return self.models[model].t_ms[self.index(clock_mhz)][batch - 1]

    def joules_per_image(self, model: str, batch: int, clock_mhz: int) -> float:
        return self.models[model].j_per_image[self.index(clock_mhz)][batch - 1]

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "clocks_mhz": self.clocks,
            "meta": self.meta,
            "errors": self.errors,
            "models": {n: {"t_ms": m.t_ms, "j_per_image": m.j_per_image} for n, m in self.models.items()},
        }


def _complete(samples: list[Sample], clocks: list[int]) -> ModelEnergy:
    """EAIS Algorithm 1 for one model: curves over the clock per sampled batch, then over the batch per clock."""
    batches = sorted({s.batch for s in samples})
    grid = np.array(clocks, dtype=float)
    t_at = np.zeros((len(batches), len(grid)))
    e_at = np.zeros((len(batches), len(grid)))
    for i, b in enumerate(batches):
        rows = sorted((s for s in samples if s.batch == b), key=lambda s: s.clock_mhz)
        f = np.array([s.clock_mhz for s in rows])
        t_at[i] = fit_time_over_clock(f, np.array([s.batch_ms for s in rows]))(grid)
        e_at[i] = fit_energy_over_clock(f, np.array([s.joules_per_image for s in rows]))(grid)
    every = np.arange(1, MAX_BATCH + 1)
    bs = np.array(batches, dtype=float)
    t_ms, j = [], []
    lines = np.polyfit(bs, t_at, 1)  # a line over the batch per clock: (alpha, beta) x clocks
    energies = fit_energy_over_batch(bs, e_at)(every)  # batch sizes x clocks
    for k in range(len(grid)):
        alpha, beta = lines[:, k]
        t_ms.append([round(float(max(alpha * b + beta, 1e-3)), 5) for b in every])
        j.append([round(float(max(x, 1e-6)), 7) for x in energies[:, k]])
    return ModelEnergy(t_ms, j)


def _held_out(samples: list[Sample], clocks_measured: list[float]) -> dict[str, float]:
    """Leave each inner measured clock out, complete from the rest, and compare at its samples (|%|)."""
    t_err, e_err = [], []
    for left in clocks_measured[1:-1]:
        kept = [s for s in samples if s.clock_mhz != left]
        grid = sorted({round(left)} | {round(c) for c in clocks_measured if c != left})
        table = _complete(kept, grid)
        i = grid.index(round(left))
        for s in samples:
            if s.clock_mhz == left:
                t_err.append(abs(table.t_ms[i][s.batch - 1] / s.batch_ms - 1))
                e_err.append(abs(table.j_per_image[i][s.batch - 1] / s.joules_per_image - 1))
    if not t_err:
        return {}
    pct = lambda xs, q: round(100 * float(np.percentile(xs, q)), 1)  # noqa: E731
    return {
        "time_median_pct": pct(t_err, 50),
        "time_p95_pct": pct(t_err, 95),
        "energy_median_pct": pct(e_err, 50),
        "energy_p95_pct": pct(e_err, 95),
    }


def fit(samples: list[Sample], meta: dict | None = None) -> EnergyModel:
    """The energy model of a sweep: every model with at least two batch sizes at two clocks each."""
    by_model: dict[str, list[Sample]] = {}
    for s in samples:
        by_model.setdefault(s.model, []).append(s)
    low = max(min(s.clock_mhz for s in ss) for ss in by_model.values())
    high = min(max(s.clock_mhz for s in ss) for ss in by_model.values())
    clocks = list(range(int(math.ceil(low / CLOCK_STEP_MHZ)) * CLOCK_STEP_MHZ, int(high) + 1, CLOCK_STEP_MHZ))
    if len(clocks) < 2:
        raise TritonctlError(
            f"the sweep's clocks span {low:g}-{high:g} MHz: at least two clocks {CLOCK_STEP_MHZ} MHz apart are needed"
        )
    models, errors = {}, {}
    for name, ss in sorted(by_model.items()):
        per_batch = {b: {s.clock_mhz for s in ss if s.batch == b} for b in {s.batch for s in ss}}
        if len(per_batch) < 2 or min(len(c) for c in per_batch.values()) < 2:
            raise TritonctlError(f"{name}: the sweep needs at least two batch sizes, each at two clocks or more")
        models[name] = _complete(ss, clocks)
        errors[name] = _held_out(ss, sorted({s.clock_mhz for s in ss}))
    return EnergyModel(clocks, models, errors, meta or {})


def save(model: EnergyModel, path: Path) -> None:
    """The model as JSON, each table row (32 batch sizes at one clock) on one line; written through a temporary
    file, so a crash never leaves half a file."""
    text = json.dumps(model.to_json(), indent=1)
    text = re.sub(
        r"\[\s+([-+\d.e,\s]+?)\s+\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text
    )
    write_text_atomic(path, text + "\n")


def load(path: str | Path) -> EnergyModel:
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TritonctlError(f"not an energy model (format {FORMAT}; `tritonctl fit-energy` writes one)", file=path)
    try:
        models = {n: ModelEnergy(m["t_ms"], m["j_per_image"]) for n, m in data["models"].items()}
        clocks = [int(c) for c in data["clocks_mhz"]]
        for n, m in models.items():
            if len(m.t_ms) != len(clocks) or any(len(row) != MAX_BATCH for row in m.t_ms + m.j_per_image):
                raise ValueError(f"{n}: tables do not match {len(clocks)} clocks x {MAX_BATCH} batch sizes")
    except (KeyError, TypeError, ValueError) as exc:
        raise TritonctlError(f"corrupt energy model ({exc})", file=path) from None
    return EnergyModel(clocks, models, data.get("errors", {}), data.get("meta", {}))


def clocked(lm: LatencyModel, energy: EnergyModel, clock_mhz: int, sources: dict[str, str]) -> LatencyModel:
    """`lm` (profiled at the GPU's own clock, the grid's top) with each model's batch times stretched by
    T(b, clock) / T(b, top) from the energy model, fitted as k * b^gamma over the batch sizes. `sources`: the
    latency model's model name -> its name in the energy model."""
    top = energy.clocks[-1]
    factors = {}
    every = np.arange(1, MAX_BATCH + 1)
    for name in lm.models:
        if name not in sources:
            continue
        src = sources[name]
        ratio = np.array([energy.time_ms(src, int(b), clock_mhz) / energy.time_ms(src, int(b), top) for b in every])
        gamma, log_k = np.polyfit(np.log2(every), np.log(ratio), 1)
        factors[name] = (float(math.exp(log_k)), float(gamma), 0.0)
    request_cpu = {n: p.request_cpu_ms for n, p in lm.models.items()}
    return scaled(lm, factors, lm.device.fingerprint, {"clock_mhz": clock_mhz}, request_cpu)


def plot(model: EnergyModel, samples: list[Sample], out: Path) -> None:
    """Per model: energy per image over the clock at each sampled batch size (points: measured; lines: the
    completed table), and batch time over the batch size at the lowest and highest clocks."""
    from matplotlib.figure import Figure

    names = sorted(model.models)
    fig = Figure(figsize=(10, 3.2 * len(names)))
    axes = fig.subplots(len(names), 2, squeeze=False)
    grid = np.array(model.clocks)
    for row, name in zip(axes, names, strict=True):
        ss = [s for s in samples if s.model == name]
        table = model.models[name]
        for b in sorted({s.batch for s in ss}):
            pts = sorted((s.clock_mhz, 1000 * s.joules_per_image) for s in ss if s.batch == b)
            line = row[0].plot(grid, [1000 * table.j_per_image[i][b - 1] for i in range(len(grid))], label=f"batch {b}")
            row[0].scatter(*zip(*pts, strict=True), s=12, color=line[0].get_color())
        row[0].set(title=f"{name}: energy per image", xlabel="SM clock (MHz)", ylabel="mJ / image")
        row[0].legend(fontsize=7)
        for clock in (model.clocks[0], model.clocks[-1]):
            i = model.clocks.index(clock)
            row[1].plot(range(1, MAX_BATCH + 1), table.t_ms[i], label=f"{clock} MHz (fit)")
            near = [s for s in ss if abs(s.clock_mhz - clock) <= CLOCK_STEP_MHZ]
            if near:
                row[1].scatter([s.batch for s in near], [s.batch_ms for s in near], s=12)
        row[1].set(title=f"{name}: batch time", xlabel="batch size", ylabel="ms")
        row[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)

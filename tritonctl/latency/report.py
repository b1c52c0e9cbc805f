"""`tritonctl report`: judge a fitted latency model on held-out measurements, with plots.

Held-out rows were measured in the same profile but never used by `fit`. Four predictors
are compared on them: the InSS-style model, Gpulet's pairwise model (co-located rows), a
plain linear regression per model on the same inputs (batch, effective share, co-runner
cache pressure, number of co-located models), and an Abacus-style MLP (mlp.py; the file's
own where it has one), all fitted on the same training rows. A learning curve refits the
InSS-style, Gpulet and MLP predictors on part of the co-located training configurations,
to show what each needs profiled to reach its accuracy. Held-out configurations the profile
measured again at its end (split `repeat`) say how far the machine repeats itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from sklearn.linear_model import LinearRegression

from tritonctl.errors import TritonctlError
from tritonctl.latency.dataset import Dataset, Measurement
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.mlp import ABACUS_MEAN_ERROR, MIN_COLOC_ROWS, MlpPredictor, fit_mlp
from tritonctl.latency.model import LatencyModel


@dataclass(frozen=True)
class Evaluated:
    row: Measurement
    inss: float
    gpulet: float
    linear: float
    mlp: float  # nan without an MLP (too few co-located training rows)

    def error(self, which: str) -> float:
        return abs(getattr(self, which) - self.row.p50_ms) / self.row.p50_ms


def _linear_features(model: LatencyModel, r: Measurement) -> list[float]:
    corunners = r.corunner_list()
    pressure = sum(model.cache_pressure(m, s) for m, s, _ in corunners)
    return [r.batch, model.eff(r.share, r.threads), pressure, len(corunners)]


def evaluate(model: LatencyModel, dataset: Dataset, mlp: MlpPredictor | None) -> list[Evaluated]:
    """Every held-out row with each predictor's latency (`model` predicting by the InSS formula)."""
    linear = {}
    for name in model.models:
        rows = [r for r in dataset.rows if r.model == name and r.split == "train"]
        linear[name] = LinearRegression().fit([_linear_features(model, r) for r in rows], [r.p50_ms for r in rows])
    out = []
    for r in dataset.rows:
        if r.split != "heldout" or r.model not in model.models:
            continue
        corunners = tuple(r.corunner_list())
        by_mlp = math.nan
        if mlp is not None:
            by_mlp = float(mlp.predict_ms(np.array(mlp.features(model.eff, r.model, r.batch, r.share, corunners)))[0])
        out.append(
            Evaluated(
                row=r,
                inss=model.t_inf(r.model, r.batch, r.share, corunners),
                gpulet=model.t_inf_gpulet(r.model, r.batch, r.share, corunners),
                linear=float(linear[r.model].predict([_linear_features(model, r)])[0]),
                mlp=by_mlp,
            )
        )
    return out


def _mlp_for(model: LatencyModel, dataset: Dataset) -> tuple[MlpPredictor | None, str]:
    """The file's MLP, else one fitted on the training rows; None (and why) where there are too few."""
    if model.mlp is not None:
        return model.mlp, "the model file's"
    try:
        return fit_mlp(dataset, model.eff), "fitted here on the training rows"
    except TritonctlError as exc:
        return None, exc.message


@dataclass(frozen=True)
class CurvePoint:
    configs: int  # co-located training configurations used
    rows: int  # co-located training rows they hold
    mean: dict[str, float]  # predictor -> mean held-out co-located error


def learning_curve(
    dataset: Dataset,
    whole: tuple[LatencyModel, MlpPredictor | None],
    parts=(0.25, 0.5, 0.75),
    seed: int = 0,
) -> list[CurvePoint]:
    """Each predictor refitted on `parts` of the co-located training configurations (every solo row kept), then
    `whole` (the InSS-style model and the MLP of all of them, already fitted), and each one's mean error on the
    held-out co-located rows."""
    configs = sorted({r.config_id for r in dataset.rows if r.kind == "coloc" and r.split == "train"})
    order = np.random.default_rng(seed).permutation(len(configs))
    points = []
    for part in [*parts, 1.0]:
        chosen = {configs[i] for i in order[: max(1, round(part * len(configs)))]}
        rows = [r for r in dataset.rows if r.kind == "solo" or r.split == "heldout" or r.config_id in chosen]
        subset = Dataset(dataset.folder, dataset.metadata, dataset.models, rows, dataset.memory, dataset.wake)
        if part == 1.0:
            model, mlp = whole
        else:
            model = fit_latency_model(subset, log=lambda _: None)
            try:
                mlp = fit_mlp(subset, model.eff)
            except TritonctlError:
                mlp = None
        coloc = [e for e in evaluate(model, subset, mlp) if e.row.kind == "coloc"]
        mean = {which: float(np.mean([e.error(which) for e in coloc])) for which in ("inss", "gpulet", "mlp")}
        points.append(CurvePoint(len(chosen), sum(r.kind == "coloc" and r.split == "train" for r in rows), mean))
    return points


def rows_for(points: list[CurvePoint], which: str, target: float) -> float | None:
    """Co-located training rows at which `which`'s mean error would reach `target`, by a power law through the
    curve (error = a rows^-b); None where the curve does not fall."""
    xs = [(p.rows, p.mean[which]) for p in points if p.rows and math.isfinite(p.mean[which]) and p.mean[which] > 0]
    if len(xs) < 2:
        return None
    slope, intercept = np.polyfit(np.log([x for x, _ in xs]), np.log([e for _, e in xs]), 1)
    if slope >= 0:
        return None
    return float(math.exp((math.log(target) - intercept) / slope))


def _summary(errors: list[float]) -> str:
    if not errors:
        return "n/a"
    e = 100 * np.array(errors)
    return f"median {np.median(e):.1f}%, p95 {np.percentile(e, 95):.1f}%, max {e.max():.1f}% (n={len(e)})"


def repeat_gaps(dataset: Dataset) -> list[float]:
    """How far each configuration measured again at the end of the profile (split `repeat`) lies from its first
    measurement, |again - first| / first of the median latency: the machine's own spread over the profile."""
    first = {(r.model, r.share, r.batch): r.p50_ms for r in dataset.rows if r.kind == "solo" and r.split == "heldout"}
    return [
        abs(r.p50_ms - first[key]) / first[key]
        for r in dataset.rows
        if r.split == "repeat" and (key := (r.model, r.share, r.batch)) in first
    ]


def prediction_cost_us(model: LatencyModel, queries: int = 100_000) -> float:
    """Mean wall time of one t_inf query with two co-runners."""
    names = list(model.models)
    other = tuple((n, 25, 4) for n in names[1:3])
    started = time.perf_counter()
    for i in range(queries):
        model.t_inf(names[0], 1 + i % 32, 10 + i % 90, other)
    return (time.perf_counter() - started) / queries * 1e6


def proxy_correlation(model: LatencyModel, dataset: Dataset) -> float:
    """Pearson r between co-runners' summed cache pressure and the measured slowdown over solo."""
    xs, ys = [], []
    for r in dataset.rows:
        if r.kind != "coloc" or r.model not in model.models:
            continue
        solo = model.t_inf(r.model, r.batch, r.share)
        xs.append(sum(model.cache_pressure(m, s) for m, s, _ in r.corunner_list()))
        ys.append(r.p50_ms / solo - 1)
    return float(np.corrcoef(xs, ys)[0, 1]) if len(xs) > 2 else math.nan


def write_report(model: LatencyModel, dataset: Dataset, out: Path, curve: bool = True) -> dict:
    """Write report.md and its plots into `out` (with the learning curve unless not `curve`); returns the headline
    figures."""
    mlp, mlp_source = _mlp_for(model, dataset)
    model = model.without_mlp()
    results = evaluate(model, dataset, mlp)
    if not results:
        raise TritonctlError(
            "the profile has no held-out measurements to judge the model on", file=dataset.folder / "measurements.csv"
        )
    out.mkdir(parents=True, exist_ok=True)
    solo = [e for e in results if e.row.kind == "solo"]
    coloc = [e for e in results if e.row.kind == "coloc"]
    figures = {
        "solo_inss": _summary([e.error("inss") for e in solo]),
        "solo_linear": _summary([e.error("linear") for e in solo]),
        "coloc_inss": _summary([e.error("inss") for e in coloc]),
        "coloc_gpulet": _summary([e.error("gpulet") for e in coloc]),
        "coloc_linear": _summary([e.error("linear") for e in coloc]),
        "solo_mlp": _summary([e.error("mlp") for e in solo]) if mlp else "n/a",
        "coloc_mlp": _summary([e.error("mlp") for e in coloc]) if mlp else "n/a",
        "coloc_mlp_mean": float(np.mean([e.error("mlp") for e in coloc])) if mlp and coloc else math.nan,
        "repeat": _summary(repeat_gaps(dataset)),
        "proxy_r": proxy_correlation(model, dataset),
        "cost_us": prediction_cost_us(model),
    }
    _plot_scatter(results, out / "predicted_vs_observed.png")
    _plot_errors(results, out / "errors.png")
    _plot_surfaces(model, dataset, out / "surfaces.png")
    _plot_inss_vs_gpulet(coloc, out / "inss_vs_gpulet.png")
    meta = dataset.metadata
    lines = [
        f"# Latency model report: {meta.get('cluster')}",
        "",
        f"Profile `{dataset.folder}` measured on {meta['device'].get('model')} "
        f"({meta['device'].get('logical_cpus')} logical CPUs, device id {meta['device'].get('id')}), "
        f"{meta.get('created')}, shares by {meta.get('share_mechanism')}.",
        "Errors are |predicted - observed| / observed of the median client latency of a batch, on held-out "
        "configurations (measured, never fitted).",
        "",
        "| held-out set | InSS-style model | Gpulet pairwise | plain linear regression | MLP (Abacus-style) |",
        "|---|---|---|---|---|",
        f"| solo | {figures['solo_inss']} | (same as InSS when alone) | {figures['solo_linear']} | "
        f"{figures['solo_mlp']} |",
        f"| co-located | {figures['coloc_inss']} | {figures['coloc_gpulet']} | {figures['coloc_linear']} | "
        f"{figures['coloc_mlp']} |",
        "",
        f"Measured again at the end of the profile, held-out configurations moved by {figures['repeat']} of their "
        "first measurement: how far this machine repeats itself, and about as close as a predictor judged against "
        "one measurement can come."
        if figures["repeat"] != "n/a"
        else "This profile measured no configuration twice: it does not say how far the machine repeats itself.",
        "",
        f"MLP: {mlp_source}."
        + (
            f" Its mean error on the co-located held-out rows is {100 * figures['coloc_mlp_mean']:.1f}% "
            f"(Abacus reports {100 * ABACUS_MEAN_ERROR:.1f}%)."
            if mlp and coloc
            else ""
        ),
        "",
        "Per model (InSS-style model, all held-out rows):",
        "",
    ]
    for name in model.models:
        rows = [e.error("inss") for e in results if e.row.model == name]
        lines.append(f"- {name}: {_summary(rows)}")
    lines += ["", "Per co-location size (InSS-style model):", ""]
    for n in sorted({e.row.n_colocated for e in results}):
        lines.append(
            f"- {n} model(s) on the device: {_summary([e.error('inss') for e in results if e.row.n_colocated == n])}"
        )
    if curve:
        lines += _curve_lines(learning_curve(dataset, (model, mlp)), out / "learning_curve.png")
    lines += [
        "",
        f"Cache-pressure proxy check: Pearson r between the co-runners' summed proxy and the measured slowdown "
        f"over solo, all co-located rows: {figures['proxy_r']:.2f}.",
        f"Prediction cost: {figures['cost_us']:.1f} us per (model, batch, share, two co-runners) query.",
        "",
        "![predicted vs observed](predicted_vs_observed.png)",
        "![errors](errors.png)",
        "![surfaces](surfaces.png)",
        "![InSS vs Gpulet](inss_vs_gpulet.png)",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    return figures


def _curve_lines(points: list[CurvePoint], path: Path) -> list[str]:
    """The learning curve as a table, a plot and what the MLP would need to reach Abacus' error."""
    names = {"inss": "InSS-style", "gpulet": "Gpulet pairwise", "mlp": "MLP"}
    lines = [
        "",
        "Learning curve: each predictor refitted on part of the co-located training configurations (every solo "
        "row kept); mean error on the co-located held-out rows:",
        "",
        "| co-located configurations | rows | " + " | ".join(names.values()) + " |",
        "|---|---|---|---|---|",
    ]
    for p in points:
        cells = [f"{100 * p.mean[k]:.1f}%" if math.isfinite(p.mean[k]) else "n/a" for k in names]
        lines.append(f"| {p.configs} | {p.rows} | " + " | ".join(cells) + " |")
    last = points[-1].mean["mlp"] if points else math.nan
    if not math.isfinite(last):
        lines.append(f"\nThe MLP was not fitted: fewer than {MIN_COLOC_ROWS} co-located training rows.")
    elif last <= ABACUS_MEAN_ERROR:
        lines.append(f"\nThe MLP reaches Abacus' {100 * ABACUS_MEAN_ERROR:.1f}% mean error on this profile.")
    else:
        needed = rows_for(points, "mlp", ABACUS_MEAN_ERROR)
        lines.append(
            f"\nThe MLP does not reach Abacus' {100 * ABACUS_MEAN_ERROR:.1f}% mean error here; "
            + (
                f"by a power law through the curve it would need about {needed:,.0f} co-located training rows."
                if needed
                else "its curve does not fall, so more rows of this kind would not get it there."
            )
        )
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for key, label in names.items():
        ys = [100 * p.mean[key] for p in points]
        ax.plot([p.rows for p in points], ys, marker="o", label=label)
    ax.set(xlabel="co-located training rows", ylabel="mean abs. error (%)", title="Held-out co-located error")
    ax.axhline(100 * ABACUS_MEAN_ERROR, color="grey", linestyle=":", label="Abacus' reported MLP error")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    lines.append(f"\n![learning curve]({path.name})")
    return lines


def _plot_scatter(results: list[Evaluated], path: Path) -> None:
    fig = Figure(figsize=(11, 5))
    axes = fig.subplots(1, 2, sharex=True, sharey=True)
    for ax, which, title in ((axes[0], "inss", "InSS-style model"), (axes[1], "linear", "plain linear regression")):
        for kind, marker in (("solo", "o"), ("coloc", "^")):
            rows = [e for e in results if e.row.kind == kind]
            ax.scatter(
                [e.row.p50_ms for e in rows],
                [getattr(e, which) for e in rows],
                marker=marker,
                s=18,
                alpha=0.7,
                label=kind,
            )
        lim = [min(e.row.p50_ms for e in results) * 0.8, max(e.row.p50_ms for e in results) * 1.25]
        ax.plot(lim, lim, "k--", lw=1)
        ax.set(xscale="log", yscale="log", xlabel="observed p50 latency (ms)", title=title)
        ax.legend()
    axes[0].set_ylabel("predicted (ms)")
    fig.suptitle("Held-out configurations")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_errors(results: list[Evaluated], path: Path) -> None:
    fig = Figure(figsize=(11, 4.5))
    axes = fig.subplots(1, 2)
    models = sorted({e.row.model for e in results})
    axes[0].boxplot([[100 * e.error("inss") for e in results if e.row.model == m] for m in models], tick_labels=models)
    axes[0].set(ylabel="abs. error (%)", title="by model (InSS-style)")
    axes[0].tick_params(axis="x", labelrotation=25)  # torchvision names are long
    sizes = sorted({e.row.n_colocated for e in results})
    axes[1].boxplot(
        [[100 * e.error("inss") for e in results if e.row.n_colocated == n] for n in sizes],
        tick_labels=[str(n) for n in sizes],
    )
    axes[1].set(xlabel="models on the device", title="by co-location size (InSS-style)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_surfaces(model: LatencyModel, dataset: Dataset, path: Path) -> None:
    names = list(model.models)
    fig = Figure(figsize=(4.6 * len(names), 4))
    axes = fig.subplots(1, len(names), squeeze=False)
    units = model.device.units
    batches = np.arange(1, 33)
    shares = np.arange(1, units + 1)
    for ax, name in zip(axes[0], names, strict=True):
        grid = np.array([[model.t_inf(name, int(b), int(s)) for s in shares] for b in batches])
        mesh = ax.pcolormesh(shares, batches, np.log10(grid), shading="auto", cmap="viridis")
        fig.colorbar(mesh, ax=ax, label="log10 latency (ms)")
        rows = [r for r in dataset.rows if r.model == name and r.kind == "solo"]
        for split, color in (("train", "white"), ("heldout", "red")):
            pts = [r for r in rows if r.split == split]
            ax.scatter([r.share for r in pts], [r.batch for r in pts], c=color, s=12, edgecolors="k", label=split)
        ax.set(yscale="log", xlabel="share (device units)", ylabel="batch", title=name)
        ax.legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_inss_vs_gpulet(coloc: list[Evaluated], path: Path) -> None:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    data = [[100 * e.error(w) for e in coloc] for w in ("inss", "gpulet", "linear")]
    if coloc:
        ax.boxplot(data, tick_labels=["InSS-style", "Gpulet pairwise", "linear"])
    ax.set(ylabel="abs. error (%)", title="Co-located held-out configurations")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

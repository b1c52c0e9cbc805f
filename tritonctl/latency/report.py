"""`tritonctl report`: judge a fitted latency model on held-out measurements, with plots.

Held-out rows were measured in the same profile but never used by `fit`. Three predictors
are compared on them: the InSS-style model, Gpulet's pairwise model (co-located rows), and
a plain linear regression per model on the same inputs (batch, effective share, co-runner
cache pressure, number of co-located models), fitted on the same training rows.
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
from tritonctl.latency.model import LatencyModel


@dataclass(frozen=True)
class Evaluated:
    row: Measurement
    inss: float
    gpulet: float
    linear: float

    def error(self, which: str) -> float:
        return abs(getattr(self, which) - self.row.p50_ms) / self.row.p50_ms


def _linear_features(model: LatencyModel, r: Measurement) -> list[float]:
    corunners = r.corunner_list()
    pressure = sum(model.cache_pressure(m, s) for m, s, _ in corunners)
    return [r.batch, model.eff(r.share, r.threads), pressure, len(corunners)]


def evaluate(model: LatencyModel, dataset: Dataset) -> list[Evaluated]:
    linear = {}
    for name in model.models:
        rows = [r for r in dataset.rows if r.model == name and r.split == "train"]
        linear[name] = LinearRegression().fit([_linear_features(model, r) for r in rows], [r.p50_ms for r in rows])
    out = []
    for r in dataset.rows:
        if r.split != "heldout" or r.model not in model.models:
            continue
        corunners = tuple(r.corunner_list())
        out.append(
            Evaluated(
                row=r,
                inss=model.t_inf(r.model, r.batch, r.share, corunners),
                gpulet=model.t_inf_gpulet(r.model, r.batch, r.share, corunners),
                linear=float(linear[r.model].predict([_linear_features(model, r)])[0]),
            )
        )
    return out


def _summary(errors: list[float]) -> str:
    if not errors:
        return "n/a"
    e = 100 * np.array(errors)
    return f"median {np.median(e):.1f}%, p95 {np.percentile(e, 95):.1f}%, max {e.max():.1f}% (n={len(e)})"


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


def write_report(model: LatencyModel, dataset: Dataset, out: Path) -> dict:
    """Write report.md and its plots into `out`; returns the headline figures."""
    results = evaluate(model, dataset)
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
        "| held-out set | InSS-style model | Gpulet pairwise | plain linear regression |",
        "|---|---|---|---|",
        f"| solo | {figures['solo_inss']} | (same as InSS when alone) | {figures['solo_linear']} |",
        f"| co-located | {figures['coloc_inss']} | {figures['coloc_gpulet']} | {figures['coloc_linear']} |",
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

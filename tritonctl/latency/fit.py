"""`tritonctl fit`: the latency model's parameters from the training rows of a profile.

Held-out rows are never used here; `report.py` judges the fit on them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
from scipy.optimize import nnls
from sklearn.model_selection import GridSearchCV, KFold

from tritonctl.errors import TritonctlError
from tritonctl.latency.dataset import Dataset, Measurement, MemoryPoint, ModelFeatures, WakePoint
from tritonctl.latency.lwr import LocallyWeightedRegression
from tritonctl.latency.model import DeviceParams, LatencyModel, ModelParams, effective_share, gpulet_factor

BANDWIDTHS = (0.1, 0.15, 0.2, 0.3, 0.5)
DEGREES = (1, 2)  # the local fit's, chosen with the bandwidth by cross-validation
MIN_SOLO_POINTS = 6


def _eff(row: Measurement, kind: str) -> float:
    return effective_share(kind, row.share_frac, row.cores, row.threads)


def _lstsq(A: np.ndarray, y: np.ndarray, ridge: float = 1e-9) -> np.ndarray:
    """Least squares with a whisper of ridge, so a rank-deficient design still has an answer."""
    gram = A.T @ A + ridge * np.eye(A.shape[1])
    return np.linalg.solve(gram, A.T @ y)


def fit_latency_model(
    dataset: Dataset,
    log: Callable[[str], None] = print,
    degrees: tuple[int, ...] = DEGREES,
    pressure_by_duty: bool = True,
    relative: bool = True,
) -> LatencyModel:
    """The latency model of `dataset`'s training rows. `degrees`: the local fits' degrees to choose among;
    `pressure_by_duty`: on a CPU, weigh the co-runners' pressure by each instance's duty (model.py); `relative`:
    fit the interference terms to relative errors, else to milliseconds (`_fit_interference`)."""
    kind = dataset.metadata["device"].get("kind", "cpu")
    train = [r for r in dataset.rows if r.split == "train"]
    solo = [r for r in train if r.kind == "solo"]
    coloc = [r for r in train if r.kind == "coloc"]
    features = dataset.models
    for name in features:
        n = sum(1 for r in solo if r.model == name)
        if n < MIN_SOLO_POINTS:
            raise TritonctlError(
                f"model {name!r} has {n} solo training points; the fit needs at least "
                f"{MIN_SOLO_POINTS} (profile longer: the profile resumes)",
                file=dataset.folder / "measurements.csv",
            )
    units = solo[0].units
    cores = solo[0].cores if kind == "cpu" else None  # a GPU share is an MPS fraction, not cores

    # Upload and feedback: what the client sees beyond Triton's compute time, against bytes moved.
    io_x = np.array([(features[r.model].input_bytes + features[r.model].output_bytes) * r.batch for r in solo])
    io_y = np.array([max(0.0, r.p50_ms - r.compute_ms) for r in solo])
    (c0, per_byte), _ = nnls(np.c_[np.ones_like(io_x), io_x], io_y)
    log(f"  upload+feedback: {c0:.2f} ms + bytes / {1 / per_byte / 1e3 if per_byte else math.inf:.0f} MB/s")

    limits = dataset.metadata.get("slower_than_ms", {})  # profiler/grid.py: nothing ran beyond these
    params = {
        name: _fit_model(
            feat,
            [r for r in solo if r.model == name],
            limits.get(name, math.inf),
            [m for m in dataset.memory if m.model == name],
            [w for w in dataset.wake if w.model == name],
            bool(dataset.wake),
            kind,
            c0,
            per_byte,
            degrees,
            log,
        )
        for name, feat in features.items()
    }
    for name in params:
        costs = [c for c in dataset.requests if c.model == name]
        if not costs:
            if kind == "cpu":  # on a GPU the host's CPU is not what the plan shares
                log(f"  {name}: no requests.csv row: the CPU its requests cost outside it is uncounted (profile again)")
            continue
        server, proxy = (float(np.median([getattr(c, k) for c in costs])) for k in ("server_cpu_ms", "proxy_cpu_ms"))
        params[name] = dataclasses.replace(params[name], request_cpu_ms=round(server + proxy, 4))
        log(f"  {name}: {server + proxy:.2f} ms of CPU a request outside it (Triton {server:.2f}, HAProxy {proxy:.2f})")
    device = DeviceParams(
        kind=kind,
        fingerprint=dataset.metadata["device"],
        units=units,
        cores=cores,
        io_c0_ms=float(c0),
        io_ms_per_byte=float(per_byte),
        sched_a=0.0,
        sched_b=0.0,
        contention=0.0,
        gpulet=[0.0, 0.0, 0.0, 0.0, 1.0],
        pressure_by_duty=pressure_by_duty and kind == "cpu",
    )
    model = LatencyModel(device, params, {"profile": str(dataset.folder), "cluster": dataset.metadata.get("cluster")})
    if not coloc:
        log("  no co-located training measurements: interference is not modelled")
        return model
    _fit_interference(model, coloc, log, relative)
    _fit_gpulet(model, coloc, log)
    return model


def _fit_model(
    feat: ModelFeatures,
    rows: list[Measurement],
    slower_than_ms: float,
    memory: list[MemoryPoint],
    wake: list[WakePoint],
    has_wake: bool,
    kind: str,
    c0: float,
    per_byte: float,
    degrees: tuple[int, ...],
    log: Callable[[str], None],
) -> ModelParams:
    """One model's solo parameters: LWR running time (with the points slower than `slower_than_ms` as floors),
    pressure on co-runners, memory by batch, wake-up (`has_wake`: the profile measured it for some model)."""
    X = np.array([(math.log2(r.batch), math.log(_eff(r, kind))) for r in rows])
    # Running time: the measured latency less the fitted upload and feedback, so t_io + t_run
    # reproduces the measurement and errors of the two parts do not add up.
    io = c0 + per_byte * (feat.input_bytes + feat.output_bytes) * np.array([r.batch for r in rows])
    p50 = np.array([r.p50_ms for r in rows])
    y = np.maximum(p50 - io, 0.05 * p50)
    search = GridSearchCV(
        LocallyWeightedRegression(),
        {"bandwidth": list(BANDWIDTHS), "degree": list(degrees)},
        cv=KFold(5, shuffle=True, random_state=0),
        scoring="neg_mean_absolute_percentage_error",
    )
    best = search.fit(X, y).best_params_
    bandwidth, degree = best["bandwidth"], best["degree"]
    # Pressure on co-runners, linear in the share (InSS fits L2 utilisation so); on CPU the
    # measured CPU utilisation of the instance stands in (see model.py).
    eff = np.array([_eff(r, kind) for r in rows])
    cache_a, cache_b = _lstsq(np.c_[eff, np.ones_like(eff)], np.array([r.cpu_util for r in rows]))
    if not memory:
        raise TritonctlError(f"no memory measurements for model {feat.model!r}", file="memory.csv")
    mem0, mem1 = _lstsq(np.c_[np.ones(len(memory)), [m.batch for m in memory]], np.array([m.rss_mb for m in memory]))
    # Spread of one batch's latency: log-normal, so ln(p95 / p50) = 1.645 sigma, linear in log2 batch.
    log2b = np.array([math.log2(r.batch) for r in rows])
    sigma = np.log(np.maximum(np.array([r.p95_ms for r in rows]) / p50, 1.0)) / 1.645
    spread0, spread1 = _lstsq(np.c_[np.ones_like(log2b), log2b], sigma)
    woken = wake_curve(wake)
    if wake and not woken:
        log(f"  {feat.model}: wake.csv has no back-to-back point (gap 0): no wake-up fitted")
    elif not wake and has_wake:
        log(f"  {feat.model}: no wake.csv row (the others have some): no wake-up fitted (profile again)")
    log(
        f"  {feat.model}: LWR bandwidth {bandwidth} degree {degree}, pressure {cache_a:.2f} x eff + {cache_b:.2f}, "
        f"memory {mem0:.0f} + {mem1:.1f} x batch MB, spread sigma {spread0:.3f} {spread1:+.3f} x log2 batch"
        + (f", wake-up +{woken[-1][1]:.1f} ms after {woken[-1][0]:g} ms idle" if woken else "")
    )
    return ModelParams(
        name=feat.model,
        onnx_sha256=feat.onnx_sha256,
        n_ops=feat.n_ops,
        io_bytes=feat.input_bytes + feat.output_bytes,
        lwr_bandwidth=bandwidth,
        lwr_degree=degree,
        lwr_X=X.round(6).tolist(),
        lwr_y=y.round(4).tolist(),
        lwr_floors=tuple(i for i, r in enumerate(rows) if r.p50_ms > slower_than_ms),
        cache_a=float(cache_a),
        cache_b=float(cache_b),
        alpha_cache=0.0,
        memory_mb0=float(mem0),
        memory_mb1=float(max(mem1, 0.0)),
        batch_range=(min(r.batch for r in rows), max(r.batch for r in rows)),
        share_range=(min(r.share for r in rows), max(r.share for r in rows)),
        spread=(round(float(spread0), 5), round(float(spread1), 5)),
        wake=woken,
    )


def wake_curve(wake: list[WakePoint]) -> tuple[tuple[float, float], ...]:
    """Per idle gap (ms), what a request after it takes beyond one sent back to back (gap 0); () without a
    back-to-back point."""
    busy = next((w.p50_ms for w in wake if w.gap_ms == 0), None)
    if busy is None:
        return ()
    return tuple(sorted((w.gap_ms, round(max(0.0, w.p50_ms - busy), 3)) for w in wake))


def _fit_interference(model: LatencyModel, rows: list[Measurement], log, relative: bool = True) -> None:
    """InSS: a_cache per model and the scheduling line (a_s, b_s) per operator, jointly. `relative`: minimising
    the squared relative error of the predicted latency (how held-out errors are judged, and how SLOs scale with
    models), where squared milliseconds let the slowest configurations of the largest model outweigh the rest."""
    names = list(model.models)
    A, y = [], []
    for r in rows:
        corunners = r.corunner_list()
        run = model.run_ms(r.model, r.batch, r.share)
        pressure = model.felt_pressure(r.share, tuple(corunners))
        n_ops = model.models[r.model].n_ops
        row = [run * pressure if name == r.model else 0.0 for name in names]
        row += [run * model.contention(r.share, tuple(corunners)), n_ops * r.n_colocated, n_ops]
        scale = r.p50_ms if relative else 1.0
        A.append([x / scale for x in row])
        y.append((r.p50_ms - model.io_ms(r.model, r.batch) - run) / scale)
    coef, _ = nnls(np.array(A), np.array(y))  # interference only slows down: coefficients >= 0
    for name, alpha in zip(names, coef[: len(names)], strict=True):
        model.models[name].alpha_cache = float(alpha)
    model.device.contention, model.device.sched_a, model.device.sched_b = (float(c) for c in coef[-3:])
    log(
        f"  interference: a_cache {', '.join(f'{n} {model.models[n].alpha_cache:.4f}' for n in names)}; "
        f"core contention {coef[-3]:.3f}; scheduling {1000 * coef[-2]:.2f} x N + {1000 * coef[-1]:.2f} us per operator"
    )


def _fit_gpulet(model: LatencyModel, rows: list[Measurement], log) -> None:
    """Gpulet: the pairwise interference factor, linear in both models' L2 and memory use."""
    pairs = [r for r in rows if r.n_colocated == 2]
    if not pairs:
        log("  no pairs measured: Gpulet's model is not fitted")
        return
    A, y = [], []
    for r in pairs:
        ((other, share_j, _),) = r.corunner_list()
        solo = model.io_ms(r.model, r.batch) + model.run_ms(r.model, r.batch, r.share)
        A.append(model.gpulet_features(r.model, r.share, other, share_j) + [1.0])
        y.append(r.p50_ms / solo)
    model.device.gpulet = [float(c) for c in _lstsq(np.array(A), np.array(y), ridge=1e-6)]
    fitted = [gpulet_factor(model.device.gpulet, a[:4]) for a in A]
    log(f"  Gpulet pairwise factor fitted on {len(pairs)} rows (mean factor {np.mean(fitted):.2f})")

"""`tritonctl calibrate`: carry a latency model to this device with a short measurement instead of a full profile.

A latency model speaks for the device it was profiled on. On a CPU, the same model runs 1.5-2x
slower on one 2-vCPU VM than on another. The shape of its latency surface (over batch and
share) and its interference terms carry over far better than its scale, so calibration
measures each model solo at a few points through real Triton, as the profiler does (three
rounds, each point's median), and multiplies its fitted running time by a factor per model
that follows batch and share, k * batch^gamma * (cores / all)^delta: another CPU is not
uniformly slower (one 2-vCPU VM ran the demo's models 2.2x as long as their profile with both
cores, 1.4-1.6x with one or less).

On a GPU the gap is of another kind: a GPU profile measured the model's CUDA graphs alone
(profiler/gpu.py), and serving adds the host's work on every batch (Triton copying the
requests into the Python backend's shared memory, the glue's copy to the GPU and back), time
that grows with the images a batch carries and not with the MPS share. So a GPU calibration
measures each model at two shares through real Triton, takes as a batch's time what Triton
counts as its compute plus a request's way in and out (a batch-1 request's latency less its
compute: a batch formed of single requests does not pay the way in once per image), and adds
c0 + c1 * batch to the running time, fitted per model.

On a CPU it also measures, as the profiler does, what each model's requests cost outside it and how much longer
a request takes after the instance sat idle (the wake-up the simulator adds): both are this CPU's, not carried.

Two further points per model are measured and never fitted: their error, before and after,
is what the calibration is worth, and it is recorded in the calibrated model's metadata and
printed.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tritonctl.deploy import mps, share
from tritonctl.deploy.gpu import gpu_count
from tritonctl.deploy.local import LocalRuntime
from tritonctl.deploy.runtime import StartError
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.latency.device import cpu_fingerprint, gpu_fingerprint
from tritonctl.latency.fit import wake_curve
from tritonctl.latency.model import LatencyModel, scaled
from tritonctl.planning.planner import devices_of
from tritonctl.spec import Cluster
from tritonctl.triton.binary import find_tritonserver

from .grid import Member
from .harness import Harness, Stats
from .run import COST_GAP_MS, COST_REQUESTS, WAKE_GAPS_MS, WAKE_REQUESTS, planned_for_profile

# (batch, share as a fraction of the usable units), fitted and held out. CPU: both thread regimes of a 2-core CPU.
# GPU: two MPS shares (an instance each, started at once), batches up to the largest a plan uses.
POINTS = {
    "cpu": (((1, 1.0), (8, 1.0), (2, 0.5)), ((4, 0.75), (3, 0.35))),
    "gpu": (((1, 0.25), (8, 0.25), (32, 0.25), (1, 0.5), (16, 0.5)), ((4, 0.25), (8, 0.5))),
}
# Rounds over every point; a point's latency is the median of its rounds. One round was not enough on a 2-vCPU
# VM with neighbours: the same point differed by 20-30% between runs. A GPU host's 16 cores serve one closed loop.
ROUNDS = {"cpu": 3, "gpu": 2}


@dataclass(frozen=True)
class Point:
    model: str
    batch: int
    share: int
    fitted: bool
    measured_ms: float
    before_ms: float  # the source model's prediction
    after_ms: float = 0.0  # the calibrated model's prediction
    spread: float = 0.0  # how far apart its rounds were: (slowest - fastest) / median

    @property
    def error_before(self) -> float:
        return self.before_ms / self.measured_ms - 1

    @property
    def error_after(self) -> float:
        return self.after_ms / self.measured_ms - 1


def median_abs(errors: list[float]) -> float:
    return statistics.median(abs(e) for e in errors)


def factors_of(lm: LatencyModel, points: list[Point]) -> dict[str, tuple[float, float, float]]:
    """Per model, (k, gamma, delta) of running time measured / predicted = k * batch^gamma * (cores / all)^delta,
    fitted in logs at the fitting points (running time: latency less the model's upload and feedback; cores:
    the share's, of all the device's). With one share among the points delta is 0; with one batch, gamma."""
    rows: dict[str, list[tuple[float, float, float]]] = {}
    full = lm.eff(lm.device.units)
    for p in points:
        if p.fitted:
            io = lm.io_ms(p.model, p.batch)
            ratio = max(p.measured_ms - io, 0.05 * p.measured_ms) / max(p.before_ms - io, 1e-6)
            rows.setdefault(p.model, []).append((math.log(p.batch), math.log(lm.eff(p.share) / full), math.log(ratio)))
    factors = {}
    for name, xyz in rows.items():
        batch, cores, y = np.array(xyz).T
        varies = [len(set(x.round(9))) > 1 for x in (batch, cores)]
        terms = [np.ones_like(y)] + [x for x, v in zip((batch, cores), varies, strict=True) if v]
        fitted = iter(np.linalg.lstsq(np.column_stack(terms), y, rcond=None)[0])
        log_k = float(next(fitted))
        gamma, delta = (float(next(fitted)) if v else 0.0 for v in varies)
        factors[name] = (math.exp(log_k), gamma, delta)
    return factors


def added_of(points: list[Point]) -> dict[str, tuple[float, float]]:
    """Per model, (c0, c1) of measured - predicted = c0 + c1 * batch, least squares over the fitting points (with one
    batch among them, c1 is 0)."""
    rows: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        if p.fitted:
            rows.setdefault(p.model, []).append((p.batch, p.measured_ms - p.before_ms))
    added = {}
    for name, pairs in rows.items():
        batch, gap = np.array(pairs).T
        if len(set(batch)) > 1:
            c1, c0 = np.polyfit(batch, gap, 1)
        else:
            c0, c1 = float(gap.mean()), 0.0
        added[name] = (round(float(c0), 4), round(float(c1), 4))
    return added


def round_spread(points: list[Point]) -> tuple[float, float]:
    """The median and the widest spread of the points' rounds: the machine's own noise, which a calibration's
    errors are not expected to go below."""
    return statistics.median(p.spread for p in points), max(p.spread for p in points)


def spread_of(values: list[float]) -> float:
    """How far apart `values` are: (largest - smallest) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def _round_ms(kind: str, stats: list[Stats], way_ms: float) -> list[float]:
    """What one batch took in each of a point's rounds: on a CPU the median latency; on a GPU Triton's compute plus
    the model's way in and out (where Triton counted no compute, the latency). A point takes their median."""
    if kind == "cpu":
        return [s.p50_ms for s in stats]
    return [s.compute_ms + way_ms if s.compute_ms > 0 else s.p50_ms for s in stats]


def _way_ms(stats: list[list[Stats]], plan: list[tuple[str, int, int, bool]], name: str) -> float:
    """A model's way in and out on a GPU: the median of latency less compute over its batch-1 rounds."""
    ways = [s.p50_ms - s.compute_ms for st, (m, b, _, _) in zip(stats, plan, strict=True) if m == name and b == 1
            for s in st if s.compute_ms > 0]  # fmt: skip
    return statistics.median(ways) if ways else 0.0


def calibrate(
    cluster: Cluster, lm: LatencyModel, source: Path, log: Callable[[str], None] = print
) -> tuple[LatencyModel, list[Point]]:
    """`lm` calibrated to this device for the cluster's models, and the points measured (with errors before/after)."""
    kind = cluster.kind
    if lm.device.kind != kind:
        raise TritonctlError(f"a {lm.device.kind} latency model cannot be carried to a {kind} cluster", file=source)
    device = devices_of(cluster)[0]
    if kind == "cpu" and share.mechanism() == "none":
        raise TritonctlError("calibrating needs enforceable shares, and no cgroup is writable here (run as root)")
    if kind == "gpu":
        mps.check_host(gpu_count(), device.index + 1, "calibrating a GPU cluster")
    artifacts = materialize(cluster, log=log)
    # the torchvision architectures the GPU glue builds with PyTorch
    sources = {m.name: None if m.is_onnx_file else m.source for m in cluster.spec.models}
    for name, artifact in artifacts.items():
        if name not in lm.models:
            raise TritonctlError(f"model {name!r} is not in the latency model: profile it", file=source)
        if lm.models[name].onnx_sha256 == artifact.sha256:
            continue
        if kind == "cpu" or sources[name] is None:
            message = f"model {name!r}: its ONNX file differs from the profiled one: profile it"
            raise TritonctlError(message, file=source)
        # Another PyTorch exports other bytes; the glue serves the architecture, which the profile measured.
        log(f"note: {name}: its ONNX export differs from the profiled one; served as torchvision {sources[name]}")
    fit_points, check_points = POINTS[kind]
    plan = [(name, batch, max(1, round(frac * device.units)), fitted)
            for name in artifacts
            for fitted, grid in ((True, fit_points), (False, check_points))
            for batch, frac in grid]  # fmt: skip
    fingerprint = cpu_fingerprint() if kind == "cpu" else gpu_fingerprint(device.index)
    started = time.monotonic()
    rounds_n = ROUNDS[kind]
    log(f"calibrating {source} on this {kind.upper()} ({fingerprint['model']}): {len(plan)} points, {rounds_n} rounds")
    with tempfile.TemporaryDirectory(prefix="tritonctl-calibrate-") as work:
        harness = Harness(
            LocalRuntime(find_tritonserver(cluster.spec.runtime.tritonserver), Path(work)),
            device,
            {name: (planned_for_profile(name, a, sources[name]), a.path) for name, a in artifacts.items()},
            Path(work),
            sorted({b for grid in POINTS[kind] for b, _ in grid}),
        )
        rounds: list[list[Stats]] = [[] for _ in plan]
        try:
            harness.start([(name, units) for name, _, units, _ in plan])
            for _ in range(rounds_n):  # every point once a round: a slow minute on a shared host hits all alike
                for measured, (name, batch, units, _) in zip(rounds, plan, strict=True):
                    (stats,) = harness.measure((Member(name, units, batch),))
                    measured.append(stats)
            if kind == "cpu":
                log(f"  CPU a request costs outside each model: {COST_REQUESTS} batch-1 requests through HAProxy")
                costs = {name: harness.request_cost(name, COST_REQUESTS, COST_GAP_MS).cpu_ms for name in artifacts}
                gaps = ", ".join(f"{gap:g}" for gap in WAKE_GAPS_MS)
                log(f"  wake-up of each model: {WAKE_REQUESTS} single requests after idle gaps of {gaps} ms")
                wakes = {name: wake_curve(harness.wake(name, WAKE_GAPS_MS, WAKE_REQUESTS)) for name in artifacts}
            else:  # the planner reserves CPU for requests on a CPU device only
                costs, wakes = {name: lm.models[name].request_cpu_ms for name in artifacts}, {}
        except StartError as exc:
            raise TritonctlError(f"calibration stopped: {exc}") from None
        finally:
            harness.close()
    ways = {name: _way_ms(rounds, plan, name) if kind == "gpu" else 0.0 for name in artifacts}
    points = []
    for measured, (name, batch, units, fitted) in zip(rounds, plan, strict=True):
        values = _round_ms(kind, measured, ways[name])
        value = statistics.median(values)
        points.append(Point(name, batch, units, fitted, value, lm.t_inf(name, batch, units), spread=spread_of(values)))
        latency, compute = (" / ".join(f"{getattr(s, key):.1f}" for s in measured) for key in ("p50_ms", "compute_ms"))
        log(f"  {name:18} batch {batch:2} share {units:3}: {value:7.1f} ms, latency {latency}, Triton's compute "
            f"{compute} (source model {points[-1].before_ms:6.1f} ms)")  # fmt: skip
    if kind == "cpu":
        factors, added = factors_of(lm, points), {}
        log("  " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in costs.items()))
        log("  wake-up after the longest gap: " + ", ".join(
            f"{name} +{wake[-1][1]:.1f} ms (source model +{lm.wake_ms(name, wake[-1][0]):.1f})"
            for name, wake in wakes.items() if wake))  # fmt: skip
    else:
        factors, added = {name: (1.0, 0.0, 0.0) for name in artifacts}, added_of(points)
        log("  way in and out: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in ways.items()))
    meta = {"calibrated": {"from": str(source), "from_device": lm.device.fingerprint.get("model"), "factors": factors}}
    if added:
        meta["calibrated"]["added_ms"] = added
    calibrated = scaled(lm, factors, fingerprint, meta, costs, added, wakes)
    points = [Point(**{**asdict(p), "after_ms": calibrated.t_inf(p.model, p.batch, p.share)}) for p in points]
    checks = [p for p in points if not p.fitted]
    calibrated.meta["calibrated"].update(
        seconds=round(time.monotonic() - started, 1),
        held_out_error_before=[round(p.error_before, 4) for p in checks],
        held_out_error_after=[round(p.error_after, 4) for p in checks],
        round_spread=[round(p.spread, 4) for p in points],
    )
    return calibrated, points

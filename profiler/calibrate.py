"""`tritonctl calibrate`: carry a latency model to this CPU with a short measurement instead of a full profile.

A latency model speaks for the CPU it was profiled on; the same model runs 1.5-2x slower on
one 2-vCPU VM than on another. The shape of its latency surface (over batch and share) and
its interference terms carry over far better than its scale, so calibration measures each
model solo at a few points through real Triton, as the profiler does (three rounds, each
point's median), and multiplies its fitted running time by a factor per model that follows
batch and share, k * batch^gamma * (cores / all)^delta: another CPU is not uniformly slower
(one 2-vCPU VM ran the demo's models 2.2x as long as their profile with both cores, 1.4-1.6x
with one or less). Two further points per model are measured and never fitted:
their error, before and after, is what the calibration is worth, and it is recorded in the
calibrated model's metadata and printed.
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

from tritonctl.deploy import share
from tritonctl.deploy.local import LocalRuntime
from tritonctl.deploy.runtime import StartError
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.latency.model import LatencyModel, scaled
from tritonctl.planning.planner import devices_of
from tritonctl.spec import Cluster
from tritonctl.triton.binary import find_tritonserver

from .grid import HELDOUT_BATCHES, TRAIN_BATCHES, Member
from .harness import Harness
from .run import COST_GAP_MS, COST_REQUESTS, planned_for_profile

# (batch, share as a fraction of the usable units): both thread regimes of a 2-core CPU.
FIT_POINTS = ((1, 1.0), (8, 1.0), (2, 0.5))
CHECK_POINTS = ((4, 0.75), (3, 0.35))
# Rounds over every point; a point's latency is the median of its rounds. One round was not enough on a 2-vCPU
# VM with neighbours: the same point differed by 20-30% between runs.
ROUNDS = 3


@dataclass(frozen=True)
class Point:
    model: str
    batch: int
    share: int
    fitted: bool
    measured_ms: float
    before_ms: float  # the source model's prediction
    after_ms: float = 0.0  # the calibrated model's prediction

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


def calibrate(
    cluster: Cluster, lm: LatencyModel, source: Path, log: Callable[[str], None] = print
) -> tuple[LatencyModel, list[Point]]:
    """`lm` calibrated to this CPU for the cluster's models, and the points measured (with errors before/after)."""
    if cluster.kind != "cpu" or lm.device.kind != "cpu":
        raise TritonctlError("calibration carries a CPU latency model to this CPU; profile a GPU on its host")
    if share.mechanism() == "none":
        raise TritonctlError("calibrating needs enforceable shares, and no cgroup is writable here (run as root)")
    artifacts = materialize(cluster, log=log)
    for name, artifact in artifacts.items():
        if name not in lm.models:
            raise TritonctlError(f"model {name!r} is not in the latency model: profile it", file=source)
        if lm.models[name].onnx_sha256 != artifact.sha256:
            raise TritonctlError(
                f"model {name!r}: its ONNX file differs from the profiled one: profile it", file=source
            )
    device = devices_of(cluster)[0]
    plan = [(name, batch, max(1, round(frac * device.units)), fitted)
            for name in artifacts
            for fitted, grid in ((True, FIT_POINTS), (False, CHECK_POINTS))
            for batch, frac in grid]  # fmt: skip
    started = time.monotonic()
    log(f"calibrating {source} on this CPU ({cpu_fingerprint()['model']}): {len(plan)} points, {ROUNDS} rounds")
    with tempfile.TemporaryDirectory(prefix="tritonctl-calibrate-") as work:
        harness = Harness(
            LocalRuntime(find_tritonserver(cluster.spec.runtime.tritonserver), Path(work)),
            device,
            {name: (planned_for_profile(name, a), a.path) for name, a in artifacts.items()},
            Path(work),
            sorted({b for b, _ in FIT_POINTS + CHECK_POINTS} & (set(TRAIN_BATCHES) | set(HELDOUT_BATCHES))),
        )
        rounds: list[list[float]] = [[] for _ in plan]
        try:
            for _ in range(ROUNDS):  # every point once a round: a slow minute on a shared host hits all alike
                for measured, (name, batch, units, _) in zip(rounds, plan, strict=True):
                    (stats,) = harness.measure((Member(name, units, batch),))
                    measured.append(stats.p50_ms)
            log(f"  CPU a request costs outside each model: {COST_REQUESTS} batch-1 requests through HAProxy")
            costs = {name: harness.request_cost(name, COST_REQUESTS, COST_GAP_MS) for name in artifacts}
        except StartError as exc:
            raise TritonctlError(f"calibration stopped: {exc}") from None
        finally:
            harness.close()
    points = []
    for measured, (name, batch, units, fitted) in zip(rounds, plan, strict=True):
        points.append(Point(name, batch, units, fitted, statistics.median(measured), lm.t_inf(name, batch, units)))
        log(f"  {name:18} batch {batch:2} share {units:3}: {points[-1].measured_ms:7.1f} ms, median of "
            f"{' / '.join(f'{m:.1f}' for m in measured)} (source model {points[-1].before_ms:6.1f} ms)")  # fmt: skip
    factors = factors_of(lm, points)
    meta = {"calibrated": {"from": str(source), "from_device": lm.device.fingerprint.get("model"), "factors": factors}}
    request_cpu_ms = {name: cost.cpu_ms for name, cost in costs.items()}
    log("  " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in request_cpu_ms.items()))
    calibrated = scaled(lm, factors, cpu_fingerprint(), meta, request_cpu_ms)
    points = [Point(**{**asdict(p), "after_ms": calibrated.t_inf(p.model, p.batch, p.share)}) for p in points]
    checks = [p for p in points if not p.fitted]
    calibrated.meta["calibrated"].update(
        seconds=round(time.monotonic() - started, 1),
        held_out_error_before=[round(p.error_before, 4) for p in checks],
        held_out_error_after=[round(p.error_after, 4) for p in checks],
    )
    return calibrated, points

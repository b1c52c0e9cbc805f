"""The fitted latency model: InSS section 4 on this device, saved as JSON, fast to query.

Execution latency of a batch of model i at share rho next to co-runners J (InSS 4.1):

    t_inf = t_io + t_run * (1 + a_cache_i * sum_j l_j + g * c_i) + [|J| > 0] n_ops_i * (a_s * N + b_s)

- t_io, upload and feedback: c0 + bytes(batch) / B, with B a bandwidth fitted on this
  device (on a CPU: Triton's gRPC and shared-memory path, the client latency beyond
  Triton's compute time).
- t_run, running time alone: locally weighted regression over (log2 batch, log eff), fitted
  to the measured latency less t_io, never below a floor: a training point the profile found
  slower than any plan can use bounds the running time of every configuration with no more
  share and a larger batch, which the profile did not measure (profiler/grid.py). `eff` is
  the share in cores, capped by the instance's thread count on a CPU (one thread cannot use
  more than one core); on a GPU the MPS fraction.
- l_j, a co-runner's cache pressure: linear in its share, l = a_u * eff + b_u (InSS fits L2
  utilisation so). No hardware counters are readable on the development machines (no PMU
  in the VM), so on CPU l is a documented proxy: the CPU utilisation the co-runner's
  instance sustains (cores busy, from /proc), the demand it puts on the shared cores and
  caches. `tritonctl report` checks that it explains the slowdown it should (correlation of
  sum_j l_j with the measured slowdown).
  On a CPU the term is weighed by the instance's own duty u = eff / threads (the part of the
  time its quota lets each thread run; see `contention`) where the model says so
  (`DeviceParams.pressure_by_duty`, set by `fit`): a thread a quota holds back for part of
  each period loses that part to waiting anyway, and what the co-runners take falls into it.
  What the weighing is worth on the committed profiles: bench/fit_forms.py.
- scheduling: n_ops_i operators (kernels on GPU) each delayed by a_s * N + b_s when N
  models share the device.
- c_i, CPU only, has no InSS counterpart: contention for cores when the instances' threads
  outnumber them (see `contention`); g is fitted with the other coefficients, 0 on a GPU.

`task_latency` (queueing.py) turns t_inf into task latency under Poisson arrivals, eq. 2.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import numpy as np
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config

from tritonctl.errors import TritonctlError
from tritonctl.files import LATENCY_MODEL_FORMAT, read_json, yaml_kind
from tritonctl.latency.mlp import MlpPredictor
from tritonctl.shares import threads_for_cores
from tritonctl.spec import MAX_BATCH  # BDA searches batch sizes 1..MAX_BATCH (InSS Algorithm 1); profiles too

if TYPE_CHECKING:
    from tritonctl.latency.lwr import LocallyWeightedRegression

FORMAT = LATENCY_MODEL_FORMAT
VERSION = 1
_BATCHES = np.arange(1, MAX_BATCH + 1)
T_INFS_KEPT = 50_000  # `t_infs` scans a model keeps (about 300 bytes each) before it starts afresh


@with_config(ConfigDict(allow_inf_nan=False))  # read back validated (`load_latency_model`)
@dataclass
class ModelParams:
    """Everything fitted for one model on this device."""

    name: str
    onnx_sha256: str
    n_ops: Annotated[int, Field(ge=0)]
    io_bytes: Annotated[int, Field(ge=0)]  # input + output bytes per sample
    lwr_bandwidth: Annotated[float, Field(gt=0)]
    lwr_X: list[Annotated[list[float], Field(min_length=2, max_length=2)]]  # (log2 batch, log eff) of training points
    lwr_y: list[float]  # running time (ms) at those points
    cache_a: float  # l = cache_a * eff + cache_b   (CPU utilisation proxy on CPU, L2 % on GPU)
    cache_b: float
    alpha_cache: float  # interference coefficient on running time
    memory_mb0: float  # footprint(b) = memory_mb0 + memory_mb1 * b
    memory_mb1: float
    batch_range: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]
    share_range: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]  # device units
    # How one batch's latency spreads around the prediction (a median): log-normal with sigma
    # max(0, spread[0] + spread[1] * log2 batch). The simulator draws from it; plans use the median.
    spread: tuple[float, float] = (0.0, 0.0)
    # (idle gap ms, extra ms): what a request takes beyond one sent back to back when the instance has been
    # idle that long (profile's wake.csv; none where it was not measured). The simulator adds it; plans do not.
    wake: tuple[tuple[float, float], ...] = ()
    # CPU ms a batch-1 request costs outside the model's own process: Triton's front end and HAProxy (profile's
    # requests.csv; 0 where not measured). The planner reserves rate x this of a CPU device's cores.
    request_cpu_ms: float = 0.0
    lwr_degree: int = 1  # the local fit's degree (LocallyWeightedRegression: 1 a plane, 2 a quadratic)
    lwr_floors: tuple[int, ...] = ()  # training points (indices) with nothing run at a larger batch and no more share


@with_config(ConfigDict(allow_inf_nan=False))
@dataclass
class DeviceParams:
    kind: str
    fingerprint: dict
    units: Annotated[int, Field(ge=1)]
    cores: Annotated[float, Field(gt=0)] | None
    io_c0_ms: float
    io_ms_per_byte: float  # 1 / bandwidth
    sched_a: float  # per operator, ms
    sched_b: float
    contention: float  # CPU only: weight of `LatencyModel.contention`
    gpulet: list[float]  # c1..c5 of Gpulet's pairwise interference factor
    pressure_by_duty: bool = False  # CPU: the co-runners' pressure weighed by the instance's own duty (see above)


def effective_share(kind: str, frac: float, cores: float | None, threads: int | None = None) -> float:
    """A share as the latency model sees it: cores usable by its threads on a CPU, the MPS fraction on a GPU."""
    if kind != "cpu":
        return frac
    share_cores = frac * cores
    return min(share_cores, threads if threads is not None else threads_for_cores(share_cores))


def _threads_and_duty(cores: float) -> tuple[int, float]:
    """The threads an instance of `cores` runs on, and the part of the time each may run."""
    threads = threads_for_cores(cores)
    return threads, min(cores, threads) / threads


def gpulet_factor(c: list[float], x: list[float]) -> float:
    """c1*L2_i + c2*L2_j + c3*mem_i + c4*mem_j + c5 (Gpulet, ATC'22)."""
    return sum(ci * xi for ci, xi in zip(c[:4], x, strict=True)) + c[4]


class LatencyModel:
    """Predicts a batch's execution latency from the fitted parameters; built by `fit`."""

    def __init__(self, device: DeviceParams, models: dict[str, ModelParams], meta: dict):
        self.device = device
        self.models = models
        self.meta = meta
        self._lwr = {name: self._make_lwr(p) for name, p in models.items()}
        self._table = {name: self._build_table(name) for name in models}
        self._columns = {name: np.array(rows[1:]) for name, rows in self._table.items()}  # [batch - 1, share]
        self._t_infs: dict[tuple, np.ndarray] = {}  # `t_infs` by the InSS formula before the margin, see there
        self._contention: dict[tuple[int, tuple[int, ...]], float] = {}  # (share, co-runners' shares) -> contention
        self._footprints: dict[str, list[float]] = {}  # `footprints_mb` per model
        self.margin = 0.0  # see `with_margin`
        self.margins: dict[str, float] = {}  # per model where set, see `with_errors`
        self.mlp: MlpPredictor | None = None  # set: t_inf is the MLP's (mlp.py), the rest stays this model's
        self._mlp_ms: dict[tuple, float] = {}

    def with_margin(self, margin: float) -> LatencyModel:
        """This model predicting every batch (1 + margin) times as long, any per-model errors (`with_errors`)
        replaced: planning against it leaves headroom for a latency model that is off by up to that much. Shares
        the fitted tables."""
        if not 0 <= margin < 1:
            raise TritonctlError(f"a latency margin must be in [0, 1), not {margin}")
        pessimist = copy.copy(self)
        pessimist.margin, pessimist.margins = margin, {}
        return pessimist

    def with_errors(self, errors: dict[str, float]) -> LatencyModel:
        """This model predicting model i's batches (1 + errors[i]) times as long, each error in (-1, 1): what it
        would predict knowing a draw of `simulate --latency-error` (`simulate.latency_errors`)."""
        if not all(-1 < e < 1 for e in errors.values()):
            raise TritonctlError(f"latency errors must be in (-1, 1): {errors}")
        knowing = copy.copy(self)
        knowing.margins = dict(errors)
        return knowing

    def slower(self, headroom: float) -> LatencyModel:
        """This model predicting every batch (1 + headroom) times as long again as it does: its margin and each
        model's error (`with_errors`) grown alike, each at most 0.99."""
        knowing = copy.copy(self)
        knowing.margin = min(0.99, (1 + self.margin) * (1 + headroom) - 1)
        knowing.margins = {name: min(0.99, (1 + e) * (1 + headroom) - 1) for name, e in self.margins.items()}
        return knowing

    @property
    def reads_corunner_batches(self) -> bool:
        """Whether a batch's time depends on its co-runners' batches (the MLP's prediction), not only on their
        shares (the InSS formula)."""
        return self.mlp is not None

    def margin_of(self, model: str) -> float:
        """How much longer than fitted this model predicts `model`'s batches: its error where set, else the margin."""
        return self.margins.get(model, self.margin)

    def without_mlp(self) -> LatencyModel:
        """This model predicting by the InSS formula even where the file carries an MLP."""
        inss = copy.copy(self)
        inss.mlp = None
        return inss

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def _make_lwr(p: ModelParams) -> LocallyWeightedRegression:
        from tritonctl.latency.lwr import LocallyWeightedRegression  # scikit-learn loads with the first model

        return LocallyWeightedRegression(bandwidth=p.lwr_bandwidth, degree=p.lwr_degree).fit(
            np.array(p.lwr_X), np.array(p.lwr_y)
        )

    def eff(self, share: int, threads: int | None = None) -> float:
        """The share in cores (CPU, capped by the thread count) or as a fraction (GPU)."""
        return effective_share(self.device.kind, share / self.device.units, self.device.cores, threads)

    def _run_lwr(self, name: str, batches: np.ndarray, shares: np.ndarray) -> np.ndarray:
        """LWR inside the profiled range; outside it, scaled from its edge (linear in batch, 1/eff in share);
        never faster than a floor point with no less share and a smaller batch.

        Local regression extrapolates poorly (a local slope can turn a tiny share fast), so
        queries are clamped to the measured box and scaled the way latency scales physically.
        """
        p = self.models[name]
        b = np.clip(batches, *p.batch_range)
        s = np.clip(shares, *p.share_range)
        eff = np.array([self.eff(int(x)) for x in shares])
        eff_in = np.array([self.eff(int(x)) for x in s])
        inside = self._lwr[name].predict(np.c_[np.log2(b), np.log(eff_in)])
        run = inside * (batches / b) * (eff_in / eff)
        for i in p.lwr_floors:
            (log_batch, log_eff), floor = p.lwr_X[i], p.lwr_y[i]
            ruled_out = (np.log2(batches) > log_batch + 1e-6) & (np.log(eff) <= log_eff + 1e-6)
            run[ruled_out] = np.maximum(run[ruled_out], floor)
        return run

    def _build_table(self, name: str) -> list[list[float]]:
        """Running time for every batch 1..32 and share 1..units, so queries cost a lookup."""
        units = self.device.units
        batches, shares = np.meshgrid(np.arange(1, MAX_BATCH + 1), np.arange(1, units + 1), indexing="ij")
        values = self._run_lwr(name, batches.ravel(), shares.ravel()).reshape(batches.shape)
        return [[0.0] * (units + 1)] + [[0.0, *row] for row in values.tolist()]

    # ---- queries ------------------------------------------------------------------------
    def run_ms(self, model: str, batch: int, share: int) -> float:
        if 1 <= batch <= MAX_BATCH and 1 <= share <= self.device.units:
            return self._table[model][batch][share]
        return float(self._run_lwr(model, np.array([batch]), np.array([share]))[0])

    def host_ms(self, model: str, batch: int) -> float:
        """What serving adds to a batch on the host, apart from the device's work (`tritonctl calibrate` on a GPU:
        Triton's and the glue's copies, c0 + c1 * batch); 0 where the model was not calibrated so."""
        c0, c1 = self.meta.get("calibrated", {}).get("added_ms", {}).get(model, (0.0, 0.0))
        return c0 + c1 * batch

    def io_ms(self, model: str, batch: int) -> float:
        p, d = self.models[model], self.device
        return d.io_c0_ms + d.io_ms_per_byte * p.io_bytes * batch

    def cache_pressure(self, model: str, share: int) -> float:
        p = self.models[model]
        return max(0.0, p.cache_a * self.eff(share) + p.cache_b)

    def felt_pressure(self, share: int, corunners: tuple[tuple[str, int, int], ...]) -> float:
        """sum_j l_j of the co-runners, as an instance at `share` feels it (weighed by its duty where the model
        says so)."""
        pressure = sum(self.cache_pressure(m, s) for m, s, _ in corunners)
        return pressure * self.duty(share) if self.device.pressure_by_duty else pressure

    def duty(self, share: int) -> float:
        """CPU: the part of the time each of the instance's threads may run, eff / threads; 1 on a GPU."""
        if self.device.kind != "cpu":
            return 1.0
        return _threads_and_duty(share / self.device.units * self.device.cores)[1]

    def t_inf(
        self,
        model: str,
        batch: int,
        share: int,
        corunners: tuple[tuple[str, int, int], ...] = (),
        in_turns: bool = False,
    ) -> float:
        """Execution latency (ms) of one batch; `corunners` are (model, share, batch) on the same device, running.
        `in_turns`: they take turns with a CPU beside it, so their interference counts but not the wait for a core
        (`contention`), which the caller counts by sharing the cores (the simulator's processor sharing)."""
        if self.mlp is not None:
            return self._predicted_by_mlp(model, batch, share, corunners) * (1 + self.margin_of(model))
        p, d = self.models[model], self.device
        run = self.run_ms(model, batch, share)
        if corunners:
            pressure = self.felt_pressure(share, corunners)
            waits = 0.0 if in_turns else d.contention * self.contention(share, corunners)
            run *= 1.0 + p.alpha_cache * pressure + waits
            run += p.n_ops * (d.sched_a * (len(corunners) + 1) + d.sched_b)
        return (self.io_ms(model, batch) + run) * (1 + self.margin_of(model))

    def t_infs(self, model: str, share: int, corunners: tuple[tuple[str, int, int], ...] = ()) -> np.ndarray:
        """`t_inf` of batches 1 ... MAX_BATCH at once (the same values), for a scan over batch sizes."""
        if self.mlp is not None or not 1 <= share <= self.device.units:
            return np.array([self.t_inf(model, int(b), share, corunners) for b in _BATCHES])
        # a planner asks again for the layouts it tried (the margin apart); the co-runners' batches are not read
        key = (model, share, tuple((m, s) for m, s, _ in corunners))
        times = self._t_infs.get(key)
        if times is None:
            p, d = self.models[model], self.device
            run = self._columns[model][:, share]
            if corunners:
                pressure = self.felt_pressure(share, corunners)
                run = run * (1.0 + p.alpha_cache * pressure + d.contention * self.contention(share, corunners))
                run = run + p.n_ops * (d.sched_a * (len(corunners) + 1) + d.sched_b)
            times = d.io_c0_ms + d.io_ms_per_byte * p.io_bytes * _BATCHES + run
            if len(self._t_infs) >= T_INFS_KEPT:
                self._t_infs.clear()
            self._t_infs[key] = times
        return times * (1 + self.margin_of(model))

    def _predicted_by_mlp(
        self, model: str, batch: int, share: int, corunners: tuple[tuple[str, int, int], ...]
    ) -> float:
        key = (model, batch, share, tuple(sorted(corunners)))
        cached = self._mlp_ms.get(key)
        if cached is None:
            row = self.mlp.features(self.eff, model, batch, share, key[3])
            cached = self._mlp_ms[key] = float(self.mlp.predict_ms(np.array(row))[0])
        return cached

    def contention(self, share: int, corunners: tuple[tuple[str, int, int], ...]) -> float:
        """CPU only: the share of time this instance's threads wait for a core beyond their quota's slack.

        A GPU's MPS share reserves SMs; a CPU quota reserves time, not cores. Each thread of
        an instance wants to run a fraction u = eff / threads of the time. A thread of ours
        finds no free core when, besides its own sibling threads, at least `cores - (t - 1)`
        threads of the co-runners want to run at once (threads independent, each runnable
        with its own u). Waiting costs nothing while the thread would be throttled anyway,
        so what counts is P(blocked) - (1 - u). Measured here: 1-thread instances at 0.5
        core barely slowed next to anything, 2-thread instances at 1.5 cores slowed clearly
        next to a half-core co-runner, as this predicts.
        """
        if self.device.kind != "cpu":
            return 0.0
        key = (share, tuple(sorted(s for _, s, _ in corunners)))
        cached = self._contention.get(key)
        if cached is None:
            cached = self._contention[key] = self._contention_of(share, key[1])
        return cached

    def _contention_of(self, share: int, shares: tuple[int, ...]) -> float:
        def threads_and_duty(s: int) -> tuple[int, float]:
            return _threads_and_duty(s / self.device.units * self.device.cores)

        threads, duty = threads_and_duty(share)
        runnable = np.array([1.0])  # distribution of the number of co-runner threads wanting a core
        for s in shares:
            t, u = threads_and_duty(s)
            for _ in range(t):
                runnable = np.convolve(runnable, [1 - u, u])
        blocking = max(0, math.ceil(self.device.cores - (threads - 1)))
        p_blocked = float(runnable[blocking:].sum())
        return max(0.0, p_blocked - (1 - duty))

    def t_inf_gpulet(
        self, model: str, batch: int, share: int, corunners: tuple[tuple[str, int, int], ...] = ()
    ) -> float:
        """The same latency by Gpulet's pairwise linear interference model (for comparison)."""
        solo = self.io_ms(model, batch) + self.run_ms(model, batch, share)
        factor = 1.0  # pairwise factors, their excess over 1 added up for groups larger than a pair
        for other, share_j, _ in corunners:
            factor += gpulet_factor(self.device.gpulet, self.gpulet_features(model, share, other, share_j)) - 1.0
        return solo * max(factor, 0.1) * (1 + self.margin_of(model))

    def gpulet_features(self, model: str, share: int, other: str, share_j: int) -> list[float]:
        """Gpulet's (L2_i, L2_j, mem_i, mem_j): here cache pressure and the share in cores."""
        return [
            self.cache_pressure(model, share),
            self.cache_pressure(other, share_j),
            self.eff(share),
            self.eff(share_j),
        ]

    def sigma(self, model: str, batch: int) -> float:
        """The log-normal sigma of one batch's latency around `t_inf` (see `ModelParams.spread`)."""
        p = self.models[model]
        s0, s1 = p.spread
        return max(0.0, s0 + s1 * math.log2(min(max(batch, p.batch_range[0]), p.batch_range[1])))

    def wake_ms(self, model: str, idle_ms: float) -> float:
        """Extra time (ms) of a batch that starts after the instance has been idle `idle_ms` (interpolated in the
        measured gaps; the longest gap's beyond them)."""
        wake = self.models[model].wake
        if not wake:
            return 0.0
        i = bisect.bisect_right(wake, (idle_ms, math.inf))  # the simulator asks once per batch: no numpy here
        if i == 0:
            return wake[0][1]
        if i == len(wake):
            return wake[-1][1]
        (g0, x0), (g1, x1) = wake[i - 1], wake[i]
        return x0 + (x1 - x0) * (idle_ms - g0) / (g1 - g0)

    def footprint_mb(self, model: str, batch: int) -> float:
        p = self.models[model]
        return p.memory_mb0 + p.memory_mb1 * batch

    def footprints_mb(self, model: str) -> list[float]:
        """`footprint_mb` of batches 1 ... MAX_BATCH (the same values), for a scan over batch sizes."""
        if model not in self._footprints:
            self._footprints[model] = [self.footprint_mb(model, b) for b in range(1, MAX_BATCH + 1)]
        return self._footprints[model]

    def extrapolates(self, model: str, batch: int, share: int) -> bool:
        p = self.models[model]
        return not (p.batch_range[0] <= batch <= p.batch_range[1] and p.share_range[0] <= share <= p.share_range[1])

    # ---- persistence --------------------------------------------------------------------
    def save(self, path: Path) -> None:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "meta": self.meta,
            "device": asdict(self.device),
            "models": {name: asdict(p) for name, p in self.models.items()},
            **({"mlp": self.mlp.to_json()} if self.mlp is not None else {}),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")


@functools.cache
def _adapter(kind: type) -> TypeAdapter:
    return TypeAdapter(kind)


def _validated(kind: type, raw, path: Path, field: str):
    """`raw` read as a `kind` dataclass, or the first problem naming its field."""
    try:
        return _adapter(kind).validate_python(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join([field, *(str(step) for step in err["loc"])])
        raise TritonctlError(f"corrupt latency model: {err['msg']}", file=path, field=where) from None


def load_latency_model(path: str | Path) -> LatencyModel:
    """A latency model file (`tritonctl fit` or `calibrate`), every field checked; a problem names the field."""
    path = Path(path)
    try:
        data = read_json(path)
    except TritonctlError:
        if kind := yaml_kind(path):
            raise TritonctlError(
                f"this is a {kind}, not a latency model (tritonctl fit or calibrate writes one)", file=path
            ) from None
        raise
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise TritonctlError(f"not a {FORMAT} file of version {VERSION} (make one with `tritonctl fit`)", file=path)
    for key in ("device", "models"):
        if not isinstance(data.get(key), dict):
            raise TritonctlError("corrupt latency model: must be a mapping", file=path, field=key)
    device = _validated(DeviceParams, data["device"], path, "device")
    models = {}
    for name, raw in data["models"].items():
        model = _validated(ModelParams, raw, path, f"models.{name}")
        if not model.lwr_y or len(model.lwr_X) != len(model.lwr_y):
            raise TritonctlError(
                "corrupt latency model: lwr_X and lwr_y must hold the same training points",
                file=path,
                field=f"models.{name}",
            )
        models[name] = dataclasses.replace(model, wake=tuple(sorted(model.wake)))
    try:
        lm = LatencyModel(device, models, data.get("meta", {}))
        if "mlp" in data:
            lm.mlp = MlpPredictor.from_json(data["mlp"])
        return lm
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TritonctlError(f"corrupt latency model ({type(exc).__name__}: {exc})", file=path) from None


def scaled(
    lm: LatencyModel,
    factors: dict[str, tuple[float, float, float]],
    fingerprint: dict,
    meta: dict,
    request_cpu_ms: dict[str, float],
    added_ms: dict[str, tuple[float, float]] | None = None,
    wake: dict[str, tuple[tuple[float, float], ...]] | None = None,
) -> LatencyModel:
    """`lm` carried to another device of the same kind: each model's running time at batch b with c of the
    device's C cores times k * b^gamma * (c / C)^delta, (k, gamma, delta) its factors measured there
    (`tritonctl calibrate`), plus c0 + c1 * b where `added_ms` gives (c0, c1) (what serving adds on a GPU; the sum
    kept above a twentieth of the running time), the CPU a request costs outside it and, where `wake` gives it, its
    wake-up curve, as measured there; upload, interference and spread terms kept, the new device's fingerprint. An
    MLP predictor is not carried: its weights are the other device's, and the calibrated model predicts by the
    InSS formula."""
    full = lm.eff(lm.device.units)
    added_ms, wake = added_ms or {}, wake or {}

    def times(name: str, p: ModelParams) -> ModelParams:
        k, gamma, delta = factors[name]
        c0, c1 = added_ms.get(name, (0.0, 0.0))
        lwr_y = []
        for x, y in zip(p.lwr_X, p.lwr_y, strict=True):  # x: (log2 batch, log cores) of a training point
            run = y * k * 2 ** (gamma * x[0]) * (math.exp(x[1]) / full) ** delta
            lwr_y.append(max(run + c0 + c1 * 2 ** x[0], 0.05 * run))
        woken = wake.get(name, p.wake)
        return dataclasses.replace(p, lwr_y=lwr_y, request_cpu_ms=round(request_cpu_ms[name], 4), wake=woken)

    models = {name: times(name, p) for name, p in lm.models.items() if name in factors}
    device = dataclasses.replace(lm.device, fingerprint=fingerprint)
    carried = LatencyModel(device, models, {**lm.meta, **meta})
    carried.margin, carried.margins = lm.margin, dict(lm.margins)  # what `lm` plans with, kept
    return carried

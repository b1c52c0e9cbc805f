"""Measure models through the serving path: real Triton instances under real shares.

Each model runs in a Triton instance rendered exactly as `tritonctl render` renders it
(same backend glue, same onnxruntime thread count for the share). On a CPU each instance
runs in its own cgroup; the thread count is fixed when an instance starts, so instances are
pooled per (model, thread count) and the share is changed by rewriting the cgroup quota,
which takes effect at once. On a GPU an instance's MPS active thread percentage is fixed
when it starts, so instances are pooled per (model, share), under an MPS control daemon of
the harness's own (`start` brings up a set of them in parallel: a GPU instance captures its
CUDA graphs at load, seconds each). A closed-loop client sends whole batches (one request of
batch b at a time, so Triton's dynamic batcher executes each at once); the client measures
end-to-end latency and Triton's statistics give the server-side compute and queue time of
exactly those batches.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tritonctl.deploy import mps
from tritonctl.deploy import share as cgroups
from tritonctl.deploy.local import LocalRuntime, cpu_seconds, free_port
from tritonctl.deploy.runtime import InstanceRecord, stop_all
from tritonctl.errors import TritonctlError
from tritonctl.latency.dataset import MemoryPoint, RequestCost, WakePoint
from tritonctl.latency.model import MAX_BATCH
from tritonctl.planning.plan import Device, Placement, PlannedModel
from tritonctl.shares import CFS_PERIOD_US, cpu_cores, threads_for
from tritonctl.spec import DTYPES
from tritonctl.triton.client import concrete_shape, random_input
from tritonctl.triton.render import render_instance

from .grid import Member

WARMUP_REPS, WARMUP_S = 3, 0.3
# A solo run measures at least MIN_TIME_S and MIN_REPS batches; it stops at MAX_REPS, or at MAX_TIME_S with 3.
MIN_REPS, MIN_TIME_S, MAX_REPS, MAX_TIME_S = 14, 1.0, 300, 3.0
COLOC_MIN_REPS, COLOC_TIME_S, COLOC_MAX_TIME_S = 5, 3.0, 12.0


@dataclass(frozen=True)
class Stats:
    """What one member of a run saw."""

    reps: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    compute_ms: float
    queue_ms: float
    rss_mb: float
    cpu_util: float  # cores the instance's processes kept busy during the measurement


def _names(members: tuple[Member, ...]) -> str:
    return " + ".join(f"{m.model} (batch {m.batch}, share {m.share})" for m in members)


class Harness:
    """A pool of Triton instances on one device, and the measurements taken against them."""

    def __init__(
        self,
        runtime: LocalRuntime,
        device: Device,
        models: dict[str, tuple[PlannedModel, Path]],
        work_dir: Path,
        warm_batches: list[int],
        host: str = "127.0.0.1",
    ):
        self.runtime = runtime
        self.device = device
        self.models = models
        self.work_dir = work_dir
        self.host = host
        self.pool: dict[tuple[str, int], InstanceRecord] = {}
        self.warm_batches = warm_batches
        self.server_version = ""
        self.memory: list[MemoryPoint] = []  # footprint by batch, from each instance's warm-up
        self.gpu_backend = "onnxruntime"  # what serves a GPU instance, as `apply` would serve it
        if device.kind == "gpu":
            mps.ensure(runtime.state_dir)  # stopped by `close` (the runtime's shutdown) if started here
            if runtime.binary is not None:
                self.gpu_backend = runtime.binary.gpu_backend()

    def _key(self, model: str, share: int) -> tuple[str, int]:
        """Which pooled instance serves `model` at `share`: per thread count on a CPU, per share on a GPU."""
        return (model, share if self.device.kind == "gpu" else threads_for(self.device, share))

    def start(self, members: list[tuple[str, int]]) -> None:
        """Start and warm the instances for these (model, share) pairs at once, those not pooled yet."""
        keys = {self._key(*m): m for m in members if self._key(*m) not in self.pool}
        with ThreadPoolExecutor(max_workers=max(1, len(keys))) as pool:
            for future in [pool.submit(self.instance, *m) for m in keys.values()]:
                future.result()

    def instance(self, model: str, share: int) -> InstanceRecord:
        """The model's instance for this share (its thread count on a CPU, with its quota set to the share)."""
        key = self._key(model, share)
        if key not in self.pool:
            planned, onnx_path = self.models[model]
            planned = planned.model_copy(update={"port": free_port(self.host)})
            tag = f"s{share}" if self.device.kind == "gpu" else f"t{key[1]}"
            placement = Placement(instance=f"{model}-{tag}", device=self.device.id, share=share, batch=MAX_BATCH)
            folder = self.work_dir / "instances" / placement.instance
            launch = render_instance(
                folder, "profile", planned, placement, self.device, onnx_path, gpu_backend=self.gpu_backend
            )
            record = self.runtime.start(launch, folder, self.host, self.work_dir / "logs", timeout_s=240)
            self._warm(record, model, key[1])
            self.pool[key] = record
        record = self.pool[key]
        if record.cgroup:
            cgroups.set_quota(Path(record.cgroup), round(cpu_cores(self.device, share) * CFS_PERIOD_US), CFS_PERIOD_US)
        return record

    def _warm(self, record: InstanceRecord, model: str, pooled: int) -> None:
        """Run every batch size once at the instance's full speed, smallest first, before measuring.

        Without it the first configurations measured on a fresh instance pay for growing
        onnxruntime's arena and touching new pages, and measured visibly slower. The
        resident memory after each batch size is the model's footprint by batch, recorded under
        `pooled` (the instance's thread count on a CPU, its share on a GPU).
        """
        if record.cgroup:
            cgroups.set_quota(Path(record.cgroup), pooled * CFS_PERIOD_US, CFS_PERIOD_US)
        with grpcclient.InferenceServerClient(self._url(record)) as client:
            if not self.server_version:
                self.server_version = client.get_server_metadata().version
            for batch in self.warm_batches:
                request = self._request(model, batch)
                for _ in range(2):
                    client.infer(model, [request])
                self.memory.append(MemoryPoint(model, pooled, batch, round(self._rss_mb(record), 2)))

    def wake(self, model: str, gaps_ms: tuple[float, ...], requests: int) -> list[WakePoint]:
        """Median latency of single batch-1 requests with the whole device, each sent a gap after the previous
        answer, per gap. The closed loops of `measure` keep an instance busy; open-loop traffic leaves it idle."""
        record = self.instance(model, self.device.units)
        request = self._request(model, 1)
        points = []
        try:
            with grpcclient.InferenceServerClient(self._url(record)) as client:
                for gap in gaps_ms:
                    latencies = []
                    for _ in range(requests):
                        time.sleep(gap / 1000)
                        start = time.perf_counter()
                        client.infer(model, [request])
                        latencies.append((time.perf_counter() - start) * 1000)
                    points.append(WakePoint(model, gap, float(np.median(latencies))))
        except Exception as exc:  # tritonclient raises InferenceServerException, grpc errors, ...
            raise TritonctlError(f"measuring the wake-up of {model} failed: {exc}") from None
        return points

    def request_cost(self, model: str, requests: int, gap_ms: float) -> RequestCost:
        """CPU that batch-1 requests cost outside the model's own process: `requests` sent through HAProxy to
        the model's instance with the whole device, each after an idle gap drawn exponential with mean `gap_ms`
        (open-loop traffic wakes the server's threads for each request: back to back, a request costs less),
        against the CPU time of the Triton server process (its front end: the model runs in the backend stub)
        and of HAProxy."""
        record = self.instance(model, self.device.units)
        port = free_port(self.host)
        self.runtime.route(self.host, port, [(record, 1.0)])
        request = self._request(model, 1)
        gaps = np.random.default_rng(0).exponential(gap_ms / 1000, requests)
        try:
            with grpcclient.InferenceServerClient(f"{self.host}:{port}") as client:
                for _ in range(WARMUP_REPS):
                    client.infer(model, [request])
                server, proxy = cpu_seconds(record.pid), self.runtime.proxy_cpu_seconds()
                for gap in gaps:
                    time.sleep(gap)
                    client.infer(model, [request])
                server, proxy = cpu_seconds(record.pid) - server, self.runtime.proxy_cpu_seconds() - proxy
        except Exception as exc:  # tritonclient raises InferenceServerException, grpc errors, ...
            raise TritonctlError(f"measuring what a request of {model} costs failed: {exc}") from None
        return RequestCost(model, requests, round(1000 * server / requests, 4), round(1000 * proxy / requests, 4))

    def _request(self, model: str, batch: int) -> grpcclient.InferInput:
        tensor = self.models[model][0].inputs[0]
        shape = [batch, *concrete_shape(tensor.shape)]
        request = grpcclient.InferInput(tensor.name, shape, DTYPES[tensor.dtype].removeprefix("TYPE_"))
        request.set_data_from_numpy(random_input(np.random.default_rng(0), shape, tensor.dtype))
        return request

    def _url(self, record: InstanceRecord) -> str:
        return f"{self.host}:{record.backend_port}"

    def close(self) -> None:
        stop_all(self.runtime, self.pool)
        self.pool.clear()
        self.runtime.shutdown()  # HAProxy and the routes `request_cost` gave it

    def measure(self, members: tuple[Member, ...]) -> list[Stats]:
        """Run every member's closed loop at once; solo when there is one member."""
        records = [self.instance(m.model, m.share) for m in members]
        solo = len(members) == 1
        stop, go = threading.Event(), threading.Event()
        warmed = threading.Barrier(len(members) + 1)
        samples: list[list[float]] = [[] for _ in members]
        errors: list[str] = []
        threads = [
            threading.Thread(target=self._loop, args=(r, m, warmed, go, stop, out, errors), daemon=True)
            for r, m, out in zip(records, members, samples, strict=True)
        ]
        for thread in threads:
            thread.start()
        try:
            warmed.wait(timeout=COLOC_MAX_TIME_S * 10)
        except threading.BrokenBarrierError:
            stop.set()
            go.set()
            raise TritonctlError(f"measuring {_names(members)} failed while warming up: {'; '.join(errors)}") from None
        before = [self._batch_stats(r, m) for r, m in zip(records, members, strict=True)]
        cpu_before = [self._cpu_seconds(r) for r in records]
        go.set()
        t0 = time.monotonic()
        min_reps, min_time, max_time = (
            (MIN_REPS, MIN_TIME_S, MAX_TIME_S) if solo else (COLOC_MIN_REPS, COLOC_TIME_S, COLOC_MAX_TIME_S)
        )
        while True:
            elapsed = time.monotonic() - t0
            counts = [len(s) for s in samples]
            if elapsed >= min_time and min(counts) >= min_reps:
                break
            if (solo and counts[0] >= MAX_REPS) or (elapsed >= max_time and min(counts) >= 3):
                break
            if errors or elapsed > 10 * max_time:
                break
            time.sleep(0.01)
        stop.set()
        wall = time.monotonic() - t0
        cpu_used = [self._cpu_seconds(r) - c for r, c in zip(records, cpu_before, strict=True)]
        for thread in threads:
            thread.join()
        if errors or min(len(s) for s in samples) < 3:
            raise TritonctlError(f"measuring {_names(members)} failed: {'; '.join(errors) or 'too few answers'}")
        stats = []
        for record, member, lat, start, cpu in zip(records, members, samples, before, cpu_used, strict=True):
            end = self._batch_stats(record, member)
            executions = max(1, end[0] - start[0])
            arr = np.array(lat)
            stats.append(
                Stats(
                    reps=len(arr),
                    p50_ms=float(np.percentile(arr, 50)),
                    p95_ms=float(np.percentile(arr, 95)),
                    p99_ms=float(np.percentile(arr, 99)),
                    mean_ms=float(arr.mean()),
                    compute_ms=(end[1] - start[1]) / executions / 1e6,
                    queue_ms=(end[2] - start[2]) / executions / 1e6,
                    rss_mb=self._rss_mb(record) if solo else float("nan"),
                    cpu_util=cpu / wall,
                )
            )
        return stats

    def _loop(
        self,
        record: InstanceRecord,
        member: Member,
        warmed: threading.Barrier,
        go: threading.Event,
        stop: threading.Event,
        out: list[float],
        errors: list[str],
    ) -> None:
        """One member's closed loop; a failure is recorded in `errors` and breaks the barrier."""
        request = self._request(member.model, member.batch)
        try:
            with grpcclient.InferenceServerClient(self._url(record)) as client:
                warm_until = time.monotonic() + WARMUP_S
                for i in itertools.count():
                    if i >= WARMUP_REPS and time.monotonic() >= warm_until:
                        break
                    client.infer(member.model, [request])
                warmed.wait()
                go.wait()
                while not stop.is_set():
                    t = time.perf_counter()
                    client.infer(member.model, [request])
                    if not stop.is_set():
                        out.append((time.perf_counter() - t) * 1000)
        except Exception as exc:  # tritonclient raises InferenceServerException, grpc errors, ...
            errors.append(f"{member.model}: {exc}")
            warmed.abort()

    def _batch_stats(self, record: InstanceRecord, member: Member) -> tuple[int, int, int]:
        """(executions, compute ns, queue ns) Triton has counted for this batch size so far."""
        with grpcclient.InferenceServerClient(self._url(record)) as client:
            stats = client.get_inference_statistics(member.model, as_json=True)["model_stats"][0]
        for batch in stats.get("batch_stats", []):
            if int(batch["batch_size"]) == member.batch:
                compute = sum(int(batch[k].get("ns", 0)) for k in ("compute_input", "compute_infer", "compute_output"))
                queue = int(stats["inference_stats"]["queue"].get("ns", 0))
                return int(batch["compute_infer"].get("count", 0)), compute, queue
        return 0, 0, int(stats["inference_stats"]["queue"].get("ns", 0))

    @staticmethod
    def _pids(record: InstanceRecord) -> set[int]:
        """The instance's processes: the server and its backend stub."""
        return cgroups.members(Path(record.cgroup)) if record.cgroup else {record.pid}

    def _cpu_seconds(self, record: InstanceRecord) -> float:
        """CPU time (user + system) the instance's processes have used so far."""
        return sum(cpu_seconds(pid) for pid in self._pids(record))

    def _rss_mb(self, record: InstanceRecord) -> float:
        """Resident memory of the instance's processes (server and backend stub)."""
        total_kb = 0
        for pid in self._pids(record):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
            except OSError:
                continue
        return total_kb / 1024

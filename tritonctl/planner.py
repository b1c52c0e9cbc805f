"""From a cluster and its model artifacts to a Plan, through a named policy."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from profiler.device import cpu_fingerprint
from tritonctl.errors import TritonctlError
from tritonctl.export import Artifact
from tritonctl.latency.model import LatencyModel
from tritonctl.latency.queueing import task_latency
from tritonctl.plan import Device, Placement, Plan, PlannedModel, Prediction, RuntimeSettings, Tensor, relative_to
from tritonctl.policies import POLICIES, Demand, PlacementError
from tritonctl.spec import Cluster

# Without a profile: weights twice (session copy + arena) plus runtime overhead.
RUNTIME_OVERHEAD_MB = 64


def devices_of(cluster: Cluster) -> list[Device]:
    devices: list[Device] = []
    for group in cluster.spec.devices:
        for _ in range(group.count):
            index = len(devices)
            devices.append(
                Device(
                    id=f"{group.kind}{index}",
                    kind=group.kind,
                    index=index,
                    memory_mb=group.memory_mb,
                    units=group.units,
                    cores=group.cores,
                )
            )
    return devices


def footprint_mb(cluster: Cluster, name: str, artifact: Artifact, lm: LatencyModel | None) -> int:
    """The spec's memory_mb, else the profiled footprint at batch 1, else an estimate from the weights."""
    model = next(m for m in cluster.spec.models if m.name == name)
    if model.memory_mb:
        return model.memory_mb
    if lm is not None:
        return math.ceil(lm.footprint_mb(name, 1))
    return math.ceil(2 * artifact.weights_mb + RUNTIME_OVERHEAD_MB)


def _describe(kind: str, units: int, cores: float | None) -> str:
    return f"a {kind} device of {units} units" + (f" standing for {cores:g} cores" if cores else "")


def check_latency_model(
    cluster: Cluster, artifacts: dict[str, Artifact], lm: LatencyModel, lm_path: Path, log: Callable[[str], None]
) -> None:
    """Refuse a latency model that cannot speak for this cluster; warn where it is only doubtful."""
    device = cluster.spec.devices[0]
    if (lm.device.kind, lm.device.units, lm.device.cores) != (device.kind, device.units, device.cores):
        raise TritonctlError(
            f"fitted for {_describe(lm.device.kind, lm.device.units, lm.device.cores)}; the cluster has "
            f"{_describe(device.kind, device.units, device.cores)}",
            file=lm_path,
            field="device",
        )
    if device.kind == "cpu" and lm.device.fingerprint.get("id") != cpu_fingerprint()["id"]:
        log(
            f"WARNING: {lm_path} was profiled on another CPU ({lm.device.fingerprint.get('model')}); "
            "its predictions may not hold here"
        )
    for i, model in enumerate(cluster.spec.models):
        fitted = lm.models.get(model.name)
        if fitted is None:
            raise TritonctlError(
                f"model {model.name!r} is not in the latency model {lm_path}: profile and fit it",
                file=cluster.path,
                field=f"models[{i}]",
            )
        if fitted.onnx_sha256 != artifacts[model.name].sha256:
            log(f"WARNING: {model.name}: its ONNX file changed since it was profiled; predictions may be off")


def predict(plan_models: list[PlannedModel], lm: LatencyModel, log: Callable[[str], None]) -> list[PlannedModel]:
    """The plan's models with a prediction on every placement, given everything else on its device."""
    placed = [(m, p) for m in plan_models for p in m.placements]
    out = []
    for model in plan_models:
        placements = []
        for p in model.placements:
            corunners = tuple((m.name, q.share, q.batch) for m, q in placed if q.device == p.device and q is not p)
            if lm.extrapolates(model.name, p.batch, p.share):
                fitted = lm.models[model.name]
                log(
                    f"WARNING: {p.instance}: batch {p.batch}, share {p.share} lies outside the profiled range "
                    f"(batch {fitted.batch_range}, share {fitted.share_range}); the prediction extrapolates"
                )
            exec_ms = lm.t_inf(model.name, p.batch, p.share, corunners)
            task = task_latency(model.rate / len(model.placements), p.batch, exec_ms)
            latency = task.p99_ms if task.stable else None
            placements.append(
                p.model_copy(
                    update={
                        "predicted": Prediction(
                            exec_ms=round(exec_ms, 3),
                            latency_ms=None if latency is None else round(latency, 3),
                            throughput_rps=round(1000 * p.batch / exec_ms, 2),
                            meets_slo=latency is not None and latency <= model.slo_ms,
                        )
                    }
                )
            )
        out.append(model.model_copy(update={"placements": placements}))
    return out


def make_plan(
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    policy: str,
    plan_path: Path,
    lm: LatencyModel | None = None,
    log: Callable[[str], None] = print,
) -> Plan:
    """Run `policy` on the cluster and return the plan to be saved at `plan_path`."""
    if policy not in POLICIES:
        raise TritonctlError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    devices = devices_of(cluster)
    largest = max(d.memory_mb for d in devices)
    demands = []
    for i, model in enumerate(cluster.spec.models):
        memory = footprint_mb(cluster, model.name, artifacts[model.name], lm)
        if memory > largest:
            raise TritonctlError(
                f"needs {memory} MB but the largest device has {largest} MB",
                file=cluster.path,
                field=f"models[{i}]" + (".memory_mb" if model.memory_mb else " (estimated from its weights)"),
            )
        demands.append(Demand(model.name, model.slo_ms, model.rate, memory))
    try:
        choices = POLICIES[policy][0](demands, devices, lm)
    except PlacementError as exc:
        raise TritonctlError(str(exc), file=cluster.path, field="models") from None
    runtime = cluster.spec.runtime
    if runtime.base_port + len(demands) - 1 > 65535:
        raise TritonctlError(
            f"{len(demands)} models need ports up to {runtime.base_port + len(demands) - 1}",
            file=cluster.path,
            field="runtime.base_port",
        )

    base = plan_path.resolve().parent
    planned = []
    for i, (model, demand) in enumerate(zip(cluster.spec.models, demands, strict=True)):
        artifact = artifacts[model.name]
        placements = [
            Placement(
                instance=f"{model.name}-{k}",
                device=c.device,
                share=c.share,
                batch=c.batch,
                queue_delay_us=c.queue_delay_us,
                predicted=c.predicted,
            )
            for k, c in enumerate(choices[model.name])
        ]
        planned.append(
            PlannedModel(
                name=model.name,
                onnx=relative_to(artifact.path, base),
                onnx_sha256=artifact.sha256,
                inputs=[Tensor(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in artifact.inputs],
                outputs=[Tensor(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in artifact.outputs],
                memory_mb=demand.memory_mb,
                slo_ms=model.slo_ms,
                rate=model.rate,
                port=runtime.base_port + i,
                placements=placements,
            )
        )
    if lm is not None:
        planned = predict(planned, lm, log)
    return Plan(
        cluster=cluster.spec.name,
        cluster_file=relative_to(cluster.path, base),
        policy=policy,
        target=cluster.kind,
        devices=devices,
        models=planned,
        runtime=RuntimeSettings(
            repository_dir=relative_to(cluster.resolve(runtime.repository_dir), base),
            state_dir=relative_to(cluster.resolve(runtime.state_dir), base),
            host=runtime.host,
            tritonserver=str(cluster.resolve(runtime.tritonserver)) if runtime.tritonserver else None,
            startup_timeout_s=runtime.startup_timeout_s,
        ),
    )

"""From a cluster and its model artifacts to a Plan, through a named policy."""

from __future__ import annotations

import math
from pathlib import Path

from tritonctl.errors import TritonctlError
from tritonctl.export import Artifact
from tritonctl.plan import Device, Placement, Plan, PlannedModel, RuntimeSettings, Tensor, relative_to
from tritonctl.policies import POLICIES, Demand, PlacementError
from tritonctl.spec import Cluster

# Until the profiler measures footprints: weights twice (session copy + arena) plus runtime overhead.
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


def footprint_mb(cluster: Cluster, name: str, artifact: Artifact) -> int:
    model = next(m for m in cluster.spec.models if m.name == name)
    return model.memory_mb or math.ceil(2 * artifact.weights_mb + RUNTIME_OVERHEAD_MB)


def make_plan(cluster: Cluster, artifacts: dict[str, Artifact], policy: str, plan_path: Path) -> Plan:
    """Run `policy` on the cluster and return the plan to be saved at `plan_path`."""
    if policy not in POLICIES:
        raise TritonctlError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    devices = devices_of(cluster)
    largest = max(d.memory_mb for d in devices)
    demands = []
    for i, model in enumerate(cluster.spec.models):
        memory = footprint_mb(cluster, model.name, artifacts[model.name])
        if memory > largest:
            raise TritonctlError(
                f"needs {memory} MB but the largest device has {largest} MB",
                file=cluster.path,
                field=f"models[{i}]" + (".memory_mb" if model.memory_mb else " (estimated from its weights)"),
            )
        demands.append(Demand(model.name, model.slo_ms, model.rate, memory))
    try:
        choices = POLICIES[policy][0](demands, devices)
    except PlacementError as exc:
        raise TritonctlError(str(exc), file=cluster.path, field="models") from None

    base = plan_path.resolve().parent
    runtime = cluster.spec.runtime
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
            tritonserver=runtime.tritonserver,
            startup_timeout_s=runtime.startup_timeout_s,
        ),
    )

"""The plan: where each model runs, with which share and batch size, as a readable YAML file.

A plan is the output of a policy and the input of render and apply. It carries everything
later stages need (several replicas per model, shares in device units, predictions per
placement), so a person can read it, diff it and hand-edit it. Paths inside a plan file
are relative to the plan file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tritonctl.files import load_validated
from tritonctl.spec import MODEL_NAME, Dtype

PLAN_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Device(_Strict):
    """One device: `units` of share to hand out, `cores` a CPU device's units stand for."""

    id: str
    kind: Literal["gpu", "cpu"]
    index: Annotated[int, Field(ge=0)]
    memory_mb: Annotated[int, Field(gt=0)]
    units: Annotated[int, Field(ge=1)]
    cores: float | None = None


class Tensor(_Strict):
    name: str
    dtype: Dtype
    shape: list[int]


class Prediction(_Strict):
    """What the fitted latency model expects of a placement (absent without one).

    exec_ms: one batch next to its co-runners; latency_ms: p99 task latency with queueing
    (InSS eq. 2) at the model's rate, None when that rate overloads the placement;
    meets_slo: that p99 is within the SLO; in_slo_rps: of the requests/s planned for this
    placement, how many are predicted to finish within the SLO (`queueing.goodput`; below the
    rate where the placement serves the model only in part).
    """

    exec_ms: float
    latency_ms: float | None = None
    throughput_rps: float
    meets_slo: bool
    in_slo_rps: float | None = None


class Placement(_Strict):
    """One replica of a model: a Triton instance on `device` with `share` units of it.

    `weight`: the part of the model's traffic this replica is sized for, relative to the
    model's other replicas (equal unless a policy sizes replicas unequally).
    """

    instance: Annotated[str, Field(pattern=MODEL_NAME.pattern)]
    device: str
    share: Annotated[int, Field(ge=1)]
    batch: Annotated[int, Field(ge=1)]
    queue_delay_us: Annotated[int, Field(ge=0)] = 0
    weight: Annotated[float, Field(gt=0)] = 1.0
    predicted: Prediction | None = None


class PlannedModel(_Strict):
    name: str
    onnx: str
    onnx_sha256: str
    inputs: list[Tensor] = Field(min_length=1)
    outputs: list[Tensor] = Field(min_length=1)
    memory_mb: Annotated[int, Field(gt=0)]
    slo_ms: Annotated[float, Field(gt=0)]
    rate: Annotated[float, Field(ge=0)]
    port: Annotated[int, Field(ge=1, le=65535)]
    placements: list[Placement] = Field(min_length=1)

    @model_validator(mode="after")
    def _name(self) -> PlannedModel:
        if not MODEL_NAME.match(self.name):
            raise ValueError(f"{self.name!r} is not a name Triton accepts")
        return self

    def rate_of(self, placement: Placement) -> float:
        """The arrival rate `placement` is planned for: the model's rate split by the replicas' weights."""
        return self.rate * placement.weight / sum(p.weight for p in self.placements)


class Unserved(_Strict):
    """A model of the cluster the plan does not serve, and why."""

    name: str
    reason: str


class RuntimeSettings(_Strict):
    repository_dir: str
    state_dir: str
    host: str
    tritonserver: str | None = None
    startup_timeout_s: float = 120.0
    reject_late: bool = False  # Triton rejects a request that can no longer meet its SLO (render.queue_timeout_us)


class Plan(_Strict):
    """`sharing`: spatial, each device split into shares that add up to at most its units (MPS,
    CPU quotas); temporal, every instance gets the whole device and instances on one device
    take turns (no spatial sharing, the baseline of InSS section 6). `turns`: the devices of a
    spatial plan that are shared in turns all the same (a policy may choose per device)."""

    version: Literal[1] = PLAN_VERSION
    cluster: str
    cluster_file: str
    policy: str
    target: Literal["gpu", "cpu"]
    sharing: Literal["spatial", "temporal"] = "spatial"
    devices: list[Device] = Field(min_length=1)
    models: list[PlannedModel] = Field(min_length=1)
    unserved: list[Unserved] = Field(default_factory=list)
    turns: list[str] = Field(default_factory=list)
    runtime: RuntimeSettings

    def takes_turns(self, device_id: str) -> bool:
        """Whether the instances on this device take turns with all of it (rather than splitting it)."""
        return self.sharing == "temporal" or device_id in self.turns

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        devices = {d.id: d for d in self.devices}
        for device_id in self.turns:
            if device_id not in devices:
                raise ValueError(f"turns: unknown device {device_id!r}")
        for device in self.devices:
            if device.kind == "cpu" and not device.cores:
                raise ValueError(f"device {device.id}: a cpu device needs `cores`")
        used: dict[str, int] = {}
        instances: set[str] = set()
        ports: set[int] = set()
        for model in self.models:
            if model.port in ports:
                raise ValueError(f"models {model.name!r}: port {model.port} is used by another model")
            ports.add(model.port)
            for placement in model.placements:
                if placement.device not in devices:
                    raise ValueError(f"model {model.name!r}: unknown device {placement.device!r}")
                if placement.instance in instances:
                    raise ValueError(f"instance name {placement.instance!r} appears twice")
                instances.add(placement.instance)
                units = devices[placement.device].units
                if self.takes_turns(placement.device) and placement.share != units:
                    raise ValueError(
                        f"instance {placement.instance!r}: a device taken in turns gives every instance the whole "
                        f"device ({units} units), not {placement.share}"
                    )
                used[placement.device] = used.get(placement.device, 0) + placement.share
        for device_id, total in used.items():
            if not self.takes_turns(device_id) and total > devices[device_id].units:
                raise ValueError(f"device {device_id}: shares add up to {total} of {devices[device_id].units} units")
        return self

    def device(self, device_id: str) -> Device:
        return next(d for d in self.devices if d.id == device_id)

    def instances(self) -> list[tuple[PlannedModel, Placement]]:
        return [(m, p) for m in self.models for p in m.placements]


class LoadedPlan:
    """A plan together with the file it came from, so its relative paths can be resolved."""

    def __init__(self, plan: Plan, path: Path):
        self.plan = plan
        self.path = path.resolve()

    def resolve(self, relative: str) -> Path:
        return (self.path.parent / relative).resolve()

    @property
    def state_dir(self) -> Path:
        return self.resolve(self.plan.runtime.state_dir)


def relative_to(target: Path, base_dir: Path) -> str:
    return os.path.relpath(target.resolve(), base_dir.resolve())


class _PlanDumper(yaml.SafeDumper):
    """Writes short lists of numbers (tensor shapes) on one line."""


_PlanDumper.add_representer(
    list,
    lambda dumper, data: dumper.represent_sequence(
        "tag:yaml.org,2002:seq", data, flow_style=all(isinstance(x, (int, float)) for x in data)
    ),
)


def save_plan(plan: Plan, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(plan.model_dump(mode="json", exclude_none=True), Dumper=_PlanDumper, sort_keys=False, width=100)
    path.write_text("# tritonctl plan: generated; safe to read, diff and edit.\n" + text)


def load_plan(path: str | Path) -> LoadedPlan:
    """Read and validate a plan file; problems name the file and the field."""
    path = Path(path)
    return LoadedPlan(load_validated(path, Plan), path)

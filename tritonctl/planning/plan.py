"""The plan: where each model runs, with which share and batch size, as a readable YAML file.

A plan is the output of a policy and the input of render and apply. It carries everything
later stages need (several replicas per model, shares in device units, predictions per
placement), so a person can read it, diff it and hand-edit it. Paths inside a plan file
are relative to the plan file. A plan records which decisions its predictions were made for
(`predicted_for`), so that after a hand edit they are known to be stale.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tritonctl.errors import TritonctlError
from tritonctl.files import check_output_dir, load_validated
from tritonctl.shares import Turn, turn_layout
from tritonctl.spec import (
    MAX_BATCH,
    MAX_DIM,
    Dtype,
    Host,
    MemoryMb,
    Name,
    PathText,
    Port,
    Rate,
    SloMs,
    Text,
    TimeoutS,
    plain_text,
)

PLAN_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


Number = Annotated[float, Field(ge=0, le=1e9)]


def _dim(size: int) -> int:
    if size != -1 and not 1 <= size <= MAX_DIM:
        raise ValueError(f"a dimension is -1 (dynamic) or 1 to {MAX_DIM}")
    return size


class Device(_Strict):
    """One device: `units` of share to hand out, `cores` a CPU device's units stand for."""

    id: Name
    kind: Literal["gpu", "cpu"]
    index: Annotated[int, Field(ge=0, le=63)]
    memory_mb: MemoryMb
    units: Annotated[int, Field(ge=1, le=1000)]
    cores: Annotated[float, Field(gt=0, le=4096)] | None = None
    node: Name | None = None  # the machine it is on, where the cluster spans several (`index` counts per node)
    # A GPU's SM clock locked for the deployment (the energy objective's choice; None: the driver's own)
    clock_mhz: Annotated[int, Field(ge=100, le=5000)] | None = None
    # How instances taking turns with a CPU device share its cores and run on them (the cluster file's
    # devices[].turn_priority and turn_threads)
    turn_priority: Literal["slo", "equal"] = "slo"
    turn_threads: Literal["even", "lightest"] = "even"


class Tensor(_Strict):
    """A tensor of the model's signature as the ONNX file names it; `shape` without the batch (-1: dynamic)."""

    name: Annotated[str, Field(min_length=1, max_length=256), AfterValidator(plain_text)]
    dtype: Dtype
    shape: list[Annotated[int, AfterValidator(_dim)]] = Field(max_length=8)


class Prediction(_Strict):
    """What the fitted latency model expects of a placement (absent without one).

    exec_ms: one batch next to its co-runners; latency_ms: p99 task latency with queueing
    (InSS eq. 2) at the model's rate, None when that rate overloads the placement;
    meets_slo: that p99 is within the SLO; in_slo_rps: of the requests/s planned for this
    placement, how many are predicted to finish within the SLO (`queueing.goodput`; below the
    rate where the placement serves the model only in part).
    """

    exec_ms: Number
    latency_ms: Number | None = None
    throughput_rps: Number
    meets_slo: bool
    in_slo_rps: Number | None = None
    joules_per_request: Number | None = None  # the energy objective's estimate (GPU energy per image)


class Placement(_Strict):
    """One replica of a model: a Triton instance on `device` with `share` units of it.

    `weight`: the part of the model's traffic this replica is sized for, relative to the
    model's other replicas (equal unless a policy sizes replicas unequally).
    """

    instance: Name
    device: Name
    share: Annotated[int, Field(ge=1, le=1000)]
    batch: Annotated[int, Field(ge=1, le=MAX_BATCH)]
    queue_delay_us: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    weight: Annotated[float, Field(gt=0, le=1e6)] = 1.0
    predicted: Prediction | None = None


class PlannedModel(_Strict):
    name: Name
    onnx: PathText
    onnx_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{1,64}$")]
    # The torchvision architecture the ONNX file was exported from (None for a model given as an .onnx file): the
    # GPU glue builds it with PyTorch where Triton has no GPU backend for ONNX.
    source: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")] | None = None
    inputs: list[Tensor] = Field(min_length=1, max_length=64)
    outputs: list[Tensor] = Field(min_length=1, max_length=64)
    memory_mb: MemoryMb
    slo_ms: SloMs
    rate: Rate
    port: Port
    placements: list[Placement] = Field(min_length=1, max_length=1024)
    # What a seeded simulation of the whole plan at its rates finds for the model (`simulate.with_simulation`:
    # batch times drawn with their spread, wake-ups of idle instances, the co-runners busy at each batch): the
    # share of its requests answered within the SLO, and their p99 (None where more than 1% go unanswered).
    # Both absent from a plan made without a latency model or never simulated.
    simulated_in_slo: Annotated[float, Field(ge=0, le=1)] | None = None
    simulated_p99_ms: Number | None = None

    def rate_of(self, placement: Placement) -> float:
        """The arrival rate `placement` is planned for: the model's rate split by the replicas' weights."""
        return self.rate * placement.weight / sum(p.weight for p in self.placements)


class Unserved(_Strict):
    """A model of the cluster the plan does not serve, and why."""

    name: Name
    reason: Text


class RuntimeSettings(_Strict):
    repository_dir: PathText
    state_dir: PathText
    host: Host
    tritonserver: PathText | None = None
    startup_timeout_s: TimeoutS = 120.0
    reject_late: bool | Literal["always"] = True  # an overloaded CPU instance refuses what can only be late (glue)
    cpu_share: Literal["quota", "weight"] = "quota"  # how a CPU share is enforced (see the cluster file's runtime)
    gpu_backend: Literal["onnxruntime", "python"] = "onnxruntime"  # what serves a GPU instance (the same)


class Plan(_Strict):
    """`sharing`: spatial, each device split into shares that add up to at most its units (MPS,
    CPU quotas); temporal, every instance gets the whole device and instances on one device
    take turns (no spatial sharing, the baseline of InSS section 6). `turns`: the devices of a
    spatial plan that are shared in turns all the same (a policy may choose per device)."""

    version: Annotated[int, Field(ge=PLAN_VERSION, le=PLAN_VERSION)] = PLAN_VERSION
    cluster: Name
    cluster_file: PathText
    policy: Name
    objective: Literal["throughput", "energy"] = "throughput"
    # how its batches were sized (plan --batching): re-plans keep it
    batching: Literal["fill", "prompt", "eager"] = "fill"
    target: Literal["gpu", "cpu"]
    sharing: Literal["spatial", "temporal"] = "spatial"
    devices: list[Device] = Field(min_length=1, max_length=1024)
    models: list[PlannedModel] = Field(min_length=1, max_length=256)
    unserved: list[Unserved] = Field(default_factory=list, max_length=256)
    turns: list[Name] = Field(default_factory=list, max_length=1024)
    notes: list[Text] = Field(default_factory=list, max_length=64)  # what the policy said of its decision
    runtime: RuntimeSettings
    # The digest of the decisions (`decisions_digest`) its predictions and simulation were made for: a plan edited
    # since (a rate, an SLO, a share, a batch, a device ...) no longer matches it, and its predictions are stale.
    predicted_for: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")] | None = None

    def decisions_digest(self) -> str:
        """A digest of what the predictions depend on: the devices, how they are shared, every model's ONNX file,
        rate and SLO, its placements (less their predictions), whether late requests are refused and how a CPU share
        is enforced."""
        models = [
            {
                "name": m.name,
                "onnx": m.onnx_sha256,
                "rate": m.rate,
                "slo_ms": m.slo_ms,
                "placements": [p.model_dump(mode="json", exclude={"predicted"}) for p in m.placements],
            }
            for m in sorted(self.models, key=lambda m: m.name)  # their order is no decision
        ]
        decisions = {
            "devices": [d.model_dump(mode="json") for d in self.devices],
            "sharing": self.sharing,
            "turns": self.turns,
            "reject_late": self.runtime.reject_late,
            "cpu_share": self.runtime.cpu_share,
            "models": models,
        }
        return hashlib.sha256(json.dumps(decisions, sort_keys=True).encode()).hexdigest()[:16]

    def has_predictions(self) -> bool:
        return any(p.predicted for _, p in self.instances()) or any(m.simulated_in_slo is not None for m in self.models)

    def stamped(self) -> Plan:
        """The plan recording that its predictions describe its decisions as they are now."""
        return self.model_copy(update={"predicted_for": self.decisions_digest() if self.has_predictions() else None})

    def stale_predictions(self) -> bool:
        """Whether the plan was edited since its predictions were made: they describe other decisions."""
        return self.has_predictions() and self.predicted_for not in (None, self.decisions_digest())

    def takes_turns(self, device_id: str) -> bool:
        """Whether the instances on this device take turns with all of it (rather than splitting it)."""
        return self.sharing == "temporal" or device_id in self.turns

    def turn_layout(self) -> dict[str, Turn]:
        """How each instance taking turns with a device runs (`shares.turn_layout`): its threads, the share it runs
        like and its cgroup CPU weight."""
        out: dict[str, Turn] = {}
        for device in self.devices:
            if self.takes_turns(device.id):
                mates = [(m, p) for m, p in self.instances() if p.device == device.id]
                layout = turn_layout(device, [m.slo_ms for m, _ in mates])
                out.update((p.instance, turn) for (_, p), turn in zip(mates, layout, strict=True))
        return out

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        devices = {d.id: d for d in self.devices}
        if len(devices) < len(self.devices):
            raise ValueError("two devices have the same id")
        for device_id in self.turns:
            if device_id not in devices:
                raise ValueError(f"turns: unknown device {device_id!r}")
        for device in self.devices:
            if device.kind == "cpu" and not device.cores:
                raise ValueError(f"device {device.id}: a cpu device needs `cores`")
            if device.kind != self.target:
                raise ValueError(f"device {device.id} is a {device.kind} device; the plan's target is {self.target}")
        used: dict[str, int] = {}
        memory: dict[str, float] = {}  # MB the instances on each device need (every replica loads its model)
        instances: set[str] = set()
        ports: set[int] = set()
        names: set[str] = set()
        for model in self.models:
            if model.name.lower() in names:
                raise ValueError(f"model {model.name!r} appears twice")
            names.add(model.name.lower())
            if model.port in ports:
                raise ValueError(f"model {model.name!r}: port {model.port} is used by another model")
            ports.add(model.port)
            for placement in model.placements:
                if placement.device not in devices:
                    raise ValueError(f"model {model.name!r}: unknown device {placement.device!r}")
                if placement.instance in instances:
                    raise ValueError(f"instance name {placement.instance!r} appears twice")
                instances.add(placement.instance)
                units = devices[placement.device].units
                if placement.share > units:
                    raise ValueError(
                        f"instance {placement.instance!r}: share {placement.share} is more than device "
                        f"{placement.device}'s {units} units"
                    )
                if self.takes_turns(placement.device) and placement.share != units:
                    raise ValueError(
                        f"instance {placement.instance!r}: a device taken in turns gives every instance the whole "
                        f"device ({units} units), not {placement.share}"
                    )
                used[placement.device] = used.get(placement.device, 0) + placement.share
                memory[placement.device] = memory.get(placement.device, 0) + model.memory_mb
        for device_id, total in used.items():
            if not self.takes_turns(device_id) and total > devices[device_id].units:
                raise ValueError(f"device {device_id}: shares add up to {total} of {devices[device_id].units} units")
            if memory[device_id] > devices[device_id].memory_mb:
                raise ValueError(
                    f"device {device_id}: its instances need {memory[device_id]:g} MB of memory, it has "
                    f"{devices[device_id].memory_mb:g} MB"
                )
        return self

    def nodes(self) -> list[str]:
        """The nodes the plan's devices are on, in order ([] for a plan on one unnamed host)."""
        return list(dict.fromkeys(d.node for d in self.devices if d.node is not None))

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
    check_output_dir(path.parent, file=path, field=None, writable=True)
    if path.is_dir():
        raise TritonctlError("is a folder, not a plan file", file=path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(plan.model_dump(mode="json", exclude_none=True), Dumper=_PlanDumper, sort_keys=False, width=100)
    path.write_text("# tritonctl plan: generated; safe to read, diff and edit.\n" + text)


def _a_cluster(raw: dict) -> str | None:
    """What to say of a cluster file given where a plan is expected."""
    if "name" in raw and "cluster" not in raw:
        return "this is a cluster file, not a plan: make a plan from it with `tritonctl plan` first"
    return None


def load_plan(path: str | Path) -> LoadedPlan:
    """Read and validate a plan file; problems name the file and the field."""
    path = Path(path)
    loaded = LoadedPlan(load_validated(path, Plan, _a_cluster), path)
    for field in ("repository_dir", "state_dir"):
        check_output_dir(loaded.resolve(getattr(loaded.plan.runtime, field)), file=path, field=f"runtime.{field}")
    return loaded

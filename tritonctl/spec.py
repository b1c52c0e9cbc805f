"""cluster.yaml: the devices, models, SLOs and rates a deployment is planned for.

Relative paths in a cluster file are resolved against the file's own folder, as
Docker Compose does, so a cluster file means the same thing from any working directory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from tritonctl.errors import TritonctlError
from tritonctl.files import check_output_dir, load_validated

# Triton takes a model name as a directory name and as a URL path segment (match with fullmatch).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
ARCHITECTURE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")  # a torchvision model builder's name
HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}|[0-9A-Fa-f:.]{2,45}")  # a host name, IPv4 or IPv6 address
MAX_BATCH = 32  # the largest batch tritonctl plans, profiles and serves (InSS Algorithm 1 searches 1..32)
MAX_DIM = 1 << 20  # one dimension of a tensor
MAX_ELEMENTS = 1 << 26  # elements of one sample of an input (256 MiB of float32)
Dtype = Literal["float32", "float16", "int64", "int32", "uint8"]  # the keys of DTYPES
DTYPES = {  # numpy dtype name -> Triton data type
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
    "uint8": "TYPE_UINT8",
}
ZERO_INPUTS = frozenset({"int64", "int32"})  # integer inputs are indices: requests and warm-ups send zeros


def triton_name(name: str) -> str:
    """`name` if Triton accepts it as a model (or instance, cluster, device) name; ValueError if not."""
    if not MODEL_NAME.fullmatch(name):
        raise ValueError(
            "not a name Triton accepts: 1-64 letters, digits, '_', '.', '-', starting with a letter or digit"
        )
    return name


def plain_text(text: str) -> str:
    """`text` if it has no control characters (no line breaks, no NUL); ValueError if it has."""
    if not text.isprintable():
        raise ValueError("has control characters (a line break, a tab, NUL ...)")
    return text


def host_name(host: str) -> str:
    if not HOST.fullmatch(host):
        raise ValueError("not a host name or IP address")
    return host


Name = Annotated[str, AfterValidator(triton_name)]
MODEL_NAME_CHARS = 60  # a model's instances are named after it with "-N" added, and must stay Triton names


def model_name(name: str) -> str:
    """A cluster's model name: a Triton name short enough to name its instances too; ValueError if not."""
    if len(name) > MODEL_NAME_CHARS:
        raise ValueError(f"{len(name)} characters: at most {MODEL_NAME_CHARS} (its instances add '-N' to it)")
    return name


ModelName = Annotated[Name, AfterValidator(model_name)]
Text = Annotated[str, Field(max_length=4096), AfterValidator(plain_text)]
PathText = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(plain_text)]
Host = Annotated[str, AfterValidator(host_name)]
SloMs = Annotated[float, Field(gt=0, le=3_600_000, allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False)]
MemoryMb = Annotated[int, Field(gt=0, le=1 << 24)]
Port = Annotated[int, Field(ge=1024, le=65535)]
TimeoutS = Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class DeviceGroup(_Strict):
    """`count` identical devices. `units` is the share granularity (100 = MPS percent).

    `reserved_cores` (CPU only) are kept for everything that is not inference: the proxy, the
    Triton processes' own threads, load generators, the system. The planner hands out only the
    units of the remaining cores; the profiler never measures beyond them.

    `turn_priority` (CPU only): how instances taking turns with a device share its cores when more are busy
    than it holds: `slo`, the tighter a model's SLO the higher its priority rank, each rank running on what
    the higher ones leave (deadline-monotonic, `shares.turn_ranks`), or `equal`, alike (what a hand-written
    deployment gets). Unset, it is `slo`, and `plan --policy search` with a latency model takes `equal` for
    every CPU group that leaves it so where the ranked plan is simulated short of an SLO and the alike one
    is not (`planner.simulated_plan`).

    `turn_threads` (CPU only): the onnxruntime threads of instances taking turns with a device: `even`, cores /
    instances each (one at least), or `lightest`, the same but the one instance of the lowest rank under
    `turn_priority: slo` on a thread per core (`shares.turn_layout`): it takes only the cores the higher ranks
    leave, so a long batch of a loose SLO runs on every core while they are idle; they may start a little later
    when they wake beside it (the kernel's preemption). Unset, `plan --policy search` with a latency model chooses
    one setting for every CPU group that leaves it so (`planner.simulated_plan`): `even`, or `lightest` where that
    plan is predicted to serve more in time; other plans take `even`.
    """

    kind: Literal["gpu", "cpu"]
    count: Annotated[int, Field(ge=1, le=64)] = 1
    memory_mb: Annotated[int, Field(gt=0)]
    # The machine these devices are on (its Kubernetes node name): a cluster across several nodes names the node
    # of every group, and its devices are numbered per node; a cluster on one host names none.
    node: Annotated[Name, Field(max_length=48)] | None = None
    units: Annotated[int, Field(ge=1, le=1000)] = 100
    cores: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    reserved_cores: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    turn_priority: Literal["slo", "equal"] = "slo"
    turn_threads: Literal["even", "lightest"] | None = None

    @property
    def priority_open(self) -> bool:
        """Whether the group leaves `turn_priority` to the planner: a CPU group that does not set it, nor
        `turn_threads: lightest` (which goes by the ranks)."""
        return self.kind == "cpu" and "turn_priority" not in self.model_fields_set and self.turn_threads != "lightest"

    @property
    def threads_open(self) -> bool:
        """Whether the group leaves `turn_threads` to the planner: a CPU group ranked by SLO that does not set it
        (under `turn_priority: equal` there is no lowest rank, and the threads are `even`)."""
        return self.kind == "cpu" and self.turn_threads is None and self.turn_priority == "slo"

    @model_validator(mode="after")
    def _cores_for_cpu(self) -> DeviceGroup:
        if self.kind == "cpu" and self.cores is None:
            raise ValueError("a cpu device needs `cores`: how many cores its `units` stand for")
        if self.kind == "gpu" and self.cores is not None:
            raise ValueError("`cores` is for cpu devices only")
        if self.kind == "gpu" and self.reserved_cores:
            raise ValueError("`reserved_cores` is for cpu devices only")
        if self.kind == "gpu" and self.turn_priority != "slo":
            raise ValueError("`turn_priority` is for cpu devices only (a GPU's turns run one after another)")
        if self.kind == "gpu" and self.turn_threads not in (None, "even"):
            raise ValueError("`turn_threads` is for cpu devices only")
        if self.turn_threads == "lightest" and self.turn_priority != "slo":
            raise ValueError("`turn_threads: lightest` needs `turn_priority: slo` (the lowest rank goes by its SLO)")
        if self.kind == "cpu" and self.usable_units < 1:
            raise ValueError(
                f"reserved_cores {self.reserved_cores:g} of {self.cores:g} cores leaves nothing to plan with: "
                f"keep it below {self.cores:g} (each of the {self.units} units is {self.cores / self.units:g} cores)"
            )
        return self

    @property
    def usable_units(self) -> int:
        """The units the planner may hand out: all of them less those of the reserved cores."""
        if self.kind != "cpu" or not self.reserved_cores:
            return self.units
        return math.floor(self.units * (self.cores - self.reserved_cores) / self.cores + 1e-9)


class TensorSpec(_Strict):
    """One input tensor, without the batch dimension."""

    shape: list[Annotated[int, Field(ge=1, le=MAX_DIM)]] = Field(min_length=1, max_length=8)
    dtype: Dtype = "float32"

    @model_validator(mode="after")
    def _size(self) -> TensorSpec:
        if math.prod(self.shape) > MAX_ELEMENTS:
            raise ValueError(f"shape {self.shape} has more than {MAX_ELEMENTS} elements per sample")
        return self


class ModelSpec(_Strict):
    """A model to serve: where it comes from, its input, its SLO and expected load."""

    name: ModelName
    source: PathText
    input: TensorSpec
    slo_ms: SloMs
    rate: Rate
    memory_mb: MemoryMb | None = None

    @field_validator("source")
    @classmethod
    def _source(cls, source: str) -> str:
        if source.lower().endswith(".onnx") and not source.endswith(".onnx"):
            raise ValueError("an ONNX file's name ends in .onnx, in lower case")
        if not source.endswith(".onnx") and not ARCHITECTURE.fullmatch(source):
            raise ValueError("neither an .onnx path nor a torchvision architecture name (letters, digits, '_')")
        return source

    @model_validator(mode="after")
    def _image_bytes(self) -> ModelSpec:
        shape = self.input.shape
        if not self.is_onnx_file and self.input.dtype == "uint8" and (len(shape) != 3 or shape[0] != 3):
            raise ValueError(f"input uint8 of a torchvision model is an RGB image of shape [3, H, W], not {shape}")
        return self

    @property
    def is_onnx_file(self) -> bool:
        return self.source.endswith(".onnx")


class RuntimeSpec(_Strict):
    """Where generated files go and which ports the deployment uses."""

    repository_dir: PathText = "model_repository"
    state_dir: PathText = ".tritonctl"
    export_dir: PathText = "model_repository/exports"
    host: Host = "127.0.0.1"
    base_port: Annotated[int, Field(ge=1024, le=65000)] = 8100
    tritonserver: PathText | None = None
    startup_timeout_s: TimeoutS = 120.0
    # While an instance is overloaded (5 of its last 100 requests could only be late), refuse a request that can
    # no longer be answered within its SLO when its batch starts, before running it, rather than serve it late and
    # make the requests behind it late (CPU instances: the model's glue, by the arrival HAProxy stamps): goodput
    # holds beyond capacity instead of collapsing into queues of seconds. A refused request is an error to its
    # client; below capacity none is refused. `always`: every request that can only be late is refused,
    # overloaded or not; `false` serves every request, however late (docs/real-load.md).
    reject_late: bool | Literal["always"] = True
    # How a CPU share is enforced: `weight`, a cgroup CPU weight in proportion to the share (work-conserving: an
    # instance gets at least its share when every instance is busy, and idle cores when others are not), or
    # `quota`, a CFS quota of exactly the share (never more, even on an idle machine; what profiles measure).
    cpu_share: Literal["quota", "weight"] = "quota"
    # What serves a GPU instance: Triton's `onnxruntime` backend over the exported file (the NGC images that Compose
    # and Kubernetes deployments run), or the `python` backend with tritonctl's GPU glue (PyTorch CUDA graphs, or
    # onnxruntime-gpu), for a Triton with only the Python backend. The local runtime picks `python` itself where its
    # tritonserver has no onnxruntime backend.
    gpu_backend: Literal["onnxruntime", "python"] = "onnxruntime"

    def folders(self) -> dict[str, str]:
        """The folders tritonctl writes into, by field name."""
        return {"repository_dir": self.repository_dir, "state_dir": self.state_dir, "export_dir": self.export_dir}


class ClusterSpec(_Strict):
    name: Name
    devices: list[DeviceGroup] = Field(min_length=1, max_length=64)
    models: list[ModelSpec] = Field(min_length=1, max_length=256)
    runtime: RuntimeSpec = RuntimeSpec()


class Cluster:
    """A validated cluster file with its paths resolved against the file's folder."""

    def __init__(self, spec: ClusterSpec, path: Path):
        self.spec = spec
        self.path = path

    def resolve(self, relative: str) -> Path:
        return (self.path.parent / relative).resolve()

    def with_rates(self, rate: Callable[[ModelSpec], float]) -> Cluster:
        """The same cluster (file and paths) with every model's rate replaced by `rate(model)`."""
        models = [m.model_copy(update={"rate": rate(m)}) for m in self.spec.models]
        return Cluster(self.spec.model_copy(update={"models": models}), self.path)

    def with_runtime(self, **changes) -> Cluster:
        """The same cluster with these runtime settings changed (own ports, state folder ...)."""
        runtime = self.spec.runtime.model_copy(update=changes)
        return Cluster(self.spec.model_copy(update={"runtime": runtime}), self.path)

    def open_turn_threads(self) -> bool:
        """Whether a device group leaves `turn_threads` to the planner (`DeviceGroup.threads_open`)."""
        return any(d.threads_open for d in self.spec.devices)

    def open_turn_priority(self) -> bool:
        """Whether a device group leaves `turn_priority` to the planner (`DeviceGroup.priority_open`)."""
        return any(d.priority_open for d in self.spec.devices)

    def with_turn_priority(self, priority: str) -> Cluster:
        """The same cluster with `turn_priority: priority` on every device group that leaves it to the planner."""
        return self._with_open({"turn_priority": priority}, lambda d: d.priority_open)

    def with_turn_threads(self, threads: str) -> Cluster:
        """The same cluster with `turn_threads: threads` on every device group that leaves it to the planner."""
        return self._with_open({"turn_threads": threads}, lambda d: d.threads_open)

    def _with_open(self, update: dict, is_open: Callable[[DeviceGroup], bool]) -> Cluster:
        """The same cluster with `update` on every device group `is_open` says leaves it to the planner."""
        devices = [d.model_copy(update=update) if is_open(d) else d for d in self.spec.devices]
        return Cluster(self.spec.model_copy(update={"devices": devices}), self.path)

    def reserving(self, cores: float = 0.0, part: float = 0.0) -> Cluster:
        """The same cluster with `cores` and `part` of its cores more reserved on every CPU device (validated:
        something must be left, else pydantic's ValidationError)."""
        devices = [
            DeviceGroup.model_validate({**d.model_dump(), "reserved_cores": d.reserved_cores + cores + part * d.cores})
            if d.kind == "cpu"
            else d
            for d in self.spec.devices
        ]
        return Cluster(self.spec.model_copy(update={"devices": devices}), self.path)

    @property
    def kind(self) -> str:
        return self.spec.devices[0].kind


def _a_plan(raw: dict) -> str | None:
    """What to say of a plan given where a cluster file is expected."""
    if "cluster" in raw and "name" not in raw:
        made = f" (made from {raw['cluster_file']})" if isinstance(raw.get("cluster_file"), str) else ""
        return f"this is a plan{made}, not a cluster file: give the cluster file"
    return None


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster file; every problem names the file and the field."""
    path = Path(path)
    spec = load_validated(path, ClusterSpec, _a_plan)
    cluster = Cluster(spec, path.resolve())
    if len({group.kind for group in spec.devices}) > 1:
        raise TritonctlError("mixing gpu and cpu devices in one cluster is not supported", file=path, field="devices")
    named = [group.node is not None for group in spec.devices]
    if any(named) and not all(named):
        i = named.index(False)
        raise TritonctlError(
            "some device groups name their node and this one does not: name the node of every group, or of none",
            file=path,
            field=f"devices[{i}].node",
        )
    for name, folder in spec.runtime.folders().items():
        check_output_dir(cluster.resolve(folder), file=path, field=f"runtime.{name}")
    seen: dict[str, str] = {}
    for i, model in enumerate(spec.models):
        if (other := seen.get(model.name.lower())) is not None:
            case = "" if other == model.name else f" ({other!r} differs only in case, and names are folders)"
            raise TritonctlError(f"duplicate model name {model.name!r}{case}", file=path, field=f"models[{i}].name")
        seen[model.name.lower()] = model.name
        where = cluster.resolve(model.source)
        if model.is_onnx_file and not where.is_file():
            message = f"{where} is a folder, not an ONNX file" if where.is_dir() else f"ONNX file not found: {where}"
            raise TritonctlError(message, file=path, field=f"models[{i}].source")
    return cluster

"""Render a plan into one Triton model repository and launch settings per instance.

Layout, under the plan's repository_dir:

    <instance>/launch.json                 the instance's share and ports (read by runtimes)
    <instance>/models/<model>/config.pbtxt
    <instance>/models/<model>/1/model.onnx (a hard link to the exported file where possible)
    <instance>/models/<model>/1/model.py   (Python-backend glue: onnxruntime on the CPU; PyTorch CUDA graphs or
                                            onnxruntime-gpu on a GPU)

Rendering is deterministic: the same plan gives the same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tritonctl.errors import TritonctlError
from tritonctl.export import TensorSig, inspect_onnx
from tritonctl.files import check_output_dir, sha256_unchanged, write_text_atomic
from tritonctl.planning.plan import Device, LoadedPlan, Placement, PlannedModel, Tensor
from tritonctl.shares import CFS_PERIOD_US, MIN_QUOTA_US, cpu_cores, cpu_weight, threads_for
from tritonctl.spec import DTYPES, ZERO_INPUTS

# Batches Triton runs at load (model_warmup) before it reports the model ready: the first
# runs of an onnxruntime session are slower (allocations, kernel selection), and a swap
# must not hand traffic to an instance that has not paid for them yet.
WARMUP_COUNT = 3

MODEL_VERSION = "1"  # every rendered model repository holds one version of its model


@dataclass(frozen=True)
class Launch:
    """How to start one instance: what a runtime needs beyond the model repository."""

    instance: str
    model: str
    device: str
    kind: str
    share: int
    units: int
    grpc_port: int
    env: dict[str, str]
    cpu_quota_us: int | None
    cpu_period_us: int | None
    cpu_weight: int | None  # a cgroup CPU weight (1-10000, cgroup v2's scale): with a quota, or instead of one
    cpu_rank: int | None  # taking turns with a CPU: its priority rank (`shares.turn_ranks`)
    config_hash: str  # everything about the instance: any change needs at least a reload
    process_hash: str  # what the process is started with: a change needs a new process (a swap)


GLUE = {"cpu": "python_onnx_model.py", "gpu": "python_torch_gpu_model.py"}  # each device kind's model.py


@functools.cache
def python_glue(kind: str = "cpu") -> str:
    """The Python-backend model.py of instances on a device of `kind`, read once."""
    return (resources.files("tritonctl.templates") / GLUE[kind]).read_text()


def render_config(
    cluster: str,
    model: PlannedModel,
    placement: Placement,
    device: Device,
    reject_late: bool | Literal["always"] = False,
    threads: int | None = None,
    gpu_backend: str = "onnxruntime",
) -> str:
    """The instance's config.pbtxt, built as Triton's ModelConfig message and written by protobuf (so
    every name is escaped and no field can be misspelled). `threads`: a CPU instance's onnxruntime
    threads where not those of its share (instances taking turns); `gpu_backend`: what serves a GPU instance."""
    config = mc.ModelConfig(
        name=model.name,
        backend=gpu_backend if device.kind == "gpu" else "python",
        max_batch_size=placement.batch,
    )
    for tensors, tensor_list in ((model.inputs, config.input), (model.outputs, config.output)):
        for t in tensors:
            tensor_list.add(name=t.name, data_type=mc.DataType.Value(DTYPES[t.dtype]), dims=t.shape)
    batching = config.dynamic_batching
    batching.preferred_batch_size.append(placement.batch)
    batching.max_queue_delay_microseconds = placement.queue_delay_us
    group = config.instance_group.add(count=1)
    if device.kind == "gpu":
        group.kind = mc.ModelInstanceGroup.KIND_GPU
        group.gpus.append(0)  # the one GPU CUDA_VISIBLE_DEVICES leaves the instance
        # the glue builds it with PyTorch (python_torch_gpu_model.py); a uint8 image's scaling is in the ONNX graph only
        if gpu_backend == "python" and model.source and model.inputs[0].dtype != "uint8":
            config.parameters["torchvision_source"].string_value = model.source
    else:
        group.kind = mc.ModelInstanceGroup.KIND_CPU
        config.parameters["intra_op_threads"].string_value = str(threads or threads_for(device, placement.share))
        if reject_late:  # the Python-backend glue refuses what can only be late (templates/python_onnx_model.py)
            config.parameters["reject_late_slo_ms"].string_value = f"{model.slo_ms:g}"
        if reject_late == "always":  # whether the instance is overloaded or not
            config.parameters["reject_late_always"].string_value = "1"
    warmup = config.model_warmup.add(name="tritonctl-warmup", batch_size=placement.batch, count=WARMUP_COUNT)
    for t in model.inputs:  # as the load generator's requests (`client.random_input`): zeros index any table
        data = {"zero_data": True} if t.dtype in ZERO_INPUTS else {"random_data": True}
        warmup.inputs[t.name].CopyFrom(
            mc.ModelWarmup.Input(data_type=mc.DataType.Value(DTYPES[t.dtype]), dims=t.shape, **data)
        )
    head = f"# Rendered by tritonctl for instance {placement.instance} of plan {cluster}: do not edit, re-render.\n"
    return head + text_format.MessageToString(config)


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def ort_spinning() -> str:
    """Whether the rendered CPU instances' onnxruntime threads spin ("1") or not ("0", the default): the
    environment's TRITONCTL_ORT_SPINNING, see templates/python_onnx_model.py."""
    return "1" if os.environ.get("TRITONCTL_ORT_SPINNING", "0") == "1" else "0"


def launch_for(
    cluster: str,
    model: PlannedModel,
    placement: Placement,
    device: Device,
    config: str,
    cpu_share: str = "quota",
    threads: int | None = None,
    gpu_backend: str = "onnxruntime",
    rank: int | None = None,
    whole_gpu: bool = False,
    host: str | None = None,
) -> Launch:
    """How the instance's process is started. `rank`: the priority rank of an instance taking turns with a CPU
    (`shares.turn_ranks`), beside its quota. `whole_gpu`: it takes turns with the whole GPU, as a process of its
    own (no MPS: no active thread percentage). `host`: the address its ports listen on (the plan's runtime.host)."""
    env: dict[str, str] = {}
    quota = period = weight = None
    if device.kind == "gpu" and whole_gpu:
        env = {"CUDA_VISIBLE_DEVICES": str(device.index)}
    elif device.kind == "gpu":
        percent = round(100 * placement.share / device.units)
        if not 1 <= percent <= 100:
            raise TritonctlError(
                f"share {placement.share} of {device.units} units is an MPS active thread percentage of {percent}; "
                "MPS takes 1-100",
                field=f"models.{model.name}.placements[{model.placements.index(placement)}].share",
            )
        env = {"CUDA_VISIBLE_DEVICES": str(device.index), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)}
    else:
        env = {"TRITONCTL_ORT_SPINNING": ort_spinning()}  # in the process hash: a change restarts the instance
        period = CFS_PERIOD_US
        quota = round(cpu_cores(device, placement.share) * period)
        if quota < MIN_QUOTA_US:
            raise TritonctlError(
                f"{placement.instance}: share {placement.share} of {device.units} units is "
                f"{cpu_cores(device, placement.share):.3f} cores; the kernel's smallest CPU quota is "
                f"{MIN_QUOTA_US / period:g} core",
                field=f"models.{model.name}.placements",
            )
        if cpu_share == "weight":
            quota = period = None
            weight = cpu_weight(device, placement.share)
    # What the process is started with. Batch size, queue delay and refusing late requests are left out (the
    # config rendered at batch 1, without delay or refusal): Triton reloads a model with them changed in place.
    batchless = render_config(
        cluster,
        model,
        placement.model_copy(update={"batch": 1, "queue_delay_us": 0}),
        device,
        threads=threads,
        gpu_backend=gpu_backend,
    )
    # The model's port is HAProxy's, not the process's: a change of it moves the address, not the instance.
    process = [batchless, model.onnx_sha256, placement.share, placement.device, env, quota, period, host]
    if weight is not None:
        process.append(weight)
    if rank is not None:
        process.append({"rank": rank})
    return Launch(
        instance=placement.instance,
        model=model.name,
        device=device.id,
        kind=device.kind,
        share=placement.share,
        units=device.units,
        grpc_port=model.port,
        env=env,
        cpu_quota_us=quota,
        cpu_period_us=period,
        cpu_weight=weight,
        cpu_rank=rank,
        config_hash=_digest(config, process),
        process_hash=_digest(process),
    )


def place_file(source: Path, dest: Path) -> None:
    """Hard-link (or copy across file systems) `source` to `dest` unless it is already there."""
    if dest.exists() and os.path.samefile(source, dest):
        return
    dest.unlink(missing_ok=True)
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)


def _write(path: Path, text: str) -> None:
    """Replace the file (a new inode, so a snapshot's hard link keeps the old text) unless it already holds `text`."""
    if not path.exists() or path.read_text() != text:
        write_text_atomic(path, text)


def render_instance(
    folder: Path,
    cluster: str,
    model: PlannedModel,
    placement: Placement,
    device: Device,
    onnx_path: Path,
    write: bool = True,
    reject_late: bool | Literal["always"] = False,
    cpu_share: str = "quota",
    threads: int | None = None,
    gpu_backend: str = "onnxruntime",
    rank: int | None = None,
    whole_gpu: bool = False,
    host: str | None = None,
) -> Launch:
    """Write one instance's model repository and launch.json into `folder` (only compute them if not `write`)."""
    config = render_config(cluster, model, placement, device, reject_late, threads, gpu_backend)
    launch = launch_for(
        cluster, model, placement, device, config, cpu_share, threads, gpu_backend, rank, whole_gpu, host
    )
    if not write:
        return launch
    version_dir = folder / "models" / model.name / MODEL_VERSION
    version_dir.mkdir(parents=True, exist_ok=True)
    _write(folder / "models" / model.name / "config.pbtxt", config)
    place_file(onnx_path, version_dir / "model.onnx")
    if device.kind == "cpu" or gpu_backend == "python":
        _write(version_dir / "model.py", python_glue(device.kind))
    _write(folder / "launch.json", json.dumps(launch.__dict__, indent=2, sort_keys=True) + "\n")
    return launch


def disagreement(kind: str, planned: list[Tensor], graph: tuple[TensorSig, ...]) -> str | None:
    """How the plan's tensors of one `kind` ("input", "output") differ from the ONNX graph's (None: they agree; a
    dimension the graph leaves dynamic may be any size)."""
    if len(planned) != len(graph):
        return f"the plan lists {len(planned)} {kind}(s), the ONNX graph has {len(graph)}"
    for tensor, sig in zip(planned, graph, strict=True):
        same_shape = len(tensor.shape) == len(sig.shape) and all(
            g == -1 or g == d for d, g in zip(tensor.shape, sig.shape, strict=True)
        )
        if tensor.name != sig.name or tensor.dtype != sig.dtype or not same_shape:
            return (
                f"{kind} {tensor.name!r} {tensor.dtype}{tensor.shape} is not the ONNX graph's "
                f"{sig.name!r} {sig.dtype}{list(sig.shape)}"
            )
    return None


def verified_onnx(loaded: LoadedPlan, model: PlannedModel) -> Path:
    """The model's ONNX file, refused unless it is a file whose SHA-256 is the plan's `onnx_sha256` and whose
    inputs and outputs are the plan's."""
    path = loaded.resolve(model.onnx)
    field = f"models.{model.name}.onnx"
    if not path.is_file():
        raise TritonctlError(f"ONNX file not found: {path}", file=loaded.path, field=field)
    if sha256_unchanged(path) != model.onnx_sha256:
        raise TritonctlError(
            f"{path} is not the file the plan was made for: its SHA-256 differs from onnx_sha256 "
            "(plan again, or restore the file)",
            file=loaded.path,
            field=field,
        )
    artifact = inspect_onnx(path)
    for kind, planned, graph in (("input", model.inputs, artifact.inputs), ("output", model.outputs, artifact.outputs)):
        if (differs := disagreement(kind, planned, graph)) is not None:
            raise TritonctlError(f"{differs} (plan again)", file=loaded.path, field=f"models.{model.name}.{kind}s")
    return path


def render(loaded: LoadedPlan, write: bool = True) -> dict[str, tuple[Path, Launch]]:
    """Render every instance of the plan; returns instance name -> (folder, launch settings).

    Everything is checked (ONNX files and their hashes, every instance's settings) before the first file is written.
    """
    plan = loaded.plan
    out_root = loaded.resolve(plan.runtime.repository_dir)
    onnx = {model.name: verified_onnx(loaded, model) for model in plan.models}

    def instance(model: PlannedModel, placement: Placement, write: bool) -> Launch:
        device = plan.device(placement.device)
        folder = out_root / placement.instance
        turn = in_turns.get(placement.instance)
        return render_instance(
            folder,
            plan.cluster,
            model,
            placement,
            device,
            onnx[model.name],
            write,
            reject_late,
            plan.runtime.cpu_share,
            turn.threads if turn and device.kind == "cpu" else None,
            plan.runtime.gpu_backend,
            turn.rank if turn else None,
            turn is not None and device.kind == "gpu",
            plan.runtime.host,
        )

    reject_late = plan.runtime.reject_late
    in_turns = plan.turn_layout()
    rendered: dict[str, tuple[Path, Launch]] = {}
    for model, placement in plan.instances():
        try:
            rendered[placement.instance] = (out_root / placement.instance, instance(model, placement, False))
        except TritonctlError as exc:
            raise TritonctlError(exc.message, file=loaded.path, field=exc.field) from None
    if write:
        check_output_dir(out_root, file=loaded.path, field="runtime.repository_dir", writable=True)
        for model, placement in plan.instances():
            try:
                instance(model, placement, True)
            except OSError as exc:
                raise TritonctlError(
                    f"cannot write {exc.filename or out_root}: {exc.strerror or exc}",
                    file=loaded.path,
                    field="runtime.repository_dir",
                ) from None
    return rendered

"""Model artifacts: torchvision architectures exported to ONNX, and ONNX files inspected.

Exports use seeded random weights (no model hub is reachable) and a dynamic batch
dimension. They are cached under a key made of everything that determines the file's
content (architecture, input, opset, seed, torch and torchvision versions), so a repeated
run finds the file and returns at once.

A torchvision model whose input the cluster declares `uint8` takes images as bytes: 3 x H x W
values 0-255, which the exported graph scales to [0, 1] and normalises with the ImageNet mean
and standard deviation that torchvision's classifiers are trained with. A request then carries a
quarter of the bytes of the same image in float32, which every hop (client, proxy, Triton, the
Python backend's copy) pays for.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from tritonctl.errors import TritonctlError
from tritonctl.files import check_output_dir, excerpt, file_identity, sha256_unchanged
from tritonctl.spec import DTYPES, MAX_DIM, Cluster, ModelSpec, plain_text

OPSET = 17
SEED = 0
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # per RGB channel, of images scaled to [0, 1]
IMAGENET_STD = (0.229, 0.224, 0.225)
_ONNX_DTYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.UINT8: "uint8",
}


@dataclass(frozen=True)
class TensorSig:
    """A tensor of the model's signature; `shape` leaves out the batch dimension."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Artifact:
    """An ONNX file ready to serve, with what the planner and renderer need from it."""

    path: Path
    sha256: str
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    weights_mb: float


def _sig(value: onnx.ValueInfoProto) -> tuple[TensorSig, bool]:
    """The signature of a graph input/output and whether its first dimension is dynamic."""
    tensor = value.type.tensor_type
    dims = list(tensor.shape.dim)
    dynamic_batch = bool(dims) and not dims[0].HasField("dim_value")
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims[1:])
    dtype = _ONNX_DTYPES.get(tensor.elem_type, f"onnx-type-{tensor.elem_type}")
    return TensorSig(value.name, dtype, shape), dynamic_batch


def _check_sig(sig: TensorSig, path: Path) -> None:
    """Refuse a tensor whose name or dimensions a Triton model configuration cannot take."""
    try:
        if not 1 <= len(sig.name) <= 256:
            raise ValueError("must have 1-256 characters")
        plain_text(sig.name)
    except ValueError as exc:
        raise TritonctlError(f"tensor name {excerpt(sig.name)} {exc}", file=path) from None
    if len(sig.shape) > 8 or not all(d == -1 or 0 < d <= MAX_DIM for d in sig.shape):
        raise TritonctlError(f"tensor {sig.name!r} has shape {excerpt(list(sig.shape))}", file=path)


def inspect_onnx(path: Path) -> Artifact:
    """Read an ONNX file's signature and weight size; refuse one without a dynamic batch. Cached while the file's
    device, inode, size and modification time stay the same: a controller re-plans with the same files, and
    parsing and hashing them (tens of MB each) would otherwise take most of a re-plan on a busy CPU."""
    try:
        identity = file_identity(path)
    except OSError as exc:
        raise TritonctlError(f"not a readable ONNX model ({type(exc).__name__}: {exc})", file=path) from None
    if identity[2] == 0:  # its size
        raise TritonctlError("not an ONNX model: the file is empty", file=path)
    return _inspected(path, *identity)


@functools.lru_cache(maxsize=256)
def _inspected(path: Path, *identity: int) -> Artifact:
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError and more for bad files
        raise TritonctlError(f"not a readable ONNX model ({type(exc).__name__}: {exc})", file=path) from None
    graph = model.graph
    weight_names = {init.name for init in graph.initializer}
    inputs, outputs = [], []
    for values, out in ((graph.input, inputs), (graph.output, outputs)):
        for value in values:
            if value.name in weight_names:
                continue
            sig, dynamic = _sig(value)
            _check_sig(sig, path)
            if not dynamic:
                raise TritonctlError(
                    f"tensor {value.name!r} has no dynamic batch dimension (its first dimension is fixed)", file=path
                )
            out.append(sig)
    if not inputs or not outputs:
        raise TritonctlError("the graph has no inputs or no outputs", file=path)
    weights = sum(len(init.raw_data) or 4 * len(init.float_data) for init in graph.initializer)
    return Artifact(path, sha256_unchanged(path), tuple(inputs), tuple(outputs), weights / 2**20)


def export_key(model: ModelSpec, torch_version: str, torchvision_version: str) -> str:
    recipe = {
        "arch": model.source,
        "shape": model.input.shape,
        "dtype": model.input.dtype,
        "opset": OPSET,
        "seed": SEED,
        "torch": torch_version,
        "torchvision": torchvision_version,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def check_architecture(source: str, *, file: str | Path | None = None, field: str | None = None) -> None:
    """Refuse a `source` torchvision does not know (nothing is said where torchvision is not installed: the export
    says that)."""
    try:
        import torchvision
    except ImportError:
        return
    available = torchvision.models.list_models()
    if source not in available:
        raise TritonctlError(
            f"{source!r} is neither an .onnx path nor a torchvision architecture "
            f"(for example: {', '.join(sorted(available)[:6])}, ...)",
            file=file,
            field=field,
        )


def export_torchvision(model: ModelSpec, out_dir: Path) -> tuple[Path, bool]:
    """Export `model.source` (a torchvision architecture) to ONNX; returns (path, was_cached)."""
    try:
        import torch
        import torchvision
    except ImportError:
        raise TritonctlError(
            "exporting torchvision models needs torch and torchvision: "
            "pip install -e '.[export]' (or give an .onnx path)"
        ) from None

    key = export_key(model, torch.__version__, torchvision.__version__)
    path = out_dir / f"{model.source}-{key}.onnx"
    if path.is_file():
        return path, True
    check_architecture(model.source)
    torch.manual_seed(SEED)
    # random weights throughout: a detection or segmentation builder would fetch its backbone's pretrained ones
    builder = torchvision.models.get_model_builder(model.source)
    backbone = {"weights_backbone": None} if "weights_backbone" in inspect.signature(builder).parameters else {}
    with warnings.catch_warnings():  # e.g. GoogLeNet's notice that its default initialisation will change
        warnings.simplefilter("ignore", FutureWarning)
        net = builder(weights=None, **backbone).eval()
    if model.input.dtype == "uint8":
        net = _image_bytes(net)
    dtype = getattr(torch, model.input.dtype)
    dummy = torch.zeros((1, *model.input.shape), dtype=dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:  # the tracer's warnings and, on failure, its graph dump are kept from the output: the error says enough
        with torch.no_grad(), warnings.catch_warnings(), _stdout_muted():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                net,
                (dummy,),
                str(tmp),
                input_names=["input"],
                output_names=["output"],
                dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
                opset_version=OPSET,
                dynamo=False,
            )
    except Exception as exc:  # torch raises RuntimeError, ValueError, ... for inputs the net cannot take
        tmp.unlink(missing_ok=True)
        said = next(iter(str(exc).strip().splitlines()), type(exc).__name__)[:200]
        raise TritonctlError(
            f"{model.source} could not be exported to ONNX taking input {model.input.dtype}{model.input.shape} "
            f"(torchvision models of one image input are served): {said}"
        ) from None
    tmp.replace(path)
    return path, False


@contextlib.contextmanager
def _stdout_muted():
    """Standard output (the file descriptor: torch's exporter prints from C++) sent to /dev/null meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _image_bytes(net):
    """`net` taking a uint8 image (3 x H x W, 0-255): scaled to [0, 1] and normalised before it runs."""
    import torch

    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)

    class ImageBytes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net
            self.register_buffer("scale", 1 / (255 * std))
            self.register_buffer("shift", mean / std)

        def forward(self, image):
            return self.net(image.float() * self.scale - self.shift)

    return ImageBytes().eval()


def materialize(cluster: Cluster, log=print, files_only: bool = False) -> dict[str, Artifact]:
    """Make an ONNX artifact for every model of the cluster, checked against the spec and served as it says
    (`served_as`); `files_only`: the models given as ONNX files alone, nothing exported (what `validate` checks)."""
    export_dir = cluster.resolve(cluster.spec.runtime.export_dir)
    if not files_only and not all(model.is_onnx_file for model in cluster.spec.models):
        check_output_dir(export_dir, file=cluster.path, field="runtime.export_dir", writable=True)
    artifacts: dict[str, Artifact] = {}
    for i, model in enumerate(cluster.spec.models):
        if files_only and not model.is_onnx_file:
            continue
        field = f"models[{i}].source"
        try:
            if model.is_onnx_file:
                path = cluster.resolve(model.source)
            else:
                path, cached = export_torchvision(model, export_dir)
                log(f"  {model.name}: {'cached' if cached else 'exported'} {path}")
            artifact = inspect_onnx(path)
        except TritonctlError as exc:
            raise TritonctlError(
                exc.message, file=cluster.path, field=f"{field} ({exc.file or model.source})"
            ) from None
        _check_input(cluster, i, model, artifact)
        artifacts[model.name] = served_as(artifact, model)
    return artifacts


def _check_input(cluster: Cluster, i: int, model: ModelSpec, artifact: Artifact) -> None:
    for out in artifact.outputs:
        if out.dtype not in DTYPES:
            raise TritonctlError(
                f"output {out.name!r} has type {out.dtype}; tritonctl serves {', '.join(DTYPES)}",
                file=cluster.path,
                field=f"models[{i}].source",
            )
    if len(artifact.inputs) != 1:
        raise TritonctlError(
            f"the model has {len(artifact.inputs)} inputs; tritonctl serves single-input models",
            file=cluster.path,
            field=f"models[{i}].source",
        )
    sig = artifact.inputs[0]
    declared = model.input.shape
    same_rank = len(sig.shape) == len(declared)
    fits = same_rank and all(d <= 0 or d == want for d, want in zip(sig.shape, declared, strict=True))
    if sig.dtype != model.input.dtype or not fits:
        raise TritonctlError(
            f"says {model.input.dtype}{declared} but the ONNX input {sig.name!r} is {sig.dtype}{list(sig.shape)}",
            file=cluster.path,
            field=f"models[{i}].input",
        )


def served_as(artifact: Artifact, model: ModelSpec) -> Artifact:
    """`artifact` with the dimensions its input leaves dynamic fixed to the cluster's `input.shape`: the shape
    tritonctl profiles, plans for and serves (Triton's config then takes no other), as the latency model speaks for
    that shape alone."""
    sig = artifact.inputs[0]
    if all(d > 0 for d in sig.shape):
        return artifact
    return replace(artifact, inputs=(replace(sig, shape=tuple(model.input.shape)),))

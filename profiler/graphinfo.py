"""Static features of an ONNX model: operator count and the bytes it moves per sample.

On a GPU InSS counts kernels per batch from a trace; on CPU the operator count of the ONNX
graph plays that part (onnxruntime dispatches one kernel per node). Weight and activation
bytes (every intermediate tensor once, per sample) are recorded with the profile for
analysis; the fitted model does not use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import shape_inference


@dataclass(frozen=True)
class GraphInfo:
    n_ops: int
    input_bytes: int  # per sample
    output_bytes: int  # per sample
    weight_bytes: int
    activation_bytes: int  # per sample: every intermediate tensor, counted once


def _numel(value: onnx.ValueInfoProto) -> int | None:
    dims = value.type.tensor_type.shape.dim
    if not dims:
        return None
    sizes = [d.dim_value if d.HasField("dim_value") else 1 for d in dims]  # the batch dim is symbolic: 1 sample
    return int(np.prod(sizes))


def _itemsize(value: onnx.ValueInfoProto) -> int:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)).itemsize


def graph_info(path: Path) -> GraphInfo:
    model = onnx.load(str(path))
    inferred = shape_inference.infer_shapes(model).graph
    weights = {init.name for init in model.graph.initializer}
    weight_bytes = sum(
        int(np.prod(init.dims)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        for init in model.graph.initializer
    )

    def size(values) -> int:
        return sum((_numel(v) or 0) * _itemsize(v) for v in values if v.name not in weights)

    return GraphInfo(
        n_ops=len(model.graph.node),
        input_bytes=size(inferred.input),
        output_bytes=size(inferred.output),
        weight_bytes=weight_bytes,
        activation_bytes=size(inferred.value_info),
    )

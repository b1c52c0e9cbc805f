"""Writes text.onnx beside this file: a model of the kind text models are, not a torchvision one.

    python examples/own-models/make_text_model.py

int64 token ids [batch, sequence] with the sequence length left dynamic in the file (the
cluster file fixes it), an embedding table (ids outside it fail), their mean, a linear layer to
logits [batch, classes]; seeded random weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def make_text_model(path: Path, vocabulary: int = 1000, classes: int = 10) -> Path:
    """A real ONNX model of the kind text models are: int64 token ids [batch, sequence], the sequence length
    dynamic, through an embedding table (ids outside it fail) and its mean to logits [batch, classes]."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((vocabulary, 32)).astype(np.float32), "table")
    weight = numpy_helper.from_array(rng.standard_normal((32, classes)).astype(np.float32), "W")
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["embedded"], axis=0),
            helper.make_node("ReduceMean", ["embedded", "axes"], ["pooled"], keepdims=0),
            helper.make_node("MatMul", ["pooled", "W"], ["logits"]),
        ],
        "text",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        [table, weight, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


if __name__ == "__main__":
    make_text_model(Path(__file__).resolve().parent / "text.onnx")

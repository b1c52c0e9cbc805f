"""torchvision -> ONNX export: dynamic batch, seeded weights, content-keyed cache."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from conftest import write_cluster
from tritonctl.export import materialize
from tritonctl.spec import load_cluster


def test_export_has_dynamic_batch_and_is_cached(tmp_path):
    model = {"name": "tiny", "source": "squeezenet1_1", "input": {"shape": [3, 64, 64]}, "slo_ms": 10, "rate": 1}
    cluster = load_cluster(write_cluster(tmp_path, [model]))
    messages: list[str] = []
    artifact = materialize(cluster, log=messages.append)["tiny"]
    assert "exported" in messages[0]
    assert artifact.inputs[0].shape == (3, 64, 64) and artifact.outputs[0].shape == (1000,)

    session = ort.InferenceSession(str(artifact.path), providers=["CPUExecutionProvider"])
    batch = np.random.default_rng(0).random((3, 3, 64, 64), dtype=np.float32)
    (out,) = session.run(None, {artifact.inputs[0].name: batch})
    assert out.shape == (3, 1000)
    (single,) = session.run(None, {artifact.inputs[0].name: batch[1:2]})
    np.testing.assert_allclose(single[0], out[1], rtol=1e-4, atol=1e-5)

    again = materialize(cluster, log=messages.append)["tiny"]
    assert "cached" in messages[1] and again.sha256 == artifact.sha256 and again.path == artifact.path


def test_export_key_follows_the_input_shape(tmp_path):
    models = [
        {"name": f"m{size}", "source": "squeezenet1_1", "input": {"shape": [3, size, size]}, "slo_ms": 10, "rate": 1}
        for size in (32, 48)
    ]
    cluster = load_cluster(write_cluster(tmp_path, models))
    artifacts = materialize(cluster, log=lambda _: None)
    assert artifacts["m32"].path != artifacts["m48"].path
    assert artifacts["m32"].inputs[0].shape == (3, 32, 32)

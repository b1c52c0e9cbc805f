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


def test_an_onnx_file_is_read_once_until_it_changes(tmp_path, monkeypatch):
    import os

    import onnx

    from conftest import make_mlp
    from tritonctl.export import inspect_onnx

    make_mlp(tmp_path / "mlp.onnx")
    loads = []
    real = onnx.load
    monkeypatch.setattr(onnx, "load", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    first = inspect_onnx(tmp_path / "mlp.onnx")
    assert inspect_onnx(tmp_path / "mlp.onnx") is first and len(loads) == 1  # a controller's re-plans read nothing
    make_mlp(tmp_path / "mlp.onnx", seed=1)  # rewritten: read again, with its new content
    stat = (tmp_path / "mlp.onnx").stat()
    os.utime(tmp_path / "mlp.onnx", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    second = inspect_onnx(tmp_path / "mlp.onnx")
    assert len(loads) == 2 and second.sha256 != first.sha256

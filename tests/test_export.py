"""torchvision -> ONNX export: dynamic batch, seeded weights, content-keyed cache."""

from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest

from conftest import TEXT_MODEL, write_cluster
from tritonctl.errors import TritonctlError
from tritonctl.export import IMAGENET_MEAN, IMAGENET_STD, materialize
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


def test_uint8_input_takes_image_bytes_and_normalises_them_in_the_graph(tmp_path):
    """An image sent as bytes answers what the float export answers for the same image normalised by hand."""
    models = [
        {"name": name, "source": "squeezenet1_1", "input": {"shape": [3, 32, 32], "dtype": dtype}, "slo_ms": 10,
         "rate": 1}
        for name, dtype in (("floats", "float32"), ("bytes", "uint8"))
    ]  # fmt: skip
    artifacts = materialize(load_cluster(write_cluster(tmp_path, models)), log=lambda _: None)
    assert artifacts["bytes"].inputs[0].dtype == "uint8" and artifacts["bytes"].path != artifacts["floats"].path

    image = np.random.default_rng(0).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
    mean, std = np.array(IMAGENET_MEAN).reshape(1, 3, 1, 1), np.array(IMAGENET_STD).reshape(1, 3, 1, 1)
    normalised = ((image / 255 - mean) / std).astype(np.float32)
    run = {n: ort.InferenceSession(str(a.path), providers=["CPUExecutionProvider"]) for n, a in artifacts.items()}
    (from_bytes,) = run["bytes"].run(None, {artifacts["bytes"].inputs[0].name: image})
    (from_floats,) = run["floats"].run(None, {artifacts["floats"].inputs[0].name: normalised})
    np.testing.assert_allclose(from_bytes, from_floats, rtol=1e-3, atol=1e-4)
    assert np.abs(from_bytes).max() > 1e-3  # the net answers something, not zeros


def test_uint8_input_of_a_torchvision_model_that_is_no_rgb_image_is_refused(tmp_path):
    model = {"name": "gray", "source": "resnet18", "input": {"shape": [1, 28, 28], "dtype": "uint8"}, "slo_ms": 10,
             "rate": 1}  # fmt: skip
    path = write_cluster(tmp_path, [model])
    with pytest.raises(TritonctlError) as refused:
        load_cluster(path)
    assert refused.value.field == "models[0]" and "RGB image of shape [3, H, W], not [1, 28, 28]" in str(refused.value)


def test_a_dynamic_dimension_is_served_at_the_declared_size_and_a_wrong_rank_is_refused(tmp_path):
    shutil.copy(TEXT_MODEL, tmp_path / "text.onnx")
    model = {"name": "text", "source": "text.onnx", "input": {"shape": [128], "dtype": "int64"}, "slo_ms": 10,
             "rate": 1}  # fmt: skip
    (artifact,) = materialize(load_cluster(write_cluster(tmp_path, [model])), log=lambda _: None).values()
    assert artifact.inputs[0].shape == (128,)  # what is profiled, planned and served; the file says (-1,)
    model["input"]["shape"] = [128, 4]
    with pytest.raises(TritonctlError) as refused:
        materialize(load_cluster(write_cluster(tmp_path, [model])), log=lambda _: None)
    assert refused.value.field == "models[0].input" and "int64[-1]" in str(refused.value)


def test_a_model_with_a_backbone_is_exported_with_random_weights_throughout(tmp_path, monkeypatch):
    """A segmentation builder fetches its backbone's pretrained weights unless told not to: nothing is fetched."""

    def no_download(*_, **__):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", no_download)  # where the weights fetch
    model = {"name": "seg", "source": "lraspp_mobilenet_v3_large", "input": {"shape": [3, 64, 64]}, "slo_ms": 50,
             "rate": 1}  # fmt: skip
    artifact = materialize(load_cluster(write_cluster(tmp_path, [model])), log=lambda _: None)["seg"]
    assert artifact.inputs[0].shape == (3, 64, 64)


def test_a_model_the_exporter_cannot_take_is_one_line_without_the_tracers_output(tmp_path, capfd):
    model = {"name": "flow", "source": "raft_small", "input": {"shape": [3, 64, 64]}, "slo_ms": 50, "rate": 1}
    with pytest.raises(TritonctlError, match="raft_small could not be exported to ONNX taking input float32") as exc:
        materialize(load_cluster(write_cluster(tmp_path, [model])), log=lambda _: None)
    assert "\n" not in str(exc.value)
    out, err = capfd.readouterr()
    assert out == "" and "Warning" not in err

"""Shared fixtures: small real ONNX models and cluster files in temporary folders."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from tritonctl.cli import main
from tritonctl.deploy.apply import down
from tritonctl.deploy.local import LocalRuntime, ephemeral_ports
from tritonctl.deploy.state import load_state
from tritonctl.errors import TritonctlError

REPO = Path(__file__).resolve().parent.parent
TEXT_MODEL = REPO / "examples" / "own-models" / "text.onnx"  # a text model's ONNX (make_text_model.py)


def make_mlp(path: Path, features: int = 16, classes: int = 4, seed: int = 0, fixed_batch: bool = False) -> Path:
    """A real ONNX model, y = relu(x W + b), with a dynamic batch dimension unless `fixed_batch`."""
    rng = np.random.default_rng(seed)
    weight = numpy_helper.from_array(rng.standard_normal((features, classes)).astype(np.float32), "W")
    bias = numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "b")
    batch = 1 if fixed_batch else "batch"
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["z"]),
            helper.make_node("Relu", ["z"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, classes])],
        [weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def make_unloadable(path: Path) -> Path:
    """A well-formed ONNX file with make_mlp's signature that onnxruntime refuses to load (an operator nobody
    implements)."""
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"], domain="com.example")],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(autouse=True)
def _no_stray_instances(request):
    """After every test with a tmp_path, stop what a local deployment there still runs (a failed test included)."""
    folder = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    for state_file in folder.rglob("state.json") if folder else ():
        state_dir = state_file.parent
        try:
            if load_state(state_dir).runtime == "local":
                down(state_dir, LocalRuntime(None, state_dir), log=lambda _: None)
        except TritonctlError:
            pass  # a test that broke its own state file on purpose


def free_base_port(span: int = 8) -> int:
    """A port with `span` free ports above it, below the kernel's ephemeral range (best effort: checked when
    chosen). Inside that range an instance's port or an outgoing connection can take a model port before
    HAProxy binds it."""
    ephemeral = ephemeral_ports()
    top = min(ephemeral.start if ephemeral else 32768, 65000) - span
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20000, top)
        ok = True
        for port in range(base, base + span):
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def write_cluster(folder: Path, models: list[dict], **overrides) -> Path:
    """A cluster file in `folder` with one CPU device and the given models; generated files stay in `folder`."""
    spec = {
        "name": "test",
        "devices": [{"kind": "cpu", "count": 1, "cores": 2, "units": 100, "memory_mb": 4096}],
        "models": models,
        "runtime": {
            "repository_dir": "repo",
            "export_dir": "exports",
            "state_dir": "state",
            "base_port": free_base_port(),
            "startup_timeout_s": 60,
        },
    }
    for key, value in overrides.items():
        spec[key] = value
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def mlp_model(name: str, source: str = "mlp.onnx", **extra) -> dict:
    return {
        "name": name,
        "source": source,
        "input": {"shape": [16], "dtype": "float32"},
        "slo_ms": 50,
        "rate": 20,
        **extra,
    }


@pytest.fixture
def mlp_cluster(tmp_path: Path) -> Path:
    make_mlp(tmp_path / "mlp.onnx")
    return write_cluster(tmp_path, [mlp_model("alpha"), mlp_model("beta")])


@pytest.fixture(scope="module")
def synthetic_lm(tmp_path_factory) -> Path:
    """A latency model fitted to the synthetic profile of tests/synthetic.py (labelled synthetic there)."""
    from synthetic import synthetic_dataset
    from tritonctl.latency.fit import fit_latency_model

    folder = tmp_path_factory.mktemp("lm") / "profile"
    fit_latency_model(synthetic_dataset(folder), log=lambda _: None).save(folder / "latency-model.json")
    return folder / "latency-model.json"


def edit(path: Path, change) -> None:
    """Change a YAML file (a plan, a cluster) in place: `change` edits its data."""
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.fixture
def gpu_plan(tmp_path: Path) -> Path:
    """Three models on two GPUs (rendered, never run); alpha has a second replica on gpu1 (same model port, its own
    instance), weighted 1 against its first's 3."""
    make_mlp(tmp_path / "mlp.onnx")
    gpus = [{"kind": "gpu", "count": 2, "units": 100, "memory_mb": 8000}]
    cluster = write_cluster(tmp_path, [mlp_model(n) for n in ("alpha", "beta", "gamma")], devices=gpus)
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(cluster), "-o", str(plan)]) == 0

    def add_replica(data):
        next(m for m in data["models"] if m["name"] == "beta")["placements"][0]["share"] = 60
        alpha = next(m for m in data["models"] if m["name"] == "alpha")
        alpha["placements"][0]["weight"] = 3.0
        alpha["placements"].append(
            {**alpha["placements"][0], "instance": "alpha-1", "device": "gpu1", "share": 40, "weight": 1.0}
        )

    edit(plan, add_replica)
    return plan

"""Control surfaces: Triton's control APIs ask for the deployment's key (real tritonserver), HAProxy's
runtime API is a socket its owner alone may use and its metrics stay on loopback, and the Compose
project mounts and pins only what it needs."""

from __future__ import annotations

import json
import re
import stat
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from conftest import REPO, make_mlp, mlp_model, write_cluster
from tritonctl.cli import main
from tritonctl.deploy.apply import exposure
from tritonctl.deploy.compose import CommandRunner, ComposeRuntime
from tritonctl.deploy.compose_project import check_mount, write_compose
from tritonctl.deploy.local import PROXY_FILE, PROXY_SOCKET, LocalRuntime
from tritonctl.deploy.runtime import CONTROL_HEADER, GRPC_CONTROL_HEADER, load_model
from tritonctl.deploy.state import KEY_FILE, control_key, load_state
from tritonctl.errors import TritonctlError
from tritonctl.planning.plan import load_plan

VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}")


def _plan(folder: Path, onnx: Path | None = None, **overrides) -> Path:
    """A plan for one MLP (exported to `onnx`, else beside the plan) in `folder`."""
    onnx = make_mlp(onnx or folder / "mlp.onnx")
    cluster = write_cluster(folder, [mlp_model("alpha", source=str(onnx))], **overrides)
    plan = folder / "plan.yaml"
    assert main(["plan", str(cluster), "-o", str(plan)]) == 0
    return plan


def _edit(plan: Path, change) -> None:
    data = yaml.safe_load(plan.read_text())
    change(data)
    plan.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """One model on one real tritonserver started by `tritonctl apply`: (plan, its instance, runtime)."""
    plan = _plan(tmp_path_factory.mktemp("secure"))
    assert main(["apply", str(plan)]) == 0
    loaded = load_plan(plan)
    (record,) = load_state(loaded.state_dir).instances.values()
    yield plan, record, LocalRuntime(None, loaded.state_dir)
    main(["down", str(plan)])


def _post(url: str, headers: dict | None = None) -> int:
    request = urllib.request.Request(url, data=b"{}", headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.triton
def test_the_key_is_the_owners_alone(deployed):
    _, _, runtime = deployed
    path = runtime.state_dir / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(runtime.control_key) >= 32 and control_key(runtime.state_dir) == runtime.control_key  # kept


@pytest.mark.triton
def test_model_control_without_the_key_is_refused_over_grpc_and_http(deployed):
    _, record, runtime = deployed
    with grpcclient.InferenceServerClient(f"{record.host}:{record.backend_port}") as client:
        for headers in (None, {GRPC_CONTROL_HEADER: "not-the-key"}, {CONTROL_HEADER: runtime.control_key}):
            with pytest.raises(InferenceServerException):
                client.load_model("alpha", headers=headers)
            with pytest.raises(InferenceServerException):
                client.unload_model("alpha", headers=headers)
            with pytest.raises(InferenceServerException):
                client.get_model_repository_index(headers=headers)
            with pytest.raises(InferenceServerException):
                client.update_log_settings({"log_file": "/tmp/elsewhere.log"}, headers=headers)
        assert client.is_model_ready("alpha")  # the refused unload left it loaded
    http = f"http://{record.host}:{record.http_port}/v2"
    assert _post(f"{http}/repository/models/alpha/load") == 403
    assert _post(f"{http}/repository/models/alpha/unload") == 403
    assert _post(f"{http}/repository/index", {CONTROL_HEADER: "not-the-key"}) == 403
    assert load_model(f"http://{record.host}:{record.http_port}", "alpha", 30, "not-the-key") is not None


@pytest.mark.triton
def test_inference_health_and_metadata_stay_open(deployed):
    plan, record, _ = deployed
    port = load_plan(plan).plan.models[0].port
    with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:  # through HAProxy
        assert client.is_server_live() and client.is_model_ready("alpha")
        assert client.get_model_metadata("alpha").name == "alpha"
        assert client.get_model_config("alpha").config.name == "alpha"
        assert client.get_inference_statistics("alpha").model_stats[0].name == "alpha"  # perf_analyzer reads them
        inp = grpcclient.InferInput("x", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        assert client.infer("alpha", [inp]).as_numpy("y").shape == (1, 4)
    with urllib.request.urlopen(f"http://{record.host}:{record.http_port}/v2/health/ready", timeout=5) as response:
        assert response.status == 200


@pytest.mark.triton
def test_tritonctls_own_calls_carry_the_key(deployed):
    _, record, runtime = deployed
    assert load_model(f"http://{record.host}:{record.http_port}", "alpha", 60, runtime.control_key) is None
    runtime.reconfigure(record, 60)  # apply's reload in place
    key = {GRPC_CONTROL_HEADER: runtime.control_key}
    with grpcclient.InferenceServerClient(f"{record.host}:{record.backend_port}") as client:
        client.load_model("alpha", headers=key)
        assert "alpha" in [m.name for m in client.get_model_repository_index(headers=key).models]
        assert client.is_model_ready("alpha")


def _listening(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket listens on at `port` (from /proc/net/tcp)."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            addresses.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return addresses


@pytest.mark.triton
def test_the_proxys_runtime_api_is_its_owners_alone_and_its_metrics_stay_on_loopback(deployed):
    plan, _, runtime = deployed
    state_dir = load_plan(plan).state_dir
    api = state_dir / PROXY_SOCKET
    assert stat.S_ISSOCK(api.stat().st_mode) and stat.S_IMODE(api.stat().st_mode) == 0o600
    metrics_port = json.loads((state_dir / PROXY_FILE).read_text())["metrics_port"]
    assert _listening(metrics_port) == {"127.0.0.1"}
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        assert "haproxy_backend_http_requests_total" in response.read().decode()
    assert runtime.proxy_ok()


def test_apply_says_which_ports_a_non_loopback_host_exposes(tmp_path, capsys):
    plan = _plan(tmp_path)
    assert exposure(load_plan(plan)) is None
    port = load_plan(plan).plan.models[0].port
    _edit(plan, lambda data: data["runtime"].update(host="0.0.0.0"))
    assert main(["apply", str(plan), "--dry-run"]) == 1  # would start it
    lines = [line for line in capsys.readouterr().out.splitlines() if "beyond this machine" in line]
    assert len(lines) == 1 and "0.0.0.0" in lines[0] and str(port) in lines[0]


# Compose


@pytest.fixture
def gpu_project(tmp_path: Path) -> tuple[Path, Path]:
    """A GPU plan in project/, its model and state in folders beside it: (plan, render folder)."""
    project, models = tmp_path / "project", tmp_path / "models"
    project.mkdir()
    models.mkdir()
    runtime = {
        "repository_dir": "repo",
        "export_dir": "exports",
        "state_dir": str(tmp_path / "state"),
        "base_port": 21000,
    }
    gpus = [{"kind": "gpu", "count": 1, "units": 100, "memory_mb": 8000}]
    return _plan(project, models / "mlp.onnx", devices=gpus, runtime=runtime), tmp_path / "deploy"


def _render(plan: Path, out: Path) -> int:
    return main(["render", str(plan), "--target", "compose", "-o", str(out), "--gpus", "1"])


def test_compose_sidecar_mounts_exactly_its_folders(gpu_project, tmp_path):
    plan, out = gpu_project
    assert _render(plan, out) == 0
    sidecar = yaml.safe_load((out / "compose.yaml").read_text())["services"]["tritonctl-sidecar"]
    binds = {v["source"]: v.get("read_only", False) for v in sidecar["volumes"] if v["type"] == "bind"}
    assert binds.pop("${DOCKER_SOCKET:-/var/run/docker.sock}") is False
    expected = {plan.parent: True, tmp_path / "models": True, tmp_path / "state": False, out: False}
    assert {Path(source): ro for source, ro in binds.items()} == expected
    assert all(v["target"] == v["source"] for v in sidecar["volumes"][:-1])  # at their host paths
    assert str(tmp_path) not in binds  # not the common parent


def test_compose_refuses_to_mount_a_system_folder(gpu_project):
    plan, _ = gpu_project
    for folder in ("/", "/etc/tritonctl"):  # a project rendered there: refused before anything is written
        with pytest.raises(TritonctlError, match=f"would mount {folder}, a system folder"):
            write_compose(load_plan(plan), Path(folder), 1, write=False)
    for path in ("/", "/etc", "/usr/local/share", "/proc/1", "/var", "/root", "/home"):
        with pytest.raises(TritonctlError):
            check_mount(Path(path))
    check_mount(Path("/var/lib/tritonctl"))  # a folder of its own under /var is fine


def test_compose_key_is_in_a_private_env_file_and_every_triton_asks_for_it(gpu_project):
    plan, out = gpu_project
    assert _render(plan, out) == 0
    env = dict(line.split("=", 1) for line in (out / ".env").read_text().splitlines() if "=" in line and line[0] != "#")
    assert stat.S_IMODE((out / ".env").stat().st_mode) == 0o600
    key = env["TRITON_CONTROL_KEY"]
    text = (out / "compose.yaml").read_text()
    assert len(key) >= 32 and key not in text
    services = yaml.safe_load(text)["services"]
    tritons = [s for s in services.values() if s.get("command", [""])[0] == "tritonserver"]
    assert tritons
    for spec in tritons:
        flags = [f for f in spec["command"] if "restricted" in f]
        assert {f.split("=", 1)[0] for f in flags} == {"--grpc-restricted-protocol", "--http-restricted-api"}
        assert all("model-repository" in f and "${TRITON_CONTROL_KEY:?" in f for f in flags)
    assert _render(plan, out) == 0  # a re-render keeps the key
    assert f"TRITON_CONTROL_KEY={key}\n" in (out / ".env").read_text()

    class Recording(CommandRunner):
        def load(self, url: str, model: str, timeout_s: float, key: str) -> str | None:
            self.keys = [*getattr(self, "keys", []), key]
            return None

    runtime = ComposeRuntime(out, Recording())
    record = type("Record", (), {"host": "127.0.0.1", "http_port": 1, "model": "alpha", "uid": "triton-a.1"})()
    runtime.reconfigure(record, 1)
    assert runtime.runner.keys == [key]


def test_no_image_is_latest_and_the_image_runs_unprivileged(gpu_project):
    plan, out = gpu_project
    assert _render(plan, out) == 0
    text = (out / "compose.yaml").read_text()
    images = [spec["image"] for spec in yaml.safe_load(text)["services"].values()]
    resolved = [VAR.sub(lambda m: m.group(2), image) for image in images]
    assert len(resolved) >= 5
    for image in resolved:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag and tag and tag != "latest", image
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    bases = re.findall(r"^ARG \w+_IMAGE=(\S+)", dockerfile, re.M)
    assert bases and all(":" in b and not b.endswith(":latest") and re.search(r"\d+\.\d+", b) for b in bases)
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")

"""HAProxy in front of the models: its rendered configuration, weights and runtime API, and its behaviour
against real Triton (per-request weights, hostile clients, a missing binary)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from conftest import make_mlp, mlp_model, write_cluster
from tritonctl.cli import main
from tritonctl.deploy.apply import ephemeral_clash
from tritonctl.deploy.local import (
    PROXY_CONFIG,
    PROXY_FILE,
    LocalRuntime,
    haproxy_binary,
    haproxy_version,
    port_holder,
    process_alive,
)
from tritonctl.deploy.proxy import (
    BUFFER_BYTES,
    LARGE_BUFFER_BYTES,
    MALLOC_ENV,
    Server,
    balance,
    buffer_bytes,
    environment,
    haproxy_weights,
    image_version,
    parse_stat,
    parse_version,
    render_config,
)
from tritonctl.deploy.state import load_state
from tritonctl.planning.plan import load_plan

SERVERS = {
    8100: [Server("b.2", "127.0.0.1", 9002, 9102, 64), Server("a.1", "127.0.0.1", 9001, 9101, 256)],
    8101: [Server("c.1", "127.0.0.1", 9003, 9103, 1)],
}


def test_the_configuration_is_deterministic_and_haproxy_accepts_it(tmp_path):
    text = render_config(SERVERS, "127.0.0.1", str(tmp_path / "api.sock"), "127.0.0.1:9999")
    assert text == render_config(
        dict(reversed(SERVERS.items())), "127.0.0.1", str(tmp_path / "api.sock"), "127.0.0.1:9999"
    )
    assert text.index("server a.1") < text.index("server b.2")  # sorted, whatever the order given
    assert "bind 127.0.0.1:8100 proto h2" in text and "check port 9101 check-proto h1" in text
    (tmp_path / "haproxy.cfg").write_text(text)
    checked = subprocess.run([haproxy_binary(), "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True)
    assert checked.returncode == 0, checked.stderr


def test_haproxy_gets_buffers_that_hold_a_request_from_version_3_0():
    assert parse_version("HAProxy version 2.6.12-1+deb12u4 2025/01/31 - https://haproxy.org/\n") == (2, 6)
    assert parse_version("HAProxy version 3.0.11-9e587df 2025/06/02 - https://haproxy.org/") == (3, 0)
    assert parse_version("HA-Proxy version 1.8.19-1+deb10u3 2020/08/01") == (1, 8)
    assert parse_version("command not found") is None
    assert [image_version(i) for i in ["haproxy:3.0", "docker.io/library/haproxy:3.2.4-alpine", "haproxy:2.6"]] == [
        (3, 0),
        (3, 2),
        (2, 6),
    ]
    assert [image_version(i) for i in ["haproxy", "haproxy:lts", "registry:5000/haproxy", "haproxy@sha256:ab12"]] == [
        None
    ] * 4
    assert [buffer_bytes(v) for v in [(2, 6), (2, 9), (3, 0), (3, 2), None]] == [BUFFER_BYTES] * 2 + [
        LARGE_BUFFER_BYTES
    ] * 2 + [BUFFER_BYTES]
    # buffers glibc would map and unmap on every request come with the settings that keep their memory
    assert environment(BUFFER_BYTES) == environment(LARGE_BUFFER_BYTES) == MALLOC_ENV and environment(1 << 16) == {}
    text = render_config(SERVERS, "127.0.0.1", "/tmp/api.sock", "127.0.0.1:9999", buffer=LARGE_BUFFER_BYTES)
    assert "    tune.bufsize 1048576\n" in text and "tune.bufsize 65536" not in text


def test_equal_replicas_go_to_the_least_busy_and_unequal_ones_by_weighted_turns(tmp_path):
    text = render_config(SERVERS, "127.0.0.1", str(tmp_path / "api.sock"), "127.0.0.1:9999")
    port8100, port8101 = text.split("\nbackend port8100\n")[1].split("\nbackend port8101\n")
    assert "balance roundrobin" in port8100 and "balance leastconn" in port8101
    assert balance([Server("a", "h", 1, 2, 7), Server("b", "h", 3, 4, 7)]) == "leastconn"


def test_plan_weights_become_proportional_haproxy_weights():
    assert haproxy_weights([1.0, 3.0]) == [85, 256]
    assert haproxy_weights([2.0]) == [256]
    assert haproxy_weights([0.001, 10.0]) == [1, 256]  # never 0: a weight-0 server gets nothing
    assert haproxy_weights([]) == []


def test_show_stat_is_read_per_backend_and_server():
    text = (
        "# pxname,svname,qcur,qmax,scur,smax,slim,stot,status,weight\n"
        "port8100,FRONTEND,,,2,5,,,OPEN,\n"
        "port8100,a.1,0,0,3,4,,,UP,256\n"
        "port8100,b.2,0,0,0,1,,,DRAIN,0\n"
        "port8100,BACKEND,0,0,3,5,,,UP,256\n"
    )
    stats = parse_stat(text)
    assert set(stats) == {"port8100"} and set(stats["port8100"]) == {"a.1", "b.2"}
    assert stats["port8100"]["a.1"].current == 3 and stats["port8100"]["b.2"].status == "DRAIN"


def test_apply_without_haproxy_says_what_to_install_and_starts_nothing(tmp_path, capsys, monkeypatch):
    make_mlp(tmp_path / "mlp.onnx")
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(write_cluster(tmp_path, [mlp_model("alpha")])), "-o", str(plan)]) == 0
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "haproxy" else which(name, *a, **k))
    monkeypatch.setattr("tritonctl.deploy.local.HAPROXY_PATHS", ())
    capsys.readouterr()
    assert main(["apply", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "HAProxy is not installed" in err and "apt-get install haproxy" in err and "Traceback" not in err
    assert not load_state(load_plan(plan).state_dir).instances


def _infer(client: grpcclient.InferenceServerClient) -> None:
    inp = grpcclient.InferInput("x", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    assert client.infer("alpha", [inp]).as_numpy("y").shape == (1, 4)


def _successes(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("nv_inference_request_success")
    )


def _served_since(records: dict, before: dict[str, float], sent: int) -> dict[str, float]:
    """Per instance, the requests it answered since `before`, once all `sent` are counted (Triton counts a request
    just after answering it) or 5 s have passed."""
    deadline = time.monotonic() + 5
    while True:
        served = {name: _successes(r.metrics_port) - before[name] for name, r in records.items()}
        if sum(served.values()) >= sent or time.monotonic() > deadline:
            return served
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    """Model alpha on two instances weighted 1 and 3 by the plan: (plan, {instance: record})."""
    folder = tmp_path_factory.mktemp("replicas")
    make_mlp(folder / "mlp.onnx")
    plan = folder / "plan.yaml"
    assert main(["plan", str(write_cluster(folder, [mlp_model("alpha")])), "-o", str(plan)]) == 0
    data = yaml.safe_load(plan.read_text())
    (placement,) = data["models"][0]["placements"]
    placement.update(share=20, weight=1.0)
    data["models"][0]["placements"] = [placement, {**placement, "instance": "alpha-1", "weight": 3.0}]
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["apply", str(plan)]) == 0
    records = {r.instance: r for r in load_state(load_plan(plan).state_dir).instances.values()}
    yield plan, records
    main(["down", str(plan)])


@pytest.mark.triton
def test_weights_1_and_3_split_one_connections_requests_25_75(two_replicas):
    plan, records = two_replicas
    before = {name: _successes(r.metrics_port) for name, r in records.items()}
    with grpcclient.InferenceServerClient(f"127.0.0.1:{load_plan(plan).plan.models[0].port}") as client:
        for _ in range(400):  # one client, one connection
            _infer(client)
    served = _served_since(records, before, 400)
    assert sum(served.values()) == 400
    assert abs(served["alpha-1"] / 400 - 0.75) <= 0.03, served


@pytest.mark.triton
def test_the_applied_haproxy_has_the_buffers_and_malloc_settings_of_its_version(two_replicas):
    plan, _ = two_replicas
    state_dir = load_plan(plan).state_dir
    binary = haproxy_binary()
    version = haproxy_version(binary)
    assert version is not None
    buffer = buffer_bytes(version)
    config = (state_dir / PROXY_CONFIG).read_text()
    assert f"    tune.bufsize {buffer}\n" in config
    pid = json.loads((state_dir / PROXY_FILE).read_text())["pid"]
    environ = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
    assert {k: environ.get(k) for k in MALLOC_ENV} == environment(buffer) == MALLOC_ENV, (version, environ)


@pytest.mark.triton
def test_perf_analyzer_measures_a_model_served_by_two_replicas(two_replicas, capsys):
    """Its statistics requests reach either replica: unless told the model's version, perf_analyzer stops when
    a window's request count falls from one replica's to the other's."""
    plan, _ = two_replicas
    capsys.readouterr()
    assert main(["load", str(plan), "--tool", "perf_analyzer", "--duration", "6"]) == 0
    (cells,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("alpha")]
    assert int(cells[1]) > 0 and int(cells[3]) == 0


@pytest.mark.triton
def test_hostile_clients_leave_normal_requests_and_the_proxy_running(two_replicas):
    plan, _ = two_replicas
    port = load_plan(plan).plan.models[0].port
    proxy = json.loads((load_plan(plan).state_dir / PROXY_FILE).read_text())
    failures: list[str] = []
    done = threading.Event()

    def normal_client() -> None:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            while not done.is_set():
                try:
                    _infer(client)
                except Exception as exc:  # noqa: BLE001 (every failure is what the test counts)
                    failures.append(str(exc))
                time.sleep(0.01)

    worker = threading.Thread(target=normal_client)
    worker.start()
    try:
        with socket.create_connection(("127.0.0.1", port)) as garbage:  # 1 MB of random bytes
            with pytest.raises(OSError):
                for _ in range(16):
                    garbage.sendall(os.urandom(1 << 16))
                garbage.settimeout(5)
                assert garbage.recv(1) == b""  # or a reset: either way closed
                raise OSError("closed")
        with socket.create_connection(("127.0.0.1", port)) as http1:  # HTTP/1.1 to a gRPC port
            http1.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            http1.settimeout(5)
            with pytest.raises(OSError):
                while http1.recv(4096):
                    pass
                raise OSError("closed")
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        time.sleep(2)
        for sock in idle:
            sock.close()
        time.sleep(0.5)
    finally:
        done.set()
        worker.join()
    assert failures == []
    assert (
        process_alive(proxy["pid"], proxy["start_ticks"]) and LocalRuntime(None, load_plan(plan).state_dir).proxy_ok()
    )


@pytest.mark.triton
def test_replicas_of_equal_weight_go_to_the_least_busy_and_the_change_reloads_the_proxy(two_replicas):
    """Weights 1 and 3 become 1 and 1: HAProxy reloads to least-connections (a request goes where fewer are in
    progress) and one connection's requests are split evenly; no request fails across the change."""
    plan, records = two_replicas
    data = yaml.safe_load(plan.read_text())
    for placement in data["models"][0]["placements"]:
        placement["weight"] = 1.0
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["apply", str(plan)]) == 0
    state_dir = load_plan(plan).state_dir
    assert "balance leastconn" in (state_dir / "haproxy.cfg").read_text()
    before = {name: _successes(r.metrics_port) for name, r in records.items()}
    with grpcclient.InferenceServerClient(f"127.0.0.1:{load_plan(plan).plan.models[0].port}") as client:
        for _ in range(200):
            _infer(client)
    served = _served_since(records, before, 200)
    assert sum(served.values()) == 200 and abs(served["alpha-1"] / 200 - 0.5) <= 0.1, served


@pytest.mark.triton
def test_haproxy_runs_in_a_cgroup_of_the_largest_weight_removed_by_down(tmp_path):
    """Every request passes through HAProxy: it must not wait behind instances weighed by their SLOs."""
    from tritonctl.deploy import share
    from tritonctl.shares import MAX_WEIGHT

    if share.mechanism() == "none":
        pytest.skip("no writable cgroup on this machine")
    make_mlp(tmp_path / "mlp.onnx")
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(write_cluster(tmp_path, [mlp_model("alpha")])), "-o", str(plan)]) == 0
    assert main(["apply", str(plan)]) == 0
    try:
        record = json.loads((load_plan(plan).state_dir / PROXY_FILE).read_text())
        group = Path(record["cgroup"])
        worker = subprocess.run(["pgrep", "-P", str(record["pid"])], capture_output=True, text=True).stdout.split()
        assert {record["pid"], *map(int, worker)} <= share.members(group) and worker
        weight = group / "cpu.weight"
        assert (weight.read_text() if weight.exists() else (group / "cpu.shares").read_text()).strip() in {
            str(MAX_WEIGHT),
            str(round(MAX_WEIGHT * 10.24)),
        }
    finally:
        assert main(["down", str(plan)]) == 0
    assert not group.exists()


def test_the_holder_of_a_port_is_the_process_whose_address_a_bind_would_collide_with():
    here = socket.socket()
    here.bind(("127.0.0.3", 0))
    here.listen()
    port = here.getsockname()[1]
    code = (
        f"import socket, time; s = socket.socket(); s.bind(('127.0.0.2', {port})); s.listen(); print(1, flush=True); "
        "time.sleep(30)"
    )
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        other.stdout.readline()  # listening
        assert port_holder(port, "127.0.0.3").pid == os.getpid()  # not the other listener on the same port
        assert port_holder(port, "127.0.0.2").pid == other.pid
        assert port_holder(port, "127.0.0.4") is None
        assert port_holder(port, "0.0.0.0") is not None and port_holder(port) is not None
    finally:
        other.kill()
        here.close()


def test_a_model_port_taken_by_another_program_is_refused_before_anything_starts(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(write_cluster(tmp_path, [mlp_model("alpha")])), "-o", str(plan)]) == 0
    port = load_plan(plan).plan.models[0].port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        capsys.readouterr()
        assert main(["apply", str(plan), "--dry-run"]) == 2  # the dry run finds what the apply would
        assert f"port {port} is in use by another process" in capsys.readouterr().err
        assert main(["apply", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} is in use by another process: python" in err and f"(pid {os.getpid()})" in err
    assert "Traceback" not in err
    state_dir = load_plan(plan).state_dir
    assert not load_state(state_dir).instances and not Path(state_dir, PROXY_FILE).exists()
    repositories = load_plan(plan).resolve(load_plan(plan).plan.runtime.repository_dir)
    assert not repositories.exists()  # refused before the repositories were written


@pytest.mark.triton
def test_a_model_port_taken_after_the_check_rolls_the_apply_back_naming_haproxys_alert(tmp_path, capsys, monkeypatch):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha")])
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(cluster), "-o", str(plan)]) == 0
    assert main(["apply", str(plan)]) == 0
    try:
        spec = yaml.safe_load(cluster.read_text())
        spec["models"].append(mlp_model("beta"))
        cluster.write_text(yaml.safe_dump(spec, sort_keys=False))
        assert main(["plan", str(cluster), "-o", str(plan)]) == 0
        loaded = load_plan(plan)
        port = next(m.port for m in loaded.plan.models if m.name == "beta")
        before = load_state(loaded.state_dir).instances
        with socket.socket() as taken:  # bound, not listening: as an outgoing connection holds its source port

            def taken_after_the_check(*_):
                taken.bind(("127.0.0.1", port))

            monkeypatch.setattr("tritonctl.deploy.apply._check_ports", taken_after_the_check)
            capsys.readouterr()
            assert main(["apply", str(plan)]) == 3
            monkeypatch.undo()
        err = capsys.readouterr().err
        assert "rolled back" in err and "cannot bind socket" in err and f":{port}" in err and "Traceback" not in err
        runtime = LocalRuntime(None, loaded.state_dir)
        assert load_state(loaded.state_dir).instances.keys() == before.keys()  # beta's instance stopped
        assert runtime.proxy_ok() and all(runtime.health(r).model_ready for r in before.values())
        assert f"port{port}" not in (loaded.state_dir / "haproxy.cfg").read_text()  # what runs, as saved
        assert main(["apply", str(plan)]) == 0  # the port free again: the same plan applies
        assert len(load_state(loaded.state_dir).instances) == 2
    finally:
        assert main(["down", str(plan)]) == 0


def test_model_ports_in_the_ephemeral_range_are_warned_of(tmp_path):
    make_mlp(tmp_path / "mlp.onnx")
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(write_cluster(tmp_path, [mlp_model("alpha")])), "-o", str(plan)]) == 0
    loaded = load_plan(plan)
    port = loaded.plan.models[0].port
    assert ephemeral_clash(loaded, range(port + 1, 60000)) is None
    assert ephemeral_clash(loaded, None) is None
    line = ephemeral_clash(loaded, range(port, 60000))
    assert f"model ports {port} lie in" in line and f"below {port}" in line


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder on a read-only filesystem (a tmpfs mounted read-only: root too is refused writes)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_an_unwritable_state_folder_is_refused_before_anything_starts(tmp_path, read_only_folder, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    plan = tmp_path / "plan.yaml"
    cluster = write_cluster(tmp_path, [mlp_model("alpha")])
    edit = yaml.safe_load(cluster.read_text())
    edit["runtime"]["state_dir"] = str(read_only_folder)
    cluster.write_text(yaml.safe_dump(edit))
    assert main(["plan", str(cluster), "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["apply", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"{read_only_folder} is not writable" in err and "Traceback" not in err
    assert not any(read_only_folder.iterdir())
    assert subprocess.run(["pgrep", "-f", f"haproxy.*{read_only_folder}"], capture_output=True).returncode == 1

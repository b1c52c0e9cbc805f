"""The controller: metrics and rates, its decisions, and a kill in the middle of a swap (real processes)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from conftest import REPO, edit, make_mlp, mlp_model, write_cluster
from synthetic import synthetic_dataset
from tritonctl.cli import main
from tritonctl.controller.decide import ControllerConfig, changed_rates, rebase, rebatch, with_rates
from tritonctl.controller.loop import Controller
from tritonctl.controller.metrics import ProxyRates, RateEstimator, parse_metrics, parse_proxy_metrics
from tritonctl.controller.state import load_controller_state
from tritonctl.deploy.local import LocalRuntime, process_alive
from tritonctl.deploy.state import load_state
from tritonctl.errors import TritonctlError
from tritonctl.latency.fit import fit_latency_model
from tritonctl.planning.plan import load_plan
from tritonctl.planning.planner import replan_artifacts
from tritonctl.planning.policies.base import Choice, Demand
from tritonctl.planning.policies.bda import bda
from tritonctl.spec import load_cluster
from tritonctl.triton.client import endpoints, run_load

METRICS = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="alpha",version="1"} 120
nv_inference_request_success{model="alpha",version="2"} 30
nv_inference_request_failure{model="alpha",version="1"} 2
nv_inference_queue_duration_us{model="alpha",version="1"} 5000
nv_inference_pending_request_count{model="alpha",version="1"} 3
nv_gpu_utilization{gpu_uuid="x"} 0.5
"""


def test_parse_metrics_sums_versions_and_keeps_only_model_series():
    parsed = parse_metrics(METRICS)
    assert parsed == {
        "alpha": {
            "nv_inference_request_success": 150.0,
            "nv_inference_request_failure": 2.0,
            "nv_inference_queue_duration_us": 5000.0,
            "nv_inference_pending_request_count": 3.0,
        }
    }


PROXY_METRICS = """# TYPE haproxy_backend_http_requests_total counter
haproxy_backend_http_requests_total{proxy="port8100"} 120
haproxy_backend_http_requests_total{proxy="metrics"} 7
# TYPE haproxy_backend_connection_errors_total counter
haproxy_backend_connection_errors_total{proxy="port8100"} 2
# TYPE haproxy_backend_http_responses_total counter
haproxy_backend_http_responses_total{proxy="port8100",code="2xx"} 115
haproxy_backend_http_responses_total{proxy="port8100",code="5xx"} 3
# TYPE haproxy_backend_current_queue gauge
haproxy_backend_current_queue{proxy="port8100"} 4
"""


def test_proxy_metrics_are_read_per_model_port_and_become_rates():
    assert parse_proxy_metrics(PROXY_METRICS) == {8100: {"requests": 120.0, "errors": 5.0, "queued": 4.0}}
    rates = ProxyRates(window_s=10)
    rates.update(0.0, {8100: {"requests": 100.0, "errors": 1.0, "queued": 0.0}})
    assert rates.rates(8100) is None
    rates.update(2.0, {8100: {"requests": 150.0, "errors": 3.0, "queued": 0.0}})
    assert rates.rates(8100) == (25.0, 1.0)
    rates.update(3.0, {8100: {"requests": 10.0, "errors": 0.0, "queued": 0.0}})  # a restarted proxy
    assert rates.rates(8100) is None


def test_status_tells_a_controller_that_stopped_from_one_that_runs(capsys, mlp_cluster):
    from tritonctl.cli import main
    from tritonctl.controller.state import ControllerState, save_controller_state
    from tritonctl.planning.plan import load_plan

    state = ControllerState(plan="p", interval_s=1.0, heartbeat=100.0)
    assert state.running(105.0) and not state.running(114.0)
    state.target = "p2"  # applying: starting instances says nothing for minutes
    assert state.running(400.0) and not state.running(800.0)
    state.stopped = 390.0
    assert not state.running(400.0)
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    state_dir = load_plan(plan).state_dir
    state_dir.mkdir(parents=True)
    stopped = ControllerState(plan="p", interval_s=1.0, heartbeat=time.time() - 60, planned_rates={"gone": 5.0})
    save_controller_state(state_dir, stopped)
    capsys.readouterr()
    assert main(["status", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "controller: not running (last heard from " in out and "gone" not in out


def test_metrics_follow_prometheus_conventions():
    from prometheus_client.parser import text_string_to_metric_families

    from tritonctl.controller.state import ControllerState, prometheus

    state = ControllerState(plan="p", applies=3, estimated_rates={"a": 4.5, "b": None}, planned_rates={"a": 5.0})
    state.queue_ms = {"a": 12.5}
    text = prometheus(state).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["tritonctl_applies"].type == "counter" and "tritonctl_applies_total 3.0" in text
    assert "# HELP tritonctl_model_queue_seconds" in text
    assert [s.value for s in families["tritonctl_model_queue_seconds"].samples] == [0.0125]
    assert [s.labels for s in families["tritonctl_model_estimated_requests_per_second"].samples] == [{"model": "a"}]


def counters(done: float, pending: float = 0, queue_us: float = 0) -> dict[str, float]:
    return {
        "nv_inference_request_success": done,
        "nv_inference_pending_request_count": pending,
        "nv_inference_queue_duration_us": queue_us,
    }


def test_rates_survive_instance_churn_and_count_a_growing_queue():
    est = RateEstimator(window_s=4.0)
    est.update(0.0, {"a": ("m", counters(0))})
    assert est.rate("m") is None  # one sample spans no time
    est.update(1.0, {"a": ("m", counters(10, queue_us=20_000))})
    # A swap: "b" appears with counts of its own (warm-up) that are not arrivals; "a" is gone.
    est.update(2.0, {"b": ("m", counters(500))})
    est.update(3.0, {"b": ("m", counters(510))})
    assert est.rate("m") == pytest.approx(20 / 3)
    assert est.queue_ms("m") == pytest.approx(1.0)  # 20 ms queued over 20 requests
    # Overloaded: 10 completed and 30 more waiting in one second means 40 arrived.
    est.update(4.0, {"b": ("m", counters(520, pending=30))})
    assert est.rate("m") == pytest.approx((10 + 0 + 10 + 40) / 4)
    est.update(5.5, {"b": ("m", counters(530, pending=30))})  # the window keeps the last 4 s only
    assert est.rate("m") == pytest.approx((10 + 40 + 10) / 3.5)


def test_only_changes_beyond_threshold_and_poisson_noise_count():
    cfg = ControllerConfig(threshold=0.25, min_delta_rps=1.0, window_s=4.0)
    planned = {"a": 100.0, "b": 5.0, "c": 10.0}
    # a: beyond 25 %; b: 5 -> 2.6 is within the noise of 20 arrivals in 4 s; c: no estimate yet
    assert changed_rates(planned, {"a": 130.0, "b": 2.6, "c": None}, cfg) == {"a": 130.0}
    assert changed_rates(planned, {"a": 120.0, "b": 10.0, "c": 20.0}, cfg) == {"b": 10.0, "c": 20.0}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A plan of two real ONNX models made by `bda` on a latency model fitted to SYNTHETIC data."""
    folder = tmp_path_factory.mktemp("ctl")
    make_mlp(folder / "mlp.onnx")
    lm = fit_latency_model(synthetic_dataset(folder / "profile"), log=lambda _: None)
    lm.save(folder / "lm.json")
    cluster = write_cluster(folder, [mlp_model("alpha", slo_ms=150), mlp_model("beta", slo_ms=400)])
    assert main(["plan", str(cluster), "--policy", "bda", "--latency-model", str(folder / "lm.json")]) == 0
    return load_plan(folder / "plan.yaml"), lm


def test_rebatch_is_bda_on_the_current_placement(planned):
    loaded, lm = planned
    plan, why = rebatch(with_rates(loaded.plan, {"alpha": 150.0}), lm)
    assert why == "" and plan is not None
    placement = {m.name: Choice(m.placements[0].device, m.placements[0].share) for m in loaded.plan.models}
    expected = bda(placement, [Demand("alpha", 150, 150, 1), Demand("beta", 400, 20, 1)], loaded.plan.devices, lm)
    assert {m.name: m.placements[0].batch for m in plan.models} == expected.batches
    assert [p.share for _, p in plan.instances()] == [p.share for _, p in loaded.plan.instances()]
    assert all(p.predicted is not None for _, p in plan.instances())
    assert with_rates(loaded.plan, {"alpha": 150.0}).stale_predictions() and not plan.stale_predictions()
    assert all(m.simulated_in_slo is None for m in plan.models)  # the simulation of other rates is gone
    impossible, why = rebatch(with_rates(loaded.plan, {"alpha": 100_000.0}), lm)
    assert impossible is None and "alpha" in why


def test_rebase_keeps_every_path_pointing_at_the_same_file(planned, tmp_path):
    loaded, _ = planned
    moved = rebase(loaded.plan, loaded.path.parent, tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / moved.models[0].onnx).resolve() == loaded.resolve(loaded.plan.models[0].onnx)
    assert (tmp_path / "elsewhere" / moved.runtime.state_dir).resolve() == loaded.state_dir.resolve()


# What the sidecar image has: the package without extras (docker/Dockerfile), so no torchvision.
SIDECAR_REPLAN = """
import sys
sys.modules["torchvision"] = None  # the sidecar image has no torchvision: importing it fails
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import load_plan
from tritonctl.planning.planner import make_plan, replan_artifacts
from tritonctl.spec import load_cluster
plan, lm = load_plan(sys.argv[1]), load_latency_model(sys.argv[2])
cluster = load_cluster(plan.resolve(plan.plan.cluster_file)).with_rates(lambda m: m.rate * 1.5)
try:
    materialize(cluster, log=lambda _: None)
    print("materialize: ok")
except TritonctlError as exc:
    print("materialize:", exc)
new = make_plan(cluster, replan_artifacts(plan, cluster), "bda", plan.path, lm, log=lambda _: None)
print("replanned:", {m.name: m.rate for m in new.models})
"""


def test_the_sidecar_replans_a_torchvision_cluster_without_torchvision(planned):
    """A torchvision-source cluster whose plan names its exports: the controller re-plans from the plan's ONNX
    files, where exporting again needs torchvision (and a writable export folder), which the sidecar lacks."""
    loaded, _ = planned
    folder = loaded.path.parent
    cluster = folder / "cluster.yaml"
    original = cluster.read_text()
    data = yaml.safe_load(original)
    for model in data["models"]:
        model["source"] = "mobilenet_v2"
    cluster.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        out = subprocess.run(
            [sys.executable, "-c", SIDECAR_REPLAN, str(loaded.path), str(folder / "lm.json")],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    finally:
        cluster.write_text(original)
    assert out.returncode == 0, out.stderr
    assert "exporting torchvision models needs torch and torchvision" in out.stdout
    assert "replanned: {'alpha': 30.0, 'beta': 30.0}" in out.stdout


def test_replan_refuses_an_onnx_file_changed_since_the_plan(planned, tmp_path):
    loaded, _ = planned
    plan = yaml.safe_load(loaded.path.read_text())
    make_mlp(tmp_path / "other.onnx", seed=1)
    plan["models"][0]["onnx"] = str(tmp_path / "other.onnx")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    moved = load_plan(tmp_path / "plan.yaml")
    with pytest.raises(TritonctlError, match="changed since the plan was made"):
        replan_artifacts(moved, load_cluster(loaded.resolve(loaded.plan.cluster_file)))


def test_the_sidecar_image_installs_the_package_without_extras():
    """docker/Dockerfile installs `.` alone, and torchvision is only an extra: what the test above leaves out."""
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.findall(r"pip install[^\n]*", dockerfile) == ["pip install --no-cache-dir ."]
    requires = re.search(r"install_requires =\n((?:    .*\n)+)", (REPO / "setup.cfg").read_text()).group(1)
    assert "torchvision" not in requires and "onnx" in requires


# ---- real processes ------------------------------------------------------------------


def controller_json(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "controller.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(condition, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_controller(plan: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "tritonctl", "controller", str(plan), "--port", "0", "--interval", "0.2"],
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        env=env,
    )


@pytest.mark.triton
def test_controller_killed_mid_swap_converges_without_a_failed_request(tmp_path):
    """An SLO no queue on a busy 2-core machine reaches: a request refused as late (runtime.reject_late) would be
    counted here as one the swap lost."""
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha", slo_ms=1000), mlp_model("beta", slo_ms=1000)])
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(cluster), "-o", str(plan)]) == 0
    state_dir = tmp_path / "state"
    log = tmp_path / "controller.log"
    ctl = start_controller(plan, log)
    try:
        listening = lambda: re.search(r"http://127\.0\.0\.1:(\d+)/metrics", log.read_text())  # noqa: E731
        wait_for(listening, what="the controller's endpoint (after its first apply)")
        port = int(listening().group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
            assert "tritonctl_applies_total 1.0" in response.read().decode()
        results = []
        load = threading.Thread(target=lambda: results.extend(run_load(endpoints(load_plan(plan).plan), 12.0, 2.0)))
        load.start()
        time.sleep(1.0)
        old_alpha = [r for r in load_state(state_dir).instances.values() if r.model == "alpha"]
        data = yaml.safe_load(plan.read_text())
        data["models"][0]["placements"][0]["share"] -= 10
        plan.write_text(yaml.safe_dump(data, sort_keys=False))  # the operator's new plan: a swap
        alpha = lambda: [r for r in load_state(state_dir).instances.values() if r.model == "alpha"]  # noqa: E731
        wait_for(lambda: len(alpha()) == 2, what="the shadow instance")
        ctl.send_signal(signal.SIGKILL)  # mid-swap: the new instance is starting, the old one serves
        ctl.wait()
        assert controller_json(state_dir)["target"] == str(plan.resolve())
        ctl = start_controller(plan, log)
        wait_for(lambda: controller_json(state_dir).get("target") == "" and len(alpha()) == 1, what="convergence")
        load.join()
        good = plan.read_text()
        plan.write_text(good.replace("share:", "share: -"))  # a malformed plan: refused, nothing touched
        wait_for(lambda: controller_json(state_dir)["decisions"][-1]["kind"] == "error", what="the refusal")
        assert "share" in controller_json(state_dir)["decisions"][-1]["reason"] and ctl.poll() is None
        plan.write_text(good)
    finally:
        ctl.terminate()
        ctl.wait()
    (new,) = alpha()
    assert new.share == data["models"][0]["placements"][0]["share"] and new.uid != old_alpha[0].uid
    assert LocalRuntime(None, state_dir).health(new).label == "ready"
    assert not any(process_alive(r.pid, r.start_ticks) for r in old_alpha)
    assert "resuming" in log.read_text()
    assert [r.errors[:1] for r in results] == [[], []] and all(r.ok == r.sent > 10 for r in results)
    assert main(["down", str(plan)]) == 0


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def _served_again(endpoint, timeout_s: float) -> float:
    """Seconds until a request for the endpoint's model is answered (a new connection each try)."""
    import tritonclient.grpc as grpcclient

    from tritonctl.triton.client import random_request

    request = random_request(endpoint, np.random.default_rng(0))
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        try:
            with grpcclient.InferenceServerClient(endpoint.url) as client:
                client.infer(endpoint.model, [request], client_timeout=1.0)
            return time.monotonic() - began
        except Exception:  # noqa: BLE001 (refused, unavailable, deadline: all mean not yet)
            time.sleep(0.1)
    raise AssertionError(f"{endpoint.model} not served again within {timeout_s} s")


def _threads(pid: int) -> int:
    return int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))


@pytest.mark.triton
def test_controller_restarts_a_killed_instance_and_a_killed_proxy_and_bounds_its_http(tmp_path):
    make_mlp(tmp_path / "mlp.onnx")
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(write_cluster(tmp_path, [mlp_model("alpha")])), "-o", str(plan)]) == 0
    state_dir = tmp_path / "state"
    log = tmp_path / "controller.log"
    ctl = start_controller(plan, log)
    try:
        wait_for(lambda: controller_json(state_dir).get("applies") == 1, what="the first apply")
        (endpoint,) = endpoints(load_plan(plan).plan)
        (old,) = load_state(state_dir).instances.values()
        os.kill(old.pid, signal.SIGKILL)
        assert _served_again(endpoint, 10.0) < 10.0
        last = lambda: controller_json(state_dir)["decisions"][-1]  # noqa: E731 (recorded once the apply ends)
        wait_for(lambda: last()["kind"] == "heal", timeout_s=10, what="the heal decision")
        assert f"{old.uid} (alpha) died" in last()["reason"], last()
        (new,) = load_state(state_dir).instances.values()
        assert new.uid != old.uid and LocalRuntime(None, state_dir).health(new).label == "ready"
        # requests HAProxy counts: the controller reads them from its metrics and shows them in /state
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/metrics", log.read_text()).group(1))
        _served_again(endpoint, 10.0)
        live = lambda: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/state", timeout=5).read())  # noqa: E731
        wait_for(lambda: live()["proxy_rates"].get("alpha"), timeout_s=10, what="HAProxy's rate in /state")

        proxy = json.loads((state_dir / "haproxy.json").read_text())
        os.killpg(proxy["pid"], signal.SIGKILL)  # HAProxy's master and worker
        assert _served_again(endpoint, 10.0) < 10.0
        wait_for(lambda: "proxy" in last()["reason"], timeout_s=10, what="the heal decision")
        assert last()["kind"] == "heal"
        assert json.loads((state_dir / "haproxy.json").read_text())["pid"] != proxy["pid"]
        assert list(load_state(state_dir).instances.values()) == [new]  # the instance was kept

        # 60 idle connections to the state endpoint: at most 16 threads serve them, each for at most 5 s
        before = _threads(ctl.pid)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(60)]
        time.sleep(1.0)
        assert _threads(ctl.pid) <= before + 16
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/state"), timeout_s=8, what="the state endpoint")
        for sock in idle:
            sock.close()
        assert load_controller_state(state_dir).running(time.time())
    finally:
        ctl.terminate()
        ctl.wait()
    stopped = load_controller_state(state_dir)  # SIGTERM: it says so before it exits
    assert stopped.stopped and not stopped.running(time.time())
    assert main(["down", str(plan)]) == 0


def test_rebatch_and_replan_keep_the_plans_batching_and_threads(planned, tmp_path):
    """A plan made with `--batching eager` stays eager when the controller re-sizes its batches: BDA's batch as the
    largest, no queue delay; one made with the default fills its batches. A re-plan keeps the plan's turn_threads
    where the cluster leaves them to the planner."""
    loaded, lm = planned
    folder = loaded.path.parent
    eager_path = tmp_path / "eager.yaml"
    args = ["plan", str(folder / "cluster.yaml"), "--policy", "bda", "--latency-model", str(folder / "lm.json")]
    assert main([*args, "--batching", "eager", "-o", str(eager_path)]) == 0
    eager_plan = load_plan(eager_path).plan
    assert eager_plan.batching == "eager" and loaded.plan.batching == "fill"
    filled, _ = rebatch(with_rates(loaded.plan, {"alpha": 150.0}), lm)
    kept, _ = rebatch(with_rates(eager_plan, {"alpha": 150.0}), lm)
    assert [p.batch for _, p in kept.instances()] == [p.batch for _, p in filled.instances()]
    assert any(p.queue_delay_us > 0 for _, p in filled.instances())
    assert all(p.queue_delay_us == 0 for _, p in kept.instances()) and kept.batching == "eager"
    controller = SimpleNamespace(state=SimpleNamespace(policy="bda"), lm=lm)  # what the re-plan reads of it
    replanned = Controller._replan(controller, load_plan(eager_path), {"alpha": 150.0})
    assert replanned.batching == "eager" and all(p.queue_delay_us == 0 for _, p in replanned.instances())
    edit(eager_path, lambda plan: plan["devices"][0].update(turn_threads="lightest"))
    replanned = Controller._replan(controller, load_plan(eager_path), {"alpha": 150.0})
    assert [d.turn_threads for d in replanned.devices] == ["lightest"]

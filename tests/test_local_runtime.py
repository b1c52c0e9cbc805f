"""Real tritonserver processes: apply, serve, re-apply, change, fail and roll back, stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import yaml

from conftest import edit, make_mlp, make_unloadable, mlp_model, write_cluster
from tritonctl.cli import main
from tritonctl.deploy import share
from tritonctl.deploy.local import LocalRuntime, free_port, proc_stat_fields, process_alive
from tritonctl.deploy.proxy import ARRIVAL_HEADER
from tritonctl.deploy.runtime import InstanceRecord, stop_all
from tritonctl.deploy.state import apply_lock, load_state
from tritonctl.files import sha256_file
from tritonctl.planning.plan import load_plan
from tritonctl.triton.client import endpoints, run_load

pytestmark = pytest.mark.triton  # real tritonserver processes


def state_of(plan_path: Path):
    loaded = load_plan(plan_path)
    return load_state(loaded.resolve(loaded.plan.runtime.state_dir))


def infer(url: str, model: str, x: np.ndarray) -> np.ndarray:
    with grpcclient.InferenceServerClient(url) as client:
        inp = grpcclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer(model, [inp]).as_numpy("y")


def all_stopped(records) -> bool:
    return not any(process_alive(r.pid, r.start_ticks) for r in records)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """Two ONNX models served by two real tritonserver instances sharing one CPU device. Their SLO is one no queue on
    a busy 2-core machine reaches: a request refused as late (runtime.reject_late) is not one a swap lost."""
    folder = tmp_path_factory.mktemp("deploy")
    make_mlp(folder / "mlp.onnx")
    cluster = write_cluster(folder, [mlp_model("alpha", slo_ms=1000), mlp_model("beta", slo_ms=1000)])
    plan = folder / "plan.yaml"
    assert main(["plan", str(cluster), "-o", str(plan)]) == 0
    assert main(["apply", str(plan)]) == 0
    records = list(state_of(plan).instances.values())
    yield plan
    main(["down", str(plan)])
    assert all_stopped(records + list(state_of(plan).instances.values()))


def test_every_model_answers_correctly_through_the_triton_client(deployment):
    plan = load_plan(deployment).plan
    session = ort.InferenceSession(str(load_plan(deployment).resolve(plan.models[0].onnx)))
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    (expected,) = session.run(None, {"x": x})
    for ep in endpoints(plan):
        np.testing.assert_allclose(infer(ep.url, ep.model, x), expected, rtol=1e-5)


def test_instances_run_under_their_cgroup_quota(deployment):
    if share.mechanism() == "none":
        pytest.skip("no writable cgroup on this machine: shares are not enforced (apply says so)")
    for rec in state_of(deployment).instances.values():
        assert rec.cgroup and rec.pid in share.members(Path(rec.cgroup))
        assert share.quota(Path(rec.cgroup)) == (10_000, 10_000)  # 50 of 100 units of 2 cores = 1 core
        assert "quota 10000/10000 us" in rec.share_mechanism


def test_a_process_joins_its_cgroup_before_it_runs_and_keeps_its_pid(tmp_path):
    """The start command writes its own pid to the cgroup, then becomes the program: no preexec function, so
    Popen need not fork() (gRPC core's fork handlers can block a fork for good once clients have been used)."""
    proc = subprocess.run(share.joining(tmp_path, ["/bin/sh", "-c", "echo $$"]), capture_output=True, text=True)
    assert proc.returncode == 0 and (tmp_path / "cgroup.procs").read_text().strip() == proc.stdout.strip()
    assert share.joining(None, ["x"]) == ["x"]
    failed = subprocess.run(share.joining(tmp_path / "gone", ["/bin/true"]), capture_output=True, text=True)
    assert failed.returncode != 0 and "cgroup.procs" in failed.stderr  # not started outside its cgroup


def test_status_and_endpoints(deployment, capsys):
    assert main(["status", str(deployment)]) == 0
    out = capsys.readouterr().out
    assert out.count(" ready ") == 2 and "alpha-0" in out and "beta-0" in out
    assert f"the deployment matches {deployment}" in out  # what runs is what the plan says
    assert main(["endpoints", str(deployment)]) == 0
    out = capsys.readouterr().out
    ports = [m.port for m in load_plan(deployment).plan.models]
    assert all(f"127.0.0.1:{port}" in out for port in ports)


def test_load_generator_measures_real_traffic(deployment):
    results = run_load(endpoints(load_plan(deployment).plan), duration_s=2.0)
    for r in results:
        assert r.sent >= 10 and r.ok == r.sent and not r.errors
        assert 0 < r.percentile(50) < 1000


def test_second_apply_of_the_same_plan_changes_nothing(deployment, capsys):
    before = {uid: rec.pid for uid, rec in state_of(deployment).instances.items()}
    assert main(["apply", str(deployment)]) == 0
    assert "changed 0 instance(s), kept 2" in capsys.readouterr().out
    assert {uid: rec.pid for uid, rec in state_of(deployment).instances.items()} == before


def model_config(record) -> dict:
    with urllib.request.urlopen(f"http://{record.host}:{record.http_port}/v2/models/{record.model}/config") as r:
        return json.loads(r.read())


def edit_plan(plan: Path, **changes) -> None:
    data = yaml.safe_load(plan.read_text())
    data["models"][0]["placements"][0].update(changes)
    plan.write_text(yaml.safe_dump(data, sort_keys=False))


def test_batch_change_reloads_in_place_without_a_restart(deployment, capsys):
    before = state_of(deployment).instances
    edit_plan(deployment, batch=4, queue_delay_us=2000)
    assert main(["status", str(deployment)]) == 0  # healthy, but not what the plan now says
    out = capsys.readouterr().out
    assert f"the deployment differs from {deployment}: `tritonctl apply` would reload alpha-0 " in out
    assert main(["status", str(deployment), "--format", "json"]) == 0
    (step,) = json.loads(capsys.readouterr().out)["pending"]
    assert step["action"] == "reload" and step["instance"] == "alpha-0"
    assert main(["apply", str(deployment), "--dry-run"]) == 1  # something would change
    assert "would change 1 instance(s), kept 1" in capsys.readouterr().out
    assert main(["apply", str(deployment)]) == 0
    out = capsys.readouterr().out
    assert "reloaded alpha-0" in out and "no restart" in out
    assert main(["apply", str(deployment), "--dry-run"]) == 0  # nothing would change now
    after = state_of(deployment).instances
    assert after.keys() == before.keys()  # same processes ...
    assert all(after[uid].pid == before[uid].pid for uid in before)
    (alpha,) = [rec for rec in after.values() if rec.model == "alpha"]
    config = model_config(alpha)  # ... serving the new configuration, warm-up included
    assert config["max_batch_size"] == 4
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert config["model_warmup"][0]["batch_size"] == 4
    x = np.ones((3, 16), np.float32)
    assert infer(f"127.0.0.1:{alpha.grpc_port}", "alpha", x).shape == (3, 4)


def test_port_change_moves_the_address_without_a_restart(deployment, capsys):
    before = state_of(deployment).instances
    data = yaml.safe_load(deployment.read_text())
    old, new = data["models"][0]["port"], free_port("127.0.0.1")
    data["models"][0]["port"] = new
    deployment.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["apply", str(deployment)]) == 0
    out = capsys.readouterr().out
    assert "move   alpha-0" in out and f"moved    alpha-0 to model port {new}, no restart" in out
    after = state_of(deployment).instances
    assert {uid: rec.pid for uid, rec in after.items()} == {uid: rec.pid for uid, rec in before.items()}
    assert infer(f"127.0.0.1:{new}", "alpha", np.ones((1, 16), np.float32)).shape == (1, 4)
    with pytest.raises(ConnectionRefusedError):  # the old address is closed
        socket.create_connection(("127.0.0.1", old), timeout=2).close()
    assert main(["status", str(deployment)]) == 0
    assert f"the deployment matches {deployment}" in capsys.readouterr().out


def test_two_models_trade_ports_without_a_restart(deployment, capsys):
    before = {uid: rec.pid for uid, rec in state_of(deployment).instances.items()}
    data = yaml.safe_load(deployment.read_text())
    first, second = data["models"][0], data["models"][1]
    first["port"], second["port"] = second["port"], first["port"]
    deployment.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["apply", str(deployment)]) == 0
    assert "move   alpha-0" in capsys.readouterr().out
    assert {uid: rec.pid for uid, rec in state_of(deployment).instances.items()} == before
    for model in (first, second):  # each port now answers for the other model
        assert infer(f"127.0.0.1:{model['port']}", model["name"], np.ones((1, 16), np.float32)).shape == (1, 4)


def test_share_change_swaps_only_that_instance(deployment, capsys):
    before = state_of(deployment).instances
    old_share = yaml.safe_load(deployment.read_text())["models"][0]["placements"][0]["share"]
    edit_plan(deployment, share=old_share - 10)
    assert main(["apply", str(deployment)]) == 0
    out = capsys.readouterr().out
    assert "swap   alpha-0" in out and "shadow of" in out and "replaced: traffic moves" in out
    assert out.index("ready    alpha-0") < out.index("stopping alpha-0")  # the new one is warm before the old stops
    after = state_of(deployment).instances
    beta = [uid for uid, rec in before.items() if rec.model == "beta"]
    assert beta and all(uid in after and after[uid].pid == before[uid].pid for uid in beta)
    alpha_new = [rec for rec in after.values() if rec.model == "alpha"]
    assert len(alpha_new) == 1 and alpha_new[0].uid not in before and alpha_new[0].share == old_share - 10
    assert all_stopped([rec for rec in before.values() if rec.model == "alpha"])
    x = np.ones((1, 16), np.float32)
    assert infer(f"127.0.0.1:{alpha_new[0].grpc_port}", "alpha", x).shape == (1, 4)


def test_swaps_and_reloads_under_load_lose_no_request(deployment, capsys):
    """Open-loop traffic to both models while alpha is swapped twice and reloaded: every request answered."""
    results = []
    load = threading.Thread(target=lambda: results.extend(run_load(endpoints(load_plan(deployment).plan), 9.0, 4.0)))
    load.start()
    share = yaml.safe_load(deployment.read_text())["models"][0]["placements"][0]["share"]
    for change in ({"share": share - 5}, {"batch": 2}, {"share": share}):
        time.sleep(1.5)
        edit_plan(deployment, **change)
        assert main(["apply", str(deployment)]) == 0
    load.join()
    out = capsys.readouterr().out
    assert out.count("drained") >= 1 and "reloaded alpha-0" in out
    assert sum(r.sent for r in results) > 100
    assert [r.errors[:1] for r in results] == [[], []]
    assert all(r.ok == r.sent for r in results)


def one_model_deployment(tmp_path: Path) -> tuple[Path, str]:
    make_mlp(tmp_path / "mlp.onnx")
    make_unloadable(tmp_path / "broken.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha")])
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(cluster)]) == 0 and main(["apply", str(plan)]) == 0
    (record,) = state_of(plan).instances.values()
    return plan, f"127.0.0.1:{record.grpc_port}"


def test_swap_to_a_model_that_fails_to_load_keeps_the_old_instance_serving(tmp_path, capsys):
    plan, url = one_model_deployment(tmp_path)
    (old,) = state_of(plan).instances.values()
    data = yaml.safe_load(plan.read_text())
    data["models"][0]["onnx"] = "broken.onnx"  # a new model version that onnxruntime cannot load
    data["models"][0]["onnx_sha256"] = sha256_file(tmp_path / "broken.onnx")
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    repository = tmp_path / "repo"
    loaded_files = {p: p.read_bytes() for p in (repository / "alpha-0").rglob("*") if p.is_file()}
    folder = (repository / "alpha-0").stat().st_ino
    assert main(["apply", str(plan)]) == 3  # failed and rolled back
    assert "rolled back (the running instances keep serving)" in capsys.readouterr().err
    assert list(state_of(plan).instances) == [old.uid]
    assert infer(url, "alpha", np.ones((1, 16), np.float32)).shape == (1, 4)
    # the old instance's repository is what it loaded, not the failed plan's model
    assert {p: p.read_bytes() for p in (repository / "alpha-0").rglob("*") if p.is_file()} == loaded_files
    assert not (repository / ".tritonctl-previous").exists() and (repository / "alpha-0").stat().st_ino == folder
    data["cluster"] = "another-cluster"  # a plan for another cluster, pointed at this deployment's state
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    for verb in ("apply", "status", "down"):  # nor looked at or stopped through it
        assert main([verb, str(plan)]) == 2
        assert "holds the deployment of cluster 'test', not 'another-cluster'" in capsys.readouterr().err
    assert list(state_of(plan).instances) == [old.uid] and process_alive(old.pid, old.start_ticks)
    data["cluster"] = "test"
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["down", str(plan)]) == 0


def test_a_host_change_moves_the_instances_and_haproxy_to_the_new_address(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(write_cluster(tmp_path, [mlp_model("alpha"), mlp_model("beta")]))]) == 0
    assert main(["apply", str(plan)]) == 0
    data = yaml.safe_load(plan.read_text())
    data["runtime"]["host"] = "127.0.0.2"  # loopback too, another address
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        assert main(["apply", str(plan)]) == 0
        assert "swap   alpha-0" in capsys.readouterr().out
        assert {record.host for record in state_of(plan).instances.values()} == {"127.0.0.2"}
        for model in load_plan(plan).plan.models:  # each address reaches the new instances (none stopped)
            x = np.ones((1, 16), np.float32)
            assert infer(f"127.0.0.2:{model.port}", model.name, x).shape == (1, 4)
            with pytest.raises(ConnectionRefusedError):  # HAProxy left the old address
                socket.create_connection(("127.0.0.1", model.port), timeout=2).close()
        assert main(["status", str(plan)]) == 0
        assert f"the deployment matches {plan}" in capsys.readouterr().out
        port = load_plan(plan).plan.models[0].port
        data["runtime"]["host"] = "127.0.0.3"
        plan.write_text(yaml.safe_dump(data, sort_keys=False))
        with socket.socket() as taken:  # another program on that address and port
            taken.bind(("127.0.0.3", port))
            taken.listen()
            for dry_run in (["--dry-run"], []):
                assert main(["apply", str(plan), *dry_run]) == 2
                assert f"port {port} is in use by another process: python" in capsys.readouterr().err
    finally:
        assert main(["down", str(plan)]) == 0


def test_a_plan_edited_into_an_invalid_one_still_shows_and_stops_its_deployment(tmp_path, capsys):
    plan, url = one_model_deployment(tmp_path)
    (record,) = state_of(plan).instances.values()
    (tmp_path / "mlp.onnx").write_bytes(b"replaced")  # its ONNX file changed under it
    capsys.readouterr()
    assert main(["status", str(plan)]) == 0
    out = capsys.readouterr().out
    assert " ready " in out and "cannot compare the deployment with the plan: " in out and "SHA-256" in out
    data = yaml.safe_load(plan.read_text())
    data["models"][0]["placements"][0]["share"] = 150  # more than the device's 100 units
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["status", str(plan)]) == 0
    out = capsys.readouterr().out
    assert f"note: {plan}: instance 'alpha-0': share 150" in out and "records the deployment below" in out
    assert " ready " in out and "alpha-0" in out
    plan.unlink()  # gone: the state folder still names the deployment
    assert main(["status", str(plan)]) == 2 and "cannot read" in capsys.readouterr().err
    assert main(["status", "--state-dir", str(tmp_path / "state")]) == 0
    assert " ready " in capsys.readouterr().out
    assert main(["down", "--state-dir", str(tmp_path / "state")]) == 0
    assert "stopped 1 instance(s)" in capsys.readouterr().out and all_stopped([record])
    assert main(["status", "--state-dir", str(tmp_path / "state")]) == 0
    assert "no instances running" in capsys.readouterr().out


def test_a_running_deployments_repositories_are_not_rendered_over_by_another(tmp_path, capsys):
    plan, _ = one_model_deployment(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    make_mlp(other / "mlp.onnx")
    cluster = write_cluster(other, [mlp_model("beta")])
    edit(cluster, lambda d: d["runtime"].update(repository_dir="../repo"))  # the running deployment's
    assert main(["plan", str(cluster)]) == 0
    config = tmp_path / "repo" / "alpha-0" / "models" / "alpha" / "config.pbtxt"
    before = config.read_text()
    capsys.readouterr()
    for verb in ("render", "apply", "apply --dry-run"):
        rc, err = main([*verb.split(), str(other / "plan.yaml")]), capsys.readouterr().err
        assert rc == 2 and f"{tmp_path / 'repo'} holds the model repositories of the deployment with state in" in err
    assert config.read_text() == before and not (tmp_path / "repo" / "beta-0").exists()
    edit(cluster, lambda d: d["runtime"].update(repository_dir="repo", base_port=load_plan(plan).plan.models[0].port))
    assert main(["plan", str(cluster)]) == 0  # its own folders, the running deployment's model port
    rc, err = main(["apply", str(other / "plan.yaml")]), capsys.readouterr().err
    assert rc == 2 and f"the HAProxy of the deployment with state in {tmp_path / 'state'}" in err
    assert main(["down", str(plan)]) == 0
    edit(cluster, lambda d: d["runtime"].update(repository_dir="../repo"))
    assert main(["plan", str(cluster)]) == 0
    assert main(["render", str(other / "plan.yaml")]) == 0  # that deployment has stopped: the folder is free


def crash_new_instances(plan: Path, known: set[str], count: int) -> threading.Thread:
    """A thread that sends SIGSEGV to the next `count` tritonservers the plan's state records, before they are
    ready (each as soon as it appears)."""

    def crash() -> None:
        deadline = time.monotonic() + 60
        crashed = set(known)
        while len(crashed) < len(known) + count and time.monotonic() < deadline:
            for rec in state_of(plan).instances.values():
                if rec.uid not in crashed:
                    os.kill(rec.pid, signal.SIGSEGV)
                    crashed.add(rec.uid)
            time.sleep(0.02)

    thread = threading.Thread(target=crash)
    thread.start()
    return thread


def test_new_instance_that_crashes_while_starting_is_started_once_more_then_rolled_back(tmp_path, capsys):
    plan, url = one_model_deployment(tmp_path)
    (old,) = state_of(plan).instances.values()
    edit_plan(plan, share=40)
    killer = crash_new_instances(plan, {old.uid}, count=1)  # one crash: the second start serves
    assert main(["apply", str(plan)]) == 0
    killer.join()
    out = capsys.readouterr().out
    assert "crashed  alpha-0 while starting (tritonserver for alpha-0 exited with code -11" in out
    (new,) = state_of(plan).instances.values()
    assert new.share == 40 and new.uid != old.uid and not process_alive(old.pid, old.start_ticks)
    assert infer(url, "alpha", np.ones((1, 16), np.float32)).shape == (1, 4)

    edit_plan(plan, share=50)
    killer = crash_new_instances(plan, {new.uid}, count=2)  # crashes twice: rolled back
    assert main(["apply", str(plan)]) == 3
    killer.join()
    captured = capsys.readouterr()
    assert "starting it once more" in captured.out
    assert "rolled back" in captured.err and "exited with code -11" in captured.err
    assert list(state_of(plan).instances) == [new.uid]
    assert infer(url, "alpha", np.ones((1, 16), np.float32)).shape == (1, 4)
    assert main(["down", str(plan)]) == 0


def test_a_dead_proxy_shows_in_status_and_the_next_apply_restarts_it(tmp_path, capsys):
    plan, url = one_model_deployment(tmp_path)
    proxy = json.loads((tmp_path / "state" / "haproxy.json").read_text())
    os.killpg(proxy["pid"], signal.SIGKILL)  # the master and its worker
    time.sleep(0.2)
    capsys.readouterr()
    assert main(["status", str(plan)]) == 1
    out = capsys.readouterr().out
    assert "proxy: NOT answering" in out and f"differs from {plan}: `tritonctl apply` would start HAProxy" in out
    assert main(["apply", str(plan), "--dry-run"]) == 1  # something would change: HAProxy would start again
    assert "HAProxy was not answering: would be started again" in capsys.readouterr().out
    assert main(["apply", str(plan)]) == 0  # nothing to change but the route: HAProxy comes back
    assert "HAProxy was not answering: started again" in capsys.readouterr().out
    assert main(["status", str(plan)]) == 0
    assert infer(url, "alpha", np.ones((1, 16), np.float32)).shape == (1, 4)
    assert main(["down", str(plan)]) == 0


def test_port_in_use_is_refused_before_anything_starts(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha"), mlp_model("beta")])
    assert main(["plan", str(cluster)]) == 0
    plan = tmp_path / "plan.yaml"
    taken = load_plan(plan).plan.models[1].port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        assert main(["apply", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"port {taken} is in use" in err and "models.beta.port" in err
    assert state_of(plan).instances == {}


def test_model_that_fails_to_load_rolls_back_the_whole_apply(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    make_unloadable(tmp_path / "broken.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("good"), mlp_model("zbroken", source="broken.onnx")])
    assert main(["plan", str(cluster)]) == 0
    plan = tmp_path / "plan.yaml"
    logs = tmp_path / "state" / "logs"
    assert main(["apply", str(plan)]) == 3
    captured = capsys.readouterr()
    assert "ready    good-0" in captured.out  # the good instance did start ...
    assert "apply failed and was rolled back" in captured.err and "zbroken-0" in captured.err
    assert state_of(plan).instances == {}  # ... and was stopped again
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == [".tritonctl-deployment"]  # nothing rendered left
    assert len(list(logs.glob("*.log"))) == 2
    if share.mechanism() != "none":
        assert not list((share.V1_ROOT / "tritonctl").glob("good-0.*"))


def test_tritonserver_that_fails_to_start(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    fake = tmp_path / "tritonserver"
    fake.write_text("#!/bin/sh\necho 'E0000 cannot start: simulated broken install' >&2\nexit 3\n")
    fake.chmod(0o755)
    cluster = write_cluster(tmp_path, [mlp_model("alpha")])
    data = yaml.safe_load(cluster.read_text())
    data["runtime"]["tritonserver"] = str(fake)
    cluster.write_text(yaml.safe_dump(data))
    assert main(["plan", str(cluster)]) == 0
    assert main(["apply", str(tmp_path / "plan.yaml")]) == 3  # failed, rolled back: nothing left running
    err = capsys.readouterr().err
    assert "exited with code 3" in err and "simulated broken install" in err
    assert "(nothing ran before it, nothing runs now)" in err
    assert state_of(tmp_path / "plan.yaml").instances == {}


def test_status_reports_a_dead_instance(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha")])
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(cluster)]) == 0 and main(["apply", str(plan)]) == 0
    (record,) = state_of(plan).instances.values()
    LocalRuntime(None, tmp_path / "state").stop(record)  # kill it behind tritonctl's back
    capsys.readouterr()
    assert main(["status", str(plan)]) == 1
    out = capsys.readouterr().out
    assert " dead " in out
    row = next(line.split() for line in out.splitlines() if line.startswith("alpha-0 "))
    assert row[4:6] == [str(record.grpc_port), str(record.backend_port)]  # the model's address, the instance's own
    assert main(["apply", str(plan)]) == 0  # a re-apply heals it
    (healed,) = state_of(plan).instances.values()
    assert healed.pid != record.pid and process_alive(healed.pid, healed.start_ticks)
    assert main(["down", str(plan)]) == 0
    assert not process_alive(healed.pid, healed.start_ticks)


def test_dry_run_writes_nothing(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha"), mlp_model("beta")])
    assert main(["plan", str(cluster)]) == 0
    assert main(["apply", str(tmp_path / "plan.yaml"), "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert out.count("start  alpha-0") + out.count("start  beta-0") == 2 and "would change 2 instance(s)" in out
    assert not (tmp_path / "repo").exists() and not (tmp_path / "state").exists()


def test_one_apply_at_a_time_and_a_corrupt_state_file(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha")])
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(cluster)]) == 0
    with apply_lock(tmp_path / "state"):
        assert main(["apply", str(plan)]) == 2
    assert "another apply holds the lock (pid" in capsys.readouterr().err
    (tmp_path / "state" / "state.json").write_text("[1, 2")
    assert main(["status", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "state.json: corrupt state file" in err


def burst(url: str, model: str, n: int, headers: dict[str, str] | None = None, features: int = 16) -> list[str]:
    """`n` requests sent at once; the error message of each (empty when answered)."""
    done, outcomes = threading.Semaphore(0), []
    x = np.ones((1, features), np.float32)
    with grpcclient.InferenceServerClient(url) as client:
        for _ in range(n):
            inp = grpcclient.InferInput("x", [1, features], "FP32")
            inp.set_data_from_numpy(x)
            client.async_infer(
                model,
                [inp],
                callback=lambda result, error: (outcomes.append(str(error or "")), done.release()),
                headers=headers,
            )
        for _ in range(n):
            assert done.acquire(timeout=30)
    return outcomes


FEATURES = 1024  # x (1, 1024) @ W (1024, 2048): about a millisecond on one core


def test_reject_late_refuses_what_can_only_be_late(tmp_path):
    """HAProxy stamps every request with its arrival (over any stamp the client sent); with reject_late the
    model's glue refuses, before running it, a request that arrived too long ago to be answered within its
    25 ms SLO, while the instance is overloaded (5% of its requests of the last 10 s, and ten at least, could only
    be late: the tail of a burst of 400), and serves a lone late request on an idle instance (which `always`
    refuses too). Without reject_late every request is answered, late or not. The model takes about a millisecond a
    request, so that a burst queues at the instance (a lighter one is served as fast as the client sends)."""
    make_mlp(tmp_path / "mlp.onnx", features=FEATURES, classes=2048)
    plan = tmp_path / "plan.yaml"
    stale, bursts = {}, {}
    for reject_late in (False, True, "always"):
        model = mlp_model("alpha", slo_ms=25, input={"shape": [FEATURES], "dtype": "float32"})
        cluster = write_cluster(tmp_path, [model])
        spec = yaml.safe_load(cluster.read_text())
        spec["runtime"]["reject_late"] = reject_late
        cluster.write_text(yaml.safe_dump(spec))
        assert main(["plan", str(cluster), "-o", str(plan), "--policy", "spread"]) == 0
        assert main(["apply", str(plan)]) == 0
        (record,) = state_of(plan).instances.values()
        proxy, own = f"127.0.0.1:{record.grpc_port}", f"127.0.0.1:{record.backend_port}"
        a_second_ago = {ARRIVAL_HEADER: f"{1000 * time.time() - 1000:.0f}"}
        now = {ARRIVAL_HEADER: f"{1000 * time.time():.0f}"}
        assert burst(own, "alpha", 1, now, FEATURES) == [""]
        stale[reject_late] = burst(own, "alpha", 1, a_second_ago, FEATURES)[0]  # just after a run: its time is fresh
        assert burst(proxy, "alpha", 1, a_second_ago, FEATURES) == [""]  # the proxy's stamp replaces the client's
        bursts[reject_late] = burst(proxy, "alpha", 400, features=FEATURES)
        # what refused the burst's tail refuses no later request
        assert burst(proxy, "alpha", 1, features=FEATURES) == [""]
        assert main(["down", str(plan)]) == 0
    assert stale[False] == stale[True] == ""  # a lone late request on an idle instance: served late, not refused
    assert "UNAVAILABLE" in stale["always"] and "past the SLO of 25 ms" in stale["always"]
    assert bursts[False] == [""] * 400
    for refusing in (True, "always"):
        refused = [e for e in bursts[refusing] if e]
        assert refused and len(refused) < 400
        assert all("UNAVAILABLE" in e and "past the SLO of 25 ms (runtime.reject_late)" in e for e in refused)


def test_shutdown_kills_a_proxy_that_ignores_sigterm(tmp_path):
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert stubborn.stdout.readline().strip() == b"up"
    ticks = int(proc_stat_fields(stubborn.pid)[19])
    record = {"pid": stubborn.pid, "start_ticks": ticks, "host": "127.0.0.1", "metrics_port": 1}
    (tmp_path / "haproxy.json").write_text(json.dumps(record))
    started = time.monotonic()
    LocalRuntime(None, tmp_path).shutdown()
    assert stubborn.wait(timeout=2) == -signal.SIGKILL and 5 <= time.monotonic() - started < 7
    assert not (tmp_path / "haproxy.json").exists()


def test_instances_stop_all_at_once_each_reported_in_the_callers_thread(tmp_path):
    """`stop_all` (down, apply's stop steps, the profiler's pool): three processes that each take a second to exit
    after SIGTERM, as Triton drains, stop in about one second, not three; each key is reported once, in this thread."""
    slow = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), sys.exit(0))); "
        "print('up', flush=True); time.sleep(60)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", slow], stdout=subprocess.PIPE) for _ in range(3)]
    records = {}
    for k, proc in enumerate(procs):
        assert proc.stdout.readline().strip() == b"up"
        ticks = int(proc_stat_fields(proc.pid)[19])
        records[f"slow-{k}"] = InstanceRecord(
            uid=f"slow-{k}", instance="slow", model="slow", device="cpu0", share=1, units=1, config_hash="",
            host="127.0.0.1", grpc_port=0, http_port=0, metrics_port=0, pid=proc.pid, start_ticks=ticks,
            folder=str(tmp_path), log="", share_mechanism="none",
        )  # fmt: skip
    reported = []
    started = time.monotonic()
    stop_all(LocalRuntime(None, tmp_path), records, lambda key: reported.append((key, threading.current_thread())))
    assert time.monotonic() - started < 2.5
    assert sorted(key for key, _ in reported) == sorted(records)
    assert {thread for _, thread in reported} == {threading.current_thread()}
    assert [proc.wait(timeout=1) for proc in procs] == [0, 0, 0]


def test_an_apply_interrupted_after_a_reload_leaves_the_instance_for_the_next_apply_to_reload(
    tmp_path, capsys, monkeypatch
):
    plan, _ = one_model_deployment(tmp_path)
    original = plan.read_text()
    batch = yaml.safe_load(original)["models"][0]["placements"][0]["batch"]
    edit_plan(plan, batch=batch + 3)
    reconfigure = LocalRuntime.reconfigure

    def interrupted(self, record, timeout_s):  # Ctrl-C just after Triton took the new configuration
        reconfigure(self, record, timeout_s)
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalRuntime, "reconfigure", interrupted)
    assert main(["apply", str(plan)]) == 130
    monkeypatch.undo()
    (record,) = state_of(plan).instances.values()
    assert model_config(record)["max_batch_size"] == batch + 3
    plan.write_text(original)  # back to the plan applied before: the instance no longer runs it
    capsys.readouterr()
    assert main(["apply", str(plan)]) == 0
    assert "reloaded alpha-0" in capsys.readouterr().out
    assert model_config(record)["max_batch_size"] == batch
    assert main(["down", str(plan)]) == 0


def test_an_apply_interrupted_while_haproxy_starts_leaves_no_haproxy(tmp_path, capsys, monkeypatch):
    from tritonctl.deploy.proxy import ProxyApi

    make_mlp(tmp_path / "mlp.onnx")
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(write_cluster(tmp_path, [mlp_model("alpha")])), "-o", str(plan)]) == 0
    started = []
    popen = subprocess.Popen

    def watched(args, *rest, **kwargs):  # note HAProxy's pid as it starts
        proc = popen(args, *rest, **kwargs)
        if any("haproxy" in str(a) for a in args):
            started.append(proc)
        return proc

    def interrupted(self):  # Ctrl-C while waiting for its runtime API
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "Popen", watched)
    monkeypatch.setattr(ProxyApi, "answers", interrupted)
    assert main(["apply", str(plan)]) == 130
    monkeypatch.undo()
    assert started
    for proc in started:
        proc.wait(timeout=10)  # stopped, not left running (else TimeoutExpired)
    assert main(["apply", str(plan)]) == 0  # its port is free again
    assert main(["down", str(plan)]) == 0

"""The Compose target: a valid project whose services match the plan, refusals that write nothing,
and the Compose runtime's dry-run command sequence for a shadow swap. No Docker engine needed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import REPO, make_mlp, mlp_model, write_cluster
from tritonctl.apply import apply_plan
from tritonctl.cli import main
from tritonctl.compose import LABEL, write_compose
from tritonctl.errors import TritonctlError
from tritonctl.plan import load_plan
from tritonctl.runtime.base import StartError
from tritonctl.runtime.compose import CommandRunner, ComposeRuntime, Outcome
from tritonctl.state import load_state

SCHEMA = REPO.parent / "shared" / "schemas" / "compose-spec.json"
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def edit(path: Path, change) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.fixture
def gpu_plan(tmp_path: Path) -> Path:
    """Three models on two GPUs; alpha has a second replica on gpu1 (same gRPC port, own service)."""
    make_mlp(tmp_path / "mlp.onnx")
    gpus = [{"kind": "gpu", "count": 2, "units": 100, "memory_mb": 8000}]
    cluster = write_cluster(tmp_path, [mlp_model(n) for n in ("alpha", "beta", "gamma")], devices=gpus)
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(cluster), "-o", str(plan)]) == 0

    def add_replica(data):
        beta = next(m for m in data["models"] if m["name"] == "beta")
        beta["placements"][0]["share"] = 60
        alpha = next(m for m in data["models"] if m["name"] == "alpha")
        alpha["placements"].append({**alpha["placements"][0], "instance": "alpha-1", "device": "gpu1", "share": 40})

    edit(plan, add_replica)
    return plan


def render(plan: Path, out: Path, *extra: str) -> int:
    return main(["render", str(plan), "--target", "compose", "-o", str(out), "--gpus", "2", *extra])


def read_env(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def triton_services(project: dict) -> dict[str, dict]:
    """Triton services by instance name."""
    return {s["labels"][f"{LABEL}.instance"]: s for s in project["services"].values() if "labels" in s}


def test_project_is_valid_compose_and_every_reference_resolves(gpu_plan, tmp_path):
    out = tmp_path / "out"
    assert render(gpu_plan, out) == 0
    text = (out / "compose.yaml").read_text()
    project = yaml.safe_load(text)
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(project)

    services = project["services"]
    for name, spec in services.items():
        for volume in spec.get("volumes", []):
            if volume["type"] == "volume":
                assert volume["source"] in project["volumes"], (name, volume)
        assert set(spec.get("depends_on", {})) <= set(services), name
        assert set(spec.get("networks", [])) <= set(project["networks"]), name
        if spec.get("ipc", "").startswith("service:"):
            assert spec["ipc"].removeprefix("service:") in services, name
    env = read_env(out / ".env")
    for var, default in VAR.findall(text):
        assert var in env, f"${{{var}}} has no value in .env"
        assert default == env[var], f"{var}: compose.yaml's default {default!r} is not .env's {env[var]!r}"
    for spec in triton_services(project).values():  # the model repositories the binds name exist
        source = spec["volumes"][0]["source"].replace("${MODEL_REPOSITORY:-./repository}", str(out / "repository"))
        assert (Path(source) / spec["labels"][f"{LABEL}.model"] / "config.pbtxt").is_file()
    sidecar = services["tritonctl-sidecar"]
    assert (Path(env["TRITONCTL_SRC"]) / sidecar["build"]["dockerfile"]).is_file()
    assert "/var/run/docker.sock" in [v["target"] for v in sidecar["volumes"]]
    proxied = services["tritonctl-sidecar-proxied"]
    assert "/var/run/docker.sock" not in [v["target"] for v in proxied["volumes"]]
    assert services["docker-socket-proxy"]["profiles"] == proxied["profiles"] == ["sidecar-proxied"]
    assert "COMPOSE_PROFILES" in env and env["COMPOSE_PROFILES"] == sidecar["profiles"][0]


def test_triton_services_carry_the_plans_shares_gpus_and_ports(gpu_plan, tmp_path):
    out = tmp_path / "out"
    assert render(gpu_plan, out) == 0
    project = yaml.safe_load((out / "compose.yaml").read_text())
    services = triton_services(project)
    plan = load_plan(gpu_plan).plan
    assert set(services) == {p.instance for _, p in plan.instances()} and "alpha-1" in services
    instance_ports = []
    for model, placement in plan.instances():
        spec = services[placement.instance]
        assert spec["environment"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(placement.share)
        assert "CUDA_VISIBLE_DEVICES" not in spec["environment"]  # the container sees its one GPU as 0
        (device,) = spec["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert device["device_ids"] == [str(plan.device(placement.device).index)]
        command = spec["command"]
        assert f"--grpc-port={model.port}" in command and "--reuse-grpc-port=true" in command
        assert "--model-control-mode=explicit" in command and f"--load-model={model.name}" in command
        assert spec["network_mode"] == "host" and spec["ipc"] == "service:mps-daemon"
        assert spec["volumes"][0]["read_only"] is True and spec["volumes"][0]["target"] == "/models"
        http, metrics = int(spec["labels"][f"{LABEL}.http-port"]), int(spec["labels"][f"{LABEL}.metrics-port"])
        assert f"--http-port={http}" in command and f"--metrics-port={metrics}" in command
        assert spec["healthcheck"]["test"][-1].endswith(f":{http}/v2/health/ready")
        assert spec["depends_on"]["mps-daemon"]["condition"] == "service_healthy"
        instance_ports += [http, metrics]
    assert len(set(instance_ports)) == len(instance_ports)
    assert not set(instance_ports) & {m.port for m in plan.models}
    assert services["alpha-0"]["labels"][f"{LABEL}.grpc-port"] == services["alpha-1"]["labels"][f"{LABEL}.grpc-port"]
    daemon = project["services"]["mps-daemon"]
    assert daemon["entrypoint"] == ["nvidia-cuda-mps-control", "-f"] and daemon["ipc"] == "shareable"
    assert daemon["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0", "1"]


def test_rerender_is_stable_and_a_changed_instance_gets_ports_clear_of_the_running_one(gpu_plan, tmp_path):
    out = tmp_path / "out"
    assert render(gpu_plan, out) == 0
    first = (out / "compose.yaml").read_text()
    assert render(gpu_plan, out) == 0
    assert (out / "compose.yaml").read_text() == first
    before = yaml.safe_load(first)["services"]

    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(batch=4))  # a reload: same service
    assert render(gpu_plan, out) == 0
    assert yaml.safe_load((out / "compose.yaml").read_text())["services"].keys() == before.keys()
    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(share=45))  # a new process: new service
    assert render(gpu_plan, out) == 0
    after = yaml.safe_load((out / "compose.yaml").read_text())["services"]
    changed = yaml.safe_load(gpu_plan.read_text())["models"][0]["placements"][0]["instance"]
    old = [n for n, s in before.items() if s.get("labels", {}).get(f"{LABEL}.instance") == changed]
    new = [n for n, s in after.items() if s.get("labels", {}).get(f"{LABEL}.instance") == changed]
    assert old and new and old != new
    assert all(after[name] == spec for name, spec in before.items() if name not in old)
    held = {
        int(s["labels"][f"{LABEL}.{k}-port"]) for s in before.values() if "labels" in s for k in ("http", "metrics")
    }
    assert not {int(after[new[0]]["labels"][f"{LABEL}.{k}-port"]) for k in ("http", "metrics")} & held


def _gpus_1(plan: Path) -> list[str]:
    return ["--gpus", "1"]


def _share(value: int, units: int = 100):
    def change(plan: Path) -> list[str]:
        def set_share(data):
            data["devices"][0]["units"] = units
            data["models"][0]["placements"][0].update(device=data["devices"][0]["id"], share=value)

        edit(plan, set_share)
        return []

    return change


def _same_port(plan: Path) -> list[str]:
    edit(plan, lambda d: d["models"][1].update(port=d["models"][0]["port"]))
    return []


@pytest.mark.parametrize(
    "change, words",
    [
        (_gpus_1, ["devices[1].index", "host has 1 GPU"]),
        (_share(0), ["placements[0].share", "greater than or equal to 1"]),
        (_share(150), ["shares add up to"]),
        (_share(3, units=1000), ["placements[0].share", "percentage of 0", "1-100"]),
        (_same_port, ["is used by another model"]),
    ],
    ids=["more-gpus-than-the-host", "share-0", "share-over-100", "share-rounds-to-0", "two-models-one-port"],
)
def test_bad_plan_is_refused_and_nothing_is_written(gpu_plan, tmp_path, capsys, change, words):
    extra = change(gpu_plan)
    out = tmp_path / "out"
    capsys.readouterr()
    assert render(gpu_plan, out, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {gpu_plan}") and err.count("\n") == 1
    assert all(w in err for w in words), err
    assert not out.exists()


def test_cpu_plan_is_refused_for_the_compose_target(mlp_cluster, tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(mlp_cluster), "-o", str(plan)]) == 0
    assert main(["render", str(plan), "--target", "compose", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{plan}: target:" in err and "GPU plans" in err
    assert not (tmp_path / "out").exists()


def test_model_port_on_a_running_services_http_port_is_refused(gpu_plan, tmp_path, capsys):
    out = tmp_path / "out"
    assert render(gpu_plan, out) == 0
    text = (out / "compose.yaml").read_text()
    busy = next(s for s in yaml.safe_load(text)["services"].values() if "labels" in s)
    http = int(busy["labels"][f"{LABEL}.http-port"])
    edit(gpu_plan, lambda d: d["models"][2].update(port=http))
    assert render(gpu_plan, out) == 2
    err = capsys.readouterr().err
    assert "models[2].port" in err and f"port {http} is held by service" in err
    assert (out / "compose.yaml").read_text() == text


def _swap_setup(gpu_plan: Path, out: Path, outcome=None):
    """Render, start alpha-0, change its share, re-render: (runtime, old record, new launch)."""
    lines: list[str] = []
    runner = CommandRunner(dry_run=True, log=lines.append)
    project = write_compose(load_plan(gpu_plan), out, 2)
    runtime = ComposeRuntime(out / "compose.yaml", runner)
    old = runtime.start(project.services["alpha-0"].launch, out, "127.0.0.1", out, 30)
    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(share=45))
    new = write_compose(load_plan(gpu_plan), out, 2).services["alpha-0"]
    runner.steps.clear()
    lines.clear()
    if outcome:
        runner.dry_outcome = outcome
    return runtime, old, new, lines


def test_shadow_swap_starts_and_waits_for_the_new_service_before_retiring_the_old(gpu_plan, tmp_path):
    runtime, old, new, lines = _swap_setup(gpu_plan, tmp_path / "out")
    record = runtime.start(new.launch, tmp_path, "127.0.0.1", tmp_path, 30)
    runtime.stop(old)
    old_service = old.uid.rsplit(".", 1)[0]
    assert old_service != new.name and record.grpc_port == old.grpc_port and record.http_port != old.http_port
    compose = ["docker", "compose", "-p", "tritonctl-test"]
    assert runtime.runner.steps == [
        [*compose, "-f", str(tmp_path / "out" / "compose.yaml"), "up", "-d", "--no-deps", "--force-recreate", new.name],
        ["wait-ready", f"http://127.0.0.1:{new.http_port}/v2/models/alpha/ready", "30"],
        [*compose, "stop", "--timeout", "15", old_service],
        [*compose, "rm", "--force", old_service],
    ]
    assert len(lines) == 4 and all(line.startswith("+ ") for line in lines)


@pytest.mark.parametrize("failing", ["up", "wait-ready"])
def test_failed_start_of_the_new_service_leaves_the_old_untouched(gpu_plan, tmp_path, failing):
    runtime, old, new, _ = _swap_setup(gpu_plan, tmp_path / "out", lambda step: Outcome(failing not in step, "log"))
    with pytest.raises(StartError, match=new.name):
        runtime.start(new.launch, tmp_path, "127.0.0.1", tmp_path, 30)
    steps = runtime.runner.steps
    assert steps[0][-1] == new.name and steps[-1][-4:] == ["rm", "--stop", "--force", new.name]
    assert not any(old.uid.rsplit(".", 1)[0] in " ".join(step) for step in steps)


def test_apply_through_the_compose_runtime_replaces_only_the_changed_instance(gpu_plan, tmp_path):
    """The apply logic drives the Compose runtime as it drives the local one (runner in dry-run mode)."""
    out = tmp_path / "out"
    runner = CommandRunner(dry_run=True, log=lambda _: None)
    write_compose(load_plan(gpu_plan), out, 2)
    runtime = ComposeRuntime(out / "compose.yaml", runner)
    apply_plan(load_plan(gpu_plan), runtime, log=lambda _: None)
    state_dir = load_plan(gpu_plan).state_dir
    before = load_state(state_dir).instances

    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(share=45))
    write_compose(load_plan(gpu_plan), out, 2)
    runner.steps.clear()
    apply_plan(load_plan(gpu_plan), runtime, log=lambda _: None)
    changes = [step[-1] if step[0] == "docker" else step[0] for step in runner.steps if "ps" not in step]
    changes = [c for c in changes if c != "probe"]
    (old,) = [r for r in before.values() if r.instance == "alpha-0"]
    (new,) = [r for r in load_state(state_dir).instances.values() if r.instance == "alpha-0"]
    old_service, new_service = old.uid.rsplit(".", 1)[0], new.uid.rsplit(".", 1)[0]
    assert changes == [new_service, "wait-ready", old_service, old_service]
    assert {u for u in load_state(state_dir).instances} == {u for u in before if u != old.uid} | {new.uid}

    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(share=40))
    write_compose(load_plan(gpu_plan), out, 2)
    runner.dry_outcome = lambda step: Outcome("up" not in step, "dry-run")
    with pytest.raises(TritonctlError, match="rolled back"):
        apply_plan(load_plan(gpu_plan), runtime, log=lambda _: None)
    assert new.uid in load_state(state_dir).instances

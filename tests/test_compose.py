"""The Compose target: a valid project whose services match the plan, refusals that write nothing,
and the Compose runtime's dry-run command sequences for the swap scenarios the local runtime
passes (through `tritonctl apply --runtime compose --dry-run` where it can). No Docker engine needed."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import REPO, edit
from tritonctl.cli import main
from tritonctl.deploy import mps
from tritonctl.deploy.apply import apply_plan, down
from tritonctl.deploy.compose import CommandRunner, ComposeRuntime, Outcome
from tritonctl.deploy.compose_project import LABEL, write_compose
from tritonctl.deploy.local import haproxy_binary
from tritonctl.deploy.proxy import BUFFER_BYTES, LARGE_BUFFER_BYTES, MALLOC_ENV
from tritonctl.deploy.runtime import StartError
from tritonctl.deploy.state import load_state
from tritonctl.errors import TritonctlError
from tritonctl.planning.plan import load_plan
from tritonctl.triton.render import render as render_plan

SCHEMA = REPO.parent / "shared" / "schemas" / "compose-spec.json"
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


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
    assert sidecar["command"][:3] == [f"${{PLAN_FILE:-{gpu_plan}}}", "--runtime", "compose"]
    assert sidecar["depends_on"]["haproxy"]["condition"] == "service_started"
    mounts = {Path(v["source"]): v.get("read_only", False) for v in sidecar["volumes"] if v["type"] == "bind"}
    mounts.pop(Path("${DOCKER_SOCKET:-/var/run/docker.sock}"))
    # the sidecar sees the plan (read-only), the project and the state (read-write) at their host paths
    assert mounts == {gpu_plan.parent: True, out: False, load_plan(gpu_plan).state_dir: False}
    assert sidecar["working_dir"] == str(gpu_plan.parent)
    proxy = services["haproxy"]
    assert (
        proxy["network_mode"] == "host"
        and "profiles" not in proxy
        and proxy["image"] == "${HAPROXY_IMAGE:-haproxy:3.0}"
        and proxy["environment"] == MALLOC_ENV
    )
    (config,) = proxy["volumes"]
    assert config["source"] == "./haproxy" and config["read_only"] and config["target"] == "/usr/local/etc/haproxy"
    assert env["PROXY_ADDRESS"] == "0.0.0.0" and env["PROXY_API_ADDRESS"] == env["TRITON_GRPC_ADDRESS"] == "127.0.0.1"
    cfg = out / "haproxy" / "haproxy.cfg"
    checked = subprocess.run([haproxy_binary(), "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    text = cfg.read_text()
    assert "stats socket ipv4@127.0.0.1:18090" in text and "bind 127.0.0.1:18091" in text
    assert f"tune.bufsize {LARGE_BUFFER_BYTES}\n" in text
    for model in load_plan(gpu_plan).plan.models:
        assert f"bind 0.0.0.0:{model.port} proto h2" in text
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
        grpc = int(spec["labels"][f"{LABEL}.grpc-port"])  # its own: the model's port is HAProxy's
        assert f"--grpc-port={grpc}" in command and not any("reuse" in arg for arg in command)
        assert spec["labels"][f"{LABEL}.model-port"] == str(model.port) and spec["profiles"] == ["triton"]
        assert "--model-control-mode=explicit" in command and f"--load-model={model.name}" in command
        assert spec["network_mode"] == "host" and spec["ipc"] == "service:mps-daemon"
        assert spec["volumes"][0]["read_only"] is True and spec["volumes"][0]["target"] == "/models"
        http, metrics = int(spec["labels"][f"{LABEL}.http-port"]), int(spec["labels"][f"{LABEL}.metrics-port"])
        assert f"--http-port={http}" in command and f"--metrics-port={metrics}" in command
        assert spec["healthcheck"]["test"][-1].endswith(f":{http}/v2/health/ready")
        assert spec["depends_on"]["mps-daemon"]["condition"] == "service_healthy"
        instance_ports += [grpc, http, metrics]
    assert len(set(instance_ports)) == len(instance_ports)
    assert not set(instance_ports) & (
        {m.port for m in plan.models}
        | {int(read_env(out / ".env")[k]) for k in ("PROXY_API_PORT", "PROXY_METRICS_PORT")}
    )
    assert services["alpha-0"]["labels"][f"{LABEL}.model-port"] == services["alpha-1"]["labels"][f"{LABEL}.model-port"]
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
    kinds = ("grpc", "http", "metrics")
    held = {int(s["labels"][f"{LABEL}.{k}-port"]) for s in before.values() if "labels" in s for k in kinds}
    assert not {int(after[new[0]]["labels"][f"{LABEL}.{k}-port"]) for k in kinds} & held


def test_rerender_keeps_the_operators_env_values(gpu_plan, tmp_path):
    out = tmp_path / "out"
    assert render(gpu_plan, out) == 0
    env = (out / ".env").read_text()
    (out / ".env").write_text(env.replace("TRITON_TAG=24.10-py3", "TRITON_TAG=25.01-py3"))
    assert render(gpu_plan, out) == 0
    assert read_env(out / ".env")["TRITON_TAG"] == "25.01-py3"


def test_haproxys_buffers_follow_the_image_the_operator_names(gpu_plan, tmp_path):
    out = tmp_path / "out"
    assert render(gpu_plan, out) == 0
    env = (out / ".env").read_text()
    (out / ".env").write_text(env.replace("HAPROXY_IMAGE=haproxy:3.0", "HAPROXY_IMAGE=haproxy:2.6"))
    assert render(gpu_plan, out) == 0  # 2.6 aborts on a shadow swap with buffers of a whole request
    assert f"tune.bufsize {BUFFER_BYTES}\n" in (out / "haproxy" / "haproxy.cfg").read_text()
    proxy = yaml.safe_load((out / "compose.yaml").read_text())["services"]["haproxy"]
    assert proxy["image"] == "${HAPROXY_IMAGE:-haproxy:2.6}" and proxy["environment"] == MALLOC_ENV


def sidecar(out: Path) -> dict:
    return yaml.safe_load((out / "compose.yaml").read_text())["services"]["tritonctl-sidecar"]


def test_the_sidecar_replans_with_the_latency_model_it_was_rendered_with(gpu_plan, tmp_path, synthetic_lm, capsys):
    out = tmp_path / "out"
    assert render(gpu_plan, out) == 0
    assert "--latency-model" not in sidecar(out)["command"]
    assert "the sidecar will follow the plan file and report rates, not re-plan" in capsys.readouterr().out

    assert render(gpu_plan, out, "--latency-model", str(synthetic_lm)) == 0
    command = sidecar(out)["command"]
    assert command[-2:] == ["--latency-model", f"${{LATENCY_MODEL:-{synthetic_lm}}}"]
    assert read_env(out / ".env")["LATENCY_MODEL"] == str(synthetic_lm)
    binds = {v["source"]: v.get("read_only", False) for v in sidecar(out)["volumes"] if v["type"] == "bind"}
    assert binds[str(synthetic_lm.parent)] is True
    for service in ("tritonctl-sidecar", "tritonctl-sidecar-proxied"):
        assert yaml.safe_load((out / "compose.yaml").read_text())["services"][service]["command"] == command

    assert render(gpu_plan, out) == 0  # a re-render (as apply does) keeps it
    assert sidecar(out)["command"] == command


def test_a_bad_latency_model_for_the_sidecar_is_refused_before_anything_is_written(gpu_plan, tmp_path, capsys):
    (tmp_path / "lm.json").write_text("{}")
    assert render(gpu_plan, tmp_path / "out", "--latency-model", str(tmp_path / "lm.json")) == 2
    assert "lm.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("port", "holder"),
    [
        (18090, "HAProxy's PROXY_API_PORT"),
        (18091, "HAProxy's PROXY_METRICS_PORT"),
        (2375, "the socket proxy's SOCKET_PROXY_PORT"),
        (9300, "the sidecar's state endpoint"),
    ],
)
def test_a_model_port_on_a_port_of_the_projects_own_services_is_refused(gpu_plan, tmp_path, capsys, port, holder):
    edit(gpu_plan, lambda d: d["models"][1].update(port=port))
    assert render(gpu_plan, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "models[1].port" in err and f"port {port} is {holder}" in err and not (tmp_path / "out").exists()


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
        (_share(150), ["share 150 is more than", "100 units"]),
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


COMPOSE = ["docker", "compose", "-p", "tritonctl-test"]


def _service(runtime: ComposeRuntime, instance: str):
    return next(s for s in runtime.services.values() if s.launch.instance == instance)


def _swap_setup(gpu_plan: Path, out: Path, outcome=None):
    """Render, start alpha-0, change its share and prepare again: (runtime, old record, new service, lines)."""
    lines: list[str] = []
    runner = CommandRunner(dry_run=True, log=lines.append)
    write_compose(load_plan(gpu_plan), out, 2)
    runtime = ComposeRuntime(out, runner, gpus=2)
    runtime.prepare(load_plan(gpu_plan), write=True)
    old = runtime.start(_service(runtime, "alpha-0").launch, out, "127.0.0.1", out, 30)
    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(share=45))
    runtime.prepare(load_plan(gpu_plan), write=True)
    runner.steps.clear()
    lines.clear()
    if outcome:
        runner.dry_outcome = outcome
    return runtime, old, _service(runtime, "alpha-0"), lines


def test_shadow_swap_starts_and_waits_for_the_new_service_before_retiring_the_old(gpu_plan, tmp_path):
    runtime, old, new, lines = _swap_setup(gpu_plan, tmp_path / "out")
    record = runtime.start(new.launch, tmp_path, "127.0.0.1", tmp_path, 30)
    runtime.route("127.0.0.1", record.grpc_port, [(record, 1.0)])
    runtime.stop(old)
    old_service = old.uid.rsplit(".", 1)[0]
    assert old_service != new.name and record.grpc_port == old.grpc_port
    assert record.backend_port == new.grpc_port != old.backend_port and record.http_port != old.http_port
    api = "127.0.0.1:18090"
    assert runtime.runner.steps == [
        [*COMPOSE, "-f", str(tmp_path / "out" / "compose.yaml"), "up", "-d", "--no-deps", "--force-recreate", new.name],
        ["wait-ready", f"http://127.0.0.1:{new.http_port}/v2/models/alpha/ready", "30"],
        [*COMPOSE, "-f", str(tmp_path / "out" / "compose.yaml"), "up", "-d", "--no-deps", "haproxy"],
        ["proxy", api, "show stat -1 1 -1"],
        ["proxy", api, f"set servers of port{record.grpc_port}: ['{new.name}']"],
        [*COMPOSE, "stop", "--timeout", "15", old_service],
        [*COMPOSE, "rm", "--force", old_service],
    ]
    assert len(lines) == 7 and all(line.startswith("+ ") for line in lines)


@pytest.mark.parametrize("failing", ["up", "wait-ready"])
def test_failed_start_of_the_new_service_leaves_the_old_untouched(gpu_plan, tmp_path, failing):
    runtime, old, new, _ = _swap_setup(gpu_plan, tmp_path / "out", lambda step: Outcome(failing not in step, "log"))
    with pytest.raises(StartError, match=new.name):
        runtime.start(new.launch, tmp_path, "127.0.0.1", tmp_path, 30)
    steps = runtime.runner.steps
    assert steps[0][-1] == new.name and steps[-1][-4:] == ["rm", "--stop", "--force", new.name]
    assert not any(old.uid.rsplit(".", 1)[0] in " ".join(step) for step in steps)


# ---- the same scenarios through the CLI's dry run --------------------------------------


def _deploy(gpu_plan: Path, runner: CommandRunner | None = None) -> ComposeRuntime:
    """Render into compose/ beside the plan and apply it through a dry runner: a recorded deployment."""
    assert render(gpu_plan, gpu_plan.parent / "compose") == 0
    runtime = ComposeRuntime(gpu_plan.parent / "compose", runner or CommandRunner(dry_run=True, log=lambda _: None))
    apply_plan(load_plan(gpu_plan), runtime, log=lambda _: None)
    return runtime


def _dry(capsys, *argv: str) -> list[str]:
    """What `tritonctl ARGV --dry-run` says it would run (the "+ " lines, without the "+ ")."""
    capsys.readouterr()
    assert main([*argv, "--dry-run"]) == (1 if argv[0] == "apply" else 0)  # an apply that would change something
    return [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("+ ")]


def _at(lines: list[str], *words: str) -> int:
    """Index of the only line with every word."""
    (index,) = [i for i, line in enumerate(lines) if all(w in line for w in words)]
    return index


def _snapshot(gpu_plan: Path) -> tuple[str, str]:
    """The state file and compose.yaml: a dry run changes neither."""
    state = load_plan(gpu_plan).state_dir / "state.json"
    return state.read_text() if state.exists() else "", (gpu_plan.parent / "compose" / "compose.yaml").read_text()


def test_dry_run_of_a_new_deployment_starts_every_service_then_routes(gpu_plan, capsys):
    assert render(gpu_plan, gpu_plan.parent / "compose") == 0
    before = _snapshot(gpu_plan)
    lines = _dry(capsys, "apply", str(gpu_plan), "--runtime", "compose")
    services = write_compose(load_plan(gpu_plan), gpu_plan.parent / "compose", 2, write=False).services
    for service in services.values():
        assert _at(lines, "up -d --no-deps --force-recreate", service.name) < _at(lines, f":{service.http_port}/")
    proxy = _at(lines, "up -d --no-deps haproxy")
    assert proxy > max(_at(lines, f":{s.http_port}/") for s in services.values())
    for model in load_plan(gpu_plan).plan.models:
        names = [s.name for s in services.values() if s.launch.model == model.name]
        assert _at(lines, f"HAProxy 127.0.0.1:18090: set servers of port{model.port}: {names}") > proxy
    assert not any(" stop " in line for line in lines)
    assert _snapshot(gpu_plan) == before


def test_dry_run_of_a_share_change_switches_the_route_before_stopping_the_old_service(gpu_plan, capsys):
    runtime = _deploy(gpu_plan)
    (old,) = [r for r in load_state(load_plan(gpu_plan).state_dir).instances.values() if r.instance == "alpha-0"]
    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(share=45))
    before = _snapshot(gpu_plan)
    lines = _dry(capsys, "apply", str(gpu_plan), "--runtime", "compose")
    new = write_compose(load_plan(gpu_plan), runtime.folder, 2, write=False).services["alpha-0"]
    old_service = old.uid.rsplit(".", 1)[0]
    started = _at(lines, "--force-recreate")  # the only Triton service started: alpha-0's new one
    assert lines[started].endswith(new.name)
    switch = _at(lines, f"set servers of port{old.grpc_port}")
    assert new.name in lines[switch] and old_service not in lines[switch]
    assert started < _at(lines, f":{new.http_port}/v2/models/alpha/ready") < switch
    assert switch < _at(lines, "stop --timeout", old_service) < _at(lines, "rm --force", old_service)
    assert _snapshot(gpu_plan) == before


def test_dry_run_of_a_batch_change_reloads_in_place(gpu_plan, capsys):
    _deploy(gpu_plan)
    (old,) = [r for r in load_state(load_plan(gpu_plan).state_dir).instances.values() if r.instance == "alpha-0"]
    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(batch=4))
    lines = _dry(capsys, "apply", str(gpu_plan), "--runtime", "compose")
    reload = f"POST http://127.0.0.1:{old.http_port}/v2/repository/models/alpha/load"
    assert sum(reload in line for line in lines) == 1
    assert not any("--force-recreate" in line or " stop " in line for line in lines)


def test_failed_start_in_apply_rolls_back_and_leaves_the_old_service_serving(gpu_plan):
    runner = CommandRunner(dry_run=True, log=lambda _: None)
    _deploy(gpu_plan, runner)
    state_dir = load_plan(gpu_plan).state_dir
    before = load_state(state_dir).instances
    (old,) = [r for r in before.values() if r.instance == "alpha-0"]
    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(share=45))
    runner.steps.clear()
    runner.dry_outcome = lambda step: Outcome("--force-recreate" not in step, "dry-run", "no such image")
    with pytest.raises(TritonctlError, match="rolled back.*no such image"):
        apply_plan(load_plan(gpu_plan), ComposeRuntime(gpu_plan.parent / "compose", runner), log=lambda _: None)
    assert load_state(state_dir).instances.keys() == before.keys()
    assert runner.steps[-1][-3:] == ["--stop", "--force", runner.steps[-2][-1]]  # the new service, removed
    retire = [step for step in runner.steps if old.uid.rsplit(".", 1)[0] in step and {"stop", "rm"} & set(step)]
    assert not retire and not any(step[0] == "proxy" for step in runner.steps)  # the routes never moved


def test_down_closes_the_routes_stops_every_service_then_the_proxy(gpu_plan, capsys):
    runner = CommandRunner(dry_run=True, log=lambda _: None)
    _deploy(gpu_plan, runner)
    state_dir = load_plan(gpu_plan).state_dir
    records = load_state(state_dir).instances.values()
    before = _snapshot(gpu_plan)
    lines = _dry(capsys, "down", str(gpu_plan))
    assert _snapshot(gpu_plan) == before
    closes = [_at(lines, f"set servers of port{port}: []") for port in {r.grpc_port for r in records}]
    stops = [_at(lines, "stop --timeout", r.uid.rsplit(".", 1)[0]) for r in records]
    assert max(closes) < min(stops) and max(stops) < _at(lines, "stop haproxy") < _at(lines, "rm --force haproxy")

    assert down(state_dir, ComposeRuntime(gpu_plan.parent / "compose", runner), log=lambda _: None) == len(records)
    assert not load_state(state_dir).instances


def test_status_asks_the_compose_runtime(gpu_plan, capsys):
    _deploy(gpu_plan)
    capsys.readouterr()
    assert main(["status", str(gpu_plan)]) == 1  # no Docker engine here: every service reads as dead
    out = capsys.readouterr().out
    assert "by the compose runtime" in out and out.count(" dead ") == 4


def test_apply_without_a_rendered_project_is_refused(gpu_plan, tmp_path, capsys):
    assert main(["apply", str(gpu_plan), "--runtime", "compose", "--compose-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Compose project" in err and "--target compose" in err


def test_a_gpu_taken_in_turns_runs_its_instances_without_mps(gpu_plan, tmp_path):
    """Instances taking turns with a whole GPU are processes of their own (no MPS client settings, no daemon's
    IPC); the daemon serves the GPUs split into shares alone, and none is rendered where no GPU is split."""

    def turns_on(*gpus: str):
        def change(data):
            data["turns"] = list(gpus)
            for model in data["models"]:
                for placement in model["placements"]:
                    if placement["device"] in gpus:
                        placement["share"] = 100

        return change

    edit(gpu_plan, turns_on("gpu1"))
    launches = {i: launch for i, (_, launch) in render_plan(load_plan(gpu_plan), write=False).items()}
    plan = load_plan(gpu_plan).plan
    assert mps.needed(plan)
    for _, placement in plan.instances():
        launch = launches[placement.instance]
        assert mps.client(launch) == (placement.device == "gpu0")
        assert launch.env["CUDA_VISIBLE_DEVICES"] == str(plan.device(placement.device).index)
        assert mps.share_mechanism(launch) == (
            f"MPS {placement.share}%" if placement.device == "gpu0" else "whole GPU in turns, no MPS"
        )
    out = tmp_path / "out"
    assert render(gpu_plan, out) == 0
    project = yaml.safe_load((out / "compose.yaml").read_text())
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(project)
    for placement in (p for _, p in plan.instances()):
        spec = triton_services(project)[placement.instance]
        split = placement.device == "gpu0"
        assert ("CUDA_MPS_PIPE_DIRECTORY" in spec["environment"]) == split
        assert ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in spec["environment"]) == split
        assert ("ipc" in spec, "depends_on" in spec) == (split, split)
        assert any(v["type"] == "volume" for v in spec["volumes"]) == split
    assert project["services"]["mps-daemon"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0"]

    edit(gpu_plan, turns_on("gpu0", "gpu1"))
    assert not mps.needed(load_plan(gpu_plan).plan)
    assert render(gpu_plan, out) == 0
    project = yaml.safe_load((out / "compose.yaml").read_text())
    jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(project)
    assert "mps-daemon" not in project["services"] and "volumes" not in project


def test_apply_without_docker_compose_is_refused_before_anything_changes(gpu_plan):
    class NoCompose(CommandRunner):
        def run(self, argv: list[str]) -> Outcome:
            self.steps.append(argv)
            return Outcome(False, error="docker: unknown command: docker compose\n\nRun 'docker --help'\n")

    _deploy(gpu_plan, CommandRunner(dry_run=True, log=lambda _: None))  # the project rendered, a deployment recorded
    before = _snapshot(gpu_plan)
    runner = NoCompose(log=lambda _: None)
    with pytest.raises(TritonctlError, match=r"Docker Compose v2 is not available here \(`docker compose version`: "
                       r"docker: unknown command: docker compose\).*nothing changed"):  # fmt: skip
        apply_plan(load_plan(gpu_plan), ComposeRuntime(gpu_plan.parent / "compose", runner), log=lambda _: None)
    assert runner.steps == [["docker", "compose", "version"]] and _snapshot(gpu_plan) == before


class Reloading(CommandRunner):
    """Docker as HAProxy in a container answers it: a new worker lists `port` after `polls` stat reads following
    the USR2 that reloads it (never, with `polls` None)."""

    def __init__(self, port: int, polls: int | None):
        super().__init__(log=lambda _: None)
        self.port, self.polls, self.reads_since_reload = port, polls, None

    def run(self, argv: list[str]) -> Outcome:
        self.steps.append(argv)
        if argv[-3:] == ["-s", "USR2", "haproxy"]:
            self.reads_since_reload = 0
        return Outcome(True)

    def proxy(self, address: str, command: str, servers=None) -> Outcome:
        self.steps.append(["proxy", command])
        listed = ["port1"]
        if self.reads_since_reload is not None:
            self.reads_since_reload += 1
            if self.polls is not None and self.reads_since_reload > self.polls:
                listed.append(f"port{self.port}")
        return Outcome(True, "# pxname,svname\n" + "".join(f"{name},FRONTEND\n" for name in listed))


@pytest.mark.parametrize("polls", [3, None])
def test_a_new_model_port_is_open_once_haproxys_new_worker_lists_it(gpu_plan, monkeypatch, polls):
    _deploy(gpu_plan)
    record = next(iter(load_state(load_plan(gpu_plan).state_dir).instances.values()))
    runner = Reloading(9999, polls)
    runtime = ComposeRuntime(gpu_plan.parent / "compose", runner)
    monkeypatch.setattr("tritonctl.deploy.compose.PROXY_RELOAD_S", 1.0)
    if polls is None:
        with pytest.raises(TritonctlError, match=r"did not open port 9999 after a reload within 1.0 s \(docker"):
            runtime.route("0.0.0.0", 9999, [(record, 1.0)])
    else:
        assert "9999" in runtime.route("0.0.0.0", 9999, [(record, 1.0)])
        assert runner.reads_since_reload == polls + 1  # it waited for the new worker, and no longer

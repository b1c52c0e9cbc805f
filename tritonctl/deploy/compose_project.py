"""Render a GPU plan into a Docker Compose project: the MPS control daemon, HAProxy, one
Triton service per placement at its MPS share (or, on a GPU taken in turns, with the whole GPU and
no MPS; the daemon only where some GPU is split), and the tritonctl sidecar.

Output folder:

    compose.yaml            the project (tests validate it against the Compose Specification schema)
    .env                    what operators change: images and tags, bind addresses, host paths, sidecar access,
                            and the deployment's Triton control key (so mode 0600); kept across re-renders
                            (delete it to get the defaults back, and a new key)
    repository/<instance>/  each instance's model repository (render.py), mounted read-only
    haproxy/haproxy.cfg     HAProxy's configuration for the plan (proxy.py), mounted read-only

Decisions (docker/README.md gives the reasons and trade-offs):

- HAProxy (the official image, configured as for the local runtime: tritonctl/deploy/proxy.py) owns
  each model's stable gRPC port and balances requests over the instances' own gRPC ports;
  `tritonctl apply --runtime compose` and the sidecar change its servers through its runtime API.
  Triton services are in the profile `triton`: `docker compose up -d` starts the daemon, HAProxy
  and the sidecar, and the instances are started (and swapped) by apply, by name.
- HAProxy and Triton services use `network_mode: host`, so every port is a host port; instance
  ports (gRPC, HTTP, metrics), HAProxy's runtime API and metrics bind to 127.0.0.1 unless .env
  says otherwise, and only the model ports listen on all interfaces. Triton's control APIs
  (runtime/base.py RESTRICTED_APIS) answer only requests carrying TRITON_CONTROL_KEY.
- The sidecar mounts exactly the folders it reads and writes, each at its host path (`sidecar_mounts`).
- IPC: the MPS daemon's IPC namespace is `shareable` and every Triton service at an MPS share joins it
  (`ipc: service:mps-daemon`), rather than `ipc: host`; pipe and log directories are named volumes.
- One service name per instance and process hash, so a shadow instance and the one it replaces
  are two services of one project. A service keeps its ports across renders; a new one takes
  ports no service of the previous render holds, since both run during a swap.
- No CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: a plan carries each model's estimated footprint, not a
  memory limit, and a limit set to that estimate would fail allocations Triton makes beyond it.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml

from tritonctl.deploy import CONTROLLER_PORT, mps
from tritonctl.deploy.local import EXIT_TIMEOUT_S, one_host
from tritonctl.deploy.proxy import Routes, Server, environment, haproxy_weights, image_buffer, render_config
from tritonctl.deploy.runtime import server_flags
from tritonctl.errors import TritonctlError
from tritonctl.planning.plan import LoadedPlan, Plan, relative_to
from tritonctl.triton.render import Launch, render

COMPOSE_FILE = "compose.yaml"
ENV_FILE = ".env"
REPOSITORY = "repository"
MPS_DAEMON = "mps-daemon"
PROXY = "haproxy"
PROXY_DIR = "haproxy"  # in the project folder: HAProxy's configuration
TRITON_PROFILE = "triton"
PIPE_DIR = "/tmp/nvidia-mps"
LOG_DIR = "/var/log/nvidia-mps"
MODELS_DIR = "/models"
PORT_BASE = 18100  # first per-instance port; clear of Triton's 8000-8002 and node_exporter's 9100
LABEL = "tritonctl"
SOURCE = Path(__file__).resolve().parents[2]  # the checkout the sidecar image is built from (docker/)
DOCKER_SOCKET = "/var/run/docker.sock"
KEY = "TRITON_CONTROL_KEY"
# Never bind-mounted into the sidecar: these folders themselves, and anything inside SYSTEM_TREES.
SYSTEM_DIRS = frozenset(
    ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt", "/opt",
     "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var")
)  # fmt: skip
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr")

# (variable, default, what it is): the only values compose.yaml takes from the environment.
SETTINGS = [
    ("TRITON_IMAGE", "nvcr.io/nvidia/tritonserver", "Triton image (NGC); the MPS daemon runs from it too"),
    ("TRITON_TAG", "24.10-py3", "Triton 24.10 is Triton 2.51 (the release tritonctl is tested with, on CPU)"),
    ("TRITON_GRPC_ADDRESS", "127.0.0.1", "each instance's own gRPC port: only HAProxy connects to it"),
    ("TRITON_HTTP_ADDRESS", "127.0.0.1", "HTTP (health, inference; model control asks for the key) stays on loopback"),
    (KEY, "", "the value Triton's control APIs ask for (model load/unload, shared memory, trace, logging): secret"),
    ("TRITON_METRICS_ADDRESS", "127.0.0.1", "Prometheus metrics; 0.0.0.0 to scrape from another host"),
    ("TRITON_SHM_SIZE", "1gb", "/dev/shm of the MPS daemon's IPC namespace, shared by every Triton service"),
    ("MODEL_REPOSITORY", f"./{REPOSITORY}", "rendered model repositories, one folder per instance"),
    (
        "HAPROXY_IMAGE",
        "haproxy:3.0",
        "the official HAProxy image (2.6 or newer); from a 3.0 tag on its buffers hold a whole request: re-render\n"
        "after changing it (haproxy/haproxy.cfg and compose.yaml follow its tag)",
    ),
    ("PROXY_ADDRESS", "0.0.0.0", "where the models' stable gRPC ports listen (HAProxy; clients connect here)"),
    (
        "PROXY_API_ADDRESS",
        "127.0.0.1",
        "HAProxy's runtime API (admin level, no authentication) and its metrics: keep them on loopback\n"
        "(the PROXY_* values are written into haproxy/haproxy.cfg: re-render after changing them)",
    ),
    ("PROXY_API_PORT", "18090", "HAProxy's runtime API port (tritonctl apply and the sidecar change servers here)"),
    ("PROXY_METRICS_PORT", "18091", "HAProxy's Prometheus metrics port (/metrics)"),
    ("DEPLOY_DIR", "", "this folder's absolute path on the host"),
    (
        "PLAN_FILE",
        "",
        "the plan the sidecar's controller follows (applies again when it changes); the sidecar mounts the\n"
        "folders of the plan it was rendered from: re-render after pointing this elsewhere",
    ),
    (
        "LATENCY_MODEL",
        "",
        "the latency model the sidecar re-plans with as rates move (`tritonctl render --latency-model`); empty:\n"
        "it follows PLAN_FILE and reports rates but never re-plans. The sidecar mounts its folder: re-render after\n"
        "changing it",
    ),
    ("TRITONCTL_SRC", "", "the tritonctl source tree the tritonctl image is built from"),
    ("TRITONCTL_IMAGE", "tritonctl:0.1.0", "the tritonctl image (docker/Dockerfile): the sidecar"),
    ("DOCKER_SOCKET", DOCKER_SOCKET, "the Docker engine's socket on the host"),
    (
        "SIDECAR_USER",
        "0:0",
        "uid:gid the sidecar runs as: the owner of this folder and the state folder (it writes both, reads .env)",
    ),
    ("DOCKER_GID", "0", "the group owning DOCKER_SOCKET on the host (stat -c %g): the sidecar joins it"),
    ("SOCKET_PROXY_IMAGE", "tecnativa/docker-socket-proxy:v0.3.0", "a tag you have reviewed (or a digest)"),
    ("SOCKET_PROXY_PORT", "2375", "loopback port of the socket proxy (profile sidecar-proxied)"),
    (
        "COMPOSE_PROFILES",
        "sidecar",
        "which sidecar `docker compose up` starts: `sidecar` mounts the Docker socket (root-equivalent on this\n"
        "host); `sidecar-proxied` talks to a socket proxy that allows fewer API sections (docker/README.md);\n"
        "empty: none (apply with `tritonctl apply --runtime compose` from the host)",
    ),
]


@dataclass(frozen=True)
class TritonService:
    """One placement as a Compose service."""

    name: str
    launch: Launch
    device_index: int
    grpc_port: int  # the instance's own; clients use the model's port, on HAProxy
    http_port: int
    metrics_port: int


@dataclass(frozen=True)
class Previous:
    """A Triton service of the previous render in the output folder: it may be running."""

    model: str
    ports: tuple[int, int, int]  # the instance's gRPC, HTTP, metrics


@dataclass(frozen=True)
class ComposeProject:
    name: str
    services: dict[str, TritonService]  # by instance name
    loaded: LoadedPlan  # the plan with its repository_dir in this folder, as the services mount it
    proxy_api: str  # HAProxy's runtime API, host:port
    replans: bool  # the sidecar has a latency model to re-plan with


def service_name(instance: str, process_hash: str) -> str:
    """One service per process: a batch-only change reloads the model in the same service."""
    return f"triton-{instance}-{process_hash[:8]}"


def project_name(cluster: str) -> str:
    """A Compose project name (lowercase letters, digits, '-', '_') for a cluster."""
    return "tritonctl-" + re.sub(r"[^a-z0-9_-]", "-", cluster.lower())


def check_plan(loaded: LoadedPlan, gpus: int | None, target: str = "compose") -> None:
    """Refuse a plan the `target` (compose, kubernetes) cannot deploy on a host with `gpus` GPUs (None: not
    checked)."""
    plan = loaded.plan
    if plan.target != "gpu":
        raise TritonctlError(
            f"the {target} target deploys GPU plans with MPS; this plan targets {plan.target} "
            "(apply it with the local runtime)",
            file=loaded.path,
            field="target",
        )
    if gpus is not None and gpus < 1:
        raise TritonctlError(f"--gpus {gpus}: a GPU host has at least one GPU")
    for i, device in enumerate(plan.devices):
        if device.kind != "gpu":
            raise TritonctlError(
                f"{device.id} is a {device.kind} device; the {target} target deploys GPUs only",
                file=loaded.path,
                field=f"devices[{i}].kind",
            )
        if gpus is not None and device.index >= gpus:
            raise TritonctlError(
                f"{device.id} is GPU {device.index}, but the host has {gpus} GPU(s) (0-{gpus - 1})",
                file=loaded.path,
                field=f"devices[{i}].index",
            )


def read_previous(folder: Path) -> dict[str, Previous]:
    """The Triton services of the compose.yaml already in `folder` (none when there is none)."""
    path = folder / COMPOSE_FILE
    if not path.exists():
        return {}
    try:
        services = yaml.safe_load(path.read_text())["services"]
        return {
            name: Previous(
                spec["labels"][f"{LABEL}.model"],
                tuple(int(spec["labels"][f"{LABEL}.{kind}-port"]) for kind in ("grpc", "http", "metrics")),
            )
            for name, spec in services.items()
            if f"{LABEL}.instance" in spec.get("labels", {})
        }
    except (OSError, yaml.YAMLError, TypeError, KeyError, ValueError) as exc:
        raise TritonctlError(
            f"cannot read the previous render's services ({exc!r}); move the folder away to render afresh", file=path
        ) from None


def check_ports(loaded: LoadedPlan, previous: dict[str, Previous], own: dict[str, int], folder: Path) -> None:
    """A model's port belongs to HAProxy: it must be none of the project's own ports (`own_ports`) nor a port of a
    service of the previous render (it runs until its replacement is ready). New instances' ports are allocated
    clear of model ports."""
    for i, model in enumerate(loaded.plan.models):
        held = [what for what, port in own.items() if model.port == port]
        held += [
            f"held by service {name} ({prev.model}) of the deployment in {folder / COMPOSE_FILE}, which runs "
            "until its replacement is ready"
            for name, prev in previous.items()
            if model.port in prev.ports
        ]
        if held:
            raise TritonctlError(
                f"port {model.port} is {held[0]}; give {model.name} another port "
                "(or, if nothing runs from that folder, render into an empty one)",
                file=loaded.path,
                field=f"models[{i}].port",
            )


def allocate_ports(
    names: list[str], previous: dict[str, Previous], reserved: set[int], base: int = PORT_BASE
) -> dict[str, tuple[int, int, int]]:
    """(gRPC, HTTP, metrics) ports per service: a service of the previous render keeps its ports; a new one
    takes the lowest free ports from `base`, clear of `reserved` and of every previous service's ports."""
    busy = reserved | {port for prev in previous.values() for port in prev.ports}
    free = (port for port in range(base, 65536) if port not in busy)
    ports: dict[str, tuple[int, int, int]] = {}
    for name in names:
        if name in previous:
            ports[name] = previous[name].ports
            continue
        taken = tuple(itertools.islice(free, 3))
        if len(taken) < 3:
            raise TritonctlError(f"no free ports left above {base} for {name}")
        ports[name] = taken
    return ports


def read_env(path: Path) -> dict[str, str]:
    """The KEY=VALUE lines of a .env file (none when there is no file)."""
    if not path.exists():
        return {}
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


@dataclass(frozen=True)
class Mount:
    """A host folder the sidecar sees at the same path."""

    path: Path
    read_only: bool


def check_mount(path: Path) -> None:
    """Refuse to bind-mount `path` into the sidecar when it is a system folder or lies in one."""
    if str(path) in SYSTEM_DIRS or any(path.is_relative_to(tree) for tree in SYSTEM_TREES):
        raise TritonctlError(
            f"the sidecar would mount {path}, a system folder; keep the plan, its cluster file, exports, "
            "state folder and this project in folders of their own"
        )


def sidecar_mounts(loaded: LoadedPlan, deploy: Path, latency_model: Path | None) -> list[Mount]:
    """What the sidecar mounts: the project and the state folder read-write, the folders of the plan, its
    cluster file, the exports and the latency model read-only; a folder inside one already mounted with its
    access is left out."""
    plan = loaded.plan
    wanted = [
        (deploy, False),
        (loaded.state_dir, False),
        (loaded.path.parent, True),
        (loaded.resolve(plan.cluster_file).parent, True),
        *((loaded.resolve(model.onnx).parent, True) for model in plan.models),
        *([(latency_model.parent, True)] if latency_model else []),
    ]
    mounts: list[Mount] = []
    for path, read_only in sorted(wanted, key=lambda w: (len(w[0].parts), w[1], w[0])):  # parents first
        check_mount(path)
        if not any(path.is_relative_to(m.path) and (read_only or not m.read_only) for m in mounts):
            mounts.append(Mount(path, read_only))
    return mounts


def docker_gid(socket: str) -> str:
    """The group owning the Docker socket here, "0" when there is none."""
    try:
        return str(os.stat(socket).st_gid)
    except OSError:
        return "0"


def settings(loaded: LoadedPlan, folder: Path, latency_model: Path | None = None) -> dict[str, str]:
    """The .env values for a project written to `folder`: those of the .env already there, defaults for the rest;
    `latency_model`, when given, replaces the one .env names."""
    deploy = folder.resolve()
    values = {name: default for name, default, _ in SETTINGS}
    values["DEPLOY_DIR"] = str(deploy)
    values["PLAN_FILE"] = str(loaded.path.resolve())
    values[KEY] = secrets.token_urlsafe(32)  # per deployment: a re-render keeps the one in .env
    values["SIDECAR_USER"] = f"{os.getuid()}:{os.getgid()}"
    values["DOCKER_GID"] = docker_gid(values["DOCKER_SOCKET"])
    if not (SOURCE / "docker" / "Dockerfile").is_file():
        raise TritonctlError(
            f"the Compose project builds its tritonctl image from a checkout of tritonctl (docker/Dockerfile), and "
            f"{SOURCE} is not one: render the project from a checkout",
            file=loaded.path,
        )
    # Relative when the project lies inside the source tree, so the two can move to the GPU host together.
    values["TRITONCTL_SRC"] = relative_to(SOURCE, folder) if deploy.is_relative_to(SOURCE) else str(SOURCE)
    kept = read_env(folder / ENV_FILE)
    values = {name: kept.get(name, value) for name, value in values.items()}
    if latency_model is not None:
        values["LATENCY_MODEL"] = str(latency_model.resolve())
    return values


def current_settings(folder: Path) -> dict[str, str]:
    """The settings of the project in `folder`: its .env's values, defaults for the rest."""
    return {**{name: default for name, default, _ in SETTINGS}, **read_env(folder / ENV_FILE)}


def proxy_api(values: dict[str, str]) -> str:
    """Where tritonctl reaches HAProxy's runtime API (host:port)."""
    address = values["PROXY_API_ADDRESS"]
    return f"{'127.0.0.1' if address == '0.0.0.0' else address}:{values['PROXY_API_PORT']}"


def own_ports(values: dict[str, str], folder: Path) -> dict[str, int]:
    """The ports the project's own services listen on, by what holds them: HAProxy's runtime API and metrics, the
    socket proxy's and the sidecar's endpoint (on the host's network); TritonctlError for a setting that is not a
    port."""
    ports = {}
    for name, service in (
        ("PROXY_API_PORT", "HAProxy's"),
        ("PROXY_METRICS_PORT", "HAProxy's"),
        ("SOCKET_PROXY_PORT", "the socket proxy's"),
    ):
        try:
            ports[f"{service} {name} in {folder / ENV_FILE}"] = int(values[name])
        except ValueError:
            raise TritonctlError(f"{name}={values[name]!r} is not a port number", file=folder / ENV_FILE) from None
    ports["the sidecar's state endpoint (`tritonctl controller`, on the host's network)"] = CONTROLLER_PORT
    return ports


def proxy_config(plan: Plan, services: list[TritonService], values: dict[str, str]) -> str:
    """HAProxy's configuration for the plan: each model's port in front of its planned services."""
    weights = {p.instance: p.weight for _, p in plan.instances()}
    routes: Routes = {model.port: [] for model in plan.models}
    for model in plan.models:
        mine = [s for s in services if s.launch.model == model.name]
        for service, weight in zip(mine, haproxy_weights([weights[s.launch.instance] for s in mine]), strict=True):
            routes[model.port].append(
                Server(service.name, values["TRITON_GRPC_ADDRESS"], service.grpc_port, service.http_port, weight)
            )
    api = values["PROXY_API_ADDRESS"]
    return render_config(
        routes,
        values["PROXY_ADDRESS"],
        f"ipv4@{api}:{values['PROXY_API_PORT']}",
        f"{api}:{values['PROXY_METRICS_PORT']}",
        buffer=proxy_buffer(values),
    )


def proxy_buffer(values: dict[str, str]) -> int:
    """HAProxy's buffer size for the image the settings name."""
    return image_buffer(values["HAPROXY_IMAGE"])


def env_text(values: dict[str, str]) -> str:
    lines = [
        "# tritonctl: what operators change in this Compose project. compose.yaml reads these as ${VAR:-default}.",
        "# Re-renders keep the values here; delete this file to get the defaults back.",
        "# Ports are not here (but HAProxy's own): model ports come from the plan, per-instance",
        "# ports are fixed at render time (Compose cannot compute them from a base); re-render to change them.",
        "",
    ]
    for name, _, comment in SETTINGS:
        lines += [*(f"# {line}" for line in comment.splitlines()), f"{name}={values[name]}"]
    return "\n".join(lines) + "\n"


def _mps_volumes(read_only: bool = False) -> list[dict]:
    pipe = {"type": "volume", "source": "mps-pipe", "target": PIPE_DIR}
    return [pipe] if read_only else [pipe, {"type": "volume", "source": "mps-log", "target": LOG_DIR}]


def _gpus(indexes: list[int], capabilities: list[str]) -> dict:
    device = {"driver": "nvidia", "device_ids": [str(i) for i in indexes], "capabilities": capabilities}
    return {"resources": {"reservations": {"devices": [device]}}}


def _tritonctl_image(ref) -> dict:
    return {
        "image": ref("TRITONCTL_IMAGE"),
        "build": {"context": ref("TRITONCTL_SRC"), "dockerfile": "docker/Dockerfile"},
    }


def _sidecar(ref, profile: str, docker_host: str, mounts: list[Mount], working_dir: Path, replans: bool) -> dict:
    binds = [{"type": "bind", "source": str(m.path), "target": str(m.path), "read_only": m.read_only} for m in mounts]
    command = [ref("PLAN_FILE"), "--runtime", "compose", "--compose-dir", ref("DEPLOY_DIR")]
    return {
        **_tritonctl_image(ref),
        "profiles": [profile],
        "command": command + (["--latency-model", ref("LATENCY_MODEL")] if replans else []),
        "network_mode": "host",  # reaches the instances' and HAProxy's loopback ports
        "user": ref("SIDECAR_USER"),
        "working_dir": str(working_dir),
        "environment": {"DOCKER_HOST": docker_host},
        "volumes": binds,
        "depends_on": {PROXY: {"condition": "service_started"}},
        "restart": "unless-stopped",
    }


def compose_project(
    plan: Plan, services: list[TritonService], values: dict[str, str], mounts: list[Mount], plan_dir: Path
) -> dict:
    """The Compose project of a plan's Triton services (a pure function: the dict compose.yaml holds).
    `mounts`: the sidecar's; `plan_dir`: the plan's folder, where the sidecar works."""

    def ref(name: str) -> str:
        return f"${{{name}:-{values[name]}}}"

    key = f"${{{KEY}:?{KEY} is not set: tritonctl writes it to .env}}"  # never written into compose.yaml

    image = f"{ref('TRITON_IMAGE')}:{ref('TRITON_TAG')}"
    clients = [s for s in services if mps.client(s.launch)]  # those at an MPS share (the others take turns)
    out: dict = {
        "name": project_name(plan.cluster),
        "services": {
            MPS_DAEMON: {
                "image": image,
                "entrypoint": ["nvidia-cuda-mps-control", "-f"],
                "environment": {"CUDA_MPS_PIPE_DIRECTORY": PIPE_DIR, "CUDA_MPS_LOG_DIRECTORY": LOG_DIR},
                "volumes": _mps_volumes(),
                "ipc": "shareable",
                "shm_size": ref("TRITON_SHM_SIZE"),
                "deploy": _gpus(sorted({s.device_index for s in clients}), ["gpu", "compute", "utility"]),
                "healthcheck": {
                    "test": ["CMD-SHELL", "echo get_server_list | nvidia-cuda-mps-control"],
                    "interval": "5s",
                    "timeout": "5s",
                    "retries": 5,
                },
                "restart": "unless-stopped",
            },
            PROXY: {
                "image": ref("HAPROXY_IMAGE"),
                "network_mode": "host",  # model ports are host ports; instances' gRPC ports are on the host's loopback
                "environment": environment(proxy_buffer(values)),
                "volumes": [
                    {"type": "bind", "source": f"./{PROXY_DIR}", "target": "/usr/local/etc/haproxy", "read_only": True}
                ],
                "restart": "unless-stopped",
            },
        },
    }
    for service in services:
        launch = service.launch
        ready = f"http://{ref('TRITON_HTTP_ADDRESS')}:{service.http_port}/v2/health/ready"
        # The container sees only its reserved GPU, as device 0: the host index in the launch's
        # CUDA_VISIBLE_DEVICES would name a device it does not have.
        env = {k: v for k, v in launch.env.items() if k != "CUDA_VISIBLE_DEVICES"}
        out["services"][service.name] = {
            "image": image,
            "command": [
                "tritonserver",
                f"--model-repository={MODELS_DIR}",
                "--model-control-mode=explicit",
                f"--load-model={launch.model}",
                f"--grpc-address={ref('TRITON_GRPC_ADDRESS')}",
                f"--grpc-port={service.grpc_port}",
                f"--http-address={ref('TRITON_HTTP_ADDRESS')}",
                f"--http-port={service.http_port}",
                f"--metrics-address={ref('TRITON_METRICS_ADDRESS')}",
                f"--metrics-port={service.metrics_port}",
                f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
                f"--id={launch.instance}",
                *server_flags(key),
            ],
            "profiles": [TRITON_PROFILE],  # started by apply, by name
            "network_mode": "host",
            "environment": env,
            "volumes": [
                {
                    "type": "bind",
                    "source": f"{ref('MODEL_REPOSITORY')}/{launch.instance}/models",
                    "target": MODELS_DIR,
                    "read_only": True,
                },
            ],
            "deploy": _gpus([service.device_index], ["gpu"]),
            "healthcheck": {
                "test": ["CMD", "curl", "-fsS", ready],
                "interval": "5s",
                "timeout": "3s",
                "retries": 3,
                "start_period": f"{plan.runtime.startup_timeout_s:.0f}s",
            },
            "stop_grace_period": f"{EXIT_TIMEOUT_S + 5}s",
            "restart": "unless-stopped",
            "labels": {
                f"{LABEL}.instance": launch.instance,
                f"{LABEL}.model": launch.model,
                f"{LABEL}.device": launch.device,
                f"{LABEL}.config-hash": launch.config_hash,
                f"{LABEL}.model-port": str(launch.grpc_port),
                f"{LABEL}.grpc-port": str(service.grpc_port),
                f"{LABEL}.http-port": str(service.http_port),
                f"{LABEL}.metrics-port": str(service.metrics_port),
            },
        }
        if mps.client(launch):  # a client of the MPS daemon: its IPC namespace, pipe and log folders
            out["services"][service.name] |= {
                "ipc": f"service:{MPS_DAEMON}",
                "environment": {**env, "CUDA_MPS_PIPE_DIRECTORY": PIPE_DIR},
                # restart: a Triton process attached to a restarted daemon's old IPC namespace is lost.
                "depends_on": {MPS_DAEMON: {"condition": "service_healthy", "restart": True}},
            }
            out["services"][service.name]["volumes"] += _mps_volumes(read_only=True)
    socket = {"type": "bind", "source": ref("DOCKER_SOCKET"), "target": DOCKER_SOCKET}
    replans = bool(values["LATENCY_MODEL"])
    sidecar = _sidecar(ref, "sidecar", f"unix://{DOCKER_SOCKET}", mounts, plan_dir, replans)
    sidecar["volumes"].append(socket)
    sidecar["group_add"] = [ref("DOCKER_GID")]
    proxied = _sidecar(ref, "sidecar-proxied", f"tcp://127.0.0.1:{ref('SOCKET_PROXY_PORT')}", mounts, plan_dir, replans)
    proxied["depends_on"]["docker-socket-proxy"] = {"condition": "service_started"}
    out["services"]["tritonctl-sidecar"] = sidecar
    out["services"]["tritonctl-sidecar-proxied"] = proxied
    out["services"]["docker-socket-proxy"] = {
        "image": ref("SOCKET_PROXY_IMAGE"),
        "profiles": ["sidecar-proxied"],
        # API sections `docker compose up/stop/rm/ps/logs` use; exec, build, swarm, plugins,
        # secrets and system stay closed. Container create stays open: see docker/README.md.
        "environment": {s: "1" for s in ("CONTAINERS", "IMAGES", "NETWORKS", "VOLUMES", "INFO", "POST")},
        "volumes": [{**socket, "read_only": True}],
        "ports": [f"127.0.0.1:{ref('SOCKET_PROXY_PORT')}:2375"],
        "networks": ["socket-proxy"],
        "restart": "unless-stopped",
    }
    if clients:
        out["volumes"] = {"mps-pipe": {}, "mps-log": {}}
    else:  # every GPU taken in turns: no MPS daemon
        del out["services"][MPS_DAEMON]
    out["networks"] = {"socket-proxy": {}}
    return out


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner alone (mode 0600), also when the file existed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True


def write_compose(
    loaded: LoadedPlan,
    folder: Path,
    gpus: int | None,
    write: bool = True,
    repositories: bool = True,
    latency_model: Path | None = None,
) -> ComposeProject:
    """Check the plan, then write compose.yaml, .env and (with `repositories`) the model repositories
    into `folder` (only compute the project if not `write`). `latency_model`: the sidecar re-plans with it
    (a re-render without one keeps the one .env names).

    Every check runs before the first write: a refused plan leaves the folder as it was.
    """
    check_plan(loaded, gpus)
    one_host(loaded, "compose")
    plan = loaded.plan
    # The plan's own rendering, into this folder: the project carries its repositories with it.
    runtime = plan.runtime.model_copy(update={"repository_dir": relative_to(folder / REPOSITORY, loaded.path.parent)})
    local = LoadedPlan(plan.model_copy(update={"runtime": runtime}), loaded.path)
    launches = {name: launch for name, (_, launch) in render(local, write=False).items()}
    values = settings(loaded, folder, latency_model)
    own = own_ports(values, folder)
    previous = read_previous(folder)
    check_ports(loaded, previous, own, folder)
    names = [service_name(i, launch.process_hash) for i, launch in launches.items()]
    ports = allocate_ports(names, previous, {m.port for m in plan.models} | set(own.values()))
    services = {
        instance: TritonService(name, launch, plan.device(launch.device).index, *ports[name])
        for (instance, launch), name in zip(launches.items(), names, strict=True)
    }
    replan_model = Path(values["LATENCY_MODEL"]) if values["LATENCY_MODEL"] else None
    mounts = sidecar_mounts(loaded, folder.resolve(), replan_model)
    project = compose_project(plan, list(services.values()), values, mounts, loaded.path.parent)
    if write:
        if repositories:
            render(local)
        header = (
            f"# Rendered by tritonctl from {loaded.path} (cluster {plan.cluster}): do not edit, re-render.\n"
            "# Start: docker compose up -d, then tritonctl apply PLAN --runtime compose (or the sidecar does)\n"
            "# Settings: .env   Decisions and trade-offs: docker/README.md\n"
        )
        (folder / COMPOSE_FILE).write_text(header + yaml.dump(project, Dumper=_Dumper, sort_keys=False, width=120))
        write_private(folder / ENV_FILE, env_text(values))
        (folder / PROXY_DIR).mkdir(exist_ok=True)
        (folder / PROXY_DIR / "haproxy.cfg").write_text(proxy_config(plan, list(services.values()), values))
    return ComposeProject(project["name"], services, local, proxy_api(values), replan_model is not None)

"""Render a GPU plan into a Docker Compose project: the MPS control daemon, one Triton service
per placement at its MPS share, and the tritonctl sidecar.

Output folder:

    compose.yaml            the project (tests validate it against the Compose Specification schema)
    .env                    what operators change: images and tags, bind addresses, host paths, sidecar access
    repository/<instance>/  each instance's model repository (render.py), mounted read-only

Decisions (docker/README.md gives the reasons and trade-offs):

- Triton services use `network_mode: host`: replicas of a model, and the shadow instance that
  replaces one, all bind the model's stable gRPC port with --reuse-grpc-port, which two
  containers cannot do through published ports. HTTP and metrics ports are per service and
  bind to 127.0.0.1 unless .env says otherwise.
- IPC: the MPS daemon's IPC namespace is `shareable` and every Triton service joins it
  (`ipc: service:mps-daemon`), rather than `ipc: host`; pipe and log directories are named volumes.
- One service name per instance and config hash, so a shadow instance and the one it replaces
  are two services of one project. A service keeps its HTTP and metrics ports across renders;
  a new one takes ports no service of the previous render holds, since both run during a swap.
- No CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: a plan carries each model's estimated footprint, not a
  memory limit, and a limit set to that estimate would fail allocations Triton makes beyond it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from tritonctl.errors import TritonctlError
from tritonctl.plan import LoadedPlan, Plan, relative_to
from tritonctl.render import TEMPLATES, Launch, render
from tritonctl.runtime.local import EXIT_TIMEOUT_S

COMPOSE_FILE = "compose.yaml"
ENV_FILE = ".env"
REPOSITORY = "repository"
MPS_DAEMON = "mps-daemon"
PIPE_DIR = "/tmp/nvidia-mps"
LOG_DIR = "/var/log/nvidia-mps"
MODELS_DIR = "/models"
PORT_BASE = 18100  # first per-service HTTP/metrics port; clear of Triton's 8000-8002 and node_exporter's 9100
LABEL = "tritonctl"
SOURCE = TEMPLATES.parent  # the repository the sidecar image is built from

# (variable, default, what it is): the only values compose.yaml takes from the environment.
SETTINGS = [
    ("TRITON_IMAGE", "nvcr.io/nvidia/tritonserver", "Triton image (NGC); the MPS daemon runs from it too"),
    ("TRITON_TAG", "24.10-py3", "Triton 24.10 is Triton 2.51, the first with --reuse-grpc-port"),
    ("TRITON_GRPC_ADDRESS", "0.0.0.0", "where the models' gRPC ports listen (clients connect here)"),
    ("TRITON_HTTP_ADDRESS", "127.0.0.1", "HTTP (health, model control: no authentication) stays on loopback"),
    ("TRITON_METRICS_ADDRESS", "127.0.0.1", "Prometheus metrics; 0.0.0.0 to scrape from another host"),
    ("TRITON_SHM_SIZE", "1gb", "/dev/shm of the MPS daemon's IPC namespace, shared by every Triton service"),
    ("MODEL_REPOSITORY", f"./{REPOSITORY}", "rendered model repositories, one folder per instance"),
    ("DEPLOY_DIR", "", "this folder's absolute path on the host (the sidecar sees it at the same path)"),
    ("TRITONCTL_SRC", "", "the tritonctl source tree the sidecar image is built from"),
    ("SIDECAR_IMAGE", "tritonctl-sidecar:0.1.0", "the sidecar image (built from docker/Dockerfile)"),
    ("DOCKER_SOCKET", "/var/run/docker.sock", "the Docker engine's socket on the host"),
    ("SOCKET_PROXY_IMAGE", "tecnativa/docker-socket-proxy:latest", "pin a tag or digest you have reviewed"),
    ("SOCKET_PROXY_PORT", "2375", "loopback port of the socket proxy (profile sidecar-proxied)"),
]
PROFILES_NOTE = (
    "# Which sidecar runs: `sidecar` mounts the Docker socket (root-equivalent on this host);\n"
    "# `sidecar-proxied` talks to a socket proxy that allows fewer API sections (see docker/README.md).\n"
    "COMPOSE_PROFILES=sidecar\n"
)


@dataclass(frozen=True)
class TritonService:
    """One placement as a Compose service."""

    name: str
    launch: Launch
    device_index: int
    http_port: int
    metrics_port: int


@dataclass(frozen=True)
class Previous:
    """A Triton service of the previous render in the output folder: it may be running."""

    model: str
    ports: tuple[int, int, int]  # gRPC, HTTP, metrics


@dataclass(frozen=True)
class ComposeProject:
    folder: Path
    name: str
    services: dict[str, TritonService]  # by instance name


def service_name(instance: str, process_hash: str) -> str:
    """One service per process: a batch-only change reloads the model in the same service."""
    return f"triton-{instance}-{process_hash[:8]}"


def project_name(cluster: str) -> str:
    """A Compose project name (lowercase letters, digits, '-', '_') for a cluster."""
    return "tritonctl-" + re.sub(r"[^a-z0-9_-]", "-", cluster.lower())


def host_gpu_count() -> int | None:
    """GPUs NVML sees on this machine; None without pynvml, a driver or a GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return pynvml.nvmlDeviceGetCount() or None
    finally:
        pynvml.nvmlShutdown()


def check_plan(loaded: LoadedPlan, gpus: int | None) -> None:
    """Refuse a plan the Compose target cannot deploy on a host with `gpus` GPUs (None: not checked)."""
    plan = loaded.plan
    if plan.target != "gpu":
        raise TritonctlError(
            f"the compose target deploys GPU plans with MPS; this plan targets {plan.target} "
            "(apply it with the local runtime)",
            file=loaded.path,
            field="target",
        )
    if gpus is not None and gpus < 1:
        raise TritonctlError(f"--gpus {gpus}: a GPU host has at least one GPU")
    for i, device in enumerate(plan.devices):
        if device.kind != "gpu":
            raise TritonctlError(
                f"{device.id} is a {device.kind} device; the compose target deploys GPUs only",
                file=loaded.path,
                field=f"devices[{i}].kind",
            )
        if gpus is not None and device.index >= gpus:
            raise TritonctlError(
                f"{device.id} is GPU {device.index}, but the host has {gpus} GPU(s) (0-{gpus - 1})",
                file=loaded.path,
                field=f"devices[{i}].index",
            )


def check_shares(loaded: LoadedPlan, launches: dict[str, Launch]) -> None:
    """Every instance's MPS active thread percentage must be 1-100."""
    for i, model in enumerate(loaded.plan.models):
        for j, placement in enumerate(model.placements):
            launch = launches[placement.instance]
            percent = int(launch.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
            if not 1 <= percent <= 100:
                raise TritonctlError(
                    f"share {placement.share} of {launch.units} units is an MPS active thread percentage "
                    f"of {percent}; MPS takes 1-100",
                    file=loaded.path,
                    field=f"models[{i}].placements[{j}].share",
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


def check_ports(loaded: LoadedPlan, previous: dict[str, Previous], compose_file: Path) -> None:
    """A model's port must not be held by a service of the previous render, unless by a replica of
    that same model on its gRPC port (shared by SO_REUSEPORT): old and new services run side by side
    during a swap. Ports of this render's own services are allocated clear of model ports."""
    for i, model in enumerate(loaded.plan.models):
        for name, prev in previous.items():
            grpc, http, metrics = prev.ports
            if model.port in (http, metrics) or (model.port == grpc and prev.model != model.name):
                raise TritonctlError(
                    f"port {model.port} is held by service {name} ({prev.model}) of the deployment in "
                    f"{compose_file}, which runs until its replacement is ready; give {model.name} another "
                    "port (or, if nothing runs from that folder, render into an empty one)",
                    file=loaded.path,
                    field=f"models[{i}].port",
                )


def allocate_ports(
    names: list[str], previous: dict[str, Previous], reserved: set[int], base: int = PORT_BASE
) -> dict[str, tuple[int, int]]:
    """(HTTP, metrics) port per service: a service of the previous render keeps its ports; a new one
    takes the lowest free pair from `base`, clear of `reserved` and of every previous service's ports."""
    busy = reserved | {port for prev in previous.values() for port in prev.ports}
    ports: dict[str, tuple[int, int]] = {}
    candidate = base
    for name in names:
        if name in previous:
            ports[name] = previous[name].ports[1:]
            continue
        while candidate in busy or candidate + 1 in busy:
            candidate += 1
        if candidate + 1 > 65535:
            raise TritonctlError(f"no free HTTP and metrics ports left above {base} for {name}")
        ports[name] = (candidate, candidate + 1)
        busy |= {candidate, candidate + 1}
    return ports


def settings(folder: Path) -> dict[str, str]:
    """The .env values for a project written to `folder`."""
    values = {name: default for name, default, _ in SETTINGS}
    values["DEPLOY_DIR"] = str(folder.resolve())
    # Relative when the project lies inside the source tree, so the two can move to the GPU host together.
    inside = folder.resolve().is_relative_to(SOURCE)
    values["TRITONCTL_SRC"] = relative_to(SOURCE, folder) if inside else str(SOURCE)
    return values


def env_text(values: dict[str, str]) -> str:
    lines = [
        "# tritonctl: what operators change in this Compose project. compose.yaml reads these as ${VAR:-default}.",
        "# Ports are not here: model ports come from the plan, per-service HTTP/metrics ports are fixed",
        "# at render time (Compose cannot compute them from a base); re-render to change them.",
        "",
    ]
    for name, _, comment in SETTINGS:
        lines += [f"# {comment}", f"{name}={values[name]}"]
    return "\n".join(lines) + "\n\n" + PROFILES_NOTE


def _mps_volumes(read_only: bool = False) -> list[dict]:
    pipe = {"type": "volume", "source": "mps-pipe", "target": PIPE_DIR}
    return [pipe] if read_only else [pipe, {"type": "volume", "source": "mps-log", "target": LOG_DIR}]


def _gpus(indexes: list[int], capabilities: list[str]) -> dict:
    device = {"driver": "nvidia", "device_ids": [str(i) for i in indexes], "capabilities": capabilities}
    return {"resources": {"reservations": {"devices": [device]}}}


def _sidecar(ref, profile: str, docker_host: str) -> dict:
    deploy_dir = {"type": "bind", "source": ref("DEPLOY_DIR"), "target": ref("DEPLOY_DIR")}
    return {
        "image": ref("SIDECAR_IMAGE"),
        "build": {"context": ref("TRITONCTL_SRC"), "dockerfile": "docker/Dockerfile"},
        "profiles": [profile],
        "network_mode": "host",  # reaches the Triton services' loopback HTTP ports
        "working_dir": ref("DEPLOY_DIR"),
        "environment": {"DOCKER_HOST": docker_host},
        "volumes": [deploy_dir],
        "restart": "unless-stopped",
    }


def compose_project(plan: Plan, services: list[TritonService], values: dict[str, str]) -> dict:
    """The Compose project of a plan's Triton services (a pure function: the dict compose.yaml holds)."""

    def ref(name: str) -> str:
        return f"${{{name}:-{values[name]}}}"

    image = f"{ref('TRITON_IMAGE')}:{ref('TRITON_TAG')}"
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
                "deploy": _gpus(sorted({s.device_index for s in services}), ["gpu", "compute", "utility"]),
                "healthcheck": {
                    "test": ["CMD-SHELL", "echo get_server_list | nvidia-cuda-mps-control"],
                    "interval": "5s",
                    "timeout": "5s",
                    "retries": 5,
                },
                "restart": "unless-stopped",
            }
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
                f"--grpc-port={launch.grpc_port}",
                "--reuse-grpc-port=true",
                f"--http-address={ref('TRITON_HTTP_ADDRESS')}",
                f"--http-port={service.http_port}",
                f"--metrics-address={ref('TRITON_METRICS_ADDRESS')}",
                f"--metrics-port={service.metrics_port}",
                f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
                f"--id={launch.instance}",
            ],
            "network_mode": "host",
            "ipc": f"service:{MPS_DAEMON}",
            "environment": {**env, "CUDA_MPS_PIPE_DIRECTORY": PIPE_DIR},
            "volumes": [
                {
                    "type": "bind",
                    "source": f"{ref('MODEL_REPOSITORY')}/{launch.instance}/models",
                    "target": MODELS_DIR,
                    "read_only": True,
                },
                *_mps_volumes(read_only=True),
            ],
            "deploy": _gpus([service.device_index], ["gpu"]),
            "healthcheck": {
                "test": ["CMD", "curl", "-fsS", ready],
                "interval": "5s",
                "timeout": "3s",
                "retries": 3,
                "start_period": f"{plan.runtime.startup_timeout_s:.0f}s",
            },
            # restart: a Triton process attached to a restarted daemon's old IPC namespace is lost.
            "depends_on": {MPS_DAEMON: {"condition": "service_healthy", "restart": True}},
            "stop_grace_period": f"{EXIT_TIMEOUT_S + 5}s",
            "restart": "unless-stopped",
            "labels": {
                f"{LABEL}.instance": launch.instance,
                f"{LABEL}.model": launch.model,
                f"{LABEL}.device": launch.device,
                f"{LABEL}.config-hash": launch.config_hash,
                f"{LABEL}.grpc-port": str(launch.grpc_port),
                f"{LABEL}.http-port": str(service.http_port),
                f"{LABEL}.metrics-port": str(service.metrics_port),
            },
        }
    socket = {"type": "bind", "source": ref("DOCKER_SOCKET"), "target": "/var/run/docker.sock"}
    sidecar = _sidecar(ref, "sidecar", "unix:///var/run/docker.sock")
    sidecar["volumes"].append(socket)
    proxied = _sidecar(ref, "sidecar-proxied", f"tcp://127.0.0.1:{ref('SOCKET_PROXY_PORT')}")
    proxied["depends_on"] = {"docker-socket-proxy": {"condition": "service_started"}}
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
    out["volumes"] = {"mps-pipe": {}, "mps-log": {}}
    out["networks"] = {"socket-proxy": {}}
    return out


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True


def write_compose(loaded: LoadedPlan, folder: Path, gpus: int | None) -> ComposeProject:
    """Check the plan, then write compose.yaml, .env and the model repositories into `folder`.

    Every check runs before the first write: a refused plan leaves the folder as it was.
    """
    check_plan(loaded, gpus)
    plan = loaded.plan
    # The plan's own rendering, into this folder: the project carries its repositories with it.
    runtime = plan.runtime.model_copy(update={"repository_dir": relative_to(folder / REPOSITORY, loaded.path.parent)})
    local = LoadedPlan(plan.model_copy(update={"runtime": runtime}), loaded.path)
    launches = {name: launch for name, (_, launch) in render(local, write=False).items()}
    check_shares(loaded, launches)
    previous = read_previous(folder)
    check_ports(loaded, previous, folder / COMPOSE_FILE)
    names = [service_name(i, launch.process_hash) for i, launch in launches.items()]
    ports = allocate_ports(names, previous, {m.port for m in plan.models})
    services = {
        instance: TritonService(name, launch, plan.device(launch.device).index, *ports[name])
        for (instance, launch), name in zip(launches.items(), names, strict=True)
    }
    values = settings(folder)
    project = compose_project(plan, list(services.values()), values)

    render(local)
    header = (
        f"# Rendered by tritonctl from {loaded.path} (cluster {plan.cluster}): do not edit, re-render.\n"
        "# Start: docker compose up -d   Settings: .env   Decisions and trade-offs: docker/README.md\n"
    )
    (folder / COMPOSE_FILE).write_text(header + yaml.dump(project, Dumper=_Dumper, sort_keys=False, width=120))
    (folder / ENV_FILE).write_text(env_text(values))
    return ComposeProject(folder, project["name"], services)

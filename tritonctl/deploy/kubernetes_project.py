"""Render a GPU plan into a kustomize-ready Kubernetes folder: a Deployment and a Service per instance at its
MPS share, HAProxy in front of every model, the MPS control daemon on the GPU node. Rendering only: nothing
here talks to a cluster (`kubectl apply -k DIR` deploys it).

Folder (`tritonctl render PLAN --target kubernetes [-o DIR] [--node NAME]`):

    kustomization.yaml      namespace, images, common labels, the generated ConfigMap and Secret: what
                            operators change (and a patch for resources or node labels)
    triton.yaml             per instance a Deployment pinned to its node and GPU, and a Service
    proxy.yaml              HAProxy (proxy.py's configuration) and per model a Service on the model's port
    mps.yaml                the MPS control daemon: a DaemonSet on the GPU node, host IPC
    storage.yaml            the PersistentVolumeClaim the model repositories are read from
    controller.yaml         the controller: its ServiceAccount, Role (only the verbs the runtime calls),
                            RoleBinding and Deployment
    controller-plan.yaml    the plan as the controller's pod reads it (its ConfigMap)
    haproxy.cfg             HAProxy's configuration: each model's port in front of its instances' Services
    control-key.env         Triton's control key (mode 0600, kept across re-renders)
    repository/<instance>/  each instance's model repository, to copy onto the claim

Decisions (docs/kubernetes.md gives the trade-offs):

- MPS by a control daemon per node with host IPC, not the device plugin's MPS sharing (equal shares
  only) and not a DRA claim (Kubernetes 1.32+ and NVIDIA's DRA driver): each pod sets its own
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and sees its GPU through NVIDIA_VISIBLE_DEVICES, which the
  NVIDIA container toolkit must be told to accept from unprivileged pods.
- Every instance is its own Deployment (one replica, surge one, none unavailable): a changed
  instance starts beside the old one, which is stopped once the new one is ready (Triton finishes
  its requests on SIGTERM): the shadow swap, done by Kubernetes.
- Model repositories live on a ReadWriteMany claim (the controller writes new ones), mounted read-only per
  instance by subPath: ONNX files of hundreds of megabytes do not fit a ConfigMap (1 MiB).
- Triton's control APIs answer only requests carrying the key from the generated Secret.
"""

from __future__ import annotations

import math
import re
import secrets
from pathlib import Path

import yaml

from tritonctl.deploy import CONTROLLER_PORT, mps
from tritonctl.deploy.compose_project import check_plan, write_private
from tritonctl.deploy.local import EXIT_TIMEOUT_S
from tritonctl.deploy.proxy import Routes, Server, environment, haproxy_weights, image_buffer, render_config
from tritonctl.deploy.runtime import server_flags
from tritonctl.errors import TritonctlError
from tritonctl.planning.plan import Device, LoadedPlan, Plan, relative_to, save_plan
from tritonctl.triton.render import MODEL_VERSION, Launch, render

GRPC, HTTP, METRICS = 8001, 8000, 8002  # each pod has its own network: Triton's default ports
PROXY_METRICS = 8404
PIPE_DIR = "/tmp/nvidia-mps"
LOG_DIR = "/var/log/nvidia-mps"
MODELS_DIR = "/models"
REPOSITORY = "repository"
CLAIM = "tritonctl-models"
KEY_FILE = "control-key.env"
KEY = "TRITON_CONTROL_KEY"
SECRET = "triton-control-key"
PROXY = "haproxy"
PROXY_TAG = "3.0"  # of the official haproxy image; its version decides HAProxy's buffers (proxy.buffer_bytes)
PROXY_BUFFER = image_buffer(f"haproxy:{PROXY_TAG}")
LABEL = "tritonctl.io"
FILES = ("storage.yaml", "mps.yaml", "triton.yaml", "proxy.yaml", "controller.yaml")
CONTROLLER = "tritonctl-controller"
CONTROLLER_COMMAND = ("tritonctl", "controller")  # docker/Dockerfile's ENTRYPOINT
PLAN_DIR = "/etc/tritonctl"
WRITE = ["get", "list", "create", "update", "delete"]
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def dns_name(name: str) -> str:
    """A name as Kubernetes takes it for objects and Services (RFC 1123 label: lowercase, digits, '-')."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63].rstrip("-")


def check_namespace(namespace: str) -> None:
    """Refuse a namespace Kubernetes would not take (an RFC 1123 label of at most 63 characters)."""
    if len(namespace) > 63 or not NAME.match(namespace):
        raise TritonctlError(
            f"--namespace {namespace!r} is not a Kubernetes namespace: at most 63 lowercase letters, digits and '-', "
            "beginning and ending with a letter or digit"
        )


def prefixed(prefix: str, name: str) -> str:
    """`prefix-name` as a Kubernetes name (at most 63 characters)."""
    return f"{prefix}-{dns_name(name)}"[:63].rstrip("-")


def instance_name(instance: str) -> str:
    return prefixed("triton", instance)


def model_service(model: str) -> str:
    return prefixed("model", model)


def _names(plan: Plan, loaded: LoadedPlan) -> None:
    """Refuse two instances or models that would share a Kubernetes name."""
    seen: dict[str, str] = {}
    for kind, name, object_name in [
        *(("instance", p.instance, instance_name(p.instance)) for _, p in plan.instances()),
        *(("model", m.name, model_service(m.name)) for m in plan.models),
    ]:
        if not NAME.match(object_name):
            raise TritonctlError(f"{kind} {name!r} gives no valid Kubernetes name", file=loaded.path, field="models")
        if object_name in seen:
            raise TritonctlError(
                f"{kind} {name!r} and {seen[object_name]!r} both become {object_name!r} in Kubernetes: rename one",
                file=loaded.path,
                field="models",
            )
        seen[object_name] = name


def node_selector(plan: Plan, device: Device, node: str | None) -> dict[str, str]:
    """Where a device is: its node where the plan names nodes, else the node given, else nodes labelled with the
    cluster's name."""
    name = device.node or node
    return {"kubernetes.io/hostname": name} if name else {f"{LABEL}/cluster": dns_name(plan.cluster)}


def _deployment(name: str, labels: dict, pod: dict, template_annotations: dict | None = None, **spec) -> dict:
    """A one-replica Deployment of pods labelled `labels` running `pod` (a pod spec)."""
    metadata = {"labels": labels, **({"annotations": template_annotations} if template_annotations else {})}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            **spec,
            "selector": {"matchLabels": labels},
            "template": {"metadata": metadata, "spec": pod},
        },
    }


def _probe(path: str, period_s: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s, "failureThreshold": failures}


def triton_objects(plan: Plan, launch: Launch, node: str | None) -> list[dict]:
    """The Deployment and Service of one instance (as kustomize deploys it: one Deployment an instance)."""
    name = instance_name(launch.instance)
    return [triton_deployment(plan, launch, node, name), triton_service(launch.instance, {f"{LABEL}/deployment": name})]


def triton_deployment(plan: Plan, launch: Launch, node: str | None, name: str) -> dict:
    """The Deployment `name` running one instance, its pods labelled with the instance and the Deployment."""
    labels = {
        "app.kubernetes.io/name": "triton",
        f"{LABEL}/instance": instance_name(launch.instance),
        f"{LABEL}/deployment": name,
    }
    device = plan.device(launch.device)
    client = mps.client(launch)  # at an MPS share; else it takes turns with the whole GPU, without MPS
    env = [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": str(device.index)},
        *(
            [
                {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": launch.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]},
                {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": PIPE_DIR},
            ]
            if client
            else []
        ),
        {"name": KEY, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": KEY}}},
    ]
    container = {
        "name": "tritonserver",
        "image": "triton",
        "args": [
            "tritonserver",
            f"--model-repository={MODELS_DIR}",
            "--model-control-mode=explicit",
            f"--load-model={launch.model}",
            f"--grpc-port={GRPC}",
            f"--http-port={HTTP}",
            f"--metrics-port={METRICS}",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            f"--id={launch.instance}",
            *server_flags(f"$({KEY})"),  # Kubernetes puts the variable's value in the argument
        ],
        "env": env,
        "ports": [
            {"name": "grpc", "containerPort": GRPC},
            {"name": "http", "containerPort": HTTP},
            {"name": "metrics", "containerPort": METRICS},
        ],
        "startupProbe": _probe("/v2/health/live", 5, max(1, math.ceil(plan.runtime.startup_timeout_s / 5))),
        "readinessProbe": _probe(f"/v2/models/{launch.model}/ready", 5, 2),
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "16Gi"}},
        "volumeMounts": [
            {"name": "models", "mountPath": MODELS_DIR, "subPath": f"{launch.instance}/models", "readOnly": True},
            *([{"name": "mps-pipe", "mountPath": PIPE_DIR}] if client else []),
        ],
    }
    pod = {
        "nodeSelector": node_selector(plan, device, node),
        **({"hostIPC": True} if client else {}),  # the MPS daemon's IPC namespace is the host's
        "terminationGracePeriodSeconds": EXIT_TIMEOUT_S + 5,
        "containers": [container],
        "volumes": [
            {"name": "models", "persistentVolumeClaim": {"claimName": CLAIM, "readOnly": True}},
            *([{"name": "mps-pipe", "hostPath": {"path": PIPE_DIR, "type": "Directory"}}] if client else []),
        ],
    }
    # a new configuration is a new pod template: Kubernetes starts it beside the old one
    annotations = {f"{LABEL}/config-hash": launch.config_hash, f"{LABEL}/device": launch.device}
    rolling = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return _deployment(name, labels, pod, annotations, strategy=rolling)


def triton_service(instance: str, selector: dict[str, str]) -> dict:
    """The Service HAProxy sends an instance's requests to, selecting the pod `selector` names."""
    name = instance_name(instance)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "triton", f"{LABEL}/instance": name}},
        "spec": {
            "selector": selector,
            "ports": [
                {"name": "grpc", "port": GRPC, "targetPort": "grpc", "appProtocol": "kubernetes.io/h2c"},
                {"name": "http", "port": HTTP, "targetPort": "http"},
                {"name": "metrics", "port": METRICS, "targetPort": "metrics"},
            ],
        },
    }


def proxy_objects(plan: Plan) -> list[dict]:
    """HAProxy's Deployment and a Service per model, on the model's port."""
    labels = {"app.kubernetes.io/name": PROXY}
    ports = [{"name": f"m{i}", "containerPort": m.port} for i, m in enumerate(plan.models)]
    pod = {
        "containers": [
            {
                "name": PROXY,
                "image": PROXY,
                "ports": [*ports, {"name": "metrics", "containerPort": PROXY_METRICS}],
                "readinessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 5},
                "env": [{"name": k, "value": v} for k, v in environment(PROXY_BUFFER).items()],
                "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}},
                "volumeMounts": [
                    {"name": "config", "mountPath": "/usr/local/etc/haproxy", "readOnly": True},
                    {"name": "run", "mountPath": "/var/run/haproxy"},
                ],
            }
        ],
        "volumes": [{"name": "config", "configMap": {"name": PROXY}}, {"name": "run", "emptyDir": {}}],
    }
    deployment = _deployment(PROXY, labels, pod)
    services = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": model_service(m.name), "labels": {f"{LABEL}/model": dns_name(m.name)}},
            "spec": {
                "selector": labels,
                "ports": [{"name": "grpc", "port": m.port, "targetPort": m.port, "appProtocol": "kubernetes.io/h2c"}],
            },
        }
        for m in plan.models
    ]
    return [deployment, *services]


def proxy_config(plan: Plan) -> str:
    """HAProxy's configuration: each model's port in front of its instances' Services, weighted as planned."""
    routes: Routes = {}
    for model in plan.models:
        weights = haproxy_weights([p.weight for p in model.placements])
        routes[model.port] = [
            Server(instance_name(p.instance), instance_name(p.instance), GRPC, HTTP, w)
            for p, w in zip(model.placements, weights, strict=True)
        ]
    return render_config(
        routes, "0.0.0.0", "/var/run/haproxy/api.sock", f"0.0.0.0:{PROXY_METRICS}", resolve=True, buffer=PROXY_BUFFER
    )


def mps_objects(plan: Plan, node: str | None) -> list[dict]:
    """The MPS control daemon on each GPU node, over the GPUs the plan splits into shares there (a GPU taken in
    turns runs its instances without MPS)."""
    out = []
    for where in plan.nodes() or [None]:
        devices = [d for d in plan.devices if d.node == where and not plan.takes_turns(d.id)]
        if not devices:
            continue
        gpus = ",".join(str(d.index) for d in sorted(devices, key=lambda d: d.index))
        name = prefixed("mps-control-daemon", where) if where else "mps-control-daemon"
        labels = {"app.kubernetes.io/name": "mps-control-daemon", f"{LABEL}/daemon": name}
        out.append(
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": name, "labels": labels},
                "spec": {
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "nodeSelector": node_selector(plan, devices[0], node),
                            "hostIPC": True,
                            "containers": [
                                {
                                    "name": "mps",
                                    "image": "triton",
                                    "command": ["nvidia-cuda-mps-control", "-f"],
                                    "env": [
                                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": gpus},
                                        {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": PIPE_DIR},
                                        {"name": "CUDA_MPS_LOG_DIRECTORY", "value": LOG_DIR},
                                    ],
                                    "volumeMounts": [
                                        {"name": "mps-pipe", "mountPath": PIPE_DIR},
                                        {"name": "mps-log", "mountPath": LOG_DIR},
                                    ],
                                }
                            ],
                            "volumes": [
                                {"name": "mps-pipe", "hostPath": {"path": PIPE_DIR, "type": "DirectoryOrCreate"}},
                                {"name": "mps-log", "hostPath": {"path": LOG_DIR, "type": "DirectoryOrCreate"}},
                            ],
                        },
                    },
                },
            }
        )
    return out


def storage_objects(size: str) -> list[dict]:
    """The claim the repositories live on: the instances mount it read-only, the controller writes new ones."""
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}},
        }
    ]


def controller_role() -> dict:
    """The Role of the controller's service account: the verbs the Kubernetes runtime calls, on what it calls them."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": CONTROLLER},
        "rules": [
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": [*WRITE, "patch"]},
            {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": WRITE},
            {"apiGroups": [""], "resources": ["services", "configmaps", "secrets"], "verbs": WRITE},
            {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "create"]},
            {"apiGroups": [""], "resources": ["services/proxy"], "verbs": ["create"]},  # Triton's model reload
        ],
    }


def controller_objects(namespace: str) -> list[dict]:
    """The controller: a service account bound to its Role, and a Deployment following the plan in its ConfigMap
    (re-render and `kubectl apply -k` to change it), with its state and the repositories on the claim."""
    labels = {"app.kubernetes.io/name": CONTROLLER}
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": CONTROLLER}}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": CONTROLLER},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": CONTROLLER},
        "subjects": [{"kind": "ServiceAccount", "name": CONTROLLER, "namespace": namespace}],
    }
    args = [f"{PLAN_DIR}/plan.yaml", "--runtime", "kubernetes", "--namespace", namespace]
    pod = {
        "serviceAccountName": CONTROLLER,
        "containers": [
            {
                "name": CONTROLLER,
                "image": "tritonctl",
                "command": list(CONTROLLER_COMMAND),  # the image's entrypoint, named so that no other image's runs
                "args": [*args, "--host", "0.0.0.0"],
                "ports": [{"name": "state", "containerPort": CONTROLLER_PORT}],
                "readinessProbe": {"httpGet": {"path": "/state", "port": "state"}, "periodSeconds": 10},
                "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
                "volumeMounts": [
                    {"name": "plan", "mountPath": PLAN_DIR, "readOnly": True},
                    {"name": "models", "mountPath": MODELS_DIR},
                ],
            }
        ],
        "volumes": [
            {"name": "plan", "configMap": {"name": CONTROLLER}},
            {"name": "models", "persistentVolumeClaim": {"claimName": CLAIM}},
        ],
    }
    deployment = _deployment(CONTROLLER, labels, pod, strategy={"type": "Recreate"})  # one controller at a time
    return [account, controller_role(), binding, deployment]


def controller_plan(plan: Plan) -> Plan:
    """The plan as the controller's pod reads it: its repositories and state on the claim, each model's ONNX file
    the one in its first instance's repository there."""
    models = [
        m.model_copy(
            update={"onnx": f"{MODELS_DIR}/{m.placements[0].instance}/models/{m.name}/{MODEL_VERSION}/model.onnx"}
        )
        for m in plan.models
    ]
    runtime = plan.runtime.model_copy(update={"repository_dir": MODELS_DIR, "state_dir": f"{MODELS_DIR}/.tritonctl"})
    return plan.model_copy(update={"models": models, "runtime": runtime})


def kustomization(plan: Plan, namespace: str, files: list[str]) -> dict:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": namespace,
        "labels": [{"pairs": {"app.kubernetes.io/part-of": "tritonctl", f"{LABEL}/cluster": dns_name(plan.cluster)}}],
        "resources": files,
        "images": [
            {"name": "triton", "newName": "nvcr.io/nvidia/tritonserver", "newTag": "24.10-py3"},
            {"name": PROXY, "newName": "haproxy", "newTag": PROXY_TAG},
            {"name": "tritonctl", "newName": "tritonctl", "newTag": "latest"},  # built from docker/Dockerfile
        ],
        "configMapGenerator": [
            {"name": PROXY, "files": ["haproxy.cfg"]},
            {"name": CONTROLLER, "files": ["plan.yaml=controller-plan.yaml"]},
        ],
        "secretGenerator": [{"name": SECRET, "envs": [KEY_FILE]}],
    }


def manifests(plan: Plan, launches: dict[str, Launch], node: str | None, namespace: str) -> dict[str, list[dict]]:
    """The objects of each manifest file (a pure function of the plan and its launches)."""
    triton = [o for launch in launches.values() for o in triton_objects(plan, launch, node)]
    return {
        "storage.yaml": storage_objects("20Gi"),
        "mps.yaml": mps_objects(plan, node),
        "triton.yaml": triton,
        "proxy.yaml": proxy_objects(plan),
        "controller.yaml": controller_objects(namespace),
    }


def check_kubernetes(loaded: LoadedPlan, node: str | None) -> dict[str, Launch]:
    """Refuse a plan Kubernetes cannot run as rendered here (a CPU plan, a share MPS does not take, names that
    clash, `node` beside a plan naming its nodes); the instances' launches."""
    check_plan(loaded, None, "kubernetes")
    plan = loaded.plan
    if node is not None and not NAME.match(node.split(".")[0]):
        raise TritonctlError(f"--node {node!r} is not a Kubernetes node name")
    if node is not None and plan.nodes():
        raise TritonctlError(
            f"the plan names its devices' nodes ({', '.join(plan.nodes())}): --node is for a plan on one unnamed host",
            file=loaded.path,
            field="devices",
        )
    _names(plan, loaded)
    for i, model in enumerate(plan.models):
        if model.port == PROXY_METRICS:  # HAProxy's pod serves every model's port beside its metrics
            raise TritonctlError(
                f"port {model.port} is HAProxy's metrics port in the Kubernetes deployment; give {model.name} "
                "another port",
                file=loaded.path,
                field=f"models[{i}].port",
            )
    return {name: launch for name, (_, launch) in render(loaded, write=False).items()}


def write_kubernetes(loaded: LoadedPlan, folder: Path, node: str | None, namespace: str = "tritonctl") -> list[str]:
    """Check the plan, then write the folder (repositories included); returns the instances' object names.
    Every check runs before the first write: a refused plan leaves the folder as it was."""
    plan = loaded.plan
    runtime = plan.runtime.model_copy(update={"repository_dir": relative_to(folder / REPOSITORY, loaded.path.parent)})
    local = LoadedPlan(plan.model_copy(update={"runtime": runtime}), loaded.path)
    check_namespace(namespace)
    launches = check_kubernetes(local, node)
    objects = manifests(plan, launches, node, namespace)
    folder.mkdir(parents=True, exist_ok=True)
    render(local)
    header = f"# Rendered by tritonctl from {loaded.path} (cluster {plan.cluster}): do not edit, re-render.\n"
    for name, docs in objects.items():
        if docs:
            (folder / name).write_text(header + yaml.safe_dump_all(docs, sort_keys=False, width=120))
        else:  # no MPS daemon where every GPU is taken in turns
            (folder / name).unlink(missing_ok=True)
    (folder / "kustomization.yaml").write_text(
        header
        + "# Change here: namespace, images; resources and node labels by a patch.\n"
        + yaml.safe_dump(kustomization(plan, namespace, [n for n in FILES if objects[n]]), sort_keys=False)
    )
    (folder / "haproxy.cfg").write_text(proxy_config(plan))
    save_plan(controller_plan(plan), folder / "controller-plan.yaml")
    if not (folder / KEY_FILE).is_file():
        write_private(folder / KEY_FILE, f"{KEY}={secrets.token_hex(16)}\n")
    return [instance_name(i) for i in launches]

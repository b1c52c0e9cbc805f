"""Kubernetes runtime: Triton instances as Deployments in one namespace, driven through the Kubernetes API
(the official client, with the kubeconfig or the pod's service account).

`prepare` creates what the instances share, from kubernetes_project's manifests: the claim holding the
model repositories, the MPS daemons, HAProxy with its ConfigMap and a Service per model, the control
key's Secret. An instance is a Deployment per process hash (`triton-<instance>-<hash>`), so a shadow
and the instance it replaces run side by side. HAProxy sends an instance's requests to the Service
`triton-<instance>`, and a route points that Service at the Deployment to keep: new connections reach
the new pod; deleting the old Deployment then lets Triton finish what it holds and close its
connections, and HAProxy reconnects through the Service. A model whose instances (or weights) change
gets HAProxy's new configuration, and HAProxy's Deployment rolls.

Every call goes through KubeApi. In a dry run it prints each call and answers as if it worked; where a
cluster is reachable, calls that change objects are also sent with dryRun=All, so the API server
validates them and changes nothing. Not run against a real cluster (docs/kubernetes.md).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client as k8s
from kubernetes import config
from kubernetes.client.exceptions import ApiException

from tritonctl.deploy.kubernetes_project import (
    GRPC,
    HTTP,
    KEY,
    LABEL,
    METRICS,
    PROXY,
    PROXY_METRICS,
    SECRET,
    check_kubernetes,
    dns_name,
    instance_name,
    manifests,
    proxy_config,
    triton_deployment,
    triton_service,
)
from tritonctl.deploy.mps import share_mechanism
from tritonctl.deploy.runtime import CONTROL_HEADER, Health, InstanceRecord, StartError
from tritonctl.deploy.state import control_key
from tritonctl.errors import TritonctlError
from tritonctl.planning.plan import LoadedPlan
from tritonctl.triton.render import Launch

POLL_S = 2.0
PART_OF = "app.kubernetes.io/part-of=tritonctl"
PROXY_METRICS_SERVICE = "haproxy-metrics"


def _snake(kind: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()


APIS = {"Deployment": "apps", "DaemonSet": "apps", "Role": "rbac", "RoleBinding": "rbac"}  # else core


@dataclass
class KubeApi:
    """The Kubernetes calls the runtime makes, on objects as dicts.

    A dry run prints each call and answers as if it worked; with `client` (a reachable cluster), it also sends
    those that change objects with dryRun=All and reads for real."""

    namespace: str
    client: object | None = None  # kubernetes.client.ApiClient; None: no cluster (a dry run only)
    dry_run: bool = False
    log: Callable[[str], None] = print

    def _api(self, kind: str):
        group = APIS.get(kind, "core")
        cls = {"apps": k8s.AppsV1Api, "rbac": k8s.RbacAuthorizationV1Api, "core": k8s.CoreV1Api}[group]
        return cls(self.client)

    def _call(self, verb: str, kind: str, name: str, *args, **kwargs):
        """`verb` (create, replace, patch, delete) on the object; in a dry run printed, and sent with dryRun=All
        where a cluster answers."""
        if self.dry_run:
            self.log(f"+ {verb} {kind} {self.namespace}/{name}")
            if self.client is None:
                return None
            kwargs["dry_run"] = "All"
        elif self.client is None:
            raise TritonctlError("no Kubernetes cluster to call")
        method = getattr(self._api(kind), f"{verb}_namespaced_{_snake(kind)}")
        return method(*args, **kwargs)

    def get(self, kind: str, name: str) -> dict | None:
        """The object, or None where it does not exist (in a dry run without a cluster: None)."""
        if self.client is None:
            return None
        try:
            obj = getattr(self._api(kind), f"read_namespaced_{_snake(kind)}")(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise TritonctlError(f"reading {kind} {self.namespace}/{name}: {exc.reason}") from None
        return self.client.sanitize_for_serialization(obj)

    def apply(self, obj: dict) -> None:
        """Create the object, or replace it where one of its name exists."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            self._call("create", kind, name, self.namespace, obj)
        except ApiException as exc:
            if exc.status != 409:
                raise TritonctlError(f"creating {kind} {self.namespace}/{name}: {exc.reason}") from None
            self._call("replace", kind, name, name, self.namespace, obj)

    def create_missing(self, obj: dict) -> None:
        """Create the object unless one of its name exists (a claim, a key: never replaced)."""
        if self.get(obj["kind"], obj["metadata"]["name"]) is None:
            self.apply(obj)

    def patch(self, kind: str, name: str, body: dict) -> None:
        """A strategic merge patch (the client would otherwise send a dict as a JSON patch)."""
        self._call(
            "patch", kind, name, name, self.namespace, body, _content_type="application/strategic-merge-patch+json"
        )

    def delete(self, kind: str, name: str) -> None:
        """Delete the object (absent: nothing to do)."""
        try:
            self._call("delete", kind, name, name, self.namespace, propagation_policy="Foreground")
        except ApiException as exc:
            if exc.status != 404:
                raise TritonctlError(f"deleting {kind} {self.namespace}/{name}: {exc.reason}") from None

    def names(self, kind: str, selector: str) -> list[str]:
        """Names of the objects of `kind` carrying the label `selector`."""
        if self.client is None:
            return []
        listed = getattr(self._api(kind), f"list_namespaced_{_snake(kind)}")(self.namespace, label_selector=selector)
        return [item.metadata.name for item in listed.items]

    def post(self, service: str, port: int, path: str, headers: dict[str, str], timeout_s: float) -> str | None:
        """POST to a Service's HTTP port through the API server's proxy; the error, or None."""
        if self.dry_run:
            self.log(f"+ POST service {self.namespace}/{service}:{port}/{path}")
            return None
        # The generated connect_post_namespaced_service_proxy_with_path escapes the path's slashes: built here.
        request = self.client.param_serialize(
            "POST",
            "/api/v1/namespaces/{namespace}/services/{name}/proxy/" + path,
            path_params={"namespace": self.namespace, "name": f"{service}:{port}"},
            header_params={**headers, "Content-Type": "application/json"},
            body={},
            auth_settings=["BearerToken"],
        )
        try:
            response = self.client.call_api(*request, _request_timeout=timeout_s)
            response.read()
        except Exception as exc:  # the REST layer's own errors (connection refused, timeouts)
            return str(exc)
        if not 200 <= response.status <= 299:
            return f"{response.status} {response.reason}: {response.data.decode(errors='replace')[:200]}"
        return None


def connect(namespace: str, dry_run: bool, log: Callable[[str], None]) -> KubeApi:
    """A KubeApi on the cluster the kubeconfig (or the pod's service account) names; refused where it does not
    answer. A dry run goes on without a cluster, printing what it would call."""
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            config.load_kube_config()
        api_client = k8s.ApiClient()
        k8s.VersionApi(api_client).get_code(_request_timeout=5)
    except Exception as exc:  # no kubeconfig, a bad one, or no answer: each is the same to the user
        if dry_run:
            log(f"note: no Kubernetes cluster reachable ({str(exc).splitlines()[0][:120]}): printing the calls only")
            return KubeApi(namespace, None, True, log)
        raise TritonctlError(
            f"no Kubernetes cluster reachable with this kubeconfig ({str(exc).splitlines()[0][:160]}); nothing changed"
        ) from None
    return KubeApi(namespace, api_client, dry_run, log)


def owned(obj: dict, cluster: str) -> dict:
    """The object labelled as tritonctl's, for the cluster (`shutdown` deletes by that label)."""
    metadata = obj["metadata"]
    labels = {**metadata.get("labels", {}), "app.kubernetes.io/part-of": "tritonctl", f"{LABEL}/cluster": cluster}
    return {**obj, "metadata": {**metadata, "labels": labels}}


def _ready(deployment: dict) -> bool:
    """Whether a Deployment (as read) has its pod ready."""
    return (deployment.get("status") or {}).get("readyReplicas", 0) >= 1


def _proxy_config_map(text: str) -> dict:
    """HAProxy's ConfigMap holding `text` as its configuration."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": PROXY}, "data": {"haproxy.cfg": text}}


def deployment_name(instance: str, process_hash: str) -> str:
    """A Deployment per process hash, so an instance and its shadow are two Deployments."""
    return f"{instance_name(instance)[:54]}-{process_hash[:8]}"


class KubernetesRuntime:
    name = "kubernetes"

    def __init__(self, api: KubeApi, state_dir: Path, node: str | None = None, ready_poll_s: float = POLL_S):
        self.api = api
        self.state_dir = state_dir
        self.node = node
        self.poll_s = ready_poll_s
        self.loaded: LoadedPlan | None = None
        self._proxy_text: str | None = None  # HAProxy's configuration as last read or written

    @property
    def rehearses(self) -> bool:
        return self.api.dry_run

    def prepare(self, loaded: LoadedPlan, write: bool) -> LoadedPlan:
        """Check the plan, then create what the instances share (replacing HAProxy's model Services)."""
        check_kubernetes(loaded, self.node)
        plan = loaded.plan
        objects = manifests(plan, {}, self.node, self.api.namespace)
        key = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": SECRET},
            "stringData": {KEY: self._key()},
        }
        self.loaded = loaded
        for obj in [*objects["storage.yaml"], key, _proxy_config_map("")]:
            self.api.create_missing(self._owned(obj))
        for obj in [*objects["mps.yaml"], *objects["proxy.yaml"], self._metrics_service()]:
            if obj["kind"] == "Deployment":
                self.api.create_missing(self._owned(obj))
            else:
                self.api.apply(self._owned(obj))
        return loaded

    def _key(self) -> str:
        """The deployment's control key (a dry run writes nothing, so it sends a stand-in)."""
        return "dry-run" if self.api.dry_run else control_key(self.state_dir)

    def _owned(self, obj: dict) -> dict:
        return owned(obj, dns_name(self.loaded.plan.cluster))

    @staticmethod
    def _metrics_service() -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": PROXY_METRICS_SERVICE},
            "spec": {
                "selector": {"app.kubernetes.io/name": PROXY},
                "ports": [{"name": "metrics", "port": PROXY_METRICS, "targetPort": "metrics"}],
            },
        }

    def start(
        self,
        launch: Launch,
        folder: Path,
        host: str,
        log_dir: Path,
        timeout_s: float,
        on_spawn: Callable[[InstanceRecord], None] | None = None,
    ) -> InstanceRecord:
        name = deployment_name(launch.instance, launch.process_hash)
        self.api.apply(self._owned(triton_deployment(self.loaded.plan, launch, self.node, name)))
        record = InstanceRecord.launched(
            launch,
            uid=name,
            host=instance_name(launch.instance),
            backend_port=GRPC,
            http_port=HTTP,
            metrics_port=METRICS,
            pid=0,
            start_ticks=0,
            folder=str(folder),
            log=f"kubectl -n {self.api.namespace} logs deployment/{name}",
            share_mechanism=share_mechanism(launch),
        )
        if on_spawn is not None:
            on_spawn(record)
        deadline = time.monotonic() + timeout_s
        while not self.api.dry_run and not self.health(record).model_ready:
            if time.monotonic() > deadline:
                self.stop(record)
                raise StartError(f"{launch.instance}: Deployment {name} was not ready after {timeout_s:.0f} s")
            time.sleep(self.poll_s)
        return record

    def health(self, record: InstanceRecord) -> Health:
        deployment = self.api.get("Deployment", record.uid)
        if deployment is None:  # gone; in a dry run without a cluster, unknown: taken as it was recorded, ready
            known = self.api.client is None and self.api.dry_run
            return Health(known, known, known)
        return Health(True, _ready(deployment), _ready(deployment))

    def reconfigure(self, record: InstanceRecord, timeout_s: float) -> None:
        path = f"v2/repository/models/{record.model}/load"
        error = self.api.post(record.host, HTTP, path, {CONTROL_HEADER: self._key()}, timeout_s)
        if error is not None:
            raise StartError(f"{record.instance}: reloading {record.model} failed: {error}")

    def route(self, host: str, port: int, backends: list[tuple[InstanceRecord, float]]) -> str:
        """Point each kept instance's Service at its Deployment; roll HAProxy when its configuration changes."""
        for record, _ in backends:
            self.api.apply(self._owned(triton_service(record.instance, {f"{LABEL}/deployment": record.uid})))
        moved = ""
        if self.loaded is not None and backends and self._proxy_text != (text := proxy_config(self.loaded.plan)):
            current = self.api.get("ConfigMap", PROXY)  # once an apply: the routes after it find it current
            self._proxy_text = text
            if current is None or (current.get("data") or {}).get("haproxy.cfg") != text:
                self.api.apply(self._owned(_proxy_config_map(text)))
                digest = hashlib.sha256(text.encode()).hexdigest()[:16]
                template = {"metadata": {"annotations": {f"{LABEL}/config-hash": digest}}}
                self.api.patch("Deployment", PROXY, {"spec": {"template": template}})
                moved = ", HAProxy's configuration changed: rolling it"
        services = ", ".join(f"{r.host} -> {r.uid}" for r, _ in backends) or "closed"
        return f"port {port} -> {services}{moved}"

    def stop(self, record: InstanceRecord) -> None:
        """Delete the instance's Deployment (Triton drains on SIGTERM), and its Service where it still selects it."""
        self.api.delete("Deployment", record.uid)
        service = self.api.get("Service", record.host)
        if service is not None and service["spec"].get("selector", {}).get(f"{LABEL}/deployment") == record.uid:
            self.api.delete("Service", record.host)

    def proxy_ok(self) -> bool:
        deployment = self.api.get("Deployment", PROXY)
        return deployment is not None and _ready(deployment)

    def proxy_info(self) -> str:
        return (
            f"HAProxy: Deployment {self.api.namespace}/{PROXY}, metrics at Service "
            f"{PROXY_METRICS_SERVICE}:{PROXY_METRICS} (in the cluster)"
        )

    def proxy_metrics_url(self) -> str | None:
        """Reachable from inside the cluster only (the controller's pod)."""
        if not os.environ.get("KUBERNETES_SERVICE_HOST"):
            return None
        return f"http://{PROXY_METRICS_SERVICE}.{self.api.namespace}.svc:{PROXY_METRICS}/metrics"

    def shutdown(self) -> None:
        """Delete what runs beside the instances (HAProxy, its Services and ConfigMap, the MPS daemons, the key);
        the claim, with the repositories, stays."""
        for kind in ("Deployment", "DaemonSet", "Service", "ConfigMap", "Secret"):
            for name in self.api.names(kind, PART_OF):
                self.api.delete(kind, name)

"""The Kubernetes runtime's API calls for every change the local runtime makes (start, reload, swap, rollback on
a failed readiness, a leftover of an interrupted apply, down), through the official client against an in-memory
API server: the client's REST calls are answered by FakeCluster (no Kubernetes API server can run here). Every
object the runtime creates validates against Kubernetes' schemas; the Role the docs give covers every call."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
from kubernetes import client as k8s

from conftest import edit
from tritonctl.cli import main
from tritonctl.deploy.apply import apply_plan, down
from tritonctl.deploy.kubernetes import KubeApi, KubernetesRuntime
from tritonctl.deploy.kubernetes_project import controller_role
from tritonctl.deploy.state import control_key, load_state, save_state
from tritonctl.errors import RolledBack
from tritonctl.planning.plan import load_plan

PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/v1)/namespaces/(?P<ns>[^/]+)/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?"
)


@dataclass
class Response:
    """What the client's REST layer returns."""

    status: int
    body: object
    reason: str = ""
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})

    def __post_init__(self):
        self.data = json.dumps(self.body).encode()

    def read(self):
        return self.data

    def getheaders(self):
        return self.headers

    def getheader(self, name, default=None):
        return self.headers.get(name, default)


class FakeCluster(k8s.ApiClient):
    """An API server in memory: objects by (plural, name); Deployments ready unless `never_ready(name)`."""

    def __init__(self):
        super().__init__(k8s.Configuration(host="http://fake"))
        self.objects: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, dryRun)
        self.never_ready = lambda name: False
        self.keys: list[str | None] = []  # the control key each proxied request carried

    def call_api(self, method, url, header_params=None, body=None, post_params=None, _request_timeout=None):
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        dry = query.get("dryRun", [""])[0]
        self.requests.append((method, parts.path, dry))
        if "/proxy/" in parts.path:
            self.keys.append((header_params or {}).get("tritonctl-key"))
            return Response(200, "ok")
        m = PATH.match(parts.path)
        plural, name = m["plural"], m["name"]
        if name is None and method == "GET":  # a list, by label
            key, _, value = query.get("labelSelector", ["="])[0].partition("=")
            items = [
                o for (p, _), o in self.objects.items() if p == plural and o["metadata"]["labels"].get(key) == value
            ]
            return Response(200, {"metadata": {}, "items": items})
        if name is None:  # create
            name = body["metadata"]["name"]
            if (plural, name) in self.objects:
                return Response(409, {"kind": "Status", "code": 409}, "Conflict")
            if not dry:
                self.objects[(plural, name)] = body
            return Response(201, body)
        current = self.objects.get((plural, name))
        if current is None:
            return Response(404, {"kind": "Status", "code": 404}, "Not Found")
        if method == "GET":
            ready = plural == "deployments" and not self.never_ready(name)
            return Response(200, {**current, "status": {"readyReplicas": 1} if ready else {}})
        if method == "PUT":
            self.objects[(plural, name)] = body
        elif method == "PATCH":
            merge(current, body)
        elif method == "DELETE":
            del self.objects[(plural, name)]
            return Response(200, {"kind": "Status"})
        return Response(200, self.objects[(plural, name)])

    def named(self, plural: str) -> dict[str, dict]:
        return {name: o for (p, name), o in self.objects.items() if p == plural}


def merge(into: dict, patch: dict) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


@pytest.fixture
def cluster():
    return FakeCluster()


def runtime_on(cluster: FakeCluster, state_dir: Path) -> KubernetesRuntime:
    return KubernetesRuntime(KubeApi("serving", cluster, log=lambda _: None), state_dir, ready_poll_s=0.01)


def applied(plan: Path, cluster: FakeCluster, **kwargs):
    loaded = load_plan(plan)
    return apply_plan(loaded, runtime_on(cluster, loaded.state_dir), log=lambda _: None, **kwargs)


def test_a_plan_starts_every_instance_behind_its_service_and_every_object_is_valid(gpu_plan, cluster):
    steps = applied(gpu_plan, cluster)
    assert sorted(s.action for s in steps) == ["start"] * 4
    deployments, services = cluster.named("deployments"), cluster.named("services")
    state = load_state(load_plan(gpu_plan).state_dir)
    for record in state.instances.values():
        assert record.uid in deployments  # a Deployment per instance and process hash
        assert services[record.host]["spec"]["selector"] == {"tritonctl.io/deployment": record.uid}
    assert {"model-alpha", "model-beta", "model-gamma", "haproxy-metrics"} <= set(services)
    config = cluster.named("configmaps")["haproxy"]["data"]["haproxy.cfg"]
    assert "server triton-alpha-1 triton-alpha-1:8001 weight 85" in config  # weighted 1 against 3
    assert set(cluster.named("persistentvolumeclaims")) == {"tritonctl-models"}
    assert set(cluster.named("secrets")) == {"triton-control-key"}
    for obj in cluster.objects.values():
        kubernetes_validate.validate(obj, "1.34.0", strict=True)
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tritonctl"


def test_a_share_change_is_a_shadow_swap_and_a_batch_change_a_reload(gpu_plan, cluster):
    applied(gpu_plan, cluster)
    before = dict(cluster.named("deployments"))
    edit(gpu_plan, lambda d: d["models"][1]["placements"][0].update(share=50))  # beta: a new process
    cluster.requests.clear()
    steps = applied(gpu_plan, cluster)
    assert sorted(s.action for s in steps) == ["keep"] * 3 + ["stop", "swap"]
    (new,) = set(cluster.named("deployments")) - set(before)
    (old,) = set(before) - set(cluster.named("deployments"))
    assert new.startswith("triton-beta-0-") and old.startswith("triton-beta-0-")
    order = [(m, p.rsplit("/", 1)[-1]) for m, p, _ in cluster.requests if m in ("POST", "PUT", "DELETE")]
    created = order.index(("POST", "deployments"))
    pointed = order.index(("PUT", "triton-beta-0"))  # the Service now selects the new Deployment
    deleted = order.index(("DELETE", old))
    assert created < pointed < deleted  # start the shadow, move the Service, then drain and delete the old one
    assert cluster.named("services")["triton-beta-0"]["spec"]["selector"] == {"tritonctl.io/deployment": new}

    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(batch=4))  # alpha-0: batch only
    cluster.requests.clear()
    steps = applied(gpu_plan, cluster)
    assert [s.action for s in steps if s.action != "keep"] == ["reload"]
    proxied = [p for m, p, _ in cluster.requests if "/proxy/" in p]
    assert proxied == [
        "/api/v1/namespaces/serving/services/triton-alpha-0%3A8000/proxy/v2/repository/models/alpha/load"
    ]
    assert not [r for r in cluster.requests if r[0] == "POST" and r[1].endswith("/deployments")]
    assert cluster.keys == [control_key(load_plan(gpu_plan).state_dir)]  # Triton's model control asks for it


def test_an_instance_that_never_gets_ready_is_rolled_back_and_the_rest_keeps_serving(gpu_plan, cluster):
    applied(gpu_plan, cluster)
    before = {n: json.dumps(o, sort_keys=True) for n, o in cluster.named("deployments").items()}
    services = {n: json.dumps(o, sort_keys=True) for n, o in cluster.named("services").items()}
    edit(gpu_plan, lambda d: d["models"][2]["placements"][0].update(share=30))
    edit(gpu_plan, lambda d: d["runtime"].update(startup_timeout_s=1))
    cluster.never_ready = lambda name: name.startswith("triton-gamma-0-") and name not in before
    loaded = load_plan(gpu_plan)
    plan = loaded.plan
    with pytest.raises(RolledBack, match="rolled back"):
        apply_plan(loaded, runtime_on(cluster, loaded.state_dir), log=lambda _: None)
    assert {n: json.dumps(o, sort_keys=True) for n, o in cluster.named("deployments").items()} == before
    assert {n: json.dumps(o, sort_keys=True) for n, o in cluster.named("services").items()} == services
    assert len(load_state(loaded.state_dir).instances) == sum(len(m.placements) for m in plan.models)


def test_a_deployment_left_by_an_interrupted_apply_is_found_and_stopped(gpu_plan, cluster):
    applied(gpu_plan, cluster)
    loaded = load_plan(gpu_plan)
    state = load_state(loaded.state_dir)
    (record,) = [r for r in state.instances.values() if r.instance == "gamma-0"]
    leftover = {
        **cluster.named("deployments")[record.uid],
        "metadata": {"name": "triton-gamma-0-deadbeef", "labels": {}},
    }
    cluster.objects[("deployments", "triton-gamma-0-deadbeef")] = leftover
    state.instances["triton-gamma-0-deadbeef"] = replace(record, uid="triton-gamma-0-deadbeef", config_hash="other")
    save_state(loaded.state_dir, state)  # what an apply killed after creating the shadow had recorded
    steps = applied(gpu_plan, cluster)
    assert [(s.action, s.uid) for s in steps if s.action != "keep"] == [("stop", "triton-gamma-0-deadbeef")]
    assert "triton-gamma-0-deadbeef" not in cluster.named("deployments")
    assert cluster.named("services")["triton-gamma-0"]["spec"]["selector"] == {"tritonctl.io/deployment": record.uid}


def test_down_deletes_all_but_the_claim_and_the_role_covers_every_call(gpu_plan, cluster):
    applied(gpu_plan, cluster)
    edit(gpu_plan, lambda d: d["models"][1]["placements"][0].update(share=50))
    applied(gpu_plan, cluster)
    edit(gpu_plan, lambda d: d["models"][0]["placements"][0].update(batch=4))
    applied(gpu_plan, cluster)
    loaded = load_plan(gpu_plan)
    runtime = runtime_on(cluster, loaded.state_dir)
    assert down(loaded.state_dir, runtime, log=lambda _: None) == 4
    assert set(cluster.objects) == {("persistentvolumeclaims", "tritonctl-models")}
    verbs = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
    allowed = {(r, v) for rule in controller_role()["rules"] for r in rule["resources"] for v in rule["verbs"]}
    for method, path, _ in cluster.requests:
        m = PATH.match(path)
        resource = "services/proxy" if "/proxy/" in path else m["plural"]
        verb = "list" if method == "GET" and m["name"] is None else verbs[method]
        assert (resource, verb) in allowed, (method, path)


def test_without_a_cluster_a_dry_run_prints_the_calls_and_a_real_apply_is_refused(
    gpu_plan, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nowhere"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    before = gpu_plan.read_text()
    assert main(["apply", str(gpu_plan), "--runtime", "kubernetes", "--dry-run", "--namespace", "serving"]) == 1
    out = capsys.readouterr()
    assert "no Kubernetes cluster reachable" in out.out + out.err
    assert "+ create Deployment serving/triton-alpha-0-" in out.out + out.err
    assert main(["apply", str(gpu_plan), "--runtime", "kubernetes"]) == 2
    assert "no Kubernetes cluster reachable with this kubeconfig" in capsys.readouterr().err
    assert not load_plan(gpu_plan).state_dir.exists()  # neither the dry run nor the refusal wrote anything
    assert gpu_plan.read_text() == before  # the plan is untouched

"""The Kubernetes target: every rendered manifest valid against Kubernetes' own OpenAPI schemas, every
cross-reference resolving, HAProxy's configuration accepted by HAProxy, the folder built by kustomize (kubectl's),
and refusals that write nothing. No Kubernetes API server runs here: nothing is applied to a cluster."""

from __future__ import annotations

import base64
import json
import shutil
import stat
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from conftest import REPO, edit, make_mlp, mlp_model, write_cluster
from tritonctl.cli import build_parser, main
from tritonctl.deploy.local import haproxy_binary
from tritonctl.deploy.proxy import LARGE_BUFFER_BYTES, MALLOC_ENV
from tritonctl.planning.plan import load_plan

KUBERNETES = "1.34.0"  # a recent release; kubernetes-validate ships its schemas offline


def rendered(out: Path) -> dict[str, list[dict]]:
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    return {name: list(yaml.safe_load_all((out / name).read_text())) for name in kustomization["resources"]}


def test_the_controller_runs_the_images_entrypoint_with_arguments_tritonctl_takes(gpu_plan, tmp_path):
    out = tmp_path / "k8s"
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(out)]) == 0
    (deployment,) = [o for o in rendered(out)["controller.yaml"] if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    (entrypoint,) = [
        json.loads(line.split(None, 1)[1]) for line in dockerfile.splitlines() if line.startswith("ENTRYPOINT")
    ]
    assert container["command"] == entrypoint == ["tritonctl", "controller"]
    parsed = build_parser().parse_args([*container["command"][1:], *container["args"]])  # argparse exits on a stray one
    assert parsed.plan == "/etc/tritonctl/plan.yaml" and parsed.runtime == "kubernetes"


def test_a_folder_holding_the_other_targets_rendering_is_refused(gpu_plan, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["render", str(gpu_plan), "--target", "compose", "-o", str(out), "--gpus", "2"]) == 0
    before = sorted(p.name for p in out.iterdir())
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(out)]) == 2
    assert "holds a Compose project (compose.yaml): render into another folder" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(tmp_path / "k8s")]) == 0
    assert main(["render", str(gpu_plan), "--target", "compose", "-o", str(tmp_path / "k8s"), "--gpus", "2"]) == 2
    assert "holds a Kubernetes folder (kustomization.yaml)" in capsys.readouterr().err


def test_a_model_port_on_haproxys_metrics_port_is_refused(gpu_plan, tmp_path, capsys):
    edit(gpu_plan, lambda d: d["models"][1].update(port=8404))
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(tmp_path / "k8s")]) == 2
    err = capsys.readouterr().err
    assert "models[1].port" in err and "port 8404 is HAProxy's metrics port" in err and not (tmp_path / "k8s").exists()


def test_every_manifest_is_valid_kubernetes_and_every_reference_resolves(gpu_plan, tmp_path):
    out = tmp_path / "k8s"
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(out), "--node", "gpu-node-1"]) == 0
    files = rendered(out)
    objects = [o for docs in files.values() for o in docs]
    for o in objects:
        kubernetes_validate.validate(o, KUBERNETES, strict=True)
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    generated = {g["name"] for g in kustomization["configMapGenerator"] + kustomization["secretGenerator"]}
    for generator in kustomization["configMapGenerator"] + kustomization["secretGenerator"]:
        for f in generator.get("files", []) + generator.get("envs", []):
            assert (out / f.split("=")[-1]).is_file()  # key=file: the key in the ConfigMap, the file here
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    workloads = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]
    for w in workloads:
        pod = w["spec"]["template"]
        assert w["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        if w["metadata"]["name"] not in ("haproxy", "tritonctl-controller"):  # these may run on any node
            assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "gpu-node-1"}
        for volume in pod["spec"]["volumes"]:
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
            if "configMap" in volume:
                assert volume["configMap"]["name"] in generated
        for container in pod["spec"]["containers"]:
            for env in container.get("env", []):
                if "valueFrom" in env:
                    assert env["valueFrom"]["secretKeyRef"]["name"] in generated
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in workloads]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for service in services.values():  # every Service selects pods that exist, on ports they name
        assert any(service["spec"]["selector"].items() <= labels.items() for labels in pods)

    plan = load_plan(gpu_plan).plan
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    for model in plan.models:
        (port,) = services[f"model-{model.name.replace('_', '-')}"]["spec"]["ports"]
        assert port["port"] == model.port
        for p in model.placements:
            container = deployments[f"triton-{p.instance.replace('_', '-')}"]["spec"]["template"]["spec"]["containers"][
                0
            ]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["NVIDIA_VISIBLE_DEVICES"] == str(plan.device(p.device).index)
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(p.share)
            mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
            assert (out / "repository" / mount["subPath"] / model.name / "config.pbtxt").is_file()
            assert container["readinessProbe"]["httpGet"]["path"] == f"/v2/models/{model.name}/ready"

    config = (out / "haproxy.cfg").read_text()
    assert "server triton-alpha-0 triton-alpha-0:8001 weight 256" in config
    assert "server triton-alpha-1 triton-alpha-1:8001 weight 85" in config  # 1 against 3
    # HAProxy's image is 3.0: buffers that hold a whole request, with glibc keeping the memory they free
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert {"name": "haproxy", "newName": "haproxy", "newTag": "3.0"} in kustomization["images"]
    assert f"tune.bufsize {LARGE_BUFFER_BYTES}\n" in config
    (proxy,) = deployments["haproxy"]["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in proxy["env"]} == MALLOC_ENV
    for line in config.splitlines():
        if line.strip().startswith("server "):
            assert line.split()[1] in services  # a server per instance Service
    checked = subprocess.run([haproxy_binary(), "-c", "-f", str(out / "haproxy.cfg")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr  # the Services' names need not resolve here


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_kustomize_builds_the_folder_into_valid_objects_whose_references_follow_the_generated_names(gpu_plan, tmp_path):
    out = tmp_path / "k8s"
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(out), "--node", "gpu-node-1"]) == 0
    built = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    objects = list(yaml.safe_load_all(built.stdout))
    for o in objects:
        kubernetes_validate.validate(o, KUBERNETES, strict=True)
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tritonctl"
        assert o["metadata"]["namespace"] == "tritonctl"  # every object is namespaced
    by_kind: dict[str, dict[str, dict]] = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    # generated objects carry a hash of their content in their names, and every pod refers to them by that name
    (config,) = [c for name, c in by_kind["ConfigMap"].items() if name.startswith("haproxy-")]
    assert config["data"]["haproxy.cfg"] == (out / "haproxy.cfg").read_text()
    (key,) = [k for name, k in by_kind["Secret"].items() if name.startswith("triton-control-key-")]
    written = (out / "control-key.env").read_text().strip().split("=", 1)[1]
    assert base64.b64decode(key["data"]["TRITON_CONTROL_KEY"]).decode() == written
    workloads = [o for kind in ("Deployment", "DaemonSet") for o in by_kind.get(kind, {}).values()]
    images = set()
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in by_kind["ConfigMap"]
        for container in pod["containers"]:
            images.add(container["image"])
            for env in container.get("env", []):
                if "secretKeyRef" in env.get("valueFrom", {}):
                    assert env["valueFrom"]["secretKeyRef"]["name"] in by_kind["Secret"]
    assert images == {"nvcr.io/nvidia/tritonserver:24.10-py3", "haproxy:3.0", "tritonctl:latest"}
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in workloads]
    for service in by_kind["Service"].values():  # the labels added to every object leave the selectors working
        assert any(service["spec"]["selector"].items() <= labels.items() for labels in pods)


def test_the_control_key_is_private_and_kept_across_renders(gpu_plan, tmp_path):
    out = tmp_path / "k8s"
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(out)]) == 0
    key = out / "control-key.env"
    first = key.read_text()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and first.startswith("TRITON_CONTROL_KEY=")
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(out)]) == 0
    assert key.read_text() == first
    triton = list(yaml.safe_load_all((out / "triton.yaml").read_text()))
    pod = triton[0]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"tritonctl.io/cluster": "test"}  # no --node: nodes labelled for the cluster
    assert first.split("=", 1)[1].strip() not in (out / "triton.yaml").read_text()


def test_a_cpu_plan_or_clashing_names_are_refused_before_anything_is_written(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha")])
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(cluster), "-o", str(plan)]) == 0
    out = tmp_path / "k8s"
    assert main(["render", str(plan), "--target", "kubernetes", "-o", str(out)]) == 2
    assert "the kubernetes target deploys GPU plans" in capsys.readouterr().err and not out.exists()

    gpus = [{"kind": "gpu", "count": 1, "units": 100, "memory_mb": 8000}]
    clash = write_cluster(tmp_path, [mlp_model("a_b"), mlp_model("a-b")], devices=gpus)
    assert main(["plan", str(clash), "-o", str(plan)]) == 0
    assert main(["render", str(plan), "--target", "kubernetes", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "instance 'a-b-0' and 'a_b-0' both become 'triton-a-b-0' in Kubernetes" in err
    assert not out.exists()


def test_a_cluster_across_nodes_plans_names_each_node_and_renders_each_instance_on_its_node(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    nodes = [
        {"kind": "gpu", "count": 2, "units": 100, "memory_mb": 8000, "node": "gpu-a"},
        {"kind": "gpu", "count": 1, "units": 100, "memory_mb": 8000, "node": "gpu-b"},
    ]
    cluster = write_cluster(tmp_path, [mlp_model(n) for n in ("alpha", "beta", "gamma")], devices=nodes)
    plan_path = tmp_path / "plan.yaml"
    assert main(["plan", str(cluster), "-o", str(plan_path)]) == 0
    plan = load_plan(plan_path).plan
    assert [(d.id, d.node, d.index) for d in plan.devices] == [
        ("gpu-a-gpu0", "gpu-a", 0), ("gpu-a-gpu1", "gpu-a", 1), ("gpu-b-gpu0", "gpu-b", 0)
    ]  # fmt: skip
    out = tmp_path / "k8s"
    assert main(["render", str(plan_path), "--target", "kubernetes", "-o", str(out)]) == 0
    files = rendered(out)
    for o in (o for docs in files.values() for o in docs):
        kubernetes_validate.validate(o, KUBERNETES, strict=True)
    deployments = {o["metadata"]["name"]: o for o in files["triton.yaml"] if o["kind"] == "Deployment"}
    for _, p in plan.instances():
        pod = deployments[f"triton-{p.instance}"]["spec"]["template"]["spec"]
        device = plan.device(p.device)
        assert pod["nodeSelector"] == {"kubernetes.io/hostname": device.node}
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == str(device.index)
    daemons = {d["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"]: d for d in files["mps.yaml"]}
    assert set(daemons) == {"gpu-a", "gpu-b"}
    assert daemons["gpu-a"]["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"] == "0,1"
    capsys.readouterr()

    assert main(["render", str(plan_path), "--target", "kubernetes", "-o", str(tmp_path / "x"), "--node", "n"]) == 2
    assert "--node is for a plan on one unnamed host" in capsys.readouterr().err
    cpu_nodes = [{"kind": "cpu", "cores": 2, "units": 100, "memory_mb": 4096, "node": n} for n in ("a", "b")]
    cpu_plan = tmp_path / "cpu-plan.yaml"
    assert (
        main(["plan", str(write_cluster(tmp_path, [mlp_model("alpha")], devices=cpu_nodes)), "-o", str(cpu_plan)]) == 0
    )
    capsys.readouterr()
    assert main(["apply", str(cpu_plan), "--dry-run"]) == 2
    assert "on 2 nodes (a, b); the local runtime deploys on one host" in capsys.readouterr().err
    assert main(["render", str(plan_path), "--target", "compose", "-o", str(tmp_path / "c"), "--gpus", "2"]) == 2
    assert "the compose runtime deploys on one host" in capsys.readouterr().err

    edit(plan_path, lambda d: d["models"][0]["placements"][0].update(device="gpu-c-gpu0"))  # a node not declared
    assert main(["render", str(plan_path), "--target", "kubernetes", "-o", str(tmp_path / "y")]) == 2
    assert "unknown device 'gpu-c-gpu0'" in capsys.readouterr().err and not (tmp_path / "y").exists()

    half = [nodes[0], {**nodes[1], "node": None}]
    assert main(["plan", str(write_cluster(tmp_path, [mlp_model("alpha")], devices=half)), "-o", str(plan_path)]) == 2
    assert "devices[1].node" in capsys.readouterr().err


def test_gpus_taken_in_turns_render_no_mps(gpu_plan, tmp_path):
    """Every GPU taken in turns: no MPS DaemonSet (mps.yaml is neither written nor listed), and the Triton pods
    carry no MPS settings, pipe or host IPC; every object still valid."""

    def whole_gpus(data):
        data["turns"] = ["gpu0", "gpu1"]
        for model in data["models"]:
            for placement in model["placements"]:
                placement["share"] = 100

    out = tmp_path / "k8s"
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(out)]) == 0
    assert (out / "mps.yaml").is_file()
    edit(gpu_plan, whole_gpus)
    assert main(["render", str(gpu_plan), "--target", "kubernetes", "-o", str(out)]) == 0
    files = rendered(out)
    assert "mps.yaml" not in files and not (out / "mps.yaml").exists()
    for o in (o for docs in files.values() for o in docs):
        kubernetes_validate.validate(o, KUBERNETES, strict=True)
    for deployment in (o for o in files["triton.yaml"] if o["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert not any(e["name"].startswith("CUDA_MPS") for e in container["env"])
        assert "hostIPC" not in pod and [v["name"] for v in pod["volumes"]] == ["models"]


@pytest.mark.parametrize("runtime", [False, True])
def test_a_namespace_kubernetes_would_not_take_is_refused_before_anything_is_written(
    gpu_plan, tmp_path, capsys, runtime
):
    out = tmp_path / "k8s"
    argv = (
        ["apply", str(gpu_plan), "--runtime", "kubernetes", "--dry-run"]
        if runtime
        else ["render", str(gpu_plan), "--target", "kubernetes", "-o", str(out)]
    )
    capsys.readouterr()
    assert main([*argv, "--namespace", "Bad_NS!"]) == 2
    assert "--namespace 'Bad_NS!' is not a Kubernetes namespace" in capsys.readouterr().err
    assert not out.exists()

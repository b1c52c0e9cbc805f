"""Planning and rendering: the spread policy, plan files, and Triton configs Triton's own schema accepts."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from conftest import REPO
from tritonctl.deploy.apply import Step, changed
from tritonctl.export import materialize
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import Device, Prediction, load_plan, save_plan
from tritonctl.planning.planner import make_plan
from tritonctl.planning.policies import Demand, PlacementError
from tritonctl.planning.policies.spread import spread
from tritonctl.spec import load_cluster
from tritonctl.triton.render import render


def gpus(n: int, memory_mb: int = 1000) -> list[Device]:
    return [Device(id=f"gpu{i}", kind="gpu", index=i, memory_mb=memory_mb, units=100) for i in range(n)]


def test_spread_uses_every_device_and_hands_out_all_units():
    models = [Demand(f"m{i}", 50, 10, 100 + i) for i in range(5)]
    choices = spread(models, gpus(2))
    assert sorted(choices) == sorted(m.name for m in models)
    per_device: dict[str, list[int]] = {}
    for (choice,) in choices.values():
        per_device.setdefault(choice.device, []).append(choice.share)
        assert choice.batch == 1
    assert sorted(len(v) for v in per_device.values()) == [2, 3]
    assert all(sum(shares) == 100 for shares in per_device.values())


def test_spread_respects_memory():
    models = [Demand("big", 50, 10, 900), Demand("b2", 50, 10, 900), Demand("small", 50, 10, 50)]
    choices = spread(models, gpus(2))
    assert choices["big"][0].device != choices["b2"][0].device
    with pytest.raises(PlacementError, match="fits on no device"):
        spread(models + [Demand("b3", 50, 10, 900)], gpus(2))


def test_plan_file_round_trips_and_carries_what_later_stages_need(mlp_cluster):
    cluster = load_cluster(mlp_cluster)
    out = mlp_cluster.parent / "plan.yaml"
    plan = make_plan(cluster, materialize(cluster, log=lambda _: None), "spread", out)
    save_plan(plan, out)
    loaded = load_plan(out)
    assert loaded.plan == plan
    raw = yaml.safe_load(out.read_text())
    placement = raw["models"][0]["placements"][0]
    assert set(placement) >= {"instance", "device", "share", "batch", "queue_delay_us"}
    assert raw["models"][0]["port"] != raw["models"][1]["port"]
    assert loaded.resolve(plan.models[0].onnx) == (mlp_cluster.parent / "mlp.onnx").resolve()


def test_a_plan_predicted_overloaded_round_trips(mlp_cluster):
    """An overloaded placement has no latency prediction (None, left out of the file); it must load back."""
    cluster = load_cluster(mlp_cluster)
    out = mlp_cluster.parent / "plan.yaml"
    plan = make_plan(cluster, materialize(cluster, log=lambda _: None), "spread", out)
    model = plan.models[0]
    overloaded = model.placements[0].model_copy(
        update={"predicted": Prediction(exec_ms=50.0, latency_ms=None, throughput_rps=20.0, meets_slo=False)}
    )
    plan = plan.model_copy(update={"models": [model.model_copy(update={"placements": [overloaded]}), *plan.models[1:]]})
    save_plan(plan, out)
    assert "latency_ms" not in out.read_text()
    assert load_plan(out).plan == plan


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    """Parse with Triton's own ModelConfig protobuf: unknown fields or bad values raise."""
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_cpu_render_is_deterministic_and_valid(mlp_cluster, tmp_path):
    from tritonctl.cli import main

    assert main(["plan", str(mlp_cluster)]) == 0
    loaded = load_plan(mlp_cluster.parent / "plan.yaml")
    rendered = render(loaded)
    repo = loaded.resolve(loaded.plan.runtime.repository_dir)
    first = tree_digest(repo)
    shutil.rmtree(repo)
    render(loaded)
    assert tree_digest(repo) == first

    folder, launch = rendered["alpha-0"]
    config = parse_config(folder / "models" / "alpha" / "config.pbtxt")
    assert config.name == "alpha" and config.backend == "python"
    assert config.max_batch_size == 1
    assert list(config.dynamic_batching.preferred_batch_size) == [1]
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert config.input[0].name == "x" and list(config.input[0].dims) == [16]
    assert config.parameters["intra_op_threads"].string_value == "1"  # 50 units of 2 cores = 1 core
    assert (folder / "models" / "alpha" / "1" / "model.py").is_file()
    settings = json.loads((folder / "launch.json").read_text())
    assert settings["cpu_quota_us"] == 10_000 and settings["cpu_period_us"] == 10_000
    assert launch.share == 50 and launch.env == {"TRITONCTL_ORT_SPINNING": "0"}  # no MPS variables on a CPU


def test_a_repository_snapshot_puts_back_what_a_new_render_replaced(mlp_cluster, monkeypatch):
    from tritonctl.cli import main
    from tritonctl.deploy.apply import put_back
    from tritonctl.deploy.state import RepositorySnapshot

    assert main(["plan", str(mlp_cluster)]) == 0
    plan_path = mlp_cluster.parent / "plan.yaml"
    render(load_plan(plan_path))
    loaded = load_plan(plan_path)
    repo = loaded.resolve(loaded.plan.runtime.repository_dir)
    before, folder = tree_digest(repo), (repo / "alpha-0").stat().st_ino
    data = yaml.safe_load(plan_path.read_text())
    data["models"][0]["placements"][0]["batch"] = 4
    data["models"][1]["placements"][0]["instance"] = "beta-new"
    plan_path.write_text(yaml.safe_dump(data, sort_keys=False))
    edited = load_plan(plan_path)
    names = [p.instance for _, p in edited.plan.instances()]
    assert names == ["alpha-0", "beta-new"]

    snapshot = RepositorySnapshot.take(repo, names)
    onnx = repo / "alpha-0" / "models" / "alpha" / "1" / "model.onnx"
    assert onnx.stat().st_nlink >= 3  # the export, the repository, the snapshot: linked, not copied
    render(edited)
    (repo / "alpha-0" / "stray.txt").write_text("written by the apply")
    assert tree_digest(repo) != before and (repo / "beta-new").is_dir()
    snapshot.restore()
    assert tree_digest(repo) == before  # alpha-0's old config back, beta-new gone, the snapshot folder too
    assert (repo / "alpha-0").stat().st_ino == folder  # the same folder, which a container's bind mount follows

    snapshot = RepositorySnapshot.take(repo, names)
    render(edited)
    rendered = tree_digest(repo / "alpha-0")
    snapshot.restore(keep={"alpha-0"})  # reloaded with the new config before the apply failed: it keeps it
    assert tree_digest(repo / "alpha-0") == rendered and not (repo / "beta-new").exists()

    said: list[str] = []
    snapshot = RepositorySnapshot.take(repo, names)
    render(edited)

    def full_disk(self, keep=()):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RepositorySnapshot, "restore", full_disk)
    put_back(snapshot, (), said.append)  # says so, and the apply raises its own error after it
    assert said == [
        f"WARNING: the model repositories were not put back as they were ([Errno 28] No space left on device); "
        f"{snapshot.folder} holds them"
    ]
    snapshot.discard()
    assert not snapshot.folder.exists() and (repo / "beta-new").is_dir()


def test_reject_late_renders_the_slo_for_the_glue_and_is_a_reload(mlp_cluster):
    from tritonctl.cli import main

    data = yaml.safe_load(mlp_cluster.read_text())
    assert "reject_late" not in data["runtime"]  # on by default
    assert main(["plan", str(mlp_cluster)]) == 0
    folder, late = render(load_plan(mlp_cluster.parent / "plan.yaml"))["alpha-0"]
    config = parse_config(folder / "models" / "alpha" / "config.pbtxt")
    assert config.parameters["reject_late_slo_ms"].string_value == "50"  # alpha's SLO, for the glue to keep
    assert "reject_late_always" not in config.parameters  # only while overloaded
    assert not config.dynamic_batching.HasField("default_queue_policy")  # never Triton's queue policy

    data["runtime"]["reject_late"] = False
    mlp_cluster.write_text(yaml.safe_dump(data))
    assert main(["plan", str(mlp_cluster)]) == 0
    folder, plain = render(load_plan(mlp_cluster.parent / "plan.yaml"))["alpha-0"]
    config = parse_config(folder / "models" / "alpha" / "config.pbtxt")
    assert "reject_late_slo_ms" not in config.parameters  # turned off: every request is served, late or not
    assert not config.dynamic_batching.HasField("default_queue_policy")

    data["runtime"]["reject_late"] = "always"  # overloaded or not
    mlp_cluster.write_text(yaml.safe_dump(data))
    assert main(["plan", str(mlp_cluster)]) == 0
    folder, _ = render(load_plan(mlp_cluster.parent / "plan.yaml"))["alpha-0"]
    always = parse_config(folder / "models" / "alpha" / "config.pbtxt").parameters
    assert always["reject_late_always"].string_value == "1" and always["reject_late_slo_ms"].string_value == "50"
    assert late.process_hash == plain.process_hash and late.config_hash != plain.config_hash  # a reload


@pytest.fixture(scope="module")
def inss_plan(tmp_path_factory):
    """The shipped InSS GPU example, planned into a temporary folder (exports cached in the repo)."""
    folder = tmp_path_factory.mktemp("inss")
    spec = yaml.safe_load((REPO / "examples" / "inss-gpu" / "cluster.yaml").read_text())
    spec["runtime"].update(
        export_dir=str(REPO / "model_repository" / "exports"), repository_dir="repo", state_dir="state"
    )
    cluster_file = folder / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(spec))
    cluster = load_cluster(cluster_file)
    plan = make_plan(cluster, materialize(cluster, log=lambda _: None), "spread", folder / "plan.yaml")
    save_plan(plan, folder / "plan.yaml")
    return load_plan(folder / "plan.yaml")


def test_spinning_onnxruntime_threads_is_a_new_process(mlp_cluster, monkeypatch):
    """TRITONCTL_ORT_SPINNING is read by the instance's Python backend at start: `apply` under another value
    must start new instances, so it is part of what the process is started with."""
    from tritonctl.cli import main

    assert main(["plan", str(mlp_cluster)]) == 0
    loaded = load_plan(mlp_cluster.parent / "plan.yaml")
    monkeypatch.delenv("TRITONCTL_ORT_SPINNING", raising=False)
    _, quiet = render(loaded)["alpha-0"]
    monkeypatch.setenv("TRITONCTL_ORT_SPINNING", "1")
    _, spinning = render(loaded)["alpha-0"]
    assert (quiet.env["TRITONCTL_ORT_SPINNING"], spinning.env["TRITONCTL_ORT_SPINNING"]) == ("0", "1")
    assert spinning.process_hash != quiet.process_hash


def test_inss_gpu_example_renders_valid_gpu_configs(inss_plan):
    plan = inss_plan.plan
    assert [m.slo_ms for m in plan.models] == [25, 80, 150, 50, 60, 40, 60, 200]
    assert len(plan.devices) == 4 and {p.device for _, p in plan.instances()} == {d.id for d in plan.devices}
    rendered = render(inss_plan)
    assert len(rendered) == 8
    for model, placement in plan.instances():
        folder, launch = rendered[placement.instance]
        config = parse_config(folder / "models" / model.name / "config.pbtxt")
        assert config.backend == "onnxruntime"
        assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
        assert list(config.instance_group[0].gpus) == [0]
        assert list(config.input[0].dims) == [3, 224, 224] and list(config.output[0].dims) == [1000]
        assert not (folder / "models" / model.name / "1" / "model.py").exists()
        assert (folder / "models" / model.name / "1" / "model.onnx").stat().st_size > 1_000_000
        assert launch.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(placement.share)
        assert launch.env["CUDA_VISIBLE_DEVICES"] == str(plan.device(placement.device).index)
        assert launch.cpu_quota_us is None


def test_gpu_plan_is_refused_by_the_local_runtime(inss_plan, capsys):
    from tritonctl.cli import main

    assert main(["apply", str(inss_plan.path)]) == 2
    assert "this plan needs a GPU, and NVML sees no GPU" in capsys.readouterr().err


def test_device_sets_try_fewest_devices_first_keeping_the_hosts_numbering(tmp_path):
    from conftest import make_mlp, mlp_model, write_cluster
    from tritonctl.planning.planner import device_sets

    make_mlp(tmp_path / "mlp.onnx")
    two = {"kind": "cpu", "count": 2, "cores": 2, "units": 100, "memory_mb": 4096}
    one = {**two, "count": 1, "cores": 4}
    cluster = load_cluster(write_cluster(tmp_path, [mlp_model("alpha")], devices=[two, one]))
    sets = [sorted(s) for s in device_sets(cluster)]
    assert sets[:2] == [["cpu0"], ["cpu2"]] and sorted(sets[2:4]) == [["cpu0", "cpu1"], ["cpu0", "cpu2"]]
    assert sets[-1] == ["cpu0", "cpu1", "cpu2"] and len(sets) == 5


def one_device_capacity(lm) -> float:
    """Requests/s one whole 2-core device serves of the synthetic model "alpha" within the test models' 50 ms."""
    return max(1000 * b / t for b in range(1, 33) if (t := lm.t_inf("alpha", b, 100)) <= 50)


@pytest.mark.parametrize(("rate", "devices"), [(5, 1), (None, 2)])
def test_plan_minimise_devices_uses_the_fewest_that_serve_every_model(tmp_path, capsys, synthetic_lm, rate, devices):
    from conftest import make_mlp, mlp_model, write_cluster
    from tritonctl.cli import main

    make_mlp(tmp_path / "mlp.onnx")
    lm = load_latency_model(synthetic_lm)
    if rate is None:  # one device does not carry both models within their SLO (queueing), two do
        rate = 0.2 * one_device_capacity(lm)
    device = {"kind": "cpu", "count": 3, "cores": 2, "units": 100, "memory_mb": 4096}
    models = [mlp_model("alpha", rate=rate), mlp_model("beta", rate=rate)]
    cluster = write_cluster(tmp_path, models, devices=[device])
    plan = tmp_path / "plan.yaml"
    argv = ["plan", str(cluster), "--latency-model", str(synthetic_lm), "--minimise", "devices", "-o", str(plan)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    planned = load_plan(plan).plan
    assert len(planned.devices) == devices and f"fewest devices: {devices} of 3" in out
    assert all(p.predicted.meets_slo for _, p in planned.instances())


def test_plan_minimise_devices_batches_as_asked_and_says_what_the_kept_plan_extrapolates(inss_plan, capsys):
    from tritonctl.cli import main

    cluster, plan = inss_plan.path.parent / "cluster.yaml", inss_plan.path.parent / "minimised.yaml"
    lm = REPO / "profiles" / "inss-gpu" / "latency-model.json"
    argv = ["plan", str(cluster), "--latency-model", str(lm), "--minimise", "devices", "--batching", "eager"]
    assert main([*argv, "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "fewest devices: 1 of 4 (gpu0)" in out and load_plan(plan).plan.batching == "eager"
    assert out.count("lies outside the profiled range") == 8  # eight models at shares of 12-13 (profiled 25-100)


@pytest.mark.parametrize("batching", ["eager", "fill"])
def test_batches_are_predicted_as_tritons_batcher_runs_them_as_the_simulator_does(inss_plan, capsys, batching):
    from tritonctl.cli import main

    cluster, plan = inss_plan.path.parent / "cluster.yaml", inss_plan.path.parent / f"gpulet-{batching}.yaml"
    lm = REPO / "profiles" / "inss-gpu" / "latency-model.json"
    argv = ["plan", str(cluster), "--latency-model", str(lm), "--policy", "gpulet", "--batching", batching]
    assert main([*argv, "-o", str(plan)]) == 0
    assert "predicted to miss" not in capsys.readouterr().out
    planned = load_plan(plan).plan
    assert {p.batch for _, p in planned.instances()} != {1}  # batches that a queue delay cuts short
    for model, p in planned.instances():  # eq. 2 waited for every batch to fill: 159 ms for AlexNet's 32 at 200/s
        assert p.predicted.meets_slo and p.predicted.latency_ms <= 1.5 * model.simulated_p99_ms + 1
    assert main(["validate", str(plan)]) == 0


def test_plan_minimise_devices_says_why_where_not_even_all_serve(tmp_path, capsys, synthetic_lm):
    from conftest import make_mlp, mlp_model, write_cluster
    from tritonctl.cli import main

    make_mlp(tmp_path / "mlp.onnx")
    rate = 3 * one_device_capacity(load_latency_model(synthetic_lm))
    cluster = write_cluster(tmp_path, [mlp_model("alpha", rate=rate)])  # one device
    argv = ["plan", str(cluster), "--latency-model", str(synthetic_lm), "--minimise", "devices"]
    assert main(argv) == 2
    assert "more than all 1 devices could carry" in capsys.readouterr().err and not (tmp_path / "plan.yaml").exists()
    assert main(["plan", str(cluster), "--minimise", "devices"]) == 2
    assert "--minimise devices needs a latency model" in capsys.readouterr().err


def test_a_swap_and_the_stop_of_what_it_replaces_count_as_one_changed_instance():
    steps = [
        Step("swap", "a-0", "share changed", "a.1"),
        Step("start", "b-0", "new"),
        Step("keep", "c-0", "unchanged and ready", "c.1"),
        Step("stop", "a-0", "replaced", "a.1"),
        Step("stop", "d-0", "not in the plan", "d.1"),
    ]
    assert changed(steps) == 3  # a-0 swapped, b-0 started, d-0 stopped


def test_a_plan_made_with_a_latency_margin_says_so(mlp_cluster, synthetic_lm, capsys):
    from tritonctl.cli import main

    argv = ["plan", str(mlp_cluster), "--latency-model", str(synthetic_lm), "--latency-margin", "0.3"]
    assert main(argv) == 0
    (note,) = [n for n in load_plan(mlp_cluster.parent / "plan.yaml").plan.notes if "margin" in n]
    assert note.startswith("planned with a latency margin of 30%: its predictions and simulation are of batches 1.3 x")
    assert f"note: {note}" in capsys.readouterr().out

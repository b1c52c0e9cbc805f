"""Bad cluster files and plans: one clear message naming file and field, exit code 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, make_mlp, mlp_model, write_cluster
from tritonctl.cli import main
from tritonctl.deploy import share
from tritonctl.deploy.apply import predicted_misses
from tritonctl.errors import TritonctlError, shown_path
from tritonctl.planning.plan import load_plan


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def edit(path: Path, change) -> Path:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda d: d["models"][0].update(sloms=5), "models[0].sloms", "unknown field"),
        (lambda d: d["models"][1].update(slo_ms="fast"), "models[1].slo_ms", "valid number"),
        (lambda d: d["models"][1].update(slo_ms="120"), "models[1].slo_ms", "YAML read it as text; write the number"),
        (lambda d: d["models"][0].update(slo_ms=-5), "models[0].slo_ms", "greater than 0"),
        (lambda d: d["models"][1].update(name="alpha"), "models[1].name", "duplicate model name 'alpha'"),
        (lambda d: d["models"][0].update(name="bad/name"), "models[0].name", "not a name Triton accepts"),
        (lambda d: d["models"][0].update(name="a" * 61), "models[0].name", "61 characters: at most 60"),
        (lambda d: d["models"][1].update(name="ALPHA"), "models[1].name", "'alpha' differs only in case"),
        (lambda d: d["models"][0].update(source="mlp.ONNX"), "models[0].source", "ends in .onnx, in lower case"),
        (lambda d: d["models"][0].update(source="missing.onnx"), "models[0].source", "ONNX file not found"),
        (lambda d: d["devices"][0].pop("cores"), "devices[0]", "needs `cores`"),
        (lambda d: d["runtime"].update(base_port=80), "runtime.base_port", "greater than or equal to 1024"),
        (lambda d: d["models"][0]["input"].update(dtype="complex64"), "models[0].input.dtype", "float32"),
    ],
)
def test_bad_cluster_file_is_refused_with_file_and_field(capsys, mlp_cluster, change, field, words):
    edit(mlp_cluster, change)
    rc, err = run_cli(capsys, "plan", str(mlp_cluster))
    assert rc == 2
    assert f"{mlp_cluster}: {field}" in err
    assert words in err
    assert not (mlp_cluster.parent / "plan.yaml").exists()


def test_the_command_line_prints_one_error_line_and_no_traceback(mlp_cluster):
    edit(mlp_cluster, lambda d: d["models"][0].update(slo_ms=-1))
    run = subprocess.run([sys.executable, "-m", "tritonctl", "plan", str(mlp_cluster)], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"error: {mlp_cluster}: models[0].slo_ms: Input should be greater than 0 (got -1)"
    ]


def test_more_models_than_share_units(capsys, mlp_cluster):
    """One model too many: the plan serves the other and says which one it left out and why;
    with --strict nothing is written and the error names the model."""
    edit(mlp_cluster, lambda d: d["devices"][0].update(units=1))
    rc, err = run_cli(capsys, "plan", "--strict", str(mlp_cluster))
    assert rc == 2 and "models[" in err and "2 models on cpu0 but it has only 1 units" in err
    assert not (mlp_cluster.parent / "plan.yaml").exists()
    rc, err = run_cli(capsys, "plan", str(mlp_cluster))
    plan = yaml.safe_load((mlp_cluster.parent / "plan.yaml").read_text())
    assert rc == 0 and len(plan["models"]) == 1 and len(plan["unserved"]) == 1
    assert "2 models on cpu0 but it has only 1 units" in plan["unserved"][0]["reason"]
    assert plan["unserved"][0]["name"] != plan["models"][0]["name"]


def test_plan_with_a_share_below_the_smallest_quota_or_a_bad_instance_name(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    edit(plan, lambda d: d["models"][0]["placements"][0].update(share=4))  # 0.08 of 2 cores
    rc, err = run_cli(capsys, "render", str(plan))
    assert rc == 2 and f"{plan}: models.alpha.placements" in err and "smallest CPU quota" in err
    edit(plan, lambda d: d["models"][0]["placements"][0].update(share=50, instance="../../escape"))
    rc, err = run_cli(capsys, "render", str(plan))
    assert rc == 2 and "models[0].placements[0].instance" in err
    assert not (mlp_cluster.parent.parent / "escape").exists()


def test_not_yaml_and_missing_file(capsys, tmp_path):
    bad = tmp_path / "cluster.yaml"
    bad.write_text("name: [unclosed\n")
    rc, err = run_cli(capsys, "plan", str(bad))
    assert rc == 2 and "not valid YAML" in err
    rc, err = run_cli(capsys, "plan", str(tmp_path / "nope.yaml"))
    assert rc == 2 and "cannot read" in err and "nope.yaml" in err


def test_a_file_is_named_from_the_working_directory_wherever_it_lies_under_it(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    assert str(TritonctlError("x", file=tmp_path / "sub" / "plan.yaml")) == "sub/plan.yaml: x"
    assert str(TritonctlError("x", file="sub/plan.yaml", field="f")) == "sub/plan.yaml: f: x"
    assert str(TritonctlError("x", file="/etc/plan.yaml")) == "/etc/plan.yaml: x"  # outside: absolute
    assert shown_path("../up.yaml") == str(tmp_path.parent / "up.yaml")


def test_a_plan_file_is_read_as_written_not_coerced(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    text = plan.read_text()
    for change, field, got in (
        (lambda d: d["models"][0]["placements"][0].update(batch=True), "models[0].placements[0].batch", "True"),
        (lambda d: d["models"][0].update(port=str(d["models"][0]["port"])), "models[0].port", "'"),
    ):
        plan.write_text(text)
        edit(plan, change)
        rc, err = run_cli(capsys, "validate", str(plan))
        assert rc == 2 and f"{plan}: {field}: Input should be a valid integer (got {got}" in err


def test_profile_refuses_a_device_of_more_cores_than_the_host_before_measuring(capsys, mlp_cluster):
    if share.mechanism() == "none":
        pytest.skip("no writable cgroup: profile refuses to run at all here")
    edit(mlp_cluster, lambda d: d["devices"][0].update(cores=64))
    rc, err = run_cli(capsys, "profile", str(mlp_cluster), "--budget", "60")
    assert rc == 2 and f"{mlp_cluster}: devices[0].cores: the device profiled stands for 64 cores" in err
    assert not (mlp_cluster.parent / "profile").exists()  # nothing measured, nothing written


def test_unreadable_onnx_file(capsys, tmp_path):
    (tmp_path / "garbage.onnx").write_bytes(b"\x00\x01 this is not a protobuf" * 10)
    cluster = write_cluster(tmp_path, [mlp_model("alpha", source="garbage.onnx")])
    rc, err = run_cli(capsys, "plan", str(cluster))
    assert rc == 2
    assert f"{cluster}: models[0].source" in err and "not a readable ONNX model" in err


def test_onnx_without_dynamic_batch(capsys, tmp_path):
    make_mlp(tmp_path / "fixed.onnx", fixed_batch=True)
    cluster = write_cluster(tmp_path, [mlp_model("alpha", source="fixed.onnx")])
    rc, err = run_cli(capsys, "plan", str(cluster))
    assert rc == 2 and "no dynamic batch dimension" in err


def test_input_that_disagrees_with_the_onnx_graph(capsys, mlp_cluster):
    edit(mlp_cluster, lambda d: d["models"][0]["input"].update(shape=[3, 224, 224]))
    rc, err = run_cli(capsys, "plan", str(mlp_cluster))
    assert rc == 2 and f"{mlp_cluster}: models[0].input" in err and "float32[16]" in err


def test_model_larger_than_every_device(capsys, mlp_cluster):
    edit(mlp_cluster, lambda d: d["models"][1].update(memory_mb=5000))
    rc, err = run_cli(capsys, "plan", "--strict", str(mlp_cluster))
    assert rc == 2
    assert f"{mlp_cluster}: models" in err and "models[1] beta: needs 5000 MB" in err
    assert "largest device has 4096 MB" in err
    rc, _ = run_cli(capsys, "plan", str(mlp_cluster))
    plan = yaml.safe_load((mlp_cluster.parent / "plan.yaml").read_text())
    assert rc == 0 and [m["name"] for m in plan["models"]] == ["alpha"]
    assert plan["unserved"] == [{"name": "beta", "reason": "needs 5000 MB but the largest device has 4096 MB"}]


def test_models_that_fit_alone_but_not_together(capsys, mlp_cluster):
    edit(mlp_cluster, lambda d: [m.update(memory_mb=3000) for m in d["models"]])
    rc, err = run_cli(capsys, "plan", "--strict", str(mlp_cluster))
    assert rc == 2 and "fits on no device" in err


def test_no_model_servable_is_an_error_even_without_strict(capsys, mlp_cluster):
    edit(mlp_cluster, lambda d: [m.update(memory_mb=5000) for m in d["models"]])
    rc, err = run_cli(capsys, "plan", str(mlp_cluster))
    assert rc == 2 and "cannot serve any model" in err and "models[0] alpha" in err and "models[1] beta" in err
    assert not (mlp_cluster.parent / "plan.yaml").exists()


def test_unknown_torchvision_architecture(capsys, tmp_path):
    cluster = write_cluster(tmp_path, [mlp_model("alpha", source="not_a_net")])
    rc, err = run_cli(capsys, "plan", str(cluster))
    assert rc == 2 and "models[0].source" in err and "neither an .onnx path nor a torchvision architecture" in err


def _refused_argument(capsys, *argv: str) -> str:
    """The one error line argparse prints for a bad argument, after checking it exits 2."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_unknown_policy_is_refused_before_anything_is_exported(capsys, mlp_cluster):
    with pytest.raises(SystemExit):
        main(["plan", str(mlp_cluster), "--policy", "magic"])
    said = capsys.readouterr()
    assert "invalid choice: 'magic'" in said.err and "spread" in said.err
    assert "models of" not in said.out  # refused by the parser: no model was even looked at


@pytest.mark.parametrize(
    ("verb", "target", "words"),
    [
        ("plan", "folder", "is a folder: name the file to write"),
        ("plan", "file/plan.yaml", "is a file, not a folder"),
        ("profile", "file", "is a file, not a folder"),
        ("plan", "/proc/plan.yaml", "system folder"),
    ],
)
def test_output_paths_are_checked_first(capsys, mlp_cluster, verb, target, words):
    (mlp_cluster.parent / "folder").mkdir()
    (mlp_cluster.parent / "file").write_text("x")
    path = target if target.startswith("/") else str(mlp_cluster.parent / target)
    line = _refused_argument(capsys, verb, str(mlp_cluster), "-o", path)
    assert line.startswith(f"tritonctl {verb}: error: argument -o/--output: ") and words in line


def test_a_latency_margin_out_of_range_or_without_a_model(capsys, mlp_cluster):
    with pytest.raises(SystemExit) as exit_info:  # argparse's own refusal
        main(["plan", str(mlp_cluster), "--latency-margin", "1.5"])
    assert exit_info.value.code == 2 and "must be at least 0 and below 1" in capsys.readouterr().err
    rc, err = run_cli(capsys, "plan", str(mlp_cluster), "--latency-margin", "0.1")
    assert rc == 2 and "--latency-margin: a latency margin needs a latency model" in err
    assert not (mlp_cluster.parent / "plan.yaml").exists()


@pytest.mark.parametrize("value", ["0", "1.5", "99", "most"])
def test_a_share_within_the_slo_out_of_range_is_refused_before_any_traffic(capsys, mlp_cluster, value):
    line = _refused_argument(capsys, "load", str(mlp_cluster.parent / "plan.yaml"), "--min-within-slo", value)
    assert line.startswith("tritonctl load: error: argument --min-within-slo: ")
    assert "must be above 0 and at most 1 (0.99 is 99%)" in line or "not a number: 'most'" in line


def test_hand_edited_plan_is_validated(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    edit(plan, lambda d: d["models"][0]["placements"][0].update(share=90))
    rc, err = run_cli(capsys, "render", str(plan))
    assert rc == 2 and f"{plan}" in err and "shares add up to 140 of 100 units" in err
    edit(plan, lambda d: d["models"][0]["placements"][0].update(device="gpu7"))
    rc, err = run_cli(capsys, "apply", str(plan))
    assert rc == 2 and "unknown device 'gpu7'" in err


def test_strict_refuses_a_plan_predicted_to_miss_an_slo(capsys, mlp_cluster, tmp_path):
    """A placement the latency model predicts to miss its SLO is stated in the plan; --strict refuses it."""
    from synthetic import synthetic_dataset

    synthetic_dataset(tmp_path / "profile")
    assert main(["fit", str(tmp_path / "profile")]) == 0
    edit(mlp_cluster, lambda d: d["models"][0].update(rate=600, slo_ms=150))
    lm = str(tmp_path / "profile" / "latency-model.json")
    rc, err = run_cli(capsys, "plan", "--strict", "--policy", "search", "--latency-model", lm, str(mlp_cluster))
    assert rc == 2 and "cannot serve every model within its SLO" in err and "requests/s within 150 ms" in err
    rc, err = run_cli(capsys, "plan", "--policy", "search", "--latency-model", lm, str(mlp_cluster))
    plan = yaml.safe_load((mlp_cluster.parent / "plan.yaml").read_text())
    alpha = next(m for m in plan["models"] if m["name"] == "alpha")["placements"][0]["predicted"]
    assert rc == 0 and not alpha["meets_slo"] and alpha["in_slo_rps"] < 600


def test_profiling_a_gpu_cluster_here_points_to_the_gpu_profiler(capsys, tmp_path):
    make_mlp(tmp_path / "mlp.onnx")
    gpu = [{"kind": "gpu", "count": 1, "units": 100, "memory_mb": 4096}]
    cluster = write_cluster(tmp_path, [mlp_model("alpha")], devices=gpu)
    assert main(["profile", str(cluster), "-o", str(tmp_path / "profile")]) == 2
    err = capsys.readouterr().err
    assert "devices" in err and "python3 -m profiler.gpu measure" in err
    assert not (tmp_path / "profile").exists()  # nothing measured, nothing written


def test_validate_checks_a_cluster_or_a_plan_and_touches_nothing(capsys, mlp_cluster):
    assert main(["validate", str(mlp_cluster)]) == 0
    assert "a valid cluster file (2 model(s)" in capsys.readouterr().out
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    capsys.readouterr()
    assert main(["validate", str(plan)]) == 0
    assert "a valid plan of cluster" in capsys.readouterr().out
    before = sorted(p.name for p in mlp_cluster.parent.rglob("*"))
    edit(plan, lambda d: d["models"][0]["placements"][0].update(share=0))
    rc, err = run_cli(capsys, "validate", str(plan))
    assert rc == 2 and err.startswith(f"error: {plan}: models") and "share" in err
    assert sorted(p.name for p in mlp_cluster.parent.rglob("*")) == before  # nothing written


def test_schema_is_the_cluster_models_json_schema(capsys):
    import json

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"devices", "models"} <= set(schema["properties"]) and schema["additionalProperties"] is False
    assert main(["schema", "--plan"]) == 0
    assert "placements" in json.dumps(json.loads(capsys.readouterr().out))


def test_format_json_gives_one_document_on_stdout(capsys, mlp_cluster, synthetic_lm):
    import json

    assert main(["plan", str(mlp_cluster), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    document = json.loads(out)  # the progress lines went to stderr
    assert "models of" in err and {m["name"] for m in document["plan"]["models"]} == {"alpha", "beta"}
    plan = document["path"]
    assert main(["endpoints", plan, "--format", "json"]) == 0
    assert [e["model"] for e in json.loads(capsys.readouterr().out)] == ["alpha", "beta"]
    assert main(["status", plan, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["instances"] == []
    assert main(["simulate", plan, "--latency-model", str(synthetic_lm), "--duration", "5", "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {m["model"] for m in result["models"]} == {"alpha", "beta"} and result["throughput_rps"] > 0


def test_a_cluster_file_for_a_plan_a_plan_for_a_cluster_file_or_an_empty_file_is_named_as_such(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    for verb in ("render", "endpoints", "status"):
        rc, err = run_cli(capsys, verb, str(mlp_cluster))
        assert rc == 2 and f"{mlp_cluster}: this is a cluster file, not a plan" in err
    rc, err = run_cli(capsys, "plan", str(plan))
    assert rc == 2 and f"{plan}: this is a plan (made from cluster.yaml), not a cluster file" in err
    (mlp_cluster.parent / "empty.yaml").write_text("")
    rc, err = run_cli(capsys, "validate", str(mlp_cluster.parent / "empty.yaml"))
    assert rc == 2 and "empty.yaml: holds nothing (empty, or comments only)" in err


def test_a_policy_that_needs_a_latency_model_is_refused_before_anything_is_exported(capsys, mlp_cluster):
    rc = main(["plan", str(mlp_cluster), "--policy", "search"])
    said = capsys.readouterr()
    assert rc == 2 and "--latency-model: policy search needs a fitted latency model" in said.err
    assert "models of" not in said.out and not (mlp_cluster.parent / "plan.yaml").exists()


def test_load_of_a_deployment_not_running_says_so_at_once(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    began = time.monotonic()
    rc, err = run_cli(capsys, "load", str(plan))
    assert rc == 2 and time.monotonic() - began < 5  # before any traffic, not after the 10 s it would send
    assert "nothing listens at 127.0.0.1:" in err and f"start it with `tritonctl apply {plan}`" in err


def test_render_without_a_target_takes_no_output_folder_and_a_cpu_plan_no_compose_runtime(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    rc, err = run_cli(capsys, "render", str(plan), "-o", str(mlp_cluster.parent / "out"))
    assert rc == 2 and "-o: the repositories go to the plan's runtime.repository_dir" in err
    assert not (mlp_cluster.parent / "out").exists()
    rc, err = run_cli(capsys, "apply", str(plan), "--runtime", "compose", "--dry-run")
    assert rc == 2 and "a CPU plan runs with the local runtime" in err


def test_simulate_refuses_an_endless_run_and_a_trace_for_other_models(capsys, mlp_cluster, synthetic_lm):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    line = _refused_argument(capsys, "simulate", str(plan), "--latency-model", str(synthetic_lm), "--duration", "1e9")
    assert "simulate at most 3600 s" in line
    trace = mlp_cluster.parent / "trace.csv"
    trace.write_text("model,time_s\nfoo,0.1\nfoo,0.2\n")
    rc, err = run_cli(capsys, "simulate", str(plan), "--latency-model", str(synthetic_lm), "--trace", str(trace))
    assert rc == 2 and f"{trace}: no request is for a model of the plan (it names foo)" in err
    trace.write_text("model,time_s\nalpha,nan\n")
    rc, err = run_cli(capsys, "simulate", str(plan), "--latency-model", str(synthetic_lm), "--trace", str(trace))
    assert rc == 2 and "line 2: time_s nan is not a time from 0" in err
    trace.write_text("model,time_s\nalpha,0.5\nalpha,70\nbeta,99\n")
    assert main(["simulate", str(plan), "--latency-model", str(synthetic_lm), "--trace", str(trace)]) == 0
    assert "2 of the trace's 3 requests come at or after --duration 60 s: they are not simulated" in (
        capsys.readouterr().out
    )


def test_simulate_refuses_a_latency_model_of_another_kind_of_device(capsys):
    cpu_plan, gpu_plan = (REPO / f"bench/results/inss{kind}-six-4/plan-search.yaml" for kind in ("", "-gpu"))
    cpu_lm, gpu_lm = (REPO / f"profiles/inss-{kind}/latency-model.json" for kind in ("scaled", "gpu"))
    rc, err = run_cli(capsys, "simulate", str(cpu_plan), "--latency-model", str(gpu_lm))
    assert rc == 2 and "fitted for a gpu device of 100 units; the plan's cpu0 is a cpu device of" in err
    rc, err = run_cli(capsys, "simulate", str(gpu_plan), "--latency-model", str(cpu_lm))
    assert rc == 2 and "fitted for a cpu device of 100 units standing for 2 cores; the plan's gpu0 is a gpu" in err


def test_an_energy_sweep_with_a_bad_cell_or_a_plot_of_no_known_format_writes_nothing(capsys, tmp_path):
    sweep = tmp_path / "sweep.csv"
    sweep.write_text("model,batch,sm_clock_read_mhz,batch_ms,joules_per_image\nresnet50,2.5,1500,3.0,0.1\n")
    out = tmp_path / "energy.json"
    rc, err = run_cli(capsys, "fit-energy", str(sweep), "-o", str(out))
    assert rc == 2 and f"{sweep}: row 2: column batch is not a whole number (got '2.5')" in err
    line = _refused_argument(capsys, "fit-energy", str(sweep), "-o", str(out), "--plot", str(tmp_path / "fig.txt"))
    assert "the suffix picks the format" in line and not out.exists()


def test_validate_refuses_what_the_next_verb_would(capsys, tmp_path, mlp_cluster):
    (tmp_path / "arch").mkdir()
    cluster = write_cluster(tmp_path / "arch", [mlp_model("alpha", source="resnet9000")])
    rc, err = run_cli(capsys, "validate", str(cluster))
    assert rc == 2 and f"{cluster}: models[0].source: 'resnet9000' is neither an .onnx path" in err
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    loaded = load_plan(plan)
    onnx = loaded.resolve(loaded.plan.models[0].onnx)
    onnx.write_bytes(onnx.read_bytes() + b"\0")  # another file under the same name: what apply would refuse
    rc, err = run_cli(capsys, "validate", str(plan))
    assert rc == 2 and f"{plan}: models.alpha.onnx: {onnx} is not the file the plan was made for" in err
    onnx.unlink()
    rc, err = run_cli(capsys, "validate", str(plan))
    assert rc == 2 and f"{plan}: models.alpha.onnx: ONNX file not found" in err


def test_fit_on_a_file_or_a_folder_that_is_no_profile_says_so(capsys, mlp_cluster):
    rc, err = run_cli(capsys, "fit", str(mlp_cluster))
    assert rc == 2 and "a file, not a profile folder" in err
    rc, err = run_cli(capsys, "fit", str(mlp_cluster.parent))
    assert rc == 2 and f"{mlp_cluster.parent}: not a profile folder: no metadata.json in it" in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["simulate", "p.yaml", "--latency-model", "m.json", "--seed", "-1"], "--seed: -1: a whole number from 0"),
        (["simulate", "p.yaml", "--latency-model", "m.json", "--rate-scale", "inf"], "'inf' is not a finite number"),
        (["simulate", "p.yaml", "--latency-model", "m.json", "--rate-scale", "1e9"], "at most 100 times the planned"),
        (["simulate", "p.yaml", "--latency-model", "m.json", "--latency-error", "1"], "at least 0 and below 1"),
        (["load", "p.yaml", "--duration", "inf"], "--duration: 'inf' is not a finite number"),
        (["load", "p.yaml", "--rate-scale", "nan"], "--rate-scale: 'nan' is not a finite number"),
        (["controller", "p.yaml", "--cooldown", "-5"], "--cooldown: '-5' is negative"),
        (["profile", "c.yaml", "--budget", "-1"], "--budget: '-1' is negative"),
        (["controller", "p.yaml", "--port", "70000"], "--port: 70000: a whole number from 0 to 65535"),
        (["train", "c.yaml", "--latency-model", "m.json", "--epochs", "0"], "--epochs: 0: a whole number from 1"),
        (["plan", "c.yaml", "-o", ""], "-o/--output: empty: name the file to write"),
    ],
)
def test_numbers_that_cannot_be_meant_are_refused_by_the_parser(capsys, argv, words):
    assert words in _refused_argument(capsys, *argv)


def test_a_simulation_too_large_to_hold_is_refused_before_it_draws(capsys, mlp_cluster, synthetic_lm):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = str(mlp_cluster.parent / "plan.yaml")
    began = time.monotonic()  # the two models at 20 requests/s: 100 x 3600 s is 14.4 million requests
    rc, err = run_cli(capsys, "simulate", plan, "--latency-model", str(synthetic_lm), "--duration", "3600",
                      "--rate-scale", "100")  # fmt: skip
    assert rc == 2 and "--duration: 3600 s at 100x the plan's rates is about 14,400,000 requests" in err
    assert time.monotonic() - began < 5


def test_a_misspelt_key_is_named_with_the_field_it_means(capsys, mlp_cluster):
    edit(mlp_cluster, lambda d: d["models"][0].update(slo_msec=d["models"][0].pop("slo_ms")))
    rc, err = run_cli(capsys, "validate", str(mlp_cluster))
    assert rc == 2 and f"{mlp_cluster}: models[0].slo_msec: unknown field (did you mean slo_ms?)" in err
    edit(mlp_cluster, lambda d: d.update(runtme=d.pop("runtime")) or d["models"][0].update(slo_ms=50))
    edit(mlp_cluster, lambda d: d["models"][0].pop("slo_msec"))
    rc, err = run_cli(capsys, "validate", str(mlp_cluster))
    assert rc == 2 and "runtme: unknown field (did you mean runtime?)" in err


def test_a_model_without_traffic_is_served_not_shed(capsys, mlp_cluster, synthetic_lm):
    edit(mlp_cluster, lambda d: d["models"][0].update(rate=0))
    plan = mlp_cluster.parent / "plan.yaml"
    assert main(["plan", str(mlp_cluster), "--policy", "search", "--latency-model", str(synthetic_lm)]) == 0
    out = capsys.readouterr().out
    alpha = load_plan(plan).plan.models[0]
    assert alpha.placements and alpha.simulated_in_slo is None and "NOT SERVED" not in out
    assert "simulated nothing (no traffic)" in out
    assert main(["apply", str(plan), "--dry-run"]) == 1  # would start it: not refused as a predicted miss


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda d: d["device"].update(contention=float("nan")), "device.contention", "finite number"),
        (lambda d: d["device"].update(cores=-2), "device.cores", "greater than 0"),
        (lambda d: d["models"]["alpha"].update(lwr_X="x"), "models.alpha.lwr_X", "valid list"),
        (lambda d: d["models"]["alpha"].update(lwr_y=[1.0]), "models.alpha", "same training points"),
        (lambda d: d.pop("models"), "models", "must be a mapping"),
    ],
)
def test_a_corrupt_latency_model_names_its_field(capsys, mlp_cluster, synthetic_lm, tmp_path, change, field, words):
    data = json.loads(synthetic_lm.read_text())
    change(data)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    rc, err = run_cli(capsys, "plan", str(mlp_cluster), "--latency-model", str(broken))
    assert rc == 2 and f"{broken}: {field}: corrupt latency model" in err and words in err
    assert err.count("\n") == 1


def test_a_latency_model_of_another_cpu_is_refused_before_any_export(capsys, mlp_cluster, synthetic_lm, tmp_path):
    data = json.loads(synthetic_lm.read_text())
    data["device"]["fingerprint"]["id"] = "another-cpu"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    rc, err = run_cli(capsys, "plan", str(mlp_cluster), "--latency-model", str(other))
    assert rc == 2 and "profiled on another CPU" in err
    assert not (mlp_cluster.parent / "exports").exists()
    data["meta"]["synthetic"] = "made up for a test"
    other.write_text(json.dumps(data))
    rc, err = run_cli(capsys, "plan", str(mlp_cluster), "--latency-model", str(other))
    assert rc == 2 and "meta.synthetic: a SYNTHETIC latency model" in err and "tritonctl bench" in err


def test_a_plan_edited_beyond_its_devices_is_named(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    edit(plan, lambda d: d["models"][0]["placements"][0].update(share=150))
    rc, err = run_cli(capsys, "validate", str(plan))
    assert rc == 2 and "instance 'alpha-0': share 150 is more than device cpu0's 100 units" in err
    edit(plan, lambda d: (d["models"][0]["placements"][0].update(share=50), d.update(target="gpu")))
    rc, err = run_cli(capsys, "validate", str(plan))
    assert rc == 2 and "device cpu0 is a cpu device; the plan's target is gpu" in err


def test_a_cpu_plan_for_more_cores_than_the_host_has_is_not_applied(capsys, mlp_cluster):
    import os

    edit(mlp_cluster, lambda d: d["devices"][0].update(cores=len(os.sched_getaffinity(0)) + 62))
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    rc, err = run_cli(capsys, "apply", str(plan), "--dry-run")
    assert rc == 2 and f"{plan}: devices: the plan's CPU devices stand for" in err and "this host gives" in err
    assert not (mlp_cluster.parent / "state").exists()


def test_a_trained_policy_file_for_a_policy_that_takes_none_is_refused(capsys, mlp_cluster):
    rc, err = run_cli(capsys, "plan", str(mlp_cluster), "--policy-file", "nothere.pt")
    assert rc == 2 and "--policy-file: a trained policy is for --policy inss, not spread" in err
    assert not (mlp_cluster.parent / "plan.yaml").exists()


def test_validate_says_when_a_plans_cluster_file_is_gone(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    mlp_cluster.unlink()
    capsys.readouterr()
    assert main(["validate", str(mlp_cluster.parent / "plan.yaml")]) == 0
    assert f"its cluster file {mlp_cluster} is not there; `controller` re-plans from it" in capsys.readouterr().out


def test_json_output_has_no_nan(capsys):
    from tritonctl.cli import output

    output.emit({"p99_ms": float("nan"), "rows": [1.0, float("inf")]})
    assert json.loads(capsys.readouterr().out) == {"p99_ms": None, "rows": [1.0, None]}


def test_no_output_is_written_over_an_input(capsys, mlp_cluster, tmp_path):
    source = mlp_cluster.parent / "mlp.onnx"
    profile = tmp_path / "p"
    shutil.copytree(REPO / "profiles" / "cpu-demo", profile)
    kept = {p: p.read_bytes() for p in (mlp_cluster, source, profile / "measurements.csv")}
    for argv, what in (
        (["plan", str(mlp_cluster), "-o", str(mlp_cluster)], f"{mlp_cluster} is the cluster file"),
        (["plan", str(mlp_cluster), "-o", str(source)], f"{source} is model alpha's source"),
        (["fit", str(profile), "-o", str(profile / "measurements.csv")], f"{profile}/measurements.csv is the"),
    ):
        rc, err = run_cli(capsys, *argv)
        assert rc == 2 and f"-o/--output: {what}" in err and "which this command reads" in err
    assert {p: p.read_bytes() for p in kept} == kept


def test_the_controller_refuses_what_it_cannot_use_before_it_applies(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = str(mlp_cluster.parent / "plan.yaml")
    rc, err = run_cli(capsys, "controller", plan, "--host", "no-such-host.invalid", "--port", "0")
    assert rc == 2 and "--host/--port: cannot serve the controller's state on no-such-host.invalid:0" in err
    other = str(REPO / "profiles" / "cpu-demo" / "latency-model.json")  # of other models (and made on another CPU)
    rc, err = run_cli(capsys, "controller", plan, "--latency-model", other)
    assert rc == 2 and err.startswith(f"error: {shown_path(other)}")
    assert not (load_plan(plan).state_dir / "state.json").exists()  # nothing was applied


def test_runtime_folders_triton_cannot_run_from_are_refused_before_anything_starts(capsys, tmp_path):
    folder = tmp_path / "with space"
    folder.mkdir()
    make_mlp(folder / "mlp.onnx")
    cluster = write_cluster(folder, [mlp_model("alpha")])
    assert main(["plan", str(cluster)]) == 0
    rc, err = run_cli(capsys, "apply", str(folder / "plan.yaml"), "--dry-run")
    assert rc == 2 and "runtime.repository_dir" in err and "spaces or non-ASCII characters" in err


def test_a_batch_queue_delay_as_long_as_the_slo_is_warned_of(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    edit(plan, lambda d: d["models"][0]["placements"][0].update(queue_delay_us=10**7))
    capsys.readouterr()
    assert main(["apply", str(plan), "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "warning: a batch may wait as long as the SLO to fill (queue_delay_us) on alpha-0 (10000 ms, SLO" in out


def test_an_onnx_source_that_is_a_folder_or_empty_says_so(capsys, mlp_cluster):
    (mlp_cluster.parent / "dir.onnx").mkdir()
    (mlp_cluster.parent / "empty.onnx").write_bytes(b"")
    for source, words in (("dir.onnx", "dir.onnx is a folder, not an ONNX file"), ("empty.onnx", "the file is empty")):
        edit(mlp_cluster, lambda d, s=source: d["models"][0].update(source=s))
        rc, err = run_cli(capsys, "plan", str(mlp_cluster))
        assert rc == 2 and "models[0].source" in err and words in err


def test_down_of_a_plan_never_applied_stops_nothing_and_writes_nothing(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = load_plan(mlp_cluster.parent / "plan.yaml")
    capsys.readouterr()
    assert main(["down", str(plan.path)]) == 0
    assert "nothing to stop" in capsys.readouterr().out and not plan.state_dir.exists()


def test_an_interrupted_change_says_how_to_see_and_finish_it(capsys, mlp_cluster, monkeypatch):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = str(mlp_cluster.parent / "plan.yaml")

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr("tritonctl.cli.deploy._apply", interrupted)
    rc, err = run_cli(capsys, "apply", plan)
    assert rc == 130 and f"interrupted: `tritonctl status {plan}` shows what runs" in err


def test_a_latency_model_a_plan_and_a_cluster_file_given_for_one_another_say_what_they_are(
    capsys, mlp_cluster, synthetic_lm
):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = str(mlp_cluster.parent / "plan.yaml")
    for argv, words in (
        (["plan", str(synthetic_lm)], "a latency model, not a cluster file or plan: give it as --latency-model"),
        (["status", str(synthetic_lm)], "a latency model, not a cluster file or plan"),
        (["simulate", plan, "--latency-model", plan], f"{plan}: this is a plan, not a latency model"),
        (["simulate", plan, "--latency-model", str(mlp_cluster)], "this is a cluster file, not a latency model"),
    ):
        rc, err = run_cli(capsys, *argv)
        assert rc == 2 and words in err, err


def test_validate_opens_the_onnx_files_every_verb_would(capsys, mlp_cluster):
    (mlp_cluster.parent / "mlp.onnx").write_bytes(b"not a model")
    rc, err = run_cli(capsys, "validate", str(mlp_cluster))
    assert rc == 2 and "models[0].source" in err and "not a readable ONNX model" in err


def test_a_model_no_request_arrived_for_in_a_trace_is_not_judged(capsys, mlp_cluster, synthetic_lm):
    assert main(["plan", str(mlp_cluster)]) == 0
    trace = mlp_cluster.parent / "trace.csv"
    trace.write_text("model,time_s\nalpha,0.1\n")
    plan = str(mlp_cluster.parent / "plan.yaml")
    capsys.readouterr()
    assert main(["simulate", plan, "--latency-model", str(synthetic_lm), "--trace", str(trace)]) == 0
    (beta,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("beta ")]
    assert beta == ["beta", "0", "0", "-", "0", "-", "-"]


def test_a_hand_edited_plan_is_not_judged_by_the_predictions_made_before_the_edit(capsys, mlp_cluster, synthetic_lm):
    assert main(["plan", str(mlp_cluster), "--latency-model", str(synthetic_lm)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    made = load_plan(plan).plan
    assert made.predicted_for == made.decisions_digest() and not predicted_misses(made)
    reordered = made.model_copy(update={"models": made.models[::-1]})
    assert not reordered.stale_predictions()  # the order of the models decides nothing
    elsewhere = made.runtime.model_copy(update={"host": "0.0.0.0"})  # an address is no decision either
    assert not made.model_copy(update={"runtime": elsewhere}).stale_predictions()
    weights = made.runtime.model_copy(update={"cpu_share": "weight"})  # predicted under quotas, served by weights
    assert made.model_copy(update={"runtime": weights}).stale_predictions()
    edit(plan, lambda d: d["models"][0].update(rate=d["models"][0]["rate"] * 100))  # beyond what the CPU serves
    assert load_plan(plan).plan.stale_predictions() and not predicted_misses(load_plan(plan).plan)
    capsys.readouterr()
    assert main(["validate", str(plan)]) == 0
    assert f"note: {plan} was edited after it was planned" in capsys.readouterr().out
    assert main(["simulate", str(plan), "--latency-model", str(synthetic_lm), "--duration", "5", "--update"]) == 0
    fresh = load_plan(plan).plan
    assert not fresh.stale_predictions() and any(m.startswith("alpha") for m in predicted_misses(fresh))
    rc, err = run_cli(capsys, "apply", str(plan))  # the fresh predictions are checked again
    assert rc == 2 and "predicted to miss SLOs" in err


def test_a_plan_whose_tensors_disagree_with_the_onnx_graph_is_refused_before_anything_starts(capsys, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = mlp_cluster.parent / "plan.yaml"
    text = plan.read_text()
    for change, words in (
        (lambda d: d["models"][0]["inputs"][0].update(shape=[65]), "input 'x' float32[65] is not the ONNX graph's"),
        (lambda d: d["models"][0]["outputs"][0].update(dtype="int64"), "output 'y' int64[4] is not the ONNX graph's"),
        (lambda d: d["models"][0]["inputs"].append(d["models"][0]["inputs"][0]), "the plan lists 2 input(s)"),
    ):
        plan.write_text(text)
        edit(plan, change)
        for verb in ("validate", "render", "apply"):
            rc, err = run_cli(capsys, verb, str(plan))
            assert rc == 2 and f"{plan}: models.alpha." in err and words in err, (verb, err)
    assert not (load_plan(plan).state_dir / "state.json").exists()  # nothing started, nothing recorded


def test_status_and_down_take_a_plan_or_a_state_folder(capsys, tmp_path, mlp_cluster):
    assert main(["plan", str(mlp_cluster)]) == 0
    plan = str(mlp_cluster.parent / "plan.yaml")
    for verb in ("status", "down"):
        for argv in ([verb], [verb, plan, "--state-dir", str(tmp_path)]):
            rc, err = run_cli(capsys, *argv)
            assert rc == 2 and "name the deployment by its plan file or by --state-dir, one of them" in err
        rc, err = run_cli(capsys, verb, "--state-dir", str(tmp_path / "nothing"))
        assert rc == 2 and f"{tmp_path / 'nothing'}: no deployment is recorded here (no state.json)" in err

"""GPU plans on the local runtime, without a GPU: the GPU glue's rendering, the trimmed Triton bundle, the MPS
daemon's and the clock lock's command sequences, and the energy objective (EAIS) on synthetic sweeps.

No GPU, MPS daemon or nvidia-smi runs here: where the runtime calls one, a small script on PATH stands in for
it and records what it was asked (the calls are what is tested; the GPU run is bench/gpu_triton.py). Energy
sweeps here are SYNTHETIC: curves of a known form, not measurements.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO
from tritonctl.cli import main
from tritonctl.deploy import mps
from tritonctl.deploy.gpu import lock_clocks, release_clocks
from tritonctl.deploy.local import LocalRuntime, free_port
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.latency import energy
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.energy import at_clock, least_energy
from tritonctl.planning.plan import load_plan, save_plan
from tritonctl.planning.planner import demands_of, devices_of, make_plan, sources_of
from tritonctl.planning.policies.bda import batch_checks
from tritonctl.profiler.energy import FIELDS
from tritonctl.spec import load_cluster
from tritonctl.triton.binary import TritonBinary, find_tritonserver
from tritonctl.triton.bundle import bundle, members
from tritonctl.triton.render import render

GPU_LM = REPO / "profiles" / "inss-gpu" / "latency-model.json"


def _script(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture(scope="module")
def gpu_one(tmp_path_factory):
    """examples/gpu-one planned by search with the H100 stand-in latency model (exports cached in the repo)."""
    folder = tmp_path_factory.mktemp("gpu-one")
    spec = yaml.safe_load((REPO / "examples" / "gpu-one" / "cluster.yaml").read_text())
    spec["runtime"].update(export_dir=str(REPO / "model_repository" / "exports"), repository_dir="repo", state_dir="s")
    (folder / "cluster.yaml").write_text(yaml.safe_dump(spec))
    cluster = load_cluster(folder / "cluster.yaml")
    artifacts = materialize(cluster, log=lambda _: None)
    lm = load_latency_model(GPU_LM)
    plan = make_plan(cluster, artifacts, "search", folder / "plan.yaml", lm, log=lambda _: None)
    save_plan(plan, folder / "plan.yaml")
    return cluster, artifacts, lm, load_plan(folder / "plan.yaml")


def _binary(tmp_path: Path, backends: tuple[str, ...]) -> TritonBinary:
    for name in backends:
        (tmp_path / "backends" / name).mkdir(parents=True)
    return TritonBinary(tmp_path / "bin" / "tritonserver", "test", tmp_path / "backends")


def test_a_triton_without_onnxruntime_serves_gpu_plans_with_the_torch_glue(gpu_one, tmp_path):
    _, _, _, loaded = gpu_one
    assert loaded.plan.runtime.gpu_backend == "onnxruntime"  # what Compose and Kubernetes render (NGC images)
    local = LocalRuntime(_binary(tmp_path / "py", ("python",)), loaded.state_dir).prepare(loaded, write=False)
    assert local.plan.runtime.gpu_backend == "python"
    for name, (folder, launch) in render(local).items():
        model = name.rsplit("-", 1)[0]
        config = (folder / "models" / model / "config.pbtxt").read_text()
        assert 'backend: "python"' in config and "KIND_GPU" in config
        source = next(m.source for m in loaded.plan.models if m.name == model)
        assert f'string_value: "{source}"' in config  # the glue builds this torchvision architecture
        glue = (folder / "models" / model / "1" / "model.py").read_text()
        assert "class TorchGraphs" in glue and "CUDAGraph" in glue
        assert launch.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and launch.cpu_quota_us is None
    # A Triton with the onnxruntime backend keeps the plan's own: no glue, a different process (a swap, not a reload)
    ort = LocalRuntime(_binary(tmp_path / "ort", ("onnxruntime", "python")), loaded.state_dir).prepare(loaded, False)
    assert ort.plan.runtime.gpu_backend == "onnxruntime"
    ours = {n: launch.process_hash for n, (_, launch) in render(local, write=False).items()}
    theirs = {n: launch.process_hash for n, (_, launch) in render(ort, write=False).items()}
    assert all(ours[n] != theirs[n] for n in ours)


def test_images_as_bytes_on_a_gpu_run_the_onnx_graph_that_scales_them_not_the_torch_glue(gpu_one):
    from tritonctl.triton.render import render_config

    _, _, _, loaded = gpu_one
    model = loaded.plan.models[0]
    device = loaded.plan.device(model.placements[0].device)
    as_bytes = model.model_copy(update={"inputs": [model.inputs[0].model_copy(update={"dtype": "uint8"})]})
    floats = render_config("c", model, model.placements[0], device, gpu_backend="python")
    image_bytes = render_config("c", as_bytes, as_bytes.placements[0], device, gpu_backend="python")
    assert "torchvision_source" in floats and "torchvision_source" not in image_bytes


def test_gpu_plans_are_refused_on_a_host_without_gpus_or_mps(tmp_path, monkeypatch):
    with pytest.raises(TritonctlError, match="NVML sees no GPU"):
        mps.check_host(None, 1)
    with pytest.raises(TritonctlError, match="GPU index 3 is named; this host has 2"):
        mps.check_host(2, 4)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mps, "CONTROL_PATHS", ())
    with pytest.raises(TritonctlError, match="no MPS control binary"):
        mps.check_host(1, 1)


FAKE_MPS = """log="$CUDA_MPS_LOG_DIRECTORY/calls"
if [ "$1" = "-d" ]; then echo "-d" >> "$log"; touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read cmd; echo "$cmd" >> "$log"
case "$cmd" in
  get_server_list) [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || exit 1 ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
esac
"""


def test_the_mps_daemon_is_started_once_adopted_after_and_stopped_only_by_who_started_it(tmp_path, monkeypatch):
    _script(tmp_path / "bin", "nvidia-cuda-mps-control", FAKE_MPS)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    state = tmp_path / "state"
    state.mkdir()
    daemon = mps.ensure(state)
    assert daemon.env == {
        "CUDA_MPS_PIPE_DIRECTORY": str(state / "mps/pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(state / "mps/log"),
    }
    calls = lambda: (state / "mps/log/calls").read_text().split()  # noqa: E731
    assert calls() == ["-d", "get_server_list"]  # started, then asked until it answered
    mps.ensure(state)  # a second apply finds it answering: no second daemon
    assert calls().count("-d") == 1
    mps.release(state)
    assert calls()[-1] == "quit" and not mps.answers(daemon) and not (state / mps.RECORD).exists()
    # A daemon that was already answering is adopted: `down` leaves it running
    (state / "mps/pipe/control").touch()
    mps.ensure(state)
    mps.release(state)
    assert calls().count("-d") == 1 and calls().count("quit") == 1 and mps.answers(daemon)


def test_a_pipe_folder_too_long_for_a_socket_is_refused_before_anything_starts(tmp_path):
    deep = tmp_path / ("x" * 90)
    with pytest.raises(TritonctlError, match="shorter runtime.state_dir"):
        mps.ensure(deep)
    assert not (deep / "mps").exists()


FAKE_SMI = """echo "$*" >> "$FAKE_SMI_LOG"
if [ "$3" = "-lgc" ]; then
  mhz="${4%%,*}"
  if [ "$mhz" -gt 2000 ]; then echo "Requested clocks are not supported for GPU $2" >&2; exit 3; fi
  echo "GPU clocks set to \\"(gpuClkMin $mhz, gpuClkMax $mhz)\\" for GPU $2"
fi
"""


def test_clocks_are_locked_before_start_and_reset_at_down_and_a_refused_clock_undoes_the_rest(
    gpu_one, tmp_path, monkeypatch
):
    _, _, _, loaded = gpu_one
    _script(tmp_path / "bin", "nvidia-smi", FAKE_SMI)
    log = tmp_path / "smi.log"
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SMI_LOG", str(log))
    state = tmp_path / "state"
    gpus = [d.model_copy(update={"index": i, "clock_mhz": 1125}) for i, d in enumerate(loaded.plan.devices * 2)]
    assert lock_clocks(state, gpus) == {0: 1125, 1: 1125}
    assert log.read_text().splitlines() == ["-i 0 -lgc 1125,1125", "-i 1 -lgc 1125,1125"]
    lock_clocks(state, [gpus[0].model_copy(update={"clock_mhz": None}), gpus[1]])  # GPU 0 no longer locked
    assert log.read_text().splitlines()[2] == "-i 0 -rgc"
    refused = [gpus[0], gpus[1].model_copy(update={"clock_mhz": 2500})]
    with pytest.raises(TritonctlError, match="refused to lock GPU 1 at 2500 MHz.*nothing was started"):
        lock_clocks(state, refused)
    assert log.read_text().splitlines()[-1] == "-i 0 -rgc"  # the one it had locked is reset
    release_clocks(state)
    assert not (state / "clocks.json").exists()


def test_the_bundle_holds_the_server_its_libraries_and_perf_analyzer():
    files = members("3.12")
    assert {"bin/tritonserver", "bin/perf_analyzer", "backends/python/libtriton_python.so"} <= set(files)
    assert "python_backend_stubs/3.12/triton_python_backend_stub" in files
    assert not any("python_backend_stubs/3.11" in name for name in files)
    assert {"lib/libcudart.so.12", "lib/libb64.so.0d"} <= set(files)  # perf_analyzer's, under their plain names
    assert any(name.startswith("lib/libtritonserver") for name in files)
    assert not any("libpython" in name for name in files)  # the host's, never the wheel's 3.13
    assert sum(p.stat().st_size for p in files.values()) < 140 * 2**20
    with pytest.raises(TritonctlError, match="--python 2.7: the wheel has stubs for Python 3.1"):
        members("2.7")


@pytest.mark.triton
def test_the_unpacked_bundle_starts_a_server_here(tmp_path, monkeypatch):
    """The trimmed Triton, unpacked elsewhere, is found on PATH, answers health checks and finds perf_analyzer."""
    made = bundle(tmp_path / "triton.tar.xz", f"{sys.version_info.major}.{sys.version_info.minor}", preset=0)
    assert made.path.stat().st_size < made.unpacked_bytes
    subprocess.run(["tar", "-xJf", str(made.path), "-C", str(tmp_path)], check=True)
    monkeypatch.setenv("PATH", f"{tmp_path / 'tritonserver' / 'bin'}:{os.environ['PATH']}")
    binary = find_tritonserver()
    assert binary.path == tmp_path / "tritonserver" / "bin" / "tritonserver" and binary.backends() == {"python"}
    (tmp_path / "models").mkdir()
    port = free_port("127.0.0.1")
    args = [
        f"--model-repository={tmp_path / 'models'}",
        "--model-control-mode=explicit",
        f"--http-port={port}",
        f"--grpc-port={free_port('127.0.0.1')}",
        "--allow-metrics=false",
        f"--backend-directory={binary.backend_dir}",
    ]
    server = subprocess.Popen(
        [str(binary.path), *args], env={**os.environ, **binary.env}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as answer:
                    assert answer.status == 200
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        server.terminate()
        server.wait(10)
    monkeypatch.setenv("TRITONCTL_PERF_ANALYZER", str(tmp_path / "tritonserver" / "bin" / "perf_analyzer"))
    from tritonctl.triton.perf_analyzer import find_perf_analyzer

    assert find_perf_analyzer().env["LD_LIBRARY_PATH"].startswith(str(tmp_path / "tritonserver" / "lib"))


def synthetic_sweep(path: Path, models=("resnet50", "mobilenet_v2", "efficientnet_b0", "resnet18")) -> None:
    """A SYNTHETIC energy sweep: batch time (a / f + c) * (alpha b + beta), energy per image U-shaped in the clock
    (least near 1150 MHz) and falling with the batch as b^-0.7; one model slower than the next."""
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(FIELDS)
        for k, model in enumerate(models):
            for b in (1, 2, 4, 8, 16, 32):
                for f in (780, 1020, 1260, 1500, 1740, 1830):
                    ms = (1 + k) * (600 / f + 0.2) * (0.15 * b + 0.6)
                    j = (0.02 + 0.05 * b**-0.7) * (1 + k) * (1 + 0.35 * ((f - 1150) / 700) ** 2)
                    out.writerow([model, b, f, 1, f, round(ms, 5), 0, round(j, 7), 0])


def test_the_energy_fit_completes_a_sweep_over_batch_and_clock(tmp_path):
    synthetic_sweep(tmp_path / "sweep.csv")
    samples = energy.read_samples(tmp_path / "sweep.csv")
    model = energy.fit(samples)
    assert (
        model.clocks[0] == 780
        and model.clocks[-1] == 1830
        and all(b - a == 15 for a, b in zip(model.clocks, model.clocks[1:], strict=False))
    )
    for s in samples:  # the completed table reproduces the sampled points it was fitted to
        assert model.time_ms(s.model, s.batch, round(s.clock_mhz)) == pytest.approx(s.batch_ms, rel=0.05)
        assert model.joules_per_image(s.model, s.batch, round(s.clock_mhz)) == pytest.approx(
            s.joules_per_image, rel=0.08
        )
    truth = (600 / 1125 + 0.2) * (0.15 * 3 + 0.6)  # a batch size and a clock the sweep never ran
    assert model.time_ms("resnet50", 3, 1125) == pytest.approx(truth, rel=0.05)
    assert all(err["time_median_pct"] < 5 and err["energy_median_pct"] < 8 for err in model.errors.values())
    energy.save(model, tmp_path / "em.json")
    assert energy.load(tmp_path / "em.json").models["resnet18"].t_ms == model.models["resnet18"].t_ms


def test_a_bad_sweep_or_energy_model_gets_one_clear_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("model,batch\nresnet50,1\n")
    with pytest.raises(TritonctlError, match="no column sm_clock_read_mhz, batch_ms, joules_per_image") as exc:
        energy.read_samples(bad)
    assert exc.value.file == str(bad)
    synthetic_sweep(bad)
    bad.write_text(bad.read_text().replace("resnet50,4,1020,1,1020,", "resnet50,4,1020,1,-5,", 1))
    with pytest.raises(TritonctlError, match="row 15: sm_clock_read_mhz out of range"):
        energy.read_samples(bad)
    one_clock = [energy.Sample("m", b, 1000, 1.0, 1.0) for b in (1, 2)]
    with pytest.raises(TritonctlError, match="at least two clocks"):
        energy.fit(one_clock)
    (tmp_path / "x.json").write_text('{"format": "something else"}')
    with pytest.raises(TritonctlError, match="not an energy model"):
        energy.load(tmp_path / "x.json")


def test_the_energy_objective_takes_the_clock_of_least_power_that_keeps_every_slo(gpu_one, tmp_path):
    cluster, artifacts, lm, loaded = gpu_one
    synthetic_sweep(tmp_path / "sweep.csv")
    em = energy.fit(energy.read_samples(tmp_path / "sweep.csv"))
    demands = demands_of(cluster, artifacts, lm)
    devices = devices_of(cluster)
    choices = {m.name: [c] for m in loaded.plan.models for c in [_choice(m.placements[0])]}
    sources = sources_of(cluster)
    decision = least_energy(choices, demands, devices, lm, em, sources)
    # Every model within every constraint at the chosen clock, under the latency model carried to it
    placement = {n: cs[0] for n, cs in decision.choices.items()}
    batches = {n: c.batch for n, c in placement.items()}
    by_name, by_id = {d.name: d for d in demands}, {d.id: d for d in devices}
    for d in demands:
        assert (
            next(batch_checks(d.name, placement, by_name, batches, by_id, decision.lm, (batches[d.name],)))[1] is None
        )
    # Slower at the lower clock, as the sweep says, and no cheaper clock on the grid serves every model
    assert decision.lm.t_inf("resnet50", 8, 25) > lm.t_inf("resnet50", 8, 25)
    assert decision.clock_mhz < em.clocks[-1]
    others = [
        at_clock(f, {n: cs[0] for n, cs in choices.items()}, demands, devices, lm, em, sources) for f in em.clocks[::8]
    ]
    assert all(o is None or o.power_w >= decision.power_w - 1e-9 for o in others)
    assert decision.power_w == pytest.approx(sum(d.rate * decision.joules_per_request[d.name] for d in demands))


def _choice(placement):
    from tritonctl.planning.policies.base import Choice

    return Choice(placement.device, placement.share, placement.batch, placement.queue_delay_us)


def test_plan_objective_energy_writes_the_clock_and_joules_and_refuses_what_it_cannot_plan(gpu_one, tmp_path, capsys):
    cluster, _, _, _ = gpu_one
    synthetic_sweep(tmp_path / "sweep.csv")
    em = tmp_path / "em.json"
    assert main(["fit-energy", str(tmp_path / "sweep.csv"), "-o", str(em)]) == 0
    out = tmp_path / "plan-energy.yaml"
    args = [
        "plan",
        str(cluster.path),
        "--latency-model",
        str(GPU_LM),
        "--objective",
        "energy",
        "--energy-model",
        str(em),
    ]
    assert main([*args, "-o", str(out)]) == 0
    plan = load_plan(out).plan
    assert plan.objective == "energy" and plan.devices[0].clock_mhz is not None
    assert all(p.predicted.joules_per_request > 0 and p.predicted.meets_slo for _, p in plan.instances())
    assert f"at {plan.devices[0].clock_mhz} MHz" in capsys.readouterr().out
    clock = plan.devices[0].clock_mhz  # a container cannot lock it: rendering for Compose says what to run
    assert main(["render", str(out), "--target", "compose", "--gpus", "1", "-o", str(tmp_path / "compose")]) == 0
    assert f"nvidia-smi -i 0 -lgc {clock},{clock}" in capsys.readouterr().out
    assert (
        main(["plan", str(cluster.path), "--latency-model", str(GPU_LM), "--objective", "energy", "-o", str(out)]) == 2
    )
    assert "--objective energy and --energy-model go together" in capsys.readouterr().err
    synthetic_sweep(tmp_path / "few.csv", models=("resnet50",))
    assert main(["fit-energy", str(tmp_path / "few.csv"), "-o", str(em)]) == 0
    assert main([*args, "-o", str(out)]) == 2
    assert "the energy model has no measurements of efficientnet_b0, mobilenet_v2, resnet18" in capsys.readouterr().err


def test_the_committed_h100_energy_model_fits_its_sweep():
    """The measured sweep (profiles/gpu-energy, H100) against the committed model: refitted, the same tables."""
    model = energy.fit(energy.read_samples(REPO / "profiles" / "gpu-energy" / "energy.csv"))
    committed = energy.load(REPO / "profiles" / "gpu-energy" / "energy-model.json")
    assert committed.clocks == model.clocks
    for name in model.models:
        assert np.allclose(committed.models[name].t_ms, model.models[name].t_ms, rtol=1e-3)
    assert not math.isnan(committed.errors["resnet50"]["energy_median_pct"])


def test_bench_adds_joules_per_request_and_the_energy_objective_row(gpu_one, tmp_path):
    from tritonctl.planning.compare import format_rows, run_policies

    cluster, artifacts, lm, _ = gpu_one
    synthetic_sweep(tmp_path / "sweep.csv")
    em = energy.fit(energy.read_samples(tmp_path / "sweep.csv"))
    rows = run_policies(cluster, artifacts, lm, ["search"], tmp_path / "bench", 5.0, energy=em)
    assert [r.policy for r in rows] == ["search", "search, energy objective"]
    search, saver = rows
    assert saver.joules_per_request < search.joules_per_request and saver.predicted_misses == 0
    assert "mJ/request (predicted)" in format_rows(rows).splitlines()[0]
    assert "mJ/request" not in format_rows([search.__class__(**{**search.__dict__, "joules_per_request": None})])


def test_a_dry_run_rehearses_a_gpu_plan_on_a_host_without_gpus(gpu_one, capsys):
    _, _, _, loaded = gpu_one
    assert main(["apply", str(loaded.path), "--dry-run"]) == 1  # 1: something would change
    said = capsys.readouterr().out
    assert (
        f"CUDA_MPS_PIPE_DIRECTORY={loaded.state_dir / 'mps' / 'pipe'}" in said and "nvidia-cuda-mps-control -d" in said
    )
    assert "would change 4 instance(s)" in said and not (loaded.state_dir / "mps").exists()
    assert main(["apply", str(loaded.path)]) == 2  # for real: refused here, nothing started
    assert "NVML sees no GPU" in capsys.readouterr().err


def test_calibrating_a_gpu_model_adds_what_serving_costs_per_batch_and_image(gpu_one):
    """Batch times that are the stand-in's plus 1.5 ms plus 0.6 ms per image (what Triton and the glue add on the
    host) give back c0 = 1.5 and c1 = 0.6, and the carried model predicts held-out batches and shares with them.
    SYNTHETIC: the measured times are made from the model itself."""
    from tritonctl.latency.model import scaled
    from tritonctl.profiler.calibrate import Point, added_of

    _, _, lm, _ = gpu_one
    truth = lambda batch, share: lm.t_inf("mobilenet", batch, share) + 1.5 + 0.6 * batch  # noqa: E731
    points = [
        Point("mobilenet", batch, share, True, truth(batch, share), lm.t_inf("mobilenet", batch, share))
        for batch, share in ((1, 25), (8, 25), (32, 25), (1, 50), (16, 50))
    ]
    assert added_of(points)["mobilenet"] == pytest.approx((1.5, 0.6), abs=1e-3)
    one = {name: (1.0, 0.0, 0.0) for name in lm.models}
    costs = {name: 0.0 for name in lm.models}
    carried = scaled(lm, one, {"id": "here"}, {}, costs, {"mobilenet": added_of(points)["mobilenet"]})
    for batch, share in ((4, 25), (8, 50), (16, 100)):
        assert carried.t_inf("mobilenet", batch, share) == pytest.approx(truth(batch, share), rel=0.05)
    assert carried.t_inf("resnet18", 8, 25) == lm.t_inf("resnet18", 8, 25)  # no term given: unchanged


def test_calibrating_a_gpu_cluster_is_refused_without_a_gpu_or_for_a_cpu_model(gpu_one, synthetic_lm, capsys):
    cluster, _, _, _ = gpu_one
    before = set(GPU_LM.parent.iterdir())
    assert main(["calibrate", str(cluster.path), "--latency-model", str(GPU_LM)]) == 2
    assert "calibrating a GPU cluster needs a GPU, and NVML sees no GPU" in capsys.readouterr().err
    assert set(GPU_LM.parent.iterdir()) == before  # nothing written
    assert main(["calibrate", str(cluster.path), "--latency-model", str(synthetic_lm)]) == 2
    err = capsys.readouterr().err
    assert "a cpu latency model cannot be carried to a gpu cluster" in err and "Traceback" not in err


def test_the_profiling_harness_pools_gpu_instances_per_share_under_its_own_mps_daemon(tmp_path, monkeypatch):
    """On a GPU the harness starts an MPS daemon of its own (stopped at close), keys instances by share (the MPS
    percentage is fixed at start; on a CPU by thread count), and serves with the torch glue where the tritonserver
    has no onnxruntime backend."""
    from tritonctl.planning.plan import Device
    from tritonctl.profiler.harness import Harness

    _script(tmp_path / "bin", "nvidia-cuda-mps-control", FAKE_MPS)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    gpu = Device(id="gpu0", kind="gpu", index=0, memory_mb=1, units=100)
    runtime = LocalRuntime(_binary(tmp_path, ("python",)), tmp_path / "work")
    (tmp_path / "work").mkdir()
    harness = Harness(runtime, gpu, {}, tmp_path / "work", [1])
    assert harness.gpu_backend == "python" and mps.answers(runtime.mps)
    assert harness._key("m", 25) != harness._key("m", 50)
    harness.close()
    assert not mps.answers(runtime.mps)
    cpu = Device(id="cpu", kind="cpu", index=0, memory_mb=1, units=100, cores=2.0)
    on_cpu = Harness(LocalRuntime(None, tmp_path / "cpu"), cpu, {}, tmp_path / "cpu", [1])
    assert on_cpu._key("m", 25) == on_cpu._key("m", 40)  # one onnxruntime thread each: one instance, two quotas


def test_prompt_batching_serves_smaller_batches_sooner_and_keeps_the_slo_at_headroom(gpu_one, tmp_path, capsys):
    """`plan --batching prompt`: each split placement at a batch no larger than BDA's, of lower predicted p99 at its
    rate, still within its SLO at PROMPT_RATE x the rate by eq. 2, with the queue delay that fills it."""
    from tritonctl.latency.queueing import task_latency
    from tritonctl.planning.policies.bda import PROMPT_RATE

    cluster = gpu_one[0]
    lm_path = GPU_LM  # search splits the GPU on it (on the calibrated model it takes the whole GPU in turns)
    for batching in ("fill", "prompt"):
        args = ["plan", str(cluster.path), "--policy", "search", "--latency-model", str(lm_path)]
        assert main([*args, "--batching", batching, "-o", str(tmp_path / f"{batching}.yaml")]) == 0
    fill, prompt = (load_plan(tmp_path / f"{b}.yaml").plan for b in ("fill", "prompt"))
    lm = load_latency_model(lm_path)
    for a, b in zip(fill.models, prompt.models, strict=True):
        pa, pb = a.placements[0], b.placements[0]
        assert pb.share == pa.share and pb.batch < pa.batch and pb.queue_delay_us < pa.queue_delay_us
        assert pb.predicted.latency_ms < pa.predicted.latency_ms
        others = tuple((m.name, m.placements[0].share, m.placements[0].batch) for m in prompt.models if m is not b)
        exec_ms = lm.t_inf(b.name, pb.batch, pb.share, others)
        assert task_latency(b.rate * PROMPT_RATE, pb.batch, exec_ms).p99_ms <= b.slo_ms
    capsys.readouterr()
    assert main(["plan", str(cluster.path), "--batching", "prompt", "-o", str(tmp_path / "x.yaml")]) == 2
    assert "--batching prompt needs a latency model" in capsys.readouterr().err


def test_a_gpu_host_refuses_to_plan_on_a_model_not_measured_through_triton_on_its_gpu(
    gpu_one, tmp_path, monkeypatch, capsys
):
    """Where nvidia-smi names a GPU, `plan` takes only a latency model made or calibrated on that GPU; elsewhere
    (planning for another host) it takes any."""
    from tritonctl.latency.device import gpu_fingerprint

    cluster = gpu_one[0]
    _script(tmp_path / "bin", "nvidia-smi", 'echo "NVIDIA H200, 580.159.04, 143771 MiB"\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    plan = ["plan", str(cluster.path), "--policy", "search", "-o", str(tmp_path / "plan.yaml"), "--latency-model"]
    assert main([*plan, str(GPU_LM)]) == 2
    err = capsys.readouterr().err
    assert "not measured through Triton on this GPU (NVIDIA H200" in err and "tritonctl calibrate" in err
    calibrated = json.loads((REPO / "profiles" / "inss-gpu" / "latency-model.714aeecb5682.json").read_text())
    calibrated["device"]["fingerprint"] = gpu_fingerprint()
    (tmp_path / "here.json").write_text(json.dumps(calibrated))
    assert main([*plan, str(tmp_path / "here.json")]) == 0
    monkeypatch.setenv("PATH", os.environ["PATH"].split(":", 1)[1])  # no GPU here: planning for another host
    capsys.readouterr()
    assert main([*plan, str(GPU_LM)]) == 0
    assert "speaks for NVIDIA H100 80GB HBM3; on another GPU" in capsys.readouterr().out


def test_eager_batching_keeps_bdas_batches_as_the_cap_and_waits_for_none(gpu_one, tmp_path):
    """`plan --batching eager`: the fill plan's shares and batches, no queue delay, so batches form of what is
    queued; the simulator (which runs Triton's batcher so) answers sooner than the fill plan at the same rates."""
    cluster = gpu_one[0]
    lm_path = str(GPU_LM)  # search splits the GPU on it (on the calibrated model it takes the whole GPU in turns)
    for batching in ("fill", "eager"):
        args = ["plan", str(cluster.path), "--policy", "search", "--latency-model", lm_path]
        assert main([*args, "--batching", batching, "-o", str(tmp_path / f"{batching}.yaml")]) == 0
    fill, eager = (load_plan(tmp_path / f"{b}.yaml").plan for b in ("fill", "eager"))
    for a, b in zip(fill.models, eager.models, strict=True):
        pa, pb = a.placements[0], b.placements[0]
        assert (pb.share, pb.batch) == (pa.share, pa.batch) and pa.queue_delay_us > 0 and pb.queue_delay_us == 0
        assert b.simulated_p99_ms < 0.5 * a.simulated_p99_ms and b.simulated_in_slo >= 0.99


def test_the_whole_gpu_in_turns_served_eagerly_forms_the_largest_batches_its_duty_cycle_keeps(gpu_one, tmp_path):
    """`plan --policy time-sharing --batching eager` on the calibrated model: every model on the whole GPU with no
    queue delay, its batch cap from the duty cycle at the highest rates it keeps (`widest_schedule`), so the plan
    holds beyond 1x where the duty cycle's batches at 1x would cap it; the host's part of a batch runs beside the
    others' turns, so the duty cycle is shorter than the batches' times added up; the plan's load counts the
    GPU parts alone."""
    from tritonctl.planning.planner import predicted_load
    from tritonctl.planning.policies.base import Demand
    from tritonctl.planning.policies.timesharing import gpu_cycle, schedule, widest_schedule
    from tritonctl.planning.simulate import simulate

    cluster, artifacts, _, _ = gpu_one
    calibrated = load_latency_model(REPO / "profiles" / "inss-gpu" / "latency-model.714aeecb5682.json")
    paths = {b: tmp_path / f"{b}.yaml" for b in ("fill", "eager")}
    for batching, path in paths.items():
        plan = make_plan(cluster, artifacts, "time-sharing", path, calibrated, log=lambda _: None, batching=batching)
        save_plan(plan, path)
    fill, eager = (load_plan(p).plan for p in paths.values())
    assert eager.sharing == "temporal" and not mps.needed(eager)
    demands = demands_of(cluster, artifacts, calibrated)
    (device,) = devices_of(cluster)
    scale, widest = widest_schedule(demands, device, calibrated)
    assert scale > 1.5 and schedule(demands, device, calibrated) is not None
    over = [Demand(d.name, d.slo_ms, d.rate * 1.02 * scale, d.memory_mb) for d in demands]
    assert schedule(over, device, calibrated) is None  # the widest: 2% more has no duty cycle
    for a, b in zip(fill.models, eager.models, strict=True):
        pa, pb = a.placements[0], b.placements[0]
        assert pb.share == 100 and pb.queue_delay_us == 0 and pb.batch == widest[b.name] > pa.batch
    members = [(m.name, m.placements[0].batch) for m in eager.models]
    alone = [calibrated.t_inf(name, batch, 100) for name, batch in members]
    gpu = sum(alone) - sum(calibrated.host_ms(name, batch) for name, batch in members)
    assert gpu_cycle(members, 100, calibrated) == pytest.approx(max(gpu, *alone)) and max(gpu, *alone) < sum(alone)
    (load,) = predicted_load(eager, calibrated).values()
    assert (
        load < 1 < sum(m.rate * m.placements[0].predicted.exec_ms / 1000 / m.placements[0].batch for m in eager.models)
    )
    for plan in (fill, eager):
        result = simulate(plan, calibrated, 30, rate_scale=1.5)
        served = [m.good / m.arrived for m in result.models]
        assert (min(served) >= 0.99) == (plan is eager), served


def test_plan_serves_a_gpu_cluster_eagerly_by_default_and_a_cpu_one_by_filling(gpu_one, tmp_path):
    """Without --batching, a GPU cluster with a latency model is planned eagerly (on the calibrated model: the whole
    GPU in turns, no queue delay); --batching fill still fills; a GPU cluster without a latency model fills."""
    cluster = gpu_one[0]
    calibrated = str(REPO / "profiles" / "inss-gpu" / "latency-model.714aeecb5682.json")
    paths = {name: tmp_path / f"{name}.yaml" for name in ("default", "fill", "none")}
    assert main(["plan", str(cluster.path), "--latency-model", calibrated, "-o", str(paths["default"])]) == 0
    assert (
        main(["plan", str(cluster.path), "--latency-model", calibrated, "--batching", "fill", "-o", str(paths["fill"])])
        == 0
    )
    assert main(["plan", str(cluster.path), "-o", str(paths["none"])]) == 0
    default, fill, none = (load_plan(p).plan for p in paths.values())
    assert (default.batching, fill.batching, none.batching) == ("eager", "fill", "fill")
    assert default.takes_turns("gpu0") and all(p.queue_delay_us == 0 for _, p in default.instances())
    assert all(p.queue_delay_us > 0 for _, p in fill.instances())


def test_a_deployment_whose_gpus_all_take_turns_starts_no_mps_daemon(gpu_one, tmp_path):
    """`prepare` (what apply runs before any instance starts) asks for the MPS daemon only where a GPU is split: on a
    host without MPS (this one) the split plan is refused there, the whole-GPU plan is not."""
    with contextlib.suppress(TritonctlError):
        pytest.skip(f"this host has MPS ({mps.control_binary()}): prepare would start a daemon")
    cluster, artifacts, _, split = gpu_one
    calibrated = load_latency_model(REPO / "profiles" / "inss-gpu" / "latency-model.714aeecb5682.json")
    path = tmp_path / "turns.yaml"
    save_plan(make_plan(cluster, artifacts, "time-sharing", path, calibrated, lambda _: None, batching="eager"), path)
    turns = load_plan(path)
    binary = _binary(tmp_path / "py", ("python",))
    with pytest.raises(TritonctlError, match="no MPS control binary"):
        LocalRuntime(binary, tmp_path / "s").prepare(split, write=True)  # short: MPS pipe paths are bounded
    LocalRuntime(binary, tmp_path / "t").prepare(turns, write=True)
    assert not (tmp_path / "t" / mps.RECORD).exists()

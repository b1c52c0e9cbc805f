"""The GPU profile: its parsers, and the fit on the committed H100 measurements (profiles/inss-gpu).

Measuring needs a GPU host (profiler/gpu.py `measure`); what runs here is everything after it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_mlp, mlp_model, write_cluster
from tritonctl.errors import TritonctlError
from tritonctl.latency.dataset import load_dataset
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.report import evaluate
from tritonctl.profiler.gpu import _keys, _l2_line, _parse_ncu, assemble, parse_models
from tritonctl.profiler.grid import Member, Run

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "profiles/inss-gpu"


def test_models_argument_and_worker_slots():
    assert parse_models("alexnet, mobilenet=mobilenet_v2,") == {"alexnet": "alexnet", "mobilenet": "mobilenet_v2"}
    run = Run("coloc", "train", (Member("a", 25, 4), Member("b", 25, 4), Member("c", 50, 4)))
    assert _keys(run) == [(25, 0), (25, 1), (50, 0)]  # two members at one share need two MPS clients


def _ncu_csv(values: list[tuple[int, float, float]]) -> str:
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    lines = ["==PROF== Connected to process 1", head]
    for i, duration, l2 in values:
        lines.append(f'"{i}","graph","gpu__time_duration.sum","ns","{duration:,.0f}"')
        lines.append(f'"{i}","graph","lts__throughput.avg.pct_of_peak_sustained_elapsed","%","{l2}"')
    return "\n".join(lines)


def test_ncu_results_map_to_the_models_in_order_or_not_at_all():
    text = _ncu_csv([(1, 2_500_000, 30.5), (0, 1200, 8.25)])
    assert _parse_ncu(text, ["first", "second"]) == {"first": 8.25, "second": 30.5}
    assert _parse_ncu(text, ["only"]) is None  # a model lost or one too many: refuse rather than misassign


def test_l2_is_carried_to_each_share_by_the_graph_time():
    rows = [
        {"model": "m", "kind": "solo", "split": "train", "batch": 4, "share": s, "compute_ms": 10.0 * 100 / s}
        for s in (25, 50, 100)
    ] + [{"model": "m", "kind": "solo", "split": "train", "batch": 8, "share": 25, "compute_ms": 99.0}]
    line = _l2_line(40.0, rows, "m")
    # graph time ~ 1/share here, so the same bytes over a longer time: 40% x share / 100, exactly a line
    assert line(100) == pytest.approx(40.0)
    assert line(25) == pytest.approx(10.0)


def test_the_h100_profile_is_complete_and_fits_its_held_out_points():
    dataset = load_dataset(PROFILE)
    assert dataset.metadata["device"]["kind"] == "gpu" and "H100" in dataset.metadata["device"]["model"]
    assert set(dataset.models) == {
        "alexnet",
        "resnet50",
        "vgg16",
        "vgg19",
        "resnet18",
        "mnasnet",
        "efficientnet",
        "mobilenet",
    }
    assert {r.kind for r in dataset.rows} == {"solo", "coloc"}
    model = fit_latency_model(dataset, log=lambda _: None)
    results = evaluate(model, dataset, None)
    solo = [r.error("inss") for r in results if r.row.kind == "solo"]
    coloc = [r.error("inss") for r in results if r.row.kind == "coloc"]
    # Measured on the H100: median 2.2% solo, 4.1% co-located; max 13.5% and 9.5%.
    assert statistics.median(solo) < 0.05 and max(solo) < 0.2
    assert statistics.median(coloc) < 0.08 and max(coloc) < 0.15
    # Co-location on the H100 costs time per kernel and through L2: both terms are fitted above zero.
    assert model.device.sched_a > 0 and model.device.sched_b > 0
    assert min(p.alpha_cache for p in model.models.values()) > 0


def test_the_committed_latency_model_is_the_fit_of_the_committed_profile():
    dataset = load_dataset(PROFILE)
    committed = json.loads((PROFILE / "latency-model.json").read_text())
    # fitted in its own form: the local fits' degrees it records (1 where the file has none), and the interference
    # terms in milliseconds, as this file's were
    degrees = tuple(sorted({p.get("lwr_degree", 1) for p in committed["models"].values()}))
    fresh = fit_latency_model(dataset, log=lambda _: None, degrees=degrees, relative=False)
    for key in ("io_c0_ms", "io_ms_per_byte", "sched_a", "sched_b", "gpulet"):
        assert committed["device"][key] == pytest.approx(getattr(fresh.device, key), rel=1e-6), key
    for name, params in fresh.models.items():
        for key in ("alpha_cache", "cache_a", "cache_b", "lwr_y", "n_ops"):
            assert committed["models"][name][key] == pytest.approx(getattr(params, key), rel=1e-6), (name, key)


def test_the_simulator_matches_the_real_h100_replay_of_the_search_plans():
    """bench/gpu_replay.py replayed the search plans of the three InSS setups on an H100 under MPS;
    the simulator, on the same arrivals, must keep agreeing with what the GPU did."""
    for setup in ("six-4", "eight-4", "eight-5"):
        results = REPO / f"bench/results/gpu-replay-{setup}"
        table = subprocess.run(
            [sys.executable, str(REPO / "bench" / "gpu_replay.py"), "compare", str(results),
             "--replays-root", str(PROFILE / "replays")],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        (total,) = [line for line in table.splitlines() if line.startswith("| search | ") and line.count("|") == 6]
        real, sim = (float(cell) for cell in total.split("|")[2:4])
        assert abs(sim / real - 1) < 0.05, (setup, real, sim)


def _stand_in_cluster(tmp_path: Path) -> Path:
    """The eight InSS model names over a small real ONNX file: assemble reads only their files' features."""
    make_mlp(tmp_path / "mlp.onnx")
    names = [line.split(",")[0] for line in (PROFILE / "models.csv").read_text().splitlines()[1:]]
    return write_cluster(tmp_path, [mlp_model(name) for name in names])


def test_assemble_maps_the_gpu_records_into_a_profile(tmp_path):
    records = [json.loads(line) for line in (PROFILE / "raw.jsonl").read_text().splitlines()]
    dataset = assemble(PROFILE / "raw.jsonl", _stand_in_cluster(tmp_path), tmp_path / "profile", log=lambda _: None)
    rows = [r for r in records if r["type"] == "row"]
    assert len(dataset.rows) == len(rows) and dataset.metadata["device"]["kind"] == "gpu"
    first = dataset.rows[0]
    assert (first.config_id, first.p99_ms, first.threads) == (rows[0]["config_id"], rows[0]["p99_ms"], 0)
    kernels = {r["model"]: r["kernels"] for r in records if r["type"] == "kernels"}
    assert {name: f.n_ops for name, f in dataset.models.items()} == kernels  # kernels, not the ONNX's operators
    l2 = {r["model"]: r["l2_pct"] for r in records if r["type"] == "l2"}
    for row in dataset.rows:  # the line through the carried L2 points passes near the measured one at 100%
        if row.share == 100:
            assert row.cpu_util == pytest.approx(l2[row.model], rel=0.15)
    assert len(dataset.memory) == sum(r["type"] == "memory" for r in records)
    back = load_dataset(tmp_path / "profile")  # and it reads back
    assert [(r.config_id, r.model) for r in back.rows] == [(r.config_id, r.model) for r in dataset.rows]


def test_assemble_refuses_a_cut_short_measurement(tmp_path):
    cut = tmp_path / "raw.jsonl"
    lines = (PROFILE / "raw.jsonl").read_text().splitlines()
    cut.write_text(
        "\n".join(ln for ln in lines if not ('"solo"' in ln and '"share": 100,' in ln and '"batch": 4,' in ln)) + "\n"
    )
    with pytest.raises(TritonctlError, match="share 100"):
        assemble(cut, _stand_in_cluster(tmp_path), tmp_path / "profile", log=lambda _: None)
    twice = tmp_path / "twice.jsonl"
    twice.write_text("\n".join(lines + lines) + "\n")
    with pytest.raises(TritonctlError, match="more than one run"):
        assemble(twice, _stand_in_cluster(tmp_path), tmp_path / "profile", log=lambda _: None)

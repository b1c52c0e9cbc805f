"""`tritonctl profile` against real Triton instances: dataset, quota enforcement, budget, resume, foreign device."""

from __future__ import annotations

import json

import pytest

from conftest import make_mlp, mlp_model, write_cluster
from tritonctl.cli import main
from tritonctl.deploy import share
from tritonctl.latency.dataset import load_dataset
from tritonctl.profiler import run
from tritonctl.profiler.grid import coloc_runs, solo_runs

pytestmark = [
    pytest.mark.triton,  # real tritonserver processes
    pytest.mark.skipif(share.mechanism() == "none", reason="profiling needs a writable cgroup"),
]


def test_profile_is_budgeted_resumable_and_measured_under_the_share(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha"), mlp_model("beta")])
    out = tmp_path / "profile"
    assert main(["profile", str(cluster), "-o", str(out), "--budget", "4"]) == 0
    assert "incomplete (run again to resume)" in capsys.readouterr().out
    first = load_dataset(out)
    assert 1 <= len(first.rows) < len(solo_runs(["alpha", "beta"], 100))
    meta = first.metadata
    assert meta["complete"] is False and meta["software"]["tritonserver"].startswith("2.")
    assert meta["device"]["logical_cpus"] >= 1 and "cgroup" in meta["share_mechanism"]
    assert first.models["alpha"].n_ops == 3 and first.models["alpha"].input_bytes == 16 * 4

    assert main(["profile", str(cluster), "-o", str(out), "--budget", "4"]) == 0
    capsys.readouterr()
    second = load_dataset(out)
    ids = [(r.config_id, r.model) for r in second.rows]
    assert len(ids) > len(first.rows) and len(ids) == len(set(ids))  # resumed, nothing measured twice
    assert ids[: len(first.rows)] == [(r.config_id, r.model) for r in first.rows]
    for row in second.rows:
        assert row.reps >= 3 and 0 < row.p50_ms <= row.p99_ms
        assert row.cpu_util <= row.share_frac * row.cores * 1.15 + 0.05  # the quota held
    assert len(solo_runs(["alpha", "beta"], 100) + coloc_runs(["alpha", "beta"], 100)) > len(ids)


def test_profile_of_other_models_is_refused(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha")])
    out = tmp_path / "profile"
    assert main(["profile", str(cluster), "-o", str(out), "--budget", "0"]) == 0
    cluster = write_cluster(tmp_path, [mlp_model("alpha"), mlp_model("beta")])
    capsys.readouterr()
    assert main(["profile", str(cluster), "-o", str(out)]) == 2
    assert "this profile measured models ['alpha']" in capsys.readouterr().err


def test_profile_from_another_device_is_refused(tmp_path, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha")])
    out = tmp_path / "profile"
    assert main(["profile", str(cluster), "-o", str(out), "--budget", "0"]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    meta["device"].update(id="0123456789ab", model="Some Other CPU")
    (out / "metadata.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["profile", str(cluster), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "measured on another device (Some Other CPU" in err and "metadata.json" in err


def test_profile_measures_the_wake_up_and_request_cost_of_every_model(tmp_path, monkeypatch, capsys):
    """Only the wake-up and request-cost measurements (the grid narrowed to nothing), on real Triton instances
    and a real HAProxy."""
    monkeypatch.setattr(run, "solo_runs", lambda names, units: [])
    monkeypatch.setattr(run, "coloc_runs", lambda names, units: [])
    monkeypatch.setattr(run, "repeat_runs", lambda names, units: [])
    monkeypatch.setattr(run, "WAKE_GAPS_MS", (0, 30))
    monkeypatch.setattr(run, "WAKE_REQUESTS", 5)
    # enough requests that HAProxy's share of this tiny model's CPU spans several 10 ms clock ticks
    monkeypatch.setattr(run, "COST_REQUESTS", 1000)
    monkeypatch.setattr(run, "COST_GAP_MS", 1.0)
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha"), mlp_model("beta")])
    assert main(["profile", str(cluster), "-o", str(tmp_path / "profile")]) == 0
    dataset = load_dataset(tmp_path / "profile")
    assert sorted((w.model, w.gap_ms) for w in dataset.wake) == [("alpha", 0), ("alpha", 30), ("beta", 0), ("beta", 30)]
    assert all(0 < w.p50_ms < 1000 for w in dataset.wake) and dataset.metadata["complete"] is True
    # every request costs the Triton server process and HAProxy some CPU, well under a 10 ms tick each
    assert sorted(c.model for c in dataset.requests) == ["alpha", "beta"]
    assert all(0 < c.server_cpu_ms < 10 and 0 < c.proxy_cpu_ms < 10 for c in dataset.requests)
    assert not (tmp_path / "profile" / "work" / "haproxy.json").exists()  # HAProxy stopped with the profile
    # resumed without its wake-up: measured again, and the warm-up's memory points are not written twice
    (tmp_path / "profile" / "wake.csv").write_text("model,gap_ms,p50_ms\n")
    assert main(["profile", str(cluster), "-o", str(tmp_path / "profile")]) == 0
    resumed = load_dataset(tmp_path / "profile")
    assert len(resumed.wake) == 4
    keys = [(m.model, m.threads, m.batch) for m in resumed.memory]
    assert keys and len(keys) == len(set(keys))
    # measured without spinning threads: resuming with them would mix two settings in one profile
    assert resumed.metadata["ort_spinning"] == "0"
    monkeypatch.setenv("TRITONCTL_ORT_SPINNING", "1")
    assert main(["profile", str(cluster), "-o", str(tmp_path / "profile")]) == 2
    assert "not spinning" in capsys.readouterr().err

"""The latency model: LWR estimator, queueing (eq. 2), fitting, file checks, plan predictions.

Datasets built here are SYNTHETIC (generated from a known formula) so that a fit can be
checked against the truth; the real-measurement path is covered by test_profile.py.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sklearn.utils.estimator_checks import check_estimator

from conftest import make_mlp, mlp_model, write_cluster
from synthetic import ALPHA_CACHE, synthetic_dataset, true_latency
from tritonctl.cli import main
from tritonctl.latency import mlp, queueing
from tritonctl.latency.dataset import WakePoint, load_dataset
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.lwr import LocallyWeightedRegression
from tritonctl.latency.model import MAX_BATCH, LatencyModel, load_latency_model
from tritonctl.latency.queueing import (
    TaskLatency,
    batcher_latency,
    eq2,
    sample_batcher_latencies,
    sample_task_latency,
    task_latency,
    warm_tables,
    without_queueing,
)
from tritonctl.latency.report import repeat_gaps
from tritonctl.planning.plan import load_plan
from tritonctl.planning.planner import predict
from tritonctl.profiler.grid import Member, beyond, coloc_runs, colocated, in_waves, left_out, repeat_runs, solo_runs


def test_lwr_is_a_scikit_learn_estimator():
    check_estimator(LocallyWeightedRegression(log_target=False))


def test_a_local_quadratic_follows_a_surface_that_bends_where_a_local_plane_cannot():
    """Latency bends across log batch (flat while a batch fills the cores, linear after): at a kernel as wide
    as the data, degree 2 reproduces a quadratic surface, degree 1 misses it."""
    grid = np.array([(b, s) for b in np.linspace(0, 5, 6) for s in np.linspace(-1, 0, 4)])
    y = np.exp(1 + 0.2 * grid[:, 0] ** 2 - 0.5 * grid[:, 0] * grid[:, 1] - grid[:, 1])  # synthetic
    query = np.array([(2.5, -0.4), (4.5, -0.9)])
    truth = np.exp(1 + 0.2 * query[:, 0] ** 2 - 0.5 * query[:, 0] * query[:, 1] - query[:, 1])
    errors = {
        d: np.abs(LocallyWeightedRegression(bandwidth=1.0, degree=d).fit(grid, y).predict(query) / truth - 1)
        for d in (1, 2)
    }
    assert errors[2].max() < 1e-4 and errors[1].max() > 0.05
    with pytest.raises(ValueError, match="degree must be 1 or 2"):
        LocallyWeightedRegression(degree=3).fit(grid, y)


def test_lwr_interpolates_a_smooth_latency_surface():
    rng = np.random.default_rng(0)
    batch, share = rng.integers(1, 33, 300), rng.uniform(0.2, 1.0, 300)
    y = (2 + 1.5 * batch**0.9) / share  # synthetic
    X = np.c_[np.log2(batch), np.log(share)]
    model = LocallyWeightedRegression(bandwidth=0.1).fit(X[:250], y[:250])
    errors = np.abs(model.predict(X[250:]) / y[250:] - 1)
    assert np.median(errors) < 0.01 and errors.max() < 0.05


def test_eq2_both_cases():
    # Enough queued work: wait for what runs, then ceil(W / b) batches.
    assert eq2(queued_with_task=5, batch=2, t_inf_ms=10, exec_left_ms=3, rate=100) == 3 + 3 * 10
    # Not enough to fill a batch: wait for (b - W) more arrivals at the rate, or what runs, if longer.
    assert eq2(queued_with_task=1, batch=4, t_inf_ms=10, exec_left_ms=3, rate=100) == 30 + 10
    assert eq2(queued_with_task=3, batch=4, t_inf_ms=10, exec_left_ms=25, rate=100) == 25 + 10


def test_task_latency_matches_md1_for_batch_one():
    """With b = 1 the batch server is M/D/1: mean sojourn t + rho t / (2 (1 - rho))."""
    t, rate = 10.0, 60.0  # rho = 0.6
    rho = rate * t / 1000
    expected = t + rho * t / (2 * (1 - rho))
    got = sample_task_latency(rate, 1, t, tasks=100_000).mean_ms
    assert got == pytest.approx(expected, rel=0.05)


def test_the_dynamic_batcher_is_eq2s_queue_at_batch_one_and_waits_at_most_its_queue_delay():
    for rate, t in ((50.0, 10.0), (90.0, 10.0)):  # one request a batch: the same M/D/1 queue on the same arrivals
        assert batcher_latency(rate, (t,), 0.0, 100.0)[0].p99_ms == pytest.approx(task_latency(rate, 1, t).p99_ms, 0.01)
    times = tuple(2.0 + 0.5 * k for k in range(8))  # a batch of 8 at 200 requests/s takes 5.5 ms, 36% of the time
    eager, capped, filled = (batcher_latency(200.0, times, delay, 25.0)[0] for delay in (0.0, 12.5, 1e9))
    assert eager.p99_ms < capped.p99_ms < 12.5 + 2 * times[-1] < filled.p99_ms  # the cap: a wait and two batches
    assert sample_batcher_latencies(200.0, times, 12.5).max() <= 12.5 + 2 * times[-1]
    assert not batcher_latency(2000.0, times, 0.0, 25.0)[0].stable  # beyond what full batches serve
    busy = tuple(1.0 + 0.3 * k for k in range(32))  # 3000 requests/s fill a batch of 32 in about 11 ms
    assert sample_batcher_latencies(3000.0, busy, 50.0).max() < 30  # the last ones too: none waits out the delay
    with without_queueing():  # the ablation: a request takes its full batch's time
        assert batcher_latency(200.0, times, 0.0, 25.0) == (TaskLatency(5.5, 5.5, True), 1.0)


def test_task_latency_depends_on_time_only_through_the_load():
    """Latency in units of t_inf is a function of batch and load alone (what the table relies on)."""
    for batch in (1, 2, 7):
        scaled = [sample_task_latency(0.3 * batch * 1000 / t, batch, t).mean_ms / t for t in (1.0, 13.21, 33.3)]
        assert scaled == pytest.approx([scaled[0]] * 3, rel=1e-9)


def test_task_latency_table_matches_the_sample():
    rng = np.random.default_rng(3)
    for _ in range(300):
        batch, t, load = int(rng.integers(1, 33)), float(rng.uniform(1, 50)), float(rng.uniform(0.002, 0.99))
        rate = load * batch * 1000 / t
        fast, exact = task_latency(rate, batch, t), sample_task_latency(rate, batch, t)
        assert fast.p99_ms == pytest.approx(exact.p99_ms, rel=0.025)
        assert fast.mean_ms == pytest.approx(exact.mean_ms, rel=0.01)


def test_warm_tables_leaves_no_table_to_build_on_first_use():
    """What the controller does when it starts, so that its first re-plan does not build them under load."""
    queueing._table.cache_clear()
    warm_tables(MAX_BATCH)
    built = queueing._table.cache_info().misses
    for batch in range(1, MAX_BATCH + 1):
        task_latency(rate=0.5 * batch * 1000 / 10, batch=batch, t_inf_ms=10)
    assert queueing._table.cache_info().misses == built


def test_task_latency_overload_and_batch_filling():
    assert not task_latency(rate=200, batch=2, t_inf_ms=10).stable  # 200/s x 10 ms = 2 batches' worth
    light = task_latency(rate=10, batch=4, t_inf_ms=5)  # waiting to fill a batch of 4 at 10/s dominates
    assert 100 < light.mean_ms < 300 and light.stable


def test_fit_recovers_a_known_synthetic_model(tmp_path):
    dataset = synthetic_dataset(tmp_path / "profile")
    model = fit_latency_model(dataset, log=lambda _: None)
    for row in dataset.rows:
        if row.split == "heldout":
            got = model.t_inf(row.model, row.batch, row.share, tuple(row.corunner_list()))
            assert got == pytest.approx(row.p50_ms, rel=0.08), row
    assert model.footprint_mb("beta", 8) == pytest.approx(140, rel=0.01)
    # The truth weighs the co-runners by the instance's duty: a quarter share (half a core on its one thread)
    # feels half of them. Fitted so, the interference coefficients are the truth's; unweighed, far off.
    for name, alpha in ALPHA_CACHE.items():
        assert model.models[name].alpha_cache == pytest.approx(alpha, rel=0.05)
    unweighed = fit_latency_model(dataset, log=lambda _: None, pressure_by_duty=False)
    assert unweighed.models["alpha"].alpha_cache < 0.5 * ALPHA_CACHE["alpha"]
    model.save(tmp_path / "lm.json")
    loaded = load_latency_model(tmp_path / "lm.json")
    assert loaded.device.pressure_by_duty and loaded.duty(25) == 0.5 and loaded.duty(50) == 1.0


def test_interference_is_fitted_to_relative_errors_so_the_slow_model_does_not_outweigh_the_fast_one(tmp_path):
    dataset = synthetic_dataset(tmp_path / "profile")
    # SYNTHETIC: a slowdown the model's terms cannot follow (20% on the co-located rows of batches 1-2 alone), so
    # the two losses part: in milliseconds the slow rows weigh most, relative to the latency each row alike
    dataset.rows = [
        replace(r, p50_ms=r.p50_ms * 1.2) if r.kind == "coloc" and r.batch <= 2 else r for r in dataset.rows
    ]
    rows = [r for r in dataset.rows if r.kind == "coloc" and r.split == "train"]

    def errors(model):
        got = np.array([model.t_inf(r.model, r.batch, r.share, tuple(r.corunner_list())) for r in rows])
        measured = np.array([r.p50_ms for r in rows])
        return float(np.sum(((got - measured) / measured) ** 2)), float(np.sum((got - measured) ** 2))

    relative = errors(fit_latency_model(dataset, log=lambda _: None))
    absolute = errors(fit_latency_model(dataset, log=lambda _: None, relative=False))
    assert relative[0] < 0.95 * absolute[0]  # each fit is the better by its own measure
    assert absolute[1] < 0.95 * relative[1]


def test_a_profile_measures_each_solo_configuration_after_its_smaller_batches_and_rules_out_what_a_slow_one_bounds():
    runs = solo_runs(["alpha", "beta"], 100) + coloc_runs(["alpha", "beta"], 100)
    ordered = in_waves(runs)
    assert sorted(r.group for r in ordered) == sorted(r.group for r in runs) and ordered == in_waves(runs)
    solo_batches = [r.members[0].batch for r in ordered if r.kind == "solo"]
    assert solo_batches == sorted(solo_batches)
    kinds = [r.kind for r in ordered]
    assert kinds.index("coloc") < kinds.index("solo", len(kinds) // 2)  # co-located runs dealt among the waves
    slow = [Member("beta", 50, 4)]
    assert beyond(Member("beta", 50, 8), slow) and beyond(Member("beta", 25, 6), slow)
    assert not beyond(Member("beta", 75, 8), slow)  # more share: may be fast enough
    assert not beyond(Member("beta", 25, 4), slow)  # the same batch is measured
    assert not beyond(Member("alpha", 25, 8), slow)
    solo = {r.members[0]: r for r in runs if r.kind == "solo"}
    assert left_out(solo[Member("beta", 50, 8)], slow, colocated(runs))
    assert not left_out(solo[Member("beta", 50, 4)], [Member("beta", 50, 2)], colocated(runs))  # measured co-located


def test_held_out_configurations_measured_again_say_how_far_the_machine_repeats_and_are_never_fitted(tmp_path):
    repeats = repeat_runs(["alpha", "beta"], 100)
    held_out = {r.members for r in solo_runs(["alpha", "beta"], 100) if r.split == "heldout"}
    assert len(repeats) == 6 and all(r.split == "repeat" and r.members in held_out for r in repeats)
    assert (
        len({r.group for r in repeats} | {r.group for r in solo_runs(["alpha", "beta"], 100)})
        == len(solo_runs(["alpha", "beta"], 100)) + 6
    )  # a row of its own in the dataset, never the held-out one's
    dataset = synthetic_dataset(tmp_path / "profile")
    before = fit_latency_model(dataset, log=lambda _: None)
    first = {(r.model, r.share, r.batch): r for r in dataset.rows if r.kind == "solo" and r.split == "heldout"}
    again = [
        replace(
            first[(m.model, m.share, m.batch)],
            config_id=run.group,
            split="repeat",
            p50_ms=factor * first[(m.model, m.share, m.batch)].p50_ms,
        )
        for run, factor in zip(repeats, (1.1, 0.8, 1.0, 1.3, 0.95, 1.0), strict=True)
        for m in run.members
    ]
    assert repeat_gaps(dataset) == []
    dataset.rows += again
    assert sorted(repeat_gaps(dataset)) == pytest.approx([0.0, 0.0, 0.05, 0.1, 0.2, 0.3])
    after = fit_latency_model(dataset, log=lambda _: None)  # 30% off on one: fitted, it would move the surface
    for r in again:
        assert after.t_inf(r.model, r.batch, r.share) == before.t_inf(r.model, r.batch, r.share)


def test_configurations_left_out_of_a_profile_are_predicted_no_faster_than_the_slow_one_that_ruled_them_out(tmp_path):
    dataset = synthetic_dataset(tmp_path / "profile")
    limit = 40.0
    slow = [
        Member(r.model, r.share, r.batch)
        for r in dataset.rows
        if r.kind == "solo" and r.split == "train" and r.p50_ms > limit
    ]
    left_out = [r for r in dataset.rows if r.kind == "solo" and beyond(Member(r.model, r.share, r.batch), slow)]
    assert len(left_out) > 20
    dataset.rows = [r for r in dataset.rows if r not in left_out]
    dataset.metadata["slower_than_ms"] = {"alpha": limit, "beta": limit}
    fit_latency_model(dataset, log=lambda _: None).save(tmp_path / "lm.json")
    model = load_latency_model(tmp_path / "lm.json")
    assert model.models["beta"].lwr_floors
    for row in left_out:
        assert model.t_inf(row.model, row.batch, row.share) > limit, row
    for row in dataset.rows:  # below the floors, the fit is as good as ever
        if row.split == "heldout" and row.kind == "solo":
            assert model.t_inf(row.model, row.batch, row.share) == pytest.approx(row.p50_ms, rel=0.08), row
    # A floor holds where the local fit would predict less: every point 10 ms but one 100 ms, at batch 4 on both
    # cores; as a floor it bounds every larger batch on fewer cores, and nothing else.
    beta = model.models["beta"]
    k = beta.lwr_X.index([2.0, round(math.log(2.0), 6)])
    y = [100.0 if j == k else 10.0 for j in range(len(beta.lwr_y))]
    lm = {f: LatencyModel(model.device, {"beta": replace(beta, lwr_y=y, lwr_floors=f)}, {}) for f in ((), (k,))}
    assert lm[()].run_ms("beta", 8, 50) < 100 <= lm[(k,)].run_ms("beta", 8, 50)
    assert lm[(k,)].run_ms("beta", 4, 50) == lm[()].run_ms("beta", 4, 50)
    assert lm[(k,)].run_ms("beta", 1, 25) == lm[()].run_ms("beta", 1, 25)


def test_wake_up_is_fitted_over_back_to_back_and_survives_a_round_trip(tmp_path):
    dataset = synthetic_dataset(tmp_path / "profile")
    dataset.append([], [], [WakePoint("alpha", g, p50) for g, p50 in ((0, 5.0), (20, 7.0), (200, 9.5))])
    said: list[str] = []
    model = fit_latency_model(load_dataset(tmp_path / "profile"), log=said.append)
    assert model.models["alpha"].wake == ((0, 0.0), (20, 2.0), (200, 4.5))
    assert model.models["beta"].wake == ()  # not measured: no wake-up, and the fit says so
    assert "  beta: no wake.csv row (the others have some): no wake-up fitted (profile again)" in said
    model.save(tmp_path / "lm.json")
    loaded = load_latency_model(tmp_path / "lm.json")
    assert [loaded.wake_ms("alpha", idle) for idle in (0, 10, 110, 1e9)] == pytest.approx([0, 1.0, 3.25, 4.5])
    assert loaded.wake_ms("beta", 1e9) == 0.0


def test_a_short_row_in_wake_csv_is_refused_with_the_file_and_line(tmp_path, capsys):
    synthetic_dataset(tmp_path / "profile")
    with open(tmp_path / "profile" / "wake.csv", "a") as fh:
        fh.write("alpha,0\n")
    assert main(["fit", str(tmp_path / "profile")]) == 2
    err = capsys.readouterr().err
    assert "wake.csv (line 2)" in err and "p50_ms" in err and "Traceback" not in err


def test_a_negative_latency_in_a_profile_is_refused_with_the_file_and_line(tmp_path, capsys):
    synthetic_dataset(tmp_path / "profile")
    path = tmp_path / "profile" / "measurements.csv"
    header, first, *rest = path.read_text().splitlines()
    cells = first.split(",")
    cells[header.split(",").index("p50_ms")] = "-5"
    path.write_text("\n".join([header, ",".join(cells), *rest]) + "\n")
    assert main(["fit", str(tmp_path / "profile")]) == 2
    err = capsys.readouterr().err
    assert "measurements.csv (line 2)" in err and "column 'p50_ms': '-5' is negative" in err


def test_fit_report_and_saved_model_round_trip(tmp_path, capsys):
    synthetic_dataset(tmp_path / "profile")
    assert main(["fit", str(tmp_path / "profile"), "--report"]) == 0
    out = capsys.readouterr().out
    assert "held-out solo" in out and "us/query" in out
    assert "measured again:      none" in out  # a synthetic profile measures nothing twice
    report = tmp_path / "profile" / "report"
    assert "measured no configuration twice" in (report / "report.md").read_text()
    for png in ("predicted_vs_observed", "errors", "surfaces", "inss_vs_gpulet"):
        assert (report / f"{png}.png").stat().st_size > 10_000
    model = load_latency_model(tmp_path / "profile" / "latency-model.json")
    assert model.t_inf("alpha", 4, 50) == pytest.approx(true_latency("alpha", 4, 50, ()), rel=0.05)
    written = (report / "report.md").stat().st_mtime_ns
    (tmp_path / "elsewhere").mkdir()
    assert main(["fit", str(tmp_path / "profile"), "--report", "-o", str(tmp_path / "elsewhere" / "lm.json")]) == 0
    assert (tmp_path / "elsewhere" / "report" / "report.md").is_file()  # beside the model: the profile's is left
    assert (report / "report.md").stat().st_mtime_ns == written


def test_too_few_points_and_corrupt_datasets_are_refused(tmp_path, capsys):
    dataset = synthetic_dataset(tmp_path / "p")
    path = tmp_path / "p" / "measurements.csv"
    rows = list(csv.DictReader(path.open()))
    keep = [r for r in rows if not (r["model"] == "beta" and r["kind"] == "solo" and r["split"] == "train")][:]
    keep += [r for r in rows if r["model"] == "beta" and r["kind"] == "solo" and r["split"] == "train"][:3]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, list(rows[0]))
        writer.writeheader()
        writer.writerows(keep)
    assert main(["fit", str(dataset.folder)]) == 2
    assert "'beta' has 3 solo training points" in capsys.readouterr().err

    text = path.read_text().splitlines()
    text[2] = text[2].replace(",solo,", ",solo,", 1).rsplit(",", 1)[0] + ",lots"
    path.write_text("\n".join(text) + "\n")
    assert main(["fit", str(dataset.folder)]) == 2
    err = capsys.readouterr().err
    assert "measurements.csv (line 3)" in err and "'lots' is not a float" in err

    (tmp_path / "p" / "metadata.json").write_text(json.dumps({"format": "something-else"}))
    assert main(["fit", str(dataset.folder)]) == 2
    assert "not a tritonctl profile" in capsys.readouterr().err
    assert main(["fit", str(tmp_path / "nowhere")]) == 2
    assert "no such profile folder" in capsys.readouterr().err


@pytest.fixture
def fitted(tmp_path) -> Path:
    synthetic_dataset(tmp_path / "profile")
    assert main(["fit", str(tmp_path / "profile")]) == 0
    return tmp_path / "profile" / "latency-model.json"


def test_plan_carries_predictions_from_the_latency_model(tmp_path, fitted, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha", rate=50, slo_ms=200), mlp_model("beta", rate=5)])
    assert main(["plan", str(cluster), "--policy", "spread", "--latency-model", str(fitted)]) == 0
    out = capsys.readouterr().out
    assert "ONNX file changed since it was profiled" in out  # the synthetic profile's hashes are zeros
    plan = load_plan(tmp_path / "plan.yaml").plan
    for model in plan.models:
        (placement,) = model.placements
        assert placement.share == 50 and placement.predicted is not None
        other = next(m for m in plan.models if m is not model)
        expected = true_latency(model.name, 1, 50, ((other.name, 50, 1),))
        assert placement.predicted.exec_ms == pytest.approx(expected, rel=0.08)
        assert placement.predicted.throughput_rps == pytest.approx(1000 / placement.predicted.exec_ms, rel=0.01)
        assert placement.predicted.latency_ms >= placement.predicted.exec_ms
    assert plan.models[0].memory_mb == 105  # the profiled footprint at batch 1


def test_latency_model_that_does_not_fit_the_cluster(tmp_path, fitted, capsys):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha"), mlp_model("gamma")])
    assert main(["plan", str(cluster), "--latency-model", str(fitted)]) == 2
    err = capsys.readouterr().err
    assert "models[1]" in err and "'gamma' is not in the latency model" in err

    gpu = write_cluster(tmp_path, [mlp_model("alpha")], devices=[{"kind": "gpu", "memory_mb": 4096}])
    assert main(["plan", str(gpu), "--latency-model", str(fitted)]) == 2
    assert "fitted for a cpu device" in capsys.readouterr().err

    fitted.write_text("{not json")
    assert main(["plan", str(cluster), "--latency-model", str(fitted)]) == 2
    out, err = capsys.readouterr()
    assert "not valid JSON" in err and "models of" not in out + err  # refused before any model is exported


def test_extrapolation_is_flagged(tmp_path, fitted):
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha"), mlp_model("beta")])
    assert main(["plan", str(cluster), "--latency-model", str(fitted)]) == 0
    plan = load_plan(tmp_path / "plan.yaml").plan
    squeezed = [
        m.model_copy(update={"placements": [m.placements[0].model_copy(update={"share": 10})]}) for m in plan.models
    ]
    messages: list[str] = []
    predicted = predict(squeezed, load_latency_model(fitted), messages.append)
    assert len(messages) == 2 and "share 10 lies outside the profiled range" in messages[0]
    lm = load_latency_model(fitted)
    # Outside the profiled box latency is scaled from its edge: fewer cores, more samples, slower.
    assert lm.t_inf("alpha", 1, 10) == pytest.approx(true_latency("alpha", 1, 10, ()), rel=0.1)
    assert lm.t_inf("alpha", 64, 100) > 1.9 * lm.t_inf("alpha", 32, 100)
    assert all(m.placements[0].predicted.exec_ms > lm.t_inf(m.name, 1, 25) for m in predicted)


def test_an_mlp_predictor_is_fitted_saved_and_used_by_t_inf_and_the_report_compares_it(tmp_path, capsys, monkeypatch):
    """SYNTHETIC profile: the MLP learns the synthetic interference and rides in the latency-model file (one
    penalty and one network, for time: the search and the averaging are the same code)."""
    monkeypatch.setattr(mlp, "PENALTIES", (0.1,))
    monkeypatch.setattr(mlp, "SEEDS", 1)
    synthetic_dataset(tmp_path / "profile", extra_coloc=30)
    out = tmp_path / "mlp.json"
    assert main(["fit", str(tmp_path / "profile"), "--predictor", "mlp", "-o", str(out)]) == 0
    assert "MLP predictor" in capsys.readouterr().out
    model = load_latency_model(out)
    assert model.mlp is not None and set(model.mlp.names) == {"alpha", "beta"}
    beside = (("beta", 50, 4),)
    by_mlp, by_inss = model.t_inf("alpha", 4, 50, beside), model.without_mlp().t_inf("alpha", 4, 50, beside)
    assert by_mlp != by_inss and by_mlp == pytest.approx(true_latency("alpha", 4, 50, beside), rel=0.15)
    assert model.with_margin(0.1).t_inf("alpha", 4, 50, beside) == pytest.approx(1.1 * by_mlp)

    assert main(["report", str(tmp_path / "profile"), "--model", str(out), "-o", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "| MLP (Abacus-style) |" in text and "MLP: the model file's." in text
    assert "Learning curve" in text and (tmp_path / "report" / "learning_curve.png").stat().st_size > 10_000
    curve = [line for line in text.splitlines() if line[:3] in {f"| {d}" for d in "123456789"}]
    assert len(curve) >= 4  # four parts of the co-located configurations, each with its errors
    assert "n/a" in curve[0] and "n/a" not in curve[-1]  # the MLP is refused on the smallest part, fitted on all


def test_too_few_co_located_rows_for_the_mlp_says_how_many_it_has_and_needs(tmp_path, capsys):
    dataset = synthetic_dataset(tmp_path / "p")  # the grid's co-locations only: 4 training rows
    assert main(["fit", str(dataset.folder), "--predictor", "mlp"]) == 2
    err = capsys.readouterr().err
    assert "needs at least 20 co-located training rows and the profile has 4" in err and "measurements.csv" in err

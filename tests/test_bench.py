"""`tritonctl bench`: every policy planned, timed and simulated the same way (SYNTHETIC latency model)."""

from __future__ import annotations

import pytest

from conftest import make_mlp, mlp_model, write_cluster
from synthetic import synthetic_dataset
from tritonctl.cli import main
from tritonctl.export import materialize
from tritonctl.latency.ablation import linear_running_time, no_interference, no_wake
from tritonctl.latency.dataset import WakePoint
from tritonctl.latency.model import load_latency_model
from tritonctl.latency.queueing import in_slo, task_latency, without_queueing
from tritonctl.planning.compare import run_policies
from tritonctl.planning.plan import load_plan
from tritonctl.planning.policies import POLICIES
from tritonctl.spec import load_cluster


def test_bench_compares_policies_and_writes_table_plans_and_plot(tmp_path, capsys):
    synthetic_dataset(tmp_path / "profile")
    assert main(["fit", str(tmp_path / "profile")]) == 0
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha", rate=150, slo_ms=150), mlp_model("beta", rate=40)])
    out = tmp_path / "bench"
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                str(cluster),
                "--latency-model",
                str(tmp_path / "profile" / "latency-model.json"),
                "--duration",
                "20",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in table.splitlines()
        if line.startswith("| ") and "---" not in line and "policy" not in line
    }
    print(table)
    assert set(rows) == set(POLICIES) - {"inss"}  # no policy trained for this cluster: left out, with a note
    assert "inss left out: no trained policy" in table
    assert all(r[1] == "0" for r in rows.values())  # light load: every policy serves both models
    capacity = {p: float(r[3]) for p, r in rows.items()}
    # optimal is exact on the grid of split shares; the search may also let a device's models take turns
    assert capacity["search"] >= 0.95 * capacity["optimal"] and capacity["search"] >= capacity["bda"]
    assert capacity["bda"] >= capacity["spread"]
    assert all(0 < float(r[4].rstrip("%")) <= 100 for r in rows.values())  # share of the upper bound
    assert "Best tritonctl policy: " in table and "- vs gpulet: " in table
    for policy in rows:
        assert (out / f"plan-{policy}.yaml").is_file()
    assert (out / "bench.md").read_text().count("|") > 20 and (out / "bench.png").stat().st_size > 5_000


def test_bench_exits_1_where_no_policy_plans_and_counts_nothing_late_where_nothing_arrives(tmp_path, capsys):
    synthetic_dataset(tmp_path / "profile")
    assert main(["fit", str(tmp_path / "profile")]) == 0
    lm = str(tmp_path / "profile" / "latency-model.json")
    make_mlp(tmp_path / "mlp.onnx")
    argv = ["bench", "--latency-model", lm, "--policies", "search", "spread", "--duration", "5"]
    tight = write_cluster(tmp_path, [mlp_model("alpha", slo_ms=0.01)])  # under any batch's time
    capsys.readouterr()
    assert main([*argv, str(tight), "-o", str(tmp_path / "tight")]) == 1
    out = capsys.readouterr().out
    assert "No tritonctl policy produced a plan." in out and "search | failed" in out.replace("  ", " ")
    idle = write_cluster(tmp_path, [mlp_model("alpha", rate=0), mlp_model("beta", rate=0)])
    assert main([*argv, str(idle), "-o", str(tmp_path / "idle")]) == 0
    out = capsys.readouterr().out
    (search,) = [line.split("|") for line in out.splitlines() if line.startswith("| search ")]
    assert [cell.strip() for cell in search[11:13]] == ["0.00%", "0.00%"]  # no request arrived: none late or dropped
    assert "- search: \n" not in out + "\n"  # a margin line only where there is something to compare with


def test_bench_plans_every_policy_with_the_batching_asked_for(tmp_path, capsys):
    synthetic_dataset(tmp_path / "profile")
    assert main(["fit", str(tmp_path / "profile")]) == 0
    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha", rate=150, slo_ms=150), mlp_model("beta", rate=40)])
    lm = str(tmp_path / "profile" / "latency-model.json")
    argv = ["bench", str(cluster), "--latency-model", lm, "--policies", "search", "bda", "--duration", "5"]
    assert main([*argv, "--batching", "eager", "-o", str(tmp_path / "eager")]) == 0
    assert {load_plan(tmp_path / "eager" / f"plan-{p}.yaml").plan.batching for p in ("search", "bda")} == {"eager"}
    assert "Planned with `--batching eager`" in (tmp_path / "eager" / "bench.md").read_text()
    capsys.readouterr()
    assert main([*argv, "--batching", "eager", "--ablate", "-o", str(tmp_path / "ablate")]) == 2
    assert "--ablate plans with fill batching" in capsys.readouterr().err


def test_a_latency_margin_plans_for_slower_batches_and_the_simulator_runs_the_exact_model(tmp_path):
    synthetic_dataset(tmp_path / "profile")
    assert main(["fit", str(tmp_path / "profile")]) == 0
    lm = load_latency_model(tmp_path / "profile" / "latency-model.json")
    make_mlp(tmp_path / "mlp.onnx")
    # spread gives each model half the device at batch 1; alpha's SLO is 15% above its batch time there, so on
    # the exact model nearly every request of its light load makes it, and none would 30% slower
    t = lm.t_inf("alpha", 1, 50, (("beta", 50, 1),))
    models = [mlp_model("alpha", rate=2, slo_ms=round(1.15 * t, 3)), mlp_model("beta", rate=2, slo_ms=1000)]
    cluster = load_cluster(write_cluster(tmp_path, models))
    artifacts = materialize(cluster, log=lambda _: None)
    exact, wary = (
        run_policies(cluster, artifacts, lm, ["spread"], tmp_path / f"m{m}", 100, margin=m)[0] for m in (0.0, 0.3)
    )
    assert wary.capacity_rps == pytest.approx(exact.capacity_rps / 1.3, rel=1e-3)  # same plan, predicted slower
    assert wary.predicted_misses == 1  # alpha, 30% slower, misses its SLO
    assert wary.goodput_rps == pytest.approx(exact.goodput_rps) and exact.goodput_rps > 0.9 * 4  # simulated exact


def test_ablations_switch_their_part_off_and_bench_simulates_each_plan_on_the_whole_model(tmp_path, capsys):
    """SYNTHETIC profile: each ablation really lacks its part, and `bench --ablate` tables all four plans."""
    dataset = synthetic_dataset(tmp_path / "profile")
    dataset.append([], [], [WakePoint("alpha", g, p50) for g, p50 in ((0, 5.0), (200, 9.5))])
    assert main(["fit", str(tmp_path / "profile")]) == 0
    lm = load_latency_model(tmp_path / "profile" / "latency-model.json")
    beside = (("beta", 50, 4),)
    assert lm.t_inf("alpha", 4, 50, beside) > lm.t_inf("alpha", 4, 50)  # the synthetic profile interferes
    alone = no_interference(lm)
    assert alone.t_inf("alpha", 4, 50, beside) == pytest.approx(alone.t_inf("alpha", 4, 50))
    assert lm.models["alpha"].wake and no_wake(lm).wake_ms("alpha", 1e9) == 0.0 < lm.wake_ms("alpha", 1e9)
    linear = linear_running_time(lm)
    runs = [(b, s) for b in (1, 4, 16) for s in (20, 50, 100)]
    assert any(linear.run_ms("alpha", b, s) != pytest.approx(lm.run_ms("alpha", b, s), rel=1e-3) for b, s in runs)

    make_mlp(tmp_path / "mlp.onnx")
    cluster = write_cluster(tmp_path, [mlp_model("alpha", rate=150, slo_ms=150), mlp_model("beta", rate=40)])
    out = tmp_path / "ablate"
    capsys.readouterr()
    model = str(tmp_path / "profile" / "latency-model.json")
    assert main(["bench", str(cluster), "--latency-model", model, "--ablate", "--duration", "10", "-o", str(out)]) == 0
    text = (out / "ablation.md").read_text()
    for label in ("search, whole model", "search, no interference (InSS-ni)", "search, no wake-up term"):
        assert f"| {label} |" in text
    assert "| search, no queueing model |" in text
    assert text.count("against the whole model") == 4 and len(list(out.glob("plan-search-*.yaml"))) == 5
    with without_queueing():  # the planner's view of a task without the queueing model: its batch alone
        assert task_latency(100, 4, 10.0).p99_ms == 10.0 and in_slo(100, 4, 10.0, 12) == 1.0
    assert task_latency(100, 4, 10.0).p99_ms > 10.0  # and with it: waiting for the batch to fill

"""BDA (InSS Algorithm 1) and the `bda` policy, on a latency model fitted to SYNTHETIC data."""

from __future__ import annotations

import pytest

from synthetic import synthetic_dataset
from tritonctl.errors import TritonctlError
from tritonctl.latency.fit import fit_latency_model
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError
from tritonctl.planning.policies.bda import (
    MAX_BATCH,
    batch_checks,
    bda,
    bda_policy,
    broken_constraint,
    memory_at,
    queue_delay_us,
)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return fit_latency_model(synthetic_dataset(tmp_path_factory.mktemp("p") / "profile"), log=lambda _: None)


def cpu(memory_mb: int = 4096) -> list[Device]:
    return [Device(id="cpu0", kind="cpu", index=0, memory_mb=memory_mb, units=100, cores=2.0)]


PLACEMENT = {"alpha": Choice("cpu0", 50), "beta": Choice("cpu0", 50)}


def brute_force(name, demands, lm, devices, batches):
    """The largest batch meeting every constraint, by trying them all."""
    ok = [
        b
        for b in range(1, MAX_BATCH + 1)
        if broken_constraint(name, b, PLACEMENT, {d.name: d for d in demands}, batches, {d.id: d for d in devices}, lm)
        is None
    ]
    return max(ok) if ok else None


def test_bda_finds_the_largest_feasible_batch(lm):
    demands = [Demand("alpha", 150, 200, 100), Demand("beta", 400, 60, 100)]
    decision = bda(PLACEMENT, demands, cpu(), lm)
    assert decision.ok and decision.infeasible == {}
    assert decision.batches["alpha"] > 1  # 200/s cannot be served one request at a time
    start = {"alpha": 1, "beta": 1}
    assert decision.batches["alpha"] == brute_force("alpha", demands, lm, cpu(), start)
    assert decision.batches["beta"] == brute_force(
        "beta", demands, lm, cpu(), {**start, "alpha": decision.batches["alpha"]}
    )


def test_bda_reports_which_constraint_fails(lm):
    assert bda(PLACEMENT, [Demand("alpha", 0.5, 1, 100), Demand("beta", 400, 1, 100)], cpu(), lm).infeasible == {
        "alpha": "slo"
    }
    too_fast = bda(PLACEMENT, [Demand("alpha", 10_000, 100_000, 100), Demand("beta", 400, 1, 100)], cpu(), lm)
    assert not too_fast.ok and too_fast.infeasible == {"alpha": "rate"}
    tight = bda(PLACEMENT, [Demand("alpha", 400, 5, 100), Demand("beta", 400, 5, 100)], cpu(memory_mb=150), lm)
    assert tight.infeasible == {"alpha": "memory", "beta": "memory"}  # 2 x 105 MB at batch 1 > 150 MB


def test_bda_policy_needs_a_latency_model_and_sets_queue_delays(lm):
    with pytest.raises(PlacementError, match="needs a fitted latency model"):
        bda_policy([Demand("alpha", 150, 200, 100)], cpu(), None)
    choices = bda_policy([Demand("alpha", 150, 200, 100), Demand("beta", 400, 60, 100)], cpu(), lm)
    (alpha,) = choices["alpha"]
    assert alpha.batch > 1 and 0 < alpha.queue_delay_us <= 1000 * 150
    with pytest.raises(PlacementError, match="alpha within its SLO"):
        bda_policy([Demand("alpha", 0.5, 1, 100), Demand("beta", 400, 1, 100)], cpu(), lm)


def test_queue_delay_fills_the_batch_within_the_slack():
    assert queue_delay_us(1, 100, 50, 10) == 0
    assert queue_delay_us(4, 100, 500, 10) == 30_000  # three more arrivals at 100/s
    assert queue_delay_us(4, 100, 25, 10) == 15_000  # but no more than the SLO leaves


def test_a_latency_margin_leaves_headroom_for_slower_batches(lm):
    slow = lm.with_margin(0.2)  # what the batches really take, in this test
    assert slow.t_inf("alpha", 4, 50, (("beta", 50, 4),)) == pytest.approx(
        1.2 * lm.t_inf("alpha", 4, 50, (("beta", 50, 4),))
    )
    demands = [Demand("alpha", 150, 200, 100), Demand("beta", 400, 60, 100)]
    by_name, devices = {d.name: d for d in demands}, {d.id: d for d in cpu()}
    exact = bda(PLACEMENT, demands, cpu(), lm).batches
    planned = bda(PLACEMENT, demands, cpu(), lm.with_margin(0.2)).batches
    assert broken_constraint("alpha", exact["alpha"], PLACEMENT, by_name, exact, devices, slow) == "slo"
    assert broken_constraint("alpha", planned["alpha"], PLACEMENT, by_name, planned, devices, slow) is None
    assert lm.t_inf("alpha", 4, 50) == pytest.approx(slow.t_inf("alpha", 4, 50) / 1.2)  # the original is untouched
    with pytest.raises(TritonctlError, match="margin"):
        lm.with_margin(1.5)


def test_batch_times_kept_for_a_layout_serve_every_margin_as_computed_for_it(lm):
    """`t_infs` keeps a layout's batch times before the margin, shared by the model's copies with a margin: each
    copy still answers what it predicts batch by batch."""
    beside = (("beta", 40, 4),)
    lm.t_infs("alpha", 60, beside)  # kept, without a margin
    for model in (lm, lm.with_margin(0.1), lm.with_margin(0.25)):
        scan = model.t_infs("alpha", 60, beside).tolist()
        assert scan == [model.t_inf("alpha", b, 60, beside) for b in range(1, MAX_BATCH + 1)]
    assert lm.with_margin(0.1).t_infs("alpha", 60, beside)[0] > lm.t_infs("alpha", 60, beside)[0]


def test_a_scan_over_every_batch_size_says_what_each_single_check_says(lm):
    """`batch_checks` reads every batch size at once (`t_infs`, `p99s`); the answers must be the one-by-one ones,
    nearly idle, overloaded and out-of-memory batches included."""
    seen = set()
    for rate in (0.5, 40, 300, 3000):
        demands = {"alpha": Demand("alpha", 150, rate, 100), "beta": Demand("beta", 400, 40, 100)}
        batches = {"alpha": 1, "beta": 4}
        full = memory_at(demands["alpha"], 16, lm) + memory_at(demands["beta"], 4, lm)
        devices = {"cpu0": cpu(int(full))[0]}  # batches of alpha beyond 16 do not fit
        for share in (5, 30, 50, 95):
            placement = {"alpha": Choice("cpu0", share), "beta": Choice("cpu0", 100 - share)}
            scan = list(batch_checks("alpha", placement, demands, batches, devices, lm))
            one_by_one = [
                next(batch_checks("alpha", placement, demands, batches, devices, lm, (b,)))
                for b in range(1, MAX_BATCH + 1)
            ]
            assert scan == one_by_one
            seen |= {why for _, why, _ in scan}
    assert seen == {None, "memory", "slo", "rate"}


def test_kept_scans_give_the_same_batches_and_serve_a_layout_seen_again(lm, monkeypatch):
    """BDA reads one scan over every batch size per model; kept in `scans` (as search's Judge keeps them) a
    layout seen again costs no prediction, and the batches are the ones BDA finds without them."""
    demands = [Demand("alpha", 150, 120, 100), Demand("beta", 400, 40, 100)]
    placement = {"alpha": Choice("cpu0", 40, 2), "beta": Choice("cpu0", 60, 8)}
    scans: dict = {}
    assert bda(placement, demands, cpu(), lm, scans) == bda(placement, demands, cpu(), lm)
    assert len(scans) == 2
    calls = []
    monkeypatch.setattr(lm, "t_infs", lambda *a: calls.append(a))
    other_batches = {"alpha": Choice("cpu0", 40, 1), "beta": Choice("cpu0", 60, 1)}  # the InSS form reads shares
    assert bda(other_batches, demands, cpu(), lm, scans) == bda(placement, demands, cpu(), lm, scans)
    assert calls == []

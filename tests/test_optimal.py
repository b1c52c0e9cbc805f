"""The `optimal` policy (an integer program over search's layouts), on a latency model fitted to SYNTHETIC data."""

from __future__ import annotations

import importlib
import itertools
import time

import numpy as np
import pytest

from synthetic import synthetic_dataset
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.queueing import goodput, task_latency
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Demand, PlacementError, PolicyLimit
from tritonctl.planning.policies.search import TURNS, Judge, Spot, max_copies

solver = importlib.import_module("tritonctl.planning.policies.optimal")  # the package exports the function


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return fit_latency_model(synthetic_dataset(tmp_path_factory.mktemp("p") / "profile"), log=lambda _: None)


def cpu(units: int = 100) -> Device:
    return Device(id="cpu0", kind="cpu", index=0, memory_mb=4096, units=units, cores=2.0)


def brute_force(demands: list[Demand], device: Device, lm) -> float:
    """The best goodput on one device by trying every layout, as search judges it: each subset split on the 5-unit
    grid (a model BDA serves counts its rate, one it does not what its best batch serves in part), or taking turns
    with every number of copies."""
    judge, best = Judge(demands, [device], lm), 0.0
    floor = {d.name: lm.models[d.name].share_range[0] for d in demands}
    for size in range(1, len(demands) + 1):
        for group in itertools.combinations(demands, size):
            levels = [range(max(5, -(-floor[d.name] // 5) * 5), device.units + 1, 5) for d in group]
            layouts = [
                [Spot(device.id, s) for s in shares]
                for shares in itertools.product(*levels)
                if sum(shares) <= device.units
            ]
            layouts += [
                [Spot(device.id, TURNS, c) for c in copies]
                for copies in itertools.product(range(1, max_copies(device) + 1), repeat=size)
            ]
            for spots in layouts:
                served = judge({d.name: spot for d, spot in zip(group, spots, strict=True)}).served
                best = max(best, sum(served.values()))
    return best


@pytest.mark.parametrize("from_search", [True, False])
@pytest.mark.parametrize(
    "demands, whole",
    [
        ([Demand("alpha", 150, 150, 100), Demand("beta", 400, 50, 100)], True),  # both fit: split or turns
        ([Demand("alpha", 40, 250, 100), Demand("beta", 120, 120, 100)], False),  # tight: alpha served in part
    ],
)
def test_the_optimum_is_what_trying_every_layout_finds_and_it_says_how_close_its_bound_is(
    lm, demands, whole, from_search
):
    lines = []
    outcome = solver.solve(demands, [cpu()], lm, from_search=from_search)  # the program alone, or from search's plan
    assert outcome.goodput == pytest.approx(brute_force(demands, cpu(), lm), rel=1e-6)
    if whole:  # every model served whole: the optimum, proved
        assert outcome.gap == 0 and outcome.goodput == pytest.approx(sum(d.rate for d in demands))
        assert outcome.searched == from_search  # search's plan serves every rate: no program needed
        assert ("optimal, search's plan in" if from_search else "optimal in") in outcome.summary()
    else:  # served in part: credited in steps of its rate, rounded up, so the bound is within two steps of it
        assert 0 < outcome.bound - outcome.goodput <= 2 * solver.PART_STEP * sum(d.rate for d in demands)
        assert "best found, gap" in outcome.summary()
    choices = solver.optimal(demands, [cpu()], lm, log=lines.append)
    assert set(choices) == {d.name for d in demands}  # both served, each on the one device
    assert all(c.device == "cpu0" for cs in choices.values() for c in cs)
    assert len(lines) == 1 and lines[0].startswith(f"optimal policy: goodput {outcome.goodput:.2f} requests/s")


def test_credit_levels_bound_what_a_model_served_in_part_serves_at_every_batch_time(lm):
    demand = Demand("alpha", 40, 250, 100)
    for batch in (1, 4, 16):
        levels = solver.part_levels(demand, batch, 5.0)
        assert levels and levels[-1][0] == demand.slo_ms  # up to the SLO, beyond which nothing is served in time
        start = 5.0
        for limit, credit in levels:
            for t in np.linspace(start, limit, 7)[1:]:
                assert goodput(demand.rate, batch, t, demand.slo_ms) <= credit + 1e-9
            start = limit


def test_the_optimum_knowing_each_models_error_plans_each_as_with_its_own_margin(lm):
    demands = [Demand("alpha", 40, 250, 100), Demand("beta", 120, 120, 100)]  # tight: not every layout serves both
    knowing = lm.with_errors({"alpha": 0.3})  # beta as fitted
    for demand, same in ((demands[0], lm.with_margin(0.3)), (demands[1], lm)):
        options = solver.split_options(demand, cpu(), knowing, lambda _: 0.5, 1)
        assert options and options == solver.split_options(demand, cpu(), same, lambda _: 0.5, 1)
    assert solver.split_options(demands[0], cpu(), knowing, lambda _: 0.5, 1) != solver.split_options(
        demands[0], cpu(), lm, lambda _: 0.5, 1
    )
    assert solver.solve(demands, [cpu()], knowing).goodput < solver.solve(demands, [cpu()], lm).goodput


def test_on_two_devices_it_serves_what_one_cannot_and_keeps_each_within_its_units(lm):
    demands = [Demand("alpha", 40, 250, 100), Demand("beta", 120, 120, 100)]
    one = solver.solve(demands, [cpu()], lm, from_search=False)
    devices = [cpu(), Device(id="cpu1", kind="cpu", index=1, memory_mb=4096, units=100, cores=2.0)]
    two = solver.solve(demands, devices, lm, from_search=False)
    assert two.goodput >= one.goodput and two.goodput == pytest.approx(sum(d.rate for d in demands), rel=1e-3)
    assert {c.device for cs in two.choices.values() for c in cs} <= {"cpu0", "cpu1"}
    for x in devices:
        split = [c.share for cs in two.choices.values() for c in cs if c.device == x.id and not c.turns]
        assert sum(split) <= x.units


def test_a_model_no_device_serves_whole_is_served_in_part_on_one_and_split_into_equal_replicas_on_two(lm):
    demand = [Demand("alpha", 40, 800, 100)]  # beyond what one device serves within 40 ms
    one = solver.solve(demand, [cpu()], lm, from_search=False)
    assert 0 < one.goodput < 800 and one.goodput == pytest.approx(brute_force(demand, cpu(), lm), rel=1e-6)
    devices = [cpu(), Device(id="cpu1", kind="cpu", index=1, memory_mb=4096, units=100, cores=2.0)]
    two = solver.solve(demand, devices, lm, from_search=False)
    assert two.gap == 0 and two.goodput == pytest.approx(800)
    replicas = two.choices["alpha"]
    assert sorted(c.device for c in replicas) == ["cpu0", "cpu1"] and {c.weight for c in replicas} == {1.0}
    for c in replicas:  # each holds its half of the rate alone on its device (eq. 2's p99 within the SLO)
        assert task_latency(400, c.batch, lm.t_inf("alpha", c.batch, c.share)).p99_ms <= 40


def test_a_model_nothing_serves_in_time_is_left_out(lm):
    demand = [Demand("alpha", 1, 100, 100)]  # no batch runs within 1 ms
    assert solver.solve(demand, [cpu()], lm, from_search=False).choices == {}
    with pytest.raises(PlacementError, match="leaves alpha unserved"):
        solver.optimal(demand, [cpu()], lm, log=lambda _: None)


def test_a_time_limit_reports_the_gap_instead_of_optimal():
    stopped = solver.Outcome(
        {}, goodput=90.0, bound=100.0, status="Time limit reached", seconds=300.0, cuts=0, searched=False
    )
    assert stopped.gap == pytest.approx(0.1)
    assert "best found, gap 10.00% (Time limit reached)" in stopped.summary() and ": optimal" not in stopped.summary()
    # a best plan that leaves a model out is not called the optimum
    with pytest.raises(PlacementError, match=r"the best plan found \(gap 10.00%\) leaves alpha unserved"):
        raise stopped.leaving_out(["alpha"])


def chosen_alone(program, forced) -> bool:
    """Whether the program still has a solution with every option of `forced` chosen."""
    binaries = dict(program.options)
    xs = [binaries[o] for o in forced]
    for x in xs:
        program.h.changeColBounds(x.index, 1.0, 1.0)
    status = program.solve(time.monotonic() + 30)[0]
    for x in xs:
        program.h.changeColBounds(x.index, 0.0, 1.0)
    return status == "Optimal"


def test_an_option_late_beside_its_co_runners_is_cut_off_beside_them_at_any_batch_of_theirs(lm):
    demands = [Demand("alpha", 150, 150, 100), Demand("beta", 400, 50, 100)]
    program = solver._Program(demands, [cpu()], lm)
    alpha = [o for o, _ in program.options if o.model == "alpha" and o.whole]
    beta = [o for o, _ in program.options if o.model == "beta"]
    a, b, other_b = next(  # alpha beside beta at one share with two batches, each pair a solution
        (a, b, c)
        for a in alpha
        for b, c in itertools.combinations(beta, 2)
        if b.share == c.share
        and b.batch != c.batch
        and a.share + b.share <= 100
        and all(chosen_alone(program, [a, x]) for x in (b, c))
    )
    late = solver._Program(demands, [cpu()], lm)
    slower = a.limit_ms * 1.001  # alpha's batch time beside beta: it breaks its limit, beta's batch does not move it
    late.cut([a, b], [(a, slower)])
    assert not chosen_alone(late, [a, b]) and not chosen_alone(late, [a, other_b])
    looser = [o for o, _ in program.options if (o.model, o.share, o.batch) == ("alpha", a.share, a.batch)]
    looser = [o for o in looser if o.limit_ms >= slower]  # alpha served in part at the same share and batch
    assert looser and all(chosen_alone(late, [o, b]) for o in looser)  # a credit that time earns stays


def test_too_large_or_without_a_latency_model_it_says_so(lm):
    many_cores = Device(id="cpu0", kind="cpu", index=0, memory_mb=1 << 20, units=100, cores=8.0)
    with pytest.raises(PolicyLimit, match="too large for the optimal policy"):
        six = [Demand(f"m{i}", 100, 1, 10) for i in range(6)]
        solver.solve(six, [many_cores], lm, from_search=False)  # 9^6 sets taking turns: refused before any solve
    with pytest.raises(PlacementError, match="needs a fitted latency model"):
        solver.optimal([Demand("alpha", 150, 150, 100)], [cpu()], None)

"""Judging plans by goodput: the queueing model's share within the SLO, partial service instead of shedding,
devices taken in turns inside the search, and the InSS six-model setup against its baselines (SCALED model)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_simulate import plan_of

from synthetic import synthetic_dataset
from tritonctl.latency import queueing
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.model import load_latency_model
from tritonctl.latency.queueing import goodput, in_slo, sample_latencies
from tritonctl.planning.plan import Device, Placement, Plan, PlannedModel, RuntimeSettings, Tensor
from tritonctl.planning.planner import demands_of, devices_of, place
from tritonctl.planning.policies import POLICIES, Choice, Demand
from tritonctl.planning.policies.bda import bda
from tritonctl.planning.policies.search import STEP, search
from tritonctl.planning.policies.timesharing import time_sharing
from tritonctl.planning.simulate import simulate
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return fit_latency_model(synthetic_dataset(tmp_path_factory.mktemp("p") / "profile"), log=lambda _: None)


def cpus(n: int) -> list[Device]:
    return [Device(id=f"cpu{i}", kind="cpu", index=i, memory_mb=4096, units=100, cores=2.0) for i in range(n)]


@pytest.mark.parametrize(("rate", "batch", "slo"), [(60, 4, 80), (90, 8, 150), (30, 1, 40), (95, 4, 60)])
def test_in_slo_matches_the_sampled_distribution(rate, batch, slo):
    t = 10.0 * batch / 1.2  # batch time: load rate * t / b between 0.25 and 0.8
    sampled = float((sample_latencies(rate, batch, t) <= slo).mean())
    assert in_slo(rate, batch, t, slo) == pytest.approx(sampled, abs=0.03)


def test_in_slo_reads_the_quantile_ladder_as_np_interp_reads_it():
    """`in_slo` reads its table in Python floats, a few rungs of the ladder; the answers must be np.interp's on
    the whole ladder, to the last bit, SLOs that fall exactly on a rung included."""
    rng = np.random.default_rng(3)
    loads = queueing._LOADS
    for _ in range(1500):
        batch, t, load = int(rng.integers(1, 33)), float(rng.uniform(1, 200)), float(rng.uniform(0.002, 0.99))
        rate = load * 1000 * batch / t
        rho = rate * t / (1000 * batch)
        i = min(int(np.searchsorted(loads, rho, side="right")) - 1, len(loads) - 2)
        w, quantiles = (rho - loads[i]) / (loads[i + 1] - loads[i]), queueing._table(batch)[2]
        ladder = ((1 - w) * quantiles[i] + w * quantiles[i + 1]) * (t / rho)
        for slo in (float(rng.uniform(0.5, 3) * ladder[-1]), float(ladder[int(rng.integers(0, len(ladder)))]), t):
            assert in_slo(rate, batch, t, slo) == float(np.interp(slo, ladder, queueing.LEVELS, left=0.0, right=1.0))


def test_a_scan_read_entry_by_entry_gives_p99s_to_the_last_bit():
    """`P99Scan` computes a scan's p99 per batch size when first read (`p99_of`, Python floats); every entry must
    be `p99s`'s, loads nearly idle, inside the table, exactly at its end, nearly saturated and overloaded included,
    with the queueing model and without it."""
    rng = np.random.default_rng(5)
    loads = queueing._LOADS
    rates = [0.0, 1e-4, float(loads[-1]) * 1000 / 7.5, *rng.uniform(0.5, 4000, 60).tolist()]
    for rate in rates:
        times = np.sort(rng.uniform(0.5, 400, 32)) if rate != rates[2] else np.full(32, 7.5)
        for switch in (contextlib.nullcontext, queueing.without_queueing):
            with switch():
                p99, _ = queueing.p99s(rate, times)
                lazy = queueing.P99Scan(rate, times.tolist())
                assert [lazy[k] for k in (31, 0, 7)] == [p99[31], p99[0], p99[7]]
                assert list(lazy) == p99.tolist()
    assert queueing.P99Scan(rates[2], [7.5] * 32)[0] == queueing.p99s(rates[2], np.full(32, 7.5))[0][0] < math.inf


def test_goodput_below_and_above_saturation():
    assert goodput(50, 4, 20, 1000) == pytest.approx(50, rel=1e-3)  # light load, loose SLO: everything in time
    assert goodput(50, 4, 20, 15) == 0  # a batch takes longer than the SLO
    # overloaded (200 > 4 / 20 ms = 200/s... at 300/s): full batches back to back, the rest rejected
    assert goodput(300, 4, 20, 1000) == pytest.approx(0.95 * 200)
    assert goodput(300, 4, 20, 30) == pytest.approx(0.95 * 200 * 0.5)  # a request may wait half a batch


def test_search_serves_an_overloaded_model_in_part_and_says_so(lm):
    """More load than the device carries: the search keeps both models (the planner used to shed the heavier
    one) and the partial one's placement says how much of it is predicted within the SLO."""
    demands = [Demand("alpha", 150, 2000, 100), Demand("beta", 400, 40, 100)]
    choices, shed = place("search", POLICIES["search"].fn, demands, cpus(1), lm)
    assert shed == {} and set(choices) == {"alpha", "beta"}
    (alpha,) = choices["alpha"]
    t = lm.t_inf("alpha", alpha.batch, alpha.share, (("beta", choices["beta"][0].share, choices["beta"][0].batch),))
    assert 0 < goodput(2000, alpha.batch, t, 150) < 2000  # partial, not dropped


def test_bda_policy_still_sheds_what_algorithm_1_cannot_serve(lm):
    demands = [Demand("alpha", 150, 2000, 100), Demand("beta", 400, 40, 100)]
    choices, shed = place("bda", POLICIES["bda"].fn, demands, cpus(1), lm)
    assert set(shed) == {"alpha"} and set(choices) == {"beta"}


def test_search_finds_time_sharings_plan_when_only_turns_serve(lm):
    """On a device whose share buys few distinct speeds (this latency model: a quota buys one thread up to 1.4
    cores) no split of shares lets BDA serve both models, while taking turns with the whole device does: the
    search returns time-sharing's plan, taken in turns. (A GPU: on a CPU the instances taking turns run at once,
    a thread each, and the whole device buys nothing more.)"""
    demands = [Demand("alpha", 150, 300, 100), Demand("beta", 400, 80, 100)]
    devices = [Device(id="cpu0", kind="gpu", index=0, memory_mb=4096, units=100)]
    for share in range(STEP, 100, STEP):
        split = {"alpha": Choice("cpu0", share), "beta": Choice("cpu0", 100 - share)}
        assert bda(split, demands, devices, lm).infeasible  # some model misses its rate or SLO
    shared = time_sharing(demands, devices, lm)
    out = search(demands, devices, lm)
    assert {n for n, cs in out.items() if any(c.turns for c in cs)} == {"alpha", "beta"}
    assert out == {n: [replace(c, turns=True) for c in cs] for n, cs in shared.items()}


def test_simulated_arrivals_do_not_depend_on_the_order_of_models(lm):
    """Common random numbers: two plans of one cluster see the same requests, so their goodputs compare."""
    alpha, beta = ("alpha", 20, 1e6, 50, 1, 0), ("beta", 20, 1e6, 50, 1, 0)
    a = {m.model: m.arrived for m in simulate(plan_of(alpha, beta), lm, 30).models}
    b = {m.model: m.arrived for m in simulate(plan_of(beta, alpha), lm, 30).models}
    assert a == b


def test_inss_six_models_search_ahead_of_every_baseline_within_one_percent():
    """The InSS six-model setup (latency model SCALED from the CPU profile): the search serves all six models,
    ahead of spread and level with time-sharing (within 0.5%) by simulated goodput, violations < 1%."""
    slm = load_latency_model(REPO / "profiles/inss-scaled/latency-model.json")
    cluster = load_cluster(REPO / "examples/inss-scaled/six-4.yaml")
    devices = devices_of(cluster)
    demands = demands_of(cluster, {}, slm)
    offered = sum(d.rate for d in demands)
    result = {}
    for policy in ("search", "spread", "time-sharing"):
        choices, shed = place(policy, POLICIES[policy].fn, demands, devices, slm)
        assert shed == {}
        tensor = [Tensor(name="x", dtype="float32", shape=[1])]
        turns = sorted({c.device for cs in choices.values() for c in cs if c.turns})
        plan = Plan(
            cluster="six",
            cluster_file="c.yaml",
            policy=policy,
            target="cpu",
            sharing=POLICIES[policy].sharing,
            turns=turns if POLICIES[policy].sharing == "spatial" else [],
            devices=devices,
            models=[
                PlannedModel(
                    name=d.name,
                    onnx="m.onnx",
                    onnx_sha256="0",
                    inputs=tensor,
                    outputs=tensor,
                    memory_mb=d.memory_mb,
                    slo_ms=d.slo_ms,
                    rate=d.rate,
                    port=9000 + i,
                    placements=[
                        Placement(
                            instance=f"{d.name}-{k}",
                            device=c.device,
                            share=c.share,
                            batch=c.batch,
                            queue_delay_us=c.queue_delay_us,
                            weight=c.weight,
                        )
                        for k, c in enumerate(choices[d.name])
                    ],
                )
                for i, d in enumerate(demands)
            ],
            runtime=RuntimeSettings(repository_dir="r", state_dir="s", host="127.0.0.1"),
        )
        result[policy] = simulate(plan, slm, 60, drop=True)
    good = {p: r.goodput for p, r in result.items()}
    assert good["search"] > good["spread"] and good["search"] > 0.995 * good["time-sharing"]
    arrived = sum(m.arrived for m in result["search"].models)
    assert 1 - sum(m.good for m in result["search"].models) / arrived < 0.01
    assert np.isclose(arrived / 60, offered, rtol=0.05)

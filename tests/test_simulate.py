"""The discrete-event simulator against queueing theory and Triton's batching rules (SYNTHETIC latency model)."""

from __future__ import annotations

import copy
import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from synthetic import synthetic_dataset
from tritonctl.errors import TritonctlError
from tritonctl.latency.ablation import no_interference
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.queueing import task_latency
from tritonctl.planning.plan import Device, Placement, Plan, PlannedModel, RuntimeSettings, Tensor, save_plan
from tritonctl.planning.simulate import (
    deal,
    latency_errors,
    read_trace,
    simulate,
    simulated_misses,
    with_simulation,
)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return fit_latency_model(synthetic_dataset(tmp_path_factory.mktemp("p") / "profile"), log=lambda _: None)


@pytest.fixture(scope="module")
def cores_only(lm):
    """The model without its interference terms: a CPU in turns is then the cores' sharing alone."""
    return no_interference(lm)


def plan_of(
    *models: tuple[str, float, float, int, int, int], sharing: str = "spatial", kind: str = "cpu", cores: float = 2.0
) -> Plan:
    """Plan with (name, rate, slo_ms, share, batch, queue_delay_us) models on one device (a CPU unless told)."""
    tensor = [Tensor(name="x", dtype="float32", shape=[16])]
    return Plan(
        cluster="sim",
        cluster_file="c.yaml",
        policy="test",
        target=kind,
        sharing=sharing,
        devices=[
            Device(id="cpu0", kind=kind, index=0, memory_mb=4096, units=100, cores=cores if kind == "cpu" else None)
        ],
        models=[
            PlannedModel(
                name=n,
                onnx="m.onnx",
                onnx_sha256="0",
                inputs=tensor,
                outputs=tensor,
                memory_mb=100,
                slo_ms=slo,
                rate=rate,
                port=9000 + i,
                placements=[Placement(instance=f"{n}-0", device="cpu0", share=share, batch=b, queue_delay_us=d)],
            )
            for i, (n, rate, slo, share, b, d) in enumerate(models)
        ],
        runtime=RuntimeSettings(repository_dir="r", state_dir="s", host="127.0.0.1"),
    )


def test_batch_one_matches_md1(lm):
    t = lm.t_inf("alpha", 1, 100)
    rate = 0.6 * 1000 / t  # utilisation 0.6
    result = simulate(plan_of(("alpha", rate, 1e6, 100, 1, 0)), lm, duration_s=400)
    (alpha,) = result.models
    rho = rate * t / 1000
    assert alpha.mean_ms == pytest.approx(t + rho * t / (2 * (1 - rho)), rel=0.05)
    assert alpha.arrived - alpha.served <= 5 and alpha.good == alpha.served  # only the last ones are cut off


def test_dynamic_batcher_waits_at_most_the_queue_delay(lm):
    # 4 requests per second cannot fill batches of 8: each batch leaves when its oldest request has waited 20 ms.
    result = simulate(plan_of(("alpha", 4, 1e6, 100, 8, 20_000)), lm, duration_s=200)
    (alpha,) = result.models
    longest = 20 + lm.t_inf("alpha", 8, 100)
    assert alpha.p99_ms <= longest + 1e-6 and alpha.p50_ms >= lm.t_inf("alpha", 1, 100)


def test_overload_serves_at_capacity_and_drop_keeps_served_requests_in_slo(lm):
    plan = plan_of(("alpha", 5000, 200, 50, 4, 0), ("beta", 1, 1e6, 50, 4, 0))
    slowest = 4 * 1000 / lm.t_inf("alpha", 4, 50, (("beta", 50, 4),))  # beta busy all the time
    fastest = 4 * 1000 / lm.t_inf("alpha", 4, 50)  # alone
    held = simulate(plan, lm, duration_s=20)
    assert 0.95 * slowest <= held.models[0].served / 20.2 <= 1.05 * fastest  # batches start until one SLO after
    assert held.models[0].good < held.models[0].served  # the queue grows without bound: late answers
    dropped = simulate(plan, lm, duration_s=20, drop=True)
    alpha = dropped.models[0]
    assert alpha.dropped > 0 and alpha.good == alpha.served and alpha.dropped + alpha.served <= alpha.arrived


def test_a_busy_corunner_slows_a_batch(lm):
    alone = simulate(plan_of(("alpha", 2, 1e6, 50, 1, 0)), lm, duration_s=100)
    shared = simulate(plan_of(("alpha", 2, 1e6, 50, 1, 0), ("beta", 80, 1e6, 50, 1, 0)), lm, duration_s=100)
    assert shared.models[0].p50_ms > alone.models[0].p50_ms * 1.03


def test_a_gpu_in_turns_runs_one_batch_at_a_time(lm):
    """Two models on one GPU in turns: no interference, but one waits for the other's batch."""
    plan = plan_of(("alpha", 30, 1e6, 100, 1, 0), ("beta", 30, 1e6, 100, 1, 0), sharing="temporal", kind="gpu")
    result = simulate(plan, lm, duration_s=200)
    alone = simulate(plan_of(("alpha", 30, 1e6, 100, 1, 0)), lm, duration_s=200)
    alpha = result.models[0]
    assert alpha.p50_ms >= lm.t_inf("alpha", 1, 100) - 1e-9  # never slowed by a co-runner ...
    assert alpha.mean_ms > alone.models[0].mean_ms * 1.05  # ... but queued behind beta's turns
    busy = sum(m.served * lm.t_inf(m.model, 1, 100) for m in result.models) / 1000
    assert busy <= 200 * 1.001  # one executor: the busy time of both never exceeds the wall time


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_a_short_batch_beside_a_long_one_in_turns(cores_only, kind):
    """Beta's batch of 8 starts at 0 ms, alpha's single request arrives at 1 ms. A GPU queues alpha behind
    beta; a 1-core CPU's scheduler runs both at half speed until alpha is done, then beta alone."""
    models = (("alpha", 1, 1e6, 100, 1, 0), ("beta", 8, 1e6, 100, 8, 0))
    plan = plan_of(*models, sharing="temporal", kind=kind, cores=1.0)
    trace = {"alpha": np.array([1.0]), "beta": np.zeros(8)}
    alpha, beta = simulate(plan, cores_only, duration_s=1, trace=trace).models
    t_alpha, t_beta = cores_only.t_inf("alpha", 1, 100), cores_only.t_inf("beta", 8, 100)
    assert t_alpha < t_beta - 1
    if kind == "gpu":
        assert (alpha.p50_ms, beta.p50_ms) == pytest.approx((t_beta - 1 + t_alpha, t_beta))
    else:
        assert (alpha.p50_ms, beta.p50_ms) == pytest.approx((2 * t_alpha, t_beta + t_alpha))


def test_a_gpu_in_turns_runs_a_batchs_host_part_beside_the_others(cores_only):
    """Calibrated with the host's part of a batch (Triton's and the glue's copies), a GPU in turns runs only the
    GPU part one batch at a time: alpha, arriving 1 ms into beta's batch, copies its request in beside it."""
    calibrated = copy.copy(cores_only)
    calibrated.meta = {"calibrated": {"added_ms": {"alpha": (0.2, 0.3), "beta": (0.2, 0.3)}}}
    host = calibrated.host_ms("alpha", 1)
    assert host == pytest.approx(0.5) and cores_only.host_ms("alpha", 1) == 0.0
    plan = plan_of(("alpha", 1, 1e6, 100, 1, 0), ("beta", 8, 1e6, 100, 8, 0), sharing="temporal", kind="gpu")
    trace = {"alpha": np.array([1.0]), "beta": np.zeros(8)}
    alpha, beta = simulate(plan, calibrated, duration_s=1, trace=trace).models
    t_alpha, t_beta = cores_only.t_inf("alpha", 1, 100), cores_only.t_inf("beta", 8, 100)
    assert 1 + host < t_beta
    assert (alpha.p50_ms, beta.p50_ms) == pytest.approx((t_beta - 1 + t_alpha - host, t_beta))


def test_a_gpu_in_turns_goes_to_the_batch_ready_first(cores_only):
    """Alpha's first request holds the GPU; beta's, ready at 1 ms, takes it before alpha's second (ready at 2 ms),
    rather than alpha keeping the GPU for as long as it has requests."""
    plan = plan_of(("alpha", 1, 1e6, 100, 1, 0), ("beta", 1, 1e6, 100, 1, 0), sharing="temporal", kind="gpu")
    trace = {"alpha": np.array([0.0, 2.0]), "beta": np.array([1.0])}
    alpha, beta = simulate(plan, cores_only, duration_s=1, trace=trace).models
    t_alpha, t_beta = cores_only.t_inf("alpha", 1, 100), cores_only.t_inf("beta", 1, 100)
    assert beta.p50_ms == pytest.approx(t_alpha + t_beta - 1)
    assert alpha.served == 2 and alpha.mean_ms == pytest.approx((t_alpha + 2 * t_alpha + t_beta - 2) / 2)


@pytest.mark.parametrize("priority", ["slo", "equal"])
def test_the_tighter_slo_takes_the_core_first(cores_only, priority):
    """As above on 1 core, alpha's SLO ten times tighter: deadline-monotonic ranks (beta in an idle group, which
    weighs 3 against alpha's 1024) run alpha at 1024/1027 of its speed and beta at 3/1027 while both are busy,
    and no time is lost; unranked, at half speed each."""
    plan = plan_of(("alpha", 1, 1e5, 100, 1, 0), ("beta", 8, 1e6, 100, 8, 0), sharing="temporal", cores=1.0)
    plan = plan.model_copy(update={"devices": [plan.devices[0].model_copy(update={"turn_priority": priority})]})
    trace = {"alpha": np.array([1.0]), "beta": np.zeros(8)}
    alpha, beta = simulate(plan, cores_only, duration_s=1, trace=trace).models
    t_alpha, t_beta = cores_only.t_inf("alpha", 1, 100), cores_only.t_inf("beta", 8, 100)
    expected = (1 + 3 / 1024) * t_alpha if priority == "slo" else 2 * t_alpha
    assert (alpha.p50_ms, beta.p50_ms) == pytest.approx((expected, t_beta + t_alpha))


@pytest.mark.parametrize("priority", ["slo", "equal"])
def test_the_loosest_slo_runs_on_every_core_and_yields_them(cores_only, priority):
    """On 2 cores, beta's SLO ten times looser, turn_threads: lightest: ranked by SLO, beta (the one instance of
    the lowest rank) runs its batch on 2 threads, alone at full speed, and while alpha's one thread takes a core
    (capped at its thread) beta runs at half speed; unranked, each runs on one thread at full speed."""
    plan = plan_of(("alpha", 1, 1e5, 100, 1, 0), ("beta", 8, 1e6, 100, 8, 0), sharing="temporal")
    device = plan.devices[0].model_copy(update={"turn_priority": priority, "turn_threads": "lightest"})
    plan = plan.model_copy(update={"devices": [device]})
    trace = {"alpha": np.array([1.0]), "beta": np.zeros(8)}
    alpha, beta = simulate(plan, cores_only, duration_s=1, trace=trace).models
    t_alpha = cores_only.t_inf("alpha", 1, 50)
    if priority == "slo":
        assert (alpha.p50_ms, beta.p50_ms) == pytest.approx((t_alpha, cores_only.t_inf("beta", 8, 100) + 0.5 * t_alpha))
    else:
        assert (alpha.p50_ms, beta.p50_ms) == pytest.approx((t_alpha, cores_only.t_inf("beta", 8, 50)))


def test_a_cpu_in_turns_shares_its_time_without_losing_or_making_any(cores_only):
    """Overloaded at 150%: each of two batches in flight runs at half speed, so the device does exactly one
    device-second of work per second, as the queued turns of a GPU do."""
    rates = [0.75 * 1000 / cores_only.t_inf(m, 1, 100) for m in ("alpha", "beta")]
    models = [(name, rate, 50, 100, 1, 0) for name, rate in zip(("alpha", "beta"), rates, strict=True)]
    for kind in ("cpu", "gpu"):
        result = simulate(plan_of(*models, sharing="temporal", kind=kind, cores=1.0), cores_only, duration_s=200)
        busy_s = sum(m.served * cores_only.t_inf(m.model, 1, 100) for m in result.models) / 1000
        assert busy_s == pytest.approx(200, rel=0.01), kind


def test_two_cpu_instances_in_turns_on_two_cores_run_at_once_on_a_thread_each(cores_only):
    """Each of two instances taking turns with 2 cores has one thread (never more threads than cores), so both
    batches run at once at their one-thread speed: the share of 1 core, 50 units."""
    plan = plan_of(("alpha", 1, 1e6, 100, 1, 0), ("beta", 8, 1e6, 100, 8, 0), sharing="temporal")
    trace = {"alpha": np.array([1.0]), "beta": np.zeros(8)}
    alpha, beta = simulate(plan, cores_only, duration_s=1, trace=trace).models
    assert (alpha.p50_ms, beta.p50_ms) == pytest.approx(
        (cores_only.t_inf("alpha", 1, 50), cores_only.t_inf("beta", 8, 50))
    )


def test_a_batch_taking_turns_takes_the_interference_of_those_in_flight_when_it_starts(lm, cores_only):
    """As above: alpha's request arrives while beta's batch runs, so alpha's batch takes its time beside beta
    (`t_inf` `in_turns`: cache pressure and scheduling, no wait for a core); beta's started alone and takes its
    time alone. Without the interference terms alpha runs as fast as alone."""
    plan = plan_of(("alpha", 1, 1e6, 100, 1, 0), ("beta", 8, 1e6, 100, 8, 0), sharing="temporal")
    trace = {"alpha": np.array([1.0]), "beta": np.zeros(8)}
    alpha, beta = simulate(plan, lm, duration_s=1, trace=trace).models
    beside = lm.t_inf("alpha", 1, 50, (("beta", 50, 8),), in_turns=True)
    assert beside > lm.t_inf("alpha", 1, 50) * 1.01
    assert (alpha.p50_ms, beta.p50_ms) == pytest.approx((beside, lm.t_inf("beta", 8, 50)))
    alone, _ = simulate(plan, cores_only, duration_s=1, trace=trace).models
    assert alone.p50_ms == pytest.approx(cores_only.t_inf("alpha", 1, 50))
    both = (("beta", 100, 8),)  # two threads each on 2 cores: under quotas alpha would also wait for a core
    assert lm.t_inf("alpha", 1, 100, both, in_turns=True) < lm.t_inf("alpha", 1, 100, both)


def test_the_same_seed_gives_the_same_run_in_every_process(lm, tmp_path):
    """Two CPU devices in turns, with spread: Python hashes strings differently in each process, so nothing
    that decides the order of the draws may follow a set of device names."""
    spread = copy.deepcopy(lm)
    spread.models["alpha"].spread = spread.models["beta"].spread = (0.2, 0.0)
    spread.save(tmp_path / "lm.json")
    plan = plan_of(("alpha", 100, 1e6, 100, 1, 0), ("beta", 40, 1e6, 100, 1, 0), sharing="temporal")
    devices = [plan.devices[0], plan.devices[0].model_copy(update={"id": "cpu1", "index": 1})]
    beta = plan.models[1].model_copy(
        update={"placements": [plan.models[1].placements[0].model_copy(update={"device": "cpu1"})]}
    )
    plan = plan.model_copy(update={"devices": devices, "models": [plan.models[0], beta]})
    save_plan(plan, tmp_path / "plan.yaml")
    run = (
        "from tritonctl.latency.model import load_latency_model; from tritonctl.planning.plan import load_plan; "
        "from tritonctl.planning.simulate import simulate; "
        f"r = simulate(load_plan('{tmp_path}/plan.yaml').plan, load_latency_model('{tmp_path}/lm.json'), 20, seed=3); "
        "print([m.p99_ms for m in r.models])"
    )
    runs = [  # side by side: each process spends most of its time importing
        subprocess.Popen(
            [sys.executable, "-c", run], env={**os.environ, "PYTHONHASHSEED": str(k)}, stdout=subprocess.PIPE, text=True
        )
        for k in range(1, 7)
    ]
    outputs = {proc.communicate()[0] for proc in runs}
    assert len(outputs) == 1 and next(iter(outputs)).startswith("[")


def test_replica_weights_split_the_traffic(lm):
    plan = plan_of(("alpha", 300, 1e6, 50, 4, 0))
    model = plan.models[0]
    replicas = [
        model.placements[0].model_copy(update={"weight": 3.0}),
        model.placements[0].model_copy(update={"instance": "alpha-1", "weight": 1.0}),
    ]
    plan = plan.model_copy(update={"models": [model.model_copy(update={"placements": replicas})]})
    assert model.model_copy(update={"placements": replicas}).rate_of(replicas[0]) == pytest.approx(225)
    (alpha,) = simulate(plan, lm, duration_s=50).models
    assert alpha.arrived == pytest.approx(300 * 50, rel=0.03)
    (arrived, served), (arrived_1, served_1) = alpha.replicas
    assert arrived + arrived_1 == alpha.arrived and served + served_1 == alpha.served
    # 3:1 of about 15,000 requests: a standard deviation of 0.004 in the first replica's part (0.5 if ignored)
    assert arrived / alpha.arrived == pytest.approx(0.75, abs=0.02)
    assert served / alpha.served == pytest.approx(0.75, abs=0.02)


def test_trace_replay_and_bad_trace_files(lm, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("model,time_s\n" + "".join(f"alpha,{0.01 * k:.2f}\n" for k in range(500)) + "beta,0.5\n")
    replay = read_trace(trace)
    result = simulate(plan_of(("alpha", 1, 1e6, 100, 1, 0)), lm, duration_s=4, trace=replay)
    alpha = result.models[0]
    assert alpha.arrived == 400 and alpha.served == 400  # requests after the 4 s horizon are not replayed
    assert alpha.p99_ms == pytest.approx(lm.t_inf("alpha", 1, 100))  # one every 10 ms: never queued
    for text, words in [("model,t\nalpha,1\n", "columns model,time_s"), ("model,time_s\nalpha,soon\n", "line 2")]:
        trace.write_text(text)
        with pytest.raises(TritonctlError, match=words):
            read_trace(trace)


def test_speed_at_least_50k_requests_per_second(lm):
    """The floor, in the slowest case (batch 1: one batch per request), at light load and overloaded, the
    CPU split and in turns. Set for the slowest machine the suite runs on, with neighbours: it catches a
    simulator grown several times slower, not a slow host (`bench/decision_time.py` measures the speed)."""
    for (rates, seconds), (share, sharing) in itertools.product(
        [((60, 30), 1000), ((600, 300), 200)], [(50, "spatial"), (100, "temporal")]
    ):
        plan = plan_of(("alpha", rates[0], 50, share, 1, 0), ("beta", rates[1], 80, share, 1, 0), sharing=sharing)
        runs = [simulate(plan, lm, duration_s=seconds, drop=True) for _ in range(2)]
        assert runs[0].throughput > 0.2 * sum(rates)  # requests were really served, not all dropped
        assert max(r.requests / r.wall_s for r in runs) >= 50_000


def test_latency_errors_are_fixed_per_model_seeded_and_leave_arrivals_alone(lm):
    plan = plan_of(("alpha", 20, 1e6, 50, 1, 0), ("beta", 5, 1e6, 50, 1, 0))
    exact = simulate(plan, lm, duration_s=50, seed=3)
    off = simulate(plan, lm, duration_s=50, seed=3, latency_error=0.1)
    assert exact.latency_errors == {} and set(off.latency_errors) == {"alpha", "beta"}
    assert all(0 < abs(e) <= 0.1 for e in off.latency_errors.values())
    assert off.latency_errors == simulate(plan, lm, duration_s=50, seed=3, latency_error=0.1).latency_errors
    assert [m.arrived for m in off.models] == [m.arrived for m in exact.models]
    for m, e in zip(off.models, (off.latency_errors["alpha"], off.latency_errors["beta"]), strict=True):
        base = next(x for x in exact.models if x.model == m.model)
        assert (m.p50_ms > base.p50_ms) == (e > 0)  # light load: latency moves with the error's sign
    with pytest.raises(TritonctlError, match="latency error"):
        simulate(plan, lm, duration_s=5, latency_error=1.5)
    assert latency_errors(plan, 3, 0.1) == off.latency_errors and latency_errors(plan, 3, 0.0) == {}
    # a latency model that knows the draw predicts what the simulator then runs: each model its own error
    knowing = lm.with_errors(off.latency_errors)
    for name, e in off.latency_errors.items():
        assert knowing.t_inf(name, 2, 50) == pytest.approx(lm.t_inf(name, 2, 50) * (1 + e))
        assert knowing.t_infs(name, 50)[1] == pytest.approx(knowing.t_inf(name, 2, 50))
        assert knowing.t_inf_gpulet(name, 2, 50) == pytest.approx(lm.t_inf_gpulet(name, 2, 50) * (1 + e))
        # slower still (inss's headroom): every model's own error grown alike, none dropped
        assert knowing.slower(0.1).t_inf(name, 2, 50) == pytest.approx(lm.t_inf(name, 2, 50) * (1 + e) * 1.1)
    assert lm.with_errors({"alpha": 0.1}).t_inf("beta", 1, 50) == lm.t_inf("beta", 1, 50)  # unnamed: exact
    assert knowing.with_margin(0.1).t_inf("alpha", 1, 50) == pytest.approx(lm.with_margin(0.1).t_inf("alpha", 1, 50))
    with pytest.raises(TritonctlError, match=r"latency errors must be in \(-1, 1\)"):
        lm.with_errors({"alpha": -1.0})


def test_the_last_requests_are_judged_like_the_others(lm):
    # Batches of 8 at 4 requests per second leave when their oldest has waited 1 s: requests arriving in the
    # last second are served after the arrivals end, within their SLO.
    delay_ms = 1000
    result = simulate(plan_of(("alpha", 4, 2 * delay_ms, 100, 8, 1000 * delay_ms)), lm, duration_s=30)
    (alpha,) = result.models
    assert alpha.arrived > 100 and alpha.good == alpha.served == alpha.arrived


def test_batches_spread_around_the_prediction_as_profiled(lm):
    spread = copy.deepcopy(lm)
    spread.models["alpha"].spread = (0.2, 0.0)  # log-normal sigma 0.2 at every batch
    plan = plan_of(("alpha", 1, 1e6, 100, 1, 0))  # 1 request/s: no queueing, latency = one batch
    t = lm.t_inf("alpha", 1, 100)
    exact = simulate(plan, lm, duration_s=2000).models[0]
    drawn = simulate(plan, spread, duration_s=2000).models[0]
    assert exact.p50_ms == pytest.approx(t) and exact.p99_ms == pytest.approx(t)
    assert drawn.p50_ms == pytest.approx(t, rel=0.03)  # the prediction is the median
    assert drawn.p99_ms == pytest.approx(t * math.exp(2.326 * 0.2), rel=0.06)


def test_an_instance_idle_since_its_last_batch_wakes_up_slower(lm):
    woken = copy.deepcopy(lm)
    woken.models["alpha"].wake = ((0.0, 0.0), (50.0, 4.0))  # +4 ms after 50 ms idle or more
    t = lm.t_inf("alpha", 1, 100)
    sparse = plan_of(("alpha", 1, 1e6, 100, 1, 0))  # 1 request/s: every request finds it idle for ~1 s
    assert simulate(sparse, woken, duration_s=500).models[0].p50_ms == pytest.approx(t + 4.0)
    # requests every ~t/0.95: most batches start right after the previous one ends, with no wake-up
    dense = plan_of(("alpha", 0.95 * 1000 / t, 1e6, 100, 1, 0))
    plain, slower = (simulate(dense, m, duration_s=200).models[0] for m in (lm, woken))
    assert slower.p50_ms < plain.p50_ms + 2.0


@pytest.mark.parametrize("share, sharing", [(50, "spatial"), (100, "temporal")])
def test_a_wake_up_by_the_device_is_not_paid_beside_a_busy_co_runner(lm, share, sharing):
    woken = copy.deepcopy(lm)
    woken.models["alpha"].wake = ((0.0, 0.0), (50.0, 4.0))
    busy = 2 * 1000 / lm.t_inf("beta", 1, share)  # beta always has a batch in flight
    plan = plan_of(("alpha", 1, 1e6, share, 1, 0), ("beta", busy, 1e6, share, 1, 0), sharing=sharing)
    by_instance, by_device = (simulate(plan, woken, duration_s=300, wake=w).models[0] for w in ("instance", "device"))
    assert by_device.p50_ms == pytest.approx(by_instance.p50_ms - 4.0, abs=0.5)
    with pytest.raises(TritonctlError, match="wake 'cpu' must be"):
        simulate(plan, woken, duration_s=1, wake="cpu")
    alone = plan_of(("alpha", 1, 1e6, share, 1, 0), sharing=sharing)  # an idle device: both pay it
    assert simulate(alone, woken, 300, wake="device").models[0].p50_ms == pytest.approx(
        simulate(alone, woken, 300).models[0].p50_ms
    )


def test_a_plans_simulation_adds_what_eq2_leaves_out_and_marks_an_overload(lm):
    t = lm.t_inf("alpha", 1, 100)
    rate = 0.5 * 1000 / t
    plan = plan_of(("alpha", rate, 1e6, 100, 1, 0))
    eq2 = task_latency(rate, 1, t).p99_ms
    exact = with_simulation(plan, lm)
    assert exact.models[0].simulated_p99_ms == pytest.approx(eq2, rel=0.1)  # no spread, no wake-up: eq. 2's p99
    assert with_simulation(plan, lm) == exact  # seeded
    woken = copy.deepcopy(lm)
    woken.models["alpha"].wake = ((0.0, 0.0), (2 * t, 3.0))
    woken.models["alpha"].spread = (0.2, 0.0)
    assert with_simulation(plan, woken).models[0].simulated_p99_ms > 1.2 * eq2
    overloaded = plan_of(("alpha", 1.5 * 1000 / t, 20 * t, 100, 1, 0))
    (alpha,) = with_simulation(overloaded, lm).models
    assert alpha.simulated_p99_ms is None and alpha.simulated_in_slo < 0.7  # serves 1 in 1.5 at most
    assert simulated_misses(with_simulation(overloaded, lm)) == [alpha] and not simulated_misses(exact)


def test_requests_are_dealt_to_replicas_in_turn_as_haproxy_deals_them():
    """Alike weights take turns; weights 1 and 3 give every fourth request to the first, at even intervals (smooth
    weighted round robin, HAProxy's roundrobin), not at random."""
    assert deal([1.0, 1.0], 6).tolist() == [0, 1, 0, 1, 0, 1]
    dealt = deal([1.0, 3.0], 400)
    assert (dealt == 0).sum() == 100 and set(np.diff(np.flatnonzero(dealt == 0)).tolist()) == {4}
    assert deal([2.0], 3).tolist() == [0, 0, 0]

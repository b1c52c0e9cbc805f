"""`tritonctl demo`: calibrate where needed, plan, apply, print the endpoints and send load, end to end."""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from tritonctl.cli.deploy import _apply, _load, cmd_down, cmd_endpoints
from tritonctl.cli.measure import _calibrate, _calibrated_path
from tritonctl.cli.output import say
from tritonctl.cli.planning import _plan
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.latency.device import busy_cores
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import load_plan
from tritonctl.planning.planner import on_another_cpu, servable_scale
from tritonctl.planning.policies import POLICIES
from tritonctl.spec import Cluster, load_cluster
from tritonctl.triton.client import endpoints

CHECKOUT = Path(__file__).resolve().parents[2]  # where the committed profiles are (profiles/<cluster name>/)
BUSY = 0.25  # cores kept busy by other processes from which the demo reserves them
DEMO_WITHIN_SLO = 0.99  # what the demo's load must keep within the SLOs to say that every model held
DEMO_MARGIN = 0.15  # the demo runs at rates its plan serves with batches 15% slower than predicted (at least)


def cmd_demo(args) -> int:
    """Export, plan, apply and load the CPU demo cluster, end to end."""

    cluster = Path(args.cluster)
    latency_model = args.latency_model
    if latency_model is None:  # the committed one, where there is one
        committed = CHECKOUT / "profiles" / load_cluster(cluster).spec.name / "latency-model.json"
        latency_model = str(committed) if committed.is_file() else None
        if latency_model is None and POLICIES[args.policy].latency_model:
            raise TritonctlError(
                f"policy {args.policy} needs a fitted latency model and there is none: pass --latency-model, "
                "or profile and fit the cluster first (tritonctl profile, tritonctl fit)",
                file=committed,
            )
    spec = _reserve_what_is_busy(load_cluster(cluster))
    if latency_model and on_another_cpu(load_latency_model(latency_model)):
        here = _calibrated_path(Path(latency_model), spec.resolve(spec.spec.runtime.state_dir))
        # calibrated once per CPU, kept in the state folder; again where it lacks what requests cost outside the models
        if not here.is_file() or not any(p.request_cpu_ms for p in load_latency_model(here).models.values()):
            say(f"== 0/4 calibrate {latency_model}: it was profiled on another CPU")
            _calibrate(str(cluster), Path(latency_model), here)
        latency_model = str(here)
    say(f"== 1/4 plan ({args.policy}" + (f", latency model {latency_model})" if latency_model else ")"))
    misses = False
    if latency_model:
        spec, misses = _demo_rates(spec, latency_model, args.policy)
    plan_path = _plan(spec, args.policy, None, latency_model=latency_model)
    say("== 2/4 apply")
    _apply(plan_path, accept_misses=misses)
    say("== 3/4 endpoints")
    cmd_endpoints(argparse.Namespace(plan=str(plan_path)))
    say("== 4/4 load")
    # a model short of its SLO is said, not an error (the demo ran end to end); one with no answer is an error
    rc, short = _load(plan_path, args.duration, 1.0, min_within_slo=DEMO_WITHIN_SLO)
    if short and (misses or not latency_model):
        say("not every model held" + (", as the plan predicted" if misses else " (no latency model predicted it)"))
    elif short:
        say(
            "not every model held where the plan simulated it (this CPU served less than calibrated: its speed "
            "moves, or other processes took cores; docs/real-load.md, 'Why a plan can miss its SLOs on a CPU')"
        )
    else:
        say(f"every model held: {100 * DEMO_WITHIN_SLO:g}% or more of its requests within its SLO")
    if args.teardown:
        cmd_down(
            argparse.Namespace(
                plan=str(plan_path), state_dir=None, compose_dir=None, namespace="tritonctl", dry_run=False
            )
        )
    else:
        first = endpoints(load_plan(plan_path).plan)[0]
        say(
            f"\nThe deployment keeps running.\n  look:           tritonctl status {plan_path}\n"
            f"  send requests:  python examples/client.py {first.url} {first.model}\n"
            f"  stop it:        tritonctl down {plan_path}"
        )
    return rc


def _reserve_what_is_busy(cluster: Cluster) -> Cluster:
    """The cluster with the cores that other processes keep busy right now reserved (in quarters, at most 3/4 of
    the machine, what the cluster reserves already counted), saying so: a plan for cores that something else
    uses misses its SLOs."""
    busy = busy_cores()
    if cluster.kind != "cpu" or busy < BUSY:
        return cluster
    cores, declared = cluster.spec.devices[0].cores, cluster.spec.devices[0].reserved_cores
    reserve = min(math.ceil(busy * 4) / 4, 0.75 * cores) - declared
    if reserve <= 0:
        return cluster
    say(
        f"other processes keep {busy:.2f} of this machine's cores busy: reserving {reserve:g} more of the "
        f"cluster's {cores:g} cores for them (devices[].reserved_cores) and planning with the rest"
    )
    return cluster.reserving(reserve)


def _demo_rates(cluster: Cluster, latency_model: str, policy: str) -> tuple[Cluster, bool]:
    """The demo cluster at the largest of 1, 0.95, ..., 0.05 times its rates that this CPU serves with a margin to
    spare (saying so); where none is, the largest it serves with nothing to spare; and whether even 0.05 x is
    predicted to miss (the demo runs it all the same, saying so: a newcomer sees the deployment and the misses
    rather than nothing)."""
    artifacts = materialize(cluster, log=lambda _: None)
    model = load_latency_model(latency_model)
    margin = demo_margin(model.meta)
    scale = servable_scale(cluster, artifacts, model.with_margin(margin), policy)
    spare = f"with {100 * margin:.0f}% to spare for the calibration's error and this machine's speed moving"
    if scale == 0:
        scale = servable_scale(cluster, artifacts, model, policy)
        if scale == 0:
            say(
                f"WARNING: this CPU serves the demo within its SLOs at none of 0.05-1 x its rates by latency model "
                f"{latency_model}, even with nothing to spare: deploying 0.05 x, predicted to miss"
            )
            return cluster.with_rates(lambda m: m.rate * 0.05), True
        say(
            f"WARNING: this CPU serves the demo within its SLOs {spare} at none of 0.05-1 x its rates; with "
            f"nothing to spare at {scale:g} x: planning for {scale:g} x, where a slower minute may miss"
        )
    elif scale < 1:
        say(
            f"this CPU serves the demo within its SLOs ({spare}) at {scale:g} x its "
            f"rates, not at 1 x (the plan at 1 x is predicted to miss): planning for {scale:g} x"
        )
    return cluster.with_rates(lambda m: m.rate * scale), False


def demo_margin(meta: dict) -> float:
    """How much slower than predicted the demo's batches may run: DEMO_MARGIN, or a calibrated model's worst error on
    the points it held out where that is larger (a noisy or busy machine calibrates less well), and on top of it half
    the median spread of a calibration point's rounds (the model is fitted to each point's median round; a machine
    whose speed moves serves some minutes that much slower), at most 60%."""
    calibrated = meta.get("calibrated", {})
    error = max([DEMO_MARGIN, *(abs(e) for e in calibrated.get("held_out_error_after", []))])
    moving = statistics.median(calibrated["round_spread"]) / 2 if calibrated.get("round_spread") else 0.0
    return min(0.6, (1 + error) * (1 + moving) - 1)

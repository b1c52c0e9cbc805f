"""From a cluster and its model artifacts to a Plan, through a named policy."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

from tritonctl.errors import TritonctlError
from tritonctl.export import Artifact, inspect_onnx, materialize, served_as
from tritonctl.latency.device import cpu_fingerprint, visible_gpu
from tritonctl.latency.energy import EnergyModel
from tritonctl.latency.model import MAX_BATCH, LatencyModel
from tritonctl.latency.queueing import batcher_latency, goodput, refusing_goodput, task_latency
from tritonctl.planning.energy import least_energy
from tritonctl.planning.plan import (
    Device,
    LoadedPlan,
    Placement,
    Plan,
    PlannedModel,
    Prediction,
    RuntimeSettings,
    Tensor,
    Unserved,
    relative_to,
)
from tritonctl.planning.policies import POLICIES, Choice, Demand, PlacementError, Policy, PolicyLimit
from tritonctl.planning.policies.bda import eager, prompted
from tritonctl.planning.policies.inss import default_policy_file, load_trained
from tritonctl.planning.policies.timesharing import turn_service_ms, widest_turns
from tritonctl.planning.simulate import simulated_misses, with_simulation
from tritonctl.shares import turn_layout
from tritonctl.spec import Cluster, DeviceGroup, ModelSpec

# Without a profile: weights twice (session copy + arena) plus runtime overhead.
RUNTIME_OVERHEAD_MB = 64
IDLE_RATE = 0.01  # requests/s a model without traffic is planned for, so that it keeps an instance
SIMULATED_GAIN = 1e-3  # copies are given up where one instance a model answers this part more within the SLOs
# `turn_threads: lightest` is chosen where it answers this part of the offered load more within the SLOs in simulation:
# a margin for the two costs neither the search nor the simulator sees (docs/real-load.md, the lightest on every core)
LIGHTEST_GAIN = 0.01
LIGHTEST = "the one instance of the lowest rank on every core (turn_threads: lightest)"  # what its plan's note says
# time-sharing's plan replaces a `search` plan simulated short of its SLOs where it answers this part of the offered
# load more within them in simulation: the search judges an overloaded model by the goodput eq. 2 credits it with,
# which a tight quota does not deliver (docs/real-load.md, two clusters drawn on the 1 MB L2 EPYC VM)
TURNS_GAIN = 0.01


def replan_artifacts(loaded: LoadedPlan, cluster: Cluster) -> dict[str, Artifact]:
    """The artifacts to re-plan `cluster` with, as a deployment's controller does: the ONNX files `loaded` serves
    (checked against the hashes it recorded), so that re-planning needs neither torchvision nor a writable
    export folder; the cluster's exports as `materialize` makes them when the plan does not serve every model."""
    planned = {m.name: m for m in loaded.plan.models}
    if any(m.name not in planned for m in cluster.spec.models):
        return materialize(cluster, log=lambda _: None)
    artifacts = {}
    for model in cluster.spec.models:
        path = loaded.resolve(planned[model.name].onnx)
        artifact = inspect_onnx(path)
        if artifact.sha256 != planned[model.name].onnx_sha256:
            raise TritonctlError(
                f"{path} changed since the plan was made (its SHA-256 differs): plan again with `tritonctl plan`",
                file=loaded.path,
                field=f"models[{model.name}].onnx",
            )
        artifacts[model.name] = served_as(artifact, model)
    return artifacts


def devices_of(cluster: Cluster) -> list[Device]:
    return [device for _, members in device_groups(cluster) for device in members]


def device_groups(cluster: Cluster) -> list[tuple[DeviceGroup, list[Device]]]:
    """Each device group of the cluster with its devices, numbered as their host numbers them (per node where the
    cluster names nodes; the node then prefixes the id)."""
    groups: list[tuple[DeviceGroup, list[Device]]] = []
    counted: dict[str | None, int] = {}
    for group in cluster.spec.devices:
        members = []
        for _ in range(group.count):
            index = counted.get(group.node, 0)
            counted[group.node] = index + 1
            members.append(
                Device(
                    id=f"{group.node}-{group.kind}{index}" if group.node else f"{group.kind}{index}",
                    kind=group.kind,
                    index=index,
                    node=group.node,
                    memory_mb=group.memory_mb,
                    # Reserved cores are left out; a unit stays the same size, so shares mean the same cores.
                    units=group.usable_units,
                    cores=group.cores * group.usable_units / group.units if group.cores else None,
                    turn_priority=group.turn_priority,
                    turn_threads=group.turn_threads or "even",
                )
            )
        groups.append((group, members))
    return groups


def device_sets(cluster: Cluster) -> list[frozenset[str]]:
    """The sets of the cluster's devices a plan on fewer of them may use, fewest devices first: so many of each
    group's (identical) devices, the first ones of it."""
    groups = [[d.id for d in members] for _, members in device_groups(cluster)]
    counts = sorted(  # fewest first; among as few, more of the groups listed first
        itertools.product(*(range(len(ids) + 1) for ids in groups)), key=lambda c: (sum(c), [-n for n in c])
    )
    return [frozenset(i for ids, n in zip(groups, c, strict=True) for i in ids[:n]) for c in counts if sum(c)]


def demands_of(cluster: Cluster, artifacts: dict[str, Artifact], lm: LatencyModel | None) -> list[Demand]:
    """The cluster's models as the policies see them. Memory: the spec's memory_mb, else the profiled footprint
    at batch 1, else an estimate from the artifact's weights (only then are `artifacts` read: with `lm`, {} does).
    A model without traffic (rate 0) asks for `IDLE_RATE`: served, not shed."""
    return [
        Demand(m.name, m.slo_ms, max(m.rate, IDLE_RATE), _footprint_mb(m, artifacts, lm)) for m in cluster.spec.models
    ]


def _footprint_mb(model: ModelSpec, artifacts: dict[str, Artifact], lm: LatencyModel | None) -> int:
    if model.memory_mb:
        return model.memory_mb
    if lm is not None:
        return math.ceil(lm.footprint_mb(model.name, 1))
    return math.ceil(2 * artifacts[model.name].weights_mb + RUNTIME_OVERHEAD_MB)


def describe_device(kind: str, units: int, cores: float | None) -> str:
    return f"a {kind} device of {units} units" + (f" standing for {cores:g} cores" if cores else "")


def on_another_cpu(lm: LatencyModel) -> bool:
    """Whether `lm` was measured on another device than this machine's CPU."""
    return lm.device.fingerprint.get("id") != cpu_fingerprint()["id"]


def other_cpu_note(lm_path: str | Path, lm: LatencyModel) -> str:
    """What to say where a latency model of another CPU is used without deploying: whose latencies it holds."""
    return f"note: {lm_path} speaks for the CPU it was profiled on ({lm.device.fingerprint.get('model')})"


def speaks_for(lm: LatencyModel, kind: str, units: int, cores: float | None, usable_units: int) -> bool:
    """Whether `lm`'s shares are those of a device of this kind whose `units` stand for `cores` (on a GPU, the same
    units), `usable_units` of them planned with."""
    same_units = lm.device.kind == kind and (
        lm.device.units == units if kind == "gpu" else math.isclose(lm.device.cores / lm.device.units, cores / units)
    )
    return same_units and lm.device.units >= usable_units


def check_latency_model(
    cluster: Cluster, lm: LatencyModel, lm_path: Path, log: Callable[[str], None], deploys_here: bool = True
) -> None:
    """Refuse a latency model that cannot speak for this cluster (before its models are exported); warn where it
    is only doubtful.

    A CPU cluster deploys on this machine: a model profiled on another CPU is refused unless
    the caller only simulates (`deploys_here=False`), where it speaks for the CPU it was made on.
    A GPU plan may be made anywhere; on a host with a GPU, a model not made (or calibrated) on that GPU
    through Triton is refused the same way."""
    group, usable = cluster.spec.devices[0], devices_of(cluster)[0]
    if not speaks_for(lm, group.kind, group.units, group.cores, usable.units):
        raise TritonctlError(
            f"fitted for {describe_device(lm.device.kind, lm.device.units, lm.device.cores)}; the cluster plans with "
            f"{describe_device(usable.kind, usable.units, usable.cores)}",
            file=lm_path,
            field="device",
        )
    if group.kind == "gpu":
        gpu = visible_gpu() if deploys_here else None
        if gpu is None:
            log(f"note: {lm_path} speaks for {lm.device.fingerprint.get('model')}; on another GPU, or without Triton "
                "in its profile, calibrate it there first (tritonctl calibrate)")  # fmt: skip
        elif lm.device.fingerprint.get("id") != gpu["id"]:
            raise TritonctlError(
                f"not measured through Triton on this GPU ({gpu['model']}, id {gpu['id']}; the model speaks for "
                f"{lm.device.fingerprint.get('model')}, id {lm.device.fingerprint.get('id')}): calibrate it "
                f"(tritonctl calibrate {cluster.path} --latency-model {lm_path}, about two minutes)",
                file=lm_path,
                field="device.fingerprint",
            )
    here = cpu_fingerprint()
    elsewhere = group.kind == "cpu" and on_another_cpu(lm)
    if elsewhere and not deploys_here:
        log(other_cpu_note(lm_path, lm))
    elif elsewhere and "synthetic" in lm.meta:
        raise TritonctlError(
            "a SYNTHETIC latency model (its meta.synthetic says how it was made): it speaks for no CPU, so no plan is "
            f"deployed from it; compare policies on it with `tritonctl bench {cluster.path} --latency-model {lm_path}`",
            file=lm_path,
            field="meta.synthetic",
        )
    elif elsewhere:
        raise TritonctlError(
            f"profiled on another CPU ({lm.device.fingerprint.get('model')}, id {lm.device.fingerprint.get('id')}; "
            f"this one is {here['model']}, id {here['id']}): its latencies do not hold here. Calibrate it "
            f"(tritonctl calibrate {cluster.path} --latency-model {lm_path}, about a minute) or profile here",
            file=lm_path,
            field="device.fingerprint",
        )
    absent = [(i, m.name) for i, m in enumerate(cluster.spec.models) if m.name not in lm.models]
    if absent:
        names = ", ".join(repr(name) for _, name in absent)
        which = f"model {names} is" if len(absent) == 1 else f"models {names} are"
        raise TritonctlError(
            f"{which} not in the latency model {lm_path}: profile and fit {'it' if len(absent) == 1 else 'them'}",
            file=cluster.path,
            field=f"models[{absent[0][0]}]",
        )


def warn_changed_exports(
    cluster: Cluster, artifacts: dict[str, Artifact], lm: LatencyModel, log: Callable[[str], None]
) -> None:
    """Say which models' ONNX files changed since the latency model's profile."""
    for model in cluster.spec.models:
        if lm.models[model.name].onnx_sha256 != artifacts[model.name].sha256:
            log(f"WARNING: {model.name}: its ONNX file changed since it was profiled; predictions may be off")


def predict(
    plan_models: list[PlannedModel],
    lm: LatencyModel,
    log: Callable[[str], None],
    sharing: str = "spatial",
    turns: frozenset[str] = frozenset(),
    devices: list[Device] = (),
) -> list[PlannedModel]:
    """The plan's models with a prediction on every placement, given everything else on its device.

    Spatial sharing: the batch runs next to its co-runners (interference), queueing by eq. 2 at batch 1 and, for
    larger batches, through Triton's dynamic batcher (`queueing.batcher_latency`: a batch runs once it is whole or
    its oldest request has waited the queue delay, where eq. 2 waits for it to fill).
    Temporal sharing (the plan's, or a device's in `turns`): instances on a device take turns
    with the whole device. On a GPU a batch runs alone but waits for one round of the others
    (the duty cycle d): latency is bounded by d + t_inf and throughput is b / d (Nexus's
    squishy bin packing). On a CPU (a device among `devices`) they run at once, each on its
    threads of `shares.turn_layout`, slowed while more are busy than the cores hold
    (`timesharing.turn_service_ms`), queueing by eq. 2.
    """
    placed = [(m, p) for m in plan_models for p in m.placements]
    by_id = {d.id: d for d in devices}
    in_turns = [(m, p) for m, p in placed if sharing == "temporal" or p.device in turns]
    turn: dict[str, tuple[float, float]] = {}  # instance in turns -> (its batch's time alone, how long it holds it)
    for device_id in {p.device for _, p in in_turns}:
        device = by_id.get(device_id) or Device(id=device_id, kind="gpu", index=0, memory_mb=1, units=lm.device.units)
        group = [(m, p) for m, p in in_turns if p.device == device_id]
        held = turn_service_ms([(m.name, p.batch, m.rate_of(p), m.slo_ms) for m, p in group], device, lm)
        layout = turn_layout(device, [m.slo_ms for m, _ in group])
        for (m, p), t, how in zip(group, held, layout, strict=True):
            turn[p.instance] = (lm.t_inf(m.name, p.batch, how.share), t)
    out = []
    for model in plan_models:
        placements = []
        for p in model.placements:
            if lm.extrapolates(model.name, p.batch, p.share):
                fitted = lm.models[model.name]
                log(
                    f"WARNING: {p.instance}: batch {p.batch}, share {p.share} lies outside the profiled range "
                    f"(batch {fitted.batch_range}, share {fitted.share_range}); the prediction extrapolates"
                )
            rate = model.rate_of(p)
            if p.instance in turn and (by_id.get(p.device) is None or by_id[p.device].kind != "cpu"):
                exec_ms, cycle = turn[p.instance]  # a GPU: a batch waits at most a cycle, then runs alone
                throughput = 1000 * p.batch / cycle
                latency = cycle + exec_ms if rate <= throughput else None
                in_slo = rate if latency is not None and latency <= model.slo_ms else 0.0
            elif p.instance in turn:  # a CPU: a batch server taking its turn's time per batch, queueing by eq. 2
                exec_ms, held = turn[p.instance]
                task = task_latency(rate, p.batch, held)
                throughput = 1000 * p.batch / held
                latency = task.p99_ms if task.stable else None
                in_slo = goodput(rate, p.batch, held, model.slo_ms)
            else:
                corunners = tuple((m.name, q.share, q.batch) for m, q in placed if q.device == p.device and q is not p)
                exec_ms = lm.t_inf(model.name, p.batch, p.share, corunners)
                throughput = 1000 * p.batch / exec_ms
                if p.batch == 1:
                    task = task_latency(rate, p.batch, exec_ms)
                    in_slo = goodput(rate, p.batch, exec_ms, model.slo_ms)
                else:  # Triton's batcher runs what waits once the oldest has waited the queue delay: not eq. 2's wait
                    times = tuple(lm.t_infs(model.name, p.share, corunners)[: p.batch].tolist())
                    task, within = batcher_latency(rate, times, p.queue_delay_us / 1000, model.slo_ms)
                    in_slo = max(rate * within, refusing_goodput(rate, p.batch, exec_ms, model.slo_ms))
                latency = task.p99_ms if task.stable else None
            placements.append(
                p.model_copy(
                    update={
                        "predicted": Prediction(
                            exec_ms=round(exec_ms, 3),
                            latency_ms=None if latency is None else round(latency, 3),
                            throughput_rps=round(throughput, 2),
                            meets_slo=latency is not None and latency <= model.slo_ms,
                            in_slo_rps=round(min(rate, in_slo), 2),
                        )
                    }
                )
            )
        out.append(model.model_copy(update={"placements": placements}))
    return out


def request_cores(cluster: Cluster, lm: LatencyModel) -> float:
    """Cores the cluster's requests keep busy outside their models at its rates: Triton's front ends and
    HAProxy, at the CPU per request the profile measured (`ModelParams.request_cpu_ms`)."""
    return sum(m.rate * lm.models[m.name].request_cpu_ms for m in cluster.spec.models if m.name in lm.models) / 1000


def reserve_for_requests(
    cluster: Cluster, lm: LatencyModel, log: Callable[[str], None], only: frozenset[str] | None
) -> Cluster:
    """The cluster with the cores its requests take outside their models reserved, spread over the CPU devices
    it plans on (`only`, else all) in proportion to their cores (the planner does not yet know where each model
    goes)."""
    cores = request_cores(cluster, lm)
    if not cores:
        return cluster
    total = sum(
        group.cores
        for group, members in device_groups(cluster)
        for d in members
        if d.kind == "cpu" and (only is None or d.id in only)
    )
    try:
        reserved = cluster.reserving(part=cores / total)
    except ValueError:
        raise TritonctlError(
            f"at these rates the requests cost {cores:.2f} of {total:g} cores outside the models (Triton's front "
            "ends and HAProxy, measured per request by the profile), which with devices[].reserved_cores leaves "
            "nothing to plan with: lower the rates or give the cluster more cores",
            file=cluster.path,
            field="models",
        ) from None
    log(f"reserving {cores:.2f} cores for what the requests cost outside the models (Triton's front ends, HAProxy)")
    return reserved


def unservable(demand: Demand, devices: list[Device], lm: LatencyModel | None) -> str | None:
    """Why a model cannot be served on these devices whatever the policy, or None.

    Too large for every device; an SLO below its fastest latency (batch 1, a whole device,
    alone); more load than every device given to it alone could carry within its SLO.
    """
    largest = max(d.memory_mb for d in devices)
    if demand.memory_mb > largest:
        return f"needs {demand.memory_mb} MB but the largest device has {largest} MB"
    if lm is None:
        return None
    units = max(d.units for d in devices)
    fastest = lm.t_inf(demand.name, 1, units)
    if fastest > demand.slo_ms:
        return f"SLO {demand.slo_ms:g} ms is below its fastest latency, {fastest:.1f} ms (batch 1, a whole device)"
    best = max(1000 * b / t for b in range(1, MAX_BATCH + 1) if (t := lm.t_inf(demand.name, b, units)) <= demand.slo_ms)
    if demand.rate > len(devices) * best:
        return (
            f"rate {demand.rate:g}/s is more than all {len(devices)} devices could carry for it alone "
            f"({len(devices) * best:.0f}/s within its SLO)"
        )
    return None


def place(
    policy: str, fn: Policy, demands: list[Demand], devices: list[Device], lm: LatencyModel | None
) -> tuple[dict[str, list[Choice]], dict[str, str]]:
    """Run the policy `fn`; while it finds no plan, shed the models it names (else the one with the most work,
    rate x latency) and retry.

    Returns the placements and, for every shed model, why it is not served.
    """
    unserved: dict[str, str] = {}
    remaining = list(demands)
    while remaining:
        try:
            choices = fn(remaining, devices, lm)
        except PlacementError as exc:
            if len(remaining) == 1:
                unserved[remaining[0].name] = str(exc)
                return {}, unserved
            named = [d for d in remaining if d.name in exc.shed]
            why = "the devices cannot carry it beside the others" if named else "left out, the model of most work"
            for demand in named or [max(remaining, key=lambda d: (_work(d, lm), d.name))]:
                unserved[demand.name] = f"{why}, where {policy} found no plan for them all ({exc})"
                remaining.remove(demand)
            continue
        return choices, unserved
    return {}, unserved


def _work(demand: Demand, lm: LatencyModel | None) -> float:
    """Device time per second a model needs at batch 1 on a whole device (memory without a latency model)."""
    if lm is None:
        return demand.memory_mb
    return demand.rate * lm.t_inf(demand.name, 1, lm.device.units)


def replan_policy(cluster: Cluster, lm: LatencyModel | None) -> tuple[str, str]:
    """The policy re-planning uses unless told: `inss` where a trained policy for this cluster ships and fits it
    and the latency model's device, `search` otherwise; and why."""
    path = default_policy_file(cluster.spec.name)
    if lm is None or not path.is_file():
        return "search", f"no trained inss policy {path}"
    try:
        trained = load_trained(path, cluster.spec.name, [m.name for m in cluster.spec.models], devices_of(cluster))
    except TritonctlError as exc:
        return "search", str(exc)
    other = trained.other_device(lm)
    if other:
        return "search", f"the trained policy {path} does not fit the latency model: {other}"
    return "inss", f"the trained policy {path} fits the cluster"


def _with_joules(model: PlannedModel, joules: float) -> PlannedModel:
    """The model with the energy objective's joules per request in each placement's prediction."""
    placements = [
        p.model_copy(update={"predicted": p.predicted.model_copy(update={"joules_per_request": joules})})
        for p in model.placements
    ]
    return model.model_copy(update={"placements": placements})


def sources_of(cluster: Cluster) -> dict[str, str]:
    """Each model's name in measurements made outside the cluster (an energy sweep): its torchvision source, or
    its own name for a model given as an .onnx file."""
    return {m.name: m.name if m.is_onnx_file else m.source for m in cluster.spec.models}


def make_plan(
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    policy: str,
    plan_path: Path,
    lm: LatencyModel | None = None,
    log: Callable[[str], None] = print,
    strict: bool = False,
    policy_file: Path | None = None,
    only: frozenset[str] | None = None,
    energy: EnergyModel | None = None,
    batching: str = "fill",
    copies: bool = True,
) -> Plan:
    """Run `policy` on the cluster (on the devices `only` names, else all) and return the plan to be saved at
    `plan_path`.

    Models that cannot be served are left out of the plan and listed in its `unserved`
    with the reason; placements predicted to miss their SLO (partial service) say so in
    their prediction and in a warning. With `strict`, either is an error instead. A policy
    that needs training (inss) reads `policy_file`, by default rl/policies/<cluster name>.pt. With an `energy`
    model, the placement's SM clock and batch sizes are then chosen for the fewest joules (`planning.energy`).
    `batching` "prompt" serves each split placement at `bda.prompt_batch` instead of the largest batch BDA allows;
    "eager" keeps BDA's batch as the largest and waits for none (`bda.eager`). Without `copies`, `search` runs
    no model as two instances on one device.
    """
    if policy not in POLICIES:
        raise TritonctlError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    runtime = cluster.spec.runtime
    if runtime.base_port + len(cluster.spec.models) - 1 > 65535:
        raise TritonctlError(
            f"{len(cluster.spec.models)} models need ports up to {runtime.base_port + len(cluster.spec.models) - 1}",
            file=cluster.path,
            field="runtime.base_port",
        )
    if lm is not None and cluster.kind == "cpu":
        cluster = reserve_for_requests(cluster, lm, log, only)
    devices = [d for d in devices_of(cluster) if only is None or d.id in only]
    demands = demands_of(cluster, artifacts, lm)
    fn = POLICIES[policy].fn
    if policy == "search" and not copies:
        fn = partial(fn, copies=False)
    if POLICIES[policy].trained:
        path = policy_file or default_policy_file(cluster.spec.name)
        trained = load_trained(path, cluster.spec.name, [d.name for d in demands], devices)
        if lm is not None and (other := trained.other_device(lm)):
            log(f"note: {path}: {other}")
        fn = partial(fn, trained=trained)
    notes: list[str] = []  # what the policy says of its decision (inss: whose placement; optimal: the gap)
    if POLICIES[policy].logs:

        def say(message: str) -> None:
            notes.append(message)
            log(message)

        fn = partial(fn, log=say)
    unserved = {d.name: why for d in demands if (why := unservable(d, devices, lm))}
    try:
        choices, shed = place(policy, fn, [d for d in demands if d.name not in unserved], devices, lm)
    except PolicyLimit as exc:
        raise TritonctlError(str(exc), file=cluster.path, field="models") from None
    unserved.update(shed)
    if batching != "fill" and (batching == "eager" or POLICIES[policy].sharing == "spatial") and choices:
        if lm is None or energy is not None:
            raise TritonctlError(f"{batching} batching needs a latency model and no energy objective (its own batches)")
        if batching == "prompt":
            choices = prompted(choices, demands, lm)
        else:
            temporal = POLICIES[policy].sharing == "temporal"
            choices = widest_turns(eager(choices), demands, devices, lm, temporal)
    joules: dict[str, float] = {}
    if energy is not None and choices:
        if lm is None:
            raise TritonctlError("the energy objective needs a latency model (--latency-model)")
        try:
            decision = least_energy(choices, demands, devices, lm, energy, sources_of(cluster))
        except TritonctlError as exc:
            raise TritonctlError(str(exc), file=cluster.path, field="models") from None
        choices, lm, joules = decision.choices, decision.lm, decision.joules_per_request
        devices = [d.model_copy(update={"clock_mhz": decision.clock_mhz}) for d in devices]
        notes.append(decision.explain())
        log(decision.explain())
    if unserved and (strict or not choices):
        fields = {m.name: f"models[{i}]" for i, m in enumerate(cluster.spec.models)}
        raise TritonctlError(
            ("cannot serve every model" if choices else "cannot serve any model")
            + "".join(f"\n  {fields[n]} {n}: {why}" for n, why in unserved.items()),
            file=cluster.path,
            field="models",
        )
    for name, why in unserved.items():
        log(f"WARNING: {name} is not served: {why}")

    base = plan_path.resolve().parent
    planned = []
    for i, (model, demand) in enumerate(zip(cluster.spec.models, demands, strict=True)):
        if model.name in unserved:
            continue
        artifact = artifacts[model.name]
        placements = [
            Placement(
                instance=f"{model.name}-{k}",
                device=c.device,
                share=c.share,
                batch=c.batch,
                queue_delay_us=c.queue_delay_us,
                weight=c.weight,
            )
            for k, c in enumerate(choices[model.name])
        ]
        planned.append(
            PlannedModel(
                name=model.name,
                onnx=relative_to(artifact.path, base),
                onnx_sha256=artifact.sha256,
                source=None if model.is_onnx_file else model.source,
                inputs=[Tensor(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in artifact.inputs],
                outputs=[Tensor(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in artifact.outputs],
                memory_mb=demand.memory_mb,
                slo_ms=model.slo_ms,
                rate=model.rate,
                port=runtime.base_port + i,
                placements=placements,
            )
        )
    sharing = POLICIES[policy].sharing
    turns = sorted({c.device for cs in choices.values() for c in cs if c.turns}) if sharing == "spatial" else []
    if lm is not None:
        planned = predict(planned, lm, log, sharing, frozenset(turns), devices)
        if joules:
            planned = [_with_joules(m, joules[m.name]) for m in planned]
        misses = [(m, p) for m in planned for p in m.placements if not p.predicted.meets_slo]
        if strict and misses:
            fields = {m.name: f"models[{i}]" for i, m in enumerate(cluster.spec.models)}
            raise TritonctlError(
                "cannot serve every model within its SLO"
                + "".join(
                    f"\n  {fields[m.name]} {p.instance}: predicted {p.predicted.in_slo_rps:g} of {m.rate_of(p):g} "
                    f"requests/s within {m.slo_ms:g} ms"
                    for m, p in misses
                ),
                file=cluster.path,
                field="models",
            )
        for m, p in misses:
            log(
                f"WARNING: {p.instance}: predicted to miss its SLO: {p.predicted.in_slo_rps:g} of "
                f"{m.rate_of(p):g} requests/s within {m.slo_ms:g} ms"
            )
        if misses and policy == "search":  # a climb from its starts: a placement two moves away can escape it
            log("note: `--policy optimal` searches every placement of these (exact, slower) and may meet every SLO")
    plan = Plan(
        cluster=cluster.spec.name,
        cluster_file=relative_to(cluster.path, base),
        policy=policy,
        objective="throughput" if energy is None else "energy",
        batching=batching,
        target=cluster.kind,
        sharing=sharing,
        devices=devices,
        models=planned,
        unserved=[Unserved(name=n, reason=why) for n, why in unserved.items()],
        turns=turns,
        notes=notes,
        runtime=RuntimeSettings(
            repository_dir=relative_to(cluster.resolve(runtime.repository_dir), base),
            state_dir=relative_to(cluster.resolve(runtime.state_dir), base),
            host=runtime.host,
            tritonserver=str(cluster.resolve(runtime.tritonserver)) if runtime.tritonserver else None,
            startup_timeout_s=runtime.startup_timeout_s,
            reject_late=runtime.reject_late,
            cpu_share=runtime.cpu_share,
            gpu_backend=runtime.gpu_backend,
        ),
    )
    return plan.stamped()


def predicted(plan: Plan, lm: LatencyModel) -> Plan:
    """The plan, as it is now (edited by hand, re-batched), with fresh predictions on every placement and without
    the simulation of what it was, recorded as describing its decisions."""
    unsimulated = [m.model_copy(update={"simulated_in_slo": None, "simulated_p99_ms": None}) for m in plan.models]
    models = predict(
        unsimulated, lm, log=lambda _: None, sharing=plan.sharing, turns=frozenset(plan.turns), devices=plan.devices
    )
    return plan.model_copy(update={"models": models}).stamped()


def repredicted(plan: Plan, lm: LatencyModel) -> Plan:
    """`predicted`, with a fresh simulation."""
    return with_simulation(predicted(plan, lm), lm).stamped()


def simulated_plan(
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    policy: str,
    plan_path: Path,
    lm: LatencyModel,
    log: Callable[[str], None] = print,
    **options,
) -> Plan:
    """`make_plan` (without an energy model) with the plan's simulation (`simulate.with_simulation`). `search` on a CPU
    cluster also chooses, by simulation, whether a model runs as copies taking turns with one device and whether
    time-sharing's plan replaces one short of its SLOs (`search_with_copies`), and where device groups leave
    `turn_threads` to the planner (`DeviceGroup.threads_open`), one setting for all of them: whether the one
    instance of a device's lowest rank runs on every core (`lightest`) or on its even part of them (`even`).
    `lightest` where that plan leaves no more models unserved, is predicted to miss no SLO the other meets, and
    answers LIGHTEST_GAIN of the offered load more within the SLOs in simulation, or no more than that less and is
    predicted to meet every SLO where the other is not (or where only it is planned at all). Where device groups
    leave `turn_priority` to the planner (`DeviceGroup.priority_open`) and the plan kept is simulated short of an
    SLO, the same search with their turns weighed alike (`equal`) takes its place where it is simulated within
    every SLO and leaves no more models unserved (`_alike_whole`). The plan's notes say when either was
    chosen, and why."""
    if policy != "search" or cluster.kind != "cpu":
        return with_simulation(make_plan(cluster, artifacts, policy, plan_path, lm, log=log, **options), lm)
    plan, said = _first_plan(lambda say: _threads_chosen(cluster, artifacts, plan_path, lm, say, **options), log)
    if cluster.open_turn_priority() and simulated_misses(plan):
        alike = _other_plan(
            lambda say: search_with_copies(
                cluster.with_turn_priority("equal"), artifacts, plan_path, lm, say, **options
            )
        )
        if alike is not None and (why := _alike_whole(plan, alike[0])):
            plan, said = _noted(*alike, why)
    for line in said:
        log(line)
    return plan


def _alike_whole(ranked: Plan, alike: Plan) -> str | None:
    """Why the plan with the turns weighed alike is kept over `ranked` (a plan ranked by SLO simulated short of an
    SLO): it is simulated within every SLO and leaves no more models unserved; else None."""
    if simulated_misses(alike) or len(alike.unserved) > len(ranked.unserved):
        return None
    return (
        "turns weighed alike (turn_priority: equal): every model simulated within its SLO, where ranked by SLO "
        f"{', '.join(m.name for m in simulated_misses(ranked))} is not"
    )


def _first_plan(planned: Callable[[Callable[[str], None]], Plan], log: Callable[[str], None]) -> tuple[Plan, list[str]]:
    """The plan `planned` makes (given where to say what it does), with what it said, to be told once a plan is
    kept; where it finds none, what it said is told to `log` and its error raised."""
    said: list[str] = []
    try:
        return planned(said.append), said
    except TritonctlError:
        for line in said:
            log(line)
        raise


def _other_plan(planned: Callable[[Callable[[str], None]], Plan]) -> tuple[Plan, list[str]] | None:
    """The plan `planned` makes (given where to say what it does), with what it said; None where it finds none (it
    serves no model, or leaves one out where --strict forbids it)."""
    said: list[str] = []
    try:
        return planned(said.append), said
    except TritonctlError:
        return None


def _noted(plan: Plan, said: list[str], why: str) -> tuple[Plan, list[str]]:
    """A plan kept over another, with `why` among its notes and after what planning it said."""
    return plan.model_copy(update={"notes": [*plan.notes, why]}), [*said, why]


def _threads_chosen(
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    plan_path: Path,
    lm: LatencyModel,
    log: Callable[[str], None],
    **options,
) -> Plan:
    """`search`'s simulated plan, with `turn_threads` chosen where device groups leave it open (`simulated_plan`)."""
    if not cluster.open_turn_threads():
        return search_with_copies(cluster, artifacts, plan_path, lm, log, **options)
    said: list[str] = []  # what the plan kept says, told once it is kept
    plan, failed = None, None
    try:
        plan = search_with_copies(cluster.with_turn_threads("even"), artifacts, plan_path, lm, said.append, **options)
    except TritonctlError as exc:
        failed = exc
    said_lightest: list[str] = []
    try:
        lightest = search_with_copies(
            cluster.with_turn_threads("lightest"), artifacts, plan_path, lm, said_lightest.append, **options
        )
    except TritonctlError:
        if failed is not None:
            for line in said:
                log(line)
            raise failed from None
        lightest = None
    offered = sum(m.rate for m in cluster.spec.models)
    why = _lightest_ahead(plan, failed, lightest, offered) if lightest is not None else None
    if why is not None:
        plan, said = _noted(lightest, said_lightest, why)
    for line in said:
        log(line)
    return plan


def _lightest_ahead(even: Plan | None, failed: Exception | None, lightest: Plan, offered: float) -> str | None:
    """Why the plan with `turn_threads: lightest` is kept over the one with `even` (None where it is not; `failed`:
    why there is no `even` plan), the cluster offering `offered` requests/s: see `simulated_plan`."""
    if even is None:
        return f"{LIGHTEST}: with turn_threads: even, {failed}"
    mine, theirs = models_predicted_to_miss(lightest), models_predicted_to_miss(even)
    if len(lightest.unserved) > len(even.unserved) or not set(mine) <= set(theirs):
        return None
    served, others = simulated_goodput(lightest), simulated_goodput(even)
    if served >= others + LIGHTEST_GAIN * offered:
        return (
            f"{LIGHTEST}: simulated {served:.1f} requests/s within the SLOs, against {others:.1f} with every instance "
            "on its even part of the cores"
        )
    if served > others - LIGHTEST_GAIN * offered and theirs and not mine:
        return (
            f"{LIGHTEST}: every model predicted within its SLO, where with every instance on its even part of the "
            f"cores {', '.join(theirs)} is not"
        )
    return None


def chosen_turn_threads(cluster: Cluster, plan: Plan) -> str:
    """The `turn_threads` a plan of `cluster` runs the CPU device groups on that leave it to the planner (`even`
    where none does): what a re-plan keeps."""
    return _chosen(cluster, plan, lambda group: group.threads_open, "turn_threads", "even")


def chosen_turn_priority(cluster: Cluster, plan: Plan) -> str:
    """The `turn_priority` a plan of `cluster` runs the CPU device groups on that leave it to the planner (`slo`
    where none does): what a re-plan keeps."""
    return _chosen(cluster, plan, lambda group: group.priority_open, "turn_priority", "slo")


def _chosen(cluster: Cluster, plan: Plan, is_open: Callable[[DeviceGroup], bool], setting: str, default: str) -> str:
    """The `setting` a plan of `cluster` runs the device groups on that `is_open` says leave it to the planner
    (`default` where none does)."""
    open_ids = {d.id for group, members in device_groups(cluster) if is_open(group) for d in members}
    return next((getattr(d, setting) for d in plan.devices if d.id in open_ids), default)


def models_predicted_to_miss(plan: Plan) -> list[str]:
    """The models a placement of which is predicted to miss its SLO."""
    return [
        m.name for m in plan.models if any(p.predicted is not None and not p.predicted.meets_slo for p in m.placements)
    ]


def search_with_copies(
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    plan_path: Path,
    lm: LatencyModel,
    log: Callable[[str], None],
    **options,
) -> Plan:
    """`search`'s plan with its simulation. Where it runs a model as several copies taking turns with one CPU
    device, the plan without copies is simulated too, and the copies are kept unless it leaves no more models
    unserved and answers more requests within their SLOs: the search judges copies by the mean slowdown of the
    cores' sharing, the simulation also by how the batches in flight slow each other. Where the plan kept is
    simulated short of an SLO, time-sharing's plan takes its place if it simulates ahead (`_turns_ahead`).
    The plan's notes say when the copies or search's plan were given up."""
    plan, said = _first_plan(
        lambda say: with_simulation(make_plan(cluster, artifacts, "search", plan_path, lm, log=say, **options), lm),
        log,
    )
    copied = sorted({m.name for m in plan.models for p in m.placements if _same_device(m, p)})
    if copied:
        single = _other_plan(
            lambda say: with_simulation(
                make_plan(cluster, artifacts, "search", plan_path, lm, log=say, copies=False, **options), lm
            )
        )
        if single is not None and len(single[0].unserved) <= len(plan.unserved):
            with_copies, one = simulated_goodput(plan), simulated_goodput(single[0])
            if one >= with_copies * (1 + SIMULATED_GAIN):
                why = (
                    f"one instance a model: simulated {one:.1f} requests/s within the SLOs, against {with_copies:.1f} "
                    f"with copies of {', '.join(copied)} taking turns"
                )
                plan, said = _noted(*single, why)
    if simulated_misses(plan):
        turns = _other_plan(
            lambda say: with_simulation(
                make_plan(cluster, artifacts, "time-sharing", plan_path, lm, log=say, **options), lm
            )
        )
        offered = sum(m.rate for m in cluster.spec.models)
        if turns is not None and (why := _turns_ahead(plan, turns[0], offered)):
            plan, said = _noted(*turns, why)
    for line in said:
        log(line)
    return plan


def _turns_ahead(searched: Plan, turns: Plan, offered: float) -> str | None:
    """Why time-sharing's plan is kept over `searched` (a search plan simulated short of its SLOs), the cluster
    offering `offered` requests/s: it answers TURNS_GAIN of that more within the SLOs in simulation; else None."""
    theirs, mine = simulated_goodput(turns), simulated_goodput(searched)
    if theirs < mine + TURNS_GAIN * offered:
        return None
    return (
        f"time-sharing's plan: simulated {theirs:.1f} requests/s within the SLOs, against {mine:.1f} with search's, "
        f"which misses {', '.join(m.name for m in simulated_misses(searched))}"
    )


def _same_device(model: PlannedModel, placement: Placement) -> bool:
    """Whether another placement of `model` is on `placement`'s device (a copy taking turns with it)."""
    return sum(p.device == placement.device for p in model.placements) > 1


def simulated_goodput(plan: Plan) -> float:
    """Requests per second a simulated plan answers within their SLOs."""
    return sum(m.rate * (m.simulated_in_slo or 0.0) for m in plan.models)


def fewest_devices(
    cluster: Cluster,
    artifacts: dict[str, Artifact],
    policy: str,
    plan_path: Path,
    lm: LatencyModel,
    log: Callable[[str], None] = print,
    policy_file: Path | None = None,
    batching: str = "fill",
) -> Plan:
    """The plan of `policy` (batching as `batching`) on the fewest of the cluster's devices that serves every model
    within its SLO at its rate, as predicted (how many GPUs do these models need?): device sets tried from the
    smallest (`device_sets`), only the kept plan's warnings printed. Where not even all of them do, the error says
    why for all of them."""
    *smaller, every = device_sets(cluster)
    plan = None
    for only in smaller:
        said: list[str] = []
        with contextlib.suppress(TritonctlError):
            plan = make_plan(
                cluster, artifacts, policy, plan_path, lm, log=said.append, strict=True, policy_file=policy_file,
                only=only, batching=batching,
            )  # fmt: skip
            for line in said:
                log(line)
            break
    if plan is None:
        plan = make_plan(
            cluster, artifacts, policy, plan_path, lm, log=log, strict=True, policy_file=policy_file, batching=batching
        )
    used = [d.id for d in plan.devices]
    log(f"fewest devices: {len(used)} of {len(every)} ({', '.join(used)}) serve every model within its SLO")
    return plan


HEADROOM = 0.85  # a device predicted busier than this has no room for bursts or for what the plan does not count


def predicted_load(plan: Plan, lm: LatencyModel | None = None) -> dict[str, float]:
    """Per device, the part of it the plan predicts busy: each placement's rate over its predicted capacity,
    weighted by the part of the device it holds; on a CPU taken in turns, the time its batches take alone on its
    threads, weighted by their part of the cores (its capacity there is what the others' batches leave it, which
    would count them again); on a GPU taken in turns, the time its batches' GPU parts hold it (less the host's
    part, `LatencyModel.host_ms`, with `lm`)."""
    load: dict[str, float] = {}
    in_turns = plan.turn_layout()
    for model in plan.models:
        for p in model.placements:
            if p.predicted is None or not p.predicted.throughput_rps:
                continue
            device = plan.device(p.device)
            if device.kind == "gpu" and plan.takes_turns(device.id):
                gpu_ms = p.predicted.exec_ms - (lm.host_ms(model.name, p.batch) if lm is not None else 0.0)
                load[p.device] = load.get(p.device, 0.0) + model.rate_of(p) * max(gpu_ms, 0.0) / (1000 * p.batch)
                continue
            if p.instance in in_turns:
                busy = model.rate_of(p) * p.predicted.exec_ms / (1000 * p.batch)
                held = in_turns[p.instance].share / device.units
            else:
                busy, held = model.rate_of(p) / p.predicted.throughput_rps, p.share / device.units
            load[p.device] = load.get(p.device, 0.0) + busy * held
    return load


def servable_scale(
    cluster: Cluster, artifacts: dict[str, Artifact], lm: LatencyModel, policy: str, steps: int = 20
) -> float:
    """The largest of 1, 0.95, ..., 0.05 times the cluster's rates that `policy` plans with every model predicted
    within its SLO, in its placements' predictions and in simulation (0 if none): what a demo on a slower CPU can
    show instead of a plan predicted to miss. Tried from the top a quarter of the steps at a time, then step by step
    down from below the last that fails (a plan that holds at a scale is taken to hold below it)."""

    def holds(i: int) -> bool:
        scaled = cluster.with_rates(lambda m, s=i / steps: m.rate * s)
        try:
            plan = simulated_plan(scaled, artifacts, policy, cluster.path.parent / "plan.yaml", lm, log=lambda _: None)
        except TritonctlError:  # no model served at this scale
            return False
        return not plan.unserved and not models_predicted_to_miss(plan) and not simulated_misses(plan)

    failed = steps + 1  # the lowest scale tried that fails (in steps)
    for top in range(steps, 0, -max(1, steps // 4)):
        if holds(top):
            break
        failed = top
    else:
        top = 0
    return next((i / steps for i in range(failed - 1, top, -1) if holds(i)), top / steps)

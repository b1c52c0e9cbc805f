"""Verbs that decide: plan, policies, simulate, bench, train, validate, schema."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tritonctl.cli import output
from tritonctl.cli.output import emit, say
from tritonctl.deploy.apply import predicted_misses, stale_note
from tritonctl.errors import TritonctlError
from tritonctl.export import check_architecture, materialize
from tritonctl.files import load_yaml, not_an_input
from tritonctl.latency.energy import clocked
from tritonctl.latency.energy import load as load_energy_model
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.compare import (
    format_rows,
    margins,
    run_ablations,
    run_policies,
    upper_bound_rps,
    write_ablation,
    write_bench,
)
from tritonctl.planning.plan import Plan, PlannedModel, load_plan, save_plan
from tritonctl.planning.planner import (
    HEADROOM,
    check_latency_model,
    describe_device,
    fewest_devices,
    make_plan,
    on_another_cpu,
    other_cpu_note,
    predicted_load,
    repredicted,
    simulated_plan,
    sources_of,
    speaks_for,
    warn_changed_exports,
)
from tritonctl.planning.policies import POLICIES
from tritonctl.planning.policies.inss import default_policy_file
from tritonctl.planning.simulate import format_sim, read_trace, simulate, simulated_misses, with_simulation
from tritonctl.spec import Cluster, ClusterSpec, load_cluster
from tritonctl.triton.render import verified_onnx


def _plan(
    cluster_arg: str | Cluster,
    policy: str,
    output: str | None,
    latency_model: str | None = None,
    strict: bool = False,
    policy_file: str | None = None,
    margin: float = 0.0,
    minimise: str | None = None,
    energy_model: str | None = None,
    batching: str = "fill",
) -> Path:
    cluster = cluster_arg if isinstance(cluster_arg, Cluster) else load_cluster(cluster_arg)
    out = Path(output) if output else cluster.path.parent / "plan.yaml"
    others = {"the latency model": latency_model, "the energy model": energy_model, "the trained policy": policy_file}
    inputs = [("the cluster file", cluster.path), *((what, Path(path)) for what, path in others.items() if path)]
    inputs += [(f"model {m.name}'s source", cluster.resolve(m.source)) for m in cluster.spec.models if m.is_onnx_file]
    not_an_input(out, inputs)
    if margin and not latency_model:
        raise TritonctlError("a latency margin needs a latency model", field="--latency-margin")
    lm = load_latency_model(latency_model) if latency_model else None  # read before the exports take their time
    if lm is not None:
        check_latency_model(cluster, lm, Path(latency_model), say)
    energy = load_energy_model(energy_model) if energy_model else None
    say(f"models of {cluster.spec.name}:")
    artifacts = materialize(cluster, log=say)
    if lm is not None:
        warn_changed_exports(cluster, artifacts, lm, say)
        lm = lm.with_margin(margin)
    trained = Path(policy_file) if policy_file else None
    if minimise:  # "devices", the one objective offered
        plan = fewest_devices(cluster, artifacts, policy, out, lm, log=say, policy_file=trained, batching=batching)
    elif lm is not None and energy is None:
        plan = simulated_plan(
            cluster, artifacts, policy, out, lm, log=say, strict=strict, policy_file=trained, batching=batching
        )
    else:
        plan = make_plan(
            cluster, artifacts, policy, out, lm, log=say, strict=strict, policy_file=trained, energy=energy,
            batching=batching,
        )  # fmt: skip
    if lm is not None and (minimise or energy is not None):
        clock = plan.devices[0].clock_mhz
        plan = with_simulation(plan, lm if clock is None else clocked(lm, energy, clock, sources_of(cluster)))
    if margin:
        note = (
            f"planned with a latency margin of {100 * margin:g}%: its predictions and simulation are of batches "
            f"{1 + margin:g} x as long as {latency_model} predicts"
        )
        plan = plan.model_copy(update={"notes": [*plan.notes, note]})
        say(f"note: {note}")
    save_plan(plan, out)
    say(f"plan ({plan.policy}) written to {out}")
    for model, placement in plan.instances():
        device = plan.device(placement.device)
        line = (
            f"  {placement.instance:24} {placement.device:6} share {placement.share:>3}/{device.units} "
            f"batch {placement.batch:>2}  port {model.port}"
        )
        if placement.predicted:
            pred = placement.predicted
            p99 = f"{pred.latency_ms:.1f} ms" if pred.latency_ms is not None else "overloaded"
            line += f"  batch {pred.exec_ms:.1f} ms, p99 {p99}, simulated {_simulated(model)} (SLO {model.slo_ms:g})"
            line += f", max {pred.throughput_rps:.0f}/s"
            if pred.joules_per_request is not None:
                line += f", {1000 * pred.joules_per_request:.1f} mJ/request at {device.clock_mhz} MHz"
        say(line)
    ranked = {name: turn for name, turn in plan.turn_layout().items() if turn.rank is not None}
    if ranked:
        say(
            "instances taking turns with a CPU run by their SLO's rank (0 first; a rank runs on the cores "
            "the higher ones leave): "
            + ", ".join(
                f"{name} {turn.rank}" + (f" on {turn.threads} threads" if turn.threads > 1 else "")
                for name, turn in ranked.items()
            )
        )
    for model in simulated_misses(plan):
        if all(p.predicted.meets_slo for p in model.placements):
            say(
                f"WARNING: {model.name}: predicted within its SLO, but simulated {100 * model.simulated_in_slo:.1f}% "
                f"of its requests within {model.slo_ms:g} ms, p99 {_simulated(model)} (batch times vary, and an "
                "idle instance wakes up slower than a busy one)"
            )
    for model in plan.unserved:
        say(f"  NOT SERVED {model.name}: {model.reason}")
    for device, load in sorted(predicted_load(plan, lm).items()):
        if load > HEADROOM:
            say(
                f"WARNING: {device} is predicted {100 * load:.0f}% busy: no headroom for bursts or for the work the "
                "plan does not count (clients, the system); reserve cores (devices[].reserved_cores), lower "
                "the rates or add devices"
            )
    return out


def _simulated(model: PlannedModel) -> str:
    """The model's simulated p99 as the plan's lines show it."""
    if model.simulated_in_slo is None:
        return "nothing (no traffic)"
    return "overloaded" if model.simulated_p99_ms is None else f"{model.simulated_p99_ms:.1f} ms"


def cmd_plan(args) -> int:
    if args.minimise and not args.latency_model:
        raise TritonctlError(
            "--minimise devices needs a latency model: without one nothing says which devices are enough",
            field="--latency-model",
        )
    if (args.objective == "energy") != bool(args.energy_model):
        raise TritonctlError(
            "--objective energy and --energy-model go together (tritonctl fit-energy writes an energy model)",
            field="--energy-model",
        )
    cluster = load_cluster(args.cluster)
    if args.batching is None:  # measured on a GPU: eager answers sooner and, in turns, carries more (docs/gpu.md)
        gpu = cluster.kind == "gpu" and args.latency_model and args.objective == "throughput"
        args.batching = "eager" if gpu else "fill"
    if args.batching != "fill" and (not args.latency_model or args.objective == "energy"):
        raise TritonctlError(
            f"--batching {args.batching} needs a latency model and the throughput objective (energy sizes batches "
            "itself)",
            field="--batching",
        )
    if args.objective == "energy" and (args.minimise or not args.latency_model):
        raise TritonctlError(
            "--objective energy needs a latency model and plans the devices it is given (no --minimise)",
            field="--objective",
        )
    policy = args.policy or ("search" if args.latency_model else "spread")
    if args.policy_file and not POLICIES[policy].trained:
        raise TritonctlError(f"a trained policy is for --policy inss, not {policy}", field="--policy-file")
    if POLICIES[policy].latency_model and not args.latency_model:
        raise TritonctlError(
            f"policy {policy} needs a fitted latency model (spread is the only policy without one)",
            field="--latency-model",
        )
    out = _plan(
        cluster, policy, args.output, args.latency_model, args.strict, args.policy_file, args.latency_margin,
        args.minimise, args.energy_model, args.batching,
    )  # fmt: skip
    if output.JSON:
        emit({"path": str(out), "plan": load_plan(out).plan.model_dump(mode="json")})
    return 0


def cmd_simulate(args) -> int:
    loaded = load_plan(args.plan)
    lm = load_latency_model(args.latency_model)
    missing = [m.name for m in loaded.plan.models if m.name not in lm.models]
    if missing:
        raise TritonctlError(f"models {missing} are not in the latency model", file=args.latency_model)
    for device in loaded.plan.devices:
        if not speaks_for(lm, device.kind, device.units, device.cores, device.units):
            raise TritonctlError(
                f"fitted for {describe_device(lm.device.kind, lm.device.units, lm.device.cores)}; the plan's "
                f"{device.id} is {describe_device(device.kind, device.units, device.cores)}",
                file=args.latency_model,
                field="device",
            )
    if loaded.plan.target == "cpu" and on_another_cpu(lm):
        say(other_cpu_note(args.latency_model, lm))
    trace = None
    if args.trace:
        trace = read_trace(Path(args.trace))
        served = {m.name for m in loaded.plan.models}
        unknown = sorted(set(trace) - served)
        if not set(trace) & served:
            raise TritonctlError(
                f"no request is for a model of the plan (it names {', '.join(unknown) or 'none'})", file=args.trace
            )
        if unknown:
            say(f"WARNING: the trace has requests for models the plan does not serve: {', '.join(unknown)}")
        late = sum(int((times >= 1000 * args.duration).sum()) for times in trace.values())
        if late:
            total = sum(len(times) for times in trace.values())
            say(f"WARNING: {late} of the trace's {total} requests come at or after --duration {args.duration:g} s: "
                "they are not simulated")  # fmt: skip
    if args.update:
        if loaded.plan.target == "cpu" and on_another_cpu(lm):  # apply would trust what another CPU predicts
            raise TritonctlError(
                "made on another CPU: its predictions would not speak for the plan here; calibrate it to this CPU "
                "first (`tritonctl calibrate`)",
                file=args.latency_model,
            )
        save_plan(repredicted(loaded.plan, lm), loaded.path)
        say(f"{loaded.path}: predictions and simulation written for the plan as it is now")
        loaded = load_plan(loaded.path)
    elif note := stale_note(loaded):
        say(note)
    result = simulate(
        loaded.plan, lm, args.duration, args.seed, args.drop, args.rate_scale, trace, latency_error=args.latency_error
    )
    if output.JSON:
        emit({**dataclasses.asdict(result), "throughput_rps": result.throughput, "goodput_rps": result.goodput})
    else:
        say(format_sim(result))
    return 0


def cmd_bench(args) -> int:
    cluster = load_cluster(args.cluster)
    lm = load_latency_model(args.latency_model)
    check_latency_model(cluster, lm, Path(args.latency_model), say, deploys_here=False)
    artifacts = materialize(cluster, log=lambda _: None)
    warn_changed_exports(cluster, artifacts, lm, say)
    unknown = [p for p in args.policies or [] if p not in POLICIES]
    if unknown:
        raise TritonctlError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    out = Path(args.output) if args.output else cluster.path.parent / "bench"
    policy_file = Path(args.policy_file) if args.policy_file else default_policy_file(cluster.spec.name)
    if args.ablate and args.batching != "fill":
        raise TritonctlError("--ablate plans with fill batching: leave --batching out", field="--batching")
    if args.ablate:
        rows = run_ablations(cluster, artifacts, lm, out, args.duration)
        path = write_ablation(rows, cluster, args.duration, out)
        if output.JSON:
            emit({"output": str(path), "rows": [dataclasses.asdict(row) for row in rows]})
            return 0
        say(format_rows(rows))
        say(f"written to {path}")
        return 0
    policies = args.policies
    if args.policies is None:  # every policy; inss where a policy was trained for this cluster
        policies = [p for p in POLICIES if not POLICIES[p].trained or policy_file.is_file()]
        if len(policies) < len(POLICIES):
            say(f"note: inss left out: no trained policy {policy_file} (tritonctl train)")
    energy = load_energy_model(args.energy_model) if args.energy_model else None
    rows = run_policies(
        cluster, artifacts, lm, policies, out, args.duration, policy_file=policy_file, margin=args.latency_margin,
        energy=energy, log=say, batching=args.batching,
    )  # fmt: skip
    write_bench(rows, upper_bound_rps(cluster, lm), cluster, args.duration, out, args.latency_margin, args.batching)
    if output.JSON:
        emit({"output": str(out), "rows": [dataclasses.asdict(row) for row in rows]})
    else:
        say(format_rows(rows))
        say(margins(rows))
        say(f"table, plans and plot written to {out}")
    return 1 if all(row.error for row in rows) else 0


def cmd_train(args) -> int:
    cluster = load_cluster(args.cluster)
    lm = load_latency_model(args.latency_model)
    out = Path(args.output) if args.output else Path("rl") / "runs" / cluster.spec.name
    policy_file = Path(args.policy_file) if args.policy_file else default_policy_file(cluster.spec.name)
    sac_only = [f"--{k}" for k in ("episodes", "resume", "init") if getattr(args, k) not in (None, False)]
    imitate_only = [f"--{k}" for k in ("demonstrations", "epochs") if getattr(args, k) is not None]
    wrong, other = (sac_only, "sac") if args.method == "imitate" else (imitate_only, "imitate")
    if wrong:
        raise TritonctlError(f"{' and '.join(wrong)}: only with --method {other}, not {args.method}")
    if args.method == "imitate":
        from tritonctl.rl.imitate import ImitationConfig, imitate  # torch loads only for training

        config = ImitationConfig(seed=args.seed)
        for key, least in (("demonstrations", 10), ("epochs", 1)):  # a tenth of the demonstrations is held out
            if getattr(args, key) is not None:
                if getattr(args, key) < least:
                    raise TritonctlError(f"--{key} must be at least {least}, not {getattr(args, key)}")
                setattr(config, key, getattr(args, key))
        imitate(cluster, lm, out, policy_file, config, log=say)
        return 0
    from tritonctl.rl.train import TrainConfig, fine_tuning_sac, train, training_sac

    init = Path(args.init) if args.init else None
    config = TrainConfig(seed=args.seed, sac=fine_tuning_sac() if init else training_sac())
    if args.episodes is not None:
        config.episodes = args.episodes
    rows = train(cluster, lm, out, policy_file, config, resume=args.resume, log=say, init=init)
    last = rows[-max(1, len(rows) // 10) :]
    say(
        f"last {len(last)} episodes: reward {sum(r['reward'] for r in last) / len(last):.2f}, "
        f"SLO violations {100 * sum(r['violation'] for r in last) / len(last):.2f}%, "
        f"{rows[-1]['wall_s']:.0f} s of training"
    )
    return 0


def cmd_policies(args) -> int:
    for name, info in POLICIES.items():
        say(f"{name:14} {info.help}")
    return 0


def cmd_validate(args) -> int:
    """Check a cluster or plan file as every verb would, touching nothing."""
    path = Path(args.file)
    raw = load_yaml(path)
    if isinstance(raw, dict) and "cluster_file" in raw:
        loaded = load_plan(path)
        for model in loaded.plan.models:
            verified_onnx(loaded, model)
        misses = predicted_misses(loaded.plan)
        say(
            f"{path}: a valid plan of cluster {loaded.plan.cluster} "
            f"({sum(1 for _ in loaded.plan.instances())} instance(s), {len(loaded.plan.models)} model(s))"
        )
        for miss in misses:
            say(f"  predicted to miss: {miss} (apply refuses it without --accept-misses)")
        if note := stale_note(loaded):
            say(f"  {note}")
        cluster_file = loaded.resolve(loaded.plan.cluster_file)
        if not cluster_file.is_file():
            say(f"  note: its cluster file {cluster_file} is not there; `controller` re-plans from it")
        return 0
    cluster = load_cluster(path)
    for i, model in enumerate(cluster.spec.models):
        if not model.is_onnx_file:
            check_architecture(model.source, file=path, field=f"models[{i}].source")
    materialize(cluster, log=lambda _: None, files_only=True)  # the ONNX files opened and checked, none exported
    say(
        f"{path}: a valid cluster file ({len(cluster.spec.models)} model(s), {len(cluster.spec.devices)} device "
        "group(s))"
    )
    return 0


def cmd_schema(args) -> int:
    """Print the JSON Schema of the cluster file (or the plan file)."""
    model = Plan if args.plan else ClusterSpec
    print(json.dumps(model.model_json_schema(), indent=2))
    return 0

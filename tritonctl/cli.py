"""The tritonctl command line: each stage of spec -> plan -> render -> apply runs on its own."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from tritonctl.apply import apply_plan, down, predicted_misses
from tritonctl.bench import format_rows, margins, run_policies, upper_bound_rps, write_bench
from tritonctl.client import endpoints, format_results, run_load
from tritonctl.compose import host_gpu_count, write_compose
from tritonctl.controller import Controller, ControllerConfig, load_controller_state
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.files import check_output_dir, load_yaml
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.model import load_latency_model
from tritonctl.latency.report import write_report
from tritonctl.perf_analyzer import find_perf_analyzer, run_perf_analyzer
from tritonctl.plan import LoadedPlan, Plan, load_plan, save_plan
from tritonctl.planner import HEADROOM, check_latency_model, make_plan, predicted_load, servable_scale
from tritonctl.policies import POLICIES
from tritonctl.policies.inss import default_policy_file
from tritonctl.profiler.calibrate import calibrate, median_abs
from tritonctl.profiler.dataset import load_dataset
from tritonctl.profiler.device import cpu_fingerprint
from tritonctl.profiler.run import profile
from tritonctl.render import render
from tritonctl.runtime import share
from tritonctl.runtime.base import Runtime
from tritonctl.runtime.binary import find_tritonserver
from tritonctl.runtime.compose import CommandRunner, ComposeRuntime
from tritonctl.runtime.local import LocalRuntime, port_is_free
from tritonctl.simulate import format_sim, read_trace, simulate
from tritonctl.spec import Cluster, ClusterSpec, load_cluster
from tritonctl.state import State, load_state

REPO = Path(__file__).resolve().parent.parent
DEMO_CLUSTER = REPO / "examples" / "cpu-demo" / "cluster.yaml"
DEMO_MARGIN = 0.15  # the demo runs at rates its plan serves with batches 15% slower than predicted


_JSON = False  # --format json: stdout carries one JSON document, the progress lines go to stderr


def _say(message: str) -> None:
    print(message, file=sys.stderr if _JSON else sys.stdout, flush=True)


def _emit(data) -> None:
    """The command's result as JSON on stdout (--format json)."""
    print(json.dumps(data, indent=2, default=str))


def _output_file(text: str) -> str:
    """argparse type of an -o naming a file to write: not a folder, in a folder that can hold it."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: name the file to write")
    _output_folder(str(Path(text).parent))
    return text


def _output_folder(text: str) -> str:
    """argparse type of an -o naming a folder to write into: a folder (or none yet) that tritonctl can write."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    try:
        check_output_dir(Path(text), file=None, field=None, writable=True)
    except TritonctlError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def cmd_export(args) -> int:
    cluster = load_cluster(args.cluster)
    _say(f"exporting models of {cluster.spec.name}:")
    for name, artifact in materialize(cluster, log=_say).items():
        _say(f"  {name}: {artifact.weights_mb:.1f} MB of weights, sha256 {artifact.sha256[:12]}")
    return 0


def _plan(
    cluster_arg: str | Cluster,
    policy: str,
    output: str | None,
    latency_model: str | None = None,
    strict: bool = False,
    policy_file: str | None = None,
    margin: float = 0.0,
) -> Path:
    cluster = cluster_arg if isinstance(cluster_arg, Cluster) else load_cluster(cluster_arg)
    out = Path(output) if output else cluster.path.parent / "plan.yaml"
    _say(f"models of {cluster.spec.name}:")
    artifacts = materialize(cluster, log=_say)
    lm = None
    if latency_model:
        lm = load_latency_model(latency_model)
        check_latency_model(cluster, artifacts, lm, Path(latency_model), _say)
        lm = lm.with_margin(margin)
    elif margin:
        raise TritonctlError("a latency margin needs a latency model", field="--latency-margin")
    trained = Path(policy_file) if policy_file else None
    plan = make_plan(cluster, artifacts, policy, out, lm, log=_say, strict=strict, policy_file=trained)
    save_plan(plan, out)
    _say(f"plan ({policy}) written to {out}")
    for model, placement in plan.instances():
        device = plan.device(placement.device)
        line = (
            f"  {placement.instance:24} {placement.device:6} share {placement.share:>3}/{device.units} "
            f"batch {placement.batch:>2}  port {model.port}"
        )
        if placement.predicted:
            pred = placement.predicted
            p99 = f"{pred.latency_ms:.1f} ms" if pred.latency_ms is not None else "overloaded"
            line += f"  batch {pred.exec_ms:.1f} ms, p99 {p99} (SLO {model.slo_ms:g}), max {pred.throughput_rps:.0f}/s"
        _say(line)
    for model in plan.unserved:
        _say(f"  NOT SERVED {model.name}: {model.reason}")
    for device, load in sorted(predicted_load(plan).items()):
        if load > HEADROOM:
            _say(
                f"WARNING: {device} is predicted {100 * load:.0f}% busy: no headroom for bursts or for the work the "
                "plan does not count (proxy, clients, the system); reserve cores (devices[].reserved_cores), lower "
                "the rates or add devices"
            )
    return out


def _calibrated_path(source: Path, folder: Path) -> Path:
    """Where `source` calibrated to this CPU goes in `folder`: named after this CPU's fingerprint."""
    return folder / f"{source.stem}.{cpu_fingerprint()['id']}.json"


def _calibrate(cluster_arg: str, source: Path, output: Path) -> Path:
    """Calibrate `source` to this CPU for the cluster's models, write it to `output` and print its errors."""
    cluster = load_cluster(cluster_arg)
    calibrated, points = calibrate(cluster, load_latency_model(source), source, log=_say)
    calibrated.save(output)
    checks = [p for p in points if not p.fitted]
    factors = calibrated.meta["calibrated"]["factors"]
    _say("running time x " + ", ".join(f"{name} {k:.2f} * batch^{g:.2f}" for name, (k, g) in factors.items()))
    _say(
        f"held-out points ({len(checks)}): median |error| {100 * median_abs([p.error_before for p in checks]):.1f}% "
        f"before, {100 * median_abs([p.error_after for p in checks]):.1f}% after; worst after "
        f"{100 * max(abs(p.error_after) for p in checks):.1f}%"
    )
    _say(f"calibrated latency model written to {output} ({calibrated.meta['calibrated']['seconds']:.0f} s)")
    return output


def cmd_calibrate(args) -> int:
    source = Path(args.latency_model)
    _calibrate(args.cluster, source, Path(args.output) if args.output else _calibrated_path(source, source.parent))
    return 0


def cmd_profile(args) -> int:
    cluster = load_cluster(args.cluster)
    out = Path(args.output) if args.output else cluster.path.parent / "profile"
    dataset = profile(cluster, out, args.budget, log=_say)
    state = "complete" if dataset.metadata["complete"] else "incomplete (run again to resume)"
    _say(f"profile {state}: {len(dataset.rows)} measurements in {out} ({dataset.metadata['duration_s']:.0f} s)")
    return 0


def cmd_plan(args) -> int:
    policy = args.policy or ("search" if args.latency_model else "spread")
    out = _plan(
        args.cluster, policy, args.output, args.latency_model, args.strict, args.policy_file, args.latency_margin
    )
    if _JSON:
        _emit({"path": str(out), "plan": load_plan(out).plan.model_dump(mode="json")})
    return 0


def cmd_fit(args) -> int:
    dataset = load_dataset(args.profile)
    out = Path(args.output) if args.output else dataset.folder / "latency-model.json"
    _say(f"fitting {dataset.folder} ({len(dataset.rows)} measurements):")
    model = fit_latency_model(dataset, log=_say)
    model.save(out)
    _say(f"latency model written to {out}")
    if args.report:
        _report(dataset, out, dataset.folder / "report")
    return 0


def _report(dataset, model_path: Path, out: Path) -> None:
    figures = write_report(load_latency_model(model_path), dataset, out)
    _say(f"report written to {out / 'report.md'}")
    _say(
        f"  held-out solo:       InSS-style {figures['solo_inss']}\n"
        f"                       linear     {figures['solo_linear']}"
    )
    _say(
        f"  held-out co-located: InSS-style {figures['coloc_inss']}\n"
        f"                       Gpulet     {figures['coloc_gpulet']}\n"
        f"                       linear     {figures['coloc_linear']}"
    )
    _say(f"  cache proxy vs slowdown r = {figures['proxy_r']:.2f}; prediction {figures['cost_us']:.1f} us/query")


def cmd_report(args) -> int:
    dataset = load_dataset(args.profile)
    model_path = Path(args.model) if args.model else dataset.folder / "latency-model.json"
    _report(dataset, model_path, Path(args.output) if args.output else dataset.folder / "report")
    return 0


def cmd_simulate(args) -> int:
    loaded = load_plan(args.plan)
    lm = load_latency_model(args.latency_model)
    missing = [m.name for m in loaded.plan.models if m.name not in lm.models]
    if missing:
        raise TritonctlError(f"models {missing} are not in the latency model", file=args.latency_model)
    trace = None
    if args.trace:
        trace = read_trace(Path(args.trace))
        unknown = sorted(set(trace) - {m.name for m in loaded.plan.models})
        if unknown:
            _say(f"WARNING: the trace has requests for models the plan does not serve: {', '.join(unknown)}")
    result = simulate(
        loaded.plan, lm, args.duration, args.seed, args.drop, args.rate_scale, trace, latency_error=args.latency_error
    )
    if _JSON:
        _emit({**dataclasses.asdict(result), "throughput_rps": result.throughput, "goodput_rps": result.goodput})
    else:
        _say(format_sim(result))
    return 0


def cmd_bench(args) -> int:
    cluster = load_cluster(args.cluster)
    lm = load_latency_model(args.latency_model)
    artifacts = materialize(cluster, log=lambda _: None)
    check_latency_model(cluster, artifacts, lm, Path(args.latency_model), _say, deploys_here=False)
    unknown = [p for p in args.policies or [] if p not in POLICIES]
    if unknown:
        raise TritonctlError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    out = Path(args.output) if args.output else cluster.path.parent / "bench"
    policy_file = Path(args.policy_file) if args.policy_file else default_policy_file(cluster.spec.name)
    policies = args.policies
    if args.policies is None:  # every policy; inss where a policy was trained for this cluster
        policies = [p for p in POLICIES if not POLICIES[p].trained or policy_file.is_file()]
        if len(policies) < len(POLICIES):
            _say(f"note: inss left out: no trained policy {policy_file} (tritonctl train)")
    rows = run_policies(
        cluster, artifacts, lm, policies, out, args.duration, policy_file=policy_file, margin=args.latency_margin
    )
    write_bench(rows, upper_bound_rps(cluster, lm), cluster, args.duration, out, args.latency_margin)
    if _JSON:
        _emit({"output": str(out), "rows": [dataclasses.asdict(row) for row in rows]})
        return 0
    _say(format_rows(rows))
    _say(margins(rows))
    _say(f"table, plans and plot written to {out}")
    return 0


def cmd_train(args) -> int:
    from tritonctl.rl.train import TrainConfig, train  # torch loads only for training

    cluster = load_cluster(args.cluster)
    lm = load_latency_model(args.latency_model)
    out = Path(args.output) if args.output else Path("rl") / "runs" / cluster.spec.name
    policy_file = Path(args.policy_file) if args.policy_file else default_policy_file(cluster.spec.name)
    config = TrainConfig(seed=args.seed)
    if args.episodes is not None:
        config.episodes = args.episodes
    rows = train(cluster, lm, out, policy_file, config, resume=args.resume, log=_say)
    last = rows[-max(1, len(rows) // 10) :]
    _say(
        f"last {len(last)} episodes: reward {sum(r['reward'] for r in last) / len(last):.2f}, "
        f"SLO violations {100 * sum(r['violation'] for r in last) / len(last):.2f}%, "
        f"{rows[-1]['wall_s']:.0f} s of training"
    )
    return 0


def cmd_policies(args) -> int:
    for name, info in POLICIES.items():
        _say(f"{name:14} {info.help}")
    return 0


def cmd_render(args) -> int:
    loaded = load_plan(args.plan)
    if args.target == "compose":
        gpus = args.gpus if args.gpus is not None else host_gpu_count()
        if gpus is None:
            _say("note: no GPU found here (or no pynvml): the plan's GPUs are not checked; pass --gpus N to check")
        out = Path(args.output) if args.output else loaded.path.parent / "compose"
        project = write_compose(loaded, out, gpus)
        for name, service in project.services.items():
            _say(f"  {name:24} {service.name}  (GPU {service.device_index}, MPS {service.launch.share}%)")
        _say(
            f"Compose project {project.name} written to {out}; on the GPU host: (cd {out} && docker compose up -d) "
            f"&& tritonctl apply {loaded.path} --runtime compose --compose-dir {out}"
        )
        return 0
    for name, (folder, launch) in render(loaded).items():
        _say(f"  {name:24} {folder}  ({launch.kind}, share {launch.share}/{launch.units})")
    return 0


def _runtime(
    loaded: LoadedPlan, name: str, compose_dir: str | None, dry_run: bool = False, starts: bool = True
) -> Runtime:
    """The runtime `name` for the plan; `starts`: it will start instances (the local one needs tritonserver)."""
    if name == "compose":
        folder = Path(compose_dir) if compose_dir else loaded.path.parent / "compose"
        return ComposeRuntime(folder, CommandRunner(dry_run=dry_run, log=_say), host_gpu_count() if starts else None)
    if not starts:
        return LocalRuntime(None, loaded.state_dir)
    if loaded.plan.target == "gpu":
        raise TritonctlError(
            "this plan targets GPUs; the local runtime runs CPU plans (on a GPU host: render it with "
            "--target compose and use --runtime compose)",
            file=loaded.path,
            field="target",
        )
    return LocalRuntime(find_tritonserver(loaded.plan.runtime.tritonserver), loaded.state_dir)


def _applied_runtime(args, loaded: LoadedPlan, state: State) -> Runtime:
    """The runtime the state says applied the plan (to look at or stop what runs)."""
    return _runtime(loaded, state.runtime, args.compose_dir, getattr(args, "dry_run", False), starts=False)


def _apply(
    plan_path: Path,
    dry_run: bool = False,
    runtime_name: str = "local",
    compose_dir: str | None = None,
    accept_misses: bool = False,
) -> int:
    """Apply the plan; how many instances it changed (in a dry run: would change)."""
    loaded = load_plan(plan_path)
    misses = predicted_misses(loaded.plan)
    if misses and not accept_misses:
        raise TritonctlError(
            f"the plan is predicted to miss SLOs ({'; '.join(misses)}); lower the rates, add devices or "
            "re-plan, or deploy it anyway with --accept-misses",
            file=loaded.path,
        )
    runtime = _runtime(loaded, runtime_name, compose_dir, dry_run)
    if isinstance(runtime, ComposeRuntime):
        _say(f"applying {loaded.path} through the Compose project in {runtime.folder}")
        if dry_run:
            _say("dry run: the docker commands and HTTP calls below are printed, not made")
    else:
        _say(f"applying {loaded.path} with tritonserver from {runtime.binary.source} ({runtime.binary.path})")
        if share.mechanism() == "none":
            _say("WARNING: no writable cgroup here: CPU shares are NOT enforced, instances compete freely")
    started = time.monotonic()
    steps = apply_plan(loaded, runtime, log=_say, dry_run=dry_run)
    changed = sum(step.action != "keep" for step in steps)
    verb = "would change" if dry_run else "changed"
    _say(f"{verb} {changed} instance(s), kept {len(steps) - changed}, in {time.monotonic() - started:.1f} s")
    return changed


def cmd_apply(args) -> int:
    """Exit 0; with --dry-run, 1 when something would change (as `kubectl diff` does)."""
    changed = _apply(Path(args.plan), args.dry_run, args.runtime, args.compose_dir, args.accept_misses)
    return int(args.dry_run and changed > 0)


def cmd_validate(args) -> int:
    """Check a cluster or plan file as every verb would, touching nothing."""
    path = Path(args.file)
    raw = load_yaml(path)
    if isinstance(raw, dict) and "cluster_file" in raw:
        loaded = load_plan(path)
        misses = predicted_misses(loaded.plan)
        _say(
            f"{path}: a valid plan of cluster {loaded.plan.cluster} "
            f"({sum(1 for _ in loaded.plan.instances())} instance(s), {len(loaded.plan.models)} model(s))"
        )
        for miss in misses:
            _say(f"  predicted to miss: {miss} (apply refuses it without --accept-misses)")
        return 0
    cluster = load_cluster(path)
    _say(
        f"{path}: a valid cluster file ({len(cluster.spec.models)} model(s), {len(cluster.spec.devices)} device "
        "group(s))"
    )
    return 0


def cmd_schema(args) -> int:
    """Print the JSON Schema of the cluster file (or the plan file)."""
    model = Plan if args.plan else ClusterSpec
    print(json.dumps(model.model_json_schema(), indent=2))
    return 0


def cmd_controller(args) -> int:
    loaded = load_plan(args.plan)
    if args.policy not in POLICIES:
        raise TritonctlError(f"unknown policy {args.policy!r}; known: {', '.join(POLICIES)}")
    runtime = _runtime(loaded, args.runtime, args.compose_dir)
    if args.latency_margin and not args.latency_model:
        raise TritonctlError("a latency margin needs a latency model", field="--latency-margin")
    lm = load_latency_model(args.latency_model).with_margin(args.latency_margin) if args.latency_model else None
    if lm is None:
        _say("note: no --latency-model: the controller follows the plan file and reports rates, but does not re-plan")
    cfg = ControllerConfig(interval_s=args.interval, threshold=args.threshold, cooldown_s=args.cooldown)
    if not 0 <= args.port <= 65535 or (args.port and not port_is_free(args.host, args.port)):
        raise TritonctlError(f"cannot serve the controller's state on {args.host}:{args.port}", field="--port")
    controller = Controller(loaded.path, runtime, lm, args.policy, cfg, log=_say)
    server = controller.serve(args.host, args.port)
    _say(
        f"controller running: state http://{args.host}:{server.server_port}/state, "
        f"metrics http://{args.host}:{server.server_port}/metrics; Ctrl-C stops the controller "
        "(the instances keep serving; `tritonctl down` stops them)"
    )
    stop = threading.Event()
    try:
        controller.run(stop)
    finally:
        server.shutdown()
    return 0


def _controller_status(state_dir: Path) -> None:
    ctl = load_controller_state(state_dir)
    if ctl is None:
        return
    _say(f"controller: {ctl.applies} change(s) applied, policy {ctl.policy}, current plan {ctl.plan}")
    if ctl.target:
        _say(f"  applying now: {ctl.target}" + (f" (last step: {ctl.steps[-1]})" if ctl.steps else ""))
    for model, planned in sorted(ctl.planned_rates.items()):
        estimate = ctl.estimated_rates.get(model)
        queue = ctl.queue_ms.get(model)
        _say(
            f"  {model:18} planned {planned:7.1f} req/s, measured "
            + ("   -   " if estimate is None else f"{estimate:7.1f}")
            + (f", queue {queue:.1f} ms" if queue is not None else "")
        )
    for decision in ctl.decisions[-3:]:
        when = time.strftime("%H:%M:%S", time.localtime(decision["time"]))
        _say(f"  {when} {decision['kind']:8} {decision['reason']} ({decision['took_s']:g} s)")


def cmd_status(args) -> int:
    loaded = load_plan(args.plan)
    state = load_state(loaded.state_dir)
    runtime = _applied_runtime(args, loaded, state) if state.instances else None
    health = {uid: runtime.health(rec).label for uid, rec in state.instances.items()} if runtime else {}
    router_ok = runtime.router_ok() if runtime else None
    unhealthy = sum(label != "ready" for label in health.values()) + (router_ok is False)
    if _JSON:
        ctl = load_controller_state(loaded.state_dir)
        _emit(
            {
                "cluster": state.cluster,
                "plan": state.plan,
                "runtime": state.runtime,
                "instances": [
                    {**dataclasses.asdict(rec), "health": health[uid]} for uid, rec in sorted(state.instances.items())
                ],
                "router_ok": router_ok,
                "controller": dataclasses.asdict(ctl) if ctl else None,
            }
        )
        return 1 if unhealthy else 0
    _controller_status(loaded.state_dir)
    if not state.instances:
        _say(f"no instances running for {loaded.plan.cluster} (state in {loaded.state_dir})")
        return 0
    _say(f"cluster {state.cluster}, applied from {state.plan} by the {state.runtime} runtime")
    _say(
        f"{'instance':24} {'model':16} {'device':6} {'share':>7} {'grpc':>6} {'http':>6} {'metrics':>7} "
        f"{'pid':>7} {'health':9} share enforcement"
    )
    for uid, rec in sorted(state.instances.items(), key=lambda item: item[1].instance):
        _say(
            f"{rec.instance:24} {rec.model:16} {rec.device:6} {f'{rec.share}/{rec.units}':>7} {rec.grpc_port:>6} "
            f"{rec.http_port:>6} {rec.metrics_port:>7} {rec.pid:>7} {health[uid]:9} {rec.share_mechanism}"
        )
    if router_ok is False:
        _say("router: NOT answering: clients cannot reach the models; `tritonctl apply` restarts it")
    return 1 if unhealthy else 0


def cmd_endpoints(args) -> int:
    targets = endpoints(load_plan(args.plan).plan)
    if _JSON:
        _emit([dataclasses.asdict(ep) for ep in targets])
        return 0
    _say(f"{'model':18} {'gRPC address':22} input")
    for ep in targets:
        _say(
            f"{ep.model:18} {ep.url:22} {ep.input_name} {ep.input_dtype}[batch, {', '.join(map(str, ep.input_shape))}]"
        )
    return 0


def cmd_down(args) -> int:
    loaded = load_plan(args.plan)
    runtime = _applied_runtime(args, loaded, load_state(loaded.state_dir))
    count = down(loaded.state_dir, runtime, log=_say, dry_run=args.dry_run)
    _say(f"{'would stop' if args.dry_run else 'stopped'} {count} instance(s)")
    return 0


def _load(plan_path: Path, duration: float, rate_scale: float, tool: str = "tritonctl") -> int:
    loaded = load_plan(plan_path)
    targets = endpoints(loaded.plan)
    pa = find_perf_analyzer() if tool == "perf_analyzer" else None  # before any traffic: a missing tool says so
    _say(
        f"sending Poisson traffic with {tool} for {duration:.0f} s at {rate_scale:g} x the planned rates "
        f"({', '.join(f'{t.model} {t.rate * rate_scale:g}/s' for t in targets)}) ..."
    )
    if pa is not None:
        results = run_perf_analyzer(pa, targets, duration, rate_scale, loaded.state_dir / "perf_analyzer")
    else:
        results = run_load(targets, duration, rate_scale)
    if _JSON:
        _emit({"tool": tool, "rate_scale": rate_scale, "models": [r.summary() for r in results]})
    else:
        _say(format_results(results))
        for r in results:
            if r.errors:
                _say(f"  {r.model}: first error: {r.errors[0]}")
    return 0 if all(r.ok > 0 for r in results) else 1


def cmd_load(args) -> int:
    return _load(Path(args.plan), args.duration, args.rate_scale, args.tool)


def cmd_demo(args) -> int:
    """Export, plan, apply and load the CPU demo cluster, end to end."""

    cluster = Path(args.cluster)
    latency_model = args.latency_model
    if latency_model is None:  # the committed one, where there is one
        committed = REPO / "profiles" / load_cluster(cluster).spec.name / "latency-model.json"
        latency_model = str(committed) if committed.is_file() else None
        if latency_model is None and args.policy != "spread":
            raise TritonctlError(
                f"policy {args.policy} needs a fitted latency model and there is none: pass --latency-model, "
                "or profile and fit the cluster first (tritonctl profile, tritonctl fit)",
                file=committed,
            )
    spec = load_cluster(cluster)
    if latency_model and load_latency_model(latency_model).device.fingerprint.get("id") != cpu_fingerprint()["id"]:
        here = _calibrated_path(Path(latency_model), spec.resolve(spec.spec.runtime.state_dir))
        if not here.is_file():  # calibrated once per CPU, kept in the state folder
            _say(f"== 0/4 calibrate {latency_model}: it was profiled on another CPU")
            _calibrate(str(cluster), Path(latency_model), here)
        latency_model = str(here)
    _say(f"== 1/4 plan ({args.policy}" + (f", latency model {latency_model})" if latency_model else ")"))
    misses = False
    if latency_model:
        spec, misses = _demo_rates(spec, latency_model, args.policy)
    plan_path = _plan(spec, args.policy, None, latency_model=latency_model)
    _say("== 2/4 apply")
    _apply(plan_path, accept_misses=misses)
    _say("== 3/4 endpoints")
    cmd_endpoints(argparse.Namespace(plan=str(plan_path)))
    _say("== 4/4 load")
    rc = _load(plan_path, args.duration, 1.0)
    if args.teardown:
        cmd_down(argparse.Namespace(plan=str(plan_path), compose_dir=None, dry_run=False))
    else:
        first = endpoints(load_plan(plan_path).plan)[0]
        _say(
            f"\nThe deployment keeps running.\n  look:           tritonctl status {plan_path}\n"
            f"  send requests:  python examples/client.py {first.url} {first.model}\n"
            f"  stop it:        tritonctl down {plan_path}"
        )
    return rc


def _demo_rates(cluster: Cluster, latency_model: str, policy: str) -> tuple[Cluster, bool]:
    """The demo cluster at the largest of 1, 0.95, ..., 0.05 times its rates that this CPU serves with DEMO_MARGIN
    to spare (saying so), and whether even 0.05 x is predicted to miss (the demo runs it all the same, saying so:
    a newcomer sees the deployment and the misses rather than nothing)."""
    artifacts = materialize(cluster, log=lambda _: None)
    headroom = load_latency_model(latency_model).with_margin(DEMO_MARGIN)
    scale = servable_scale(cluster, artifacts, headroom, policy)
    if scale == 0:
        _say(
            f"WARNING: this CPU serves the demo within its SLOs (with {100 * DEMO_MARGIN:g}% to spare) at none of "
            f"0.05-1 x its rates by latency model {latency_model}: deploying 0.05 x, predicted to miss"
        )
        return cluster.with_rates(lambda m: m.rate * 0.05), True
    if scale < 1:
        _say(
            f"this CPU serves the demo within its SLOs (with {100 * DEMO_MARGIN:g}% to spare) at {scale:g} x its "
            f"rates, not at 1 x (the plan at 1 x is predicted to miss): planning for {scale:g} x"
        )
    return cluster.with_rates(lambda m: m.rate * scale), False


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1 (0.1 is 10%), not {text}")
    return value


def add_margin(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--latency-margin",
        type=_margin,
        default=0.0,
        metavar="M",
        help="plan as if every batch ran (1 + M) times as long as the latency model predicts: headroom for a "
        "model that is off by up to M (default 0; 0.1 for 10%%)",
    )


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tritonctl",
        description="Plan, render and apply dense NVIDIA Triton deployments. "
        "Typical flow: tritonctl plan cluster.yaml && tritonctl apply plan.yaml",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    def add_format(p):
        p.add_argument(
            "--format",
            choices=["text", "json"],
            default="text",
            help="text for people (default); json for programs: one JSON document on stdout, progress on stderr",
        )

    def add_compose_dir(p):
        p.add_argument(
            "--compose-dir",
            help="compose: the project folder (tritonctl render --target compose; default: compose/ beside the plan)",
        )

    def add_runtime(p):
        p.add_argument(
            "--runtime",
            choices=["local", "compose"],
            default="local",
            help="local: tritonserver processes here (CPU plans); compose: services of a rendered Compose project",
        )
        add_compose_dir(p)

    p = add("export", cmd_export, "export the cluster's torchvision models to ONNX (cached by content)")
    p.add_argument("cluster", help="cluster.yaml")
    p = add("profile", cmd_profile, "measure the models over batch x share, solo and co-located, through Triton")
    p.add_argument("cluster", help="cluster.yaml")
    p.add_argument(
        "-o",
        "--output",
        type=_output_folder,
        help="dataset folder (default: profile/ beside the cluster file); resumes if present",
    )
    p.add_argument("--budget", type=float, help="stop after this many seconds (resume later)")
    p = add("plan", cmd_plan, "choose placements, shares and batch sizes and write a plan file")
    add_format(p)
    p.add_argument("cluster", help="cluster.yaml")
    p.add_argument(
        "-o", "--output", type=_output_file, help="plan file to write (default: plan.yaml beside the cluster file)"
    )
    p.add_argument(
        "--policy",
        choices=list(POLICIES),
        help="placement policy (see `tritonctl policies`); default: search with --latency-model (the best here), "
        "spread without one (the only policy that needs no latency model)",
    )
    p.add_argument(
        "--latency-model", help="a fitted latency model (tritonctl fit or calibrate): adds predictions to the plan"
    )
    p.add_argument(
        "--strict", action="store_true", help="fail if any model cannot be served (default: plan the others, list it)"
    )
    p.add_argument("--policy-file", help="inss: the trained policy (default: rl/policies/<cluster name>.pt)")
    add_margin(p)
    p = add(
        "calibrate",
        cmd_calibrate,
        "carry a CPU latency model profiled on another CPU to this one: a short measurement through Triton "
        "(about 20 s a model), running time x k * batch^gamma per model, its error on held-out points printed",
    )
    p.add_argument("cluster", help="cluster.yaml (its models must be in the latency model)")
    p.add_argument("--latency-model", required=True, help="the latency model to carry over (tritonctl fit)")
    p.add_argument(
        "-o", "--output", type=_output_file, help="where to write it (default: beside it, named after this CPU's id)"
    )
    p = add("fit", cmd_fit, "fit the interference-aware latency model (InSS section 4) to a profile")
    p.add_argument("profile", help="profile folder (tritonctl profile)")
    p.add_argument(
        "-o", "--output", type=_output_file, help="model file (default: latency-model.json in the profile folder)"
    )
    p.add_argument("--report", action="store_true", help="also evaluate on held-out measurements (see report)")
    p = add("report", cmd_report, "evaluate a fitted latency model on held-out measurements, with plots")
    p.add_argument("profile", help="profile folder")
    p.add_argument("--model", help="latency model file (default: latency-model.json in the profile folder)")
    p.add_argument("-o", "--output", type=_output_folder, help="report folder (default: report/ in the profile folder)")
    add("policies", cmd_policies, "list the placement policies")
    p = add("render", cmd_render, "render a plan into per-instance Triton model repositories")
    p.add_argument("plan", help="plan.yaml")
    p.add_argument(
        "--target",
        choices=["repositories", "compose"],
        default="repositories",
        help="repositories: the plan's repository_dir (local runtime); compose: a Docker Compose project (GPU plans)",
    )
    p.add_argument(
        "-o", "--output", type=_output_folder, help="compose: project folder (default: compose/ beside the plan)"
    )
    p.add_argument("--gpus", type=int, help="compose: GPUs on the target host (default: count them here, if any)")
    p = add(
        "apply",
        cmd_apply,
        "start or change Triton instances to match a plan (exit 2: bad input, nothing done; exit 3: the apply "
        "failed and was rolled back, the previous deployment keeps serving)",
    )
    p.add_argument("plan", help="plan.yaml")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the steps without doing them (compose: also every docker command and HTTP call); exit 1 "
        "when something would change, 0 when nothing would",
    )
    p.add_argument(
        "--accept-misses",
        action="store_true",
        help="apply a plan even where its own predictions miss an SLO or leave a model unserved (refused otherwise)",
    )
    add_runtime(p)
    p = add("validate", cmd_validate, "check a cluster or plan file as every verb would, touching nothing")
    p.add_argument("file", help="cluster.yaml or plan.yaml")
    p = add("schema", cmd_schema, "print the JSON Schema of the cluster file (for editors and CI checks)")
    p.add_argument("--plan", action="store_true", help="the plan file's schema instead")
    p = add(
        "controller",
        cmd_controller,
        "run the sidecar: apply the plan, watch rates, re-size batches (BDA) or re-plan (policy), apply",
    )
    p.add_argument("plan", help="plan.yaml to start from (or resume the plan the controller applied last)")
    p.add_argument("--latency-model", help="fitted latency model (tritonctl fit); without it, no re-planning")
    p.add_argument("--policy", default="search", help="policy to re-plan with when BDA fails (default: search)")
    p.add_argument("--host", default="127.0.0.1", help="address of the state and metrics endpoint (default: local)")
    p.add_argument("--port", type=int, default=9300, help="port of the state and metrics endpoint (default 9300)")
    p.add_argument("--interval", type=_positive, default=1.0, help="seconds between metric scrapes (default 1)")
    p.add_argument("--threshold", type=_positive, default=0.25, help="relative rate change that acts (default 0.25)")
    p.add_argument("--cooldown", type=float, default=10.0, help="seconds between two changes (default 10)")
    add_margin(p)
    add_runtime(p)
    p = add("status", cmd_status, "show the running instances, their shares, ports and health")
    add_format(p)
    p.add_argument("plan", help="plan.yaml")
    add_compose_dir(p)
    p = add("endpoints", cmd_endpoints, "show where clients send requests for each model")
    add_format(p)
    p.add_argument("plan", help="plan.yaml")
    p = add("down", cmd_down, "stop every instance of the deployment (through the runtime that applied it)")
    p.add_argument("plan", help="plan.yaml")
    p.add_argument("--dry-run", action="store_true", help="print what would be stopped (compose: every command)")
    add_compose_dir(p)
    p = add("simulate", cmd_simulate, "replay Poisson traffic against a plan in a discrete-event simulator")
    add_format(p)
    p.add_argument("plan", help="plan.yaml")
    p.add_argument("--latency-model", required=True, help="fitted latency model (tritonctl fit)")
    p.add_argument("--duration", type=_positive, default=60.0, help="simulated seconds (default 60)")
    p.add_argument("--rate-scale", type=_positive, default=1.0, help="multiply every model's rate (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival process (default 0)")
    p.add_argument("--drop", action="store_true", help="drop requests that can no longer meet their SLO")
    p.add_argument("--trace", help="replay this trace (CSV: model,time_s) instead of Poisson arrivals at the rates")
    p.add_argument(
        "--latency-error",
        type=float,
        default=0.0,
        help="run every model's batches (1 + e) times as long as predicted, e fixed per model, uniform in "
        "[-X, X] (seeded): a latency model that is off (default 0)",
    )
    p = add("bench", cmd_bench, "plan a cluster with several policies and simulate each plan side by side")
    add_format(p)
    p.add_argument("cluster", help="cluster.yaml")
    p.add_argument("--latency-model", required=True, help="fitted latency model (tritonctl fit)")
    p.add_argument(
        "--policies", nargs="+", help="policies to compare (default: all; inss where a trained policy exists)"
    )
    p.add_argument("--duration", type=_positive, default=60.0, help="simulated seconds per policy (default 60)")
    p.add_argument(
        "-o", "--output", type=_output_folder, help="output folder (default: bench/ beside the cluster file)"
    )
    p.add_argument("--policy-file", help="inss: the trained policy (default: rl/policies/<cluster name>.pt)")
    add_margin(p)
    p = add("train", cmd_train, "train the inss policy (SAC-Discrete, InSS Algorithm 2) for a cluster")
    p.add_argument("cluster", help="cluster.yaml")
    p.add_argument("--latency-model", required=True, help="fitted latency model (tritonctl fit)")
    p.add_argument("--episodes", type=int, help="episodes in all, resumed ones included (default 400)")
    p.add_argument("--seed", type=int, default=0, help="seed of the agent and the workload (default 0)")
    p.add_argument("--resume", action="store_true", help="go on from the run folder's last checkpoint")
    p.add_argument(
        "-o",
        "--output",
        type=_output_folder,
        help="run folder: log, learning curve, checkpoint (default: rl/runs/<cluster>)",
    )
    p.add_argument("--policy-file", help="where the trained policy goes (default: rl/policies/<cluster name>.pt)")
    p = add("load", cmd_load, "send Poisson traffic at the planned rates and print latency and throughput")
    add_format(p)
    p.add_argument("plan", help="plan.yaml")
    p.add_argument(
        "--tool",
        choices=["tritonctl", "perf_analyzer"],
        default="tritonctl",
        help="load generator: tritonctl's own client (default) or NVIDIA perf_analyzer, one process per model",
    )
    p.add_argument("--duration", type=_positive, default=10.0, help="seconds of traffic (default 10)")
    p.add_argument("--rate-scale", type=_positive, default=1.0, help="multiply every model's rate (default 1)")
    p = add("demo", cmd_demo, "plan, apply and load the CPU demo cluster end to end")
    p.add_argument("cluster", nargs="?", default=str(DEMO_CLUSTER), help="cluster.yaml (default: the CPU demo)")
    p.add_argument("--policy", default="search", help="placement policy (default search, tritonctl's best here)")
    p.add_argument(
        "--latency-model",
        help="fitted latency model (default: the committed profiles/<cluster name>/latency-model.json)",
    )
    p.add_argument("--duration", type=_positive, default=10.0, help="seconds of traffic (default 10)")
    p.add_argument("--teardown", action="store_true", help="stop the deployment at the end")
    return parser


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`, so started instances are stopped


def main(argv: list[str] | None = None) -> int:
    global _JSON
    args = build_parser().parse_args(argv)
    _JSON = getattr(args, "format", "text") == "json"
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return args.func(args)
    except TritonctlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""Verbs that run deployments: render, apply, down, status, endpoints, load, controller."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from pathlib import Path

from tritonctl.cli import output
from tritonctl.cli.output import emit, say
from tritonctl.controller.decide import ControllerConfig
from tritonctl.controller.loop import Controller
from tritonctl.controller.state import load_controller_state
from tritonctl.deploy import mps, share
from tritonctl.deploy.apply import (
    Step,
    apply_plan,
    changed,
    check_cluster,
    down,
    pending,
    per_instance,
    predicted_misses,
    stale_note,
)
from tritonctl.deploy.compose import ComposeRuntime
from tritonctl.deploy.compose_project import write_compose
from tritonctl.deploy.gpu import energy_mj, gpu_count, lock_commands
from tritonctl.deploy.kubernetes_project import write_kubernetes
from tritonctl.deploy.local import port_is_free
from tritonctl.deploy.runtime import Runtime
from tritonctl.deploy.runtimes import runtime_for, watching_runtime
from tritonctl.deploy.state import STATE_FILE, State, claim_repositories, load_state
from tritonctl.errors import TritonctlError
from tritonctl.files import load_yaml
from tritonctl.latency.model import load_latency_model
from tritonctl.planning.plan import LoadedPlan, load_plan
from tritonctl.planning.planner import check_latency_model, replan_policy
from tritonctl.spec import load_cluster
from tritonctl.triton.bundle import bundle, members
from tritonctl.triton.client import LoadResult, endpoints, format_results, run_load
from tritonctl.triton.perf_analyzer import RequestsRefused, find_perf_analyzer, run_perf_analyzer
from tritonctl.triton.render import render


def cmd_bundle(args) -> int:
    files = members(args.python)  # a Python without a stub is refused before anything is said or written
    say(f"trimming nvidia-pytriton's Triton for Python {args.python} into {args.output} (xz: about a minute) ...")
    made = bundle(Path(args.output), args.python, files=files)
    say(
        f"wrote {made.path}: {len(made.files)} files, {made.unpacked_bytes / 2**20:.0f} MiB unpacked, "
        f"{made.path.stat().st_size / 2**20:.0f} MiB packed; on the target: tar -xJf {made.path.name}, then put "
        f"tritonserver/bin on PATH and set TRITONCTL_PERF_ANALYZER=<folder>/tritonserver/bin/perf_analyzer"
    )
    return 0


def _clock_note(loaded: LoadedPlan) -> None:
    """A container cannot lock its GPU's clock: where the plan sets one, say what to run on the host."""
    for line in lock_commands(loaded.plan.devices):
        say(f"note: the plan's SM clock is not locked by the containers; on the GPU host, as root: {line}")


def _not_the_other_target(out: Path, marker: str, what: str) -> None:
    """Refuse to render into a folder that holds the other target's rendering (its `marker` file)."""
    if (out / marker).exists():
        raise TritonctlError(f"{out} holds {what} ({marker}): render into another folder (-o)")


def cmd_render(args) -> int:
    loaded = load_plan(args.plan)
    if args.target in ("compose", "kubernetes"):
        _clock_note(loaded)
    if args.target == "compose":
        gpus = args.gpus if args.gpus is not None else gpu_count()
        if gpus is None:
            say("note: no GPU found here (or no pynvml): the plan's GPUs are not checked; pass --gpus N to check")
        out = Path(args.output) if args.output else loaded.path.parent / "compose"
        _not_the_other_target(out, "kustomization.yaml", "a Kubernetes folder")
        latency_model = Path(args.latency_model) if args.latency_model else None
        if latency_model is not None:
            load_latency_model(latency_model)  # refused here, not in the sidecar on the GPU host
        project = write_compose(loaded, out, gpus, latency_model=latency_model)
        if not project.replans:
            say("note: no --latency-model: the sidecar will follow the plan file and report rates, not re-plan")
        for name, service in project.services.items():
            say(f"  {name:24} {service.name}  (GPU {service.device_index}, MPS {service.launch.share}%)")
        say(
            f"Compose project {project.name} written to {out}; on the GPU host: (cd {out} && docker compose up -d) "
            f"&& tritonctl apply {loaded.path} --runtime compose --compose-dir {out}"
        )
        return 0
    if args.latency_model:
        raise TritonctlError("only the compose target's sidecar re-plans", field="--latency-model")
    if args.target == "kubernetes":
        out = Path(args.output) if args.output else loaded.path.parent / "kubernetes"
        _not_the_other_target(out, "compose.yaml", "a Compose project")
        for name in write_kubernetes(loaded, out, args.node, args.namespace):
            say(f"  {name}")
        say(
            f"Kubernetes folder written to {out}: copy {out / 'repository'} onto the claim tritonctl-models, "
            f"then kubectl apply -k {out} (docs/kubernetes.md)"
        )
        return 0
    if args.output:
        raise TritonctlError(
            "the repositories go to the plan's runtime.repository_dir; -o names the folder of --target compose or "
            "kubernetes",
            field="-o",
        )
    render(loaded, write=False)  # every check first: bad input writes nothing
    claim_repositories(loaded)
    for name, (folder, launch) in render(loaded).items():
        say(f"  {name:24} {folder}  ({launch.kind}, share {launch.share}/{launch.units})")
    return 0


def _applied_runtime(args, loaded: LoadedPlan, state: State) -> Runtime:
    """The runtime the state says applied the plan (to look at or stop what runs): the plan's cluster's only."""
    check_cluster(loaded, state)
    dry_run = getattr(args, "dry_run", False)
    return runtime_for(loaded, state.runtime, args.compose_dir, say, dry_run, starts=False, namespace=args.namespace)


def _apply(
    plan_path: Path,
    dry_run: bool = False,
    runtime_name: str = "local",
    compose_dir: str | None = None,
    accept_misses: bool = False,
    namespace: str = "tritonctl",
) -> int:
    """Apply the plan; how many instances it changed, one more where HAProxy had to be started again (in a dry run:
    would)."""
    loaded = load_plan(plan_path)
    if note := stale_note(loaded):
        say(note)
    misses = predicted_misses(loaded.plan)
    if misses and not accept_misses:
        raise TritonctlError(
            f"the plan is predicted to miss SLOs ({'; '.join(misses)}); lower the rates, add devices or "
            "re-plan, or deploy it anyway with --accept-misses",
            file=loaded.path,
        )
    runtime = runtime_for(loaded, runtime_name, compose_dir, say, dry_run, namespace=namespace)
    if runtime.name == "kubernetes":
        say(f"applying {loaded.path} through the Kubernetes API in namespace {runtime.api.namespace}")
        repositories = loaded.resolve(loaded.plan.runtime.repository_dir)
        say(f"  the instances read their repositories from the claim tritonctl-models: copy {repositories} there")
        if dry_run:
            say("dry run: the API calls below are printed (and sent with dryRun=All where a cluster answers)")
    elif isinstance(runtime, ComposeRuntime):
        say(f"applying {loaded.path} through the Compose project in {runtime.folder}")
        if dry_run:
            say("dry run: the docker commands and HTTP calls below are printed, not made")
    else:
        say(f"applying {loaded.path} with tritonserver from {runtime.binary.source} ({runtime.binary.path})")
        if loaded.plan.target == "gpu" and dry_run:
            say("dry run: on the GPU host, before any instance starts:")
            daemon = [mps.rehearsal(runtime.mps)] if mps.needed(loaded.plan) else []
            for line in [*lock_commands(loaded.plan.devices), *daemon]:
                say(f"  {line}")
            say(
                "  every instance with CUDA_VISIBLE_DEVICES, and at an MPS share CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "
                "(its launch.json); an instance taking turns with a whole GPU runs without MPS"
            )
        elif share.mechanism() == "none":
            say("WARNING: no writable cgroup here: CPU shares are NOT enforced, instances compete freely")
    started = time.monotonic()
    # a local deployment whose HAProxy died: apply starts it again (from the rendered configuration and the state)
    proxy_down = runtime.name == "local" and bool(load_state(loaded.state_dir).instances) and not runtime.proxy_ok()
    steps = apply_plan(loaded, runtime, log=say, dry_run=dry_run)
    count, kept = changed(steps), sum(step.action == "keep" for step in steps)
    verb = "would change" if dry_run else "changed"
    proxy = f"; HAProxy was not answering: {'would be ' if dry_run else ''}started again" if proxy_down else ""
    say(f"{verb} {count} instance(s), kept {kept}, in {time.monotonic() - started:.1f} s{proxy}")
    return count + proxy_down


def cmd_apply(args) -> int:
    """Exit 0; with --dry-run, 1 when something would change (as `kubectl diff` does)."""
    changed = _apply(Path(args.plan), args.dry_run, args.runtime, args.compose_dir, args.accept_misses, args.namespace)
    return int(args.dry_run and changed > 0)


def cmd_controller(args) -> int:
    loaded = load_plan(args.plan)
    runtime = runtime_for(loaded, args.runtime, args.compose_dir, say, namespace=args.namespace)
    if args.latency_margin and not args.latency_model:
        raise TritonctlError("a latency margin needs a latency model", field="--latency-margin")
    if not port_is_free(args.host, args.port):  # an address that cannot be served is said before anything starts
        raise TritonctlError(f"cannot serve the controller's state on {args.host}:{args.port}", field="--host/--port")
    lm = load_latency_model(args.latency_model) if args.latency_model else None
    cluster = load_cluster(loaded.resolve(loaded.plan.cluster_file)) if lm is not None or args.policy is None else None
    if lm is None:
        say("note: no --latency-model: the controller follows the plan file and reports rates, but does not re-plan")
    else:
        check_latency_model(cluster, lm, Path(args.latency_model), say)
        lm = lm.with_margin(args.latency_margin)
    policy = args.policy
    if policy is None:
        policy, why = replan_policy(cluster, lm)
        if lm is not None:
            say(f"re-planning with {policy}: {why}")
    cfg = ControllerConfig(interval_s=args.interval, threshold=args.threshold, cooldown_s=args.cooldown)
    controller = Controller(loaded.path, runtime, lm, policy, cfg, log=say)
    server = controller.serve(args.host, args.port)
    say(
        f"controller running: state http://{args.host}:{server.server_port}/state, "
        f"metrics http://{args.host}:{server.server_port}/metrics; Ctrl-C stops the controller "
        "(the instances keep serving; `tritonctl down` stops them)"
    )
    stop = threading.Event()
    try:
        controller.run(stop)
    except KeyboardInterrupt:
        if controller.applying():
            raise  # cut short mid-apply: the CLI says how to see and finish the change
        say("controller stopped: the instances keep serving (`tritonctl down` stops them)")
        return 130
    finally:
        controller.record_stop()
        server.shutdown()
    return 0


def _controller_status(state_dir: Path) -> None:
    ctl = load_controller_state(state_dir)
    if ctl is None:
        return
    if not ctl.running(time.time()):  # what it saved last is no longer what happens
        last = ctl.stopped or ctl.heartbeat
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last)) if last else "never"
        how = "stopped at" if ctl.stopped else "last heard from"
        say(f"controller: not running ({how} {when}; {ctl.applies} change(s) applied, policy {ctl.policy})")
        return
    say(f"controller: {ctl.applies} change(s) applied, policy {ctl.policy}, current plan {ctl.plan}")
    if ctl.target:
        say(f"  applying now: {ctl.target}" + (f" (last step: {ctl.steps[-1]})" if ctl.steps else ""))
    for model, planned in sorted(ctl.planned_rates.items()):
        estimate = ctl.estimated_rates.get(model)
        queue = ctl.queue_ms.get(model)
        at_proxy, errors = ctl.proxy_rates.get(model), ctl.proxy_errors.get(model)
        say(
            f"  {model:18} planned {planned:7.1f} req/s, measured "
            + ("   -   " if estimate is None else f"{estimate:7.1f}")
            + (f", queue {queue:.1f} ms" if queue is not None else "")
            + (f"; at HAProxy {at_proxy:.1f} req/s, {errors:.2f} errors/s" if at_proxy is not None else "")
            + (f", {ctl.proxy_queued[model]:.0f} queued" if ctl.proxy_queued.get(model) else "")
        )
    for decision in ctl.decisions[-3:]:
        when = time.strftime("%H:%M:%S", time.localtime(decision["time"]))
        say(f"  {when} {decision['kind']:8} {decision['reason']} ({decision['took_s']:g} s)")


def _drift(loaded: LoadedPlan, steps: list[Step], proxy_ok: bool) -> str:
    """One line: whether what runs is what the plan says, and if not what `apply` would change."""
    if not steps and proxy_ok:
        return f"the deployment matches {loaded.path}"
    changes = [f"{s.action} {s.instance}" for s in per_instance(steps)] + ([] if proxy_ok else ["start HAProxy"])
    why = "`tritonctl apply --dry-run` says why"
    return f"the deployment differs from {loaded.path}: `tritonctl apply` would {', '.join(changes)} ({why})"


def _recorded(plan_arg: str, invalid: TritonctlError) -> tuple[Path, State]:
    """Where a plan file that no longer validates (`invalid`) says its deployment's state is, and what that folder
    records, so that what runs can still be looked at and stopped; raises `invalid` where the file cannot say or the
    folder records no deployment of the file's cluster."""
    path = Path(plan_arg)
    try:
        raw = load_yaml(path)
    except TritonctlError:
        raise invalid from None
    runtime = raw.get("runtime") if isinstance(raw, dict) else None
    folder = runtime.get("state_dir") if isinstance(runtime, dict) else None
    if not isinstance(folder, str):
        raise invalid
    state_dir = path.parent / folder
    state = load_state(state_dir)
    if not state.instances or state.cluster != raw.get("cluster"):
        raise invalid
    say(f"note: {invalid}")
    say(f"  the plan file does not validate; its state folder {state_dir} records the deployment below")
    return state_dir, state


def _deployment(args) -> tuple[LoadedPlan | None, Path, State, Runtime | None]:
    """The plan (None where it no longer validates but still names its deployment, or `--state-dir` names the
    deployment instead), the state folder, what it records and the runtime that applied it (None where nothing runs
    and the plan is at hand)."""
    if (args.plan is None) == (args.state_dir is None):
        raise TritonctlError("name the deployment by its plan file or by --state-dir, one of them", field="PLAN")
    if args.state_dir is not None:
        state_dir = Path(args.state_dir)
        if not (state_dir / STATE_FILE).is_file():
            raise TritonctlError(f"no deployment is recorded here (no {STATE_FILE})", file=state_dir)
        state = load_state(state_dir)
        plan = Path(state.plan) if state.plan else state_dir / "plan.yaml"  # a Compose project's default is beside it
    else:
        try:
            loaded = load_plan(args.plan)
        except TritonctlError as exc:
            (state_dir, state), plan = _recorded(args.plan, exc), Path(args.plan)
        else:
            state = load_state(loaded.state_dir)
            return loaded, loaded.state_dir, state, _applied_runtime(args, loaded, state) if state.instances else None
    dry_run = getattr(args, "dry_run", False)
    runtime = watching_runtime(state.runtime, state_dir, plan, args.compose_dir, say, dry_run, args.namespace)
    return None, state_dir, state, runtime


def cmd_status(args) -> int:
    """Exit 0 when every instance and the proxy answer, 1 otherwise; the local runtime also says whether what runs
    is what the plan says."""
    loaded, state_dir, state, runtime = _deployment(args)
    health = {uid: runtime.health(rec) for uid, rec in state.instances.items()} if runtime else {}
    proxy_ok = runtime.proxy_ok() if runtime else None
    unhealthy = sum(h.label != "ready" for h in health.values()) + (proxy_ok is False)
    changes, uncompared = None, None  # another runtime's prepare reaches its engine: `apply --dry-run` compares there
    if loaded is not None and runtime is not None and runtime.name == "local":
        try:
            changes = pending(loaded, runtime, state, health)
        except TritonctlError as exc:  # an ONNX file replaced since, say: what runs is still shown
            uncompared = f"cannot compare the deployment with the plan: {exc}"
    if output.JSON:
        ctl = load_controller_state(state_dir)
        emit(
            {
                "cluster": state.cluster or (loaded.plan.cluster if loaded else None),
                "plan": state.plan or args.plan,
                "applied": bool(state.instances),
                "runtime": state.runtime,
                "instances": [
                    {**dataclasses.asdict(rec), "health": health[uid].label}
                    for uid, rec in sorted(state.instances.items())
                ],
                "matches": None if changes is None else not changes and proxy_ok is not False,
                "pending": None if changes is None else [dataclasses.asdict(step) for step in changes],
                "proxy_ok": proxy_ok,
                "proxy": runtime.proxy_info() if runtime else None,
                "controller": {**dataclasses.asdict(ctl), "running": ctl.running(time.time())} if ctl else None,
            }
        )
        return 1 if unhealthy else 0
    _controller_status(state_dir)
    if not state.instances:
        cluster = state.cluster or (loaded.plan.cluster if loaded else "the deployment")
        say(f"no instances running for {cluster} (state in {state_dir})")
        return 0
    say(f"cluster {state.cluster}, applied from {state.plan} by the {state.runtime} runtime")
    say(  # port: the model's address (HAProxy's); grpc, http, metrics: the instance's own
        f"{'instance':24} {'model':16} {'device':6} {'share':>7} {'port':>6} {'grpc':>6} {'http':>6} {'metrics':>7} "
        f"{'pid':>7} {'health':9} share enforcement"
    )
    for uid, rec in sorted(state.instances.items(), key=lambda item: item[1].instance):
        say(
            f"{rec.instance:24} {rec.model:16} {rec.device:6} {f'{rec.share}/{rec.units}':>7} {rec.grpc_port:>6} "
            f"{rec.backend_port or '-':>6} {rec.http_port:>6} {rec.metrics_port:>7} {rec.pid:>7} "
            f"{health[uid].label:9} {rec.share_mechanism}"
        )
    say(runtime.proxy_info())
    if proxy_ok is False:
        say("proxy: NOT answering: clients cannot reach the models; `tritonctl apply` restarts it")
    if changes is not None:
        say(_drift(loaded, changes, proxy_ok is not False))
    elif uncompared:
        say(uncompared)
    return 1 if unhealthy else 0


def cmd_endpoints(args) -> int:
    targets = endpoints(load_plan(args.plan).plan)
    if output.JSON:
        emit([dataclasses.asdict(ep) for ep in targets])
        return 0
    say(f"{'model':18} {'gRPC address':22} input")
    for ep in targets:
        say(f"{ep.model:18} {ep.url:22} {ep.input_name} {ep.input_dtype}[batch, {', '.join(map(str, ep.input_shape))}]")
    return 0


def cmd_down(args) -> int:
    loaded, state_dir, state, runtime = _deployment(args)
    if not state_dir.exists():  # never applied: nothing to stop, and nothing to write
        say(f"nothing to stop: no deployment was applied with state in {state_dir}")
        return 0
    if runtime is None:  # no instance recorded: the runtime still stops what else the deployment runs (HAProxy)
        runtime = _applied_runtime(args, loaded, state)
    count = down(state_dir, runtime, log=say, dry_run=args.dry_run)
    say(f"{'would stop' if args.dry_run else 'stopped'} {count} instance(s)")
    return 0


def _load(
    plan_path: Path, duration: float, rate_scale: float, tool: str = "tritonctl", min_within_slo: float | None = None
) -> tuple[int, list[str]]:
    """Load the deployment and report it: 1 where a model had no answer (else 0), and the models with less than
    `min_within_slo` of their requests within the SLO."""
    loaded = load_plan(plan_path)
    targets = endpoints(loaded.plan)
    pa = find_perf_analyzer() if tool == "perf_analyzer" else None  # before any traffic: a missing tool says so
    silent = [t for t in targets if not _listening(t.url)]
    if silent:
        raise TritonctlError(
            f"nothing listens at {', '.join(f'{t.url} ({t.model})' for t in silent)}: the deployment is not running; "
            f"start it with `tritonctl apply {plan_path}`",
            file=plan_path,
        )
    say(
        f"sending Poisson traffic with {tool} for {duration:g} s at {rate_scale:g} x the planned rates "
        f"({', '.join(f'{t.model} {t.rate * rate_scale:g}/s' for t in targets)}) ..."
    )
    gpus = [d.index for d in loaded.plan.devices if d.kind == "gpu"]
    before = energy_mj(gpus) if gpus else None
    refused = None
    if pa is not None:
        try:
            results = run_perf_analyzer(pa, targets, duration, rate_scale, loaded.state_dir / "perf_analyzer")
        except RequestsRefused as exc:  # the models whose runs finished are still reported, then the refusal
            results, refused = exc.results, exc
    else:
        results = run_load(targets, duration, rate_scale)
    after = energy_mj(gpus) if before is not None else None
    simulated = {}  # the plan's simulated p99s speak for its own rates, and for it as it was planned, only
    if note := stale_note(loaded):
        say(note)
    elif rate_scale == 1:
        simulated = {m.name: m.simulated_p99_ms for m in loaded.plan.models if m.simulated_p99_ms}
    joules = None if after is None else (after - before) / 1000
    short = [r for r in results if min_within_slo is not None and not r.within_slo >= min_within_slo]
    _report_load(results, tool, rate_scale, simulated, joules, refused, short, min_within_slo)
    if refused is not None:
        raise refused
    unanswered = [r for r in results if r.ok == 0]
    for r in unanswered:  # exit 1: say why
        said = f"sent {r.sent}, none answered" if r.sent else "nothing sent: raise --duration or --rate-scale"
        say(f"no answer from {r.model} ({said})")
    return (1 if unanswered else 0), [r.model for r in short]


def _report_load(
    results: list[LoadResult],
    tool: str,
    rate_scale: float,
    simulated: dict[str, float],
    joules: float | None,
    refused: RequestsRefused | None,
    short: list[LoadResult],
    min_within_slo: float | None,
) -> None:
    """The load's table (or JSON) of the models measured, and those with less than `min_within_slo` of their
    requests within the SLO (`short`); with `refused`, the message of the perf_analyzer runs that stopped."""
    answered = sum(r.ok for r in results)
    if output.JSON:
        energy = (
            {} if joules is None else {"gpu_joules": round(joules, 2), "joules_per_request": joules / max(answered, 1)}
        )
        models = [{**r.summary(), "simulated_p99_ms": simulated.get(r.model)} for r in results]
        stopped = {} if refused is None else {"stopped": refused.message}
        check = {} if min_within_slo is None else {"min_within_slo": min_within_slo, "short": [r.model for r in short]}
        emit({"tool": tool, "rate_scale": rate_scale, "models": models, **stopped, **check, **energy})
        return
    if results:
        say(format_results(results, simulated))
    for r in results:
        if r.errors:
            say(f"  {r.model}: first error: {r.errors[0]}")
    if joules is not None:
        say(
            f"GPU energy (NVML, all the GPUs' work while the load ran): {joules:.0f} J over {answered} answered "
            f"requests, {1000 * joules / max(answered, 1):.1f} mJ/request"
        )
    if short:
        shares = [f"{r.model} {100 * r.within_slo:.1f}%" if r.sent else f"{r.model} (nothing sent)" for r in short]
        say(f"below {100 * min_within_slo:g}% within the SLO: {', '.join(shares)}")


def _listening(url: str) -> bool:
    """Whether something accepts connections at host:port."""
    host, port = url.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def cmd_load(args) -> int:
    rc, short = _load(Path(args.plan), args.duration, args.rate_scale, args.tool, args.min_within_slo)
    return 1 if short else rc

"""Make the running deployment match a plan, changing only what differs.

The decision (`diff`) is a pure function of the rendered launches and the health of the
recorded instances. Carrying it out starts every new instance first and stops the
instances it replaces only after all new ones are ready and warm (the shadow swap of
InSS), so a failed start is rolled back with the old deployment untouched. A change of
batch size or queue delay alone reloads the model in place, without a new process.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Collection
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

from tritonctl.deploy.local import ephemeral_ports, port_holder, port_is_free
from tritonctl.deploy.runtime import Health, InstanceRecord, Runtime, StartError, stop_all
from tritonctl.deploy.state import (
    RepositorySnapshot,
    State,
    apply_lock,
    claim_repositories,
    load_state,
    save_state,
)
from tritonctl.errors import RolledBack, TritonctlError
from tritonctl.planning.plan import LoadedPlan, Plan
from tritonctl.planning.simulate import simulated_misses
from tritonctl.triton.render import Launch, render

RELOADING = "reloading"  # the config hash of an instance while its reload is under way: no plan's config matches it


@dataclass(frozen=True)
class Step:
    """One change: `start` a new instance, `swap` one for a new process (shadow swap: start the
    new one, then the old one is stopped by a `stop` step), `reload` a model in place (batch,
    queue delay or late refusals changed), `move` the model's address to another port (the instance stays), `keep`
    one as it is, or `stop` one."""

    action: Literal["start", "swap", "reload", "move", "keep", "stop"]
    instance: str
    reason: str
    uid: str | None = None  # the recorded instance the step keeps, reloads, replaces or stops


def predicted_misses(plan: Plan) -> list[str]:
    """What the plan's own predictions (and its simulation, where it has one) say it will not serve within the
    SLO: one line per placement or model. Predictions a hand edit made stale (`Plan.stale_predictions`) say nothing
    of the plan: only the models it leaves out are named then."""
    misses = [f"{m.name}: not served ({m.reason})" for m in plan.unserved]
    if plan.stale_predictions():
        return misses
    for model in plan.models:
        for p in model.placements:
            if p.predicted is not None and not p.predicted.meets_slo:
                p99 = "overloaded" if p.predicted.latency_ms is None else f"p99 {p.predicted.latency_ms:.0f} ms"
                misses.append(f"{p.instance}: predicted {p99} against an SLO of {model.slo_ms:g} ms")
    for model in simulated_misses(plan):
        misses.append(f"{model.name}: simulated {100 * model.simulated_in_slo:.1f}% within {model.slo_ms:g} ms")
    return misses


def stale_note(loaded: LoadedPlan) -> str | None:
    """What to say of a plan edited since its predictions were made (None: they describe it)."""
    if not loaded.plan.stale_predictions():
        return None
    return (
        f"note: {loaded.path} was edited after it was planned: its predictions describe the plan as it was made and "
        f"are neither checked nor compared; `tritonctl simulate {loaded.path} --latency-model MODEL --update` "
        "predicts it as it is now"
    )


def per_instance(steps: list[Step]) -> list[Step]:
    """The steps less the stops of instances a swap replaces: one step per instance changed or kept."""
    replaced = {step.uid for step in steps if step.action == "swap"}
    return [step for step in steps if not (step.action == "stop" and step.uid in replaced)]


def changed(steps: list[Step]) -> int:
    """How many instances the steps change: a swap and the stop of the instance it replaces count once."""
    return sum(step.action != "keep" for step in per_instance(steps))


def diff(launches: dict[str, Launch], records: dict[str, InstanceRecord], health: dict[str, Health]) -> list[Step]:
    """Steps that turn the recorded instances into the planned ones: starts, reloads, keeps, then stops."""
    starts, reloads, keeps = [], [], []
    used: set[str] = set()
    for name, launch in launches.items():
        ready = [uid for uid, rec in records.items() if rec.instance == name and health[uid].label == "ready"]
        same = [uid for uid in ready if records[uid].config_hash == launch.config_hash]
        reloadable = [uid for uid in ready if records[uid].process_hash == launch.process_hash]
        older = [uid for uid, rec in records.items() if rec.instance == name]
        if same and (port := records[same[0]].grpc_port) != launch.grpc_port:
            reloads.append(Step("move", name, f"model port {port} -> {launch.grpc_port}", same[0]))
            used.add(same[0])
        elif same:
            keeps.append(Step("keep", name, "unchanged and ready", same[0]))
            used.add(same[0])
        elif reloadable:
            reason = "configuration changed (batch, queue delay or late refusals)"
            reloads.append(Step("reload", name, reason, reloadable[0]))
            used.add(reloadable[0])
        elif not older:
            starts.append(Step("start", name, "new"))
        elif ready:
            starts.append(Step("swap", name, "share, device, model or settings changed", ready[0]))
        else:
            starts.append(Step("swap", name, "not ready: restart", older[0]))
    stops = []
    for uid, rec in records.items():
        if uid in used:
            continue
        if rec.instance not in launches:
            reason = "not in the plan"
        elif not health[uid].alive:
            reason = "dead"
        elif any(s.uid == uid for s in starts):
            reason = "replaced: traffic moves to the new instance, the old one drains"
        else:
            reason = "duplicate"
        stops.append(Step("stop", rec.instance, reason, uid))
    return starts + reloads + keeps + stops


def _check_ports(loaded: LoadedPlan, steps: list[Step], rendered: dict[str, tuple[Path, Launch]], state: State) -> None:
    """A model port must be free on the plan's host, or an address of this deployment there already (its proxy
    holds it, for whichever model), or held by this deployment's own proxy on another address (the host changed:
    the proxy moves)."""
    host = loaded.plan.runtime.host
    for step in steps:
        if step.action not in ("start", "swap", "move", "reload"):
            continue
        launch = rendered[step.instance][1]
        port = launch.grpc_port
        if any(rec.grpc_port == port and rec.host == host for rec in state.instances.values()):
            continue
        if port_is_free(host, port):
            continue
        holder = port_holder(port, host)
        if holder is not None and holder.state_dir == loaded.state_dir.resolve():
            continue
        raise TritonctlError(
            f"port {port} is in use by another process" + (f": {holder}" if holder else ""),
            file=loaded.path,
            field=f"models.{launch.model}.port",
        )


def _steps(
    loaded: LoadedPlan, runtime: Runtime, state: State, rendered: dict, log: Callable[[str], None]
) -> list[Step]:
    """Check the state belongs to this plan's cluster and runtime; log and return the steps."""
    check_owner(loaded, runtime, state)
    launches = {name: launch for name, (_, launch) in rendered.items()}
    health = {uid: runtime.health(rec) for uid, rec in state.instances.items()}
    steps = diff(launches, state.instances, health)
    for step in steps:
        log(f"  {step.action:6} {step.instance:28} {step.reason}")
    return steps


def pending(loaded: LoadedPlan, runtime: Runtime, state: State, health: dict[str, Health]) -> list[Step]:
    """What `apply` would change to make the recorded deployment match the plan (its steps but the keeps);
    renders nothing to disk."""
    launches = {name: launch for name, (_, launch) in render(runtime.prepare(loaded, write=False), write=False).items()}
    return [step for step in diff(launches, state.instances, health) if step.action != "keep"]


def check_cluster(loaded: LoadedPlan, state: State) -> None:
    """Refuse a plan for another cluster than the one whose deployment the state folder holds: what runs there is
    not this plan's to change, look at or stop."""
    if state.instances and state.cluster != loaded.plan.cluster:
        raise TritonctlError(
            f"the state folder {loaded.state_dir} holds the deployment of cluster {state.cluster!r}, not "
            f"{loaded.plan.cluster!r}: give this cluster its own runtime.state_dir in its cluster file",
            file=loaded.path,
            field="runtime.state_dir",
        )


def check_owner(loaded: LoadedPlan, runtime: Runtime, state: State) -> None:
    """Refuse a plan for another cluster, or a runtime other than the one running the deployment."""
    check_cluster(loaded, state)
    if state.instances and state.runtime != runtime.name:
        raise TritonctlError(
            f"the deployment in {loaded.state_dir} runs on the {state.runtime} runtime, not {runtime.name}: "
            f"apply with --runtime {state.runtime}, or `tritonctl down` it first",
            file=loaded.path,
            field="runtime.state_dir",
        )


Save = Callable[[State], None]


def rolled_back(why: str, serving: bool, file: str | Path, field: str | None = None) -> RolledBack:
    """The error of an apply undone: `serving`, whether instances of an earlier apply run on."""
    after = "the running instances keep serving" if serving else "nothing ran before it, nothing runs now"
    return RolledBack(f"apply failed and was rolled back ({after}): {why}", file=file, field=field)


@dataclass
class _Run:
    """One apply in progress: the plan, its rendering, the runtime and the state it changes."""

    loaded: LoadedPlan
    runtime: Runtime
    state: State
    rendered: dict[str, tuple[Path, Launch]]
    log: Callable[[str], None]
    save: Save
    reloaded: set[str] = field(default_factory=set)  # the instances reloaded in place by this apply

    def discard(self, records: list[InstanceRecord]) -> None:
        """Stop instances this apply started and forget them."""
        stop_all(self.runtime, {r.uid: r for r in records}, lambda uid: self.state.instances.pop(uid, None))
        self.save(self.state)

    def start_all(self, steps: list[Step]) -> list[InstanceRecord]:
        """Start every new instance and wait until it is loaded and warmed; on failure stop them all and raise.
        An instance whose process dies of a signal while starting is started once more first (a tritonserver
        was seen to abort once inside gRPC's poller while starting, and start fine the next time).

        Each record is saved the moment its process exists, so a crash mid-start leaves nothing
        unrecorded: a later apply finds it and keeps or stops it.
        """
        runtime_settings, state_dir = self.loaded.plan.runtime, self.loaded.state_dir
        started: list[InstanceRecord] = []

        def persist(record: InstanceRecord) -> None:
            started.append(record)
            self.state.instances[record.uid] = record
            self.save(self.state)

        try:
            for step in steps:
                if step.action not in ("start", "swap"):
                    continue
                folder, launch = self.rendered[step.instance]
                began = time.monotonic()
                old = f" (shadow of {self.state.instances[step.uid].uid})" if step.action == "swap" else ""
                self.log(f"  starting {step.instance}{old} on {launch.device}, share {launch.share}/{launch.units} ...")
                for attempt in range(2):
                    before = len(started)
                    try:
                        record = self.runtime.start(
                            launch,
                            folder,
                            runtime_settings.host,
                            state_dir / "logs",
                            runtime_settings.startup_timeout_s,
                            persist,
                        )
                        break
                    except StartError as exc:
                        if not exc.crashed or attempt:
                            raise
                        self.discard(started[before:])  # the dead process: already stopped, forget it
                        del started[before:]
                        first_line = str(exc).splitlines()[0]
                        self.log(f"  crashed  {step.instance} while starting ({first_line}); starting it once more")
                self.log(
                    f"  ready    {step.instance}: loaded and warmed in {time.monotonic() - began:.1f} s, "
                    f"pid {record.pid}, {record.share_mechanism}"
                )
        except BaseException as exc:
            self.discard(started)
            if isinstance(exc, StartError):
                raise rolled_back(str(exc), bool(self.state.instances), self.loaded.path) from None
            raise
        return started

    def reload_all(self, steps: list[Step]) -> None:
        """Reload in place the models whose batch or queue delay changed; Triton serves the old config meanwhile."""
        placements = {p.instance: p for _, p in self.loaded.plan.instances()}
        for step in steps:
            if step.action != "reload":
                continue
            record, placement = self.state.instances[step.uid], placements[step.instance]
            began = time.monotonic()
            delay = placement.queue_delay_us
            self.log(f"  reload   {step.instance} in place: batch {placement.batch}, queue delay {delay} us")
            previous, record.config_hash = record.config_hash, RELOADING  # interrupted, no plan matches: reloaded next
            self.save(self.state)
            try:
                self.runtime.reconfigure(record, self.loaded.plan.runtime.startup_timeout_s)
            except StartError as exc:
                record.config_hash = previous
                self.save(self.state)
                raise RolledBack(
                    f"apply failed and was rolled back: {exc}; it keeps serving its previous configuration "
                    "(reloads before it stay, the new instances were stopped)",
                    file=self.loaded.path,
                    field="models",
                ) from None
            record.config_hash = self.rendered[step.instance][1].config_hash
            self.save(self.state)
            self.reloaded.add(step.instance)
            self.log(f"  reloaded {step.instance} in {time.monotonic() - began:.2f} s, no restart")

    def move_all(self, steps: list[Step]) -> set[int]:
        """Give every kept instance whose model's port changed (a `move`, or a `reload` with a new port) the model's
        new address; returns the ports they leave."""
        left = set()
        for step in steps:
            if step.action not in ("move", "reload"):
                continue
            record, port = self.state.instances[step.uid], self.rendered[step.instance][1].grpc_port
            if record.grpc_port != port:
                left.add(record.grpc_port)
                record.grpc_port = port
                self.log(f"  moved    {step.instance} to model port {port}, no restart")
        self.save(self.state)
        return left

    def _backends(self, steps: list[Step], left: Collection[int] = ()) -> dict[int, list[tuple[InstanceRecord, float]]]:
        """Every model address (and every address in `left`, to close) and the instances (with their weights) the
        plan keeps behind it."""
        leaving = {step.uid for step in steps if step.action == "stop"}
        weights = {p.instance: p.weight for _, p in self.loaded.plan.instances()}
        ports: dict[int, list[tuple[InstanceRecord, float]]] = {port: [] for port in left}
        ports.update({model.port: [] for model in self.loaded.plan.models})
        for uid, record in self.state.instances.items():
            ports.setdefault(record.grpc_port, [])
            if uid not in leaving:
                ports[record.grpc_port].append((record, weights.get(record.instance, 1.0)))
        return ports

    def open_new(self, steps: list[Step], started: list[InstanceRecord], opened: list[int]) -> None:
        """Open the model addresses no instance served before this apply, before anything that serves is touched,
        adding each to `opened` (to close again if the apply rolls back)."""
        new = {record.uid for record in started}
        served = {r.grpc_port for uid, r in self.state.instances.items() if uid not in new}
        for port, backends in self._backends(steps).items():
            if port not in served and backends:
                self.log(f"  switch   {self.runtime.route(self.loaded.plan.runtime.host, port, backends)}")
                opened.append(port)

    def route(
        self, steps: list[Step], log: Callable[[str], None], opened: Collection[int] = (), left: Collection[int] = ()
    ) -> None:
        """Point every model address (but those `opened` already) at the instances the plan keeps, and close the
        addresses `left`; connections to the others drain."""
        for port, backends in self._backends(steps, left).items():
            if port not in opened:
                log(f"  switch   {self.runtime.route(self.loaded.plan.runtime.host, port, backends)}")

    def stop_steps(self, steps: list[Step]) -> None:
        """The stop steps, all at once; the state saved as each instance has stopped."""
        leaving = [step for step in steps if step.action == "stop"]
        began = time.monotonic()
        for step in leaving:
            self.log(f"  stopping {step.uid}: {step.reason} ...")

        def stopped(uid: str) -> None:
            del self.state.instances[uid]
            self.save(self.state)
            self.log(f"  stopped  {uid} in {time.monotonic() - began:.1f} s")

        stop_all(self.runtime, {step.uid: self.state.instances[step.uid] for step in leaving}, stopped)


def apply_plan(
    loaded: LoadedPlan, runtime: Runtime, log: Callable[[str], None] = print, dry_run: bool = False
) -> list[Step]:
    """Apply the plan; returns the steps taken. Raises TritonctlError after rolling back.

    Order: start every new instance (shadows included) and wait until each is warm; then
    open the addresses of models new to the deployment; then reload in place; then point the
    other model addresses at the instances to keep (the proxy drains the others), a model's
    changed port at its running instances (the old port closed); then stop
    what the plan no longer has. A plan refused (bad input, a port taken) changes nothing; a
    failed start, opening or reload closes what this apply opened, stops the instances it
    started and touches nothing else, its model repositories put back as they were
    (`RepositorySnapshot`): on disk they hold what the running instances loaded.

    A dry run takes no lock and writes nothing: it reads the state and prints the steps, and,
    with a runtime that rehearses (Compose in dry-run mode), walks through them with it, so
    that runtime prints every command it would run (host ports are not checked).
    """
    if line := late_by_design(loaded):
        log(line)
    if runtime.name == "local":
        for line in (exposure(loaded), ephemeral_clash(loaded, ephemeral_ports())):
            if line:
                log(line)
    if dry_run and not runtime.rehearses:
        loaded = runtime.prepare(loaded, write=False)
        state, rendered = load_state(loaded.state_dir), render(loaded, write=False)
        steps = _steps(loaded, runtime, state, rendered, log)
        if runtime.name == "local":  # what the apply would find taken, the dry run says so too
            _check_ports(loaded, steps, rendered, state)
            claim_repositories(loaded, write=False)
        return steps
    state_dir = loaded.state_dir
    with nullcontext() if dry_run else apply_lock(state_dir):
        state = load_state(state_dir)
        check_owner(loaded, runtime, state)  # before anything is written for the plan
        loaded = runtime.prepare(loaded, write=not dry_run)
        save: Save = (lambda _: None) if dry_run else partial(save_state, state_dir)
        run = _Run(loaded, runtime, state, render(loaded, write=False), log, save)
        steps = _steps(loaded, runtime, state, run.rendered, log)
        if not dry_run and runtime.name != "kubernetes":  # a pod's ports are its own
            _check_ports(loaded, steps, run.rendered, state)
        changing = any(step.action != "keep" for step in steps)
        snapshot = None
        if not dry_run:  # checked: now the repositories are written, kept as they were until the new instances serve
            claim_repositories(loaded)
            if changing:
                root = loaded.resolve(loaded.plan.runtime.repository_dir)
                snapshot = RepositorySnapshot.take(root, [p.instance for _, p in loaded.plan.instances()])
            try:
                render(loaded, write=True)
            except BaseException:
                put_back(snapshot, (), log)
                raise
        if not changing:
            run.route(steps, log=lambda _: None)  # restarts a proxy that died
            return steps
        before = (state.cluster, state.plan, state.runtime)
        state.cluster, state.plan, state.runtime = loaded.plan.cluster, str(loaded.path), runtime.name
        opened: list[int] = []
        try:
            started = run.start_all(steps)
            try:
                run.open_new(steps, started, opened)  # a port taken meanwhile fails here, nothing else touched
                run.reload_all(steps)
            except BaseException as exc:
                for port in opened:
                    with suppress(TritonctlError):
                        runtime.route(loaded.plan.runtime.host, port, [])
                run.discard(started)
                if isinstance(exc, TritonctlError) and not isinstance(exc, RolledBack):
                    raise rolled_back(exc.message, bool(state.instances), exc.file or loaded.path, exc.field) from None
                raise
        except BaseException:  # rolled back: the state and the repositories say what runs, the previous plan
            state.cluster, state.plan, state.runtime = before
            save(state)
            put_back(snapshot, run.reloaded, log)
            raise
        if snapshot:
            snapshot.discard()
        run.route(steps, log, opened, left=run.move_all(steps))
        run.stop_steps(steps)
        return steps


def put_back(snapshot: RepositorySnapshot | None, reloaded: Collection[str], log: Callable[[str], None]) -> None:
    """Put a rolled-back apply's repositories back, but those of the instances it reloaded (they run what it
    wrote); where that fails, say so, leaving the rollback's own error to be raised."""
    if snapshot is None:
        return
    try:
        snapshot.restore(keep=reloaded)
    except OSError as exc:
        log(f"WARNING: the model repositories were not put back as they were ({exc}); {snapshot.folder} holds them")


def exposure(loaded: LoadedPlan) -> str | None:
    """One line naming the ports a local deployment opens beyond this machine; None when runtime.host is loopback."""
    host = loaded.plan.runtime.host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if loopback:
        return None
    ports = ", ".join(str(port) for port in sorted({model.port for model in loaded.plan.models}))
    return (
        f"note: runtime.host is {host}: model ports {ports} and every instance's gRPC, HTTP and metrics ports "
        "are reachable beyond this machine (Triton's control APIs ask for the deployment's key; HAProxy's runtime API "
        "is a unix socket in the state folder)"
    )


def late_by_design(loaded: LoadedPlan) -> str | None:
    """A warning naming the instances whose batch queue delay is as long as their model's SLO: every request that
    waits it out is late (a plan edited by hand; no policy plans one)."""
    late = [
        f"{p.instance} ({p.queue_delay_us / 1000:g} ms, SLO {m.slo_ms:g} ms)"
        for m in loaded.plan.models
        for p in m.placements
        if p.queue_delay_us / 1000 >= m.slo_ms
    ]
    if not late:
        return None
    return f"warning: a batch may wait as long as the SLO to fill (queue_delay_us) on {', '.join(late)}"


def ephemeral_clash(loaded: LoadedPlan, ephemeral: range | None) -> str | None:
    """A warning when model ports lie in the kernel's ephemeral range: an instance's ports or an outgoing
    connection's source port can hold one of them when HAProxy comes to bind it."""
    inside = sorted({model.port for model in loaded.plan.models if ephemeral is not None and model.port in ephemeral})
    if not inside:
        return None
    return (
        f"warning: model ports {', '.join(map(str, inside))} lie in this machine's ephemeral port range "
        f"({ephemeral.start}-{ephemeral.stop - 1}), where the kernel hands out ports to instances and outgoing "
        f"connections, so one may be taken when HAProxy binds it; choose runtime.base_port below {ephemeral.start}"
    )


def down(state_dir: Path, runtime: Runtime, log: Callable[[str], None] = print, dry_run: bool = False) -> int:
    """Close every model address, stop every recorded instance and what runs beside them; returns how
    many instances were (in a dry run: would be) stopped. A dry run saves nothing and calls the runtime
    only if it rehearses."""
    with nullcontext() if dry_run else apply_lock(state_dir):
        state = load_state(state_dir)
        act = runtime.rehearses or not dry_run
        save: Save = (lambda _: None) if dry_run else partial(save_state, state_dir)
        count = len(state.instances)
        for host, port in sorted({(record.host, record.grpc_port) for record in state.instances.values()}):
            try:
                log(f"  switch   {runtime.route(host, port, []) if act else f'port {port} -> closed'}")
            except TritonctlError as exc:  # the instances are stopped all the same
                log(f"  warning: {exc}")
        for uid in state.instances:
            log(f"  stopping {uid}")

        def stopped(uid: str) -> None:
            del state.instances[uid]
            save(state)

        if act:
            stop_all(runtime, dict(state.instances), stopped)
            runtime.shutdown()
        else:  # a dry run: nothing is saved
            state.instances.clear()
        state.cluster = state.plan = ""
        save(state)
        return count

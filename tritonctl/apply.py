"""Make the running deployment match a plan, changing only what differs.

The decision (`diff`) is a pure function of the rendered launches and the health of the
recorded instances. Carrying it out starts every new instance first and stops the
instances it replaces only after all new ones are ready, so a failed start is rolled back
with the old deployment untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tritonctl.errors import TritonctlError
from tritonctl.plan import LoadedPlan
from tritonctl.render import Launch, render
from tritonctl.runtime.base import Health, InstanceRecord, Runtime, StartError
from tritonctl.runtime.local import port_is_free
from tritonctl.state import State, apply_lock, load_state, save_state


@dataclass(frozen=True)
class Step:
    action: Literal["start", "stop", "keep"]
    instance: str
    reason: str
    uid: str | None = None  # the recorded instance a stop or keep refers to


def diff(launches: dict[str, Launch], records: dict[str, InstanceRecord], health: dict[str, Health]) -> list[Step]:
    """Steps that turn the recorded instances into the planned ones: starts first, then stops."""
    starts, keeps, stops = [], [], []
    kept: set[str] = set()
    for name, launch in launches.items():
        same = [
            uid
            for uid, rec in records.items()
            if rec.instance == name and rec.config_hash == launch.config_hash and health[uid].label == "ready"
        ]
        if same:
            keeps.append(Step("keep", name, "unchanged and ready", same[0]))
            kept.add(same[0])
        else:
            older = [rec for rec in records.values() if rec.instance == name]
            reason = (
                "new"
                if not older
                else "changed"
                if any(r.config_hash != launch.config_hash for r in older)
                else "not ready: restart"
            )
            starts.append(Step("start", name, reason))
    for uid, rec in records.items():
        if uid in kept:
            continue
        if rec.instance not in launches:
            reason = "not in the plan"
        elif health[uid].alive:
            reason = "replaced"
        else:
            reason = "dead"
        stops.append(Step("stop", rec.instance, reason, uid))
    return starts + keeps + stops


def _check_ports(
    loaded: LoadedPlan, steps: list[Step], launches: dict[str, Launch], state: State, health: dict[str, Health]
) -> None:
    """A model port must be free or held by a live instance of the same model (shared by SO_REUSEPORT)."""
    host = loaded.plan.runtime.host
    for step in steps:
        if step.action != "start":
            continue
        launch = launches[step.instance]
        ours = any(
            rec.grpc_port == launch.grpc_port and rec.model == launch.model and health[uid].alive
            for uid, rec in state.instances.items()
        )
        if not ours and not port_is_free(host, launch.grpc_port):
            raise TritonctlError(
                f"port {launch.grpc_port} is in use by another process",
                file=loaded.path,
                field=f"models.{launch.model}.port",
            )


def _steps(
    loaded: LoadedPlan, runtime: Runtime, state: State, rendered: dict, log: Callable[[str], None]
) -> tuple[list[Step], dict[str, Health]]:
    """Check the state belongs to this plan's cluster; log and return the steps and the instances' health."""
    if state.cluster and state.cluster != loaded.plan.cluster:
        raise TritonctlError(
            f"the state folder belongs to cluster {state.cluster!r}, not {loaded.plan.cluster!r}",
            file=loaded.path,
            field="runtime.state_dir",
        )
    launches = {name: launch for name, (_, launch) in rendered.items()}
    health = {uid: runtime.health(rec) for uid, rec in state.instances.items()}
    steps = diff(launches, state.instances, health)
    for step in steps:
        log(f"  {step.action:5} {step.instance:28} {step.reason}")
    return steps, health


def apply_plan(
    loaded: LoadedPlan, runtime: Runtime, log: Callable[[str], None] = print, dry_run: bool = False
) -> list[Step]:
    """Apply the plan; returns the steps taken. Raises TritonctlError after rolling back.

    A dry run takes no lock and writes nothing: it reads the state and prints the steps.
    """
    if dry_run:
        return _steps(loaded, runtime, load_state(loaded.state_dir), render(loaded, write=False), log)[0]
    plan = loaded.plan
    state_dir = loaded.state_dir
    with apply_lock(state_dir):
        state = load_state(state_dir)
        rendered = render(loaded)
        steps, health = _steps(loaded, runtime, state, rendered, log)
        if all(step.action == "keep" for step in steps):
            return steps
        launches = {name: launch for name, (_, launch) in rendered.items()}
        _check_ports(loaded, steps, launches, state, health)
        state.cluster, state.plan, state.runtime = plan.cluster, str(loaded.path), runtime.name
        started: list[InstanceRecord] = []
        try:
            for step in steps:
                if step.action == "start":
                    folder, launch = rendered[step.instance]
                    log(f"  starting {step.instance} on {launch.device} (share {launch.share}/{launch.units}) ...")
                    record = runtime.start(
                        launch, folder, plan.runtime.host, state_dir / "logs", plan.runtime.startup_timeout_s
                    )
                    started.append(record)
                    state.instances[record.uid] = record
                    save_state(state_dir, state)
                    log(f"  ready    {step.instance}: pid {record.pid}, {record.share_mechanism}")
        except BaseException as exc:
            for record in started:
                runtime.stop(record)
                del state.instances[record.uid]
            save_state(state_dir, state)
            if isinstance(exc, StartError):
                raise TritonctlError(f"apply failed and was rolled back: {exc}", file=loaded.path) from None
            raise
        for step in steps:
            if step.action == "stop":
                log(f"  stopping {step.uid} ({step.reason})")
                runtime.stop(state.instances.pop(step.uid))
                save_state(state_dir, state)
        return steps


def down(state_dir: Path, runtime: Runtime, log: Callable[[str], None] = print) -> int:
    """Stop every recorded instance; returns how many were stopped."""
    with apply_lock(state_dir):
        state = load_state(state_dir)
        count = len(state.instances)
        for uid in list(state.instances):
            log(f"  stopping {uid}")
            runtime.stop(state.instances.pop(uid))
            save_state(state_dir, state)
        state.cluster = state.plan = ""
        save_state(state_dir, state)
        return count

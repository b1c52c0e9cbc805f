"""Which runtime deploys a plan: the local one (tritonserver processes here), Compose (services of a project) or
Kubernetes (Deployments in a namespace)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tritonctl.deploy import mps
from tritonctl.deploy.compose import CommandRunner, ComposeRuntime
from tritonctl.deploy.gpu import gpu_count
from tritonctl.deploy.local import LocalRuntime
from tritonctl.deploy.runtime import Runtime
from tritonctl.errors import TritonctlError
from tritonctl.planning.plan import LoadedPlan
from tritonctl.triton.binary import find_tritonserver


def runtime_for(
    loaded: LoadedPlan,
    name: str,
    compose_dir: str | None,
    log: Callable[[str], None],
    dry_run: bool = False,
    starts: bool = True,
    namespace: str = "tritonctl",
) -> Runtime:
    """The runtime `name` ("local", "compose" or "kubernetes", in `namespace`) for the plan; `starts`: it will
    start instances (the local one then needs tritonserver, and for a GPU plan the GPUs and MPS); `log` takes the
    Compose runner's command lines and the Kubernetes calls of a dry run."""
    if name != "local" and loaded.plan.target == "cpu":
        raise TritonctlError(
            f"the {name} runtime runs GPU plans; a CPU plan runs with the local runtime (--runtime local)",
            file=loaded.path,
        )
    if name == "kubernetes" or not starts:
        return watching_runtime(name, loaded.state_dir, loaded.path, compose_dir, log, dry_run, namespace)
    if name == "compose":
        folder = Path(compose_dir) if compose_dir else loaded.path.parent / "compose"
        return ComposeRuntime(folder, CommandRunner(dry_run=dry_run, log=log), gpu_count())
    if loaded.plan.target == "gpu" and not dry_run:  # a dry run rehearses a GPU plan on any host
        mps.check_host(gpu_count(), 1 + max(d.index for d in loaded.plan.devices), shares=mps.needed(loaded.plan))
    return LocalRuntime(find_tritonserver(loaded.plan.runtime.tritonserver), loaded.state_dir)


def watching_runtime(
    name: str,
    state_dir: Path,
    plan_path: Path,
    compose_dir: str | None,
    log: Callable[[str], None],
    dry_run: bool = False,
    namespace: str = "tritonctl",
) -> Runtime:
    """The runtime `name` as it looks at and stops the deployment recorded in `state_dir`: it needs no plan beyond
    where the plan file is (a Compose project's default folder is beside it)."""
    if name == "kubernetes":
        from tritonctl.deploy.kubernetes import KubernetesRuntime, connect  # the kubernetes client loads only here
        from tritonctl.deploy.kubernetes_project import check_namespace

        check_namespace(namespace)
        return KubernetesRuntime(connect(namespace, dry_run, log), state_dir)
    if name == "compose":
        folder = Path(compose_dir) if compose_dir else plan_path.parent / "compose"
        return ComposeRuntime(folder, CommandRunner(dry_run=dry_run, log=log), None)
    return LocalRuntime(None, state_dir)

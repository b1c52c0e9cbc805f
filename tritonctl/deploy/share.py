"""CPU shares through Linux cgroups: the CPU analogue of CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.

Each instance gets its own cgroup with a CFS quota (`cores x period`). The process joins
the group before it execs tritonserver, so every thread and child (the Python backend
stubs) is limited too. Where no cgroup is writable the share is not enforced, and callers
say so.

Instances taking turns with a CPU are ranked (`shares.turn_ranks`): rank r's group sits r levels down a ladder
of groups marked idle (`cpu.idle`, Linux 5.15 on), `tritonctl/below/below/<group>` for rank 2. At each level
the kernel weighs the idle group 3 against the others' 1024 and preempts it at once for a waking task of a
group that is not idle: a rank runs on what the ranks above it leave, and a tight SLO's request does not wait
for a loose one's slice. Where the kernel has no `cpu.idle`, ranks fall back to weights a tenth apart.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from tritonctl.shares import MAX_WEIGHT

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


def mechanism() -> str:
    """'cgroup-v1', 'cgroup-v2' or 'none' (share not enforced)."""
    if (V1_ROOT / "cpu.cfs_quota_us").exists() and _writable(V1_ROOT):
        return "cgroup-v1"
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split() and _writable(V2_ROOT):
        return "cgroup-v2"
    return "none"


def create(
    group: str, quota_us: int | None, period_us: int | None, weight: int | None = None, rank: int | None = None
) -> Path | None:
    """Create cgroup `tritonctl/<group>` with the quota (none where None), given `weight` that CPU weight
    (1-10000 on cgroup v2's scale), given `rank` that far down the idle ladder; None where cgroups are not
    writable.

    Raises OSError when the kernel refuses the quota, after removing the cgroup it created for it.
    """
    kind = mechanism()
    if kind == "none":
        return None
    parent = (V1_ROOT if kind == "cgroup-v1" else V2_ROOT) / "tritonctl"
    parent.mkdir(exist_ok=True)
    if kind == "cgroup-v2":
        (V2_ROOT / "cgroup.subtree_control").write_text("+cpu")
        (parent / "cgroup.subtree_control").write_text("+cpu")
    if rank is not None and not (parent / "cpu.idle").exists():  # a kernel before 5.15: weights a tenth apart
        weight = max(1, MAX_WEIGHT // 10**rank)
    else:
        for _ in range(rank or 0):
            parent = _below(parent, kind)
    path = parent / group
    created = not path.exists()
    path.mkdir(exist_ok=True)
    try:
        if weight is not None:
            set_weight(path, weight)
        if quota_us is not None:
            set_quota(path, quota_us, period_us)
    except OSError:
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise
    return path


def _below(parent: Path, kind: str) -> Path:
    """The idle group one rank down the ladder under `parent`."""
    path = parent / "below"
    path.mkdir(exist_ok=True)
    (path / "cpu.idle").write_text("1")
    if kind == "cgroup-v2":
        (path / "cgroup.subtree_control").write_text("+cpu")
    return path


def set_weight(path: Path, weight: int) -> None:
    """A work-conserving share: `weight` (1-10000) against the other groups, no cap. cgroup v1's cpu.shares
    scale (2-262144, default 1024) is cgroup v2's cpu.weight (1-10000, default 100) times 10.24."""
    if (path / "cpu.weight").exists():
        (path / "cpu.weight").write_text(str(weight))
    else:
        (path / "cpu.shares").write_text(str(max(2, round(weight * 10.24))))


def set_quota(path: Path, quota_us: int, period_us: int) -> None:
    """Change a cgroup's quota; takes effect at once for the processes already in it."""
    if (path / "cpu.max").exists():
        (path / "cpu.max").write_text(f"{quota_us} {period_us}")
        return
    current = int((path / "cpu.cfs_quota_us").read_text())
    # v1 checks quota/period against the parent at each write: shrink before changing the period.
    if current != -1 and current > quota_us:
        (path / "cpu.cfs_quota_us").write_text(str(quota_us))
    (path / "cpu.cfs_period_us").write_text(str(period_us))
    (path / "cpu.cfs_quota_us").write_text(str(quota_us))


def joining(path: Path | None, command: list[str]) -> list[str]:
    """`command`, started inside the cgroup at `path`: a shell writes its own pid to the cgroup, then execs the
    command in its place (the same pid: nothing of it runs outside). Not a preexec function: with one, Popen must
    fork(), and fork() runs gRPC core's fork handlers, which can block for good in a process that has used gRPC
    clients; without one it spawns by vfork, which runs none."""
    if path is None:
        return command
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(path / "cgroup.procs"), *command]


def quota(path: Path) -> tuple[int, int]:
    """(quota_us, period_us) as the kernel has them."""
    if (path / "cpu.max").exists():
        q, p = (path / "cpu.max").read_text().split()
        return (-1 if q == "max" else int(q)), int(p)
    return int((path / "cpu.cfs_quota_us").read_text()), int((path / "cpu.cfs_period_us").read_text())


def members(path: Path) -> set[int]:
    try:
        return {int(pid) for pid in (path / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


def remove(path: Path | None, timeout_s: float = 5.0) -> None:
    """Remove the cgroup once its processes are gone, and the ladder's idle groups above it left empty."""
    if path is None:
        return
    deadline = time.monotonic() + timeout_s
    while path.exists():
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
    for below in (p for p in path.parents if p.name == "below"):
        try:
            below.rmdir()
        except OSError:  # another rank still runs in it
            return

"""The MPS control daemon of a local GPU deployment: started (or adopted) before its instances, stopped by `down`.

Each deployment has its own pipe and log folders under its state folder, so its daemon is told apart from any
other on the host; every instance gets them in its environment beside CUDA_MPS_ACTIVE_THREAD_PERCENTAGE. A
daemon already answering on those folders is adopted and left running at `down`; one tritonctl started is
stopped there (`quit`, which waits for its clients to leave).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tritonctl.errors import TritonctlError

if TYPE_CHECKING:
    from tritonctl.planning.plan import Plan
    from tritonctl.triton.render import Launch

CONTROL = "nvidia-cuda-mps-control"
CONTROL_PATHS = ("/usr/local/nvidia/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-control")
CLIENT_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
RECORD = "mps.json"  # in the state folder: whether this deployment started its daemon
MAX_PIPE_PATH = 90  # the daemon's socket path (pipe folder + its own names) must fit a unix socket's 108 bytes
READY_S = 10.0


@dataclass(frozen=True)
class Daemon:
    state_dir: Path

    @property
    def pipe_dir(self) -> Path:
        return self.state_dir / "mps" / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "mps" / "log"

    @property
    def env(self) -> dict[str, str]:
        """What the daemon and every client of it are started with."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}


def needed(plan: Plan) -> bool:
    """Whether the plan splits a GPU into MPS shares (instances taking turns with a whole GPU run without MPS)."""
    return any(plan.device(p.device).kind == "gpu" and not plan.takes_turns(p.device) for _, p in plan.instances())


def client(launch: Launch) -> bool:
    """Whether the instance runs as a client of the deployment's MPS daemon: a GPU instance at a share of it."""
    return launch.kind == "gpu" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in launch.env


def share_mechanism(launch: Launch) -> str:
    """How a GPU instance's share is held, as `status` shows it."""
    return f"MPS {launch.env['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}%" if client(launch) else "whole GPU in turns, no MPS"


def rehearsal(daemon: Daemon) -> str:
    """The command `ensure` runs where no daemon answers on the deployment's pipe folder (for a dry run)."""
    env = " ".join(f"{k}={v}" for k, v in daemon.env.items())
    return f"{env} {CONTROL} -d   (unless a daemon answers there already)"


def control_binary() -> str:
    """nvidia-cuda-mps-control, or a TritonctlError saying it is missing."""
    found = shutil.which(CONTROL) or next((p for p in CONTROL_PATHS if Path(p).is_file()), None)
    if found is None:
        raise TritonctlError(
            f"no MPS control binary ({CONTROL}) on PATH or in {', '.join(CONTROL_PATHS)}: a GPU plan shares its GPUs "
            "through MPS; install the NVIDIA driver's utilities on this host"
        )
    return found


def check_host(gpus: int | None, count: int, what: str = "this plan", shares: bool = True) -> None:
    """Refuse `what` (a GPU plan, a calibration) on a host without the `count` GPUs it names (NVML's count) or,
    where it splits one into `shares`, without MPS."""
    if not gpus:
        raise TritonctlError(f"{what} needs a GPU, and NVML sees no GPU on this host (no driver, or no GPU)")
    if count > gpus:
        raise TritonctlError(f"GPU index {count - 1} is named; this host has {gpus} GPU(s)")
    if shares:
        control_binary()


def _ask(daemon: Daemon, command: str, timeout_s: float = 5.0) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            [control_binary()],
            input=command + "\n",
            text=True,
            capture_output=True,
            env=_env(daemon),
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return None


def _env(daemon: Daemon) -> dict[str, str]:
    return {**os.environ, **daemon.env}


def answers(daemon: Daemon) -> bool:
    """Whether a control daemon answers on the deployment's pipe folder."""
    if not (daemon.pipe_dir / "control").exists():
        return False
    done = _ask(daemon, "get_server_list")
    return done is not None and done.returncode == 0


def start(daemon: Daemon) -> bool:
    """Start the deployment's daemon unless one answers already; True if this call started it."""
    if len(str(daemon.pipe_dir)) > MAX_PIPE_PATH:
        raise TritonctlError(
            f"the MPS pipe folder {daemon.pipe_dir} is longer than {MAX_PIPE_PATH} characters (a unix socket path): "
            "choose a shorter runtime.state_dir"
        )
    if answers(daemon):
        return False
    for folder in (daemon.pipe_dir, daemon.log_dir):
        folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([control_binary(), "-d"], capture_output=True, text=True, env=_env(daemon))
    if done.returncode != 0:
        raise TritonctlError(f"{CONTROL} -d failed ({done.returncode}): {(done.stderr or done.stdout).strip()[:300]}")
    deadline = time.monotonic() + READY_S
    while not answers(daemon):
        if time.monotonic() > deadline:
            raise TritonctlError(f"the MPS control daemon did not answer within {READY_S:g} s; log {daemon.log_dir}")
        time.sleep(0.1)
    return True


def ensure(state_dir: Path) -> Daemon:
    """The deployment's daemon, running; whether tritonctl started it is kept for `down` (a first start wins)."""
    daemon = Daemon(state_dir)
    started = start(daemon)
    record = state_dir / RECORD
    if started or not record.exists():
        record.write_text(json.dumps({"started": started}) + "\n")
    return daemon


def release(state_dir: Path) -> None:
    """At `down`: stop the deployment's daemon if tritonctl started it, and forget it."""
    record = state_dir / RECORD
    if not record.exists():
        return
    daemon = Daemon(state_dir)
    if json.loads(record.read_text()).get("started") and answers(daemon):
        _ask(daemon, "quit", timeout_s=30.0)
    record.unlink()

"""Local runtime: one real tritonserver process per instance on this machine.

Clients keep one address per model: the model's port is served by the router
(tritonctl/deploy/router.py, one process per deployment), which forwards to the gRPC ports of the
model's instances and drains connections when an instance is replaced. Every instance has
its own gRPC, HTTP (health, model control) and metrics ports. Triton's control APIs answer only
requests carrying the deployment's key (state.py `control_key`); the router's control endpoint
listens on loopback only.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from tritonctl.deploy import share
from tritonctl.deploy.router import DRAIN_TIMEOUT_S
from tritonctl.deploy.runtime import (
    Health,
    InstanceRecord,
    StartError,
    backends_of,
    http_ok,
    load_model,
    put_json,
    restriction_flags,
    route_summary,
)
from tritonctl.deploy.state import control_key
from tritonctl.errors import TritonctlError
from tritonctl.files import write_json_atomic
from tritonctl.planning.plan import LoadedPlan
from tritonctl.triton.binary import TritonBinary
from tritonctl.triton.render import Launch

EXIT_TIMEOUT_S = 10
ROUTER_FILE = "router.json"
LOOPBACK = "127.0.0.1"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free now. Bound all at once: ports asked for one after another can come back the
    same (seen: Triton refusing to start with its gRPC and metrics ports equal)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def free_port(host: str) -> int:
    return free_ports(host, 1)[0]


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on the port. SO_REUSEADDR, as the router binds: connections the router
    closed linger in TIME_WAIT on the port, and they must not count as "in use"."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def proc_stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first); [] when it does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far; 0 when it does not exist."""
    fields = proc_stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS if fields else 0.0


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a process, None when it does not exist."""
    fields = proc_stat_fields(pid)
    return (fields[0], int(fields[19])) if fields else None


def process_alive(pid: int, start_ticks: int) -> bool:
    stat = _proc_stat(pid)
    if stat is None or stat[1] != start_ticks:
        return False
    if stat[0] == "Z":
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
        except ChildProcessError:
            pass
        return False
    return True


def _log_tail(log: Path, lines: int = 12) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in text if line.startswith("E") or "error" in line.lower()]
    return "\n".join((errors or text)[-lines:])


def _answers(record: InstanceRecord) -> Health:
    """What the instance's HTTP endpoint says of the server and its model (its process taken as alive)."""
    base = f"http://{record.host}:{record.http_port}/v2"
    server = http_ok(f"{base}/health/ready")
    return Health(True, server, server and http_ok(f"{base}/models/{record.model}/ready"))


def _control_url(router: dict) -> str:
    """The router's control endpoint, from its record (one without `control_host` listens on its `host`)."""
    return f"http://{router.get('control_host', router['host'])}:{router['control_port']}"


class LocalRuntime:
    name = "local"
    rehearses = False

    def prepare(self, loaded: LoadedPlan, write: bool) -> LoadedPlan:
        """The plan as it is: the instances run from its own repositories."""
        return loaded

    def __init__(self, binary: TritonBinary | None, state_dir: Path):
        """`binary` may be None for a runtime that only probes and stops instances."""
        self.binary = binary
        self.state_dir = state_dir

    @cached_property
    def control_key(self) -> str:
        """The key the instances' control APIs ask for (created with the deployment's first start)."""
        return control_key(self.state_dir)

    def command(
        self, launch: Launch, folder: Path, host: str, grpc_port: int, http_port: int, metrics_port: int
    ) -> list[str]:
        cmd = [
            str(self.binary.path),
            f"--model-repository={folder / 'models'}",
            "--model-control-mode=explicit",
            f"--load-model={launch.model}",
            f"--grpc-address={host}",
            f"--grpc-port={grpc_port}",
            f"--http-address={host}",
            f"--http-port={http_port}",
            f"--metrics-address={host}",
            f"--metrics-port={metrics_port}",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            f"--id={launch.instance}",
            *restriction_flags(self.control_key),
        ]
        if self.binary.backend_dir is not None:
            cmd.append(f"--backend-directory={self.binary.backend_dir}")
        return cmd

    def start(
        self,
        launch: Launch,
        folder: Path,
        host: str,
        log_dir: Path,
        timeout_s: float,
        on_spawn: Callable[[InstanceRecord], None] | None = None,
    ) -> InstanceRecord:
        uid = f"{launch.instance}.{launch.config_hash[:8]}.{secrets.token_hex(3)}"  # unique per start
        grpc_port, http_port, metrics_port = free_ports(host, 3)
        cgroup = None
        mechanism = "none"
        if launch.kind == "cpu":
            try:
                cgroup = share.create(uid, launch.cpu_quota_us, launch.cpu_period_us, launch.cpu_weight)
            except OSError as exc:
                raise StartError(f"{launch.instance}: cannot set its CPU quota ({exc})") from None
            if cgroup is not None:
                mechanism = (
                    f"{share.mechanism()} weight {launch.cpu_weight}"
                    if launch.cpu_weight is not None
                    else f"{share.mechanism()} quota {launch.cpu_quota_us}/{launch.cpu_period_us} us"
                )
        else:
            mechanism = f"MPS {launch.env.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')}%"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{uid}.log"
        env = {**os.environ, **self.binary.env, **launch.env}
        try:
            with log.open("wb") as log_fh:
                proc = subprocess.Popen(
                    self.command(launch, folder, host, grpc_port, http_port, metrics_port),
                    stdout=log_fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    preexec_fn=share.joiner(cgroup),
                )
        except OSError as exc:
            share.remove(cgroup)
            raise StartError(f"cannot start {self.binary.path} for {launch.instance}: {exc}") from None
        stat = _proc_stat(proc.pid)
        record = InstanceRecord(
            uid=uid,
            instance=launch.instance,
            model=launch.model,
            device=launch.device,
            share=launch.share,
            units=launch.units,
            config_hash=launch.config_hash,
            process_hash=launch.process_hash,
            host=host,
            grpc_port=launch.grpc_port,
            backend_port=grpc_port,
            http_port=http_port,
            metrics_port=metrics_port,
            pid=proc.pid,
            start_ticks=stat[1] if stat else 0,
            folder=str(folder),
            log=str(log),
            share_mechanism=mechanism,
            cgroup=str(cgroup) if cgroup else None,
        )
        try:
            if on_spawn is not None:
                on_spawn(record)
            self._wait_ready(proc, record, timeout_s)
        except BaseException:  # not ready, or interrupted: leave nothing running behind
            self.stop(record)
            raise
        return record

    def _wait_ready(self, proc: subprocess.Popen, record: InstanceRecord, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise StartError(
                    f"tritonserver for {record.instance} exited with code {proc.returncode}; "
                    f"log {record.log}:\n{_log_tail(Path(record.log))}",
                    crashed=proc.returncode < 0,
                )
            # Over HTTP only: `health` reaps a dead child, and Popen would then report its exit code as 0.
            if _answers(record).model_ready:
                return
            if time.monotonic() > deadline:
                raise StartError(
                    f"{record.instance} was not ready after {timeout_s:.0f} s; log {record.log}:\n"
                    f"{_log_tail(Path(record.log))}"
                )
            time.sleep(0.2)

    def health(self, record: InstanceRecord) -> Health:
        if not process_alive(record.pid, record.start_ticks):
            return Health(False, False, False)
        return _answers(record)

    def reconfigure(self, record: InstanceRecord, timeout_s: float) -> None:
        error = load_model(f"http://{record.host}:{record.http_port}", record.model, timeout_s, self.control_key)
        if error is not None:
            raise StartError(f"{record.instance}: reloading {record.model} failed: {error}")

    def stop(self, record: InstanceRecord) -> None:
        """Drain and stop the instance: SIGTERM to tritonserver alone, SIGKILL to what is left at the deadline.

        On SIGTERM Triton closes its endpoints (gRPC clients get GOAWAY and reconnect to the
        other process on the shared port), finishes the requests it holds, then stops its
        backend stubs itself; signalling the whole group at once would kill the stubs under
        in-flight requests. Only processes known to be the instance's are signalled: its group
        while its leader is still the process we started, and whatever remains in its cgroup.
        """
        cgroup = Path(record.cgroup) if record.cgroup else None
        if process_alive(record.pid, record.start_ticks):
            try:
                os.kill(record.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + EXIT_TIMEOUT_S + 5
            while process_alive(record.pid, record.start_ticks) and time.monotonic() < deadline:
                time.sleep(0.05)
            if process_alive(record.pid, record.start_ticks):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record.pid, signal.SIGKILL)
        for pid in share.members(cgroup) if cgroup else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        share.remove(cgroup)

    # The router: one per deployment, started on first use, recorded in the state folder.

    def _router_record(self) -> dict | None:
        """The running router's record, None when it does not run."""
        try:
            rec = json.loads((self.state_dir / ROUTER_FILE).read_text())
        except (OSError, ValueError):
            return None
        return rec if process_alive(rec["pid"], rec["start_ticks"]) else None

    def _router_url(self, host: str) -> str:
        rec = self._router_record()
        if rec is None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            (self.state_dir / "logs").mkdir(exist_ok=True)
            port = free_port(LOOPBACK)
            with (self.state_dir / "logs" / "router.log").open("ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tritonctl.deploy.router", "--host", host, "--control-host", LOOPBACK,
                     "--control-port", str(port), "--routes", str(self.state_dir / "routes.json")],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            stat = _proc_stat(proc.pid)
            rec = {"pid": proc.pid, "start_ticks": stat[1] if stat else 0, "host": host, "control_host": LOOPBACK,
                   "control_port": port}  # fmt: skip
            write_json_atomic(self.state_dir / ROUTER_FILE, rec)
            deadline = time.monotonic() + 10
            while not http_ok(f"{_control_url(rec)}/routes"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise TritonctlError("the router did not start", file=self.state_dir / "logs" / "router.log")
                time.sleep(0.05)
        return _control_url(rec)

    def route(self, host: str, port: int, records: list[InstanceRecord]) -> str:
        backends = backends_of(records)
        ok, answer = put_json(f"{self._router_url(host)}/routes/{port}", {"backends": backends}, DRAIN_TIMEOUT_S + 10)
        if not ok:
            raise TritonctlError(f"the router did not take the route for port {port}: {answer.strip()}")
        return route_summary(port, backends, json.loads(answer))

    def router_ok(self) -> bool:
        rec = self._router_record()
        return rec is not None and http_ok(f"{_control_url(rec)}/routes")

    def shutdown(self) -> None:
        """Stop the router (after `down` closed every route): SIGTERM, SIGKILL if it is still there after 5 s."""
        rec = self._router_record()
        if rec is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec["pid"], signal.SIGTERM)
            deadline = time.monotonic() + 5
            while process_alive(rec["pid"], rec["start_ticks"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if process_alive(rec["pid"], rec["start_ticks"]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec["pid"], signal.SIGKILL)
        (self.state_dir / ROUTER_FILE).unlink(missing_ok=True)
        (self.state_dir / "routes.json").unlink(missing_ok=True)

"""Local runtime: one real tritonserver process per instance on this machine.

Clients keep one address per model: the model's port is served by HAProxy (tritonctl/deploy/proxy.py,
one per deployment), which balances each request over the model's instances as the plan weights
them, and drains an instance before it is replaced. Every instance has its own gRPC, HTTP (health,
model control) and metrics ports. Triton's control APIs answer only requests carrying the
deployment's key (state.py `control_key`); HAProxy's runtime API is a unix socket in the state
folder, readable by its owner only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from tritonctl.deploy import mps, share
from tritonctl.deploy.gpu import lock_clocks, release_clocks
from tritonctl.deploy.proxy import (
    ProxyApi,
    Routes,
    Server,
    backend,
    balance,
    buffer_bytes,
    environment,
    haproxy_weights,
    parse_version,
    render_config,
    server_name,
)
from tritonctl.deploy.runtime import (
    Health,
    InstanceRecord,
    StartError,
    http_ok,
    load_model,
    route_summary,
    server_flags,
)
from tritonctl.deploy.state import control_key
from tritonctl.errors import TritonctlError
from tritonctl.files import file_identity, write_json_atomic
from tritonctl.planning.plan import LoadedPlan
from tritonctl.shares import MAX_WEIGHT
from tritonctl.triton.binary import TritonBinary
from tritonctl.triton.render import Launch

EXIT_TIMEOUT_S = 10
HAPROXY_PATHS = ("/usr/sbin/haproxy",)  # where Debian installs it, off a non-root user's PATH
PROXY_FILE = "haproxy.json"  # the running HAProxy's record
PROXY_CONFIG = "haproxy.cfg"
PROXY_SOCKET = "haproxy.sock"  # its runtime API
ROUTES_FILE = "routes.json"  # what it serves: model port -> servers
LOOPBACK = "127.0.0.1"
CPUCLOCK_SCHED = 2  # a process-wide CPU clock id is (~pid << 3) | 2 (Linux posix-cpu-timers)


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
    """True when nothing listens on the port. SO_REUSEADDR, as HAProxy binds: connections HAProxy
    closed linger in TIME_WAIT on the port, and they must not count as "in use"."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class Listener:
    """A process listening on a TCP port: its name and pid, and for the HAProxy of a tritonctl deployment, that
    deployment's state folder."""

    name: str
    pid: int
    state_dir: Path | None

    def __str__(self) -> str:
        ours = f", the HAProxy of the deployment with state in {self.state_dir}" if self.state_dir else ""
        return f"{self.name} (pid {self.pid}){ours}"


def _listening_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A /proc/net/tcp{,6} local address (its host part: 32-bit words in the host's byte order) as an address."""
    words = b"".join(bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8))
    return ipaddress.ip_address(words)


def _in_the_way(listening: ipaddress.IPv4Address | ipaddress.IPv6Address, host: str | None) -> bool:
    """Whether a socket listening on `listening` keeps a bind to `host` (None: any address) from its port."""
    try:
        wanted = ipaddress.ip_address(host) if host is not None else None
    except ValueError:  # a host name: as any address
        wanted = None
    if wanted is None or listening.is_unspecified:
        return True
    if isinstance(listening, ipaddress.IPv6Address) and listening.ipv4_mapped is not None:
        listening = listening.ipv4_mapped
    return wanted.is_unspecified or listening == wanted


def port_holder(port: int, host: str | None = None) -> Listener | None:
    """Which process listens on the TCP port where a bind to `host` would collide with it (any address where None;
    from /proc: Linux, and the processes this user may see); None where none is found."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(hex_port, 16) == port and _in_the_way(_listening_address(address), host):
                    inodes.add(f"socket:[{fields[9]}]")  # 0A: listening
    for proc in Path("/proc").iterdir() if inodes else ():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
                config = next((arg for arg in argv if arg.endswith(PROXY_CONFIG)), None)
                state_dir = (Path(os.readlink(proc / "cwd")) / config).parent.resolve() if config else None
                if state_dir is not None and not (state_dir / PROXY_FILE).is_file():  # an HAProxy not of tritonctl
                    state_dir = None
                return Listener((proc / "comm").read_text().strip(), int(proc.name), state_dir)
    return None


def ephemeral_ports() -> range | None:
    """The ports the kernel hands out to sockets bound to port 0 and to outgoing connections (None off Linux)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def proc_stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first); [] when it does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def cpu_seconds(pid: int) -> float:
    """CPU time a process (all its threads, exited ones too) has used so far, to the nanosecond: its
    process-wide scheduler clock (clock_getcpuclockid's id; /proc's counts come in 10 ms ticks, too coarse
    for the CPU of a few hundred tiny requests); 0 when it does not exist."""
    try:
        return time.clock_gettime((~pid << 3) | CPUCLOCK_SCHED)
    except OSError:
        return 0.0


def group_pids(group: int) -> list[int]:
    """The processes of a process group (HAProxy's master leads its own)."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [pid for pid in pids if (f := proc_stat_fields(pid)) and int(f[2]) == group]


def group_cpu_seconds(group: int) -> float:
    """CPU seconds used so far by every process of a process group."""
    return sum(cpu_seconds(pid) for pid in group_pids(group))


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


def _log_since(log: Path, since: int) -> list[str]:
    """The lines a log gained after byte `since`."""
    try:
        with log.open("rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def _proxy_alerts(log: Path, since: int = 0) -> str:
    """HAProxy's alerts logged after byte `since` (why a worker did not start), else its last lines."""
    text = _log_since(log, since)
    alerts = [line for line in text if "[ALERT]" in line]
    return "\n".join((alerts or text)[-4:])


def _answers(record: InstanceRecord) -> Health:
    """What the instance's HTTP endpoint says of the server and its model (its process taken as alive)."""
    base = f"http://{record.host}:{record.http_port}/v2"
    server = http_ok(f"{base}/health/ready")
    return Health(True, server, server and http_ok(f"{base}/models/{record.model}/ready"))


def one_host(loaded: LoadedPlan, runtime: str) -> None:
    """Refuse a plan whose devices are on several nodes: `runtime` deploys on one host."""
    nodes = loaded.plan.nodes()
    if len(nodes) > 1:
        raise TritonctlError(
            f"the plan's devices are on {len(nodes)} nodes ({', '.join(nodes)}); the {runtime} runtime deploys on "
            "one host: render it with --target kubernetes",
            file=loaded.path,
            field="devices",
        )


def within_host_cores(loaded: LoadedPlan) -> None:
    """Refuse a CPU plan whose devices stand for more cores than this host gives tritonctl: their quotas would
    promise CPU that is not there."""
    planned = sum(d.cores or 0 for d in loaded.plan.devices if d.kind == "cpu")
    here = len(os.sched_getaffinity(0))
    if planned > here + 1e-9:
        raise TritonctlError(
            f"the plan's CPU devices stand for {planned:g} cores and this host gives tritonctl {here}: set the "
            "cluster file's devices[].cores to what this host has and plan again",
            file=loaded.path,
            field="devices",
        )


def plain_folders(loaded: LoadedPlan) -> None:
    """Refuse runtime folders whose paths have spaces or characters beyond ASCII: tritonserver and its Python
    backend fail to start from them (after the whole start-up timeout, with a space)."""
    for field in ("repository_dir", "state_dir"):
        path = str(loaded.resolve(getattr(loaded.plan.runtime, field)))
        if not path.isascii() or any(c.isspace() for c in path):
            raise TritonctlError(
                f"{path!r}: Triton cannot run from a folder whose path has spaces or non-ASCII characters; set "
                f"runtime.{field} in the cluster file to another folder and plan again",
                file=loaded.path,
                field=f"runtime.{field}",
            )


def haproxy_binary() -> str:
    """The haproxy executable; TritonctlError saying how to install it where there is none."""
    found = shutil.which("haproxy") or next((p for p in HAPROXY_PATHS if Path(p).is_file()), None)
    if found is None:
        raise TritonctlError(
            "HAProxy is not installed, and every model's address is served by it: install it "
            "(`make install` does, with `apt-get install haproxy`; HAProxy 2.6 or newer) and apply again"
        )
    return found


@functools.lru_cache(maxsize=4)
def haproxy_version(binary: str, *identity: int) -> tuple[int, int] | None:
    """The (major, minor) version of this haproxy executable (`identity`: its file's, so that an upgrade is seen),
    None where `haproxy -v` does not say."""
    try:
        shown = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_version(shown)


def proxy_buffer() -> int:
    """The buffer size the installed HAProxy is given (`proxy.buffer_bytes`)."""
    binary = haproxy_binary()
    return buffer_bytes(haproxy_version(binary, *file_identity(Path(binary))))


class LocalRuntime:
    name = "local"
    rehearses = False

    def prepare(self, loaded: LoadedPlan, write: bool) -> LoadedPlan:
        """The plan (the instances run from its own repositories), once HAProxy is known to be there. A GPU plan:
        served by the Python-backend GPU glue where this tritonserver has no onnxruntime backend; unless only
        rehearsed (`write` False), its SM clocks locked where it sets them and, where it splits a GPU into
        shares, its MPS control daemon running (started or adopted)."""
        one_host(loaded, self.name)
        within_host_cores(loaded)
        plain_folders(loaded)
        haproxy_binary()
        if loaded.plan.target != "gpu":
            return loaded
        if self.binary is not None and self.binary.gpu_backend() == "python":
            runtime = loaded.plan.runtime.model_copy(update={"gpu_backend": "python"})
            loaded = LoadedPlan(loaded.plan.model_copy(update={"runtime": runtime}), loaded.path)
        if write:
            lock_clocks(self.state_dir, loaded.plan.devices)  # the energy objective's clocks, before any start
            try:
                if mps.needed(loaded.plan):
                    mps.ensure(self.state_dir)
            except TritonctlError:
                release_clocks(self.state_dir)  # nothing half-started
                raise
        return loaded

    def __init__(self, binary: TritonBinary | None, state_dir: Path):
        """`binary` may be None for a runtime that only probes and stops instances."""
        self.binary = binary
        self.state_dir = state_dir.absolute()  # HAProxy reads a relative socket path as host:port
        self.mps = mps.Daemon(self.state_dir)  # a GPU deployment's MPS daemon (`prepare` starts it)

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
            *server_flags(self.control_key),
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
                cgroup = share.create(
                    uid, launch.cpu_quota_us, launch.cpu_period_us, launch.cpu_weight, launch.cpu_rank
                )
            except OSError as exc:
                raise StartError(f"{launch.instance}: cannot set its CPU quota ({exc})") from None
            if cgroup is not None:
                parts = [f"quota {launch.cpu_quota_us}/{launch.cpu_period_us} us"] if launch.cpu_quota_us else []
                parts += [f"weight {launch.cpu_weight}"] if launch.cpu_weight is not None else []
                parts += [f"rank {launch.cpu_rank}"] if launch.cpu_rank is not None else []
                mechanism = f"{share.mechanism()} {', '.join(parts)}"
        else:
            mechanism = mps.share_mechanism(launch)
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{uid}.log"
        env = {**os.environ, **self.binary.env, **launch.env}
        if mps.client(launch):
            env.update(self.mps.env)
        elif launch.kind == "gpu":  # its own CUDA context, not a client of any MPS daemon the host's environment names
            for name in mps.CLIENT_ENV:
                env.pop(name, None)
        try:
            with log.open("wb") as log_fh:
                proc = subprocess.Popen(
                    share.joining(cgroup, self.command(launch, folder, host, grpc_port, http_port, metrics_port)),
                    stdout=log_fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
        except OSError as exc:
            share.remove(cgroup)
            raise StartError(f"cannot start {self.binary.path} for {launch.instance}: {exc}") from None
        stat = _proc_stat(proc.pid)
        record = InstanceRecord.launched(
            launch,
            uid=uid,
            host=host,
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

    # The proxy: one HAProxy per deployment, started on first use, recorded in the state folder.

    def _proxy_record(self) -> dict | None:
        """The running HAProxy's record (its master's pid and start time, metrics port), or None."""
        try:
            rec = json.loads((self.state_dir / PROXY_FILE).read_text())
        except (OSError, ValueError):
            return None
        return rec if process_alive(rec["pid"], rec["start_ticks"]) else None

    @property
    def _api(self) -> ProxyApi:
        return ProxyApi(str(self.state_dir / PROXY_SOCKET))

    def _routes(self) -> Routes:
        try:
            saved = json.loads((self.state_dir / ROUTES_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return {int(port): [Server(**s) for s in servers] for port, servers in saved.items()}

    def _write_routes(self, routes: Routes, host: str, metrics_port: int) -> Path:
        """Save the routes and HAProxy's configuration for them (a restarted HAProxy serves the same)."""
        write_json_atomic(
            self.state_dir / ROUTES_FILE,
            {str(port): [dataclasses.asdict(s) for s in servers] for port, servers in sorted(routes.items())},
        )
        config = self.state_dir / PROXY_CONFIG
        socket_path, metrics = str(self.state_dir / PROXY_SOCKET), f"{LOOPBACK}:{metrics_port}"
        text = render_config(routes, host, socket_path, metrics, buffer=proxy_buffer())
        tmp = config.with_suffix(".tmp")
        tmp.write_text(text)
        checked = subprocess.run([haproxy_binary(), "-c", "-f", str(tmp)], capture_output=True, text=True)
        if checked.returncode != 0:
            alerts = [line for line in checked.stderr.splitlines() if "[ALERT]" in line]
            raise TritonctlError(f"HAProxy refused the rendered configuration: {' '.join(alerts[:2])}", file=tmp)
        tmp.replace(config)
        return config

    def _start_proxy(self, routes: Routes, host: str) -> dict:
        """Start HAProxy (master-worker) for these routes and wait until its runtime API answers."""
        socket_path = self.state_dir / PROXY_SOCKET
        if len(str(socket_path)) > 100:
            raise TritonctlError(
                f"the state folder's path is too long for HAProxy's runtime socket ({len(str(socket_path))} "
                "characters, at most 100)",
                file=self.state_dir,
            )
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        metrics_port = free_port(LOOPBACK)
        config = self._write_routes(routes, host, metrics_port)
        log_path = self.state_dir / "logs" / "haproxy.log"
        group = self._proxy_group()
        since = log_path.stat().st_size if log_path.exists() else 0
        env = {**os.environ, **environment(proxy_buffer())}
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                share.joining(group, [haproxy_binary(), "-W", "-db", "-f", str(config)]),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env,
            )  # fmt: skip
        stat = _proc_stat(proc.pid)
        rec = {"pid": proc.pid, "start_ticks": stat[1] if stat else 0, "host": host, "metrics_port": metrics_port,
               "cgroup": None if group is None else str(group)}  # fmt: skip
        deadline = time.monotonic() + 10
        try:
            while not self._api.answers():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise TritonctlError(f"HAProxy did not start: {_proxy_alerts(log_path, since)}", file=log_path)
                time.sleep(0.05)
            write_json_atomic(self.state_dir / PROXY_FILE, rec)
        except BaseException:  # an interrupt too: nothing records it yet, so nothing else would stop it
            self._stop_proxy(rec)
            raise
        return rec

    def _proxy_group(self) -> Path | None:
        """HAProxy's own cgroup, of the largest CPU weight (None where cgroups are not writable). Every request
        passes through it, so it must not wait behind the instances it feeds (at the default weight, beside instances
        given weights by their SLOs, the small models' p99 was up to 4.7 ms longer: bench/proxy_priority.py)."""
        name = "haproxy." + hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:12]
        try:
            return share.create(name, None, None, MAX_WEIGHT)
        except OSError:
            return None

    def _reload_proxy(self, rec: dict, routes: Routes, before: Routes, host: str | None = None) -> None:
        """Rewrite the configuration for a new set of model ports (listening on `host`, by default where they listen
        now) and reload (the old worker finishes its requests). If the new configuration does not load, the saved
        one goes back to `before`, what still runs."""
        self._write_routes(routes, host or rec["host"], rec["metrics_port"])
        log_path = self.state_dir / "logs" / "haproxy.log"
        since = log_path.stat().st_size if log_path.exists() else 0
        old_worker = self._api.worker_pid()
        os.kill(rec["pid"], signal.SIGUSR2)
        wanted = {backend(port) for port in routes}
        deadline = time.monotonic() + 10
        while True:
            # the new worker answers with the new backends (the old one may list the same: a balance or host change)
            with contextlib.suppress(TritonctlError):
                if self._api.worker_pid() not in (None, old_worker):
                    listed = {line.split(",", 1)[0] for line in self._api("show stat -1 1 -1").splitlines()[1:] if line}
                    if listed - {"metrics", ""} == wanted:
                        return
            # A new configuration that cannot load (a port taken) fails at once; the old worker resumes serving.
            if time.monotonic() > deadline or any("Loading failure" in line for line in _log_since(log_path, since)):
                self._write_routes(before, rec["host"], rec["metrics_port"])
                raise TritonctlError(f"HAProxy did not reload: {_proxy_alerts(log_path, since)}", file=log_path)
            time.sleep(0.05)

    def route(self, host: str, port: int, backends: list[tuple[InstanceRecord, float]]) -> str:
        weights = haproxy_weights([weight for _, weight in backends])
        servers = [
            Server(server_name(r.uid), r.host, r.backend_port, r.http_port, w)
            for (r, _), w in zip(backends, weights, strict=True)
        ]
        before = self._routes()
        routes = {p: s for p, s in before.items() if p != port}
        if servers:
            routes[port] = servers
        rec = self._proxy_record()
        done: dict = {}
        if rec is None:
            if routes:
                rec = self._start_proxy(routes, host)
            else:
                (self.state_dir / ROUTES_FILE).unlink(missing_ok=True)
        elif rec["host"] != host:  # the plan's runtime.host changed: the model ports listen there from now on
            self._reload_proxy(rec, routes, before, host)
            write_json_atomic(self.state_dir / PROXY_FILE, {**rec, "host": host})
        elif set(routes) != set(before) or balance(servers) != balance(before.get(port, servers)):
            self._reload_proxy(rec, routes, before)
        else:
            done = self._api.set_servers(port, servers)
            self._write_routes(routes, rec["host"], rec["metrics_port"])
        return route_summary(port, [f"{s.host}:{s.port} weight {s.weight}" for s in servers], done)

    def proxy_ok(self) -> bool:
        return self._proxy_record() is not None and self._api.answers()

    def proxy_cpu_seconds(self) -> float:
        """CPU seconds HAProxy (master and worker) has used so far; 0 when it is not running."""
        rec = self._proxy_record()
        return 0.0 if rec is None else group_cpu_seconds(rec["pid"])

    def proxy_info(self) -> str:
        rec = self._proxy_record()
        if rec is None:
            return "HAProxy: not running"
        return (
            f"HAProxy: pid {rec['pid']}, runtime API {self.state_dir / PROXY_SOCKET}, "
            f"metrics http://{LOOPBACK}:{rec['metrics_port']}/metrics"
        )

    def proxy_metrics_url(self) -> str | None:
        rec = self._proxy_record()
        return None if rec is None else f"http://{LOOPBACK}:{rec['metrics_port']}/metrics"

    def _stop_proxy(self, rec: dict) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 5
        while process_alive(rec["pid"], rec["start_ticks"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if process_alive(rec["pid"], rec["start_ticks"]):
            for kill in (os.kill, os.killpg):  # the master, then its group (its worker)
                with contextlib.suppress(ProcessLookupError):
                    kill(rec["pid"], signal.SIGKILL)
        if rec.get("cgroup"):
            share.remove(Path(rec["cgroup"]))

    def shutdown(self) -> None:
        """Stop HAProxy (after `down` closed every route): SIGTERM, SIGKILL to its group after 5 s; then the MPS
        daemon if this deployment started it, and reset the GPU clocks it locked."""
        rec = self._proxy_record()
        if rec is not None:
            self._stop_proxy(rec)
        for name in (PROXY_FILE, ROUTES_FILE, PROXY_CONFIG, PROXY_SOCKET):
            (self.state_dir / name).unlink(missing_ok=True)
        mps.release(self.state_dir)
        release_clocks(self.state_dir)

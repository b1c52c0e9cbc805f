"""Compose runtime: Triton instances as services of a rendered Compose project (tritonctl/deploy/compose_project.py).

A start is `docker compose -f <file> up -d --no-deps <service>`, then a wait for the service's
Triton HTTP ready endpoint; a stop is `docker compose stop` then `rm` of that service. Each
process hash has its own service name, so a shadow swap (the apply logic starts the new instance
and stops the old one only once the new one is ready) runs two services side by side. A route
changes the project's HAProxy service (started on first use) through its runtime API, as for the
local runtime; a new set of model ports reloads it from the rendered configuration.

Every side effect goes through a CommandRunner; in a dry run it records and prints each step
and answers with an injected outcome instead. Never run against a Docker engine: none runs on
the development machines (docker/README.md says what that leaves unverified).
"""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tritonctl.deploy.compose_project import (
    COMPOSE_FILE,
    KEY,
    PROXY,
    TritonService,
    current_settings,
    proxy_api,
    service_name,
    write_compose,
)
from tritonctl.deploy.local import EXIT_TIMEOUT_S
from tritonctl.deploy.mps import share_mechanism
from tritonctl.deploy.proxy import ProxyApi, Server, backend, haproxy_weights, server_name
from tritonctl.deploy.runtime import (
    Health,
    InstanceRecord,
    StartError,
    http_ok,
    load_model,
    route_summary,
)
from tritonctl.errors import TritonctlError
from tritonctl.planning.plan import LoadedPlan
from tritonctl.triton.render import Launch

PROXY_START_S = 30  # seconds for HAProxy's runtime API to answer once `up` returned
PROXY_RELOAD_S = 10  # seconds for HAProxy's new worker to serve a new model port once told to reload


@dataclass(frozen=True)
class Outcome:
    ok: bool
    output: str = ""  # stdout
    error: str = ""  # stderr


def assume_success(step: list[str]) -> Outcome:
    """The dry-run answer to every step: it worked (and a `ps` lists a container)."""
    return Outcome(True, "dry-run")


@dataclass
class CommandRunner:
    """Runs docker commands and HTTP probes; in a dry run, records and prints them and returns `dry_outcome`.

    Steps are argv lists; HTTP calls are recorded as ["probe", url], ["wait-ready", url, timeout] and
    ["load", url, model]; HAProxy runtime API calls as ["proxy", address, command].
    """

    dry_run: bool = False
    log: Callable[[str], None] = print
    dry_outcome: Callable[[list[str]], Outcome] = assume_success
    steps: list[list[str]] = field(default_factory=list)

    def _dry(self, step: list[str], text: str) -> Outcome | None:
        self.steps.append(step)
        if not self.dry_run:
            return None
        self.log(f"+ {text}")
        return self.dry_outcome(step)

    def run(self, argv: list[str]) -> Outcome:
        if (dry := self._dry(argv, shlex.join(argv))) is not None:
            return dry
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        except OSError as exc:
            return Outcome(False, error=str(exc))
        return Outcome(proc.returncode == 0, proc.stdout, proc.stderr)

    def probe(self, url: str) -> bool:
        dry = self._dry(["probe", url], f"GET {url}")
        return dry.ok if dry is not None else http_ok(url)

    def wait_ready(self, url: str, timeout_s: float) -> bool:
        dry = self._dry(["wait-ready", url, f"{timeout_s:g}"], f"wait until GET {url} answers 200 ({timeout_s:g} s)")
        if dry is not None:
            return dry.ok
        deadline = time.monotonic() + timeout_s
        while not http_ok(url):
            if time.monotonic() > deadline:
                return False
            time.sleep(1)
        return True

    def load(self, url: str, model: str, timeout_s: float, key: str) -> str | None:
        """Reload `model` through Triton's model control, with the control `key` (never printed); the error, or None."""
        dry = self._dry(["load", url, model], f"POST {url}/v2/repository/models/{model}/load")
        if dry is not None:
            return None if dry.ok else dry.error
        return load_model(url, model, timeout_s, key)

    def proxy(self, address: str, command: str, servers: list[Server] | None = None) -> Outcome:
        """Send HAProxy's runtime API at `address` one command, or (`servers` given) make them the servers of
        the backend `command` names (ProxyApi.set_servers); the answer as output (JSON for set_servers)."""
        text = command if servers is None else f"set servers of {command}: {[s.name for s in servers]}"
        if (dry := self._dry(["proxy", address, text], f"HAProxy {address}: {text}")) is not None:
            return dry
        api = ProxyApi(address)
        try:
            if servers is None:
                return Outcome(True, api(command))
            return Outcome(True, json.dumps(api.set_servers(int(command.removeprefix("port")), servers)))
        except TritonctlError as exc:
            return Outcome(False, error=str(exc))


class ComposeRuntime:
    """The Runtime of runtime/base.py over the Compose project rendered into `folder`.

    The MPS daemon must already run (`docker compose up -d` starts it): starts use --no-deps,
    so starting one Triton service never recreates the daemon the others are attached to.
    """

    name = "compose"

    def __init__(self, folder: Path, runner: CommandRunner | None = None, gpus: int | None = None):
        """`gpus`: the host's GPU count, checked against each plan (None: not checked)."""
        self.folder = folder.resolve()
        self.compose_file = self.folder / COMPOSE_FILE
        self.runner = runner or CommandRunner()
        self.gpus = gpus
        self.project = self._read()["name"]
        self.proxy_api = proxy_api(current_settings(self.folder))
        self.services: dict[str, TritonService] = {}  # by service name, once a plan is prepared
        self._latest: dict[str, str] = {}  # service -> uid of this runtime's latest start of it
        self._proxy_up = False

    @property
    def rehearses(self) -> bool:
        return self.runner.dry_run

    def _read(self) -> dict:
        if not self.compose_file.exists():
            raise TritonctlError(
                f"no Compose project in {self.folder}: render the plan there first "
                f"(tritonctl render PLAN --target compose -o {self.folder}) and start it (docker compose up -d)",
                file=self.compose_file,
            )
        try:
            project = yaml.safe_load(self.compose_file.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise TritonctlError(f"cannot read the Compose project: {exc}", file=self.compose_file) from None
        if not isinstance(project, dict) or not isinstance(project.get("name"), str):
            raise TritonctlError("not a project tritonctl rendered (no name): render it again", file=self.compose_file)
        return project

    def _compose(self, *args: str, with_file: bool = False) -> list[str]:
        # stop, rm, ps and logs go by project name alone (no -f): docker compose then finds the
        # service's containers by label, so a service the latest render no longer has still answers.
        file = ["-f", str(self.compose_file)] if with_file else []
        return ["docker", "compose", "-p", self.project, *file, *args]

    def prepare(self, loaded: LoadedPlan, write: bool) -> LoadedPlan:
        """Re-render the project for the plan (running services keep their names and ports, .env its values), once
        Docker Compose v2 is known to be there."""
        if not self.runner.dry_run:
            found = self.runner.run(["docker", "compose", "version"])
            if not found.ok:
                said = next(iter((found.error or found.output).strip().splitlines()), "failed")
                raise TritonctlError(
                    f"Docker Compose v2 is not available here (`docker compose version`: {said}): install Docker "
                    "with its Compose plugin, or render the project with `tritonctl render --target compose` and run "
                    "it where Docker is; nothing changed",
                    file=loaded.path,
                )
        # the repositories are apply's to render, from the plan this returns
        project = write_compose(loaded, self.folder, self.gpus, write, repositories=False)
        self.project, self.proxy_api = project.name, project.proxy_api
        self.services = {service.name: service for service in project.services.values()}
        return project.loaded

    def start(
        self,
        launch: Launch,
        folder: Path,
        host: str,
        log_dir: Path,
        timeout_s: float,
        on_spawn: Callable[[InstanceRecord], None] | None = None,
    ) -> InstanceRecord:
        service = service_name(launch.instance, launch.process_hash)
        rendered = self.services.get(service)
        if rendered is None:
            raise StartError(f"{service} is not in {self.compose_file}: apply prepares the plan first")
        record = InstanceRecord.launched(
            launch,
            uid=f"{service}.{secrets.token_hex(3)}",
            host=host,
            backend_port=rendered.grpc_port,
            http_port=rendered.http_port,
            metrics_port=rendered.metrics_port,
            pid=0,
            start_ticks=0,
            folder=str(folder),
            log=shlex.join(self._compose("logs", service)),
            share_mechanism=f"{share_mechanism(launch)} ({service})",
        )
        # --force-recreate: restarting an unready service must replace its container; never
        # --remove-orphans, which would remove the old instance before the new one is ready.
        started = self.runner.run(self._compose("up", "-d", "--no-deps", "--force-recreate", service, with_file=True))
        if not started.ok:
            self._discard(service)
            raise StartError(f"{service} did not start: {started.error.strip() or started.output.strip()}")
        if on_spawn is not None:
            on_spawn(record)
        if not self.runner.wait_ready(self._url(record, f"models/{launch.model}/ready"), timeout_s):
            logs = self.runner.run(self._compose("logs", "--no-color", "--tail", "20", service)).output
            self._discard(service)
            raise StartError(f"{service} was not ready after {timeout_s:.0f} s; its last log lines:\n{logs}")
        self._latest[service] = record.uid
        return record

    def _discard(self, service: str) -> None:
        self.runner.run(self._compose("rm", "--stop", "--force", service))

    @staticmethod
    def _url(record: InstanceRecord, path: str) -> str:
        return f"http://{record.host}:{record.http_port}/v2/{path}"

    def health(self, record: InstanceRecord) -> Health:
        running = self.runner.run(self._compose("ps", "--status", "running", "--quiet", _service(record)))
        if not (running.ok and running.output.strip()):
            return Health(False, False, False)
        server = self.runner.probe(self._url(record, "health/ready"))
        return Health(True, server, server and self.runner.probe(self._url(record, f"models/{record.model}/ready")))

    def reconfigure(self, record: InstanceRecord, timeout_s: float) -> None:
        key = current_settings(self.folder)[KEY]  # .env's, which the project's services were started with
        error = self.runner.load(f"http://{record.host}:{record.http_port}", record.model, timeout_s, key)
        if error is not None:
            raise StartError(f"{_service(record)}: reloading {record.model} failed: {error}")

    def _frontends(self) -> set[str] | None:
        """The model ports HAProxy serves now (as backend names); None when its API does not answer."""
        answer = self.runner.proxy(self.proxy_api, "show stat -1 1 -1")
        if not answer.ok:
            return None
        return {line.split(",", 1)[0] for line in answer.output.splitlines()[1:] if line} - {"metrics", ""}

    def _start_proxy(self) -> None:
        """Start the HAProxy service unless this runtime did already (`up` leaves a running one as it is)."""
        if self._proxy_up:
            return
        started = self.runner.run(self._compose("up", "-d", "--no-deps", PROXY, with_file=True))
        if not started.ok:
            raise TritonctlError(f"HAProxy did not start: {started.error.strip()}", file=self.compose_file)
        self._await_proxy(lambda: self._frontends() is not None, PROXY_START_S, "its runtime API did not answer")
        self._proxy_up = True

    def _await_proxy(self, done: Callable[[], bool], limit_s: float, failure: str) -> None:
        """Wait until `done()` holds; TritonctlError saying HAProxy's `failure` after `limit_s` seconds."""
        deadline = time.monotonic() + limit_s
        while not done():
            if time.monotonic() > deadline:
                raise TritonctlError(
                    f"HAProxy ({self.proxy_api}): {failure} within {limit_s} s "
                    f"(docker compose -p {self.project} logs {PROXY})",
                    file=self.compose_file,
                )
            time.sleep(0.1)

    def route(self, host: str, port: int, backends: list[tuple[InstanceRecord, float]]) -> str:
        self._start_proxy()
        weights = haproxy_weights([weight for _, weight in backends])
        servers = [
            Server(server_name(_service(r)), r.host, r.backend_port, r.http_port, w)
            for (r, _), w in zip(backends, weights, strict=True)
        ]
        described = [f"{s.host}:{s.port} weight {s.weight}" for s in servers]
        if servers and not self.runner.dry_run and backend(port) not in (self._frontends() or set()):
            self._reload_proxy(port)
            return route_summary(port, described, {})
        answer = self.runner.proxy(self.proxy_api, backend(port), servers)
        if not answer.ok:
            self._proxy_up = False  # probe and start it again next time: it may have died
            raise TritonctlError(f"HAProxy did not take the servers for port {port}: {answer.error.strip()}")
        try:
            done = json.loads(answer.output)
        except ValueError:  # a dry run's answer
            done = {}
        return route_summary(port, described, done)

    def _reload_proxy(self, port: int) -> None:
        """Open a new model port: HAProxy reloads the configuration `prepare` rendered, which has it; the port is open
        once HAProxy's new worker answers with it (the old one finishes what it holds)."""
        sent = self.runner.run(self._compose("kill", "-s", "USR2", PROXY))
        if not sent.ok:
            raise TritonctlError(f"HAProxy could not be told to reload: {sent.error.strip()}", file=self.compose_file)
        self._await_proxy(
            lambda: backend(port) in (self._frontends() or set()),
            PROXY_RELOAD_S,
            f"its new worker did not open port {port} after a reload",
        )

    def proxy_ok(self) -> bool:
        return self._frontends() is not None

    def proxy_metrics_url(self) -> str | None:
        settings = current_settings(self.folder)
        address = settings["PROXY_API_ADDRESS"]
        host = "127.0.0.1" if address == "0.0.0.0" else address
        return f"http://{host}:{settings['PROXY_METRICS_PORT']}/metrics"

    def proxy_info(self) -> str:
        return f"HAProxy: service {PROXY} of project {self.project}, runtime API {self.proxy_api}"

    def _stop_and_remove(self, service: str, *stop_args: str) -> None:
        for args in (("stop", *stop_args), ("rm", "--force")):
            done = self.runner.run(self._compose(*args, service))
            if not done.ok:
                self.runner.log(f"warning: docker compose {args[0]} {service} failed: {done.error.strip()}")

    def shutdown(self) -> None:
        """Stop and remove the HAProxy service (after `down` closed every route)."""
        self._stop_and_remove(PROXY)
        self._proxy_up = False

    def stop(self, record: InstanceRecord) -> None:
        """Stop (Triton drains for --exit-timeout-secs) and remove the record's service."""
        service = _service(record)
        if self._latest.get(service, record.uid) != record.uid:
            return  # a restart reused this service: its container is the new instance now
        self._stop_and_remove(service, "--timeout", str(EXIT_TIMEOUT_S + 5))
        self._latest.pop(service, None)


def _service(record: InstanceRecord) -> str:
    return record.uid.rsplit(".", 1)[0]

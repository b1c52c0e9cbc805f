"""What runs where: the deployment state file, and the lock that lets one apply run at a time."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Collection, Iterable
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from tritonctl.deploy.runtime import InstanceRecord
from tritonctl.errors import TritonctlError
from tritonctl.files import MAX_INPUT_BYTES, check_output_dir, excerpt, read_text, write_json_atomic
from tritonctl.planning.plan import LoadedPlan
from tritonctl.triton.client import Endpoint

STATE_FILE = "state.json"
KEY_FILE = "control.key"
OWNER_FILE = ".tritonctl-deployment"  # in a repository folder: the state folder of the deployment it serves
SNAPSHOT_DIR = ".tritonctl-previous"  # in a repository folder: its instance folders while an apply may roll back


@dataclass
class State:
    cluster: str = ""
    plan: str = ""
    runtime: str = "local"
    instances: dict[str, InstanceRecord] = field(default_factory=dict)


_JSON_TYPES = {"int": int, "str": str, "str | None": (str, type(None))}  # InstanceRecord's field types


def _is(value, expected) -> bool:
    return isinstance(value, expected) and not (expected is int and isinstance(value, bool))


def _record(uid: str, raw) -> InstanceRecord:
    """One instance of the state file, every field present and of its type; ValueError naming what is not."""
    if not isinstance(raw, dict):
        raise ValueError(f"instance {excerpt(uid)} is {excerpt(raw)}, not a mapping")
    for f in fields(InstanceRecord):
        if f.name not in raw:
            if f.default is MISSING:
                raise ValueError(f"instance {excerpt(uid)} has no {f.name!r}")
        elif not _is(raw[f.name], _JSON_TYPES.get(f.type, object)):
            raise ValueError(f"instance {excerpt(uid)}: {f.name} is {excerpt(raw[f.name])}, not {f.type}")
    unknown = set(raw) - {f.name for f in fields(InstanceRecord)}
    if unknown:
        raise ValueError(f"instance {excerpt(uid)}: unknown field {excerpt(sorted(unknown)[0])}")
    return InstanceRecord(**raw)


def load_state(state_dir: Path) -> State:
    path = state_dir / STATE_FILE
    if not path.exists():
        return State()
    try:
        raw = json.loads(read_text(path, limit=16 * MAX_INPUT_BYTES))
        if not isinstance(raw, dict) or not isinstance(raw.get("instances"), dict):
            raise ValueError("no `instances` mapping")
        records = {uid: _record(uid, rec) for uid, rec in raw.pop("instances").items()}
        for name, value in raw.items():
            if name not in State.__dataclass_fields__ or not isinstance(value, str):
                raise ValueError(f"{excerpt(name)}: {excerpt(value)}")
        return State(**raw, instances=records)
    except ValueError as exc:
        raise TritonctlError(
            f"corrupt state file ({exc}); stop stray tritonserver and haproxy processes and remove it", file=path
        ) from None


def save_state(state_dir: Path, state: State) -> None:
    """Write atomically, so a crash never leaves half a state file."""
    write_json_atomic(state_dir / STATE_FILE, asdict(state))


def control_key(state_dir: Path) -> str:
    """The deployment's key to Triton's control APIs (runtime/base.py RESTRICTED_APIS): created on first
    use with mode 0600, then kept, since the instances running were started with it."""
    path = state_dir / KEY_FILE
    state_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=f".{KEY_FILE}.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        os.link(tmp, path)  # atomic, and never replaces a key already there
    except FileExistsError:
        os.chmod(path, 0o600)
    finally:
        os.unlink(tmp)
    key = path.read_text().strip()
    if not key:
        raise TritonctlError("empty control key: remove it, then restart the instances (down, apply)", file=path)
    return key


@contextmanager
def apply_lock(state_dir: Path):
    """Hold the deployment's lock; refuse at once when another apply holds it."""
    check_output_dir(state_dir, file=state_dir, field=None, writable=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "apply.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise TritonctlError(
                f"another apply holds the lock ({fh.read().strip() or 'unknown pid'})", file=fh.name
            ) from None
        fh.truncate(0)
        fh.write(f"pid {os.getpid()}")
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def straight_to_instances(targets: list[Endpoint], state_dir: Path) -> list[Endpoint]:
    """The same endpoints at their instances' own gRPC ports instead of the models' addresses (the proxy);
    one instance per model (a model's last recorded instance)."""
    own = {r.model: f"{r.host}:{r.backend_port}" for r in load_state(state_dir).instances.values()}
    return [dataclasses.replace(t, url=own[t.model]) for t in targets]


def claim_repositories(loaded: LoadedPlan, write: bool = True) -> None:
    """Refuse to write the plan's model repositories where a running deployment with another state folder serves
    from; else mark the folder as this plan's deployment's (one that has stopped leaves it to whoever comes next),
    unless only checking (`write` False)."""
    folder = loaded.resolve(loaded.plan.runtime.repository_dir)
    ours, marker = str(loaded.state_dir.resolve()), folder / OWNER_FILE
    try:
        theirs = marker.read_text().strip()
    except OSError:
        theirs = ""
    if theirs and theirs != ours and load_state(Path(theirs)).instances:
        raise TritonctlError(
            f"{folder} holds the model repositories of the deployment with state in {theirs}, which is running: "
            "give this cluster its own runtime.repository_dir in its cluster file",
            file=loaded.path,
            field="runtime.repository_dir",
        )
    if write and theirs != ours:
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(ours + "\n")


@dataclass(frozen=True)
class RepositorySnapshot:
    """The instance folders of a repository root as they were before an apply rewrote them, kept as hard links (the
    renderer replaces files, never writes into them), so that a rolled-back apply leaves the repositories of the
    instances still running as they loaded them. Restoring puts the files back into the same folders, which
    Compose's bind mounts and Kubernetes' subPath mounts follow."""

    root: Path
    names: tuple[str, ...]

    @property
    def folder(self) -> Path:
        return self.root / SNAPSHOT_DIR

    @classmethod
    def take(cls, root: Path, names: Iterable[str]) -> RepositorySnapshot:
        """Snapshot the folders `names` under `root` (a snapshot an interrupted apply left is dropped first: the
        apply after it renders and compares afresh)."""
        snapshot = cls(root, tuple(names))
        shutil.rmtree(snapshot.folder, ignore_errors=True)
        snapshot.folder.mkdir(parents=True)
        for name in snapshot.names:
            if (root / name).is_dir():
                shutil.copytree(root / name, snapshot.folder / name, symlinks=True, copy_function=_link_or_copy)
        return snapshot

    def restore(self, keep: Collection[str] = ()) -> None:
        """Put the snapshot's files back where the apply replaced them, and remove what it added (a folder it
        created, whole), but for the instances in `keep` (reloaded with what the apply wrote); then forget it."""
        for name in self.names:
            live, kept = self.root / name, self.folder / name
            if name in keep or not live.exists():
                continue
            if not kept.is_dir():
                shutil.rmtree(live)
                continue
            for path in sorted(live.rglob("*"), reverse=True):  # what the apply added, deepest first
                if (kept / path.relative_to(live)).exists():
                    continue
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()
                else:
                    path.unlink()
            for path in sorted(kept.rglob("*")):  # folders before what they hold
                target = live / path.relative_to(kept)
                if path.is_dir() and not path.is_symlink():
                    target.mkdir(exist_ok=True)
                else:
                    os.replace(path, target)
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _link_or_copy(source: str, dest: str) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)

"""Read the files users hand tritonctl (YAML, JSON), or fail naming the file and what is wrong."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from tritonctl.errors import TritonctlError

M = TypeVar("M", bound=BaseModel)


def field_path(loc: tuple) -> str:
    """('models', 1, 'slo_ms') -> 'models[1].slo_ms'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def load_validated(path: Path, schema: type[M]) -> M:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise TritonctlError(f"cannot read: {exc.strerror}", file=path) from None
    except yaml.YAMLError as exc:
        raise TritonctlError(f"not valid YAML: {exc}", file=path) from None
    if not isinstance(raw, dict):
        raise TritonctlError("must be a YAML mapping", file=path)
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] != "missing" and err["loc"]:
            msg = f"{msg} (got {err['input']!r})"
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more problem(s))"
        raise TritonctlError(msg, file=path, field=field_path(err["loc"]) or None) from None


def read_json(path: Path):
    """The parsed content of a JSON file."""
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise TritonctlError(f"cannot read: {exc.strerror}", file=path) from None
    except ValueError as exc:
        raise TritonctlError(f"not valid JSON: {exc}", file=path) from None


def write_json_atomic(path: Path, data) -> None:
    """Write `data` as JSON through a temporary file, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's content, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

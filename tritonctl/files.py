"""Read the files users hand tritonctl (YAML, JSON), or fail naming the file and what is wrong.

Every input is bounded before it is parsed: its size, its encoding (UTF-8 text), and for YAML
its nesting and the number of nodes it stands for once aliases are expanded, so a small file
cannot stand for a huge document. Errors quote at most a short excerpt of the input.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from tritonctl.errors import TritonctlError

M = TypeVar("M", bound=BaseModel)

MAX_INPUT_BYTES = 1 << 20  # a cluster or plan file is a few KiB
MAX_DEPTH = 64  # nesting of mappings and sequences
MAX_NODES = 100_000  # nodes of the document, every alias expanded
EXCERPT_CHARS = 80
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# Folders tritonctl never writes into: `/` and these, and for the first group anything below them.
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/proc", "/sys", "/dev", "/boot")
SYSTEM_DIRS = ("/", "/root", "/var")


LATENCY_MODEL_FORMAT = "tritonctl-latency-model"  # the `format` of a latency model file


def excerpt(value, limit: int = EXCERPT_CHARS) -> str:
    """`repr(value)` cut to `limit` characters, for quoting user input in a message."""
    text = repr(value[: limit + 1] if isinstance(value, (str, bytes)) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_path(loc: tuple) -> str:
    """('models', 1, 'slo_ms') -> 'models[1].slo_ms'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def read_text(path: Path, limit: int = MAX_INPUT_BYTES) -> str:
    """The content of a user's text file: UTF-8 (a BOM allowed), at most `limit` bytes."""
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise TritonctlError(f"cannot read: {exc.strerror or exc}", file=path) from None
    if len(data) > limit:
        raise TritonctlError(f"larger than {limit // 1024} KiB: not a file tritonctl reads", file=path)
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise TritonctlError("UTF-16 text: save it as UTF-8", file=path)
    if b"\x00" in data:
        raise TritonctlError("binary content (NUL bytes): expected UTF-8 text", file=path)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TritonctlError(f"not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x})", file=path) from None


def _yaml_problem(exc: yaml.YAMLError, text: str) -> str:
    """The parser's complaint, where it is, and an excerpt of that line."""
    mark = getattr(exc, "problem_mark", None)
    problem = " ".join((getattr(exc, "problem", None) or str(exc)).split())[:200]
    if mark is None:
        return problem
    lines = text.splitlines()
    line = excerpt(lines[mark.line].strip()) if mark.line < len(lines) else "end of file"
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1}: {line})"


def check_yaml_shape(text: str) -> str | None:
    """Why this YAML is too deep, too large once its aliases are expanded, or repeats a key; None if it is not.

    Reads the event stream (no document is built), so a small file that stands for a huge document
    costs no more than its own size.
    """
    sizes: dict[str, int] = {}  # anchor -> nodes of the anchored node, expanded
    stack: list[list] = []  # per open collection: [anchor, nodes, keys seen (mappings) or None, next is a key]
    total = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(stack) >= MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            mapping = isinstance(event, yaml.MappingStartEvent)
            stack.append([event.anchor, 0, set() if mapping else None, True])
            continue
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, nodes, _, _ = stack.pop()
            size = nodes + 1
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
            if stack and stack[-1][2] is not None and stack[-1][3]:
                if event.value in stack[-1][2]:
                    return f"key {excerpt(event.value)} appears twice in one mapping (line {event.start_mark.line + 1})"
                stack[-1][2].add(event.value)
        elif isinstance(event, yaml.AliasEvent):
            anchor, size = None, sizes.get(event.anchor, 1)
        else:
            continue
        total += size if not isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)) else 1
        if total > MAX_NODES:
            return f"stands for more than {MAX_NODES} values once its aliases are expanded"
        if anchor is not None:
            sizes[anchor] = size
        if stack:
            stack[-1][1] += size
            stack[-1][3] = not stack[-1][3]
    return None


def load_yaml(path: Path):
    """The parsed content of a YAML file, its size, nesting and aliases bounded first."""
    text = read_text(path)
    try:
        problem = check_yaml_shape(text)
        if problem is None:
            return yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        problem = f"not valid YAML: {_yaml_problem(exc, text)}"
        if "maximum nesting depth" in problem:  # libyaml's own limit, met while it reads ahead of our count
            problem = f"nested deeper than {MAX_DEPTH} levels"
    raise TritonctlError(problem, file=path)


def yaml_kind(path: Path) -> str | None:
    """Which of tritonctl's YAML files `path` holds ("plan", "cluster file"), None where it is neither or unreadable."""
    try:
        raw = load_yaml(path)
    except TritonctlError:
        return None
    if isinstance(raw, dict) and "cluster" in raw and "models" in raw:
        return "plan"
    return "cluster file" if isinstance(raw, dict) and "name" in raw and "models" in raw else None


def load_validated(path: Path, schema: type[M], mistaken: Callable[[dict], str | None] = lambda _: None) -> M:
    """A YAML file validated against `schema`; the first problem is raised naming the file and the field, or what
    `mistaken` says the file is where it is another kind of file. Validated strictly, as written: `batch: true` or
    `port: "8001"` is refused, not read as 1 or 8001."""
    raw = load_yaml(path)
    if raw is None:
        raise TritonctlError("holds nothing (empty, or comments only)", file=path)
    if not isinstance(raw, dict):
        raise TritonctlError(f"must be a YAML mapping, not {type(raw).__name__}", file=path)
    if raw.get("format") == LATENCY_MODEL_FORMAT:  # JSON is YAML: a latency model given in the wrong place
        raise TritonctlError("a latency model, not a cluster file or plan: give it as --latency-model", file=path)
    try:
        return schema.model_validate(raw, strict=True)
    except ValidationError as exc:
        if (other := mistaken(raw)) is not None:
            raise TritonctlError(other, file=path) from None
        errors = exc.errors()
        # a misspelt key also makes its field look missing: the unknown key is the cause, say it first
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        msg = " ".join(err["msg"].removeprefix("Value error, ").split())
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
            known = _fields_at(schema.model_json_schema(), err["loc"][:-1])
            close = difflib.get_close_matches(str(err["loc"][-1]), sorted(known), n=1, cutoff=0.6)
            if close:
                msg += f" (did you mean {close[0]}?)"
        elif err["type"] != "missing" and err["loc"] and not isinstance(err["input"], dict):
            msg = f"{msg} (got {excerpt(err['input'])})"
            numeric = err["type"] in ("float_type", "int_type")
            if numeric and _number_text(err["input"], whole=err["type"] == "int_type"):
                msg += ": YAML read it as text; write the number unquoted (an exponent needs a dot and a sign: 3.0e+1)"
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more problem(s))"
        raise TritonctlError(msg, file=path, field=_field_text(err["loc"])) from None


def _fields_at(schema: dict, loc: tuple) -> set[str]:
    """The field names a JSON Schema allows at `loc` (keys and list indices), none where it cannot tell."""
    defs = schema.get("$defs", {})

    def options(node: dict) -> list[dict]:  # a node with its references and unions opened
        if "$ref" in node:
            return options(defs.get(node["$ref"].rsplit("/", 1)[-1], {}))
        alternatives = node.get("anyOf", []) + node.get("allOf", [])
        return [o for alt in alternatives for o in options(alt)] if alternatives else [node]

    nodes = options(schema)
    for step in loc:
        if isinstance(step, int):
            nodes = [o for n in nodes if "items" in n for o in options(n["items"])]
        else:
            nodes = [o for n in nodes if step in n.get("properties", {}) for o in options(n["properties"][step])]
    return {name for n in nodes for name in n.get("properties", {})}


def _number_text(value, whole: bool) -> bool:
    """Whether `value` is text that reads as a number (`whole`: a whole one)."""
    if not isinstance(value, str):
        return False
    try:
        number = float(value)
    except ValueError:
        return False
    return number.is_integer() if whole else True


def _field_text(loc: tuple) -> str | None:
    """The field path of an error, quoted when user-chosen keys make it long or unprintable."""
    text = field_path(loc)
    return text if len(text) <= EXCERPT_CHARS and text.isprintable() else excerpt(text) if text else None


def check_output_dir(path: Path, *, file: str | Path | None, field: str | None, writable: bool = False) -> Path:
    """`path` resolved, refused when it is `/` or a system folder, or it (or a parent) is not a folder;
    with `writable`, also when tritonctl could not create or write into it."""
    resolved = path.resolve()
    text = str(resolved)
    if text in SYSTEM_DIRS or any(text == tree or text.startswith(tree + "/") for tree in SYSTEM_TREES):
        raise TritonctlError(
            f"{resolved} is a system folder: choose a folder of the deployment's own", file=file, field=field
        )
    for folder in (resolved, *resolved.parents):
        if not folder.exists():
            continue
        if not folder.is_dir():
            raise TritonctlError(f"{folder} is not a folder", file=file, field=field)
        if writable and not os.access(folder, os.W_OK | os.X_OK):
            raise TritonctlError(f"{folder} is not writable", file=file, field=field)
        break
    return resolved


def not_an_input(out: Path, inputs: list[tuple[str, Path]], field: str = "-o/--output") -> None:
    """Refuse to write `out` over one of the command's inputs, each given with what it is ("the cluster file")."""
    for what, path in inputs:
        if out.exists() and path.exists() and os.path.samefile(out, path):
            raise TritonctlError(f"{out} is {what}, which this command reads: write elsewhere", field=field)


def read_json(path: Path):
    """The parsed content of a JSON file."""
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise TritonctlError(f"cannot read: {exc.strerror}", file=path) from None
    except ValueError as exc:
        raise TritonctlError(f"not valid JSON: {exc}", file=path) from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` through a temporary file, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def write_json_atomic(path: Path, data) -> None:
    """Write `data` as JSON through a temporary file (`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's content, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_identity(path: Path) -> tuple[int, int, int, int]:
    """What changes when a file is replaced or rewritten: its device, inode, size and modification time (the key
    that cached readings of a file go by)."""
    stat = path.stat()
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def sha256_unchanged(path: Path) -> str:
    """`sha256_file`, read again only when the file's identity changed (model files of tens of MB are checked at
    every plan, apply and re-plan)."""
    return _sha256(path, *file_identity(path))


@functools.lru_cache(maxsize=256)
def _sha256(path: Path, *identity: int) -> str:
    return sha256_file(path)

"""A corpus of malformed cluster and plan files, made by mutating a few valid ones.

Each case is refused the same way: exit code 2, exactly one line on stderr (`error: <file>: ...`),
no traceback, nothing written anywhere under the test's folder (a sibling folder `outside`
included), within a few seconds. A few cases run as real processes under a memory limit.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import make_mlp, mlp_model, write_cluster
from tritonctl.cli import main
from tritonctl.deploy import share
from tritonctl.deploy.apply import apply_plan
from tritonctl.deploy.local import LocalRuntime
from tritonctl.errors import TritonctlError
from tritonctl.planning.plan import load_plan
from tritonctl.triton.render import render_config

# A file change: given the case folder and the file's path, rewrite the file (and prepare the folder).
Mutation = Callable[[Path, Path], None]


@dataclass(frozen=True)
class Case:
    name: str
    target: str  # "cluster" or "plan": which base file is mutated
    mutate: Mutation
    words: str = ""  # expected in the error line


def data(change: Callable[[dict], object]) -> Mutation:
    """Change the parsed file and write it back as YAML."""

    def mutate(folder: Path, path: Path) -> None:
        content = yaml.safe_load(path.read_text())
        change(content)
        path.write_text(yaml.safe_dump(content, sort_keys=False))

    return mutate


def text(change: Callable[[str], str | bytes]) -> Mutation:
    """Replace the file's content by change(its text), written as UTF-8 when a str."""

    def mutate(folder: Path, path: Path) -> None:
        out = change(path.read_text())
        path.write_bytes(out if isinstance(out, bytes) else out.encode())

    return mutate


def setup(prepare: Callable[[Path], object], change: Callable[[dict], object]) -> Mutation:
    """Prepare the case folder (files, links), then change the file."""
    rewrite = data(change)

    def mutate(folder: Path, path: Path) -> None:
        prepare(folder)
        rewrite(folder, path)

    return mutate


def put(key: str, value) -> Callable[[dict], None]:
    """Set a dotted path (`models.0.slo_ms`) to `value`."""
    *parents, last = key.split(".")

    def change(content: dict) -> None:
        node = content
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return change


def drop(key: str) -> Callable[[dict], None]:
    *parents, last = key.split(".")

    def change(content: dict) -> None:
        node = content
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]

    return change


def alias_bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\nname: *a{levels}\n"


def doubling_anchors(levels: int) -> bytes:
    """Each key twice the one before: 2**levels values from a few hundred bytes."""
    return b"k0: &a1 [x]\n" + b"".join(b"k%d: &a%d [*a%d, *a%d]\n" % (i, i + 1, i, i) for i in range(1, levels))


def deep_block(text: str, levels: int = 200) -> str:
    """`text` with a mapping nested `levels` deep in block style."""
    return text + "".join(f"{'  ' * i}k{i}:\n" for i in range(levels)) + "  " * levels + "x\n"


def odd_onnx(folder: Path) -> None:
    """mlp.onnx with an input named so that it would end a quoted string and a line in config.pbtxt."""
    import onnx

    model = onnx.load(str(folder / "mlp.onnx"))
    old = model.graph.input[0].name
    model.graph.input[0].name = 'x"\n}'
    for node in model.graph.node:
        node.input[:] = [model.graph.input[0].name if name == old else name for name in node.input]
    onnx.save(model, str(folder / "odd.onnx"))


ENCODING = [
    Case("binary", "cluster", text(lambda t: b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))), "NUL"),
    Case("utf16-bom", "cluster", text(lambda t: t.encode("utf-16")), "UTF-16"),
    Case("utf16-le-no-bom", "cluster", text(lambda t: t.encode("utf-16-le")), "NUL"),
    Case("invalid-utf8", "cluster", text(lambda t: t.encode() + b"# caf\xe9\n"), "not UTF-8"),
    Case("nul-in-value", "cluster", text(lambda t: t.replace("name: test", "name: te\x00st").encode()), "NUL"),
    Case("bell-character", "cluster", text(lambda t: t.replace("name: test", "name: te\x07st")), "not valid YAML"),
    Case("empty", "cluster", text(lambda t: ""), "holds nothing"),
    Case("only-comments", "cluster", text(lambda t: "# nothing here\n"), "holds nothing"),
    Case("top-level-list", "cluster", text(lambda t: "- a\n- b\n"), "mapping"),
    Case("top-level-scalar", "cluster", text(lambda t: "just words\n"), "mapping"),
    Case("truncated", "cluster", text(lambda t: t[: len(t) // 3])),
    Case("tabs", "cluster", text(lambda t: t.replace("  ", "\t")), "not valid YAML"),
    Case("unclosed-flow", "cluster", text(lambda t: t + "extra: [unclosed\n"), "not valid YAML"),
    Case("duplicate-key", "cluster", text(lambda t: t + "name: again\n"), "appears twice"),
    Case("python-tag", "cluster", text(lambda t: t.replace("name: test", "name: !!python/object:os.system x"))),
    Case("deep-flow-nesting", "cluster", text(lambda t: t + "extra: " + "[" * 10_000 + "]" * 10_000 + "\n"), "deeper"),
    Case("deep-block-nesting", "cluster", text(deep_block), "deeper"),
    Case("alias-bomb", "cluster", text(lambda t: alias_bomb()), "aliases"),
    Case("alias-bomb-mappings", "cluster", text(lambda t: t.replace("name: test\n", "") + alias_bomb(6)), "aliases"),
    Case("recursive-alias", "cluster", text(lambda t: t + "extra: &r [*r]\n")),
    Case("over-1-MiB", "cluster", text(lambda t: t + "#" + "x" * (1 << 20) + "\n"), "larger than"),
    Case("long-name", "cluster", text(lambda t: t.replace("name: test", "name: " + "n" * 500_000)), "Triton"),
    Case("unprintable-key", "cluster", text(lambda t: t + '"a\\nb": 1\n'), "unknown field"),
    Case("huge-integer", "cluster", data(put("models.0.rate", 10**400))),
    Case("binary", "plan", text(lambda t: bytes(range(256)) * 4), "NUL"),
    Case("utf16-bom", "plan", text(lambda t: t.encode("utf-16")), "UTF-16"),
    Case("invalid-utf8", "plan", text(lambda t: b"\xc3\x28" + t.encode()), "not UTF-8"),
    Case("empty", "plan", text(lambda t: ""), "holds nothing"),
    Case("alias-bomb", "plan", text(lambda t: alias_bomb()), "aliases"),
    Case(
        "deep-flow-nesting", "plan", text(lambda t: t + "extra: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n"), "deeper"
    ),
    Case("over-1-MiB", "plan", text(lambda t: t + ("# padding\n" * 110_000)), "larger than"),
    Case("duplicate-key", "plan", text(lambda t: t + "policy: again\n"), "appears twice"),
]

CLUSTER_FIELDS = [
    Case("name-slash", "cluster", data(put("name", "bad/name")), "name"),
    Case("name-trailing-newline", "cluster", data(put("name", "test\n")), "Triton"),
    Case("name-empty", "cluster", data(put("name", ""))),
    Case("name-too-long", "cluster", data(put("name", "n" * 65))),
    Case("name-int", "cluster", data(put("name", 42))),
    Case("name-null", "cluster", data(put("name", None))),
    Case("name-missing", "cluster", data(drop("name")), "name"),
    Case("unknown-top-field", "cluster", data(put("extra", 1)), "unknown field"),
    Case("devices-empty", "cluster", data(put("devices", []))),
    Case("devices-string", "cluster", data(put("devices", "cpu"))),
    Case("device-kind", "cluster", data(put("devices.0.kind", "tpu"))),
    Case("device-cores-inf", "cluster", data(put("devices.0.cores", math.inf)), "finite"),
    Case("device-cores-nan", "cluster", data(put("devices.0.cores", math.nan)), "finite"),
    Case("device-cores-negative", "cluster", data(put("devices.0.cores", -2))),
    Case("device-cores-string", "cluster", data(put("devices.0.cores", "two"))),
    Case("device-units-zero", "cluster", data(put("devices.0.units", 0))),
    Case("device-units-huge", "cluster", data(put("devices.0.units", 10**6))),
    Case("device-count-zero", "cluster", data(put("devices.0.count", 0))),
    Case("device-memory-zero", "cluster", data(put("devices.0.memory_mb", 0))),
    Case("device-reserves-all", "cluster", data(put("devices.0.reserved_cores", 2))),
    Case("devices-mixed", "cluster", data(lambda d: d["devices"].append({"kind": "gpu", "memory_mb": 100})), "mixing"),
    Case("models-empty", "cluster", data(put("models", []))),
    Case("models-mapping", "cluster", data(put("models", {"alpha": 1}))),
    Case("model-duplicate", "cluster", data(put("models.1.name", "alpha")), "duplicate"),
    Case("model-duplicate-case", "cluster", data(put("models.1.name", "ALPHA")), "duplicate"),
    Case("model-name-newline", "cluster", data(put("models.0.name", "alpha\n")), "Triton"),
    Case("model-name-dotdot", "cluster", data(put("models.0.name", "../alpha"))),
    Case("model-name-missing", "cluster", data(drop("models.0.name"))),
    Case("slo-inf", "cluster", data(put("models.0.slo_ms", math.inf)), "finite"),
    Case("slo-nan", "cluster", data(put("models.0.slo_ms", math.nan)), "finite"),
    Case("slo-negative", "cluster", data(put("models.0.slo_ms", -5))),
    Case("slo-zero", "cluster", data(put("models.0.slo_ms", 0))),
    Case("slo-huge", "cluster", data(put("models.0.slo_ms", 1e12))),
    Case("slo-bool", "cluster", data(put("models.0.slo_ms", True))),
    Case("slo-string", "cluster", data(put("models.0.slo_ms", "fast"))),
    Case("rate-inf", "cluster", data(put("models.0.rate", math.inf)), "finite"),
    Case("rate-nan", "cluster", data(put("models.1.rate", math.nan)), "finite"),
    Case("rate-negative", "cluster", data(put("models.0.rate", -1))),
    Case("rate-huge", "cluster", data(put("models.0.rate", 1e12))),
    Case("memory-zero", "cluster", data(put("models.0.memory_mb", 0))),
    Case("memory-huge", "cluster", data(put("models.0.memory_mb", 2**40))),
    Case("memory-float", "cluster", data(put("models.0.memory_mb", 1.5))),
    Case("shape-empty", "cluster", data(put("models.0.input.shape", []))),
    Case("shape-zero", "cluster", data(put("models.0.input.shape", [0]))),
    Case("shape-negative", "cluster", data(put("models.0.input.shape", [-1]))),
    Case("shape-huge", "cluster", data(put("models.0.input.shape", [100_000, 100_000])), "elements"),
    Case("shape-rank-9", "cluster", data(put("models.0.input.shape", [1] * 9))),
    Case("shape-string", "cluster", data(put("models.0.input.shape", "16"))),
    Case("dtype", "cluster", data(put("models.0.input.dtype", "complex64"))),
    Case("source-empty", "cluster", data(put("models.0.source", ""))),
    Case("source-missing-file", "cluster", data(put("models.0.source", "missing.onnx")), "not found"),
    Case("source-outside-missing", "cluster", data(put("models.0.source", "../outside/missing.onnx")), "not found"),
    Case("source-system-file", "cluster", data(put("models.0.source", "/etc/passwd")), "architecture"),
    Case("source-traversal", "cluster", data(put("models.0.source", "../../escape")), "architecture"),
    Case("source-newline", "cluster", data(put("models.0.source", "resnet50\n")), "control"),
    Case("source-nul", "cluster", data(put("models.0.source", "a\x00b.onnx")), "control"),
    Case("source-folder", "cluster", setup(lambda f: (f / "d.onnx").mkdir(), put("models.0.source", "d.onnx"))),
    Case(
        "source-not-onnx",
        "cluster",
        setup(lambda f: (f / "g.onnx").write_bytes(b"\x08\x07garbage" * 40), put("models.0.source", "g.onnx")),
        "not a readable ONNX model",
    ),
    Case("source-odd-tensor-name", "cluster", setup(odd_onnx, put("models.0.source", "odd.onnx")), "tensor name"),
    Case("export-boot", "cluster", data(put("runtime.export_dir", "/boot/x")), "system folder"),
    Case(
        "repository-symlink-to-etc",
        "cluster",
        setup(lambda f: (f / "link").symlink_to("/etc"), put("runtime.repository_dir", "link")),
        "system folder",
    ),
    Case(
        "state-under-file",
        "cluster",
        setup(lambda f: (f / "afile").write_text("x"), put("runtime.state_dir", "afile/state")),
        "not a folder",
    ),
    Case("repository-nul", "cluster", data(put("runtime.repository_dir", "re\x00po")), "control"),
    Case("repository-empty", "cluster", data(put("runtime.repository_dir", ""))),
    Case("base-port-80", "cluster", data(put("runtime.base_port", 80)), "1024"),
    Case("base-port-70000", "cluster", data(put("runtime.base_port", 70_000))),
    Case("base-port-string", "cluster", data(put("runtime.base_port", "8100"))),
    Case("base-port-float", "cluster", data(put("runtime.base_port", 8100.5))),
    Case("host-space", "cluster", data(put("runtime.host", "bad host")), "host"),
    Case("host-newline", "cluster", data(put("runtime.host", "localhost\nx")), "host"),
    Case("timeout-inf", "cluster", data(put("runtime.startup_timeout_s", math.inf)), "finite"),
    Case("timeout-nan", "cluster", data(put("runtime.startup_timeout_s", math.nan)), "finite"),
    Case("timeout-zero", "cluster", data(put("runtime.startup_timeout_s", 0))),
    Case("tritonserver-empty", "cluster", data(put("runtime.tritonserver", ""))),
    Case("reject-late-string", "cluster", data(put("runtime.reject_late", "yes"))),
    Case("runtime-string", "cluster", data(put("runtime", "local"))),
    Case("runtime-unknown-field", "cluster", data(put("runtime.ports", [1, 2])), "unknown field"),
]


def other_onnx(folder: Path) -> None:
    (folder.parent / "outside" / "other.onnx").write_bytes((folder / "mlp.onnx").read_bytes() + b"\x00")


def second_model(change: Callable[[dict], None]) -> Callable[[dict], None]:
    """Add a copy of the first model (its own name, port and instance), then apply `change`."""

    def add(content: dict) -> None:
        model = yaml.safe_load(yaml.safe_dump(content["models"][0]))
        model["name"] = "gamma"
        model["port"] = content["models"][0]["port"] + 50
        model["placements"][0].update(instance="gamma-0", share=10)
        content["models"].append(model)
        change(content)

    return add


BAD_PREDICTION = {"exec_ms": math.nan, "throughput_rps": 10.0, "meets_slo": True}
PLAN_FIELDS = [
    Case("version-2", "plan", data(put("version", 2))),
    Case("cluster-newline", "plan", data(put("cluster", "test\n# injected")), "Triton"),
    Case("cluster-empty", "plan", data(put("cluster", ""))),
    Case("cluster-file-nul", "plan", data(put("cluster_file", "a\x00b")), "control"),
    Case("policy-space", "plan", data(put("policy", "a b"))),
    Case("target", "plan", data(put("target", "tpu"))),
    Case("sharing", "plan", data(put("sharing", "both"))),
    Case("unknown-field", "plan", data(put("extra", 1)), "unknown field"),
    Case("runtime-missing", "plan", data(drop("runtime"))),
    Case("devices-empty", "plan", data(put("devices", []))),
    Case("device-duplicate", "plan", data(lambda d: d["devices"].append(dict(d["devices"][0]))), "same id"),
    Case("device-id-newline", "plan", data(put("devices.0.id", "cpu0\n"))),
    Case("device-units-zero", "plan", data(put("devices.0.units", 0))),
    Case("device-cores-inf", "plan", data(put("devices.0.cores", math.inf)), "finite"),
    Case("device-cores-nan", "plan", data(put("devices.0.cores", math.nan)), "finite"),
    Case("device-cores-missing", "plan", data(drop("devices.0.cores")), "cores"),
    Case("device-index-negative", "plan", data(put("devices.0.index", -1))),
    Case("models-empty", "plan", data(put("models", []))),
    Case("model-duplicate", "plan", data(second_model(put("models.2.name", "alpha"))), "twice"),
    Case("model-duplicate-case", "plan", data(second_model(put("models.2.name", "Alpha"))), "twice"),
    Case("model-name-newline", "plan", data(put("models.0.name", "alpha\n")), "Triton"),
    Case("onnx-other-file", "plan", setup(other_onnx, put("models.0.onnx", "../outside/other.onnx")), "SHA-256"),
    Case("onnx-etc-passwd", "plan", data(put("models.0.onnx", "/etc/passwd")), "SHA-256"),
    Case("onnx-missing", "plan", data(put("models.0.onnx", "missing.onnx")), "not found"),
    Case("onnx-folder", "plan", setup(lambda f: (f / "d.onnx").mkdir(), put("models.0.onnx", "d.onnx")), "not found"),
    Case("onnx-sha-short", "plan", data(put("models.0.onnx_sha256", "abc"))),
    Case("onnx-sha-other", "plan", data(put("models.1.onnx_sha256", "0" * 64)), "SHA-256"),
    Case("onnx-sha-newline", "plan", data(lambda d: d["models"][0].update(onnx_sha256="0" * 63 + "\n"))),
    Case("inputs-empty", "plan", data(put("models.0.inputs", []))),
    Case("tensor-name-newline", "plan", data(put("models.0.inputs.0.name", 'x"\n}\ninstance_group [')), "control"),
    Case("tensor-name-empty", "plan", data(put("models.0.outputs.0.name", ""))),
    Case("tensor-dtype", "plan", data(put("models.0.inputs.0.dtype", "complex64"))),
    Case("tensor-shape-zero", "plan", data(put("models.0.inputs.0.shape", [0]))),
    Case("tensor-shape-huge", "plan", data(put("models.0.inputs.0.shape", [10**9]))),
    Case("memory-zero", "plan", data(put("models.0.memory_mb", 0))),
    Case("slo-inf", "plan", data(put("models.0.slo_ms", math.inf)), "finite"),
    Case("slo-nan", "plan", data(put("models.0.slo_ms", math.nan)), "finite"),
    Case("slo-negative", "plan", data(put("models.0.slo_ms", -1))),
    Case("rate-inf", "plan", data(put("models.0.rate", math.inf)), "finite"),
    Case("rate-huge", "plan", data(put("models.0.rate", 1e12))),
    Case("port-80", "plan", data(put("models.0.port", 80)), "1024"),
    Case("port-0", "plan", data(put("models.0.port", 0))),
    Case("port-70000", "plan", data(put("models.0.port", 70_000))),
    Case("port-duplicate", "plan", data(lambda d: d["models"][1].update(port=d["models"][0]["port"])), "port"),
    Case("placements-empty", "plan", data(put("models.0.placements", []))),
    Case("batch-1e9", "plan", data(put("models.0.placements.0.batch", 1e9)), "valid integer"),
    Case("batch-zero", "plan", data(put("models.0.placements.0.batch", 0))),
    Case("batch-33", "plan", data(put("models.0.placements.0.batch", 33)), "32"),
    Case("batch-fraction", "plan", data(put("models.0.placements.0.batch", 1.5))),
    Case("share-zero", "plan", data(put("models.0.placements.0.share", 0))),
    Case("share-over-units", "plan", data(put("models.0.placements.0.share", 90)), "shares add up"),
    Case("share-huge", "plan", data(put("models.0.placements.0.share", 5000))),
    Case("version-true", "plan", data(put("version", True)), "valid integer"),
    Case("memory-beyond-device", "plan", data(put("models.0.memory_mb", 1_000_000)), "MB of memory, it has"),
    Case("placement-device-unknown", "plan", data(put("models.0.placements.0.device", "cpu7")), "unknown device"),
    Case("instance-traversal", "plan", data(put("models.0.placements.0.instance", "../../escape")), "Triton"),
    Case("instance-newline", "plan", data(put("models.0.placements.0.instance", "alpha-0\n")), "Triton"),
    Case("instance-duplicate", "plan", data(lambda d: d["models"][1]["placements"][0].update(instance="alpha-0"))),
    Case("queue-delay-negative", "plan", data(put("models.0.placements.0.queue_delay_us", -1))),
    Case("weight-zero", "plan", data(put("models.0.placements.0.weight", 0))),
    Case("weight-inf", "plan", data(put("models.0.placements.0.weight", math.inf)), "finite"),
    Case("prediction-nan", "plan", data(put("models.0.placements.0.predicted", BAD_PREDICTION)), "finite"),
    Case("unserved-newline", "plan", data(put("unserved", [{"name": "x", "reason": "a\nb"}])), "control"),
    Case("turns-unknown-device", "plan", data(put("turns", ["cpu9"])), "unknown device"),
    Case("host-space", "plan", data(put("runtime.host", "a b")), "host"),
    Case("timeout-nan", "plan", data(put("runtime.startup_timeout_s", math.nan)), "finite"),
    Case("tritonserver-newline", "plan", data(put("runtime.tritonserver", "/bin/sh\n-c")), "control"),
]

SYSTEM_FOLDERS = [  # (case, runtime field, folder)
    ("repository-root", "repository_dir", "/"),
    ("repository-etc", "repository_dir", "/etc"),
    ("repository-under-usr", "repository_dir", "/usr/share/x"),
    ("repository-proc", "repository_dir", "/proc/self"),
    ("state-var", "state_dir", "/var"),
    ("state-root-home", "state_dir", "/root"),
    ("state-sys", "state_dir", "/sys"),
]


def folder_cases(target: str) -> list[Case]:
    """The same refused folders in a cluster file and in a plan: system folders, and a file where a folder goes."""
    cases = [
        Case(name, target, data(put(f"runtime.{key}", value)), "system folder") for name, key, value in SYSTEM_FOLDERS
    ]
    make_file = setup(lambda f: (f / "afile").write_text("x"), put("runtime.repository_dir", "afile"))
    return [*cases, Case("repository-is-file", target, make_file, "not a folder")]


CASES = ENCODING + CLUSTER_FIELDS + PLAN_FIELDS + folder_cases("cluster") + folder_cases("plan")
VERBS = {"cluster": ["plan", "export"], "plan": ["render"]}


def test_the_corpus_is_large_and_its_names_unique():
    assert len(CASES) >= 100
    assert len({(c.target, c.name) for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A folder with mlp.onnx, a valid cluster.yaml (two models) and the plan.yaml made from it."""
    folder = tmp_path_factory.mktemp("base")
    make_mlp(folder / "mlp.onnx")
    write_cluster(folder, [mlp_model("alpha"), mlp_model("beta")])
    assert main(["plan", str(folder / "cluster.yaml")]) == 0
    return folder


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for path in sorted(folder.rglob("*")):
        stat = path.lstat()
        out[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{c.target}-{c.name}" for c in CASES])
def test_malformed_file_is_refused_cleanly(capsys, monkeypatch, tmp_path, base, case):
    folder = tmp_path / "case"
    shutil.copytree(base, folder)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep.txt").write_text("untouched\n")
    path = folder / f"{case.target}.yaml"
    case.mutate(folder, path)
    before = snapshot(tmp_path)
    monkeypatch.chdir(folder)
    capsys.readouterr()
    for verb in VERBS[case.target]:
        started = time.monotonic()
        rc = main([verb, str(path)])
        took = time.monotonic() - started
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert rc == 2, f"{verb}: exit {rc}, stderr {err!r}"
        # the file named as the working directory (the case's folder) reaches it
        assert len(lines) == 1 and lines[0].startswith(f"error: {path.name}"), f"{verb}: {err[:500]!r}"
        assert "Traceback" not in err and len(lines[0]) < 600
        assert case.words in lines[0], f"{verb}: {lines[0]!r}"
        assert took < 5, f"{verb} took {took:.1f} s"
        assert snapshot(tmp_path) == before, f"{verb} wrote files"


def test_config_strings_are_escaped(base):
    """A tensor name that would end a string and a block stays one name once parsed back (the spec refuses
    such names first: this is the layer beneath)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    loaded = load_plan(base / "plan.yaml")
    model = loaded.plan.models[0]
    odd = 'x"\n} parameters { key: "k" value { string_value: "v" } } input { name: "é'
    model = model.model_copy(update={"inputs": [model.inputs[0].model_copy(update={"name": odd})]})
    placement = model.placements[0]
    text = render_config(loaded.plan.cluster, model, placement, loaded.plan.device(placement.device))
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert [t.name for t in config.input] == [odd] and list(config.parameters) == ["intra_op_threads"]


def limited_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (500 << 20, 500 << 20))


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("alias-bomb", alias_bomb(12).encode(), "aliases"),
        ("50-MB", b"name: test\n" + b"# " + b"x" * (50 << 20) + b"\n", "larger than"),
        ("deep-nesting", b"name: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "deeper"),
        ("doubling-anchors", doubling_anchors(40), "aliases"),
    ],
)
def test_hostile_files_in_a_process_with_500_MB(tmp_path, name, content, words):
    """As a real process whose address space is limited: no memory blow-up, one error line."""
    path = tmp_path / "cluster.yaml"
    path.write_bytes(content)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "tritonctl", "plan", str(path)],
        capture_output=True,
        text=True,
        preexec_fn=limited_memory,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cluster.yaml: ") and words in lines[0], run.stderr[-2000:]
    assert len(lines[0]) < 600
    assert time.monotonic() - started < 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml"]


RECORD = {
    "uid": "alpha-0.1",
    "instance": "alpha-0",
    "model": "alpha",
    "device": "cpu0",
    "share": 50,
    "units": 100,
    "config_hash": "x",
    "host": "127.0.0.1",
    "grpc_port": 9000,
    "http_port": 9001,
    "metrics_port": 9002,
    "pid": 999_999_999,
    "start_ticks": 1,
    "folder": "f",
    "log": "l",
    "share_mechanism": "none",
}


@pytest.mark.parametrize(
    ("name", "state", "words"),
    [
        (
            "missing-field",
            {"cluster": "test", "instances": {"u": {k: v for k, v in RECORD.items() if k != "pid"}}},
            "'pid'",
        ),
        ("wrong-type", {"cluster": "test", "instances": {"u": {**RECORD, "pid": "abc"}}}, "pid"),
        ("bool-port", {"cluster": "test", "instances": {"u": {**RECORD, "grpc_port": True}}}, "grpc_port"),
        ("unknown-field", {"cluster": "test", "instances": {"u": {**RECORD, "extra": 1}}}, "unknown field"),
        ("record-list", {"cluster": "test", "instances": {"u": [1, 2]}}, "not a mapping"),
        ("no-instances", {"cluster": "test"}, "instances"),
        ("cluster-number", {"cluster": 5, "instances": {}}, "cluster"),
        ("top-level-list", [1, 2], "instances"),
    ],
)
def test_a_broken_state_file_is_one_clear_line(capsys, base, tmp_path, name, state, words):
    folder = tmp_path / "case"
    shutil.copytree(base, folder)
    (folder / "state").mkdir(exist_ok=True)
    (folder / "state" / "state.json").write_text(json.dumps(state))
    assert main(["status", str(folder / "plan.yaml")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {folder / 'state' / 'state.json'}: corrupt state file")
    assert words in lines[0]


def test_a_plan_for_another_cluster_writes_nothing(base, tmp_path):
    """Refused because the state folder runs another cluster: before the repositories are rendered."""
    folder = tmp_path / "case"
    shutil.copytree(base, folder)
    (folder / "state").mkdir(exist_ok=True)
    (folder / "state" / "state.json").write_text(json.dumps({"cluster": "other", "instances": {"u": RECORD}}))
    loaded = load_plan(folder / "plan.yaml")
    with pytest.raises(TritonctlError, match="holds the deployment of cluster 'other', not 'test'"):
        apply_plan(loaded, LocalRuntime(None, loaded.state_dir), log=lambda _: None)
    assert not (folder / "repo").exists()


def test_a_refused_cgroup_quota_leaves_no_cgroup(monkeypatch, tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    monkeypatch.setattr(share, "V1_ROOT", tmp_path / "no-v1")
    monkeypatch.setattr(share, "V2_ROOT", root)
    assert share.mechanism() == "cgroup-v2"
    with pytest.raises(OSError):  # a plain folder has no cpu.max nor cpu.cfs_quota_us: the quota write fails
        share.create("alpha-0.1", 50_000, 100_000)
    assert not (root / "tritonctl" / "alpha-0.1").exists()

"""The package as a user installs it: a wheel (not an editable install), used from another working directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml

from conftest import REPO, free_base_port

pytestmark = pytest.mark.triton


def test_a_wheel_runs_plan_render_apply_and_down_on_the_demo_from_elsewhere(tmp_path):
    source = tmp_path / "source"  # what the wheel is built from, copied: the build writes build/ beside it
    source.mkdir()
    for part in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / part, source / part)
    for part in ("tritonctl", "profiler", "rl", "templates"):
        shutil.copytree(REPO / part, source / part, ignore=shutil.ignore_patterns("__pycache__", "runs"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "wheel"), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "wheel").glob("tritonctl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("tritonctl/profiler/run.py", "tritonctl/rl/sac.py", "tritonctl/rl/policies/cpu-demo.pt",
                    "tritonctl/templates/python_onnx_model.py"):  # fmt: skip
        assert shipped in names
    assert not [n for n in names if n.split("/")[0] in ("profiler", "rl", "templates", "tests", "bench")]
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )

    work = tmp_path / "elsewhere"
    work.mkdir()
    demo = yaml.safe_load((REPO / "examples" / "cpu-demo" / "cluster.yaml").read_text())
    demo["runtime"] = {
        "repository_dir": "repo",
        "state_dir": "state",
        "export_dir": str(REPO / "model_repository" / "exports"),  # the checkout's exports, if made already
        "base_port": free_base_port(3),
    }
    (work / "cluster.yaml").write_text(yaml.safe_dump(demo, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(site)}

    def tritonctl(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tritonctl", *argv], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )

    where = subprocess.run(
        [sys.executable, "-c", "import tritonctl.profiler.run, tritonctl; print(tritonctl.__file__)"],
        cwd=work, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert where.stdout.strip() == str(site / "tritonctl" / "__init__.py")
    for argv in (["plan", "cluster.yaml", "-o", "plan.yaml"], ["render", "plan.yaml"], ["apply", "plan.yaml"]):
        run = tritonctl(*argv)
        assert run.returncode == 0, f"{argv}: {run.stdout[-2000:]}{run.stderr[-2000:]}"
    try:
        status = tritonctl("status", "plan.yaml", "--format", "json")
        assert status.returncode == 0 and '"health": "ready"' in status.stdout
        assert (work / "repo" / "mobilenet_v2-0" / "models" / "mobilenet_v2" / "1" / "model.py").is_file()
    finally:
        assert tritonctl("down", "plan.yaml").returncode == 0

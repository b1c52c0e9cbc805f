"""The main job, end to end: `tritonctl demo` on a copy of the shipped CPU demo cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, free_base_port

pytestmark = pytest.mark.triton  # real tritonserver processes


def test_demo_serves_every_model_of_the_cpu_demo(tmp_path):
    spec = yaml.safe_load((REPO / "examples" / "cpu-demo" / "cluster.yaml").read_text())
    spec["runtime"].update(
        export_dir=str(REPO / "model_repository" / "exports"),  # the shared export cache
        repository_dir="repo",
        state_dir="state",
        base_port=free_base_port(),
    )
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(spec))
    # As a newcomer runs it: the virtualenv not activated, so its bin folder is not on PATH.
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PATH": path}
    run = subprocess.run(
        [sys.executable, "-m", "tritonctl", "demo", str(cluster), "--duration", "10", "--teardown"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    if "== 0/4 calibrate" in run.stdout:  # another CPU than the profile's: the machine's noise is said
        assert re.search(r"rounds: [\d.]+% apart \(median\), [\d.]+% at most: this machine's own noise", run.stdout)
    rows = {}
    for line in run.stdout.splitlines():
        match = re.match(r"^(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+\s+([\d.]+)", line)
        if match:
            rows[match[1]] = tuple(int(match[i]) for i in (2, 3, 4))
    assert set(rows) == {m["name"] for m in spec["models"]}
    for sent, ok, failed in rows.values():
        assert sent > 0 and ok == sent and failed == 0
    verdicts = [line for line in run.stdout.splitlines() if line.startswith(("every model held", "not every model"))]
    assert len(verdicts) == 1  # whether every model kept 99% of its requests within its SLO, said either way
    started = run.stdout.count("\n  ready    ")  # one a placement: replicas where one instance would queue too long
    assert started >= 3 and f"stopped {started} instance(s)" in run.stdout

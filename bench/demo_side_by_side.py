"""The demo's plan beside the hand-written and naive deployments, at the rates `make demo` planned on this CPU.

    python bench/demo_side_by_side.py --out DIR [--scales 1 1.5 2] [--duration 30]

Run in a clone where `make demo` has run (its deployment may still be up: it is stopped first, since the
deployments compared take the same ports). Writes DIR/cluster.yaml (the demo's cluster at the rates of
examples/cpu-demo/plan.yaml, its folders those of this clone) and DIR/latency-model-calibrated.json (the model
`make demo` calibrated to this CPU), then runs

    bench/real_load.py DIR/cluster.yaml --latency-model DIR/latency-model-calibrated.json --out DIR
        --deployments handwritten naive best-replan --scales ... --duration ...

so every number comes from one run on one machine, under perf_analyzer and tritonctl's client. Quiet machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tritonctl.cli.measure import _calibrated_path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "cpu-demo"


def scaled_cluster(cluster: dict, plan: dict, out: Path) -> dict:
    """The demo's cluster at the plan's rates, its runtime folders those of this clone, relative to `out` (where the
    file is written)."""
    rates = {m["name"]: m["rate"] for m in plan["models"]}
    models = [{**m, "rate": rates[m["name"]]} for m in cluster["models"]]
    runtime = dict(cluster["runtime"])
    for key in ("repository_dir", "export_dir", "state_dir"):
        runtime[key] = os.path.relpath((DEMO / runtime[key]).resolve(), out.resolve())
    return {**cluster, "models": models, "runtime": runtime}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scales", nargs="+", default=["1", "1.5", "2"])
    parser.add_argument("--duration", default="30")
    args = parser.parse_args()
    plan_path = DEMO / "plan.yaml"
    if not plan_path.exists():
        sys.exit(f"{plan_path} is missing: run `make demo` first")
    cluster = yaml.safe_load((DEMO / "cluster.yaml").read_text())
    plan = yaml.safe_load(plan_path.read_text())
    calibrated = _calibrated_path(
        ROOT / "profiles" / "cpu-demo" / "latency-model.json", DEMO / cluster["runtime"]["state_dir"]
    )
    if not calibrated.exists():
        sys.exit(f"{calibrated} is missing: `make demo` calibrates the demo's model to this CPU there")
    args.out.mkdir(parents=True, exist_ok=True)
    scaled = {m["name"]: m["rate"] for m in plan["models"]}
    head = f"# The CPU demo at the rates `make demo` planned on this CPU ({scaled}), for bench/real_load.py.\n"
    text = yaml.safe_dump(scaled_cluster(cluster, plan, args.out), sort_keys=False)
    (args.out / "cluster.yaml").write_text(head + text)
    shutil.copyfile(calibrated, args.out / "latency-model-calibrated.json")
    tritonctl = [sys.executable, "-m", "tritonctl"]
    subprocess.run([*tritonctl, "down", str(plan_path)], check=True)
    command = [
        sys.executable,
        str(ROOT / "bench" / "real_load.py"),
        str(args.out / "cluster.yaml"),
        "--latency-model",
        str(args.out / "latency-model-calibrated.json"),
        "--out",
        str(args.out),
        "--deployments",
        "handwritten",
        "naive",
        "best-replan",
        "--scales",
        *args.scales,
        "--duration",
        args.duration,
    ]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())

"""`inss`'s decision time (or `search`'s plan) with this checkout's code against another commit's, decision by
decision.

    python bench/decision_ab.py --against COMMIT [--setup eight-4] [--vectors 50] [--policy inss|search]

Two warm worker processes, one running the code of COMMIT (`git archive` of its package folders into a
temporary folder) and one this checkout's, each loading the InSS setup of examples/inss-scaled/ with the
SCALED latency model and its own trained policy. Every held-out rate vector (each model's rate drawn in
0.5-1.2x, a fixed seed; the setup's own rates first) goes to both in turn, which one first alternating,
and each times its `inss.decide` (or `search`) alone. A machine whose speed drifts moves both of a pair alike, so the
ratio per vector is what compares; the script prints its median, each side's median decision, and how
many decisions differ (placement, whose, why and every choice). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("tritonctl", "rl", "profiler", "templates")  # the package and the folders it maps in a checkout
SEED = 20


def worker(setup: str, policy: str) -> None:
    """Answer each JSON line of rate factors on stdin with the decision's time (ms) and what it decided."""
    from tritonctl.latency.model import load_latency_model
    from tritonctl.latency.queueing import warm_tables
    from tritonctl.planning.planner import demands_of, devices_of
    from tritonctl.planning.policies.inss import decide, default_policy_file, load_trained
    from tritonctl.planning.policies.search import search
    from tritonctl.spec import load_cluster

    lm = load_latency_model(REPO / "profiles/inss-scaled/latency-model.json")
    cluster = load_cluster(REPO / f"examples/inss-scaled/{setup}.yaml")
    devices, base = devices_of(cluster), demands_of(cluster, {}, lm)
    name = cluster.spec.name
    trained = load_trained(default_policy_file(name), name, [d.name for d in base], devices)
    warm_tables(32)
    decide([replace(d, rate=d.rate * 0.3) for d in base], devices, lm, trained)  # torch's first call
    print(json.dumps(len(base)), flush=True)
    for line in sys.stdin:
        demands = [replace(d, rate=d.rate * x) for d, x in zip(base, json.loads(line), strict=True)]
        started = time.perf_counter()
        if policy == "search":
            what = sorted(search(demands, devices, lm).items())
        else:
            chosen = decide(demands, devices, lm, trained)
            what = [sorted(chosen.placement.items()), chosen.source, chosen.why, sorted(chosen.choices.items())]
        ms = 1000 * (time.perf_counter() - started)
        print(json.dumps([ms, repr(what)]), flush=True)


def start(code: Path, setup: str, policy: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(code)}
    args = [sys.executable, __file__, "--worker", "--setup", setup, "--policy", policy]
    return subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(proc: subprocess.Popen, factors: list[float]) -> tuple[float, str]:
    proc.stdin.write(json.dumps(factors) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        sys.exit("a worker stopped: see its error above")
    ms, what = json.loads(line)
    return ms, what


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="the commit whose code is timed beside this checkout's")
    parser.add_argument("--setup", default="eight-4", help="examples/inss-scaled/SETUP.yaml (default eight-4)")
    parser.add_argument("--vectors", type=int, default=50, help="rate vectors, the setup's own rates first")
    parser.add_argument("--policy", choices=("inss", "search"), default="inss", help="what is timed (default inss)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.setup, args.policy)
        return 0
    if not args.against:
        parser.error("--against COMMIT is needed")
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.against, *FOLDERS], capture_output=True)
        if archive.returncode:
            sys.exit(f"git archive {args.against}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        theirs, ours = start(Path(tmp), args.setup, args.policy), start(REPO, args.setup, args.policy)
        models = json.loads(theirs.stdout.readline())
        if json.loads(ours.stdout.readline()) != models:
            sys.exit("the two workers load different setups")
        rng = np.random.default_rng(SEED)
        times: dict[str, list[float]] = {"theirs": [], "ours": []}
        differ = 0
        for k in range(args.vectors):
            factors = rng.uniform(0.5, 1.2, models).tolist() if k else [1.0] * models
            order = [("theirs", theirs), ("ours", ours)][:: 1 if k % 2 else -1]
            answers = {side: ask(proc, factors) for side, proc in order}
            for side, (ms, _) in answers.items():
                times[side].append(ms)
            differ += answers["theirs"][1] != answers["ours"][1]
        for proc in (theirs, ours):
            proc.stdin.close()
            proc.wait()
    ratios = [a / b for a, b in zip(times["theirs"], times["ours"], strict=True)]
    theirs_ms, ours_ms = statistics.median(times["theirs"]), statistics.median(times["ours"])
    low, high = np.percentile(ratios, [25, 75])
    print(
        f"{args.policy}, {args.setup}, {args.vectors} rate vectors: {args.against} median {theirs_ms:.2f} ms, "
        f"this checkout {ours_ms:.2f} ms; per vector {args.against} / this checkout: median "
        f"{statistics.median(ratios):.2f} (quartiles {low:.2f}-{high:.2f}); {differ} of {args.vectors} decisions differ"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A GPU latency model carried to real Triton by `tritonctl calibrate`, and the plans made on it, under perf_analyzer.

    bash bench/gpu_host.sh gpu_calibrated.py OUT [--calibrated LM] [--scales 0.5 1] [--batching fill eager]
        [--split] [--baseline] [--duration 15] [--budget 540]

The committed GPU profile (profiles/inss-gpu) measured the models' CUDA graphs alone on an H100,
without Triton. Stages, each timed and logged to OUT/log.txt as it ends; everything else goes
into OUT/results.tar.gz, rewritten after each stage:
1. `tritonctl calibrate examples/gpu-one` with that profile: each model at MPS share 25 and 50
   through real Triton, the running time plus c0 + c1 * batch fitted, two held-out points each
   (skipped with --calibrated: a model calibrated on this kind of GPU before);
2. bench/real_load.py on the calibrated model: search's plan (`best`; `best-prompt`, `best-eager`
   served as `plan --batching prompt` or `eager`), with --split also BDA's batches on equal MPS shares
   (`bda`, `bda-prompt`, `bda-eager`), and the hand-written deployment (one
   tritonserver, the whole GPU each, dynamic batching up to 32), loaded by perf_analyzer at each
   scale of the cluster's rates, the plans' predictions beside;
3. with --baseline, the same for search's plan on the uncalibrated profile, at 1x.
Unpacked, each stage's folder holds real_load's summary.md, results.json, plans and CPU use by
process (bench/results/gpu-calibrated/ keeps those of the runs the docs cite).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import time
from pathlib import Path

from gpu_triton import CLUSTER, LATENCY_MODEL, REPO, calibrated, gpu_description, start


def options(parser) -> None:
    parser.add_argument("--calibrated", type=Path, help="a model calibrated on this kind of GPU: no calibration")
    parser.add_argument("--scales", nargs="+", default=["0.5", "1"], help="x the cluster's rates")
    parser.add_argument("--baseline", action="store_true", help="also search's plan on the uncalibrated profile")
    ways = ["fill", "prompt", "eager"]
    parser.add_argument("--batching", nargs="+", choices=ways, default=["fill"], help="search's plans: --batching")
    parser.add_argument(
        "--split", action="store_true", help="also BDA's batches on equal MPS shares (`bda-<batching>`) beside search's"
    )


def main() -> None:
    args, out, run, work = start(540, "gpu-calibrated-work", options)
    run.summary["host"] = {"gpu": gpu_description()}
    run.save()

    def pack() -> None:
        with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
            tar.add(work, arcname="gpu-calibrated")

    def calibrate() -> Path:
        path = calibrated(run, work)  # what calibrate printed: calibrate.txt beside it
        pack()
        return path

    model = args.calibrated.resolve() if args.calibrated else run.stage("calibrate", calibrate, min_left_s=200)

    def real_load(name: str, model, deployments: list[str], scales: list[str]):
        left = run.deadline - time.monotonic() - 10
        cmd = [sys.executable, str(REPO / "bench" / "real_load.py"), str(CLUSTER), "--latency-model", str(model),
               "--out", str(work / name), "--deployments", *deployments, "--scales", *scales,
               "--tools", "perf_analyzer", "--duration", f"{args.duration:g}"]  # fmt: skip
        run.log("$ " + " ".join(cmd[1:]))
        try:
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=left)
            output, rc = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            parts = [p.decode() if isinstance(p, bytes) else p for p in (exc.stdout, exc.stderr) if p]
            output, rc = "".join(parts) + "\nstopped at the budget", -1
        (work / f"{name}.txt").write_text(output)
        pack()
        return {"rc": rc, "tail": output.strip().splitlines()[-14:]}

    if model is not None:
        best = ["best" if b == "fill" else f"best-{b}" for b in args.batching]
        split = ["bda" if b == "fill" else f"bda-{b}" for b in args.batching] if args.split else []
        run.stage("calibrated", lambda: real_load("calibrated", model, [*best, *split, "handwritten"], args.scales))
    if args.baseline:
        run.stage("uncalibrated", lambda: real_load("uncalibrated", LATENCY_MODEL, ["best"], ["1"]), min_left_s=90)
    pack()
    run.log("done")


if __name__ == "__main__":
    main()

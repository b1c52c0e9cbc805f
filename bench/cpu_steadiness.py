"""How steady this machine's CPU is: one fixed piece of work timed again and again for some minutes.

    python bench/cpu_steadiness.py [--minutes 5] [--every 1.0] [--out bench/results/cpu-steadiness]

Two pieces of work, alternately, once every `--every` seconds: ResNet18 at batch 1 on onnxruntime with one
intra-op thread (the demo's export; the median of 3 runs: what an instance feels) and a fixed pure-Python loop
(what the planner and the simulator feel). Each keeps its own time series; the machine's other load is
sampled too (busy cores beside the work, from /proc/stat), so a slow stretch with the machine idle is the
host's, not ours. No latency model can predict a time more closely than the same work's own spread, so the
spread here is the floor under the error of any profile or calibration measured on this machine.

Writes OUT/<cpu id>.csv (every sample), OUT/<cpu id>.txt (the summary) and OUT/<cpu id>.png (both series over
time). Run it on a quiet machine (nothing else of ours running).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import onnxruntime as ort

from tritonctl.export import materialize
from tritonctl.latency.device import busy_cores, cpu_fingerprint
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
LOOP = 200_000  # iterations of the Python loop: about 10-25 ms on the 2-vCPU VMs


def python_loop_ms() -> float:
    started = time.perf_counter()
    total = 0
    for i in range(LOOP):
        total += i * i % 7
    return 1000 * (time.perf_counter() - started)


def resnet_session() -> tuple[ort.InferenceSession, dict[str, np.ndarray]]:
    """The CPU demo's ResNet18 on one intra-op thread, with a batch-1 input."""
    artifacts = materialize(load_cluster(REPO / "examples/cpu-demo/cluster.yaml"), log=lambda _: None)
    artifact = artifacts["resnet18"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(artifact.path), options, providers=["CPUExecutionProvider"])
    (sig,) = artifact.inputs
    return session, {sig.name: np.random.default_rng(0).random((1, *sig.shape), dtype=np.float32)}


def resnet_ms(session: ort.InferenceSession, feed: dict[str, np.ndarray]) -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        session.run(None, feed)
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def spread(values: list[float]) -> str:
    """Median, p5-p95 and min-max of a series, and p95 over p5."""
    v = np.array(values)
    p5, p50, p95 = np.percentile(v, [5, 50, 95])
    return (
        f"median {p50:.2f} ms, p5-p95 {p5:.2f}-{p95:.2f}, min-max {v.min():.2f}-{v.max():.2f}; "
        f"p95/p5 {p95 / p5:.2f}, max/min {v.max() / v.min():.2f}, p95 off the median {100 * (p95 / p50 - 1):.1f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to sample (default 5)")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/cpu-steadiness")
    args = parser.parse_args()
    cpu = cpu_fingerprint()
    session, feed = resnet_session()
    for _ in range(5):  # warm both up
        resnet_ms(session, feed)
        python_loop_ms()
    rows, began = [], time.monotonic()
    while (elapsed := time.monotonic() - began) < 60 * args.minutes:
        row = {"t_s": round(elapsed, 2), "resnet18_ms": resnet_ms(session, feed), "python_ms": python_loop_ms()}
        row["busy_cores"] = round(busy_cores(args.every), 2)  # the next second, this process idle
        rows.append(row)
        if len(rows) % 60 == 0:
            print(f"  {elapsed / 60:.1f} of {args.minutes:g} min", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / cpu["id"]
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    minute = [[r for r in rows if m * 60 <= r["t_s"] < (m + 1) * 60] for m in range(int(np.ceil(args.minutes)))]
    medians = {
        key: [statistics.median(r[key] for r in rs) for rs in minute if rs] for key in ("resnet18_ms", "python_ms")
    }
    caches = ", ".join(f"{k} {v}" for k, v in cpu["caches"].items())
    lines = [
        f"# python bench/cpu_steadiness.py --minutes {args.minutes:g} --every {args.every:g}",
        f"# {cpu['model']}, {cpu['logical_cpus']} logical CPUs, {caches}; CPU id {cpu['id']}; {len(rows)} samples",
        f"ResNet18 batch 1, 1 thread (median of 3 a sample): {spread([r['resnet18_ms'] for r in rows])}",
        f"Python loop of {LOOP:,}: {spread([r['python_ms'] for r in rows])}",
        "per-minute medians, ResNet18: " + ", ".join(f"{m:.2f}" for m in medians["resnet18_ms"]),
        "per-minute medians, Python: " + ", ".join(f"{m:.2f}" for m in medians["python_ms"]),
        f"busy cores beside the work (of {cpu['logical_cpus']}): median "
        f"{statistics.median(r['busy_cores'] for r in rows):.2f}, max {max(r['busy_cores'] for r in rows):.2f}",
    ]
    stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    t = [r["t_s"] / 60 for r in rows]
    for ax, key, label in (
        (axes[0], "resnet18_ms", "ResNet18 b1, 1 thread (ms)"),
        (axes[1], "python_ms", f"Python loop of {LOOP:,} (ms)"),
        (axes[2], "busy_cores", "busy cores beside it"),
    ):
        ax.plot(t, [r[key] for r in rows], ".", markersize=3)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(f"The same work, again and again: {cpu['model']} ({caches})", fontsize=10)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    print(f"wrote {stem}.csv, .txt and .png")


if __name__ == "__main__":
    main()

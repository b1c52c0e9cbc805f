"""The product's own path on a GPU host: export, plan, apply (real Triton under MPS), load, swap, profile, energy.

    bash bench/gpu_host.sh gpu_triton.py OUT     # on the GPU host: unpacks what travels, then runs this

Stages, each timed and written to OUT as it ends (a stage that fails is recorded and the next runs):
1. export, calibrate the H100 stand-in latency model (profiles/inss-gpu) to Triton on this GPU, plan
   examples/gpu-one on it (search);
2. apply through the local runtime: an MPS control daemon under the state folder, one tritonserver per
   instance with its CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, the PyTorch CUDA-graph glue, HAProxy in front;
3. perf_analyzer at the planned rates, then tritonctl's own client (same rates, same duration), each with what
   Triton counted meanwhile (mean batch, queueing and compute per request);
4. the stand-in replay of the same plan (bench/gpu_replay.py: CUDA graphs in MPS clients, no Triton);
5. a shadow swap (one model's share) and a batch-only reload under load (own client), failed requests counted;
6. a profile through real Triton: every model at share 25, batch 8, closed-loop single requests of batch 1, 4
   and 8 sent one model at a time, against the stand-in profile's solo rows at the same points; beside it the
   same straight to the instance (no HAProxy), and Triton's own compute and queueing per request;
7. down (the MPS daemon stops with it);
8. energy per image over batch x locked SM clock (profiler/energy.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "examples" / "gpu-one" / "cluster.yaml"
LATENCY_MODEL = REPO / "profiles" / "inss-gpu" / "latency-model.json"
STANDIN = REPO / "profiles" / "inss-gpu" / "measurements.csv"
CLI = [sys.executable, "-m", "tritonctl"]


class Run:
    def __init__(self, out: Path, budget_s: float):
        self.out, self.deadline = out, time.monotonic() + budget_s
        self.summary: dict = {"stages": {}}
        self.log_fh = (out / "log.txt").open("a")

    def log(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        print(line, flush=True)
        self.log_fh.write(line + "\n")
        self.log_fh.flush()

    def save(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str) + "\n")

    def stage(self, name: str, func, min_left_s: float = 20.0):
        left = self.deadline - time.monotonic()
        if left < min_left_s:
            self.log(f"== {name}: skipped, {left:.0f} s left")
            self.summary["stages"][name] = {"skipped": f"{left:.0f} s left"}
            self.save()
            return None
        self.log(f"== {name}")
        began = time.monotonic()
        try:
            result = func()
            self.summary["stages"][name] = {"ok": True, "seconds": round(time.monotonic() - began, 1), "result": result}
        except Exception as exc:  # recorded; the next stage runs
            self.log(f"!! {name} failed: {exc}\n{traceback.format_exc()[-1500:]}")
            self.summary["stages"][name] = {
                "ok": False,
                "seconds": round(time.monotonic() - began, 1),
                "error": str(exc)[-800:],
            }
            result = None
        self.save()
        return result

    def cli(self, *args: str, timeout_s: float = 300) -> str:
        self.log("$ tritonctl " + " ".join(args))
        done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
        self.log_fh.write(done.stderr[-4000:] + done.stdout[-4000:] + "\n")
        if done.returncode != 0:
            raise RuntimeError(f"tritonctl {args[0]} exited {done.returncode}: {(done.stderr or done.stdout)[-600:]}")
        return done.stdout


def closed_loop(url: str, model: str, shape: list[int], batch: int, reps: int) -> list[float]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    data = np.random.default_rng(0).standard_normal((batch, *shape), dtype=np.float32)
    inp = grpcclient.InferInput("input", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        client.infer(model, [inp])
        if i >= 3:
            times.append(1000 * (time.perf_counter() - t0))
    client.close()
    return times


def server_stats(plan_path: Path) -> dict[str, dict[str, int]]:
    """Per model, the cumulative counters of its Triton instances (summed over them): requests answered, batches
    executed, inferences (images), and the nanoseconds requests spent queued and in compute (input, infer,
    output; each request of a batch counts the batch's compute)."""
    import tritonclient.grpc as grpcclient

    from tritonctl.deploy.state import load_state
    from tritonctl.planning.plan import load_plan

    totals: dict[str, dict[str, int]] = {}
    for record in load_state(load_plan(plan_path).state_dir).instances.values():
        with grpcclient.InferenceServerClient(f"{record.host}:{record.backend_port}") as client:
            stats = client.get_inference_statistics(record.model, as_json=True)["model_stats"][0]
        inference = stats["inference_stats"]
        counters = {
            "requests": int(inference["success"].get("count", 0)),
            "batches": int(stats.get("execution_count", 0)),
            "images": int(stats.get("inference_count", 0)),
            "queue_ns": int(inference["queue"].get("ns", 0)),
            "compute_ns": sum(
                int(inference[k].get("ns", 0)) for k in ("compute_input", "compute_infer", "compute_output")
            ),
        }
        total = totals.setdefault(record.model, dict.fromkeys(counters, 0))
        for key, value in counters.items():
            total[key] += value
    return totals


def stats_between(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """What Triton saw between two `server_stats`: per model the mean batch, and per request its queueing and its
    batch's compute (ms)."""
    out = {}
    for model, b in after.items():
        a = before.get(model, dict.fromkeys(b, 0))
        d = {k: b[k] - a[k] for k in b}
        requests = max(d["requests"], 1)
        out[model] = {
            "requests": d["requests"],
            "mean_batch": round(d["images"] / max(d["batches"], 1), 2),
            "queue_ms_per_request": round(d["queue_ns"] / requests / 1e6, 3),
            "compute_ms_per_request": round(d["compute_ns"] / requests / 1e6, 3),
        }
    return out


def standin_p50(model: str, share: int, batch: int) -> float | None:
    import csv

    with STANDIN.open() as fh:
        for row in csv.DictReader(fh):
            if (
                row["kind"] == "solo"
                and row["model"] == model
                and int(row["share"]) == share
                and int(row["batch"]) == batch
            ):
                return float(row["p50_ms"])
    return None


def calibrated(run: Run, work: Path) -> Path:
    """The committed GPU profile carried to real Triton on this GPU (`tritonctl calibrate`, what it printed kept in
    calibrate.txt beside), once per work folder: a GPU host refuses to plan on a model not measured through Triton
    on its GPU."""
    path = work / "latency-model.calibrated.json"
    if not path.exists():
        text = run.cli("calibrate", str(CLUSTER), "--latency-model", str(LATENCY_MODEL), "-o", str(path), timeout_s=400)
        (work / "calibrate.txt").write_text(text)
    return path


def gpu_description(fields: str = "name,driver_version,memory.total,clocks.max.sm") -> str:
    """What nvidia-smi says of the GPU(s): by default name, driver, memory and top SM clock."""
    query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
    try:
        return subprocess.run(query, capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return "no nvidia-smi"


def start(
    budget_s: float, work: str, more: Callable[[argparse.ArgumentParser], None] | None = None
) -> tuple[argparse.Namespace, Path, Run, Path]:
    """What a GPU bench script starts with: its arguments (-o, --budget, --duration and what `more` adds), its
    output folder and Run, and its work folder under /tmp (plans and their variants side by side: their paths are
    relative)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--budget", type=float, default=budget_s, help="seconds for the whole run")
    parser.add_argument("--duration", type=float, default=20, help="seconds of each load")
    if more is not None:
        more(parser)
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path("/tmp") / work
    folder.mkdir(parents=True, exist_ok=True)
    return args, out, Run(out, args.budget), folder


def main() -> None:
    args, out, run, work = start(560, "gpu-triton-work")
    plan_path = work / "plan.yaml"
    import torch

    run.summary["host"] = {
        "gpu": gpu_description(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    run.save()

    def plan():
        run.cli("export", str(CLUSTER))
        lm = str(calibrated(run, work))
        text = run.cli("plan", str(CLUSTER), "--policy", "search", "--latency-model", lm, "-o", str(plan_path))
        (out / "plan.yaml").write_text(plan_path.read_text())
        return text.strip().splitlines()[-8:]

    run.stage("plan", plan)
    if not plan_path.exists():
        return

    def apply():
        t0 = time.monotonic()
        text = run.cli("apply", str(plan_path), timeout_s=400)
        status = run.cli("status", str(plan_path))
        return {
            "apply_s": round(time.monotonic() - t0, 1),
            "apply": text.strip().splitlines()[-10:],
            "status": status.strip().splitlines(),
        }

    if run.stage("apply", apply, min_left_s=60) is None:
        run.stage("down", lambda: run.cli("down", str(plan_path)))
        return

    def load(tool: str, scale: float):
        before = server_stats(plan_path)
        text = run.cli(
            "load",
            str(plan_path),
            "--tool",
            tool,
            "--duration",
            f"{args.duration:g}",
            "--rate-scale",
            f"{scale:g}",
            "--format",
            "json",
            timeout_s=args.duration * 4 + 60,
        )
        return {**json.loads(text), "triton": stats_between(before, server_stats(plan_path))}

    run.stage("perf_analyzer", lambda: load("perf_analyzer", 1.0), min_left_s=args.duration + 30)
    run.stage("own client", lambda: load("tritonctl", 1.0), min_left_s=args.duration + 30)

    def swap_under_load():
        from tritonctl.deploy.apply import apply_plan
        from tritonctl.deploy.local import LocalRuntime
        from tritonctl.planning.plan import load_plan
        from tritonctl.triton.binary import find_tritonserver
        from tritonctl.triton.client import endpoints, run_load

        loaded = load_plan(plan_path)
        base = yaml.safe_load(plan_path.read_text())
        first = base["models"][0]
        swap = json.loads(json.dumps(base))
        swap["models"][0]["placements"][0]["share"] = first["placements"][0]["share"] - 5
        reload = json.loads(json.dumps(swap))
        reload["models"][0]["placements"][0]["batch"] = max(1, first["placements"][0]["batch"] // 2)
        variants = []
        for name, doc in (("swap", swap), ("reload", reload)):
            path = work / f"plan-{name}.yaml"
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            variants.append((name, path))
        runtime = LocalRuntime(find_tritonserver(loaded.plan.runtime.tritonserver), loaded.state_dir)
        results = []
        duration = 40.0
        load = threading.Thread(
            target=lambda: results.extend(run_load(endpoints(loaded.plan), duration, 0.25)), daemon=True
        )
        load.start()
        timings = {}
        time.sleep(4)
        for name, path in variants:
            t0 = time.monotonic()
            apply_plan(load_plan(path), runtime, log=run.log)
            timings[name] = round(time.monotonic() - t0, 2)
            time.sleep(3)
        load.join()
        return {
            "rate_scale": 0.25,
            "took_s": timings,
            "sent": sum(r.sent for r in results),
            "failed": sum(r.sent - r.ok for r in results),
            "first_errors": [e for r in results for e in r.errors][:3],
            "p99_ms": {r.model: round(r.percentile(99), 2) for r in results},
        }

    run.stage("swap under load", swap_under_load, min_left_s=90)

    def profile():
        from tritonctl.planning.plan import load_plan
        from tritonctl.triton.client import endpoints

        doc = yaml.safe_load(plan_path.read_text())
        for m in doc["models"]:
            for p in m["placements"]:
                p.update(share=25, batch=8, queue_delay_us=0)
        path = work / "plan-profile.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        run.cli("apply", str(path), "--accept-misses", timeout_s=400)
        loaded = load_plan(path)
        from tritonctl.deploy.state import load_state

        direct = {r.model: f"{r.host}:{r.backend_port}" for r in load_state(loaded.state_dir).instances.values()}
        sources = {m["name"]: m.get("source") for m in doc["models"]}
        standin_names = {"mobilenet_v2": "mobilenet", "efficientnet_b0": "efficientnet", "mnasnet1_0": "mnasnet"}
        rows = []
        for ep in endpoints(loaded.plan):
            for batch in (1, 4, 8):
                before = server_stats(path)
                times = closed_loop(ep.url, ep.model, list(ep.input_shape), batch, 40)
                server = stats_between(before, server_stats(path))[ep.model]
                straight = closed_loop(direct[ep.model], ep.model, list(ep.input_shape), batch, 20)
                src = sources[ep.model]
                ref = standin_p50(standin_names.get(src, src), 25, batch)
                rows.append(
                    {
                        "model": ep.model,
                        "share": 25,
                        "batch": batch,
                        "triton_p50_ms": round(float(np.median(times)), 3),
                        "triton_p99_ms": round(float(np.percentile(times, 99)), 3),
                        "standin_p50_ms": ref,
                        "direct_p50_ms": round(float(np.median(straight)), 3),  # straight to the instance
                        "server_compute_ms": server["compute_ms_per_request"],
                        "server_queue_ms": server["queue_ms_per_request"],
                    }
                )
                run.log(f"  {rows[-1]}")
        return rows

    run.stage("profile through triton", profile, min_left_s=90)
    run.stage("down", lambda: run.cli("down", str(plan_path)).strip().splitlines()[-3:], min_left_s=5)

    def replay():
        spec = work / "replay-spec.json"
        subprocess.run(
            [
                sys.executable,
                str(REPO / "bench" / "gpu_replay.py"),
                "spec",
                str(plan_path),
                "--cluster",
                str(CLUSTER),
                "--duration",
                "15",
                "-o",
                str(spec),
            ],
            check=True,
            cwd=REPO,
            capture_output=True,
        )
        done = subprocess.run(
            [sys.executable, str(REPO / "bench" / "gpu_replay.py"), "run", str(spec), "--out", str(out / "replay")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=200,
        )
        run.log_fh.write(done.stdout[-3000:] + done.stderr[-3000:])
        return {"rc": done.returncode, "tail": done.stdout.strip().splitlines()[-12:]}

    run.stage("stand-in replay", replay, min_left_s=70)

    def energy():
        done = subprocess.run(
            [sys.executable, "-m", "tritonctl.profiler.energy", "--seconds", "0.8", "-o", str(out / "energy.csv")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=max(30, run.deadline - time.monotonic() - 5),
        )
        run.log_fh.write(done.stdout[-6000:] + done.stderr[-3000:])
        return {"rc": done.returncode, "tail": (done.stdout + done.stderr).strip().splitlines()[-5:]}

    run.stage("energy", energy, min_left_s=60)
    run.log("done")


if __name__ == "__main__":
    main()

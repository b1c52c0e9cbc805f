"""Profile models on an NVIDIA GPU under MPS shares, into a tritonctl profile.

The GPU hosts lent to this project run no Triton, so this measures what the latency model needs
straight from PyTorch. Each model is its torchvision architecture (seeded random weights, fp32
with TF32 math), captured as one CUDA graph per batch size, in one process per MPS share
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). One timed batch copies the input from pinned host memory,
replays the graph, copies the output back and waits, so it includes upload and feedback (InSS's
t_io); CUDA events time the graph alone (`compute_ms`). The grid is `tritonctl profile`'s
(profiler/grid.py), co-locating every pair and up to 8 triples. Nsight Compute then reads each
model's L2 throughput (lts__throughput, % of peak, over one replay of its CUDA graph at batch 4)
on the whole GPU, with MPS stopped: under MPS ncu profiles no graphs and only through a control
process of its own, too slow for a lease. `assemble` carries it to each share by the graph's
time there and fits InSS's line l_i = a * share + b (`_l2_line`).

Two steps. On the GPU host (torch, torchvision, nvidia-cuda-mps-control and ncu; nothing else):

    python3 -m profiler.gpu measure --models alexnet=alexnet,resnet50=resnet50 --out raw.jsonl

Then here, where the cluster's ONNX files are, into a profile folder `tritonctl fit` reads:

    python -m profiler.gpu assemble raw.jsonl --cluster examples/inss-gpu/cluster.yaml --output profiles/inss-gpu
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .grid import TRAIN_BATCHES, Run, coloc_runs, solo_runs

L2_BATCH = 4
L2_METRICS = "gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed"
SOLO_MIN_S, SOLO_MIN_REPS, SOLO_MAX_S = 0.15, 25, 2.0
COLOC_WINDOW_S = 1.0


def parse_models(text: str) -> dict[str, str]:
    """'alexnet=alexnet,mobilenet=mobilenet_v2' -> {name: torchvision architecture}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, source = item.partition("=")
        out[name.strip()] = (source or name).strip()
    return out


# ---- on the GPU host: one worker process per MPS share ----------------------------------------------------


def _setup_torch():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return torch


def _build(torch, source: str):
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.get_model(source, weights=None).eval().cuda()


def _capture(torch, module, batch: int, pool):
    """(graph, static input, static output) of one forward pass at `batch`, after warm-up on a side stream."""
    with torch.inference_mode():
        static_in = torch.randn(batch, 3, 224, 224, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                module(static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            static_out = module(static_in)
    return graph, static_in, static_out


def batch_runner(torch, module, batch: int, pool):
    """A function that runs one batch as a server would: the input copied from pinned host memory, the captured
    graph replayed, the output copied back, and waited for. It returns the graph's own time (ms, CUDA events)."""
    graph, static_in, static_out = _capture(torch, module, batch, pool)
    host_in = torch.randn(batch, 3, 224, 224).pin_memory()
    host_out = torch.empty(static_out.shape, dtype=static_out.dtype).pin_memory()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    @torch.inference_mode()  # the graph's static tensors are inference tensors
    def run() -> float:
        static_in.copy_(host_in, non_blocking=True)
        start.record()
        graph.replay()
        end.record()
        host_out.copy_(static_out, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return start.elapsed_time(end)

    return run


def _worker(models: dict[str, str]) -> None:
    """Serve JSON-line commands on stdin: prepare graphs, time batches, measure memory."""
    torch = _setup_torch()
    nets, runners = {}, {}
    pool = torch.cuda.graph_pool_handle()  # graphs replay one at a time in a worker: they share memory

    def net(name):
        if name not in nets:
            nets[name] = _build(torch, models[name])
        return nets[name]

    def prepare(name, batch):
        if (name, batch) not in runners:
            runners[name, batch] = batch_runner(torch, net(name), batch, pool)

    def once(name, batch):
        began = time.perf_counter()
        graph_ms = runners[name, batch]()
        return 1000 * (time.perf_counter() - began), graph_ms

    def run(cmd):
        name, batch = cmd["model"], cmd["batch"]
        lat, gpu = [], []
        if "until" in cmd:  # co-located: run until the window closes, keep batches wholly inside it
            time.sleep(max(0.0, cmd["start"] - time.time()))
            while time.time() < cmd["until"]:
                total, graph_ms = once(name, batch)
                if time.time() <= cmd["until"]:
                    lat.append(total)
                    gpu.append(graph_ms)
            return {"lat": lat[1:], "gpu": gpu[1:]}
        for _ in range(3):
            once(name, batch)
        began = time.perf_counter()
        while (len(lat) < SOLO_MIN_REPS or time.perf_counter() - began < SOLO_MIN_S) and (
            time.perf_counter() - began < SOLO_MAX_S
        ):
            total, graph_ms = once(name, batch)
            lat.append(total)
            gpu.append(graph_ms)
        return {"lat": lat, "gpu": gpu}

    @torch.inference_mode()
    def memory(cmd):
        """MB a model holds at each batch (its weights plus the peak its forward pass allocates), and the
        kernels one forward pass launches (InSS's operator count on a GPU)."""
        module = net(cmd["model"])
        weights = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
        out = {}
        for batch in cmd["batches"]:
            x = torch.randn(batch, 3, 224, 224, device="cuda")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            module(x)
            torch.cuda.synchronize()
            out[str(batch)] = weights + (torch.cuda.max_memory_allocated() - before) / 2**20
            del x
        x = torch.randn(1, 3, 224, 224, device="cuda")
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            module(x)
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        return {"mb": out, "kernels": kernels}

    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "prepare":
                for name, batch in cmd["items"]:
                    prepare(name, batch)
                torch.cuda.synchronize()
                reply = {"sms": torch.cuda.get_device_properties(0).multi_processor_count}
            elif cmd["op"] == "run":
                reply = run(cmd)
            else:
                reply = memory(cmd)
        except Exception as exc:  # the coordinator stops and reports it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


def _l2_probe(models: dict[str, str], batch: int) -> None:
    """Under ncu (--graph-profiling graph): each model's CUDA graph at `batch` replayed once in the profiled
    range, so ncu reports one result per model, in this order."""
    torch = _setup_torch()
    for source in models.values():
        module = _build(torch, source)
        graph, _, _ = _capture(torch, module, batch, None)
        graph.replay()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        graph.replay()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        del graph, module


class _Workers:
    """Worker processes by (share, slot): a run with two members at one share needs two processes."""

    def __init__(self, models_arg: str, env: dict[str, str]):
        self.models_arg, self.env, self.procs = models_arg, env, {}

    def send(self, key: tuple[int, int], cmd: dict) -> None:
        if key not in self.procs:
            env = {**self.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(key[0])}
            self.procs[key] = subprocess.Popen(
                [sys.executable, "-m", "profiler.gpu", "worker", "--models", self.models_arg],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        self.procs[key].stdin.write(json.dumps(cmd) + "\n")
        self.procs[key].stdin.flush()

    def recv(self, key: tuple[int, int]) -> dict:
        line = self.procs[key].stdout.readline()
        if not line:
            raise RuntimeError(f"worker at share {key[0]} exited (code {self.procs[key].wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"worker at share {key[0]}: {reply['error']}")
        return reply

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
        self.procs = {}


def _keys(run: Run) -> list[tuple[int, int]]:
    seen: dict[int, int] = {}
    keys = []
    for m in run.members:
        keys.append((m.share, seen.get(m.share, 0)))
        seen[m.share] = keys[-1][1] + 1
    return keys


def _stats(lat: list[float]) -> dict:
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else [lat[0]] * 99
    return {"p50_ms": q[49], "p95_ms": q[94], "p99_ms": q[98], "mean_ms": statistics.fmean(lat), "reps": len(lat)}


def _start_mps(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(tmp / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(tmp / "log")}
    for d in ("pipe", "log"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
    return env


def _stop_mps(env: dict[str, str]) -> None:
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env, check=False)


def _l2_stage(models_arg: str, names: list[str], emit, log, deadline: float) -> None:
    """Each model's L2 throughput on the whole GPU (ncu cannot profile an MPS client with its own report)."""
    ncu = shutil.which("ncu")
    if ncu is None:
        log("no ncu on the PATH: L2 utilisation not measured")
        return
    with tempfile.NamedTemporaryFile("r", suffix=".csv") as report:
        cmd = [ncu, "--graph-profiling", "graph", "--profile-from-start", "off", "--metrics", L2_METRICS, "--csv"]
        cmd += ["--log-file", report.name, sys.executable, "-m", "profiler.gpu", "l2probe"]
        cmd += ["--models", models_arg, "--batch", str(L2_BATCH)]
        started = time.time()
        try:
            proc = subprocess.run(cmd, timeout=max(10.0, deadline - time.time()), capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            log("L2: ncu ran out of time")
            return
        text = Path(report.name).read_text()
    per_model = _parse_ncu(text, names)
    if proc.returncode != 0 or per_model is None:
        log(f"L2: ncu failed ({proc.returncode}): {(proc.stdout + proc.stderr + text)[-600:]}")
        return
    for name, l2 in per_model.items():
        emit({"type": "l2", "model": name, "share": 100, "batch": L2_BATCH, "l2_pct": l2})
    log(f"L2: {time.time() - started:.0f} s, " + ", ".join(f"{n} {v:.1f}%" for n, v in per_model.items()))


def _parse_ncu(text: str, names: list[str]) -> dict[str, float] | None:
    """Per model: L2 throughput % of its graph, from ncu's CSV (None when the results do not match the models)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    results: dict[int, float] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        if row["Metric Name"].startswith("lts__throughput"):
            results[int(row["ID"])] = float(row["Metric Value"].replace(",", ""))
    if len(results) != len(names):
        return None
    return dict(zip(names, (results[k] for k in sorted(results)), strict=True))


def measure(models_arg: str, out: Path, deadline_s: float, log=print) -> None:
    """Everything, in order of value: solo grid, co-located grid, memory, then L2 in what time is left."""
    models = parse_models(models_arg)
    names = list(models)
    deadline = time.time() + deadline_s
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        sink = out.open("x")
    except FileExistsError:
        raise SystemExit(f"{out} exists: measure into a new file (assemble reads one run)") from None

    def emit(record: dict) -> None:
        sink.write(json.dumps(record) + "\n")
        sink.flush()

    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    import torch
    import torchvision

    emit(
        {
            "type": "meta",
            "gpu": smi,
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "python": sys.version.split()[0],
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    runs = solo_runs(names, 100) + coloc_runs(names, 100, max_pairs=math.comb(len(names), 2), max_triples=8)
    random.Random(0).shuffle(runs)
    tmp = Path(tempfile.mkdtemp(prefix="tritonctl-mps-"))
    env = _start_mps(tmp)
    workers = _Workers(models_arg, env)
    try:
        needs: dict[tuple[int, int], set] = {}
        for run in runs:
            for key, m in zip(_keys(run), run.members, strict=True):
                needs.setdefault(key, set()).add((m.model, m.batch))
        needs.setdefault((100, 0), set())
        started = time.time()
        for key, items in needs.items():
            workers.send(key, {"op": "prepare", "items": sorted(items)})
        sms = {key[0]: workers.recv(key)["sms"] for key in needs}
        emit({"type": "sms", "by_share": sms})
        log(f"{len(needs)} workers prepared {sum(map(len, needs.values()))} graphs in {time.time() - started:.0f} s")
        l2_reserve = min(120.0, 0.4 * deadline_s)  # memory, kernel counts and ncu: under a minute for eight models
        for i, run in enumerate(runs):
            if time.time() > deadline - l2_reserve:
                log(f"grid stopped at run {i} of {len(runs)}: time reserved for L2")
                break
            keys = _keys(run)
            at = time.time() + 0.2
            for key, m in zip(keys, run.members, strict=True):
                cmd = {"op": "run", "model": m.model, "batch": m.batch}
                workers.send(key, cmd if run.kind == "solo" else {**cmd, "start": at, "until": at + COLOC_WINDOW_S})
            for key, m in zip(keys, run.members, strict=True):
                reply = workers.recv(key)
                if not reply["lat"]:
                    log(f"{run.group}: no batch of {m.model} inside the window; skipped")
                    continue
                others = [o for o in run.members if o is not m]
                emit(
                    {
                        "type": "row",
                        "config_id": run.group,
                        "kind": run.kind,
                        "split": run.split,
                        "model": m.model,
                        "batch": m.batch,
                        "share": m.share,
                        "corunners": ";".join(f"{o.model}:{o.share}:{o.batch}" for o in others),
                        "n_colocated": len(run.members),
                        "compute_ms": statistics.median(reply["gpu"]),
                        **_stats(reply["lat"]),
                    }
                )
            if i % 50 == 0:
                log(f"run {i} of {len(runs)}, {time.time() - started:.0f} s")
        try:
            for name in names:
                workers.send((100, 0), {"op": "memory", "model": name, "batches": list(TRAIN_BATCHES)})
                reply = workers.recv((100, 0))
                emit({"type": "kernels", "model": name, "kernels": reply["kernels"]})
                for batch, mb in reply["mb"].items():
                    emit({"type": "memory", "model": name, "batch": int(batch), "mb": mb})
        except RuntimeError as exc:  # L2 is worth more than the rest of this stage
            log(f"memory and kernel counts stopped: {exc}")
        workers.close()
        _stop_mps(env)  # ncu refuses to profile while MPS runs
        env = None
        _l2_stage(models_arg, names, emit, log, deadline)
        log(f"done in {time.time() - started:.0f} s")
    finally:
        for proc in workers.procs.values():
            proc.kill()
        if env is not None:
            _stop_mps(env)
        sink.close()


# ---- here: raw records -> a profile folder ---------------------------------------------------------------


def assemble(raw: Path, cluster_path: Path, output: Path, log=print):
    """Build the profile folder from the GPU host's records and this machine's ONNX files of the same models."""
    from tritonctl.errors import TritonctlError
    from tritonctl.export import materialize
    from tritonctl.latency.dataset import Dataset, Measurement, MemoryPoint, ModelFeatures
    from tritonctl.spec import load_cluster

    from .graphinfo import graph_info

    try:
        records = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise TritonctlError(f"cannot read: {exc.strerror}", file=raw) from None
    except json.JSONDecodeError as exc:
        raise TritonctlError(f"not JSON lines (line {exc.lineno}): {exc.msg}", file=raw) from None
    by_type: dict[str, list[dict]] = {}
    for r in records:
        by_type.setdefault(r["type"], []).append(r)
    if not by_type.get("meta") or not by_type.get("row") or not by_type.get("sms"):
        raise TritonctlError("no measurements in it (was `measure` cut short?)", file=raw)
    if len(by_type["meta"]) > 1:
        raise TritonctlError("it holds more than one run of `measure`: assemble one at a time", file=raw)
    meta, sms = by_type["meta"][0], by_type["sms"][0]["by_share"]
    cluster = load_cluster(cluster_path)
    artifacts = materialize(cluster, log=log)
    l2 = by_type.get("l2", [])
    features, pressure = [], {}
    for name, artifact in artifacts.items():
        info = graph_info(artifact.path).__dict__
        points = [r for r in l2 if r["model"] == name]
        kernels = [r["kernels"] for r in by_type.get("kernels", []) if r["model"] == name]
        if kernels:
            info["n_ops"] = kernels[0]  # kernels per forward pass: InSS's operator count on a GPU
        features.append(ModelFeatures(name, artifact.sha256, **info))
        if not points:
            raise TritonctlError(f"no L2 utilisation of model {name!r}: its interference cannot be fitted", file=raw)
        pressure[name] = _l2_line(points[0]["l2_pct"], by_type["row"], name)
    unknown = {r["model"] for r in by_type["row"]} - set(artifacts)
    if unknown:
        raise TritonctlError(f"measured models the cluster lacks: {sorted(unknown)}", file=cluster_path)
    memory = {(r["model"], r["batch"]): r["mb"] for r in by_type.get("memory", [])}
    rows = [
        Measurement(
            **{k: r[k] for k in r if k != "type"},
            units=100,
            cores=float(sms["100"]),
            threads=0,  # no threads on a GPU: the share is the MPS fraction
            queue_ms=0.0,
            rss_mb=memory.get((r["model"], r["batch"]), float("nan")) if r["kind"] == "solo" else float("nan"),
            cpu_util=pressure[r["model"]](r["share"]),
        )
        for r in by_type["row"]
    ]
    gpu_name, driver, total = (s.strip() for s in meta["gpu"].split(","))
    device = {"kind": "gpu", "model": gpu_name, "driver": driver, "memory": total, "sms": sms["100"]}
    device["id"] = hashlib.sha256(repr(sorted(device.items())).encode()).hexdigest()[:12]
    dataset = Dataset.create(
        output,
        {
            "cluster": cluster.spec.name,
            "created": meta["created"],
            "device": device,
            "share_mechanism": "MPS CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; SMs by share " + json.dumps(sms, sort_keys=True),
            "measured_with": "profiler/gpu.py: PyTorch CUDA graphs of the torchvision architectures, fp32 weights, "
            "TF32 math, not Triton; latency includes pinned host<->device copies",
            "cpu_util_column": f"InSS's l_i: L2 throughput % of peak (ncu lts__throughput over one replay of the "
            f"graph, batch {L2_BATCH}) on the whole GPU, carried to each share by the graph time there; a line "
            "in the share (see l2.csv and profiler/gpu.py _l2_line)",
            "rss_mb_column": "weights + peak allocation of one forward pass (no CUDA context)",
            "software": {k: str(meta[k]) for k in ("torch", "torchvision", "cuda", "cudnn", "python")},
            "complete": True,
            "grid": {"runs": len({r.config_id for r in rows})},
        },
        features,
    )
    points = [MemoryPoint(model, 0, batch, mb) for (model, batch), mb in sorted(memory.items())]
    dataset.append(rows, points)
    (output / "l2.csv").write_text(
        "model,share,batch,l2_pct\n"
        + "".join(f"{r['model']},{r['share']},{r['batch']},{r['l2_pct']:.3f}\n" for r in l2)
    )
    log(f"{output}: {len(rows)} measurements of {len(artifacts)} models, {len(l2)} L2 points")
    return dataset


def _l2_line(l2_full: float, rows: list[dict], name: str):
    """InSS's l_i = a * share + b. ncu measured the L2 throughput on the whole GPU only; a batch moves about the
    same bytes through L2 at any share, so at share s it is l2_full * graph time at 100% / graph time at s
    (solo, batch L2_BATCH), and the line is fitted to those points."""
    import numpy as np

    from tritonctl.errors import TritonctlError

    graph = {
        r["share"]: r["compute_ms"]
        for r in rows
        if r["model"] == name and r["kind"] == "solo" and r["split"] == "train" and r["batch"] == L2_BATCH
    }
    if 100 not in graph or len(graph) < 2:
        raise TritonctlError(
            f"model {name!r}: L2 needs its solo batch-{L2_BATCH} rows at share 100 and one more share, and it has "
            f"shares {sorted(graph)} (measure was cut short: measure again with a longer --deadline-s)"
        )
    shares = sorted(graph)
    a, b = np.polyfit(shares, [l2_full * graph[100] / graph[s] for s in shares], 1)
    return lambda share: float(a * share + b)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m profiler.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("measure", help="on the GPU host: measure everything into a JSON-lines file")
    p.add_argument("--models", required=True, help="name=torchvision_architecture,...")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--deadline-s", type=float, default=540, help="stop after this long (default 540)")
    p = sub.add_parser("assemble", help="here: the JSON-lines file -> a profile folder")
    p.add_argument("raw", type=Path)
    p.add_argument("--cluster", type=Path, required=True)
    p.add_argument("--output", type=Path, required=True)
    p = sub.add_parser("worker")
    p.add_argument("--models", required=True)
    p = sub.add_parser("l2probe")
    p.add_argument("--models", required=True)
    p.add_argument("--batch", type=int, default=L2_BATCH)
    args = parser.parse_args(argv)
    if args.step == "measure":
        measure(args.models, args.out, args.deadline_s, log=lambda s: print(s, flush=True))
    elif args.step == "assemble":
        from tritonctl.errors import TritonctlError

        try:
            assemble(args.raw, args.cluster, args.output)
        except TritonctlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    elif args.step == "worker":
        _worker(parse_models(args.models))
    else:
        _l2_probe(parse_models(args.models), args.batch)


if __name__ == "__main__":
    main()

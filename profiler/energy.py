"""Energy per image over batch size x SM clock on a GPU (EAIS): NVML's total-energy counter around CUDA graph replays.

    python3 -m tritonctl.profiler.energy --models resnet50,mobilenet_v2,efficientnet_b0 -o energy.csv

Runs on the GPU host, as root where clocks are to be locked. Per clock (locked with `nvidia-smi -lgc C,C`; where
the driver refuses, the row says `unlocked` and the clock NVML read instead), per model and batch size: the graph
replayed back to back for `--seconds`, the energy counter (mJ) read before and after; one row with the batch
time (ms, CUDA events) and joules per image. The clocks are reset (`nvidia-smi -rgc`) at the end, also on error.
The model is built as the GPU profiler builds it (`profiler/gpu.py`): seeded torchvision weights, fp32 with TF32
math, one CUDA graph per batch size, on the whole GPU.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from tritonctl.deploy.gpu import lock, reset

from .gpu import _build, _setup_torch

FIELDS = [
    "model",
    "batch",
    "clock_mhz",
    "locked",
    "sm_clock_read_mhz",
    "batch_ms",
    "images_per_s",
    "joules_per_image",
    "avg_power_w",
]


def measure(models: list[str], batches: list[int], clocks: list[int], seconds: float, out: Path, log=print) -> None:
    import pynvml

    torch = _setup_torch()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    # (model, batch) -> (graph, static input, static output, module): what a graph reads lives as long as it does.
    # Captured on an input of zeros, as the committed sweep was (profiler/gpu.py's capture draws a random one).
    graphs = {}
    with torch.inference_mode():
        for name in models:
            module = _build(torch, name)
            for b in batches:
                static_in = torch.zeros((b, 3, 224, 224), device="cuda")
                side = torch.cuda.Stream()  # warm-up off the capture's stream, as CUDA graph capture requires
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        module(static_in)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = module(static_in)
                graphs[name, b] = (graph, static_in, static_out, module)
    rows = []
    try:
        for clock in clocks:
            locked = lock(0, clock) is None
            for (name, b), (graph, *_) in graphs.items():
                torch.cuda.synchronize()
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                runs = 0
                e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                t0 = time.perf_counter()
                start.record()
                while time.perf_counter() - t0 < seconds:
                    for _ in range(10):
                        graph.replay()
                    runs += 10
                    torch.cuda.synchronize()
                end.record()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                joules = (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - e0) / 1000
                read = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
                batch_ms = start.elapsed_time(end) / runs
                rows.append(
                    {
                        "model": name,
                        "batch": b,
                        "clock_mhz": clock if locked else read,
                        "locked": int(locked),
                        "sm_clock_read_mhz": read,
                        "batch_ms": round(batch_ms, 4),
                        "images_per_s": round(runs * b / wall, 1),
                        "joules_per_image": round(joules / (runs * b), 6),
                        "avg_power_w": round(joules / wall, 1),
                    }
                )
                log(
                    f"  {name} b{b} @{clock} MHz ({'locked' if locked else 'unlocked'}, read {read}): "
                    f"{batch_ms:.2f} ms/batch, {rows[-1]['joules_per_image'] * 1000:.2f} mJ/image"
                )
    finally:
        reset(0)
        pynvml.nvmlShutdown()
    with out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet50,mobilenet_v2,efficientnet_b0", help="torchvision architectures")
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--clocks", default="1980,1590,1200,900", help="SM clocks to lock, MHz")
    parser.add_argument("--seconds", type=float, default=1.0, help="replay time per point")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    measure(args.models.split(","), ints(args.batches), ints(args.clocks), args.seconds, Path(args.output))


if __name__ == "__main__":
    main()

"""The InSS evaluation setups on this CPU: a latency model SCALED from the CPU profile, and three clusters.

Built before a GPU was lent (bench/inss_gpu.py makes the same setups on the H100 profile measured
since): the eight InSS models get latency models derived from the three profiled ones
(profiles/cpu-demo): each model borrows the fitted model of a profiled architecture of its
family and has its running times scaled by how much slower it measures than that base here,
alone, in onnxruntime on 2 threads (batch 1 and 8, scaled between them in log batch, held
beyond 8). Interference coefficients are the base's; the
memory footprint moves by twice the difference in weights. The result is labelled
SYNTHETIC (scaled) in its metadata: it is no measurement of these models under shares. The
spread of a batch's latency around the prediction (what the simulator draws) is the base's too.

SLOs are InSS's ([25, 80, 150, 50, 60, 40, 60, 200] ms, section 6.1) times one factor: this
CPU's predicted ResNet50 latency at 30% share and batch 1 over InSS Table 2's 8.69 ms. Rates
are a stated load: each model gets an equal part of `load` x the devices' capacity for it
(its best throughput on a whole device with batch latency under SLO / 2).

The eight-model "heavy workload" is one workload for both its 4- and 5-device setups, as in InSS
section 6.3. The paper gives no rates, only that InSS serves it on 4 GPUs with under 1% SLO
violations while Gpulet and GSLICE need 5 to 6. At 4.0 device capacities no policy here stays
under 7%; the load is 3.2, the scale 0.8 of that at which bench/load_sweep.py found a tritonctl
policy under 1% on 4 devices.
bench/results/load-sweep/ shows every policy from 0.6 to 1.2 times this load.

    python bench/inss_scaled.py               # writes profiles/inss-scaled/ and examples/inss-scaled/
    python bench/inss_scaled.py --no-measure  # keeps the committed running times (no measuring): takes
                                              # what is borrowed from the base afresh, writes the clusters
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import yaml

from tritonctl.export import materialize
from tritonctl.latency.model import MAX_BATCH, LatencyModel, load_latency_model
from tritonctl.profiler.graphinfo import graph_info
from tritonctl.spec import load_cluster

REPO = Path(__file__).resolve().parent.parent
SLO_MS = {
    "alexnet": 25,
    "resnet50": 80,
    "vgg16": 150,
    "mnasnet": 50,
    "mobilenet": 60,
    "efficientnet": 40,
    "resnet18": 60,
    "vgg19": 200,
}
BASE = {  # the profiled model each borrows its fitted model from
    "alexnet": "resnet18",
    "resnet50": "resnet18",
    "vgg16": "resnet18",
    "vgg19": "resnet18",
    "resnet18": "resnet18",
    "mnasnet": "mnasnet",
    "efficientnet": "mnasnet",
    "mobilenet": "mobilenet_v2",
}
RESNET50_30PCT_B1_MS = 8.69  # InSS Table 2, observed
CPU_DEVICE = {"kind": "cpu", "cores": 2, "units": 100, "memory_mb": 8192}
ABOUT = (
    "on this CPU, for `tritonctl bench` with\n"
    "# profiles/inss-scaled/latency-model.json (SYNTHETIC: scaled from the CPU profile)."
)
SETUPS = {  # name: (models, devices, load)
    "six-4": (["alexnet", "resnet50", "vgg16", "mnasnet", "mobilenet", "efficientnet"], 4, 0.7),
    "eight-4": (list(SLO_MS), 4, 0.8),
    "eight-5": (list(SLO_MS), 5, 0.64),  # the same rates as eight-4
}


def measure_ms(path: Path, batch: int, repeats: int, threads: int = 2) -> float:
    """Median latency of one batch in onnxruntime on `threads` threads, after a warm-up run."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    session.run(None, {name: x})
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        session.run(None, {name: x})
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def scaled_model(base: LatencyModel, artifacts, base_artifacts, out_dir: Path, repeats: int) -> LatencyModel:
    rows, models = [], {}
    for name, base_name in BASE.items():
        art, base_art = artifacts[name], base_artifacts[base_name]
        if art.sha256 == base_art.sha256:
            k1 = k8 = 1.0
        else:
            k1, k8 = (measure_ms(art.path, b, repeats) / measure_ms(base_art.path, b, repeats) for b in (1, 8))
        rows.append({"model": name, "base": base_name, "factor_b1": round(k1, 3), "factor_b8": round(k8, 3)})
        print(f"  {name:13} from {base_name:13} x{k1:.2f} (batch 1) x{k8:.2f} (batch 8)")
        p = base.models[base_name]
        batches = 2.0 ** np.array(p.lwr_X)[:, 0]
        factor = k1 * (k8 / k1) ** np.clip(np.log2(batches) / 3, 0, 1)
        models[name] = replace(
            p,
            name=name,
            onnx_sha256=art.sha256,
            n_ops=graph_info(art.path).n_ops,
            lwr_y=(np.array(p.lwr_y) * factor).tolist(),
            memory_mb0=p.memory_mb0 + 2 * (art.weights_mb - base_art.weights_mb),
            memory_mb1=p.memory_mb1 * k1,
        )
    with open(out_dir / "scaling.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    meta = {
        "synthetic": "SCALED from profiles/cpu-demo by measured onnxruntime latency (bench/inss_scaled.py); "
        "not a measurement of these models under shares",
        "base_profile": "profiles/cpu-demo",
    }
    return LatencyModel(base.device, models, meta)


def capacity_rps(lm: LatencyModel, name: str, slo_ms: float) -> float:
    """Best throughput on a whole device with the batch's latency under SLO / 2."""
    units = lm.device.units
    return max(
        (1000 * b / t for b in range(1, MAX_BATCH + 1) if (t := lm.t_inf(name, b, units)) <= slo_ms / 2),
        default=0.0,
    )


def write_clusters(lm: LatencyModel, out_dir: Path, device: dict, prefix: str, about: str, generator: str) -> None:
    """The three setups for `lm`: SLOs are InSS's times the factor that maps its Table 2 ResNet50 latency onto
    `lm`'s; rates are each setup's load of the devices' capacity. `device` is the devices entry without count."""
    here = lm.t_inf("resnet50", 1, 30)
    factor = here / RESNET50_30PCT_B1_MS
    print(f"SLO factor: ResNet50 at 30% share, batch 1 predicts {here:.1f} ms here -> x{factor:.2f}")
    gpu_spec = yaml.safe_load((REPO / "examples/inss-gpu/cluster.yaml").read_text())
    sources = {m["name"]: m["source"] for m in gpu_spec["models"]}
    for setup, (names, devices, load) in SETUPS.items():
        slo = {n: round(SLO_MS[n] * factor) for n in names}
        rate = {n: round(load * devices / len(names) * capacity_rps(lm, n, slo[n]), 1) for n in names}
        spec = {
            "name": f"{prefix}-{setup}",
            "devices": [{"kind": device["kind"], "count": devices, **device}],
            "models": [
                {
                    "name": n,
                    "source": sources[n],
                    "input": {"shape": [3, 224, 224]},
                    "slo_ms": slo[n],
                    "rate": rate[n],
                }
                for n in names
            ],
            "runtime": {
                "repository_dir": f"../../model_repository/{prefix}-{setup}",
                "export_dir": "../../model_repository/exports",
                "state_dir": f"../../.tritonctl/{prefix}-{setup}",
                "base_port": 8300,
            },
        }
        header = (
            f"# InSS setup {setup} ({len(names)} models, {devices} devices) {about}\n"
            f"# Generated by {generator}: SLOs = InSS's x {factor:.2f}; rates = load {load} of capacity.\n"
        )
        path = out_dir / f"{setup}.yaml"
        path.write_text(header + yaml.safe_dump(spec, sort_keys=False, width=120))
        print(f"  {path}: load {load}, rates {rate}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per model and batch (default 5)")
    parser.add_argument(
        "--no-measure",
        action="store_true",
        help="keep the committed running times; take the latency spread from the base again; write the clusters",
    )
    args = parser.parse_args()
    model_dir = REPO / "profiles/inss-scaled"
    clusters = REPO / "examples/inss-scaled"
    base = load_latency_model(REPO / "profiles/cpu-demo/latency-model.json")
    if args.no_measure:
        lm = load_latency_model(model_dir / "latency-model.json")
        for name, p in lm.models.items():
            p.spread = base.models[BASE[name]].spread
        lm.save(model_dir / "latency-model.json")
        write_clusters(lm, clusters, CPU_DEVICE, "inss", ABOUT, "bench/inss_scaled.py")
        return
    artifacts = materialize(load_cluster(REPO / "examples/inss-gpu/cluster.yaml"), log=lambda _: None)
    base_artifacts = materialize(load_cluster(REPO / "examples/cpu-demo/cluster.yaml"), log=lambda _: None)
    model_dir.mkdir(parents=True, exist_ok=True)
    print("scaling the CPU profile to the InSS models:")
    lm = scaled_model(base, artifacts, base_artifacts, model_dir, args.repeats)
    lm.save(model_dir / "latency-model.json")
    clusters.mkdir(parents=True, exist_ok=True)
    write_clusters(lm, clusters, CPU_DEVICE, "inss", ABOUT, "bench/inss_scaled.py")


if __name__ == "__main__":
    main()

"""The InSS evaluation setups on the measured H100 profile (profiles/inss-gpu), for `tritonctl bench`.

The same three setups as bench/inss_scaled.py (six models on 4 GPUs, eight on 4 and on 5), built the
same way, on the latency model fitted to real H100 measurements under MPS shares (profiler/gpu.py)
instead of the scaled CPU one. The H100 runs these models several times faster than the
GPU of InSS's Table 2 (ResNet50 at 30%, batch 1: 8.69 ms there), so the SLOs are scaled by the same
rule, which keeps each setup as tight relative to its hardware as the paper's. Each device gets the
H100's memory; the footprints are the models' weights and activations, without the CUDA context
of each MPS client (not measured).

    python bench/inss_gpu.py    # writes examples/inss-gpu/{six-4,eight-4,eight-5}.yaml
"""

from __future__ import annotations

from inss_scaled import REPO, write_clusters

from tritonctl.latency.model import load_latency_model

GPU_DEVICE = {"kind": "gpu", "units": 100, "memory_mb": 81559}
ABOUT = (
    "on an H100, for `tritonctl bench` with\n"
    "# profiles/inss-gpu/latency-model.json (measured on an H100 under MPS shares, profiler/gpu.py)."
)


def main() -> None:
    lm = load_latency_model(REPO / "profiles/inss-gpu/latency-model.json")
    write_clusters(lm, REPO / "examples/inss-gpu", GPU_DEVICE, "inss-gpu", ABOUT, "bench/inss_gpu.py")


if __name__ == "__main__":
    main()

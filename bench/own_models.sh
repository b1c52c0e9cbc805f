#!/usr/bin/env bash
# Models of your own, as a new user brings them (examples/own-models: an ONNX text model with int64 token ids and
# a dynamic sequence length, and a torchvision model taking its images as bytes): `tritonctl profile`, `fit
# --report`, `plan` (search), `apply`, then DURATION seconds (default 20) of the planned rates from tritonctl's
# client and from NVIDIA perf_analyzer, one after the other, and `down`. The profile, its fit report and the plan
# land in OUT (default bench/results/own-models/<CPU id>). Run on a quiet machine.
#     bash bench/own_models.sh | tee bench/results/own-models/<CPU id>.txt
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
id=$(python -c 'from tritonctl.latency.device import cpu_fingerprint; print(cpu_fingerprint()["id"])')
out=${OUT:-bench/results/own-models/$id}
mkdir -p "$out"
python -c 'from tritonctl.latency.device import cpu_fingerprint
c = cpu_fingerprint(); k = c["caches"]
print("# on", c["model"], "L1d", k.get("L1 Data"), "/ L2", k.get("L2 Unified"), "CPU id", c["id"])'
cluster=examples/own-models/cluster.yaml
tritonctl profile "$cluster" -o "$out/profile"
tritonctl fit "$out/profile" -o "$out/latency-model.json" --report
tritonctl plan "$cluster" --latency-model "$out/latency-model.json" -o "$out/plan.yaml"
tritonctl apply "$out/plan.yaml"
trap 'tritonctl down "$out/plan.yaml"' EXIT
for tool in tritonctl perf_analyzer; do
    tritonctl load "$out/plan.yaml" --tool "$tool" --duration "${DURATION:-20}"
done

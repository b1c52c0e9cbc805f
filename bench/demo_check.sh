#!/usr/bin/env bash
# The README's main job, checked by an independent load generator: `make demo` (calibrate on another CPU, plan,
# apply on the local Triton, 10 s of tritonctl's client), then the deployment it leaves running loaded for
# DURATION seconds (default 30) at its planned rates by NVIDIA perf_analyzer and by tritonctl's client, one after
# the other. Run from a fresh clone on a quiet machine; `make down` stops the deployment afterwards.
#     bash bench/demo_check.sh | tee bench/results/demo/<machine>.txt
set -euo pipefail
cd "$(dirname "$0")/.."
make demo
.venv/bin/python -c 'from tritonctl.latency.device import cpu_fingerprint
c = cpu_fingerprint(); k = c["caches"]
print("# on", c["model"], "L1d", k.get("L1 Data"), "/ L2", k.get("L2 Unified"), "CPU id", c["id"])'
for tool in perf_analyzer tritonctl; do
    .venv/bin/tritonctl load examples/cpu-demo/plan.yaml --tool "$tool" --duration "${DURATION:-30}"
done

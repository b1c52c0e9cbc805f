#!/usr/bin/env bash
# Plans from profiles made on the CPU they run on, not calibrated from another: the five benchmark clusters, each
# profiled on the 32 KB L1d AMD EPYC VM (bench/results/profiles-epyc-32k/, `tritonctl profile` and `tritonctl fit`;
# as `tritonctl profile` measures now, leaving out what no plan can use, except random-0-1's), each deployed
# hand-written, naive and best (re-planned per scale) at the rates of bench/results/overload/<cluster>/cluster.yaml,
# under perf_analyzer and tritonctl's client. Quiet machine, on the CPU the profiles were made on (real_load.py says
# which): about 12 minutes a cluster; a cluster with results in OUT is skipped (delete its folder to measure again).
#     bash bench/native.sh [OUT]     # OUT defaults to bench/results/native
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-results/native}
for pair in torchvision-four:torchvision-four-limited random-0-1:random-0-1 cpu-demo:cpu-demo-limited \
    random-0-0:random-0-0-limited random-0-2:random-0-2-limited; do
    name=${pair%%:*} profile=${pair#*:}
    [ -f "$out/$name/summary.md" ] && continue
    python real_load.py "results/overload/$name/cluster.yaml" \
        --latency-model "results/profiles-epyc-32k/$profile/latency-model.json" \
        --out "$out/$name" --scales 1 2 3 4 --duration 12 \
        --deployments handwritten naive best-replan --tools perf_analyzer tritonctl
done

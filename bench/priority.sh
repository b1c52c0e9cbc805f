#!/usr/bin/env bash
# Deadline-monotonic CPU weights against the hand-written deployment and the same plans weighing alike, on the
# five clusters calibrated for the slow AMD EPYC VM (bench/results/overload/*), each under perf_analyzer (random-0-1
# also under tritonctl's client and beside the naive plan). Two more passes add, keeping the earlier rows
# (--add): the naive plan on the other four, and the best plan with the lightest instance on a thread per
# core (devices[].turn_threads: lightest) on all five. Then the demo twice more, weights alone and lightest side
# by side in each run (cpu-demo-lightest-1, -2). Quiet machine: about 90 minutes.
#     bash bench/priority.sh [OUT]     # OUT defaults to bench/results/priority
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-results/priority}
run() {  # cluster, then real_load.py's own options
    local name=$1; shift
    python real_load.py "results/overload/$name/cluster.yaml" \
        --latency-model "results/overload/$name/latency-model-calibrated.json" \
        --out "$out/$name" --scales 1 2 3 4 --duration 12 "$@"
}
run random-0-1 --deployments handwritten naive best-replan best-replan-equal --tools perf_analyzer tritonctl
for name in random-0-0 random-0-2 torchvision-four cpu-demo; do
    run "$name" --deployments handwritten best-replan best-replan-equal --tools perf_analyzer
done
for name in random-0-0 random-0-2 torchvision-four cpu-demo; do
    run "$name" --deployments naive --tools perf_analyzer --add
done
run random-0-1 --deployments best-replan-lightest --tools perf_analyzer tritonctl --add
for name in random-0-0 random-0-2 torchvision-four cpu-demo; do
    run "$name" --deployments best-replan-lightest --tools perf_analyzer --add
done
for k in 1 2; do
    python real_load.py results/overload/cpu-demo/cluster.yaml \
        --latency-model results/overload/cpu-demo/latency-model-calibrated.json --out "$out/cpu-demo-lightest-$k" \
        --scales 1 2 3 4 --duration 12 --deployments best-replan best-replan-lightest --tools perf_analyzer
done

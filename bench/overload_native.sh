#!/usr/bin/env bash
# Goodput beyond capacity on the benchmark clusters, each planned from a profile made on the CPU it runs on
# (bench/results/profiles-epyc-32k/, `tritonctl profile` as it measures now and `tritonctl fit`; the two clusters
# not yet profiled there are profiled first), the naive and the best plan as tritonctl deploys them by default
# (overloaded instances refuse what can only be late), from half to six times the load `search` plans within
# every SLO, with tritonctl's client (bench/overload.py). Quiet machine, on the CPU the profiles were made on
# (overload.md says which): about an hour with the two profiles, 30 minutes without; a cluster with results in OUT
# is skipped (delete its folder to measure it again). 1x is the largest multiple of 0.05 of the cluster's rates that
# `search` plans within every SLO (the demo), else the reference load of bench/results/overload/: by their profiles
# search plans the four models within every SLO at 0.05x only (it overestimates ResNet18 at 0.4x), and neither
# random-0-0 nor random-0-2 at any multiple of 0.05 (their 19-20 ms SLOs).
#     bash bench/overload_native.sh [OUT]     # OUT defaults to bench/results/overload-native
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-results/overload-native}
profiles=results/profiles-epyc-32k
for spec in cpu-demo:../examples/cpu-demo/cluster.yaml: \
    torchvision-four:../examples/torchvision-four/cluster.yaml:0.4 \
    random-0-0:results/real-load/random/random-0-0.yaml:0.05 \
    random-0-2:results/real-load/random/random-0-2.yaml:0.05; do
    IFS=: read -r name cluster scale <<<"$spec"
    profile=$profiles/$name-limited
    [ -f "$out/$name/overload.md" ] && continue
    if [ ! -f "$profile/latency-model.json" ]; then
        python -m tritonctl profile "$cluster" -o "$profile"
        python -m tritonctl fit "$profile" --report
    fi
    python overload.py "$cluster" --latency-model "$profile/latency-model.json" --out "$out/$name" \
        ${scale:+--rate-scale "$scale"} --scales 0.5 1 2 3 4 6 --duration 12 --deployments naive best
done

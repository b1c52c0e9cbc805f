#!/usr/bin/env bash
# On a GPU host with Python 3.12, PyTorch and torchvision but no network: run a bench script (gpu_triton.py,
# gpu_energy.py) with what `make gpu-pack` put in .gpu/ (the trimmed Triton, the wheels tritonctl needs beyond
# the host's, HAProxy).
#     bash bench/gpu_host.sh SCRIPT OUT [the script's flags]
set -euo pipefail
script=${1:?usage: bash bench/gpu_host.sh SCRIPT OUT [flags]}
out=${2:?usage: bash bench/gpu_host.sh SCRIPT OUT [flags]}
shift 2
cd "$(dirname "$0")/.."
site=/tmp/tritonctl-site triton=/tmp/tritonctl-triton haproxy=/tmp/tritonctl-haproxy
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/whl/*.whl
mkdir -p "$triton" "$haproxy"
tar -xJf .gpu/triton.tar.xz -C "$triton"
for deb in .gpu/deb/*.deb; do dpkg -x "$deb" "$haproxy"; done
# The Python backend passes tensors through /dev/shm: a batch of 32 images is 19 MB per direction.
shm_mb=$(df -m --output=size /dev/shm | tail -1)
if [ "$shm_mb" -lt 4096 ]; then mount -o remount,size=8G /dev/shm || echo "note: /dev/shm is ${shm_mb} MB"; fi
export PYTHONPATH="$site:$PWD" PATH="$triton/tritonserver/bin:$haproxy/usr/sbin:$PATH"
export LD_LIBRARY_PATH="$haproxy/usr/lib/x86_64-linux-gnu" TRITONCTL_PERF_ANALYZER="$triton/tritonserver/bin/perf_analyzer"
exec python3 "bench/$script" -o "$out" "$@"

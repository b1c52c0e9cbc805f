#!/usr/bin/env bash
# Does a newer HAProxy cost less CPU per request? Debian 12's HAProxy 2.6 against 3.0 built from Debian 13's
# source (each as `apply` starts it: 256 KB buffers for 2.6, 1 MB from 3.0, the glibc settings with either; 3.0 forwards
# without user-space copies where it can),
# each loading the CPU demo through bench/proxy_overhead.py, alternately, twice each. Quiet machine; about
# 15 minutes with the build.
#     bash bench/haproxy_versions.sh [OUT]    # OUT defaults to bench/results/proxy-versions/<cpu id>.txt
set -euo pipefail
cd "$(dirname "$0")/.."
version=3.0.11
build=${TMPDIR:-/tmp}/tritonctl-haproxy-$version
if [ ! -x "$build/haproxy" ]; then
    mkdir -p "$build"
    curl -sSf "http://deb.debian.org/debian/pool/main/h/haproxy/haproxy_$version.orig.tar.gz" |
        tar xz -C "$build" --strip-components=1
    make -C "$build" -j"$(nproc)" TARGET=linux-glibc USE_OPENSSL= USE_LUA= USE_PCRE2= USE_ZLIB= USE_PROMEX=1 >/dev/null
fi
export PATH=$PWD/.venv/bin:$PATH PYTHONPATH=.:bench
cpu=$(python -c "from tritonctl.latency.device import cpu_fingerprint as f; c = f(); print(c['id'])")
out=${1:-bench/results/proxy-versions/$cpu.txt}
mkdir -p "$(dirname "$out")"
{
    echo "# bash bench/haproxy_versions.sh: python bench/proxy_overhead.py --duration 30 --rounds 2 --rate-scale 0.15"
    echo "# --tool tritonctl under each HAProxy, alternately; $(lscpu | grep -m1 'Model name' | tr -s ' '), CPU id $cpu"
    for run in 1 2; do
        for haproxy in /usr/sbin "$build"; do
            echo "== $("$haproxy/haproxy" -v | head -1)"
            PATH=$haproxy:$PATH python bench/proxy_overhead.py --duration 30 --rounds 2 --rate-scale 0.15 \
                --tool tritonctl | tail -6
        done
    done
} | tee "$out"

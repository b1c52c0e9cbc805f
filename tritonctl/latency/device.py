"""Device fingerprint and software versions, recorded with every profile."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime

from tritonctl.errors import TritonctlError


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _caches() -> dict[str, str]:
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            caches[f"L{level} {kind}"] = (index / "size").read_text().strip()
        except OSError:
            continue
    return caches


def cpu_fingerprint() -> dict:
    """What identifies this CPU for latency purposes; `id` is a short hash of the rest."""
    info = {"kind": "cpu", "model": _cpu_model(), "logical_cpus": os.cpu_count(), "caches": _caches()}
    info["id"] = hashlib.sha256(repr(sorted(info.items())).encode()).hexdigest()[:12]
    return info


def busy_cores(seconds: float = 1.0) -> float:
    """How many of this machine's cores were busy (not idle, not waiting for I/O) over the next `seconds`."""

    def sample() -> tuple[int, int]:
        ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    if total1 == total0:
        return 0.0
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / (total1 - total0))


def software_versions(tritonserver: str) -> dict[str, str]:
    from tritonctl import __version__

    return {
        "tritonserver": tritonserver,
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "kernel": platform.release(),
        "tritonctl": __version__,
    }


def gpu_fingerprint(index: int = 0) -> dict:
    """What identifies a GPU of this host for latency purposes (nvidia-smi's name, driver and memory); `id` is a
    short hash of the rest."""
    query = ["nvidia-smi", f"--id={index}", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TritonctlError(f"cannot read GPU {index}'s name with nvidia-smi: {exc}") from None
    fields = [f.strip() for f in done.stdout.strip().split(",")]
    if done.returncode != 0 or len(fields) != 3:
        raise TritonctlError(f"nvidia-smi could not describe GPU {index}: {(done.stderr or done.stdout).strip()[:200]}")
    info = {"kind": "gpu", "model": fields[0], "driver": fields[1], "memory": fields[2]}
    info["id"] = hashlib.sha256(repr(sorted(info.items())).encode()).hexdigest()[:12]
    return info


def visible_gpu() -> dict | None:
    """`gpu_fingerprint` of this host's first GPU; None where nvidia-smi is missing or sees none."""
    try:
        return gpu_fingerprint(0)
    except TritonctlError:
        return None

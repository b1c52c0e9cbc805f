"""A local GPU deployment's SM clocks (locked with nvidia-smi, as the energy objective chose) and its energy
counter (NVML's total energy, millijoules since the driver loaded).

Clocks are locked before any instance starts and reset at `down`; the GPUs tritonctl locked are kept in the
state folder, so a plan without clocks applied over one with them resets them. A clock the driver refuses stops
the apply before anything starts, with the GPUs it had locked reset.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tritonctl.errors import TritonctlError
from tritonctl.planning.plan import Device

RECORD = "clocks.json"  # in the state folder: GPU index -> the SM clock tritonctl locked (MHz)


def _smi(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise TritonctlError(
            "nvidia-smi is not installed: a plan with SM clocks needs the NVIDIA driver's tools"
        ) from None


def _reset(index: int) -> None:
    _smi("-i", str(index), "-rgc")


def _read(state_dir: Path) -> dict[int, int]:
    path = state_dir / RECORD
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def _write(state_dir: Path, locked: dict[int, int]) -> None:
    path = state_dir / RECORD
    if locked:
        state_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(locked) + "\n")
    else:
        path.unlink(missing_ok=True)


def lock_commands(devices: list[Device]) -> list[str]:
    """The nvidia-smi commands `lock_clocks` runs for these devices (for a dry run)."""
    return [
        f"nvidia-smi -i {d.index} -lgc {d.clock_mhz},{d.clock_mhz}" for d in devices if d.kind == "gpu" and d.clock_mhz
    ]


def lock_clocks(state_dir: Path, devices: list[Device]) -> dict[int, int]:
    """Lock each GPU with a `clock_mhz` at it, reset those tritonctl locked that have none now; the GPUs locked."""
    wanted = {d.index: d.clock_mhz for d in devices if d.kind == "gpu" and d.clock_mhz is not None}
    before = _read(state_dir)
    for index in sorted(set(before) - set(wanted)):
        _reset(index)
    done: dict[int, int] = {}
    for index, mhz in sorted(wanted.items()):
        answer = _smi("-i", str(index), "-lgc", f"{mhz},{mhz}")
        if answer.returncode != 0 or "set to" not in answer.stdout:
            for locked in done:
                _reset(locked)
            _write(state_dir, {})
            said = (answer.stderr or answer.stdout).strip().splitlines()
            raise TritonctlError(
                f"the driver refused to lock GPU {index} at {mhz} MHz ({said[0] if said else answer.returncode}); "
                "locking clocks needs root and a GPU that allows it (nvidia-smi -lgc); nothing was started",
                field="devices.clock_mhz",
            )
        done[index] = mhz
    _write(state_dir, done)
    return done


def release_clocks(state_dir: Path) -> None:
    """At `down`: reset every GPU clock tritonctl locked for the deployment."""
    for index in _read(state_dir):
        _reset(index)
    _write(state_dir, {})


def energy_mj(indices: list[int]) -> float | None:
    """The GPUs' total-energy counters summed (mJ); None without NVML, a GPU or the counter."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return float(
            sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices)
        )
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()

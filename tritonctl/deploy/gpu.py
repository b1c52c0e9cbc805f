"""What the NVIDIA driver tells and sets for tritonctl: the GPUs NVML sees, their energy counter (NVML's total
energy, millijoules since the driver loaded), and SM clocks locked with nvidia-smi (the energy objective's, and
the energy sweep's).

Clocks are locked before any instance starts and reset at `down`; the GPUs tritonctl locked are kept in the
state folder, so a plan without clocks applied over one with them resets them. A clock the driver refuses stops
the apply before anything starts, with the GPUs it had locked reset.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tritonctl.errors import TritonctlError

if TYPE_CHECKING:  # the energy sweep imports this module on a GPU host that may lack the plan's dependencies
    from tritonctl.planning.plan import Device

RECORD = "clocks.json"  # in the state folder: GPU index -> the SM clock tritonctl locked (MHz)


def _smi(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise TritonctlError(
            "nvidia-smi is not installed: a plan with SM clocks needs the NVIDIA driver's tools"
        ) from None


def lock(index: int, mhz: int) -> str | None:
    """Lock GPU `index`'s SM clock at `mhz`: None once locked, else what the driver said."""
    answer = _smi("-i", str(index), "-lgc", f"{mhz},{mhz}")
    if answer.returncode == 0 and "set to" in answer.stdout:
        return None
    said = (answer.stderr or answer.stdout).strip().splitlines()
    return said[0] if said else f"exit {answer.returncode}"


def reset(index: int) -> None:
    """Give GPU `index`'s SM clock back to the driver."""
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
        reset(index)
    done: dict[int, int] = {}
    for index, mhz in sorted(wanted.items()):
        refused = lock(index, mhz)
        if refused is not None:
            for locked in done:
                reset(locked)
            _write(state_dir, {})
            raise TritonctlError(
                f"the driver refused to lock GPU {index} at {mhz} MHz ({refused}); "
                "locking clocks needs root and a GPU that allows it (nvidia-smi -lgc); nothing was started",
                field="devices.clock_mhz",
            )
        done[index] = mhz
    _write(state_dir, done)
    return done


def release_clocks(state_dir: Path) -> None:
    """At `down`: reset every GPU clock tritonctl locked for the deployment."""
    for index in _read(state_dir):
        reset(index)
    _write(state_dir, {})


@contextlib.contextmanager
def _nvml() -> Iterator:
    """pynvml, initialised for the block; None without pynvml, a driver or a GPU."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def gpu_count() -> int | None:
    """GPUs NVML sees on this machine; None without pynvml, a driver or a GPU."""
    with _nvml() as nvml:
        return None if nvml is None else nvml.nvmlDeviceGetCount() or None


def energy_mj(indices: list[int]) -> float | None:
    """The GPUs' total-energy counters summed (mJ); None without NVML, a GPU or the counter."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            return float(
                sum(nvml.nvmlDeviceGetTotalEnergyConsumption(nvml.nvmlDeviceGetHandleByIndex(i)) for i in indices)
            )
        except nvml.NVMLError:
            return None

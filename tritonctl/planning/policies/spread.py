"""The plain policy: spread models over devices, split each device equally, batch 1."""

from __future__ import annotations

from tritonctl.latency.model import LatencyModel
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand, PlacementError


def spread(models: list[Demand], devices: list[Device], lm: LatencyModel | None = None) -> dict[str, list[Choice]]:
    """Place the largest models first, each on the least-loaded device it fits on (no latency model needed)."""
    free = {d.id: d.memory_mb for d in devices}
    hosted: dict[str, list[str]] = {d.id: [] for d in devices}
    for model in sorted(models, key=lambda m: (-m.memory_mb, m.name)):
        fits = [d for d in devices if free[d.id] >= model.memory_mb]
        if not fits:
            raise PlacementError(
                f"model {model.name!r} ({model.memory_mb} MB) fits on no device: "
                f"free memory is {', '.join(f'{k} {v} MB' for k, v in free.items())}"
            )
        best = min(fits, key=lambda d: (len(hosted[d.id]), -free[d.id], d.index))
        free[best.id] -= model.memory_mb
        hosted[best.id].append(model.name)
    choices: dict[str, list[Choice]] = {}
    for device in devices:
        names = hosted[device.id]
        if len(names) > device.units:
            raise PlacementError(f"{len(names)} models on {device.id} but it has only {device.units} units to share")
        for k, name in enumerate(names):
            share = device.units // len(names) + (1 if k < device.units % len(names) else 0)
            choices[name] = [Choice(device=device.id, share=share)]
    return choices

"""The latency model with one of its parts switched off, to show what each part is worth (`tritonctl bench
--ablate`): a plan made with the ablated model is simulated against the whole one.

- no interference (InSS-ni): no cache-pressure, scheduling or CPU-contention terms, each model as if alone;
- no wake-up: an idle instance's first batch costs nothing extra;
- linear instead of LWR: the running time alone a single linear fit in (log2 batch, log share) per model
  (locally weighted regression of degree 1 with a kernel far wider than the data, which weighs every point
  alike);
- no queueing model: a task takes its batch's time alone (`queueing.without_queueing`, around the planning;
  the queueing model is the planner's, so this one is a context rather than a model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tritonctl.latency.model import LatencyModel

WIDE = 1e6  # an LWR bandwidth this many feature ranges wide is one global weighted linear fit


def _rebuilt(lm: LatencyModel, device=None, **changes) -> LatencyModel:
    params = {name: dataclasses.replace(p, **changes) for name, p in lm.models.items()}
    return LatencyModel(device or lm.device, params, {**lm.meta, "ablated": True})


def no_interference(lm: LatencyModel) -> LatencyModel:
    device = dataclasses.replace(lm.device, sched_a=0.0, sched_b=0.0, contention=0.0)
    return _rebuilt(lm, device, alpha_cache=0.0)


def no_wake(lm: LatencyModel) -> LatencyModel:
    return _rebuilt(lm, wake=())


def linear_running_time(lm: LatencyModel) -> LatencyModel:
    return _rebuilt(lm, lwr_bandwidth=WIDE, lwr_degree=1)


ABLATIONS: dict[str, Callable[[LatencyModel], LatencyModel]] = {
    "no interference (InSS-ni)": no_interference,
    "no wake-up term": no_wake,
    "linear instead of LWR": linear_running_time,
}

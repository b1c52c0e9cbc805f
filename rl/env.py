"""The GPU-provisioning MDP of InSS (section 5.2) as a gymnasium environment, on the fitted latency model.

State, action and reward (eq. 3) are those of `tritonctl.planning.policies.inss`, through which the trained
policy acts online: memory used per device by the previous decision, arrival rate and queued work per
model; per model a device and a share level or a way of taking turns; inside a step the batch sizes are
decided as `search` decides them (BDA, Algorithm 1, on split devices), then normalised goodput minus 100 x
the share of requests missing the SLO, placements that overflow memory missing all of them. The previous
decision is observed with its devices taken in turns seen as whole devices.

Rates change: each episode draws a factor per model uniformly in [rate_low, rate_high] of the cluster's
rate, and each step moves it by a log-normal jitter (clipped to what the observation can show). Some
episodes leave models out (rate 0, not placed, their heads ignored), as the planner does when it sheds a
model the devices cannot carry: the policy then decides for the others. Between steps, as online, BDA
first re-decides the batches of the previous placement at the new rates; the state is observed after.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import gymnasium as gym
import numpy as np

from tritonctl.latency.model import LatencyModel
from tritonctl.planning.plan import Device
from tritonctl.planning.policies.base import Choice, Demand
from tritonctl.planning.policies.bda import bda
from tritonctl.planning.policies.inss import (
    PENALTY,
    RATE_HEADROOM,
    SHARE_LEVELS,
    Layout,
    action_mask,
    current_placement,
    decode,
    observe,
    outcome,
    peak_rps,
    propose,
    undeployed,
)
from tritonctl.planning.policies.search import TURNS, Judge


@dataclass(frozen=True)
class EnvConfig:
    """Episode shape, workload dynamics and the reward's penalty."""

    steps: int = 50
    """Decisions per episode (Table 1 has 200; shorter episodes give more varied rates per minute of training)."""
    penalty: float = PENALTY
    """omega of eq. 3: the weight of a model's SLO-violation share against its normalised throughput (6.1)."""
    rate_low: float = 0.5
    """Lowest per-episode rate factor of a model (times the cluster's rate)."""
    rate_high: float = 1.2
    """Highest per-episode rate factor."""
    rate_jitter: float = 0.1
    """Standard deviation of the per-step log-normal change of a model's rate."""
    levels: int = SHARE_LEVELS
    """Share levels per device (level l is (l + 1) / levels of its units), before the ways of taking turns."""
    absent: float = 0.3
    """Probability that an episode leaves out models: between 1 and half of them, chosen at random."""


class InssEnv(gym.Env):
    """One cluster's provisioning MDP; `action_masks()` (and info["action_mask"]) gives the allowed choices."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        cluster: str,
        demands: list[Demand],
        devices: list[Device],
        lm: LatencyModel,
        config: EnvConfig | None = None,
    ):
        self.config = config or EnvConfig()
        self.demands, self.devices, self.lm = list(demands), list(devices), lm
        self.layout = Layout.of(cluster, self.demands, self.devices, self.config.levels)
        self.peak = peak_rps(self.demands, self.devices, lm)
        self.mask = action_mask(self.layout, self.demands, lm)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (self.layout.obs_dim,), np.float32)
        self.action_space = gym.spaces.MultiDiscrete(self.layout.heads)
        self.factors = np.ones(len(self.demands))
        self.present = np.ones(len(self.demands), bool)
        self.t = 0
        self.placement: dict[str, Choice] = {}

    def action_masks(self) -> np.ndarray:
        return self.mask.copy()

    def current_demands(self) -> list[Demand]:
        """The models in this episode at their current rates."""
        scaled = zip(self.demands, self.factors, self.present, strict=True)
        return [replace(d, rate=d.rate * f) for d, f, here in scaled if here]

    def _observe(self) -> np.ndarray:
        """BDA re-decides the previous placement's batches at the current rates; the state is seen after."""
        demands = self.current_demands()
        decision = bda(self.placement, demands, self.devices, self.lm)
        return observe(self.layout, self.placement, decision.batches, demands, self.lm, undeployed(decision))

    def planning_reward(self, act) -> float:
        """Eq. 3's reward of the decision `act(state, mask)` takes where `tritonctl plan` asks for one: every model
        at the cluster's own rate, spread's placement current."""
        current = current_placement(self.demands, self.devices, self.lm)
        placement = propose(act, self.layout, current, self.demands, self.devices, self.lm)
        judged = Judge(self.demands, self.devices, self.lm)(placement)
        return outcome(judged, self.demands, self.peak, self.config.penalty).reward

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        cfg = self.config
        n = len(self.demands)
        self.factors = self.np_random.uniform(cfg.rate_low, cfg.rate_high, n)
        self.present = np.ones(n, bool)
        if n > 1 and self.np_random.random() < cfg.absent:
            self.present[self.np_random.choice(n, self.np_random.integers(1, n // 2 + 1), replace=False)] = False
        self.t = 0
        self.placement = current_placement(self.current_demands(), self.devices, self.lm)
        return self._observe(), {"action_mask": self.action_masks()}

    def step(self, action):
        demands = self.current_demands()
        placement = decode(action, self.layout, demands, self.devices)
        judged = Judge(demands, self.devices, self.lm)(placement)
        result = outcome(judged, demands, self.peak, self.config.penalty)
        units = {d.id: d.units for d in self.devices}
        self.placement = {
            n: Choice(s.device, units[s.device] if s.share == TURNS else s.share) for n, s in placement.items()
        }
        info = {
            "action_mask": self.action_masks(),
            "throughput": sum(result.throughput.values()),
            "violation": sum(result.violation[d.name] * d.rate for d in demands) / sum(d.rate for d in demands),
            "goodput_rps": sum(judged.served.values()),
        }
        self.t += 1
        jitter = self.np_random.normal(0.0, self.config.rate_jitter, len(self.demands))
        self.factors = np.clip(self.factors * np.exp(jitter), 0.05, RATE_HEADROOM)
        return self._observe(), float(result.reward), False, self.t >= self.config.steps, info

"""SAC-Discrete for a factorised discrete action: the scheduler TS of InSS (section 5.4, Algorithm 2, Table 1).

One file, top to bottom, CleanRL style: hyper-parameters, networks, replay buffer, then the agent whose
`update` a training loop calls once per environment step.

The action is factorised: one categorical decision per *head*, `heads` giving their sizes (for InSS, per
model a device head and a share-level head; nothing here assumes that). Given the state the heads are
independent, pi(a|s) = prod_h pi_h(a_h|s), so the joint entropy is the sum of the heads' entropies.

Invalid actions are masked. A mask is a boolean vector of length sum(heads), the per-head masks concatenated
(the MultiDiscrete convention of sb3-contrib's MaskablePPO), True = allowed; rows of them for a batch.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tritonctl.planning.policies.actor import Actor, check_mask, save_actor, trunk


@dataclass
class SACConfig:
    """Hyper-parameters. Defaults are InSS Table 1 (and section 6.1) unless a field says otherwise."""

    hidden_sizes: tuple[int, ...] = (512, 256)
    """Hidden layers (ReLU) of the actor and of each critic: 512 and 256 in InSS section 6.1."""
    actor_lr: float = 1e-4
    """Adam learning rate of the actor (Table 1, l_pi)."""
    critic_lr: float = 1e-4
    """Adam learning rate of the two critics (Table 1, l_Q)."""
    alpha_lr: float = 1e-4
    """Adam learning rate of the temperatures (Table 1, l_tau)."""
    gamma: float = 0.99
    """Discount factor (Table 1)."""
    tau: float = 0.01
    """Soft update factor of the target critics, theta' <- tau theta + (1 - tau) theta' (Table 1's kappa)."""
    batch_size: int = 100
    """Transitions per update (Table 1, mini-batch size)."""
    buffer_size: int = 10_000
    """Replay buffer capacity (Table 1)."""
    init_alpha: float = 1.0
    """Initial temperature of every head (Table 1, initial temperature)."""
    target_entropy_scale: float = 0.6
    """Target entropy of head h = scale * log(heads[h]), a fraction of that head's maximum entropy.
    Not Table 1: its -log(1 + iota) is negative, below any discrete entropy, so the temperature could only
    shrink towards 0 at a pace set by its learning rate. SAC-Discrete (Christodoulou 2019) uses 0.98, which
    holds every head almost uniform (alpha grows until it is); 0.6 keeps exploring yet lets a head settle on
    a clear choice (a two-way head at target puts about 0.85 on its preferred action), which matters since
    the deployed scheduler acts greedily."""
    learning_starts: int = 1_000
    """Environment steps collected before the first update (read by the training loop; not in Table 1)."""
    update_frequency: int = 1
    """Environment steps between updates (read by the training loop; Algorithm 2 updates every step)."""
    actor_delay: int = 0
    """Updates that move only the critics before the actor and the temperatures move too (not in InSS): an actor
    trained beforehand is then first judged by critics that have learnt its values, not by random ones."""
    seed: int = 0
    """Seeds torch (network initialisation) and the agent's numpy Generator (sampling actions and replay)."""


class QNetwork(nn.Module):
    """A factorised critic: a shared trunk, then per head h the values Q_h(s, a_h) of its actions.

    The joint value is additive, Q(s, a) = sum_h Q_h(s, a_h): a joint critic over prod(heads) actions is
    intractable, and with a factorised policy the soft value then splits exactly,
    V(s) = sum_h E_{a_h ~ pi_h}[Q_h(s, a_h) - alpha_h log pi_h(a_h|s)], and so does the actor loss. The
    price: how one head's choice changes another's value (two models on one device) is seen only through
    the state and through the other heads' current policy, not as an explicit interaction term.
    """

    def __init__(self, obs_dim: int, heads: list[int], hidden_sizes: tuple[int, ...]):
        super().__init__()
        self.trunk = trunk(obs_dim, hidden_sizes)
        self.heads = nn.ModuleList(nn.Linear((obs_dim, *hidden_sizes)[-1], n) for n in heads)

    def forward(self, obs: Tensor) -> list[Tensor]:
        """Per-head Q values, each (batch, heads[h])."""
        x = self.trunk(obs)
        return [head(x) for head in self.heads]

    def q_taken(self, obs: Tensor, actions: Tensor) -> Tensor:
        """Q(s, a) = sum_h Q_h(s, a_h) for a (batch, n_heads) tensor of actions; shape (batch,)."""
        return sum(q.gather(1, actions[:, h, None]).squeeze(1) for h, q in enumerate(self(obs)))


class ReplayBuffer:
    """A ring buffer of transitions in numpy arrays; when full the oldest is overwritten."""

    FIELDS = ("obs", "actions", "rewards", "next_obs", "dones", "masks", "next_masks")

    def __init__(self, capacity: int, obs_dim: int, heads: list[int]):
        self.capacity, self.heads, self.size, self.pos = capacity, list(heads), 0, 0
        self.obs = np.zeros((capacity, obs_dim), np.float32)
        self.next_obs = np.zeros((capacity, obs_dim), np.float32)
        self.actions = np.zeros((capacity, len(heads)), np.int64)
        self.rewards = np.zeros(capacity, np.float32)
        self.dones = np.zeros(capacity, np.float32)
        self.masks = np.ones((capacity, sum(heads)), bool)
        self.next_masks = np.ones((capacity, sum(heads)), bool)

    def __len__(self) -> int:
        return self.size

    def add(self, obs, action, reward: float, next_obs, done: bool, mask=None, next_mask=None) -> None:
        """Store one transition. `done` is a true termination (a time limit is not: it must not cut the
        bootstrap). `mask` is the one `action` was chosen under, `next_mask` the one at `next_obs`: the
        actor and temperature losses use the first, the critic target the second."""
        action = np.asarray(action, np.int64)
        if action.shape != (len(self.heads),) or (action < 0).any() or (action >= self.heads).any():
            raise ValueError(f"action {action.tolist()} is not one index per head of sizes {self.heads}")
        i = self.pos
        self.obs[i], self.actions[i], self.rewards[i], self.next_obs[i], self.dones[i] = (
            obs,
            action,
            reward,
            next_obs,
            done,
        )
        self.masks[i], self.next_masks[i] = check_mask(mask, self.heads), check_mask(next_mask, self.heads)
        self.pos, self.size = (i + 1) % self.capacity, min(self.size + 1, self.capacity)

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """`batch_size` transitions drawn uniformly, with replacement, as a dict of arrays (FIELDS)."""
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        idx = rng.integers(0, self.size, size=batch_size)
        return {name: getattr(self, name)[idx] for name in self.FIELDS}


class SACDiscrete:
    """The agent: actor, twin critics and their targets, one temperature per head, optimisers, replay buffer.

    One temperature per head, not one shared: heads differ in size and in how sure they can be (a device
    head may be forced by the masks while a share head is open), and each has its own entropy target; a
    shared alpha would let one head collapse while another stays uniform.
    """

    def __init__(self, obs_dim: int, heads: list[int], config: SACConfig | None = None):
        if obs_dim < 1 or not heads or min(heads) < 1:
            raise ValueError(f"need obs_dim >= 1 and at least one head of size >= 1, got {obs_dim}, {heads}")
        self.config = cfg = config or SACConfig()
        self.obs_dim, self.heads = int(obs_dim), [int(n) for n in heads]
        self.metadata: dict[str, Any] = {}
        torch.manual_seed(cfg.seed)
        self.rng = np.random.default_rng(cfg.seed)
        self.actor = Actor(obs_dim, self.heads, cfg.hidden_sizes)
        self.q1 = QNetwork(obs_dim, self.heads, cfg.hidden_sizes)
        self.q2 = QNetwork(obs_dim, self.heads, cfg.hidden_sizes)
        self.q1_target, self.q2_target = copy.deepcopy(self.q1), copy.deepcopy(self.q2)
        self.q1_target.requires_grad_(False)
        self.q2_target.requires_grad_(False)
        self.log_alpha = torch.full((len(heads),), math.log(cfg.init_alpha), requires_grad=True)
        self.target_entropy = torch.tensor([cfg.target_entropy_scale * math.log(n) for n in self.heads])
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr)
        self.critic_opt = torch.optim.Adam(chain(self.q1.parameters(), self.q2.parameters()), lr=cfg.critic_lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=cfg.alpha_lr)
        self.buffer = ReplayBuffer(cfg.buffer_size, obs_dim, self.heads)
        self.updates = 0

    @torch.no_grad()
    def act(self, obs, mask=None, deterministic: bool = False) -> np.ndarray:
        """One action index per head, (n_heads,) for one observation or (batch, n_heads) for rows of them.
        Sampled from pi (Gumbel-max with the agent's Generator), or its argmax when `deterministic`."""
        obs = np.asarray(obs, np.float32)
        rows = torch.as_tensor(np.atleast_2d(obs))
        if mask is not None:
            mask = torch.as_tensor(check_mask(mask, self.heads)).expand(len(rows), -1)
        choices = []
        for logp in self.actor.log_probs(rows, mask):
            scores = logp.numpy().astype(np.float64)
            if not deterministic:
                scores += self.rng.gumbel(size=scores.shape)
            choices.append(scores.argmax(-1))
        actions = np.stack(choices, axis=-1)
        return actions[0] if obs.ndim == 1 else actions

    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """One gradient step on the critics, the actor and the temperatures (InSS eqs. 6-9; the critics alone for
        the first `actor_delay` updates), then the soft update of the target critics. Returns the losses, the mean
        temperature and the joint entropy."""
        obs, actions, rewards, next_obs, dones, masks, next_masks = (
            torch.as_tensor(batch[name]) for name in ReplayBuffer.FIELDS
        )
        alpha = self.log_alpha.detach().exp()

        # Critics: regress Q1(s, a) and Q2(s, a) on the soft Bellman target (eq. 6).
        target = self.critic_target(rewards, next_obs, dones, next_masks)
        q_loss = 0.5 * (
            F.mse_loss(self.q1.q_taken(obs, actions), target) + F.mse_loss(self.q2.q_taken(obs, actions), target)
        )
        self.critic_opt.zero_grad()
        q_loss.backward()
        self.critic_opt.step()
        self.updates += 1

        # Actor: minimise E_pi[alpha log pi - min(Q1, Q2)] per head (eq. 8), summed over heads.
        logp = self.actor.log_probs(obs, masks)
        probs = [lp.exp() for lp in logp]
        with torch.no_grad():
            q_min = [torch.min(a, b) for a, b in zip(self.q1(obs), self.q2(obs), strict=True)]
        actor_loss = sum(
            (p * (a * lp - q)).sum(-1).mean() for p, lp, q, a in zip(probs, logp, q_min, alpha, strict=True)
        )
        # Temperatures (eq. 9): J = alpha_h (H_h - target_h); alpha_h falls while head h is above its target.
        entropy = torch.stack([-(p * lp).sum(-1).mean() for p, lp in zip(probs, logp, strict=True)]).detach()
        alpha_loss = (self.log_alpha.exp() * (entropy - self.target_entropy)).sum()
        if self.updates > self.config.actor_delay:
            self.actor_opt.zero_grad()
            actor_loss.backward()
            self.actor_opt.step()
            self.alpha_opt.zero_grad()
            alpha_loss.backward()
            self.alpha_opt.step()

        self.soft_update()
        return {
            "q_loss": q_loss.item(),
            "actor_loss": actor_loss.item(),
            "alpha_loss": alpha_loss.item(),
            "alpha": self.log_alpha.detach().exp().mean().item(),
            "entropy": entropy.sum().item(),
        }

    @torch.no_grad()
    def critic_target(self, rewards: Tensor, next_obs: Tensor, dones: Tensor, next_masks: Tensor) -> Tensor:
        """r + gamma (1 - done) V(s') with V(s') = sum_h E_{pi_h}[min(Q1'_h, Q2'_h) - alpha_h log pi_h] (eq. 7):
        clipped double-Q taken per head and action, the policy at s' restricted to the actions allowed there."""
        alpha = self.log_alpha.detach().exp()
        next_logp = self.actor.log_probs(next_obs, next_masks)
        q_next = zip(self.q1_target(next_obs), self.q2_target(next_obs), strict=True)
        v_next = sum(
            (lp.exp() * (torch.min(q1, q2) - a * lp)).sum(-1)
            for lp, (q1, q2), a in zip(next_logp, q_next, alpha, strict=True)
        )
        return rewards + self.config.gamma * (1.0 - dones) * v_next

    @torch.no_grad()
    def soft_update(self) -> None:
        """theta' <- tau theta + (1 - tau) theta' for both target critics."""
        for online, target in ((self.q1, self.q1_target), (self.q2, self.q2_target)):
            for p, p_target in zip(online.parameters(), target.parameters(), strict=True):
                p_target.lerp_(p, self.config.tau)

    def _modules(self) -> dict[str, nn.Module]:
        return {
            "actor": self.actor,
            "q1": self.q1,
            "q2": self.q2,
            "q1_target": self.q1_target,
            "q2_target": self.q2_target,
        }

    def _optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"actor": self.actor_opt, "critic": self.critic_opt, "alpha": self.alpha_opt}

    def save(self, path: str | Path, metadata: dict[str, Any] | None = None) -> None:
        """Write one torch file with the config, the networks, the temperatures and the optimiser states
        (enough to act and to resume training; not the replay buffer), plus `metadata` as given, e.g. the
        cluster the policy was trained for (None: the agent's own `.metadata`, e.g. what it was loaded with).
        `metadata` must be JSON-like (str, numbers, bools, lists, dicts)."""
        metadata = dict(self.metadata if metadata is None else metadata)
        json.dumps(metadata)  # fail here, not at load time, on values a weights-only load would refuse
        state = {
            "config": asdict(self.config),
            "obs_dim": self.obs_dim,
            "heads": self.heads,
            "networks": {name: module.state_dict() for name, module in self._modules().items()},
            "log_alpha": self.log_alpha.detach().clone(),
            "updates": self.updates,
            "optimizers": {name: opt.state_dict() for name, opt in self._optimizers().items()},
            "metadata": metadata,
        }
        torch.save(state, path)

    def save_actor(self, path: str | Path, metadata: dict[str, Any]) -> None:
        """Write only what acting needs (`actor.save_actor`): a small file to deploy, unlike `save`, which keeps
        everything training needs."""
        save_actor(path, self.actor, self.obs_dim, self.config.hidden_sizes, metadata)

    @classmethod
    def load(cls, path: str | Path) -> SACDiscrete:
        """An agent restored from `save`; the metadata saved with it is in `.metadata`."""
        state = torch.load(path, weights_only=True)
        agent = cls(state["obs_dim"], state["heads"], SACConfig(**state["config"]))
        for name, module in agent._modules().items():
            module.load_state_dict(state["networks"][name])
        with torch.no_grad():
            agent.log_alpha.copy_(state["log_alpha"])
        for name, opt in agent._optimizers().items():
            opt.load_state_dict(state["optimizers"][name])
        agent.metadata, agent.updates = state["metadata"], state["updates"]
        return agent

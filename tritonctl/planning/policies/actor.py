"""The trained InSS scheduler at run time: the actor network and the greedy, masked choice it makes.

Training (`tritonctl.rl.sac`) builds and saves this actor; planning (`inss`) loads it. torch is needed
only here, and only when a trained policy is used.
"""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

MASKED_LOGIT = -1e9
"""Logit of a disallowed action: finite, so log-probs stay finite (no NaN from 0 * -inf), and low enough
that its probability underflows to exactly 0."""


def check_mask(mask: Any, heads: list[int]) -> np.ndarray:
    """The mask as a boolean array (..., sum(heads)); None means all allowed. Each head needs an allowed action."""
    if mask is None:
        return np.ones(sum(heads), bool)
    mask = np.asarray(mask, bool)
    if mask.shape[-1:] != (sum(heads),):
        raise ValueError(f"mask has shape {mask.shape}, expected (..., {sum(heads)}) for heads {heads}")
    starts = np.cumsum([0, *heads[:-1]])
    empty = ~np.logical_or.reduceat(mask, starts, axis=-1)
    if empty.any():
        raise ValueError(f"mask allows no action in head(s) {sorted(set(np.nonzero(empty)[-1].tolist()))}")
    return mask


def trunk(obs_dim: int, hidden_sizes: tuple[int, ...]) -> nn.Sequential:
    """The shared body: one Linear + ReLU per hidden layer."""
    widths = (obs_dim, *hidden_sizes)
    return nn.Sequential(
        *chain.from_iterable((nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths[:-1], widths[1:], strict=True))
    )


class Actor(nn.Module):
    """The policy: a shared trunk, then one linear head of logits per decision."""

    def __init__(self, obs_dim: int, heads: list[int], hidden_sizes: tuple[int, ...]):
        super().__init__()
        self.sizes = list(heads)
        self.trunk = trunk(obs_dim, hidden_sizes)
        # A ModuleList, not a list: a plain list hides the heads from parameters(), the optimiser and the
        # state_dict, so they never train (the bug of the public InSS prototype).
        self.heads = nn.ModuleList(nn.Linear((obs_dim, *hidden_sizes)[-1], n) for n in heads)

    def forward(self, obs: Tensor, mask: Tensor | None = None) -> list[Tensor]:
        """Per-head logits, each (batch, heads[h]); disallowed actions get MASKED_LOGIT."""
        x = self.trunk(obs)
        logits = [head(x) for head in self.heads]
        if mask is None:
            return logits
        return [z.masked_fill(~m, MASKED_LOGIT) for z, m in zip(logits, mask.split(self.sizes, -1), strict=True)]

    def log_probs(self, obs: Tensor, mask: Tensor | None = None) -> list[Tensor]:
        """Per-head log pi_h(.|s): finite everywhere, and exp() is exactly 0 on masked actions."""
        return [F.log_softmax(z, dim=-1) for z in self(obs, mask)]


def save_actor(path: str | Path, actor: Actor, obs_dim: int, hidden_sizes: tuple[int, ...], metadata: dict) -> None:
    """Write only what acting needs, the actor's shape and weights and `metadata` (JSON-like): the small file
    `TrainedActor.load` reads."""
    json.dumps(metadata)  # fail here, not at load time, on values a weights-only load would refuse
    state = {
        "obs_dim": obs_dim,
        "heads": actor.sizes,
        "hidden_sizes": list(hidden_sizes),
        "actor": actor.state_dict(),
        "metadata": metadata,
    }
    torch.save(state, path)


class TrainedActor:
    """A deployed policy: the actor `SACDiscrete.save_actor` wrote, choosing greedily under a mask."""

    def __init__(self, actor: Actor, metadata: dict[str, Any]):
        self.actor, self.metadata = actor.eval(), metadata

    @classmethod
    def load(cls, path: str | Path) -> TrainedActor:
        state = torch.load(path, weights_only=True)
        actor = Actor(state["obs_dim"], state["heads"], tuple(state["hidden_sizes"]))
        actor.load_state_dict(state["actor"])
        return cls(actor, state["metadata"])

    @torch.inference_mode()
    def act(self, obs, mask=None) -> np.ndarray:
        """The most likely allowed action of every head for one observation."""
        rows = torch.as_tensor(np.asarray(obs, np.float32)[None])
        if mask is not None:
            mask = torch.as_tensor(check_mask(mask, self.actor.sizes)[None])
        return np.array([int(z.argmax()) for z in self.actor(rows, mask)])

    @torch.inference_mode()
    def proposals(self, obs, mask, count: int, seed: int = 0) -> np.ndarray:
        """`count` actions for one observation, one per row: the greedy one first, then draws from the policy
        (each head independently, seeded: the same observation gives the same proposals)."""
        rows = torch.as_tensor(np.asarray(obs, np.float32)[None])
        allowed = torch.as_tensor(check_mask(mask, self.actor.sizes)[None])
        generator = torch.Generator().manual_seed(seed)
        heads = []
        for z in self.actor(rows, allowed):
            greedy = z[0].argmax()[None]
            if count > 1:
                drawn = torch.multinomial(torch.softmax(z[0], -1), count - 1, replacement=True, generator=generator)
                greedy = torch.cat([greedy, drawn])
            heads.append(greedy)
        return torch.stack(heads, 1).numpy()

"""The SAC-Discrete agent of rl/sac.py: every head trains, masks hold, targets, temperature, learning, save/load."""

from __future__ import annotations

import math
from itertools import chain

import numpy as np
import pytest
import torch

from tritonctl.rl.sac import ReplayBuffer, SACConfig, SACDiscrete

torch.set_num_threads(1)

SMALL = {"hidden_sizes": (32, 32), "batch_size": 32, "buffer_size": 1_000}


def random_batch(agent: SACDiscrete, n: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """A buffer filled with random transitions (nothing masked), sampled once."""
    rng = np.random.default_rng(seed)
    buffer = ReplayBuffer(n, agent.obs_dim, agent.heads)
    for _ in range(n):
        action = [rng.integers(k) for k in agent.heads]
        obs, next_obs = rng.standard_normal((2, agent.obs_dim))
        buffer.add(obs, action, rng.standard_normal(), next_obs, rng.random() < 0.2)
    return buffer.sample(n, rng)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def test_default_config_is_inss_table_1():
    cfg = SACConfig()
    assert cfg.hidden_sizes == (512, 256)
    assert cfg.actor_lr == cfg.critic_lr == cfg.alpha_lr == 1e-4
    assert (cfg.gamma, cfg.batch_size, cfg.buffer_size, cfg.tau, cfg.init_alpha) == (0.99, 100, 10_000, 0.01, 1.0)


def test_one_update_changes_every_head_and_the_trunks():
    # The InSS shape at the Table 1 sizes: two models, each a device head (3) and a share-level head (4).
    agent = SACDiscrete(obs_dim=10, heads=[3, 4, 3, 4])
    nets = {"actor": agent.actor, "q1": agent.q1, "q2": agent.q2}
    before = {name: snapshot(net) for name, net in nets.items()}
    agent.update(random_batch(agent))
    for name, net in nets.items():
        after = snapshot(net)
        assert len([k for k in after if k.startswith("heads.")]) == 2 * len(agent.heads), name
        for key, tensor in after.items():
            assert not torch.equal(tensor, before[name][key]), f"{name}.{key} did not change"


def test_masked_actions_have_zero_probability_and_are_never_chosen():
    agent = SACDiscrete(obs_dim=4, heads=[3, 5], config=SACConfig(**SMALL))
    # Make the actions we mask the ones the unmasked policy prefers, so a leaky mask would show.
    with torch.no_grad():
        agent.actor.heads[0].bias.copy_(torch.tensor([0.0, 0.0, 50.0]))
        agent.actor.heads[1].bias.copy_(torch.tensor([50.0, 0.0, 0.0, 0.0, 40.0]))
    mask = np.array([True, True, False] + [False, True, False, False, False])  # all but one masked in head 1
    obs = np.random.default_rng(1).standard_normal((500, 4)).astype(np.float32)

    logp = agent.actor.log_probs(torch.as_tensor(obs), torch.as_tensor(mask).expand(500, -1))
    assert all(torch.isfinite(lp).all() for lp in logp)
    probs = torch.cat([lp.exp() for lp in logp], dim=-1)
    assert (probs[:, ~mask] == 0).all()
    assert torch.allclose(probs[:, 3:], torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]).expand(500, 5))

    for deterministic in (False, True):
        for _ in range(4):
            actions = agent.act(obs, mask, deterministic=deterministic)
            assert set(actions[:, 0]) <= {0, 1} and set(actions[:, 1]) == {1}
    assert set(agent.act(obs, mask)[:, 0]) == {0, 1}  # both allowed actions do get sampled
    with pytest.raises(ValueError, match="no action in head"):
        agent.act(obs[0], np.array([True, True, True] + [False] * 5))


def test_masked_update_is_finite_and_uses_the_masks():
    agent = SACDiscrete(obs_dim=4, heads=[3, 2], config=SACConfig(**SMALL))
    batch = random_batch(agent)
    batch["next_masks"][:] = [False, False, True, True, False]
    batch["masks"][:] = [False, True, False, False, True]  # one action left per head at obs: no entropy
    losses = agent.update(batch)
    assert all(math.isfinite(v) for v in losses.values())
    assert losses["entropy"] == 0.0
    assert all(torch.isfinite(p).all() for p in agent.actor.parameters())


def test_critic_target_by_hand():
    # Uniform policy; target critics constant per action, so V(s') is known in closed form.
    agent = SACDiscrete(obs_dim=4, heads=[3, 4], config=SACConfig(**SMALL, gamma=0.9))
    with torch.no_grad():
        for head in chain(agent.actor.heads, agent.q1_target.heads, agent.q2_target.heads):
            head.weight.zero_()
            head.bias.zero_()
        agent.q1_target.heads[0].bias.copy_(torch.tensor([1.0, 5.0, 1.0]))
        agent.q2_target.heads[0].bias.copy_(torch.tensor([3.0, 2.0, 3.0]))  # min per action: [1, 2, 1]
        agent.q2_target.heads[1].bias.fill_(1.0)  # min: 0
        agent.log_alpha.copy_(torch.tensor([math.log(0.5), math.log(2.0)]))
    allowed = [True, True, False, True, True, True, True]
    only_2 = [True, True, False, False, False, True, False]
    target = agent.critic_target(
        rewards=torch.tensor([1.0, 2.0, 0.0]),
        next_obs=torch.randn(3, 4),
        dones=torch.tensor([0.0, 1.0, 0.0]),
        next_masks=torch.tensor([allowed, allowed, only_2]),
    )
    # head 0: E over {0, 1} of [1, 2] plus 0.5 log 2; head 1: 0 plus 2 log(allowed count)
    v0, v2 = 1.5 + 0.5 * math.log(2) + 2 * math.log(4), 1.5 + 0.5 * math.log(2)
    assert torch.allclose(target, torch.tensor([1.0 + 0.9 * v0, 2.0, 0.9 * v2]), atol=1e-5)


def test_soft_update_moves_targets_by_tau():
    agent = SACDiscrete(obs_dim=4, heads=[3, 2], config=SACConfig(**SMALL, tau=0.25))
    with torch.no_grad():
        for p in agent.q2.parameters():
            p.add_(1.0)  # online and target differ
    online, target = agent.q2.heads[1].weight.detach().clone(), agent.q2_target.heads[1].weight.detach().clone()
    agent.soft_update()
    expected = 0.75 * target + 0.25 * online
    assert torch.allclose(agent.q2_target.heads[1].weight, expected, atol=1e-7)
    assert not torch.allclose(agent.q2_target.heads[1].weight, target)


@pytest.mark.parametrize("peaked", [False, True])
def test_temperature_moves_toward_the_target_entropy(peaked):
    agent = SACDiscrete(obs_dim=4, heads=[3, 4], config=SACConfig(**SMALL, alpha_lr=1e-2))
    if peaked:  # entropy near 0, below target (0.6 log n): alpha must rise
        with torch.no_grad():
            agent.actor.heads[0].bias.copy_(torch.tensor([30.0, 0.0, 0.0]))
            agent.actor.heads[1].bias.copy_(torch.tensor([0.0, 30.0, 0.0, 0.0]))
    # else: a fresh policy is near uniform, entropy near log n, above target: alpha must fall
    batch = random_batch(agent)
    for _ in range(5):
        agent.update(batch)
    alpha = agent.log_alpha.detach().exp()
    assert ((alpha > 1.0) if peaked else (alpha < 1.0)).all(), alpha


def bandit_run(seed: int, steps: int = 500) -> SACDiscrete:
    """Contextual bandit: obs = one-hot of 3 contexts, heads [3, 4], reward 1 only if both heads hit the
    context's target pair, every step terminal. Collected with the agent's own policy, as a loop would."""
    targets = np.array([[0, 1], [2, 3], [1, 0]])
    cfg = SACConfig(**SMALL, actor_lr=3e-3, critic_lr=3e-3, alpha_lr=3e-3, learning_starts=100, seed=seed)
    agent = SACDiscrete(obs_dim=3, heads=[3, 4], config=cfg)
    eye = np.eye(3, dtype=np.float32)
    for step in range(steps):
        context = agent.rng.integers(3)
        action = agent.act(eye[context])
        reward = float((action == targets[context]).all())
        agent.buffer.add(eye[context], action, reward, eye[context], True)
        if step >= cfg.learning_starts and step % cfg.update_frequency == 0:
            agent.update(agent.buffer.sample(cfg.batch_size, agent.rng))
    assert (agent.act(eye, deterministic=True) == targets).all(), agent.act(eye, deterministic=True)
    return agent


def test_learns_a_contextual_bandit():
    bandit_run(seed=0)


def test_an_actor_delay_moves_the_critics_alone_first():
    agent = SACDiscrete(obs_dim=5, heads=[2, 3], config=SACConfig(**SMALL, actor_delay=2))
    batch = random_batch(agent)
    actor, critic, alpha = snapshot(agent.actor), snapshot(agent.q1), agent.log_alpha.detach().clone()
    for _ in range(2):
        agent.update(batch)
    assert all(torch.equal(t, snapshot(agent.actor)[k]) for k, t in actor.items())
    assert torch.equal(agent.log_alpha, alpha)
    assert not all(torch.equal(t, snapshot(agent.q1)[k]) for k, t in critic.items())
    agent.update(batch)  # the third update moves the actor and the temperatures too
    assert not all(torch.equal(t, snapshot(agent.actor)[k]) for k, t in actor.items())
    assert not torch.equal(agent.log_alpha, alpha)


def test_save_load_round_trip(tmp_path):
    agent = SACDiscrete(obs_dim=5, heads=[2, 3, 4], config=SACConfig(**SMALL, seed=3))
    batch = random_batch(agent)
    for _ in range(3):
        agent.update(batch)
    agent.save(tmp_path / "policy.pt", metadata={"cluster": "lab-a", "models": ["resnet18", "alexnet"]})
    loaded = SACDiscrete.load(tmp_path / "policy.pt")

    assert loaded.metadata == {"cluster": "lab-a", "models": ["resnet18", "alexnet"]}
    assert loaded.config == agent.config and loaded.heads == agent.heads
    obs = np.random.default_rng(0).standard_normal((50, 5)).astype(np.float32)
    assert (loaded.act(obs, deterministic=True) == agent.act(obs, deterministic=True)).all()
    # Optimiser states and temperatures came back too: the same next update gives the same weights.
    agent.update(batch)
    loaded.update(batch)
    for mine, theirs in zip(agent.actor.parameters(), loaded.actor.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(agent.log_alpha, loaded.log_alpha)
    assert loaded.updates == agent.updates == 4
    loaded.save(tmp_path / "again.pt")  # no metadata given: the loaded one is kept
    assert SACDiscrete.load(tmp_path / "again.pt").metadata["cluster"] == "lab-a"
    with pytest.raises(TypeError):
        agent.save(tmp_path / "bad.pt", metadata={"when": object()})

"""Training TS offline (InSS Algorithm 2): SAC-Discrete on the provisioning environment of one cluster.

Top to bottom: per episode, reset the environment (rates drawn anew), then per step act with the current
policy under the action mask, store the transition, and update the agent once the buffer holds
`learning_starts` transitions. Each episode appends a row to `train.csv`: mean reward, normalised
throughput and SLO-violation share over its steps, and the reward of the greedy decision where
`tritonctl plan` asks for one (every model at the cluster's rate, spread's placement current). Every
`checkpoint_every` episodes and at the end the run folder gets a checkpoint (the whole agent, its replay
buffer and random state: `resume` goes on from it exactly) and the learning curve; at the end the
deployable actor goes to `policy_file`.

Fine-tuning: with `init` the actor starts from a policy trained before (imitation's), the critics from scratch;
`fine_tuning_sac()` holds the actor still until the critics know its values.

Reproducible: episode e resets the environment with seed (seed, e), the agent draws from its own seeded
Generator, and torch runs on one thread.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from tqdm import tqdm

from tritonctl.errors import TritonctlError
from tritonctl.latency.model import LatencyModel
from tritonctl.planning.planner import demands_of, devices_of, reserve_for_requests
from tritonctl.planning.policies import PlacementError
from tritonctl.planning.policies.actor import Actor
from tritonctl.planning.policies.inss import Layout, load_trained, policy_metadata
from tritonctl.planning.policies.spread import spread
from tritonctl.spec import Cluster

from .env import EnvConfig, InssEnv
from .sac import SACConfig, SACDiscrete

COLUMNS = ("episode", "reward", "throughput", "violation", "goodput_rps", "alpha", "planning_reward", "wall_s")


def training_sac() -> SACConfig:
    """Table 1 but for three fields. gamma 0: a decision's reward depends only on that decision and the rates,
    and the rates move regardless of it, so the best policy is myopic and a discounted return adds only
    variance. Learning rates 1e-3 (Table 1: 1e-4): with gamma 0 the critic regresses the bounded reward
    itself, and the larger step fits the 30 minutes of 2 cores. Target entropy 0.3 of each head's maximum
    (sac.py's default 0.6): sharper heads let the factorised critic see the others' choices more nearly as
    they will be made; on the six-model setup it ended 500 episodes at 4.0% violations instead of 6.7%."""
    return SACConfig(gamma=0.0, actor_lr=1e-3, critic_lr=1e-3, target_entropy_scale=0.3)


def fine_tuning_sac() -> SACConfig:
    """training_sac() for an actor that already decides well (imitation's): the critics learn its values for
    2,000 updates before it moves, it moves at Table 1's learning rate, and a temperature starting at 0.01
    (Table 1: 1) keeps the entropy bonus from flattening heads that imitation made sure of."""
    return replace(training_sac(), actor_lr=1e-4, init_alpha=0.01, actor_delay=2_000)


@dataclass
class TrainConfig:
    """A training run: how long, which seed, and the environment and agent settings."""

    episodes: int = 400
    seed: int = 0
    checkpoint_every: int = 50
    env: EnvConfig = field(default_factory=EnvConfig)
    sac: SACConfig = field(default_factory=training_sac)


def make_env(cluster: Cluster, lm: LatencyModel, config: EnvConfig) -> InssEnv:
    missing = [m.name for m in cluster.spec.models if m.name not in lm.models]
    if missing:
        raise TritonctlError(f"models {missing} are not in the latency model: profile and fit them", file=cluster.path)
    if cluster.kind == "cpu":  # the devices as the planner sees them at the cluster's rates
        cluster = reserve_for_requests(cluster, lm, lambda _: None, None)
    demands, devices = demands_of(cluster, {}, lm), devices_of(cluster)
    try:  # episodes start from spread's placement: it must fit
        spread(demands, devices, lm)
    except PlacementError as exc:
        raise TritonctlError(f"cannot train for this cluster: {exc}", file=cluster.path, field="models") from None
    return InssEnv(cluster.spec.name, demands, devices, lm, config)


def initial_actor(path: Path, env: InssEnv) -> Actor:
    """The actor in `path` (imitation's, say) to fine-tune, refused unless trained for `env`'s layout."""
    if not path.is_file():
        raise TritonctlError("no policy to start from here: train one first (`tritonctl train`)", file=path)
    trained = load_trained(path, env.layout.cluster, list(env.layout.models), env.devices)
    differ = [f.name for f in fields(Layout) if getattr(trained.layout, f.name) != getattr(env.layout, f.name)]
    if differ:
        raise TritonctlError(
            f"the policy to start from was trained with another {' and '.join(differ)} than this cluster's "
            "environment has now: train it again (`tritonctl train`) and fine-tune that",
            file=path,
        )
    return trained.actor.actor


def _save_checkpoint(folder: Path, agent: SACDiscrete, episode: int, init: Path | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    agent.save(folder / "agent.pt")
    buf = agent.buffer
    np.savez(folder / "buffer.npz", **{name: getattr(buf, name) for name in buf.FIELDS}, size=buf.size, pos=buf.pos)
    state = {"episode": episode, "rng": agent.rng.bit_generator.state, "init": init and str(init)}
    (folder / "state.json").write_text(json.dumps(state))


def _load_checkpoint(folder: Path) -> tuple[SACDiscrete, int, Path | None]:
    agent = SACDiscrete.load(folder / "agent.pt")
    with np.load(folder / "buffer.npz") as saved:
        for name in agent.buffer.FIELDS:
            getattr(agent.buffer, name)[:] = saved[name]
        agent.buffer.size, agent.buffer.pos = int(saved["size"]), int(saved["pos"])
    state = json.loads((folder / "state.json").read_text())
    agent.rng.bit_generator.state = state["rng"]
    return agent, state["episode"], state["init"] and Path(state["init"])


def _read_log(path: Path, episodes: int) -> list[dict[str, float]]:
    with open(path, newline="") as f:
        return [{k: int(v) if k == "episode" else float(v) for k, v in row.items()} for row in csv.DictReader(f)][
            :episodes
        ]


def plot_curve(rows: list[dict[str, float]], path: Path, title: str, actor_from: int = 0) -> None:
    """Reward, normalised throughput and SLO violations against episodes (as InSS Figs. 13 and 14); where the
    actor was held still at first (fine-tuning), a line at the episode it first moved."""
    episodes = [r["episode"] for r in rows]
    fig = Figure(figsize=(7, 7))
    axes = fig.subplots(3, 1, sharex=True)
    panels = (("reward", "reward (eq. 3)"), ("throughput", "throughput, sum h/H"), ("violation", "SLO violations %"))
    window = max(1, len(rows) // 25)
    for ax, (key, label) in zip(axes, panels, strict=True):
        values = np.array([r[key] for r in rows]) * (100 if key == "violation" else 1)
        ax.plot(episodes, values, color="tab:blue", alpha=0.3, linewidth=0.8)
        if len(values) >= window:
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            ax.plot(episodes[window - 1 :], smooth, color="tab:blue", label=f"mean of {window}")
            ax.legend(loc="best", fontsize=8)
        if key == "reward":
            ax.plot(episodes, [r["planning_reward"] for r in rows], color="tab:orange", label="greedy, at planning")
            ax.legend(loc="best", fontsize=8)
        if actor_from:
            ax.axvline(actor_from, color="grey", linestyle=":", label="the actor moves from here")
            ax.legend(loc="best", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("episode")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def train(
    cluster: Cluster,
    lm: LatencyModel,
    out_dir: Path,
    policy_file: Path,
    config: TrainConfig,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    init: Path | None = None,
) -> list[dict[str, float]]:
    """Train (or, with `resume`, go on training) a policy for `cluster`; returns the per-episode log. With `init`,
    the actor starts from the policy in that file (pair it with `fine_tuning_sac()`), the critics from scratch."""
    if config.episodes < 1:
        raise TritonctlError(f"--episodes must be at least 1, not {config.episodes}")
    torch.set_num_threads(1)
    env = make_env(cluster, lm, config.env)
    csv_path, checkpoint = out_dir / "train.csv", out_dir / "checkpoint"
    start, rows = 0, []
    if resume:
        if init is not None:
            raise TritonctlError("a run resumes from its checkpoint, not from another policy: --resume or --init")
        if not (checkpoint / "state.json").is_file():
            raise TritonctlError("no checkpoint to resume from: train without --resume first", file=checkpoint)
        agent, start, init = _load_checkpoint(checkpoint)
        if start > config.episodes:
            raise TritonctlError(
                f"the checkpoint is at episode {start}, past --episodes {config.episodes}", file=checkpoint
            )
        rows = _read_log(csv_path, start)
        if agent.metadata != env.layout.metadata():
            raise TritonctlError("the checkpoint was trained for another cluster layout", file=checkpoint)
        log(f"resuming {cluster.spec.name} from episode {start}")
    else:
        config.sac.seed = config.seed
        start_from = initial_actor(init, env) if init is not None else None
        if start_from is not None:
            config.sac.hidden_sizes = tuple(m.out_features for m in start_from.trunk if isinstance(m, torch.nn.Linear))
        agent = SACDiscrete(env.layout.obs_dim, env.layout.heads, config.sac)
        if start_from is not None:
            agent.actor.load_state_dict(start_from.state_dict())
        agent.metadata = env.layout.metadata()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:  # rewritten up to the checkpoint's episode, then appended
        csv.DictWriter(f, COLUMNS).writeheader()
        csv.DictWriter(f, COLUMNS).writerows(rows)
    cfg, started = agent.config, time.perf_counter() - (rows[-1]["wall_s"] if rows else 0.0)
    steps = start * env.config.steps  # environment steps so far (every episode has the same number)
    held_steps = cfg.learning_starts + cfg.actor_delay * cfg.update_frequency  # before the actor's first update
    actor_from = held_steps // env.config.steps + 1 if cfg.actor_delay else 0
    bar = tqdm(range(start, config.episodes), initial=start, total=config.episodes, disable=not progress, unit="ep")
    for episode in bar:
        obs, info = env.reset(seed=config.seed * 1_000_003 + episode)
        totals = dict.fromkeys(("reward", "throughput", "violation", "goodput_rps", "alpha"), 0.0)
        done = False
        while not done:
            mask = info["action_mask"]
            action = agent.act(obs, mask)
            next_obs, reward, terminated, truncated, info = env.step(action)
            agent.buffer.add(obs, action, reward, next_obs, terminated, mask, info["action_mask"])
            steps += 1
            if len(agent.buffer) >= cfg.learning_starts and steps % cfg.update_frequency == 0:
                totals["alpha"] += agent.update(agent.buffer.sample(cfg.batch_size, agent.rng))["alpha"]
            obs, done = next_obs, terminated or truncated
            totals["reward"] += reward
            for key in ("throughput", "violation", "goodput_rps"):
                totals[key] += info[key]
        row = {k: v / env.config.steps for k, v in totals.items()}
        greedy = env.planning_reward(lambda o, m: agent.act(o, m, deterministic=True))
        row.update(episode=episode + 1, planning_reward=greedy, wall_s=round(time.perf_counter() - started, 1))
        rows.append(row)
        with open(csv_path, "a", newline="") as f:
            csv.DictWriter(f, COLUMNS).writerow({k: round(v, 4) for k, v in row.items()})
        bar.set_postfix(reward=f"{row['reward']:.2f}", violations=f"{100 * row['violation']:.1f}%")
        if (episode + 1) % config.checkpoint_every == 0 or episode + 1 == config.episodes:
            _save_checkpoint(checkpoint, agent, episode + 1, init)
            plot_curve(rows, out_dir / "learning-curve.png", f"TS training on {cluster.spec.name}", actor_from)
    policy_file.parent.mkdir(parents=True, exist_ok=True)
    trained = {"method": "sac", "episodes": config.episodes, "seed": config.seed, "env": asdict(config.env)}
    if init is not None:
        trained["init"] = str(init)
    agent.save_actor(policy_file, policy_metadata(env.layout, env.lm, trained))
    log(f"policy written to {policy_file}; log, curve and checkpoint in {out_dir}")
    return rows

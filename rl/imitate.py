"""Training the inss actor by imitation: it learns `search`'s decisions over random rates (behaviour cloning).

Top to bottom: draw workloads as the training environment does (each model's rate in [0.5, 1.2] x the
cluster's, some models left out), observe each as `inss` will online (spread's placement with BDA's
batches), and label it with the placement `search` climbs to, encoded as the actor's action (identical
devices renumbered, `inss.encode`). The labelled demonstrations are kept in the run folder
(`demonstrations.npz`) and reused while the layout, the workloads, the latency model and the code that
judges placements stay the same. Then the actor (the network SAC-Discrete trains, the
same heads and mask) is fitted by cross-entropy on every head, a tenth of the demonstrations held out, and
the weights of the epoch with the least held-out loss are kept (the demonstrations are few for the
network: past that epoch it learns them by heart). `imitate.csv` logs per epoch the loss on both, the
share of held-out heads the greedy actor gets right and the seconds of fitting so far; the predicted
goodput of what `inss` deploys with the actor on the held-out workloads, as a share of search's on the
same workloads, is printed at the end.

Reproducible: workload d resets the environment with seed (seed, d), and torch runs on one thread.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from tqdm import tqdm

import tritonctl
from tritonctl.latency.model import LatencyModel
from tritonctl.planning.policies.actor import Actor, TrainedActor, save_actor
from tritonctl.planning.policies.inss import Trained, decide, encode, policy_metadata
from tritonctl.planning.policies.search import Judge, climb
from tritonctl.spec import Cluster

from .env import EnvConfig, InssEnv
from .train import make_env

COLUMNS = ("epoch", "loss", "held_out_loss", "held_out_accuracy", "wall_s")


@dataclass
class ImitationConfig:
    """How many workloads, how long to fit, and the network."""

    demonstrations: int = 1500
    epochs: int = 200
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-4
    hidden_sizes: tuple[int, ...] = (512, 256)
    held_out: float = 0.1
    seed: int = 0
    env: EnvConfig = field(default_factory=EnvConfig)


@dataclass
class Demonstrations:
    """Observations, search's actions (-1 in the heads of models left out) and masks, one row per workload."""

    obs: np.ndarray
    actions: np.ndarray
    masks: np.ndarray
    goodput: np.ndarray  # what search's placement is predicted to serve within the SLOs, requests/s

    def save(self, path: Path, key: str) -> None:
        np.savez(path, key=key, **asdict(self))

    @classmethod
    def load(cls, path: Path, key: str) -> Demonstrations | None:
        if not path.is_file():
            return None
        with np.load(path) as saved:
            if str(saved["key"]) != key:
                return None
            return cls(saved["obs"], saved["actions"], saved["masks"], saved["goodput"])


def workload(env: InssEnv, seed: int, d: int):
    """Workload d: the environment reset with seed (seed, d); its observation and models at their rates."""
    obs, info = env.reset(seed=seed * 1_000_003 + d)
    return obs, info["action_mask"], env.current_demands()


def demonstrate(env: InssEnv, count: int, seed: int, progress: bool = True) -> Demonstrations:
    """Search's decisions on `count` workloads."""
    rows = []
    for d in tqdm(range(count), disable=not progress, unit="workload", desc="search's decisions"):
        obs, mask, demands = workload(env, seed, d)
        placement, judge = climb(demands, env.devices, env.lm, replicas=False)
        rows.append((obs, encode(placement, env.layout), mask, sum(judge(placement).served.values())))
    obs, actions, masks, goodput = (np.array(column) for column in zip(*rows, strict=True))
    return Demonstrations(obs.astype(np.float32), actions, masks, goodput)


def _loss(actor: Actor, obs: torch.Tensor, actions: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of search's choice summed over heads, heads of models left out ignored."""
    logits = actor(obs, masks)
    return sum(F.cross_entropy(z, actions[:, h], ignore_index=-1) for h, z in enumerate(logits))


@torch.no_grad()
def _accuracy(actor: Actor, obs: torch.Tensor, actions: torch.Tensor, masks: torch.Tensor) -> float:
    chosen = torch.stack([z.argmax(-1) for z in actor(obs, masks)], 1)
    present = actions >= 0
    return float((chosen == actions)[present].float().mean())


def goodput_share(env: InssEnv, trained: Trained, seed: int, indices: list[int], goodput: np.ndarray) -> float:
    """Mean over workloads of the goodput of the placement inss deploys with `trained` (`inss.decide`), predicted,
    over that of search's."""
    shares = []
    for d in indices:
        _, _, demands = workload(env, seed, d)
        placement = decide(demands, env.devices, env.lm, trained).placement
        served = sum(Judge(demands, env.devices, env.lm)(placement).served.values())
        shares.append(served / goodput[d] if goodput[d] > 0 else 1.0)
    return float(np.mean(shares))


def _labels_key(env: InssEnv, lm: LatencyModel, config: ImitationConfig) -> str:
    """What search's labels depend on: the cluster's layout, the workloads drawn, the latency model, and the code
    that judges placements (the planning and latency packages: a change there relabels)."""
    root = Path(tritonctl.__file__).parent
    code = hashlib.sha256()
    for source in sorted([*root.glob("planning/**/*.py"), *root.glob("latency/*.py"), root / "shares.py"]):
        code.update(source.read_bytes())
    margins = (lm.margin, sorted(lm.margins.items()))
    model = hashlib.sha256(repr((lm.device, sorted(lm.models.items()), margins)).encode()).hexdigest()
    return repr((env.layout.metadata(), asdict(config.env), config.seed, model, code.hexdigest()))


def imitate(
    cluster: Cluster,
    lm: LatencyModel,
    out_dir: Path,
    policy_file: Path,
    config: ImitationConfig,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict[str, float]]:
    """Fit the actor of `cluster` to search's decisions; returns the per-epoch log."""
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    env = make_env(cluster, lm, config.env)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache, key = out_dir / "demonstrations.npz", _labels_key(env, lm, config)
    demos = Demonstrations.load(cache, key)
    if demos is None or len(demos.obs) < config.demonstrations:
        demos = demonstrate(env, config.demonstrations, config.seed, progress)
        demos.save(cache, key)
    started = time.perf_counter()  # the log's wall_s: fitting alone
    n = config.demonstrations
    order = np.random.default_rng(config.seed).permutation(n)
    held = sorted(order[: max(1, int(config.held_out * n))].tolist())
    fit = order[len(held) :]
    tensors = [torch.as_tensor(a[:n]) for a in (demos.obs, demos.actions, demos.masks)]
    train_set = [t[fit] for t in tensors]
    test_set = [t[held] for t in tensors]
    actor = Actor(env.layout.obs_dim, env.layout.heads, config.hidden_sizes)
    optimiser = torch.optim.Adam(actor.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    rng = np.random.default_rng(config.seed)
    rows, best = [], (float("inf"), 0, None)
    bar = tqdm(range(config.epochs), disable=not progress, unit="epoch", desc="imitating")
    for epoch in bar:
        actor.train()
        total = 0.0
        shuffled = torch.as_tensor(rng.permutation(len(fit)))
        for start in range(0, len(fit), config.batch_size):
            idx = shuffled[start : start + config.batch_size]
            loss = _loss(actor, *(t[idx] for t in train_set))
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            total += float(loss.detach()) * len(idx)
        actor.eval()
        with torch.no_grad():
            held_loss = float(_loss(actor, *test_set))
        row = {
            "epoch": epoch + 1,
            "loss": total / len(fit),
            "held_out_loss": held_loss,
            "held_out_accuracy": _accuracy(actor, *test_set),
            "wall_s": round(time.perf_counter() - started, 1),
        }
        rows.append(row)
        if held_loss < best[0]:
            best = (held_loss, epoch + 1, copy.deepcopy(actor.state_dict()))
        bar.set_postfix(loss=f"{row['loss']:.3f}", held_out=f"{row['held_out_accuracy']:.1%}")
    with open(out_dir / "imitate.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows({k: round(v, 4) for k, v in r.items()} for r in rows)
    plot_imitation(rows, out_dir / "imitation-curve.png", f"imitating search on {cluster.spec.name}", best[1])
    actor.load_state_dict(best[2])
    metadata = policy_metadata(env.layout, env.lm, {"method": "imitate", "epoch": best[1], **asdict(config)})
    policy_file.parent.mkdir(parents=True, exist_ok=True)
    save_actor(policy_file, actor, env.layout.obs_dim, config.hidden_sizes, metadata)
    share = goodput_share(env, Trained(TrainedActor(actor, metadata), env.layout), config.seed, held, demos.goodput)
    accuracy = rows[best[1] - 1]["held_out_accuracy"]
    log(
        f"kept epoch {best[1]}; held out ({len(held)} workloads): {accuracy:.1%} of heads as search chose, "
        f"predicted goodput {share:.1%} of search's; policy written to {policy_file}, log and curve in {out_dir}"
    )
    return rows


def plot_imitation(rows: list[dict[str, float]], path: Path, title: str, kept: int) -> None:
    """Loss on the demonstrations and on the held-out ones, and held-out accuracy, against epochs; the epoch
    kept marked."""
    epochs = [r["epoch"] for r in rows]
    fig = Figure(figsize=(7, 5))
    loss_ax, acc_ax = fig.subplots(2, 1, sharex=True)
    loss_ax.plot(epochs, [r["loss"] for r in rows], label="fitted")
    loss_ax.plot(epochs, [r["held_out_loss"] for r in rows], label="held out")
    loss_ax.set_ylabel("cross-entropy, summed over heads")
    loss_ax.set_yscale("log")
    acc_ax.plot(epochs, [100 * r["held_out_accuracy"] for r in rows], color="tab:green")
    acc_ax.set_ylabel("held-out heads as search, %")
    acc_ax.set_xlabel("epoch")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.axvline(kept, color="grey", linestyle=":", label=f"kept (epoch {kept})")
    loss_ax.legend(fontsize=8)
    loss_ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)

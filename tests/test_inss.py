"""The InSS scheduler: the provisioning environment, training, and the two-layer `inss` policy (SYNTHETIC model)."""

from __future__ import annotations

import csv
import dataclasses
import sys

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from conftest import REPO, make_mlp, mlp_model, write_cluster
from synthetic import synthetic_dataset
from tritonctl.cli import main
from tritonctl.errors import TritonctlError
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.model import LatencyModel, load_latency_model
from tritonctl.latency.queueing import task_latency
from tritonctl.planning.plan import Device, load_plan
from tritonctl.planning.planner import replan_policy
from tritonctl.planning.policies import POLICIES, Demand
from tritonctl.planning.policies.base import Choice
from tritonctl.planning.policies.bda import bda
from tritonctl.planning.policies.inss import HEADROOM, Layout, decode, encode, inss, load_trained, slower_judge
from tritonctl.planning.policies.search import TURNS, Judge, Spot
from tritonctl.rl.env import EnvConfig, InssEnv
from tritonctl.rl.imitate import ImitationConfig, imitate
from tritonctl.rl.sac import SACConfig, SACDiscrete
from tritonctl.rl.train import TrainConfig, train
from tritonctl.spec import load_cluster

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return fit_latency_model(synthetic_dataset(tmp_path_factory.mktemp("p") / "profile"), log=lambda _: None)


def cpus(*memory: int) -> list[Device]:
    return [Device(id=f"cpu{i}", kind="cpu", index=i, memory_mb=m, units=100, cores=2.0) for i, m in enumerate(memory)]


DEMANDS = [Demand("alpha", 150, 120, 100), Demand("beta", 400, 40, 100)]
TWO = cpus(4096, 4096)


def test_env_passes_the_gymnasium_checker(lm):
    env = InssEnv("test", DEMANDS, cpus(4096, 4096), lm)
    check_env(env, skip_render_check=True)
    assert env.observation_space.shape == (2 + 2 * 2,)
    assert list(env.action_space.nvec) == [2, 22, 2, 22]  # 20 share levels, then turns with 1 or 2 instances


def test_a_placement_that_overflows_memory_is_a_full_violation(lm):
    env = InssEnv("test", DEMANDS, cpus(150, 150), lm, EnvConfig(absent=0.0))  # one fits a device, two do not
    env.reset(seed=0)
    obs, reward, _, _, info = env.step([1, 19, 1, 19])  # both on cpu1: 200 MB > 150 MB
    assert reward == pytest.approx(-env.config.penalty)  # h = 0, v = 1 for both: (0 - 100 - 100) / 2
    assert info["violation"] == 1.0 and info["goodput_rps"] == 0.0
    assert obs[:2].tolist() == [0.0, 1.0]  # memory used after the decision: cpu1 over full
    assert obs[-2:].tolist() == [1.0, 1.0]  # undeployed: fully queued
    _, reward, _, _, info = env.step([0, 19, 1, 19])  # one per device: both served
    assert reward > 0 and info["violation"] == 0.0


def test_episodes_without_some_models_observe_them_idle_and_place_the_rest(lm):
    env = InssEnv("test", DEMANDS, cpus(4096, 4096), lm, EnvConfig(absent=1.0))
    obs, _ = env.reset(seed=1)
    (gone,) = [i for i, here in enumerate(env.present) if not here]  # one of two models left out
    assert obs[2 + gone] == 0.0 and obs[4 + gone] == 0.0  # rate and queue
    env.step([0, 19, 0, 19])
    assert set(env.placement) == {DEMANDS[1 - gone].name}
    assert env.placement[DEMANDS[1 - gone].name].share == 100  # alone on cpu0: no split with the absent one


def test_masks_forbid_devices_too_small_and_shares_below_the_profile(lm):
    demands = [Demand("alpha", 150, 120, 300), Demand("beta", 400, 40, 100)]
    env = InssEnv("test", demands, cpus(200, 4096), lm)  # alpha does not fit cpu0
    _, info = env.reset(seed=0)
    mask = env.action_masks()
    assert (mask == info["action_mask"]).all()
    alpha_devices, alpha_levels, beta_devices = mask[:2], mask[2:24], mask[24:26]
    assert alpha_devices.tolist() == [False, True] and beta_devices.tolist() == [True, True]
    assert alpha_levels.tolist() == [False] * 4 + [True] * 18  # profiled from 25 units: 5-20% masked, turns not
    agent = SACDiscrete(env.layout.obs_dim, env.layout.heads, SACConfig(hidden_sizes=(16,)))
    obs = np.tile(env.observation_space.sample(), (200, 1))
    actions = agent.act(obs, mask)
    assert (actions[:, 0] == 1).all() and (actions[:, 1] >= 4).all()


def test_oversubscribed_devices_split_in_proportion_and_most_asking_for_turns_take_them():
    layout = Layout.of("test", DEMANDS, cpus(4096, 4096))
    assert decode([0, 19, 0, 9], layout, DEMANDS, TWO) == {
        "alpha": Spot("cpu0", 66),
        "beta": Spot("cpu0", 33),
    }  # 100 + 50
    assert decode([1, 20, 1, 9], layout, DEMANDS, TWO) == {"alpha": Spot("cpu1", TURNS), "beta": Spot("cpu1", TURNS)}
    assert decode([0, 21, 0, 9], layout, DEMANDS, TWO)["alpha"] == Spot("cpu0", TURNS, 2)  # two instances of alpha
    assert decode([0, 9, 1, 20], layout, DEMANDS, TWO) == {
        "alpha": Spot("cpu0", 50),
        "beta": Spot("cpu1", 100),
    }  # alone


def test_encoding_numbers_identical_devices_by_the_first_model_they_hold():
    layout = Layout.of("test", DEMANDS, cpus(4096, 4096))
    placement = {"alpha": Spot("cpu1", 45), "beta": Spot("cpu0", TURNS, 2)}
    assert encode(placement, layout).tolist() == [0, 8, 1, 21]
    renumbered = {"alpha": Spot("cpu0", 45), "beta": Spot("cpu1", TURNS, 2)}
    assert decode(encode(placement, layout), layout, DEMANDS, TWO) == renumbered
    assert encode({"beta": Spot("cpu1", 100)}, layout).tolist() == [-1, -1, 0, 19]  # alpha left out
    big = Device(id="big", kind="cpu", index=1, memory_mb=8192, units=100, cores=2.0)
    mixed = Layout.of("test", DEMANDS, [*cpus(4096), big])  # not interchangeable: keep their numbers
    assert encode({"alpha": Spot("big", 100), "beta": Spot("cpu0", 100)}, mixed).tolist() == [1, 19, 0, 19]


def forced_policy(path, layout: Layout, action: list[int]) -> None:
    """A saved actor that always picks `action` (head biases), for the cluster `layout` describes."""
    agent = SACDiscrete(layout.obs_dim, layout.heads, SACConfig(hidden_sizes=(8,)))
    with torch.no_grad():
        for head, choice in zip(agent.actor.heads, action, strict=True):
            head.weight.zero_()
            head.bias.zero_()
            head.bias[choice] = 10.0
    agent.save_actor(path, layout.metadata())


def test_inss_takes_bda_first_then_the_actor_then_bda(lm, tmp_path):
    devices = cpus(4096)
    demands = [Demand("alpha", 150, 300, 100), Demand("beta", 400, 10, 100)]  # 50/50 fails alpha; 75/25 serves
    layout = Layout.of("test", demands, devices, levels=4)
    forced_policy(tmp_path / "p.pt", layout, [0, 2, 0, 0])
    trained = load_trained(tmp_path / "p.pt", "test", ["alpha", "beta"], devices)
    said = []
    out = inss(demands, devices, lm, trained, log=said.append)
    assert {n: (c[0].device, c[0].share) for n, c in out.items()} == {"alpha": ("cpu0", 75), "beta": ("cpu0", 25)}
    assert said[0].startswith("inss deployed the actor's placement: BDA fails on the current placement")
    slower = Judge(demands, devices, lm.with_margin(HEADROOM))  # batches with headroom
    chosen = {"alpha": Spot("cpu0", 75), "beta": Spot("cpu0", 25)}
    assert {n: c[0].batch for n, c in out.items()} == {n: c[0].batch for n, c in slower.choices(chosen).items()}
    light = [Demand("alpha", 150, 50, 100), Demand("beta", 400, 10, 100)]  # spread's 50/50 serves: no actor
    out = inss(light, devices, lm, trained, log=said.append)
    assert {c[0].share for c in out.values()} == {50}
    assert "BDA finds batches that meet every SLO on the current (spread) placement" in said[1]


def test_inss_batches_meet_the_slo_with_the_model_slower_than_predicted_where_they_can(lm, tmp_path):
    devices = cpus(4096)
    demands = [Demand("alpha", 150, 300, 100), Demand("beta", 400, 10, 100)]
    layout = Layout.of("test", demands, devices, levels=4)
    forced_policy(tmp_path / "p.pt", layout, [0, 2, 0, 0])
    trained = load_trained(tmp_path / "p.pt", "test", ["alpha", "beta"], devices)
    out = {n: c[0] for n, c in inss(demands, devices, lm, trained).items()}
    nominal = bda({n: Choice(c.device, c.share) for n, c in out.items()}, demands, devices, lm)
    slower = lm.with_margin(HEADROOM)
    for d in demands:
        others = tuple((m, c.share, c.batch) for m, c in out.items() if m != d.name)
        t = slower.t_inf(d.name, out[d.name].batch, out[d.name].share, others)
        assert task_latency(d.rate, out[d.name].batch, t).p99_ms <= d.slo_ms
    # a plan's own latency margin gets the headroom on top of it, not instead of it
    margined = lm.with_margin(0.3)
    out30 = {n: c[0] for n, c in inss(demands, devices, margined, trained).items()}
    stricter = lm.with_margin(1.3 * (1 + HEADROOM) - 1)
    for d in demands:
        others = tuple((m, c.share, c.batch) for m, c in out30.items() if m != d.name)
        t = stricter.t_inf(d.name, out30[d.name].batch, out30[d.name].share, others)
        assert task_latency(d.rate, out30[d.name].batch, t).p99_ms <= d.slo_ms
    # BDA's own batch for alpha sits at the SLO's edge: 10% slower, it misses
    assert out["alpha"].batch < nominal.batches["alpha"]
    alpha = nominal.batches["alpha"]
    others = (("beta", 25, nominal.batches["beta"]),)
    assert task_latency(300, alpha, slower.t_inf("alpha", alpha, 75, others)).p99_ms > 150


def test_inss_keeps_the_current_placement_where_it_is_predicted_to_serve_more(lm, tmp_path):
    devices = cpus(4096)
    demands = [Demand("alpha", 150, 600, 100), Demand("beta", 400, 10, 100)]  # alpha overloads any share
    layout = Layout.of("test", demands, devices, levels=4)
    forced_policy(tmp_path / "p.pt", layout, [0, 0, 0, 3])  # alpha 25 units, beta 75: worse than 50/50
    trained = load_trained(tmp_path / "p.pt", "test", ["alpha", "beta"], devices)
    said = []
    out = inss(demands, devices, lm, trained, log=said.append)  # not refused: served as well as it can be
    judge = Judge(demands, devices, lm)
    halves = {n: Spot("cpu0", 50) for n in ("alpha", "beta")}
    proposal = {"alpha": Spot("cpu0", 25), "beta": Spot("cpu0", 75)}
    assert sum(judge(halves).served.values()) > sum(judge(proposal).served.values())
    assert {n: c[0].share for n, c in out.items()} == {"alpha": 50, "beta": 50}
    assert "inss deployed the current (spread) placement" in said[0] and "the current one is kept" in said[0]
    assert 0 < judge(halves).served["alpha"] < 600  # served in part, at the batch serving most in time
    assert out["alpha"][0].batch > 1


def test_of_level_proposals_inss_deploys_the_one_serving_most_with_the_model_slower(lm, tmp_path, monkeypatch):
    """Two proposals predicted to serve alike; the first misses some requests with every model HEADROOM slower, the
    second none: the second is deployed, and the plan's note says why."""
    devices = cpus(4096)
    demands = [Demand("alpha", 150, 300, 100), Demand("beta", 400, 40, 100)]
    fragile = {"alpha": Spot("cpu0", 80), "beta": Spot("cpu0", 20)}
    robust = {"alpha": Spot("cpu0", 75), "beta": Spot("cpu0", 25)}
    judge, slower = Judge(demands, devices, lm), Judge(demands, devices, lm.with_margin(HEADROOM))
    assert sum(judge(fragile).served.values()) == pytest.approx(sum(judge(robust).served.values()))
    assert sum(slower(fragile).served.values()) < sum(slower(robust).served.values()) == pytest.approx(340)
    layout = Layout.of("test", demands, devices, levels=4)
    forced_policy(tmp_path / "p.pt", layout, [0, 2, 0, 0])
    trained = load_trained(tmp_path / "p.pt", "test", ["alpha", "beta"], devices)
    module = sys.modules["tritonctl.planning.policies.inss"]
    monkeypatch.setattr(module, "proposals", lambda *_: [fragile, robust])
    chosen = module.decide(demands, devices, lm, trained)
    assert (chosen.source, chosen.placement) == ("actor", robust)
    assert "proposal 2 is deployed" in chosen.why and "serves most with every model 10% slower (340.0)" in chosen.why


def test_the_slower_judge_counts_what_a_cpu_in_turns_serves_once_an_instance_no_longer_keeps_up(lm):
    """Taking turns with a CPU, alpha keeps up at no batch at 400 requests/s: search's judge (what to plan) counts the
    device as serving nothing; the slower judge that inss ranks level proposals by counts what it serves: beta whole,
    alpha in part."""
    demands = [Demand("alpha", 150, 400, 100), Demand("beta", 400, 40, 100)]
    both = {"alpha": Spot("cpu0", TURNS, 1), "beta": Spot("cpu0", TURNS, 1)}
    judge = Judge(demands, cpus(4096), lm)
    assert judge(both).served == {"alpha": 0.0, "beta": 0.0}
    served = slower_judge(judge)(both).served
    assert served["beta"] == pytest.approx(40) and 0 < served["alpha"] < 400


def test_inss_falls_back_to_search_where_the_actor_and_the_current_placement_leave_a_model_unserved(
    lm, tmp_path, monkeypatch
):
    """cpu0 holds one model's memory, cpu1 both. The actor (forced) and the current placement (made so) put both
    models on cpu0, where neither can be deployed: inss deploys search's placement, which serves both, and says
    so."""
    devices = cpus(150, 4096)
    layout = Layout.of("test", DEMANDS, devices, levels=4)
    forced_policy(tmp_path / "p.pt", layout, [0, 1, 0, 1])  # both on cpu0, 50 units each
    trained = load_trained(tmp_path / "p.pt", "test", ["alpha", "beta"], devices)
    both_on_cpu0 = {d.name: Choice("cpu0", 50) for d in DEMANDS}
    module = sys.modules["tritonctl.planning.policies.inss"]  # the package's `inss` is the policy function
    monkeypatch.setattr(module, "current_placement", lambda *_: both_on_cpu0)
    said = []
    out = inss(DEMANDS, devices, lm, trained, log=said.append)
    assert {c.device for cs in out.values() for c in cs} == {"cpu0", "cpu1"}  # one model a device
    assert "inss deployed search's placement" in said[0] and "leaves alpha, beta unserved" in said[0]
    assert "the actor proposes one placement" in said[0]
    judge = Judge(DEMANDS, devices, lm)
    assert judge({n: Spot("cpu0", 50) for n in ("alpha", "beta")}).served == {"alpha": 0, "beta": 0}


def test_inss_adds_replicas_where_the_actors_placement_serves_a_model_short(lm, tmp_path):
    """The actor places one replica a model: alpha at 800 requests/s (SLO 40 ms), more than one device serves,
    on cpu0. inss keeps that placement and adds a replica on cpu1, each sized for half the rate."""
    demands = [Demand("alpha", 40, 800, 100)]
    layout = Layout.of("test", demands, TWO, levels=4)
    forced_policy(tmp_path / "p.pt", layout, [0, 3])  # cpu0, all of it
    trained = load_trained(tmp_path / "p.pt", "test", ["alpha"], TWO)
    judge = Judge(demands, TWO, lm)
    assert judge({"alpha": Spot("cpu0", 100)}).served["alpha"] < 800
    said = []
    out = inss(demands, TWO, lm, trained, log=said.append)
    assert sorted(c.device for c in out["alpha"]) == ["cpu0", "cpu1"]
    assert "inss deployed the actor's placement" in said[0] and "replicas of alpha changed by search's" in said[0]
    placement = {"alpha": Spot("cpu0", 100), "alpha#2": Spot("cpu1", 100)}
    assert judge(placement).served["alpha"] == pytest.approx(800)


def test_inss_refuses_a_policy_for_another_cluster(tmp_path, lm):
    forced_policy(tmp_path / "p.pt", Layout.of("lab-a", DEMANDS, cpus(4096, 4096)), [0, 9, 1, 9])
    with pytest.raises(TritonctlError, match=r"lab-a.*devices cpu0 \(4096 MB\), cpu1 \(4096 MB\), the cluster has cpu"):
        load_trained(tmp_path / "p.pt", "lab-b", ["alpha", "beta"], cpus(4096))
    with pytest.raises(TritonctlError, match=r"models \['alpha', 'beta'\], the cluster has \['beta', 'alpha'\]"):
        load_trained(tmp_path / "p.pt", "lab-a", ["beta", "alpha"], cpus(4096, 4096))
    with pytest.raises(TritonctlError, match="no trained inss policy.*tritonctl train") as missing:
        load_trained(tmp_path / "none.pt", "lab-a", ["alpha", "beta"], cpus(4096, 4096))
    assert missing.value.file == str(tmp_path / "none.pt")
    (tmp_path / "junk.pt").write_text("not torch")
    with pytest.raises(TritonctlError, match=r"not a trained policy that `tritonctl train` writes \(UnpicklingError\)"):
        load_trained(tmp_path / "junk.pt", "lab-a", ["alpha", "beta"], cpus(4096, 4096))
    assert POLICIES["inss"].trained


def tiny(episodes: int, seed: int = 0) -> TrainConfig:
    sac = SACConfig(hidden_sizes=(16,), batch_size=8, buffer_size=100, learning_starts=8)
    return TrainConfig(episodes=episodes, seed=seed, checkpoint_every=2, env=EnvConfig(steps=6), sac=sac)


def log_rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k != "wall_s"} for row in csv.DictReader(f)]


def test_training_is_seeded_and_resume_goes_on_from_the_checkpoint(tmp_path, lm):
    synthetic_dataset(tmp_path / "profile")
    make_mlp(tmp_path / "mlp.onnx")
    cluster = load_cluster(write_cluster(tmp_path, [mlp_model("alpha", rate=120, slo_ms=150), mlp_model("beta")]))
    straight, again, resumed = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train(cluster, lm, straight, straight / "p.pt", tiny(3), progress=False, log=lambda _: None)
    train(cluster, lm, again, again / "p.pt", tiny(3), progress=False, log=lambda _: None)
    assert log_rows(straight / "train.csv") == log_rows(again / "train.csv")  # same seed, same run
    assert len(log_rows(straight / "train.csv")) == 3

    train(cluster, lm, resumed, resumed / "p.pt", tiny(2), progress=False, log=lambda _: None)
    messages = []
    train(cluster, lm, resumed, resumed / "p.pt", tiny(3), resume=True, progress=False, log=messages.append)
    assert messages[0] == "resuming test from episode 2"
    assert log_rows(resumed / "train.csv") == log_rows(straight / "train.csv")  # episode 3 as if never stopped
    assert [r["episode"] for r in log_rows(resumed / "train.csv")] == ["1", "2", "3"]
    assert (resumed / "learning-curve.png").stat().st_size > 5_000
    other = tmp_path / "d"
    train(cluster, lm, other, other / "p.pt", tiny(3, seed=1), progress=False, log=lambda _: None)
    assert log_rows(other / "train.csv") != log_rows(straight / "train.csv")
    trained = load_trained(straight / "p.pt", "test", ["alpha", "beta"], cpus(4096))
    assert trained.layout.models == ("alpha", "beta")
    with pytest.raises(TritonctlError, match="no checkpoint"):
        train(cluster, lm, tmp_path / "e", tmp_path / "e.pt", tiny(3), resume=True, progress=False)
    with pytest.raises(TritonctlError, match="checkpoint is at episode 3, past --episodes 2"):
        train(cluster, lm, resumed, resumed / "p.pt", tiny(2), resume=True, progress=False)
    huge = load_cluster(write_cluster(tmp_path, [mlp_model("alpha", memory_mb=9000)]))
    with pytest.raises(TritonctlError, match="cannot train for this cluster.*fits on no device"):
        train(huge, lm, tmp_path / "f", tmp_path / "f.pt", tiny(1), progress=False)


def test_fine_tuning_starts_the_actor_from_a_trained_policy_and_holds_it_until_the_critics_learn(tmp_path, lm):
    synthetic_dataset(tmp_path / "profile")
    make_mlp(tmp_path / "mlp.onnx")
    cluster = load_cluster(write_cluster(tmp_path, [mlp_model("alpha", rate=120, slo_ms=150), mlp_model("beta")]))
    start = tiny(1)
    start.sac.hidden_sizes = (24,)  # not tiny's: the fine-tuned agent takes the start's shape
    train(cluster, lm, tmp_path / "start", tmp_path / "start.pt", start, progress=False, log=lambda _: None)

    def tune(name: str, actor_delay: int, **kwargs):
        config = tiny(3)
        config.sac.actor_delay = actor_delay
        train(cluster, lm, tmp_path / name, tmp_path / f"{name}.pt", config, progress=False, log=lambda _: None,
              **kwargs)  # fmt: skip
        return torch.load(tmp_path / f"{name}.pt", weights_only=True)

    before = torch.load(tmp_path / "start.pt", weights_only=True)
    held = tune("held", actor_delay=1_000, init=tmp_path / "start.pt")  # more than the 18 steps' updates
    assert all(torch.equal(held["actor"][k], t) for k, t in before["actor"].items())
    assert held["metadata"]["training"]["init"] == str(tmp_path / "start.pt")
    moved = tune("moved", actor_delay=0, init=tmp_path / "start.pt")
    assert not all(torch.equal(moved["actor"][k], t) for k, t in before["actor"].items())
    assert moved["hidden_sizes"] == [24]

    (tmp_path / "other").mkdir()
    make_mlp(tmp_path / "other" / "mlp.onnx")
    other = load_cluster(write_cluster(tmp_path / "other", [mlp_model("beta"), mlp_model("alpha", rate=120)]))
    with pytest.raises(TritonctlError, match="trained for models \\['alpha', 'beta'\\], the cluster has"):
        train(other, lm, tmp_path / "x", tmp_path / "x.pt", tiny(1), progress=False, init=tmp_path / "start.pt")
    with pytest.raises(TritonctlError, match="no policy to start from"):
        train(cluster, lm, tmp_path / "y", tmp_path / "y.pt", tiny(1), progress=False, init=tmp_path / "none.pt")
    with pytest.raises(TritonctlError, match="--resume or --init"):
        train(cluster, lm, tmp_path / "held", tmp_path / "held.pt", tiny(3), resume=True, init=tmp_path / "start.pt")
    tune("resumed", actor_delay=1_000, init=tmp_path / "start.pt")
    config = tiny(4)
    train(cluster, lm, tmp_path / "resumed", tmp_path / "resumed.pt", config, resume=True, progress=False,
          log=lambda _: None)  # fmt: skip
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert resumed["metadata"]["training"]["init"] == str(tmp_path / "start.pt")  # the checkpoint remembers it


def test_plan_cli_uses_a_matching_policy_file_and_refuses_another(tmp_path, capsys, lm):
    synthetic_dataset(tmp_path / "profile")
    assert main(["fit", str(tmp_path / "profile")]) == 0
    make_mlp(tmp_path / "mlp.onnx")
    models = [mlp_model("alpha", rate=300, slo_ms=150), mlp_model("beta", rate=10, slo_ms=400)]
    cluster = write_cluster(tmp_path, models)
    demands = [Demand("alpha", 150, 300, 100), Demand("beta", 400, 10, 100)]
    forced_policy(tmp_path / "ok.pt", Layout.of("test", demands, cpus(4096)), [0, 7, 0, 2])
    forced_policy(tmp_path / "other.pt", Layout.of("other", demands, cpus(4096, 4096)), [0, 7, 0, 2])
    lm_file = str(tmp_path / "profile" / "latency-model.json")
    args = ["plan", str(cluster), "--policy", "inss", "--latency-model", lm_file]
    capsys.readouterr()
    assert main([*args, "--policy-file", str(tmp_path / "other.pt")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "other.pt") in err and "trained for cluster 'other' and does not fit 'test'" in err
    assert main([*args, "--policy-file", str(tmp_path / "ok.pt"), "-o", str(tmp_path / "plan.yaml")]) == 0
    plan = load_plan(tmp_path / "plan.yaml").plan
    assert plan.policy == "inss" and not plan.unserved and {m.name for m in plan.models} == {"alpha", "beta"}
    assert len(plan.notes) == 1 and plan.notes[0].startswith("inss deployed the actor's placement")


def test_imitation_fits_the_actor_to_search_and_reuses_its_demonstrations(tmp_path, lm, monkeypatch, capsys):
    synthetic_dataset(tmp_path / "profile")
    make_mlp(tmp_path / "mlp.onnx")
    models = [mlp_model("alpha", rate=300, slo_ms=150), mlp_model("beta", rate=10, slo_ms=400)]
    cluster = load_cluster(write_cluster(tmp_path, models))
    config = ImitationConfig(demonstrations=40, epochs=60, batch_size=8, hidden_sizes=(32,))
    said = []
    rows = imitate(cluster, lm, tmp_path / "run", tmp_path / "p.pt", config, progress=False, log=said.append)
    assert len(rows) == 60 and rows[-1]["loss"] < rows[0]["loss"] / 2
    assert log_rows(tmp_path / "run" / "imitate.csv")[0]["epoch"] == "1"
    assert (tmp_path / "run" / "imitation-curve.png").stat().st_size > 5_000
    assert "of heads as search chose, predicted goodput" in said[0]
    trained = load_trained(tmp_path / "p.pt", "test", ["alpha", "beta"], cpus(4096))
    assert trained.actor.metadata["training"]["method"] == "imitate"
    assert trained.actor.metadata["latency_model_device"]["id"] == lm.device.fingerprint["id"]
    demands, devices = [Demand("alpha", 150, 300, 100), Demand("beta", 400, 10, 100)], cpus(4096)
    notes = []
    out = inss(demands, devices, lm, trained, log=notes.append)  # spread's 50/50 fails alpha: the actor decides
    assert "the actor's placement" in notes[0]
    judge = Judge(demands, devices, lm)
    placement = {n: Spot(c[0].device, TURNS if c[0].turns else c[0].share, len(c)) for n, c in out.items()}
    assert sum(judge(placement).served.values()) >= 0.99 * 310  # as much as search serves: every request

    def no_search(*_, **__):
        raise AssertionError("search ran again")

    monkeypatch.setattr("tritonctl.rl.imitate.climb", no_search)  # the demonstrations are reused
    imitate(cluster, lm, tmp_path / "run", tmp_path / "q.pt", config, progress=False, log=said.append)
    assert said[1] == said[0].replace("p.pt", "q.pt")  # and the same seed fits the same actor
    with pytest.raises(AssertionError, match="search ran again"):  # labels of another latency model: made anew
        imitate(cluster, lm.with_margin(0.1), tmp_path / "run", tmp_path / "r.pt", config, progress=False)
    lm_file = str(tmp_path / "profile" / "latency-model.json")
    assert main(["fit", str(tmp_path / "profile")]) == 0
    capsys.readouterr()
    assert main(["train", str(cluster.path), "--latency-model", lm_file, "--episodes", "3"]) == 2
    assert "--episodes: only with --method sac, not imitate" in capsys.readouterr().err
    assert main(["train", str(cluster.path), "--latency-model", lm_file, "--demonstrations", "5"]) == 2
    assert "--demonstrations must be at least 10, not 5" in capsys.readouterr().err


def test_the_controller_replans_with_a_trained_policy_where_one_fits_and_search_otherwise(tmp_path, lm, monkeypatch):
    synthetic_dataset(tmp_path / "profile")
    make_mlp(tmp_path / "mlp.onnx")
    cluster = load_cluster(write_cluster(tmp_path, [mlp_model("alpha", rate=300, slo_ms=150), mlp_model("beta")]))
    policy = tmp_path / "test.pt"
    monkeypatch.setattr("tritonctl.planning.planner.default_policy_file", lambda name: tmp_path / f"{name}.pt")
    assert replan_policy(cluster, lm) == ("search", f"no trained inss policy {policy}")
    forced_policy(policy, Layout.of("test", DEMANDS, cpus(4096, 4096)), [0, 9, 1, 9])  # two devices: not this one
    chosen, why = replan_policy(cluster, lm)
    assert chosen == "search" and "the cluster has cpu0 (4096 MB)" in why
    forced_policy(policy, Layout.of("test", DEMANDS, cpus(4096)), [0, 9, 0, 9])
    assert replan_policy(cluster, lm) == ("inss", f"the trained policy {policy} fits the cluster")
    assert replan_policy(cluster, None)[0] == "search"  # no latency model, no re-planning by inss
    monkeypatch.undo()
    demo = load_cluster(REPO / "examples/cpu-demo/cluster.yaml")  # the shipped demo has its policy
    demo_lm = load_latency_model(REPO / "profiles/cpu-demo/latency-model.json")
    assert replan_policy(demo, demo_lm)[0] == "inss"
    # calibrated to another CPU, the model's numbers are not those the actor learned from: search re-plans
    elsewhere = {**demo_lm.device.fingerprint, "id": "0123456789ab", "model": "AMD EPYC"}
    calibrated = LatencyModel(dataclasses.replace(demo_lm.device, fingerprint=elsewhere), demo_lm.models, demo_lm.meta)
    chosen, why = replan_policy(demo, calibrated)
    assert chosen == "search" and "it learned from a latency model of Intel(R) Xeon(R) Processor" in why
    assert "this one describes AMD EPYC (id 0123456789ab); train one on it with `tritonctl train`" in why

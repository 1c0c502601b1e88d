"""One definition of the reward heads (common/rewards.RewardHeads): their names, the weight w_h of
each and the composite R = Σ_h w_h·S_h, the same in the reward client the rollout actors score
with, in the learner's per-head advantages and in `vgrpo eval`; two reward models that report one
head name are refused in one line before anything runs."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from cluster.cli import main
from common import toyworld as tw
from common.config import ConfigError, load_config
from common.rewards import RewardHeads
from common.sde import Sage, Schedule
from common.types import Condition, Group, Scores, TrainBatch, Trajectory
from reward_worker.base import RewardModel

SHARED = "rewards.models=[{name: toy, weights: {TA: 2.0}}, {name: toy_i2v}]"
SHARED_LINE = ("rewards.models[0] (toy) and rewards.models[1] (toy_i2v) both report a head named 'VQ'; "
               "head names must be unique across reward models: drop one of the two models")


# --- 1. a head name two models share: one line, before anything runs ---------------------------

def test_a_shared_head_name_is_refused_by_train_and_eval_in_one_line(tmp_path, capsys, monkeypatch):
    import rollout_worker.sampler

    sampled = []
    monkeypatch.setattr(rollout_worker.sampler, "sample_videos", lambda *a, **k: sampled.append(a))
    assert main(["train", "-c", "configs/quickstart.yaml", SHARED, f"run.root={tmp_path / 'runs'}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {SHARED_LINE}"
    assert not (tmp_path / "runs").exists()
    cfg = tmp_path / "two.yaml"
    cfg.write_text(_yaml("configs/quickstart.yaml", SHARED))
    assert main(["eval", "base", "-c", str(cfg), "--seeds", "1", "--out", str(tmp_path / "ev")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {SHARED_LINE}"
    assert sampled == [] and not (tmp_path / "ev").exists()  # refused before any video was sampled


def _yaml(base: str, override: str) -> str:
    import yaml

    data = yaml.safe_load(open(base, encoding="utf-8"))
    data["rewards"]["models"] = yaml.safe_load(override.split("=", 1)[1])
    return yaml.safe_dump(data)


def test_the_toy_i2v_config_passes_preflight():
    """Its reward (toy_i2v) has a scorer; preflight's list of scorers is the registry's."""
    from cluster.driver.preflight import preflight

    preflight(load_config("configs/toy_i2v.yaml"))


# --- 2. the same weights in the client, the learner and `vgrpo eval` ----------------------------

class Brightness(RewardModel):
    """A stand-in for HPSv3 (its one head, HPS): the mean pixel value in [0, 1]."""

    heads = ("HPS",)

    def __init__(self, cfg):
        pass

    def score(self, frames, prompts, images=None):
        return frames.float().mean(dim=(1, 2, 3, 4)).view(-1, 1) / 255.0


def factory(cfg):
    from reward_worker.registry import build_reward_model

    return Brightness(cfg) if cfg.name == "hpsv3" else build_reward_model(cfg)


WEIGHTS = {"VQ": 0.5, "MQ": 1.0, "TA": 2.0, "HPS": 3.0}  # as the config below spells them


def _videos() -> tuple[torch.Tensor, list[str]]:
    """Four toy-world videos with some noise, so every head has spread. uint8 [4, F, H, W, 3]"""
    prompts = ["a red square moving left", "a blue square moving up", "a green square moving right",
               "a red square moving down"]
    rng = np.random.default_rng(0)
    v = np.stack([tw.render(p).astype(np.int16) + rng.integers(-a, a + 1, (tw.NUM_FRAMES, tw.SIZE, tw.SIZE, 3))
                  for p, a in zip(prompts, (10, 30, 60, 90), strict=True)])
    return torch.from_numpy(v.clip(0, 255).astype(np.uint8)), prompts


def _traj(cond: Condition, member: int) -> Trajectory:
    g = torch.Generator().manual_seed(member)
    shape = (3, 2, 4, 4)
    return Trajectory(condition=cond, group_id="g", member=member, seed=member,
                      spec=Sage(0.5).spec(Schedule.explicit([1.0, 0.5, 0.0])),
                      guidance_scale=1.0, policy_version=0, step_indices=[0],
                      x=torch.randn(1, *shape, generator=g), x_next=torch.randn(1, *shape, generator=g),
                      logp_old=torch.randn(1, generator=g), final_latents=torch.zeros(shape),
                      mu_old=torch.randn(1, *shape, generator=g))


def test_client_learner_and_eval_weigh_the_heads_alike(ray_session, tmp_path):
    from cluster.evaluation.policy import score
    from common.actors import kill_and_wait
    from learner.rows import build_rows
    from reward_worker.actor import RewardClient, actor_names, create_reward_actors

    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    cfg = load_config("configs/quickstart.yaml", [
        "rewards.models=[{name: toy, weights: {VQ: 0.5, TA: 2.0}}, {name: hpsv3, weights: {HPS: 3.0}}]",
        "grpo.per_head_advantages=true", "grpo.adv_clip=100"])
    frames, prompts = _videos()
    actors = create_reward_actors(cfg.rewards.models, cfg.pools.reward, factory)
    try:
        client = RewardClient(actors, dict(zip(actor_names(cfg.rewards.models), cfg.rewards.models, strict=True)))
        scores = client.score(frames, prompts)
    finally:
        kill_and_wait([a for acts in actors.values() for a in acts])
    # the client: every head once, with the weight its model's config gives it (else 1)
    assert list(client.heads.names) == scores.heads == ["VQ", "MQ", "TA", "HPS"]
    assert client.heads.weights == tuple(WEIGHTS[h] for h in scores.heads)
    s = scores.values.double().numpy()                                        # [4, 4]
    w = np.array([WEIGHTS[h] for h in scores.heads])
    assert np.isfinite(s).all() and (s.std(axis=0) > 1e-3).all()
    composite = client.heads.composite(scores)
    np.testing.assert_allclose(composite.numpy(), s @ w, rtol=1e-6)
    # `vgrpo eval`'s scoring, in this process: the same scores and composite, bit for bit
    offline, offline_composite = score(cfg, frames, prompts, factory=factory)
    assert offline.heads == scores.heads and torch.equal(offline.values, scores.values)
    assert torch.equal(offline_composite, composite)
    # the learner: A_i = Σ_h w_h·(S_ih − mean_h)/(std_h + 1e-8), the config's weights (DanceGRPO)
    cond = Condition("c", prompts[0])
    group = Group(cond, "g", 0, [_traj(cond, i) for i in range(4)], scores, composite)
    rows = build_rows(TrainBatch([group], [[]]), cfg)
    want = ((s - s.mean(0)) / (s.std(0) + 1e-8)) @ w
    np.testing.assert_allclose(rows.adv.numpy(), want, rtol=1e-5, atol=1e-5)


def test_composite_is_the_weighted_sum_in_head_order():
    """R = Σ_h w_h·S_h, exactly what the composite was before RewardHeads (a head without a
    weight gets 1), and scores whose heads are not the run's are refused."""
    from common.config import RewardModelConfig

    cfgs = [RewardModelConfig(name="toy", weights={"TA": 2.0, "VQ": 0.25})]
    heads = RewardHeads.build(cfgs, [("VQ", "MQ", "TA")])
    values = torch.tensor([[0.1, 0.2, 0.3], [1.0, -0.5, 0.25]])
    old = values.float() @ torch.tensor([0.25, 1.0, 2.0], dtype=torch.float32)
    assert torch.equal(heads.composite(Scores(["VQ", "MQ", "TA"], values)), old)
    assert heads == RewardHeads.of(cfgs, ["VQ", "MQ", "TA"])  # the learner's view: the same heads
    with pytest.raises(ValueError, match="scores carry heads"):
        heads.composite(Scores(["MQ", "VQ", "TA"], values))
    # two models that weigh one head differently: refused, naming both
    two = [cfgs[0], RewardModelConfig(name="hpsv3", weights={"TA": 1.0})]
    with pytest.raises(ConfigError, match=r"rewards.models\[0\].weights and rewards.models\[1\].weights"):
        RewardHeads.build(two, [("VQ", "MQ", "TA"), ("HPS",)])

"""Held-out evaluation keeps the videos off the driver (real Ray, real toy model and reward).

1. `Driver.evaluate`: every rollout actor samples and scores its share; the driver takes out of
   Ray the score rows and the frames of the pairs it renders only (here 18 of 64 videos), and its
   results, GIF, tracker grid and before_after.png equal the old recipe's: every video sampled into
   this process, scored by the reward models directly (`cluster.evaluation.policy.score`).
2. `score_pairs` with a reward that gives NaN for some videos keeps those rows (NaN, not dropped);
   a reward that raises surfaces as RewardFailed naming the model, as the driver's own client did.
"""

from __future__ import annotations

import sys

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from common.config import load_config

EVAL_PROMPTS = [f"a {c} square moving {d}" for c in ("red", "green", "blue", "yellow")
                for d in ("left", "right")]
SEEDS = 8            # 8 prompts x 8 seeds = 64 pairs
# rendered: before_after.png shows 4 prompts x 4 seeds (16 pairs; the GIFs' first seeds are among
# them); the tracker grid's 6 videos are the first seed of prompts 0..5, adding prompts 4 and 5
RENDERED = 4 * 4 + 2


def _cfg(tmp_path, *extra: str):
    train = tmp_path / "train.txt"
    train.write_text("a red square moving left\n")
    evals = tmp_path / "eval.txt"
    evals.write_text("\n".join(EVAL_PROMPTS) + "\n")
    return load_config("configs/quickstart.yaml", [
        f"train.prompts={train}", f"train.eval_prompts={evals}", f"train.eval_seeds={SEEDS}",
        "train.steps=1", "schedule.steps=4", "log.video_pairs=6", "pools.rollout.num_actors=2",
        f"run.root={tmp_path}", "run.name=evalplane", *extra])


class FramesTaken:
    """What this process takes out of Ray: videos (uint8, 4+ dims) and the bytes they hold,
    counted by storage, so a view that drags its whole batch along counts as the batch."""

    def __init__(self, monkeypatch):
        import ray

        self.videos, self.bytes = 0, 0
        real_get = ray.get

        def get(refs, *a, **kw):
            out = real_get(refs, *a, **kw)
            self._walk(out)
            return out

        monkeypatch.setattr(ray, "get", get)

    def _walk(self, obj) -> None:
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.uint8 and obj.ndim >= 4:
            self.videos += 1 if obj.ndim == 4 else obj.shape[0]
            self.bytes += obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                self._walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                self._walk(v)


def test_evaluation_brings_only_the_rendered_frames_and_scores_as_before(ray_session, tmp_path, monkeypatch):
    from rich.console import Console

    from cluster.data.manifests import side_by_side
    from cluster.data.prompts import load_prompts
    from cluster.driver.driver import Driver
    from cluster.driver.lifecycle import write_grid
    from cluster.evaluation.before_after import write_before_after
    from cluster.evaluation.eval_set import EvalSet, grid_pairs
    from cluster.evaluation.evaluate import sample_pairs
    from cluster.evaluation.policy import score
    from cluster.runs.media import write_gif
    from cluster.runs.run_dir import RunDir
    from cluster.runs.tracking import encode_gif, tiled
    from common.toyworld import eval_seeds

    cfg = _cfg(tmp_path)
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        taken = FramesTaken(monkeypatch)
        before = driver.evaluate("before", gifs=2)
        after = driver.evaluate("after", gifs=2)  # same weights: the before/after grid is its own twin
        monkeypatch.undo()
        # the old recipe: every video into this process, scored by the reward models here
        pairs = [(p, s) for p in EVAL_PROMPTS for s in eval_seeds(SEEDS)]
        frames = sample_pairs(driver.rollouts, EvalSet.of_pairs(pairs))
    finally:
        monkeypatch.undo()
        driver.teardown()
    video_bytes = frames[0].numel()
    assert len(pairs) == 64 and len(before.composite) == 64
    # 1. two evaluations took 2 x 18 videos out of Ray, not 2 x 64, and no more bytes than those
    assert taken.videos == 2 * RENDERED, taken.videos
    assert taken.bytes == 2 * RENDERED * video_bytes, (taken.bytes, video_bytes)
    b, per = driver.eval_frames["before"]
    assert b.shape == (16, *frames.shape[1:]) and per == 4
    # 2. the same scores, bit for bit
    scores, composite = score(cfg, frames, [p for p, _ in pairs])
    for result in (before, after):
        assert result.heads == scores.heads
        assert np.array_equal(result.values, scores.values.numpy())
        assert np.array_equal(result.composite, composite.numpy())
    # 3. the same pictures: before_after.png, the GIFs, the tracker's grid video
    write_grid(driver, run_dir, Console(file=open(tmp_path / "console.txt", "w")))  # noqa: SIM115
    old = write_before_after(tmp_path / "old.png", frames.numpy(), frames.numpy(), SEEDS, list(EVAL_PROMPTS),
                             trails=True)  # the toy world: the square's path drawn, as the run draws it
    assert np.array_equal(iio.imread(run_dir.path / "before_after.png"), iio.imread(old))
    conds = load_prompts(cfg.train.eval_prompts)
    for i in range(2):  # the first seed of the first two prompts
        want = write_gif(side_by_side(frames[i * SEEDS].numpy(), conds[i], cfg.model), tmp_path / f"old_{i}.gif")
        got = run_dir.samples / f"before_{i}_{EVAL_PROMPTS[i].replace(' ', '_')}.gif"
        assert got.read_bytes() == want.read_bytes()
    grid = run_dir.samples / "videos" / "videos_before_step000000.gif"
    assert grid.read_bytes() == encode_gif(tiled(frames.numpy()[grid_pairs(len(pairs), SEEDS, 6)]), cfg.log.video_fps)


class Poisoned:
    """The toy reward, except: NaN for blue squares, and it raises on any batch with a yellow one."""

    def __init__(self, cfg):
        from reward_worker.registry import build_reward_model

        self.inner = build_reward_model(cfg)

    def head_names(self) -> list[str]:
        return self.inner.head_names()

    def score(self, frames, prompts, images=None):
        if any("yellow" in p for p in prompts):
            raise RuntimeError("scorer exploded")
        out = self.inner.score(frames, prompts, images).clone()
        out[[i for i, p in enumerate(prompts) if "blue" in p]] = float("nan")
        return out


def test_nan_rows_are_kept_and_a_failing_reward_is_named(ray_session, tmp_path):
    from cluster.evaluation.eval_set import EvalSet
    from cluster.evaluation.evaluate import sample_pairs, score_pairs
    from cluster.evaluation.policy import score
    from common.actors import kill_and_wait
    from reward_worker.actor import RewardFailed, create_reward_actors
    from rollout_worker.actor import RolloutActor

    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    cfg = _cfg(tmp_path)
    rewards = create_reward_actors(cfg.rewards.models, cfg.pools.reward, Poisoned)
    rollouts = [RolloutActor.options(resources={"rollout": 1}, num_cpus=0).remote(cfg, i, None, None, rewards)
                for i in range(2)]
    try:
        pairs = [(p, s) for p in ("a red square moving left", "a blue square moving up") for s in (1, 2, 3)]
        scores, kept = score_pairs(rollouts, EvalSet.of_pairs(pairs), keep={4})
        frames = sample_pairs(rollouts, EvalSet.of_pairs(pairs))
        with pytest.raises(RewardFailed, match="reward model 'toy' failed.*scorer exploded"):
            score_pairs(rollouts, EvalSet.of_pairs([("a yellow square moving down", 1), *pairs]))
    finally:
        kill_and_wait([*rollouts, *rewards["toy"]])
    assert list(kept) == [4] and torch.equal(kept[4], frames[4])
    nan = ~torch.isfinite(scores.values).all(dim=1)
    assert nan.tolist() == [False] * 3 + [True] * 3      # every pair kept, the blue ones NaN
    want, _ = score(cfg, frames[:3], [p for p, _ in pairs[:3]])
    assert torch.equal(scores.values[:3], want.values)

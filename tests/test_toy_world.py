"""The toy world's generator and its verifiable rewards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common import toyscore
from common import toyworld as tw
from reward_worker.models.toy import ToyReward

# --- prompts and split ---------------------------------------------------------------


def test_parse_prompt_reads_the_words_and_names_unknown_ones():
    spec = tw.parse_prompt("A Blue square moving UP.")
    assert (spec.colour, spec.shape, spec.direction) == ("blue", "square", "up")
    assert spec.prompt == "a blue square moving up"
    with pytest.raises(ValueError, match="unknown colour 'purple'"):
        tw.parse_prompt("a purple square moving up")
    with pytest.raises(ValueError, match="unknown direction 'sideways'"):
        tw.parse_prompt("a red square moving sideways")
    with pytest.raises(ValueError, match="does not read"):
        tw.parse_prompt("red square, left")


def test_train_and_eval_prompts_are_disjoint_and_compositional():
    assert len(tw.WORLD_PROMPTS) == 16 and len(set(tw.WORLD_PROMPTS)) == 16
    assert not set(tw.TRAIN_PROMPTS) & set(tw.EVAL_PROMPTS)
    assert set(tw.TRAIN_PROMPTS) | set(tw.EVAL_PROMPTS) == set(tw.WORLD_PROMPTS)
    train = [tw.parse_prompt(p) for p in tw.TRAIN_PROMPTS]
    for p in tw.EVAL_PROMPTS:           # every eval word is seen in training, never together
        s = tw.parse_prompt(p)
        assert any(t.colour == s.colour for t in train) and any(t.direction == s.direction for t in train)
    seeds = tw.eval_seeds(8)
    assert min(seeds) >= tw.EVAL_SEED_BASE and len(set(seeds)) == 8
    assert tw.eval_pairs(2)[:2] == [(tw.EVAL_PROMPTS[0], seeds[0]), (tw.EVAL_PROMPTS[0], seeds[1])]


# --- renderer ------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", tw.WORLD_PROMPTS)
def test_render_draws_what_the_prompt_says(prompt):
    spec = tw.parse_prompt(prompt)
    rng = np.random.default_rng(7)
    for s in (spec, tw.random_spec(prompt, rng), tw.random_spec(prompt, rng)):
        v = tw.render(s)
        assert v.shape == (6, 16, 16, 3) and v.dtype == np.uint8
        mask = v.max(-1) == 255                                          # fully covered pixels
        assert np.all(v[mask] == np.asarray(tw.COLOURS[spec.colour]))
        for f in range(6):                                               # the whole square stays in frame
            assert v[f].max(-1).sum() / 255 == pytest.approx(tw.SIDE**2, abs=0.05)
        c, _ = toyscore.centroids(toyscore.foreground(v))
        d = c[-1] - c[0]
        assert d == pytest.approx(np.asarray(tw.DIRECTIONS[spec.direction]) * tw.travel(), abs=0.05)
        step = np.diff(c, axis=0)
        assert np.allclose(step, step[0], atol=0.05)                     # constant speed


def test_random_start_varies_and_i2v_condition_is_the_first_frame():
    rng = np.random.default_rng(0)
    starts = {tw.random_spec("a red square moving left", rng).start for _ in range(20)}
    assert len(starts) > 5
    img = tw.i2v_condition("a red square moving left", 123)
    spec = tw.i2v_spec("a red square moving left", np.random.default_rng(123))
    assert np.array_equal(img, tw.render(spec)[0])
    assert not np.array_equal(img, tw.i2v_condition("a red square moving left", 124))
    # the image does not give the direction away: every direction starts from the same frame
    for d in tw.DIRECTIONS:
        assert np.array_equal(img, tw.i2v_condition(f"a red square moving {d}", 123))
        video = tw.i2v_video(f"a red square moving {d}", 123)
        assert video.min() == 0 and np.all(video.max(axis=(1, 2, 3)) == 255)   # inside the frame throughout


# --- rewards -------------------------------------------------------------------------

P = "a red square moving right"


def _heads(video, prompt=P):
    return toyscore.score_video(video, prompt)


def _jitter(prompt, amp=1.5, seed=0):
    spec = tw.parse_prompt(prompt)
    corners = tw.path(spec) + np.random.default_rng(seed).uniform(-amp, amp, (6, 2))
    return tw.render_corners(np.clip(corners, 0, 16 - tw.SIDE), spec.colour)


def test_a_perfect_video_scores_high_on_every_head():
    rng = np.random.default_rng(1)
    for prompt in tw.WORLD_PROMPTS:
        h = _heads(tw.render(tw.random_spec(prompt, rng)), prompt)
        assert min(h["VQ"], h["MQ"], h["TA"]) > 0.95, (prompt, h)
        assert h["direction_correct"] == 1.0


def test_wrong_colour_lowers_ta_only():
    good, bad = _heads(tw.render(P)), _heads(tw.render("a blue square moving right"))
    assert bad["TA"] < good["TA"] - 0.4
    assert bad["VQ"] == pytest.approx(good["VQ"], abs=0.01) and bad["MQ"] == pytest.approx(good["MQ"], abs=0.01)


def test_wrong_direction_lowers_ta_only():
    good, bad = _heads(tw.render(P)), _heads(tw.render("a red square moving left"))
    assert bad["TA"] < good["TA"] - 0.4 and bad["direction_correct"] == 0.0
    assert bad["VQ"] == pytest.approx(good["VQ"], abs=0.01) and bad["MQ"] == pytest.approx(good["MQ"], abs=0.01)


def test_jitter_lowers_mq():
    good = _heads(tw.render(P))
    jit = [_heads(_jitter(P, seed=s)) for s in range(4)]
    assert max(h["MQ"] for h in jit) < good["MQ"] - 0.25
    assert min(h["VQ"] for h in jit) > 0.9                               # still a crisp square


def test_noise_lowers_vq():
    v = tw.render(P)
    good = _heads(v)
    noisy = np.clip(v + np.random.default_rng(0).normal(0, 40, v.shape), 0, 255).astype(np.uint8)
    h = _heads(noisy)
    assert h["VQ"] < good["VQ"] - 0.3
    assert h["colour"] > 0.9                                             # the square's colour is still read


def test_empty_or_static_videos_score_low():
    empty = _heads(np.zeros((6, 16, 16, 3), np.uint8))
    assert empty["VQ"] == 0.0 and empty["MQ"] == 0.0 and empty["TA"] == 0.0
    still = _heads(np.repeat(tw.render(P)[:1], 6, axis=0))
    assert still["direction"] == 0.0 and still["MQ"] < _heads(tw.render(P))["MQ"] - 0.25


def test_toy_reward_model_scores_a_batch_and_weights_the_composite():
    frames = torch.from_numpy(np.stack([tw.render(P), tw.render("a red square moving left")]))
    rm = ToyReward({"TA": 2.0})
    vals = rm.score(frames, [P, P])
    assert vals.shape == (2, 3) and vals.dtype == torch.float32
    assert rm.head_names() == ["VQ", "MQ", "TA"]
    assert torch.allclose(rm.composite(vals), vals[:, 0] + vals[:, 1] + 2 * vals[:, 2])
    assert rm.composite(vals)[0] > rm.composite(vals)[1] + 0.8


def test_toy_reward_marks_unscorable_prompts_nan_and_rejects_bad_input():
    frames = torch.from_numpy(np.stack([tw.render(P)] * 2))
    vals = ToyReward().score(frames, [P, "a dog running"])
    assert torch.isfinite(vals[0]).all() and all(math.isnan(x) for x in vals[1].tolist())
    with pytest.raises(ValueError, match="uint8"):
        ToyReward().score(frames.float(), [P, P])
    with pytest.raises(ValueError, match="2 videos"):
        ToyReward().score(frames, [P])
    with pytest.raises(ValueError, match="unknown head"):
        ToyReward({"XX": 1.0})


def test_the_parts_locate_what_changed_in_a_video():
    """visual_parts / motion_parts (benchmarks/toy_parts.py) against the world's own geometry: a
    rendered square has its true area and the world's speed; grown, only mass and size move;
    jittered, only smoothness does."""
    v = tw.render(P)
    vp, mp = toyscore.visual_parts(v), toyscore.motion_parts(v)
    assert vp["mass/area"] == pytest.approx(np.ones(6), abs=0.05) and vp["size"].min() > 0.95
    assert mp["|d|/v*"] == pytest.approx(1.0, abs=0.05) and mp["speed"] > 0.95
    grown = np.maximum(v, np.roll(v, 2, axis=1))           # the square smeared 2 px down in every frame
    gp = toyscore.visual_parts(grown)
    assert gp["mass/area"].mean() > 1.3 and gp["size"].mean() < vp["size"].mean() - 0.2
    assert gp["crisp"].mean() == pytest.approx(vp["crisp"].mean(), abs=0.05)
    jp = toyscore.motion_parts(_jitter(P, seed=0))
    assert jp["smooth"] < mp["smooth"] - 0.3 and jp["|d|/v*"] == pytest.approx(1.0, abs=0.3)
    assert toyscore.motion_parts(np.zeros((6, 16, 16, 3), np.uint8)) is None

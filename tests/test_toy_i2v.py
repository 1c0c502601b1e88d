"""The toy I2V world: Wan-style first-frame conditioning, the IA head, the committed I2V base."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common import toyscore
from common import toyworld as tw
from common.config import load_config
from reward_worker.models.toy import ToyI2VReward
from rollout_worker.models.toy import BASE_CHECKPOINT, BASE_I2V_CHECKPOINT, ToyVideoModel
from rollout_worker.models.toy_pretrain import eval_images, ode_sample, pretrain

P = "a green square moving down"


# --- the IA head ---------------------------------------------------------------------------


def test_ideal_i2v_video_scores_one_on_every_head():
    for seed in range(5):
        video, img = tw.i2v_video(P, seed), tw.i2v_condition(P, seed)
        s = toyscore.score_video(video, P, img)
        for h in toyscore.I2V_HEADS:
            assert s[h] > 0.97, (h, s)


def test_ia_parts_each_catch_their_defect():
    video, img = tw.i2v_video(P, 3), tw.i2v_condition(P, 3)
    good = toyscore.image_alignment(video, img)
    elsewhere = toyscore.image_alignment(tw.i2v_video(P, 4), img)          # starts somewhere else
    recoloured = toyscore.image_alignment(tw.i2v_video("a red square moving down", 3), img)
    shrunk = (video.astype(np.float64) * np.linspace(1, 0.3, 6)[:, None, None, None]).astype(np.uint8)
    faded = toyscore.image_alignment(shrunk, img)                          # the square loses mass
    assert good["IA"] > 0.97
    assert elsewhere["match"] < good["match"] - 0.3 and elsewhere["IA"] < good["IA"] - 0.1
    assert recoloured["keep_colour"] < 0.01 and recoloured["IA"] < 0.3
    assert faded["keep_size"] < good["keep_size"] - 0.2
    # the direction is the prompt's business: a wrong direction keeps IA, loses TA
    wrong = tw.i2v_video("a green square moving up", 3)
    assert toyscore.image_alignment(wrong, img)["IA"] > 0.97
    assert toyscore.score_video(wrong, P, img)["TA"] < 0.6


def test_toy_i2v_reward_needs_images():
    rm = ToyI2VReward()
    frames = torch.from_numpy(np.stack([tw.i2v_video(P, 0), tw.i2v_video(P, 1)]))
    imgs = torch.from_numpy(np.stack([tw.i2v_condition(P, 0), tw.i2v_condition(P, 0)]))
    out = rm.score(frames, [P, P], imgs)
    assert list(rm.heads) == ["VQ", "MQ", "TA", "IA"] and tuple(out.shape) == (2, 4)
    assert out[0, 3] > 0.97 and out[1, 3] < out[0, 3] - 0.1               # video 1 starts elsewhere
    with pytest.raises(ValueError, match="needs each video's first frame"):
        rm.score(frames, [P, P])


# --- the model -----------------------------------------------------------------------------


def test_layouts_agree_without_an_image_and_differ_with_one():
    """T2V input is all zeros in both layouts, so the T2V base is unchanged; I2V input is not."""
    torch.manual_seed(0)
    a = ToyVideoModel(i2v_layout="first_frame")
    b = ToyVideoModel(i2v_layout="broadcast")
    b.transformer.load_state_dict(a.transformer.state_dict())
    x = torch.randn(2, *a.latent_shape)
    sigma = torch.tensor([0.7, 0.7])
    t2v = a.encode([P, P])
    assert torch.equal(a.velocity(x, sigma, t2v), b.velocity(x, sigma, t2v))
    img = torch.from_numpy(np.stack([tw.i2v_condition(P, 0)] * 2))
    i2v = a.encode([P, P], img)
    assert not torch.allclose(a.velocity(x, sigma, i2v), b.velocity(x, sigma, i2v))
    # first_frame: later frames' condition is black with mask 0, as Wan I2V's frame-0 latent + mask
    seen = {}

    def grab(module, args):  # returns None: the inputs go on unchanged
        seen.setdefault("inp", args[0])

    hook = a.transformer.register_forward_pre_hook(grab)
    a.velocity(x, sigma, i2v)
    hook.remove()
    cond = seen["inp"][:, 3:7]                                             # [B, 3 rgb + 1 mask, F, H, W]
    assert torch.equal(cond[:, 3, 0], torch.ones_like(cond[:, 3, 0])) and cond[:, :, 1:].abs().sum() == 0


def test_task_picks_the_committed_base():
    i2v = ToyVideoModel.from_config(load_config("configs/toy_i2v.yaml"))
    t2v = ToyVideoModel.from_config(load_config("configs/quickstart.yaml"))
    assert i2v.i2v_layout == "first_frame" and t2v.i2v_layout == "broadcast"
    meta = json.loads(BASE_I2V_CHECKPOINT.with_suffix(".json").read_text())
    rec = meta["pretrain"]
    assert rec["init"] == str(BASE_CHECKPOINT.relative_to(BASE_CHECKPOINT.parents[3]))
    assert f"--steps {rec['steps']}" in rec["command"] and "--i2v-prob 0.75" in rec["command"]
    assert "IA" in rec["eval"]
    assert BASE_I2V_CHECKPOINT.stat().st_size < 2_000_000


def test_i2v_base_starts_its_videos_at_the_image():
    """The committed I2V base conditions on the image: each video's first frame matches its own
    image far better than another pair's image (same colour, other position)."""
    model = ToyVideoModel.from_pretrained(BASE_I2V_CHECKPOINT)
    pairs = tw.eval_pairs(4)[::2]                                          # 8 held-out (prompt, seed) pairs
    images = eval_images(pairs)
    frames = ode_sample(model, [p for p, _ in pairs], [s for _, s in pairs], images=images)
    own = [toyscore.image_alignment(f.numpy(), i.numpy())["match"] for f, i in zip(frames, images, strict=True)]
    other = [toyscore.image_alignment(f.numpy(), i.numpy())["match"]
             for f, i in zip(frames, images.roll(1, 0), strict=True)]
    assert np.mean(own) > 0.6 and np.mean(own) > np.mean(other) + 0.25, (own, other)


def test_pretrain_smoke_records_i2v(tmp_path):
    out = tmp_path / "m.safetensors"
    _, hist = pretrain(2, batch=4, eval_every=1, eval_seeds=1, warmup=1, out_path=out, init=BASE_CHECKPOINT,
                       i2v_prob=1.0, progress=False)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["i2v_layout"] == "first_frame" and meta["pretrain"]["init"] == str(BASE_CHECKPOINT)
    assert "IA" in hist[-1]["eval"] and ToyVideoModel.from_pretrained(out).i2v_layout == "first_frame"

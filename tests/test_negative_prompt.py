"""A dataset row's own negative prompt reaches CFG in the rollout and the learner, and the bank keeps it."""

from __future__ import annotations

import dataclasses

import torch

from common.config import ModelConfig, load_config
from common.types import Condition
from rollout_worker.models.base import negative_kwargs
from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel
from rollout_worker.models.tiny import tiny_hunyuan15_components, tiny_wan_components
from rollout_worker.models.toy import ToyVideoModel
from rollout_worker.models.wan import WanVideoModel
from rollout_worker.sampler import sample_group

CFG = dict(num_frames=5, height=16, width=16, guidance_scale=2.0)


def test_adapters_encode_a_rows_negative_prompt():
    """Wan via WanPipeline.encode_prompt's own negative branch; HunyuanVideo 1.5 via its text encoders."""
    wan = WanVideoModel.from_components(tiny_wan_components("t2v"),
                                        ModelConfig(family="wan", max_sequence_length=16, **CFG))
    hy = Hunyuan15VideoModel.from_components(tiny_hunyuan15_components("t2v"), ModelConfig(family="hunyuan15", **CFG))
    for model, key in ((wan, "encoder_hidden_states"), (hy, "prompt_embeds")):
        plain = model.encode(["a cat", "a dog"])
        same = model.encode(["a cat", "a dog"], negative_prompts=[None, None])
        own = model.encode(["a cat", "a dog"], negative_prompts=["blurry, static", None])
        key = key if key in plain.uncond else next(iter(plain.uncond))
        assert torch.equal(plain.uncond[key], same.uncond[key])
        assert not torch.equal(own.uncond[key][0], plain.uncond[key][0])      # row 0: its own
        assert torch.equal(own.uncond[key][1], plain.uncond[key][1])          # row 1: model.negative_prompt
        ref = model.encode(["a cat"], negative_prompts=["blurry, static"])
        assert torch.equal(own.uncond[key][:1], ref.uncond[key])


def test_rollout_and_bank_carry_the_negative_prompt():
    cfg = load_config("configs/quickstart.yaml", ["model.guidance_scale=3.0", "sampler.group_size=2",
                                                  "schedule.steps=3"])
    model = ToyVideoModel.from_config(cfg)
    base = Condition("c0", "a red square moving left")
    neg = dataclasses.replace(base, negative_prompt="a red square moving right")
    assert negative_kwargs([base]) == {} and negative_kwargs([neg]) == {"negative_prompts": [neg.negative_prompt]}
    a = sample_group(model, base, cfg, seed=1, policy_version=0)
    b = sample_group(model, neg, cfg, seed=1, policy_version=0)
    assert not torch.equal(a.members[0].final_latents, b.members[0].final_latents)

    # the row's negative prompt is in the encoded condition the group carries (and names it)
    assert not torch.equal(a.cond.uncond["text"], b.cond.uncond["text"])
    assert torch.equal(a.cond.tensors["text"], b.cond.tensors["text"])
    assert a.cond.encoder != b.cond.encoder and neg.negative_prompt in b.cond.encoder
    from memory_bank.codec import decode_cond, encode_cond

    key, fields = encode_cond(neg.id, b.cond)
    assert key != encode_cond(base.id, a.cond)[0]
    assert torch.equal(decode_cond(fields)[2].uncond["text"], b.cond.uncond["text"])


def test_learner_trains_on_the_rows_negative_prompts_and_first_frames_as_encoded(tmp_path):
    """The learner, built without encoders, gets each row's CFG text and first frame exactly as the
    rollout encoded them (first frame by path, negative prompt per row)."""
    from PIL import Image

    from common import toyworld as tw
    from common.types import TrainBatch
    from learner.rows import build_rows
    from learner.trainer import Trainer

    cfg = load_config("configs/toy_i2v.yaml", ["model.guidance_scale=3.0", "optim.finetune=full",
                                               "sampler.group_size=2", "schedule.steps=3"])
    model = ToyVideoModel.from_config(cfg)
    Image.fromarray(tw.i2v_condition("a red square moving up", 0)).save(tmp_path / "f.png")
    conds = [Condition("a", "a red square moving up", image_path=str(tmp_path / "f.png"), negative_prompt="blur"),
             Condition("b", "a red square moving up", image_path=str(tmp_path / "f.png"))]
    groups = [sample_group(model, c, cfg, seed=i, policy_version=0) for i, c in enumerate(conds)]
    for g in groups:
        g.composite = torch.tensor([0.0, 1.0])
    learner = ToyVideoModel.from_config(cfg, components="transformer")
    got = Trainer(cfg, learner).setup().conditions(build_rows(TrainBatch(groups), cfg))
    img = torch.from_numpy(tw.i2v_condition("a red square moving up", 0))
    want = model.encode([c.prompt for c in conds], torch.stack([img, img]), negative_prompts=["blur", None])
    for k in ("text", "image"):
        assert torch.equal(got.tensors[k], want.tensors[k]) and torch.equal(got.uncond[k], want.uncond[k])
    assert not torch.equal(got.uncond["text"][0], got.uncond["text"][1])

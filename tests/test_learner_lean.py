"""The learner builds the transformer(s) alone (group format item 2): no text encoder, image
encoder or VAE, for toy, Wan and HunyuanVideo 1.5, from the same checkpoint directory the rollout
loads. It computes the same velocities as the full model on the conditions the rollout encoded,
refuses to encode or decode, and a learner rank trains a real step on a banked I2V group whose
first-frame file no longer exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline
from PIL import Image

from common.config import RunConfig, load_config
from common.types import Condition, Scores, TrainBatch
from learner.actor import LearnerRank
from rollout_worker.models import build_model
from rollout_worker.models.base import NoEncoders
from rollout_worker.models.tiny import tiny_hunyuan15_components, tiny_wan_components
from rollout_worker.sampler import sample_group

IMAGE = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (16, 16, 3), dtype=np.uint8))
MODEL = dict(num_frames=5, height=16, width=16, guidance_scale=2.0, max_sequence_length=16)


def _save(family: str, variant: str, path) -> None:
    if family == "wan":
        cls = WanImageToVideoPipeline if variant.startswith("i2v") else WanPipeline
        cls(scheduler=FlowMatchEulerDiscreteScheduler(), **tiny_wan_components(variant)).save_pretrained(path)
        return
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance

    cls = HunyuanVideo15ImageToVideoPipeline if variant == "i2v" else HunyuanVideo15Pipeline
    comps = {**tiny_hunyuan15_components(variant), "scheduler": FlowMatchEulerDiscreteScheduler(),
             "guider": ClassifierFreeGuidance(guidance_scale=2.0, guidance_rescale=0.3)}
    cls(**comps).save_pretrained(path)


def _cfg(family: str, task: str, path, **over) -> RunConfig:
    model = {**MODEL, "family": family, "task": task, "path": str(path)}
    if family == "hunyuan15":
        model.pop("max_sequence_length")
    return RunConfig.model_validate({"model": model, **over})


@pytest.mark.parametrize("family,variant", [("wan", "t2v"), ("wan", "i2v"), ("wan", "i2v_a14b"),
                                            ("hunyuan15", "t2v"), ("hunyuan15", "i2v")])
def test_transformer_only_build_computes_the_full_models_velocities(tmp_path, family, variant):
    task = "i2v" if variant.startswith("i2v") else "t2v"
    _save(family, variant, tmp_path / "ckpt")
    cfg = _cfg(family, task, tmp_path / "ckpt")
    full, lean = build_model(cfg, "cpu"), build_model(cfg, "cpu", components="transformer")
    assert (full.components, lean.components) == ("all", "transformer")
    if family == "wan":
        assert lean.pipe.vae is None and lean.pipe.text_encoder is None and lean.pipe.tokenizer is None
        assert getattr(lean.pipe, "image_encoder", None) is None
    else:
        assert lean.pipe is None and lean.guider.guidance_rescale == full.guider.guidance_rescale == 0.3
    assert lean.latent_shape == full.latent_shape
    mods = [m for m in (getattr(lean, "transformer", None), getattr(lean, "transformer_2", None)) if m is not None]
    fulls = [full.transformer] + ([full.transformer_2] if getattr(full, "transformer_2", None) is not None else [])
    assert len(mods) == len(fulls)
    for a, b in zip(mods, fulls, strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    cond = full.encode(["a red cat"], IMAGE[None] if task == "i2v" else None)   # what the rollout sends
    x = torch.randn(1, *full.latent_shape, generator=torch.Generator().manual_seed(0))
    for sigma in (0.95, 0.4):   # both Wan 2.2 experts
        kw = {"sigma_next": torch.tensor([sigma - 0.2])} if full.needs_sigma_next else {}
        assert torch.equal(lean.velocity(x, torch.tensor([sigma]), cond, **kw),
                           full.velocity(x, torch.tensor([sigma]), cond, **kw))
    with pytest.raises(NoEncoders, match="components='transformer'"):
        lean.encode(["a red cat"], IMAGE[None] if task == "i2v" else None)
    with pytest.raises(NoEncoders, match="decode"):
        lean.decode(x)


def test_toy_transformer_only_build_has_no_word_encoder():
    cfg = load_config("configs/quickstart.yaml")
    full, lean = build_model(cfg), build_model(cfg, components="transformer")
    assert lean.text_encoder is None and full.text_encoder is not None
    cond = full.encode(["a red square moving left"])
    x = torch.zeros(1, *full.latent_shape)
    assert torch.equal(lean.velocity(x, torch.tensor([0.5]), cond), full.velocity(x, torch.tensor([0.5]), cond))
    with pytest.raises(NoEncoders):
        lean.encode(["a red square moving left"])


def test_a_learner_rank_trains_a_banked_i2v_group_without_encoders_or_its_image_file(bank, tmp_path,
                                                                                     monkeypatch):
    """The rollout reads the first frame from its file and encodes it (VAE latents, CLIP); the bank
    stores that once; the learner rank, built from the same config, holds no encoder or VAE, never
    calls one (every adapter's encode and the VAE's are spied on), and trains on the banked group
    after the file is gone."""
    _save("wan", "i2v", tmp_path / "ckpt")
    cfg = _cfg("wan", "i2v", tmp_path / "ckpt", schedule={"steps": 3, "shift": 1.0},
               sampler={"group_size": 2, "train_steps": "all"},
               optim={"finetune": "lora", "lora_rank": 4, "micro_batch": 4},
               pools={"learner": {"num_cpus": 0.5, "torch_threads": 1}})
    image = tmp_path / "first.png"
    Image.fromarray(IMAGE.numpy()).save(image)
    rollout = build_model(cfg, "cpu")
    group = sample_group(rollout, Condition("c0", "a red cat", image_path=str(image)), cfg, seed=1,
                         policy_version=0)
    group.scores = Scores(["R"], torch.tensor([[0.2], [0.9]]))
    group.composite = torch.tensor([0.2, 0.9])
    for m in group.members:
        m.frames = None
    bank.push_group(group)
    image.unlink()                                     # a learner that opened it would fail

    from diffusers import AutoencoderKLWan

    from rollout_worker.models.wan import WanVideoModel
    calls = []
    for cls, name in ((WanVideoModel, "encode"), (WanVideoModel, "decode"), (AutoencoderKLWan, "encode"),
                      (AutoencoderKLWan, "decode")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, _r=real, _n=f"{cls.__name__}.{name}", **k: (calls.append(_n),
                                                                                            _r(*a, **k))[1])
    rank = LearnerRank(cfg.model_dump(mode="json"), 0, 1)
    rank.setup("127.0.0.1", 0)
    model = rank.trainer.model
    assert model.components == "transformer" and model.pipe.vae is None and model.pipe.text_encoder is None
    batch = bank.pull(1, 0)
    assert batch.fresh[0].condition.image_path is None and batch.fresh[0].cond is not None
    before = {n: p.detach().clone() for n, p in rank.trainer.policy.params.items()}
    stats = rank.train_step(TrainBatch(batch.fresh, batch.bank, 0))
    assert calls == [] and stats["version"] == 1.0 and stats["num_rows"] == 2 * 3
    assert any(not torch.equal(p, before[n]) for n, p in rank.trainer.policy.params.items())
    assert stats["logratio_first_absmax"] < 1e-5        # replayed with the rollout's own encoding


def test_a_batch_without_its_encoded_conditions_is_refused_in_one_line():
    from learner.trainer import Trainer

    cfg = load_config("configs/quickstart.yaml", ["sampler.group_size=2", "schedule.steps=3"])
    group = sample_group(build_model(cfg), Condition("c0", "a red square moving left"), cfg, seed=0,
                         policy_version=0)
    group.scores = Scores(["VQ", "MQ", "TA"], torch.tensor([[0.0, 0.1, 0.2], [1.0, 0.5, 0.2]]))
    group.composite = group.scores.values.sum(1)
    trainer = Trainer(cfg, build_model(cfg, components="transformer")).setup()
    for m in group.members:
        m.cond = None
    with pytest.raises(ValueError, match=r"carry no encoded condition \(Trajectory.cond\)"):
        trainer.train_step(TrainBatch([group]))
    group.members[0].cond = build_model(cfg).encode(["a red square moving left"])
    with pytest.raises(ValueError, match="mixes trajectories with and without"):
        trainer.train_step(TrainBatch([group]))


def test_a_learner_rank_trains_a_banked_ti2v_5b_i2v_group_with_per_token_timesteps(bank, tmp_path):
    """Wan 2.2 TI2V-5B from a checkpoint saved as the hub's (WanPipeline, expand_timesteps): the
    rollout loads it for I2V, the bank stores its held first frame's latents, and a learner rank
    (transformer only, loaded from the same folder) replays the banked steps with log r = 0 and
    trains on them."""
    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(),
                **tiny_wan_components("ti2v_5b")).save_pretrained(tmp_path / "ckpt")
    cfg = _cfg("wan", "i2v", tmp_path / "ckpt", schedule={"steps": 3, "shift": 1.0},
               sampler={"group_size": 2, "train_steps": "all"},
               optim={"finetune": "lora", "lora_rank": 4, "micro_batch": 4},
               pools={"learner": {"num_cpus": 0.5, "torch_threads": 1}})
    cfg = RunConfig.model_validate({**cfg.model_dump(mode="json"),
                                    "model": {**cfg.model.model_dump(mode="json"), "num_frames": 9,
                                              "height": 32, "width": 64}})
    rollout = build_model(cfg, "cpu")
    assert rollout.expand_timesteps and rollout.latent_shape == (48, 3, 2, 4)
    group = sample_group(rollout, Condition("c0", "a red cat", image=IMAGE), cfg, seed=1, policy_version=0)
    assert set(group.members[0].cond.tensors) == {"encoder_hidden_states", "first_frame"}
    group.scores = Scores(["R"], torch.tensor([[0.2], [0.9]]))
    group.composite = torch.tensor([0.2, 0.9])
    for m in group.members:
        m.frames = None
    bank.push_group(group)
    rank = LearnerRank(cfg.model_dump(mode="json"), 0, 1)
    rank.setup("127.0.0.1", 0)
    model = rank.trainer.model
    assert model.components == "transformer" and model.expand_timesteps and model.pipe.vae is None
    batch = bank.pull(1, 0)
    assert torch.equal(batch.fresh[0].cond.tensors["first_frame"], group.members[0].cond.tensors["first_frame"])
    before = {n: p.detach().clone() for n, p in rank.trainer.policy.params.items()}
    stats = rank.train_step(TrainBatch(batch.fresh, batch.bank, 0))
    assert stats["version"] == 1.0 and stats["num_rows"] == 2 * 3
    assert any(not torch.equal(p, before[n]) for n, p in rank.trainer.policy.params.items())
    assert stats["logratio_first_absmax"] < 1e-5

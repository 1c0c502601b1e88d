"""The real I2V adapters (Wan 2.2 I2V A14B-style, HunyuanVideo 1.5 I2V), tiny random weights saved
as diffusers checkpoints, through the real rollout, reward and learner actors on a two-row
manifest with images: the same path `vgrpo train -c configs/wan22_i2v_tagrpo.yaml` takes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.driver.driver import Driver
from cluster.runs.run_dir import RunDir
from common import toyworld as tw
from common.config import load_config


def _wan22_i2v(path):
    """Wan 2.2 I2V A14B's layout: no CLIP image encoder, mask + first-frame latent channels, two experts."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    from rollout_worker.models.tiny import tiny_wan_components, tiny_wan_transformer

    comps = tiny_wan_components("i2v")
    comps.pop("image_encoder"), comps.pop("image_processor")
    z = comps["vae"].config.z_dim
    comps["transformer"] = tiny_wan_transformer(2 * z + 4, z)
    comps["transformer_2"] = tiny_wan_transformer(2 * z + 4, z, seed=1)
    comps["boundary_ratio"] = 0.6
    WanImageToVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), image_encoder=None,
                            image_processor=None, **comps).save_pretrained(path)
    return ["model.family=wan", "model.guidance_scale=2.0", "model.guidance_scale_2=2.0",
            "model.boundary_ratio=0.6", "model.max_sequence_length=16", "model.num_frames=5"]


def _hunyuan15_i2v(path):
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15ImageToVideoPipeline
    from diffusers.guiders import ClassifierFreeGuidance

    from rollout_worker.models.tiny import tiny_hunyuan15_components

    HunyuanVideo15ImageToVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(),
                                       guider=ClassifierFreeGuidance(guidance_scale=2.0),
                                       **tiny_hunyuan15_components("i2v")).save_pretrained(path)
    return ["model.family=hunyuan15", "model.guidance_scale=2.0", "model.num_frames=5"]


def _manifest(tmp_path):
    from PIL import Image

    (tmp_path / "data").mkdir()
    rows = []
    for i, (prompt, seed) in enumerate([("a red square moving right", 0), ("a blue square moving up", 1)]):
        Image.fromarray(tw.i2v_condition(prompt, seed)).save(tmp_path / "data" / f"f{i}.png")
        rows.append(json.dumps({"prompt": prompt, "image": f"f{i}.png"}))
    m = tmp_path / "data" / "manifest.jsonl"
    m.write_text("\n".join(rows) + "\n")
    return m


@pytest.mark.parametrize("make", [_wan22_i2v, _hunyuan15_i2v], ids=["wan22_i2v", "hunyuan15_i2v"])
def test_real_i2v_adapter_trains_on_a_manifest(ray_session, tmp_path, make):
    import ray

    model_dir = tmp_path / "model"
    family = make(model_dir)
    m = _manifest(tmp_path)
    cfg = load_config("configs/toy_i2v.yaml", [
        *family, f"model.path={model_dir}", "model.height=16", "model.width=16", "optim.finetune=full",
        "optim.lr=1e-4", f"train.prompts={m}", f"train.eval_prompts={m}", "train.mode=sync", "train.steps=1",
        "train.groups_per_step=2", "train.eval_seeds=1", "train.checkpoint_every=1000", "sampler.group_size=2",
        "schedule.steps=3", "sampler.ode_last_steps=0", "bank.capacity=2", "optim.micro_batch=2",
        f"run.root={tmp_path}", "run.name=real"])
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        driver.run()
        rows = [json.loads(line) for line in run_dir.metrics_file.read_text().splitlines()]
        assert [r["step"] for r in rows] == [1] and rows[0]["groups_trained"] == 2
        assert ray.get(driver.rollouts[0].version.remote()) == 1
        entries = [e for c in driver.conditions for e in driver.bank.entries(c.id)]
        # entries name no file: the first frame travels as the rollout encoded it (VAE latents,
        # and SigLIP states for HunyuanVideo 1.5), and the learner, holding no VAE, trained on it
        assert entries and all(e.trajectory.condition.image_path is None for e in entries)
        latents = {"wan": "condition", "hunyuan15": "cond_latents"}[cfg.model.family]
        assert all(e.trajectory.cond.tensors[latents].abs().sum() > 0 for e in entries)
        after = driver.evaluate("after", gifs=1)
        assert "IA" in after.heads and np.isfinite(after.values).all()
    finally:
        driver.teardown()

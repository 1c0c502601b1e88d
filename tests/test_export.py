"""`vgrpo export` against loaders this project did not write: the exported folder loaded by
diffusers' own `load_lora_weights` / `load_lora_adapter` / `from_pretrained`, sampled with the ODE
at a fixed seed (by the diffusers pipeline itself where the family has one), equals vgrpo's own
sample with the trained weights (cluster/evaluation/policy.load_policy) within 1e-5.

Tiny real classes (rollout_worker/models/tiny.py) stand in for Wan and HunyuanVideo 1.5, their
"trained" adapters drawn at random; the toy world's checkpoints are written by the real learner
(learner/trainer.Trainer, a few steps on sampled groups)."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from safetensors import safe_open
from safetensors.torch import save_file

from cluster.cli import main
from cluster.evaluation.policy import load_policy
from cluster.runs.export import EXPORT_JSON, LORA_FILE, export_run
from cluster.runs.run_dir import RunDir
from common.config import RunConfig, load_config
from common.policy_layout import LEGACY_FILE, POLICY_DIR
from common.sde import Schedule
from learner.checkpoint import write_policy
from learner.policy_writer import expert_configs
from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel
from rollout_worker.models.lora import inject_lora, is_lora_key
from rollout_worker.models.tiny import tiny_hunyuan15_components, tiny_wan_components
from rollout_worker.sampler import sample_videos

SIGMAS = Schedule.linear(4, 3.0).sigmas
SEED = 7
STEP = 3
IMAGE = torch.from_numpy(__import__("numpy").random.RandomState(0).randint(0, 256, (16, 16, 3), dtype="uint8"))


class FixedSigmas(FlowMatchEulerDiscreteScheduler):
    """Euler on vgrpo's σ_0 … σ_{T-1} (the Wan pipelines only pass a step count)."""

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, **kw):
        super().set_timesteps(sigmas=list(SIGMAS[:-1]), device=device)


def latents(model, prompts, seeds, schedule, images=None) -> torch.Tensor:
    """vgrpo's ODE final latents (captured where the sampler decodes them)."""
    seen = {}
    decode = model.decode
    model.decode = lambda z: (seen.setdefault("z", z.clone()), decode(z))[1]
    sample_videos(model, prompts, seeds, schedule, images=images)
    model.decode = decode
    return seen["z"]


def trained_adapter(module, family: str, cfg: RunConfig, seed: int = 1) -> dict[str, torch.Tensor]:
    """What a LoRA run's policy holds, with every adapter weight moved off its init."""
    inject_lora(module, family, cfg.optim)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if is_lora_key(n):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return {k: v.clone() for k, v in module.state_dict().items() if is_lora_key(k)}


def make_run(tmp_path, cfg: RunConfig, payload, ema: bool = False, summary: dict | None = None,
             legacy: bool = False) -> RunDir:
    """A run dir as `vgrpo train` leaves it: config.yaml, checkpoints/step_N/policy/ (the
    learner's own writer; `legacy`: the single policy.safetensors of older checkpoints),
    summary.json."""
    run = RunDir.create(cfg)
    ckpt = run.checkpoints / f"step_{STEP:08d}"
    ckpt.mkdir(parents=True)
    if legacy:
        meta = {"vgrpo.weights": "ema" if ema else "live", "vgrpo.version": str(STEP), "vgrpo.ema_decay": "0.0"}
        save_file({k: v.contiguous() for k, v in payload.items()}, str(ckpt / LEGACY_FILE), metadata=meta)
    else:
        write_policy(ckpt / POLICY_DIR, payload, ema=ema, version=STEP, decay=cfg.optim.ema_decay)
    if summary is not None:
        run.summary_file.write_text(json.dumps(summary))
    return run


def wan_cfg(tmp_path, base, task="t2v", g2=None, **optim) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"family": "wan", "task": task, "path": str(base), "num_frames": 5, "height": 16, "width": 16,
                  "guidance_scale": 2.0, "guidance_scale_2": g2, "max_sequence_length": 16},
        "optim": {"lora_rank": 4, "lora_alpha": 8.0, **optim},
        "schedule": {"sigmas": list(SIGMAS)}, "run": {"root": str(tmp_path), "name": "run"}})


def wan_base(tmp_path, variant: str):
    comps = tiny_wan_components(variant)
    cls = WanImageToVideoPipeline if variant.startswith("i2v") else WanPipeline
    cls(scheduler=FlowMatchEulerDiscreteScheduler(), **comps).save_pretrained(tmp_path / "base")
    return tmp_path / "base", cls


def wan_pipeline_sample(pipe, task: str, g2=None) -> torch.Tensor:
    from PIL import Image

    pipe.scheduler = FixedSigmas(shift=1.0)
    kw = dict(negative_prompt="", height=16, width=16, num_frames=5, num_inference_steps=4, guidance_scale=2.0,
              guidance_scale_2=g2, max_sequence_length=16, output_type="latent",
              generator=torch.Generator().manual_seed(SEED))
    args = ["a red cat"] if task == "t2v" else [Image.fromarray(IMAGE.numpy()), "a red cat"]
    return pipe(*args, **kw).frames


@pytest.mark.parametrize("variant", ["t2v", "i2v", "t2v_a14b"])
def test_wan_lora_loads_with_the_pipelines_load_lora_weights(tmp_path, variant):
    base, pipe_cls = wan_base(tmp_path, variant)
    task = "i2v" if variant.startswith("i2v") else "t2v"
    g2 = 3.0 if variant.endswith("a14b") else None
    cfg = wan_cfg(tmp_path, base, task, g2)
    trained = load_policy(cfg, None)                      # vgrpo's model of the base
    payload = trained_adapter(trained.trainable_module(), "wan", cfg)
    run = make_run(tmp_path, cfg, payload)
    info = export_run(str(run.path), str(tmp_path / "out"))
    ours = latents(load_policy(cfg, run.checkpoints / f"step_{STEP:08d}"), ["a red cat"], [SEED],
                   Schedule(SIGMAS), IMAGE[None] if task == "i2v" else None)

    pipe = pipe_cls.from_pretrained(base)
    untouched = wan_pipeline_sample(pipe, task, g2)
    pipe.load_lora_weights(tmp_path / "out")              # diffusers' own loader
    if variant == "t2v_a14b":  # both experts trained: the second file goes to transformer_2
        assert info["files"] == [LORA_FILE, "pytorch_lora_weights_transformer_2.safetensors"]
        pipe.load_lora_weights(tmp_path / "out", weight_name=info["files"][1], load_into_transformer_2=True)
    ref = wan_pipeline_sample(pipe, task, g2)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0), (ours - ref).abs().max()
    assert (untouched - ref).abs().max() > 1e-3, "the adapter must change the sample"
    with safe_open(str(tmp_path / "out" / LORA_FILE), "pt") as f:  # diffusers' key format, no adapter name
        assert all(k.startswith("transformer.") and ".default." not in k for k in f.keys())
    card = (tmp_path / "out" / "README.md").read_text()
    assert "pipe.load_lora_weights" in card and f"{pipe_cls.__name__}.from_pretrained" in card


def test_hunyuan15_lora_loads_with_the_transformers_load_lora_adapter(tmp_path):
    """diffusers 0.42's HunyuanVideo15Pipeline has no load_lora_weights; its transformer's own
    PeftAdapterMixin loader reads the same file."""
    comps = tiny_hunyuan15_components("t2v")
    cfg = RunConfig.model_validate({
        "model": {"family": "hunyuan15", "path": str(tmp_path / "unused"), "num_frames": 5, "height": 16,
                  "width": 16, "guidance_scale": 2.0},
        "optim": {"lora_rank": 4, "lora_alpha": 2.0}, "run": {"root": str(tmp_path), "name": "run"}})
    ours_model = Hunyuan15VideoModel.from_components(comps, cfg.model)
    payload = trained_adapter(ours_model.trainable_module(), "hunyuan15", cfg)
    run = make_run(tmp_path, cfg, payload)
    export_run(str(run.path), str(tmp_path / "out"))
    ours = latents(ours_model, ["a red cat"], [SEED], Schedule(SIGMAS))

    fresh = tiny_hunyuan15_components("t2v")              # the same base, seeded
    fresh["transformer"].load_lora_adapter(str(tmp_path / "out"), use_safetensors=True)
    pipe = HunyuanVideo15Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
                                  guider=ClassifierFreeGuidance(guidance_scale=2.0), **fresh)
    ref = pipe("a red cat", height=16, width=16, num_frames=5, sigmas=list(SIGMAS[:-1]), output_type="latent",
               generator=torch.Generator().manual_seed(SEED)).frames
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0), (ours - ref).abs().max()
    assert "pipe.transformer.load_lora_adapter" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize("legacy", [False, True])
def test_wan_full_fine_tune_exports_a_transformer_folder_and_a_pipeline(tmp_path, legacy):
    """legacy: a checkpoint written before policy/ (one policy.safetensors) exports alike."""
    base, _ = wan_base(tmp_path, "t2v")
    cfg = wan_cfg(tmp_path, base, finetune="full")
    model = load_policy(cfg, None)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a "trained" transformer: every weight moved
        for p in model.trainable_module().parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    run = make_run(tmp_path, cfg, model.trainable_module().state_dict(), legacy=legacy)
    ours = latents(load_policy(cfg, run.checkpoints / f"step_{STEP:08d}"), ["a red cat"], [SEED], Schedule(SIGMAS))

    export_run(str(run.path), str(tmp_path / "tr"))
    transformer = WanTransformer3DModel.from_pretrained(tmp_path / "tr", subfolder="transformer")
    ref = wan_pipeline_sample(WanPipeline.from_pretrained(base, transformer=transformer), "t2v")
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0), (ours - ref).abs().max()
    assert main(["export", str(run.path), "--out", str(tmp_path / "pipe"), "--pipeline"]) == 0
    ref = wan_pipeline_sample(WanPipeline.from_pretrained(tmp_path / "pipe"), "t2v")
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0)
    for part in ("vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"):  # the base's, linked
        assert (tmp_path / "pipe" / part).exists(), part
    card = (tmp_path / "pipe" / "README.md").read_text()
    assert "vgrpo export" in card and "--pipeline" in card and 'WanPipeline.from_pretrained("' in card
    if not legacy:   # the same run on an object store (fsspec's in-process one): the shards streamed down
        import uuid

        from common import storage

        remote = f"memory://vgrpo-run-{uuid.uuid4().hex[:8]}/run"
        (run.checkpoints / f"step_{STEP:08d}" / "trainer.pt").write_bytes(b"")   # listed by its marker
        storage.push_tree(run.path, remote)
        export_run(remote, str(tmp_path / "from_remote"))
        again = WanTransformer3DModel.from_pretrained(tmp_path / "from_remote", subfolder="transformer")
        assert all(torch.equal(v, again.state_dict()[k]) for k, v in transformer.state_dict().items())
        storage.remove(remote)


# --- the toy world, trained by the real learner ------------------------------------------------------

def _toy_cfg(tmp_path, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square moving left\na blue square moving up\n")
    return load_config("configs/quickstart.yaml", [
        f"train.prompts={prompts}", "sampler.group_size=4", "schedule.steps=4", "optim.micro_batch=8",
        "optim.lr=0.01", "train.eval_seeds=2", "grpo.per_head_advantages=false", f"run.root={tmp_path}",
        "run.name=toy", *extra])


def _toy_run(tmp_path, cfg, steps: int = 2):
    """`steps` learner updates on groups the toy base sampled, then the checkpoint and its
    policy/ as the driver writes them; summary.json from real before/after evaluations."""
    from helpers_tiny import sample_group

    from cluster.evaluation.evaluate import paired
    from cluster.evaluation.policy import evaluate_policy
    from common.types import Condition, TrainBatch
    from learner.trainer import Trainer
    from rollout_worker.models import build_model

    run = RunDir.create(cfg)
    trainer = Trainer(cfg, build_model(cfg)).setup()
    sampler = build_model(cfg)
    for s in range(steps):
        groups = [sample_group(sampler, Condition(f"c{c}", p), group_size=4, seed=10 * s + c, steps=4, shift=3.0)
                  for c, p in enumerate(["a red square moving left", "a blue square moving up"])]
        for g in groups:
            g.composite = torch.stack([-t.final_latents[0, 0].mean() for t in g.members])
        trainer.train_step(TrainBatch(groups))
    d = trainer.save_checkpoint(run.checkpoints, {"step": trainer.version, "cursor": 0})
    configs = expert_configs(trainer.policy.module, "WanTransformer3DModel") if cfg.optim.finetune == "full" else {}
    write_policy(d / POLICY_DIR, trainer.weights_payload(ema=True), ema=trainer.exports_ema,
                 version=trainer.version, decay=cfg.optim.ema_decay, configs=configs)
    before, after = evaluate_policy(cfg, None)[0], evaluate_policy(cfg, d)[0]
    run.summary_file.write_text(json.dumps({"steps": trainer.version, "before": before.to_dict(),
                                            "after": after.to_dict(),
                                            "paired": [vars(r) | {"z": r.z} for r in paired(before, after)]}))
    return run, d, trainer


def test_toy_lora_with_ema_loads_with_diffusers_load_lora_adapter(tmp_path):
    from rollout_worker.models.toy import ToyVideoModel

    cfg = _toy_cfg(tmp_path, "optim.ema_decay=0.9")
    run, ckpt, trainer = _toy_run(tmp_path, cfg)
    assert main(["export", str(run.path), "--out", str(tmp_path / "exported")]) == 0
    prompts, seeds, sched = ["a red square moving left", "a blue square moving up"], [0, 1], Schedule.from_config(cfg.schedule)
    ours = latents(load_policy(cfg, ckpt), prompts, seeds, sched)
    theirs = ToyVideoModel.from_config(cfg)
    theirs.transformer.load_lora_adapter(str(tmp_path / "exported"), use_safetensors=True)  # diffusers' loader
    ref = latents(theirs, prompts, seeds, sched)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0), (ours - ref).abs().max()
    live = ToyVideoModel.from_config(cfg)  # the live weights sample otherwise: the folder holds the average
    inject_lora(live.transformer, "toy", cfg.optim)
    live.load_weights(trainer.weights_payload())
    assert (latents(live, prompts, seeds, sched) - ref).abs().max() > 1e-4
    info = json.loads((tmp_path / "exported" / EXPORT_JSON).read_text())
    assert (info["kind"], info["weights"], info["ema_decay"], info["step"]) == ("lora", "ema", 0.9, 2)
    card = (tmp_path / "exported" / "README.md").read_text()
    summary = json.loads(run.summary_file.read_text())
    composite = next(r for r in summary["paired"] if r["key"] == "composite")
    assert "moving average" in card and "optim.ema_decay = 0.9" in card and "2 optimizer steps" in card
    assert f"{composite['diff']:+.3f} ± {composite['se']:.3f}" in card       # the before/after table
    assert f"{summary['before']['composite_se']:.3f}" in card
    assert "vgrpo export " + str(run.path) in card and "scheme: sage" in card
    # the card's own snippet runs, and samples what vgrpo samples
    ns: dict = {}
    exec(info["load"].replace("[0]", "[0, 1]").replace('["a red square moving right"]', repr(prompts)), ns)
    assert torch.equal(ns["frames"], sample_videos(load_policy(cfg, ckpt), prompts, seeds, sched))


def test_toy_full_fine_tune_loads_with_from_pretrained(tmp_path):
    from rollout_worker.models.toy import ToyVideoModel

    cfg = _toy_cfg(tmp_path, "optim.finetune=full", "optim.lr=0.0005")
    run, ckpt, _ = _toy_run(tmp_path, cfg, steps=1)
    info = export_run(str(run.path), str(tmp_path / "exported"), pipeline=True)
    assert info["weights"] == "live" and info["files"] == ["transformer", "toy.json"]
    prompts, seeds, sched = ["a red square moving left"], [3], Schedule.from_config(cfg.schedule)
    ours = latents(load_policy(cfg, ckpt), prompts, seeds, sched)
    theirs = ToyVideoModel.from_config(cfg)
    theirs.transformer = WanTransformer3DModel.from_pretrained(tmp_path / "exported", subfolder="transformer")
    assert torch.allclose(ours, latents(theirs, prompts, seeds, sched), atol=1e-5, rtol=0)
    whole = ToyVideoModel.from_pretrained(tmp_path / "exported")   # the toy pipeline: transformer/ + toy.json
    assert torch.allclose(ours, latents(whole, prompts, seeds, sched), atol=1e-5, rtol=0)
    base = latents(ToyVideoModel.from_config(cfg), prompts, seeds, sched)
    assert (base - ours).abs().max() > 1e-4, "training must have moved the weights"


def test_bad_export_requests_are_one_line(tmp_path, capsys):
    base, _ = wan_base(tmp_path, "t2v")
    cfg = wan_cfg(tmp_path, base)
    run = make_run(tmp_path, cfg, trained_adapter(load_policy(cfg, None).trainable_module(), "wan", cfg))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    cases = [(["--step", "9"], "--step 9", "kept: 3"), (["--pipeline"], "--pipeline", "LoRA run"),
             (["--out", str(tmp_path / "busy")], "not an earlier export", "busy")]
    for extra, *needles in cases:
        capsys.readouterr()
        args = ["export", str(run.path), "--out", str(tmp_path / "new"), *extra]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(n in err[0] for n in needles), err
    assert not (tmp_path / "new").exists() and (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "new")]) == 2
    # an earlier export is replaced whole
    assert main(["export", str(run.path), "--out", str(tmp_path / "new")]) == 0
    assert main(["export", str(run.path), "--out", str(tmp_path / "new")]) == 0
    # an object-store --out (fsspec's in-process one here) gets the same files, one object each
    import uuid

    from common import storage

    out = f"memory://vgrpo-export-{uuid.uuid4().hex[:8]}/exported"
    assert main(["export", str(run.path), "--out", out]) == 0
    got = sorted(p.name for p in storage.Uri(out).iterdir())
    assert got == sorted(p.name for p in (tmp_path / "new").iterdir()) == sorted([LORA_FILE, "README.md", EXPORT_JSON])
    # the same tensors and metadata (the writer may order the header's JSON differently per call)
    from safetensors.torch import load

    def parts(data: bytes):
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        meta = {k: json.loads(v) if v[:1] in "[{" else v for k, v in header.get("__metadata__", {}).items()}
        meta = {k: sorted(v["target_modules"]) if isinstance(v, dict) and "target_modules" in v else v
                for k, v in meta.items()}
        return load(data), meta

    (got_t, got_m), (want_t, want_m) = parts(storage.read_bytes(storage.join(out, LORA_FILE))), \
        parts((tmp_path / "new" / LORA_FILE).read_bytes())
    assert got_m == want_m and got_t.keys() == want_t.keys()
    assert all(torch.equal(got_t[k], want_t[k]) for k in want_t)
    storage.remove(out)


def test_the_readme_lines_load_an_export_and_sample(tmp_path, monkeypatch):
    """README.md's three lines after `vgrpo export runs/quickstart --out exported/`, run as written
    in a folder holding such an export (a toy LoRA run's), sample what vgrpo samples."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "vgrpo export runs/quickstart --out exported/" in readme
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if 'load_lora_adapter("exported/"' in b]
    assert len(code.strip().splitlines()) == 3
    cfg = _toy_cfg(tmp_path, "schedule.steps=10")
    run, ckpt, _ = _toy_run(tmp_path, cfg, steps=1)
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(run.path), "--out", "exported/"]) == 0
    ns: dict = {}
    exec(code, ns)
    want = sample_videos(load_policy(cfg, ckpt), ["a red square moving right"], [0], Schedule.linear(10, 3.0))
    assert ns["frames"].shape == (1, 6, 16, 16, 3) and torch.equal(ns["frames"], want)


def test_an_export_to_s3_prints_a_loader_that_downloads_it_first(tmp_path, s3_root, capsys, monkeypatch):
    """diffusers loads local folders: `vgrpo export --out s3://…` printed `load_lora_adapter("s3://…")`,
    which it cannot open. The printed lines (also the card's and vgrpo_export.json's), run as written
    in another folder against the S3 endpoint, download the export and sample what vgrpo samples."""
    from common import storage

    cfg = _toy_cfg(tmp_path, "schedule.steps=10")
    run, ckpt, _ = _toy_run(tmp_path, cfg, steps=1)
    out = f"{s3_root}/exported"
    capsys.readouterr()
    assert main(["export", str(run.path), "--out", out]) == 0
    code = capsys.readouterr().out.split("load it with:\n", 1)[1].strip()
    assert '("s3://' not in code.split("\n", 2)[2], code           # nothing after the download reads s3://
    assert code.splitlines()[0] == (f"# diffusers loads local folders: download {out} first (or in a shell: "
                                    f"aws s3 cp --recursive {out} exported/)")
    assert json.loads(storage.read_bytes(storage.join(out, EXPORT_JSON)))["load"] == code
    assert code in storage.read_bytes(storage.join(out, "README.md")).decode()
    where = tmp_path / "elsewhere"
    where.mkdir()
    monkeypatch.chdir(where)
    ns: dict = {}
    exec(code, ns)
    assert sorted(p.name for p in (where / "exported").iterdir()) == sorted([LORA_FILE, "README.md", EXPORT_JSON])
    want = sample_videos(load_policy(cfg, ckpt), ["a red square moving right"], [0], Schedule.linear(10, 3.0))
    assert torch.equal(ns["frames"], want)

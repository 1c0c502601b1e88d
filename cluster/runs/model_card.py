"""The model card (README.md) of an exported policy: the base, the method and its config, the
steps trained, the before/after evaluation with its standard errors, how to load it, and the
command that made the folder."""

from __future__ import annotations

from typing import Any

import yaml

from common import storage
from common.config import RunConfig, to_dict
from common.families import FAMILIES

# the config sections that define the method (the rest is plumbing: pools, logging); of two of
# them only the fields that do (not where Redis is, what checkpoints and evaluations keep)
METHOD_SECTIONS = ("schedule", "sde", "sampler", "grpo", "optim", "kl", "align", "bank", "rewards", "train")
KEPT = {"bank": {"enabled", "capacity", "strategy", "max_staleness"},
            "train": {"steps", "mode", "max_staleness", "groups_per_step", "seed", "prompts"}}


def method_name(cfg: RunConfig) -> str:
    """One line: the SDE scheme, the KL to which anchor, TAGRPO's alignment and bank when on."""
    parts = [f"GRPO with the `{cfg.sde.scheme}` SDE (η {cfg.sde.eta})"]
    if cfg.grpo.equalizer:
        parts.append("SAGE's equalizer")
    parts.append(f"KL {cfg.kl.strategy} (λ {cfg.kl.lam})")
    if cfg.align.enabled:
        parts.append(f"TAGRPO alignment (γ {cfg.align.gamma}) with a {cfg.bank.strategy} memory bank")
    return ", ".join(parts)


def load_snippet(info: dict[str, Any], out: str) -> str:
    """Python that loads the folder with diffusers and samples one video. diffusers reads local
    folders (or hub ids) only: an export on an object store is downloaded first, by the snippet's
    own first lines, into a folder of its name, and loaded from there."""
    if storage.is_uri(out):
        uri, rest = out.rstrip("/"), out.partition("://")[2].strip("/")
        local = rest.rsplit("/", 1)[1] if "/" in rest else "vgrpo-export"  # the bucket itself: no name
        alt = (f" (or in a shell: aws s3 cp --recursive {uri} {local}/)"
               if out.lower().startswith(("s3://", "s3a://")) else "")
        fetch = [f"# diffusers loads local folders: download {uri} first{alt}",
                 f'import fsspec; fs, src = fsspec.core.url_to_fs({uri!r}); '
                 f'fs.get(src + "/", {local + "/"!r}, recursive=True)']
        return "\n".join([*fetch, load_snippet(info, f"{local}/")])
    base, kind = info["base"], info["kind"]
    if not FAMILIES[base["family"]].needs_path:  # its own pipeline, not diffusers'
        return _toy_snippet(info, out)
    pipe_cls, tr_cls = info["pipeline_class"], info["transformer_class"]
    dtype = f"torch.{base['dtype']}"
    call = (f'video = pipe("a prompt", num_frames={base["num_frames"]}, height={base["height"]}, '
            f'width={base["width"]}).frames[0]' if base["task"] == "t2v" else
            f'video = pipe(image, "a prompt", num_frames={base["num_frames"]}, height={base["height"]}, '
            f'width={base["width"]}).frames[0]   # image: the first frame (PIL)')
    lines = ["import torch", f"from diffusers import {pipe_cls}" + (f", {tr_cls}" if kind == "full" else "")]
    if kind == "lora":
        lines.append(f'pipe = {pipe_cls}.from_pretrained("{base["path"]}", torch_dtype={dtype})')
        if FAMILIES[base["family"]].lora_on_transformer:  # diffusers 0.42's pipeline has no load_lora_weights
            lines.append(f'pipe.transformer.load_lora_adapter("{out}", use_safetensors=True)')
        else:
            lines.append(f'pipe.load_lora_weights("{out}")')
            if "transformer_2" in info.get("lora", {}).get("experts", []):
                lines.append(f'pipe.load_lora_weights("{out}", weight_name="pytorch_lora_weights_transformer_2'
                             '.safetensors", load_into_transformer_2=True)')
    elif info.get("pipeline"):
        lines.append(f'pipe = {pipe_cls}.from_pretrained("{out}", torch_dtype={dtype})')
    else:
        lines.append(f'transformer = {tr_cls}.from_pretrained("{out}", subfolder="transformer", torch_dtype={dtype})')
        lines.append(f'pipe = {pipe_cls}.from_pretrained("{base["path"]}", transformer=transformer, '
                     f'torch_dtype={dtype})')
    return "\n".join([*lines, call])


def _toy_snippet(info: dict[str, Any], out: str) -> str:
    base = info["base"]
    head = ("from common.sde import Schedule; from rollout_worker.models.toy import ToyVideoModel; "
            "from rollout_worker.sampler import sample_videos")
    src = "" if base["path"] is None else f'"{base["path"]}"'
    if info["kind"] == "lora":
        load = (f'model = ToyVideoModel.from_pretrained({src}); '
                f'model.transformer.load_lora_adapter("{out}", use_safetensors=True)  # diffusers\' LoRA loader')
    else:
        load = f'model = ToyVideoModel.from_pretrained("{out}")  # its transformer/: WanTransformer3DModel'
    sched = info.get("schedule", "Schedule.linear(10, 3.0)")
    images = "" if base["task"] == "t2v" else ", images=first_frames  # uint8 [1, H, W, 3]"
    sample = f'frames = sample_videos(model, ["a red square moving right"], [0], {sched}{images})  # uint8 [1, F, H, W, 3]'
    return "\n".join([head, load, sample])


def eval_table(summary: dict[str, Any]) -> str:
    """The before/after table of summary.json (paired over the same (prompt, seed) pairs)."""
    rows = summary.get("paired") or []
    before, after = summary.get("before") or {}, summary.get("after") or {}
    if not rows:
        return "No before/after evaluation in this run (trained with --no-eval)."
    out = ["| reward | before | after | after − before | z |", "|---|---|---|---|---|"]
    for r in rows:
        k = r["key"]
        out.append(f"| {k} | {r['before']:.3f} ± {before.get(f'{k}_se', float('nan')):.3f} | "
                   f"{r['after']:.3f} ± {after.get(f'{k}_se', float('nan')):.3f} | "
                   f"{r['diff']:+.3f} ± {r['se']:.3f} | {r['z']:.1f} |")
    return "\n".join(out)


def model_card(info: dict[str, Any], cfg: RunConfig, summary: dict[str, Any]) -> str:
    base, step = info["base"], info["step"]
    base_name = base["path"] or f"the committed toy {base['task']} model (rollout_worker/models/assets)"
    what = (f"a LoRA adapter (rank {cfg.optim.lora_rank}, alpha {cfg.optim.lora_alpha}) for the transformer"
            if info["kind"] == "lora" else "the fully fine-tuned transformer"
            + (" with the base's other components (a whole pipeline)" if info.get("pipeline") else ""))
    weights = (f"the exponential moving average of the trained weights (optim.ema_decay = {info['ema_decay']})"
               if info["weights"] == "ema" else "the trained weights at that step (no moving average)")
    evaluated = summary.get("steps")
    note = "" if evaluated in (None, step) else (
        f"\n\nThe evaluation is of the run's final policy (step {evaluated}); this folder is step {step}.")
    tags = ["vgrpo", "grpo", info["kind"], "text-to-video" if base["task"] == "t2v" else "image-to-video",
            base["family"]]
    front = yaml.safe_dump({"library_name": "diffusers", "base_model": base["path"] or "vgrpo-toy",
                            "tags": tags}, sort_keys=False).strip()
    data = to_dict(cfg)
    method_cfg = yaml.safe_dump({k: {f: v for f, v in data[k].items() if k not in KEPT or f in KEPT[k]}
                                 for k in METHOD_SECTIONS}, sort_keys=False).strip()
    return f"""---
{front}
---

# {info['run_name']} at step {step}

Post-trained from **{base_name}** ({base['family']}, {base['task']}) with vgrpo: {method_name(cfg)}.
{step} optimizer steps. This folder holds {what}; the weights are {weights}.

## Load it

```python
{info['load']}
```

## Evaluation

Fixed (prompt, seed) pairs sampled with the ODE, before and after training, mean ± standard error
over the pairs; the difference is paired over the same pairs (z = difference / its standard error).

{eval_table(summary)}{note}

## Method and config

{method_name(cfg)}. The run's settings that define it:

```yaml
{method_cfg}
```

## How this folder was made

```
{info['command']}
```

from `{info['checkpoint']}` (`{info['weights']}` weights). `vgrpo_export.json` beside this file
records the same in JSON.
"""

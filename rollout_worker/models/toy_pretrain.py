"""Pretrain the toy video model by flow matching on rendered toy-world videos.

Recipe (from the feasibility runs in issue 4):
- data: a random prompt of the whole world (all 16 colour × direction pairs), a random start;
  with probability `i2v_prob` it is an I2V video (toyworld.i2v_spec) whose first frame is given
  as the I2V condition; with probability
  `cfg_drop` the text is dropped (zero embeddings) so CFG has an unconditional model;
- σ ~ logit-normal shifted by `shift` (σ' = s·u / (1 + (s-1)·u), u = sigmoid(N(0, 1))): the
  direction is decided at σ > 0.8, which plain logit-normal almost never trains;
- x_σ = (1-σ)·x0 + σ·ε, loss = ‖v_θ(x_σ, σ, c) - (ε - x0)‖²;
- AdamW, linear warm-up then a constant lr, so `--steps K` reproduces the snapshot at step K.
Every `eval_every` steps it samples the fixed eval set with a deterministic ODE, scores it
with the verifiable toy measurements, and (with `snapshot_dir`) saves a snapshot, so the
released base can be picked where colour is right but direction only partly right.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from common import toyscore
from common import toyworld as tw
from common.sde import Schedule
from rollout_worker.models.toy import ToyVideoModel

EVAL_STEPS, EVAL_SHIFT = 16, 3.0


@torch.no_grad()
def ode_sample(model: ToyVideoModel, prompts: list[str], seeds: list[int], steps: int = EVAL_STEPS,
               shift: float = EVAL_SHIFT, images: torch.Tensor | None = None) -> torch.Tensor:
    """Deterministic Euler ODE (x ← x - Δ·v); video i depends only on (prompts[i], seeds[i]). → uint8 [B, F, H, W, 3]"""
    x = torch.cat([model.initial_noise(1, torch.Generator().manual_seed(s)) for s in seeds])  # [B, C, F, H, W]
    cond = model.encode(prompts, images)
    sched = Schedule.linear(steps, shift)
    for k in range(sched.steps):
        s, s1 = sched.pair(k)
        v = model.velocity(x, torch.full((len(seeds),), s), cond)
        x = x - (s - s1) * v
    return model.decode(x)


def summarize(frames: torch.Tensor, prompts: list[str], images: torch.Tensor | None = None) -> dict[str, Any]:
    """Mean ± stderr of each head and part over a batch of videos, plus direction accuracy
    (and IA with its parts when the I2V condition images uint8 [B, H, W, 3] are given)."""
    imgs = [None] * len(prompts) if images is None else [i.numpy() for i in images]
    rows = [toyscore.score_video(f.numpy(), p, i) for f, p, i in zip(frames, prompts, imgs, strict=True)]
    out: dict[str, Any] = {"n": len(rows)}
    for key in rows[0]:
        vals = np.asarray([r[key] for r in rows])
        out[key] = {"mean": float(vals.mean()), "stderr": float(vals.std(ddof=1) / math.sqrt(len(vals)))}
    total = np.asarray([sum(r[h] for h in toyscore.HEADS) for r in rows])
    out["reward"] = {"mean": float(total.mean()), "stderr": float(total.std(ddof=1) / math.sqrt(len(total)))}
    return out


def eval_images(pairs: list[tuple[str, int]]) -> torch.Tensor:
    """The I2V condition of each eval (prompt, seed): its seeded first frame. uint8 [N, H, W, 3]"""
    return torch.from_numpy(np.stack([tw.i2v_condition(p, s) for p, s in pairs]))


def evaluate(model: ToyVideoModel, seeds_per_prompt: int = 16, steps: int = EVAL_STEPS,
             shift: float = EVAL_SHIFT, batch: int = 64, i2v: bool = False) -> dict[str, Any]:
    """Heads on the fixed eval set (toyworld.eval_pairs), sampled with the ODE; `i2v` conditions
    each pair on its seeded first frame and adds IA."""
    pairs = tw.eval_pairs(seeds_per_prompt)
    images = eval_images(pairs) if i2v else None
    frames = torch.cat([ode_sample(model, [p for p, _ in pairs[i:i + batch]], [s for _, s in pairs[i:i + batch]],
                                   steps, shift, None if images is None else images[i:i + batch])
                        for i in range(0, len(pairs), batch)])
    return summarize(frames, [p for p, _ in pairs], images)


def make_batch(rng: np.random.Generator, batch: int, i2v_prob: float, num_frames: int, size: int):
    """Rendered training videos: (prompts [B], frames uint8 [B, F, H, W, 3], first frames or None per row)."""
    prompts = [tw.WORLD_PROMPTS[i] for i in rng.integers(0, len(tw.WORLD_PROMPTS), batch)]
    use_img = rng.uniform(size=batch) < i2v_prob
    # an I2V row is an I2V video (centre start, short travel): its first frame does not tell the direction
    frames = np.stack([tw.render((tw.i2v_spec if i2v else tw.random_spec)(p, rng, size), num_frames, size)
                       for p, i2v in zip(prompts, use_img, strict=True)])
    return prompts, torch.from_numpy(frames), torch.from_numpy(use_img)


def sample_sigma(gen: torch.Generator, batch: int, shift: float) -> torch.Tensor:
    u = torch.sigmoid(torch.randn(batch, generator=gen))
    return shift * u / (1.0 + (shift - 1.0) * u)                            # [B]


def pretrain(steps: int, batch: int = 64, lr: float = 1e-3, seed: int = 0, out_path: str | Path | None = None,
             eval_every: int = 200, eval_seeds: int = 16, snapshot_dir: str | Path | None = None,
             warmup: int = 100, shift: float = 3.0, cfg_drop: float = 0.1, i2v_prob: float = 0.25,
             weight_decay: float = 0.0, command: str = "", progress: bool = True,
             init: str | Path | None = None, i2v_layout: str = "first_frame",
             eval_i2v: bool | None = None) -> tuple[ToyVideoModel, list[dict]]:
    """Train from scratch (or go on from the checkpoint `init`, with the condition layout
    `i2v_layout`); returns the model and the eval history [{step, loss (mean since the last
    eval), eval}]. The eval is I2V (with IA) when `eval_i2v`, by default when i2v_prob >= 0.5."""
    # 1. Model, optimizer and the two independent streams (data / noise) from one seed.
    torch.manual_seed(seed)
    model = _initial_model(init, i2v_layout)
    eval_i2v = i2v_prob >= 0.5 if eval_i2v is None else eval_i2v
    net = model.trainable_module().train()
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(warmup, 1)))
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    history: list[dict] = []
    record = {"command": command, "seed": seed, "steps": steps, "batch": batch, "lr": lr, "warmup": warmup,
              "shift": shift, "cfg_drop": cfg_drop, "i2v_prob": i2v_prob, "weight_decay": weight_decay,
              "init": None if init is None else str(init), "i2v_layout": i2v_layout, "eval_i2v": eval_i2v,
              "params": sum(p.numel() for p in net.parameters()), "torch": torch.__version__,
              "threads": torch.get_num_threads(),
              "eval_set": {"prompts": list(tw.EVAL_PROMPTS), "seeds_per_prompt": eval_seeds,
                           "ode_steps": EVAL_STEPS, "shift": EVAL_SHIFT}}

    def checkpoint(step: int, loss: float, path: Path) -> None:
        if not history or history[-1]["step"] != step:                  # one eval per step
            net.eval()
            history.append({"step": step, "loss": loss, "eval": evaluate(model, eval_seeds, i2v=eval_i2v)})
            net.train()
        model.save_pretrained(path, {"pretrain": {**record, **history[-1]}})

    # 2. Flow-matching loop.
    columns = [TextColumn("toy pretrain"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn()]
    window: list[float] = []                                               # losses since the last eval
    t0 = time.perf_counter()
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("train", total=steps, info="")
        for step in range(1, steps + 1):
            window.append(_train_step(model, opt, sched, rng, gen, batch, shift, cfg_drop, i2v_prob))
            rate = step / (time.perf_counter() - t0)
            bar.update(task, advance=1, info=f"loss {np.mean(window[-50:]):.4f}  {rate:.1f} it/s")
            if snapshot_dir is not None and (step % eval_every == 0 or step == steps):
                mean_loss = float(np.mean(window))
                window = []
                checkpoint(step, mean_loss, Path(snapshot_dir) / f"step_{step:05d}.safetensors")
                bar.console.print(_eval_line(step, mean_loss, history[-1]["eval"]))

    # 3. The final checkpoint, with its eval record.
    net.eval()
    if out_path is not None:
        checkpoint(steps, float(np.mean(window[-eval_every:])) if window else history[-1]["loss"], Path(out_path))
    return model, history


def _initial_model(init: str | Path | None, i2v_layout: str) -> ToyVideoModel:
    """A fresh model (seeded by the caller), or the checkpoint `init` with the layout `i2v_layout`."""
    if init is None:
        return ToyVideoModel(i2v_layout=i2v_layout)
    model = ToyVideoModel.from_pretrained(init)
    model.i2v_layout = i2v_layout
    return model


def _train_step(model: ToyVideoModel, opt: torch.optim.Optimizer, sched, rng: np.random.Generator,
                gen: torch.Generator, batch: int, shift: float, cfg_drop: float, i2v_prob: float) -> float:
    """One flow-matching step on a rendered batch: x_σ = (1-σ)·x0 + σ·ε, loss ‖v - (ε - x0)‖²."""
    net = model.trainable_module()
    _, F, H, _ = model.latent_shape
    prompts, frames, use_img = make_batch(rng, batch, i2v_prob, F, H)
    x0 = ToyVideoModel.encode_frames(frames)                       # [B, 3, F, H, W]
    drop = torch.rand(batch, generator=gen) < cfg_drop
    prompts = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
    cond = model.encode(prompts, frames[:, 0])
    cond.tensors["image"][~use_img] = 0.0                          # T2V rows: no first frame
    sigma = sample_sigma(gen, batch, shift)                        # [B]
    eps = torch.randn(x0.shape, generator=gen)
    s = sigma.view(-1, 1, 1, 1, 1)
    x = (1 - s) * x0 + s * eps
    v = model.velocity(x, sigma, cond)
    loss = ((v - (eps - x0)) ** 2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def _eval_line(step: int, loss: float, ev: dict[str, Any]) -> str:
    return (f"step {step}: loss {loss:.4f}  VQ {ev['VQ']['mean']:.3f}  MQ {ev['MQ']['mean']:.3f}"
            f"  TA {ev['TA']['mean']:.3f}  colour {ev['colour']['mean']:.3f}"
            f"  dir-acc {ev['direction_correct']['mean']:.3f}"
            + (f"  IA {ev['IA']['mean']:.3f}" if "IA" in ev else ""))

"""A run's evaluation on the rollout pool: ODE samples of the fixed evaluation pairs
(`EvalSet`), scored by the reward role, plus what the run directory shows of them.

Each rollout actor samples its share and scores it through its own reward client
(evaluate.score_pairs); the caller gets every pair's score row, and frames only for the few
pairs it renders: the GIFs, the tracker's grid and before_after.png.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cluster.data.manifests import side_by_side
from cluster.evaluation.before_after import shown_pairs
from cluster.evaluation.eval_set import EvalSet
from cluster.evaluation.evaluate import EvalResult, sample_pairs, score_pairs
from cluster.runs.media import write_gif
from cluster.runs.tracking import tiled

log = logging.getLogger(__name__)


@dataclass
class RunEval:
    result: EvalResult
    shown: np.ndarray       # uint8 [N, F, H, W, 3]: the pairs before_after.png shows
    shown_per: int          # of them, seeds per prompt
    prompts: list[str]      # its row labels


def evaluate_run(cfg, rollouts: list, heads, run_dir, step: int, label: str, gifs: int,
                 note: Callable[[str], None]) -> RunEval:
    """Evaluate with the weights the (idle) rollout actors hold; write `gifs` GIFs and the
    tracker's grid video under `label`."""
    evals = EvalSet.load(cfg.train.eval_prompts, cfg.train.eval_seeds, cfg.model, cfg.data)
    gif_pairs = evals.firsts(gifs)  # the first seed of each prompt
    grid = evals.grid(cfg.log.video_pairs)
    shown, shown_per = shown_pairs(len(evals), evals.per_prompt)
    t0 = time.monotonic()
    scores, frames = score_pairs(rollouts, evals, keep={*gif_pairs, *grid, *shown})
    composite = heads.composite(scores)
    for i, k in enumerate(gif_pairs):
        cond = evals.conditions[k]
        video = side_by_side(frames[k].numpy(), cond, cfg.model)  # I2V: first frame beside it
        name = cond.name or cond.prompt.replace(' ', '_')  # a dataset row's id, else the prompt
        write_gif(video, run_dir.samples / f"{label}_{i}_{name}.gif")
    run_dir.log_video(f"videos/{label}", tiled(_stack(frames, grid)), step)
    note(f"evaluation '{label}': {len(evals)} videos in {time.monotonic() - t0:.1f}s "
         f"({len(frames)} came back to render), composite {composite.mean():.3f}")
    return RunEval(EvalResult(scores.heads, scores.values.numpy(), composite.numpy()), _stack(frames, shown),
                   shown_per, [c.prompt for c in evals.prompt_conditions])


def _stack(frames: dict, order: list[int]) -> np.ndarray:
    """The kept evaluation frames of the pairs in `order`, uint8 [len(order), F, H, W, 3]."""
    return np.stack([frames[k].numpy() for k in order])


def step_videos(cfg, step: int, rollouts: list, run_dir) -> None:
    """Every log.video_every steps: the first log.video_pairs evaluation pairs in grid order
    (the first seed of every prompt first; I2V with their first frames) sampled with the actors'
    current weights, one tiled video (always written to samples/, and sent to each tracker)."""
    every = cfg.log.video_every
    if not every or step % every:
        return
    evals = EvalSet.load(cfg.train.eval_prompts, cfg.train.eval_seeds, cfg.model, cfg.data)
    try:
        frames = sample_pairs(rollouts, evals.subset(evals.grid(cfg.log.video_pairs))).numpy()
    except Exception as e:  # a rollout actor restarting: the video waits for the next turn, the run goes on
        log.warning("step %d: no sample video (%s: %s)", step, type(e).__name__, e)
        return
    run_dir.log_video("videos/train", tiled(frames), step)

"""The toy world's image-to-video sets, written as a real dataset (JSONL manifest + PNGs).

- train: every training prompt (toyworld.TRAIN_PROMPTS, 12) with the first frames of
  `TRAIN_IMAGES` seeds; a colour's prompts share its images, so only the words tell the
  directions apart.
- eval: the held-out prompts (toyworld.EVAL_PROMPTS, the Latin-square diagonal) with first
  frames from evaluation seeds (>= toyworld.EVAL_SEED_BASE) no training image uses: held-out
  (image, prompt) pairs.
The committed copy lives in rollout_worker/models/assets/toy_i2v/ (`vgrpo toy i2v-data`
rewrites it; tests/test_datasets.py checks it is what this module writes).
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from common import toyworld as tw

TRAIN_IMAGES = 4
EVAL_IMAGES = 8


def rows(split: str) -> list[tuple[str, str, int]]:
    """(row id, prompt, image seed) of a split, in manifest order."""
    if split == "train":
        prompts, seeds = tw.TRAIN_PROMPTS, range(TRAIN_IMAGES)
    elif split == "eval":
        prompts, seeds = tw.EVAL_PROMPTS, tw.eval_seeds(EVAL_IMAGES)
    else:
        raise ValueError(f"split {split!r}: expected 'train' or 'eval'")
    out = []
    for p in prompts:
        spec = tw.parse_prompt(p)
        out += [(f"{spec.colour}-{spec.direction}-{s}", p, s) for s in seeds]
    return out


def image_name(prompt: str, seed: int) -> str:
    return f"images/{tw.parse_prompt(prompt).colour}_{seed}.png"


def write_sets(out: str | Path) -> list[Path]:
    """Write OUT/train.jsonl, OUT/eval.jsonl and OUT/images/*.png; returns the manifests."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    manifests = []
    for split in ("train", "eval"):
        lines = []
        for rid, prompt, seed in rows(split):
            name = image_name(prompt, seed)
            if not (out / name).exists():
                Image.fromarray(tw.i2v_condition(prompt, seed)).save(out / name)
            lines.append(json.dumps({"id": rid, "prompt": prompt, "image": name}))
        path = out / f"{split}.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        manifests.append(path)
    return manifests

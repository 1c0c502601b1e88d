"""The toy world: a coloured square moving across a black frame, and the prompts that name it.

A video is `num_frames` frames of `size`×`size` RGB (uint8 [F, H, W, 3]). The square (side
`SIDE` px) moves `TRAVEL` px in total — about half the frame — at constant speed, so a
perfect video has a straight, evenly spaced path. Positions are continuous; the renderer
draws the exact pixel coverage (area anti-aliasing), so sub-pixel motion stays smooth.

Prompts read "a red square moving left". The prompt sets:
- `WORLD_PROMPTS`: all 16 (colour, direction) pairs; pretraining samples all of them.
- `TRAIN_PROMPTS` (12) / `EVAL_PROMPTS` (4): the GRPO split. Eval holds out one Latin-square
  diagonal of (colour, direction) pairs — every colour and every direction still appears in
  training, but never in that combination — so an eval gain means RL improved the words,
  not memorised the training prompts.
- Evaluation seeds (`eval_seeds`) are disjoint from any seed a training run draws.

Image-to-video: the condition image is the first frame of a rendered I2V video
(`i2v_condition`). An I2V square travels `I2V_TRAVEL_FRAC` of the frame (a quarter) from a start
drawn from the centre box every direction fits in (`i2v_spec`), so the image fixes where the
square starts, its colour and size, and only the prompt says which way it goes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
}
SHAPES: tuple[str, ...] = ("square",)
DIRECTIONS: dict[str, tuple[float, float]] = {  # unit (dy, dx) in image coordinates (y down)
    "left": (0.0, -1.0),
    "right": (0.0, 1.0),
    "up": (-1.0, 0.0),
    "down": (1.0, 0.0),
}
NUM_FRAMES = 6
SIZE = 16
SIDE = 5.0
"""Side of the square in pixels."""
TRAVEL_FRAC = 0.5
"""Total travel over the video as a fraction of the frame size."""
I2V_TRAVEL_FRAC = 0.25
"""Total travel of an image-to-video square: short enough that any direction fits from the centre."""
EVAL_SEED_BASE = 1_000_000
"""Evaluation seeds start here; training code draws seeds below it."""

_PROMPT_RE = re.compile(r"^\s*an?\s+(\w+)\s+(\w+)\s+moving\s+(\w+)\s*\.?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class VideoSpec:
    """Everything that fixes one video: what the prompt says plus where the square starts."""

    colour: str
    shape: str
    direction: str
    start: tuple[float, float] | None = None
    """(y, x) of the square's top-left corner in frame 0; None centres the path."""
    travel_frac: float = TRAVEL_FRAC
    """Total travel as a fraction of the frame size (I2V videos: I2V_TRAVEL_FRAC)."""

    @property
    def prompt(self) -> str:
        return make_prompt(self.colour, self.direction, self.shape)


def make_prompt(colour: str, direction: str, shape: str = "square") -> str:
    return f"a {colour} {shape} moving {direction}"


def parse_prompt(prompt: str) -> VideoSpec:
    """"a red square moving left" → VideoSpec; a ValueError names the word that is not known."""
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(f"prompt {prompt!r} does not read 'a COLOUR SHAPE moving DIRECTION'")
    colour, shape, direction = (w.lower() for w in m.groups())
    for word, known, what in ((colour, COLOURS, "colour"), (shape, SHAPES, "shape"),
                              (direction, DIRECTIONS, "direction")):
        if word not in known:
            raise ValueError(f"prompt {prompt!r}: unknown {what} {word!r}; expected one of {sorted(known)}")
    return VideoSpec(colour, shape, direction)


WORLD_PROMPTS: tuple[str, ...] = tuple(make_prompt(c, d) for c in COLOURS for d in DIRECTIONS)
# The held-out diagonal: colour i with direction i.
EVAL_PROMPTS: tuple[str, ...] = tuple(make_prompt(c, d) for c, d in zip(COLOURS, DIRECTIONS, strict=True))
TRAIN_PROMPTS: tuple[str, ...] = tuple(p for p in WORLD_PROMPTS if p not in EVAL_PROMPTS)
PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "toy-world": WORLD_PROMPTS, "toy-train": TRAIN_PROMPTS, "toy-eval": EVAL_PROMPTS,
}


def eval_seeds(n: int) -> list[int]:
    """The fixed evaluation seeds (disjoint from training seeds)."""
    return [EVAL_SEED_BASE + i for i in range(n)]


def eval_pairs(seeds_per_prompt: int) -> list[tuple[str, int]]:
    """The fixed evaluation set: every eval prompt with each eval seed, prompt-major."""
    return [(p, s) for p in EVAL_PROMPTS for s in eval_seeds(seeds_per_prompt)]


# --- geometry ------------------------------------------------------------------------


def travel(size: int = SIZE, frac: float = TRAVEL_FRAC) -> float:
    return frac * size


def side(size: int = SIZE) -> float:
    return SIDE * size / SIZE


def start_range(direction: str, size: int = SIZE) -> tuple[tuple[float, float], tuple[float, float]]:
    """Allowed (lo, hi) of the start corner along y and x so the square stays in frame."""
    dy, dx = DIRECTIONS[direction]
    free = size - side(size)
    t = travel(size)
    rng = []
    for d in (dy, dx):
        lo, hi = (0.0, free) if d == 0 else ((0.0, free - t) if d > 0 else (t, free))
        rng.append((lo, hi))
    return rng[0], rng[1]


def random_spec(prompt: str, rng: np.random.Generator, size: int = SIZE) -> VideoSpec:
    """The prompt's video with a start drawn uniformly (on a quarter-pixel grid) from its range."""
    spec = parse_prompt(prompt)
    (ylo, yhi), (xlo, xhi) = start_range(spec.direction, size)
    y = ylo + np.floor(rng.uniform(0, 1) * ((yhi - ylo) * 4 + 1)) / 4
    x = xlo + np.floor(rng.uniform(0, 1) * ((xhi - xlo) * 4 + 1)) / 4
    return VideoSpec(spec.colour, spec.shape, spec.direction, (float(y), float(x)))


def i2v_start_range(size: int = SIZE) -> tuple[float, float]:
    """The (lo, hi) of the I2V start corner along each axis: from there every direction fits."""
    t = travel(size, I2V_TRAVEL_FRAC)
    return t, size - side(size) - t


def i2v_spec(prompt: str, rng: np.random.Generator, size: int = SIZE) -> VideoSpec:
    """The prompt's I2V video: a start drawn (quarter-pixel grid) from the centre box, short travel."""
    spec = parse_prompt(prompt)
    lo, hi = i2v_start_range(size)
    y, x = (lo + np.floor(rng.uniform(0, 1) * ((hi - lo) * 4 + 1)) / 4 for _ in range(2))
    return VideoSpec(spec.colour, spec.shape, spec.direction, (float(y), float(x)), I2V_TRAVEL_FRAC)


def path(spec: VideoSpec, num_frames: int = NUM_FRAMES, size: int = SIZE) -> np.ndarray:
    """Top-left corner per frame, float [F, 2] (y, x)."""
    dy, dx = DIRECTIONS[spec.direction]
    if spec.start is None:
        (ylo, yhi), (xlo, xhi) = start_range(spec.direction, size)
        start = ((ylo + yhi) / 2, (xlo + xhi) / 2)
    else:
        start = spec.start
    f = np.arange(num_frames) / max(num_frames - 1, 1)          # [F] in [0, 1]
    step = travel(size, spec.travel_frac) * f
    return np.stack([start[0] + dy * step, start[1] + dx * step], axis=1)


def _coverage_1d(lo: np.ndarray, length: float, size: int) -> np.ndarray:
    """Overlap of [lo, lo+length] with each pixel [i, i+1]: [N] → [N, size]."""
    i = np.arange(size)[None, :]
    lo = lo[:, None]
    return np.clip(np.minimum(lo + length, i + 1) - np.maximum(lo, i), 0.0, 1.0)


def render_corners(corners: np.ndarray, colour: str, size: int = SIZE) -> np.ndarray:
    """A square at each top-left corner [F, 2] → uint8 [F, H, W, 3], exact area coverage."""
    s = side(size)
    cov = _coverage_1d(corners[:, 0], s, size)[:, :, None] * _coverage_1d(corners[:, 1], s, size)[:, None, :]
    rgb = np.asarray(COLOURS[colour], dtype=np.float64)
    return np.round(cov[..., None] * rgb).astype(np.uint8)          # [F, H, W, 3]


def render(prompt_or_spec: str | VideoSpec, num_frames: int = NUM_FRAMES, size: int = SIZE) -> np.ndarray:
    """The video a prompt (centred path) or a spec describes: uint8 [F, H, W, 3]."""
    spec = parse_prompt(prompt_or_spec) if isinstance(prompt_or_spec, str) else prompt_or_spec
    if spec.shape not in SHAPES:
        raise ValueError(f"shape {spec.shape!r} is not drawable; expected one of {list(SHAPES)}")
    return render_corners(path(spec, num_frames, size), spec.colour, size)


def i2v_video(prompt: str, seed: int, num_frames: int = NUM_FRAMES, size: int = SIZE) -> np.ndarray:
    """The ideal I2V video for (prompt, seed), uint8 [F, H, W, 3]."""
    return render(i2v_spec(prompt, np.random.default_rng(seed), size), num_frames, size)


def i2v_condition(prompt: str, seed: int, num_frames: int = NUM_FRAMES, size: int = SIZE) -> np.ndarray:
    """The I2V condition for (prompt, seed): the first frame of its seeded I2V video, uint8 [H, W, 3].
    The start does not depend on the direction, so the image does not give the direction away."""
    return i2v_video(prompt, seed, num_frames, size)[0]

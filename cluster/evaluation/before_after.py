"""The before/after picture of a run: the same (prompt, seed) evaluation pairs, ODE-sampled by the
base and by the trained policy, one PNG a reader can judge by eye (`run_dir/before_after.png`).
Each picture row is labelled on the left: "before" with its prompt, then "after". The frames of a
video stand apart (a dark gap), so its motion reads frame by frame; in the toy world a last cell
draws the square's path, the motion the rewards score."""

from __future__ import annotations

from pathlib import Path

import imageio.v3 as iio
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from common.toyscore import centroids, foreground

SCALE, GAP = 8, 2  # pixels per video pixel; video pixels between cells (videos, rows)
FRAME_GAP = 4      # screen pixels between the frames of one video: each frame reads as a frame
GAP_GREY, FRAME_GREY = 128, 64


def before_after_grid(before: np.ndarray, after: np.ndarray, seeds_per_prompt: int,
                      prompts: int = 4, seeds: int = 4, trails: bool = False) -> np.ndarray:
    """uint8 [N, F, H, W, 3] twice (pairs in the same order, prompt-major) → one image.

    For each of the first `prompts` prompts, its first `seeds` seeds: a row of the base's videos,
    then the same seeds after training. Each video is its frames side by side, FRAME_GAP apart;
    `trails` (the toy world) adds a cell after them with the square's path (toyscore's centroid
    per frame, what the motion and direction rewards measure) over the faded frames."""
    if before.shape != after.shape:
        raise ValueError(f"before/after grid: the evaluations differ in shape {before.shape} vs {after.shape}; "
                         "both must sample the same (prompt, seed) pairs")
    idx, k = shown_pairs(before.shape[0], seeds_per_prompt, prompts, seeds)
    rows = []
    for p in range(len(idx) // k):
        for videos in (before, after):
            strips = [film_strip(videos[i], SCALE, FRAME_GAP, trail_cell(videos[i], SCALE) if trails else None)
                      for i in idx[p * k:(p + 1) * k]]
            rows.append(_join(strips, axis=1, gap=GAP * SCALE))
    return _join(rows, axis=0, gap=GAP * SCALE)


def film_strip(frames: np.ndarray, scale: int, gap: int, extra: np.ndarray | None = None) -> np.ndarray:
    """uint8 [F, H, W, 3] → [H·scale, …, 3]: the frames upscaled, `gap` pixels of FRAME_GREY
    between them, and `extra` (a cell as tall) after the last."""
    cells = [f.repeat(scale, axis=0).repeat(scale, axis=1) for f in frames]
    if extra is not None:
        cells.append(extra)
    return _join(cells, axis=1, gap=gap, grey=FRAME_GREY)


def _join(parts: list[np.ndarray], axis: int, gap: int, grey: int = GAP_GREY) -> np.ndarray:
    shape = list(parts[0].shape)
    shape[axis] = gap
    sep = np.full(shape, grey, np.uint8)
    return np.concatenate([x for part in parts for x in (part, sep)][:-1], axis=axis)


def trail_cell(frames: np.ndarray, scale: int) -> np.ndarray:
    """A frame-sized cell: every frame faded and overlaid, the square's centroid per frame as a
    dot (brighter with time), joined by a line, an arrowhead on the last. Frames where toyscore
    finds no square are left out of the path."""
    ghost = (frames.astype(np.float32).max(axis=0) * 0.45).astype(np.uint8)
    img = Image.fromarray(ghost.repeat(scale, axis=0).repeat(scale, axis=1))
    draw = ImageDraw.Draw(img)
    c, _ = centroids(foreground(frames))                     # (y, x) in video pixels, NaN: no square
    pts = [(float(x) * scale, float(y) * scale) for y, x in c if np.isfinite(y)]
    if len(pts) >= 2:
        draw.line(pts, fill=(255, 255, 255), width=max(1, scale // 4))
        _arrowhead(draw, pts[-2], pts[-1], size=scale * 1.2)
    for i, (x, y) in enumerate(pts):
        v = int(120 + 135 * i / max(1, len(pts) - 1))
        r = max(1.5, scale / 4)
        draw.ellipse([x - r, y - r, x + r, y + r], fill=(v, v, v))
    return np.asarray(img)


def _arrowhead(draw, a: tuple[float, float], b: tuple[float, float], size: float) -> None:
    dx, dy = b[0] - a[0], b[1] - a[1]
    n = float(np.hypot(dx, dy))
    if n < 1e-6:
        return
    ux, uy = dx / n, dy / n
    back = (b[0] - ux * size, b[1] - uy * size)
    left = (back[0] - uy * size * 0.6, back[1] + ux * size * 0.6)
    right = (back[0] + uy * size * 0.6, back[1] - ux * size * 0.6)
    draw.polygon([b, left, right], fill=(255, 255, 255))


def shown_pairs(n: int, seeds_per_prompt: int, prompts: int = 4, seeds: int = 4) -> tuple[list[int], int]:
    """(indices of the pairs the grid shows, prompt-major; seeds shown per prompt). The frames of
    just these pairs, with `seeds_per_prompt` = the second value, give the same grid."""
    k = min(seeds, seeds_per_prompt)
    return [p * seeds_per_prompt + s for p in range(min(prompts, n // seeds_per_prompt)) for s in range(k)], k


def row_labels(n_prompts: int, prompts: list[str] | None = None) -> list[list[str]]:
    """The text beside each picture row: ["before", prompt] then ["after"], per prompt shown."""
    return [rows for p in range(n_prompts)
            for rows in (["before", *([prompts[p]] if prompts else [])], ["after"])]


def labelled(grid: np.ndarray, labels: list[list[str]], row_px: int, gap_px: int, pad: int = 8) -> np.ndarray:
    """The grid with a white strip on its left holding each picture row's lines of text, centred
    on the row (rows of `row_px` pixels, `gap_px` apart, as before_after_grid draws them)."""
    try:
        font = ImageFont.load_default(size=max(10, row_px // 8))
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        font = ImageFont.load_default()
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    boxes = [[draw.textbbox((0, 0), line, font=font) for line in lines] for lines in labels]
    width = max(b[2] for bs in boxes for b in bs) + 2 * pad
    strip = Image.new("RGB", (width, grid.shape[0]), (255, 255, 255))
    ink = ImageDraw.Draw(strip)
    for r, (lines, bs) in enumerate(zip(labels, boxes, strict=True)):
        line_px = max(b[3] for b in bs) + 4
        lines = lines[:max(1, row_px // line_px)]  # tiny videos: the lines that fit the row
        y = r * (row_px + gap_px) + max(0, row_px - line_px * len(lines)) // 2
        for i, line in enumerate(lines):
            ink.text((pad, y + i * line_px), line, fill=(0, 0, 0), font=font)
    return np.concatenate([np.asarray(strip), grid], axis=1)


def write_before_after(path: Path, before: np.ndarray, after: np.ndarray, seeds_per_prompt: int,
                       prompts: list[str] | None = None, trails: bool = False) -> Path:
    """The grid as a PNG, each row labelled; `prompts`: the evaluation's prompts, in pair order;
    `trails`: draw the toy square's path after each video."""
    grid = before_after_grid(before, after, seeds_per_prompt, trails=trails)
    idx, k = shown_pairs(before.shape[0], seeds_per_prompt)
    labels = row_labels(len(idx) // k, prompts)
    iio.imwrite(path, labelled(grid, labels, before.shape[2] * SCALE, GAP * SCALE))
    return path

"""The before/after picture of a run: the same (prompt, seed) evaluation pairs, ODE-sampled by the
base and by the trained policy, one PNG a reader can judge by eye (`run_dir/before_after.png`).
Each picture row is labelled on the left: "before" with its prompt, then "after"."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cluster.runs.media import grid_image

SCALE, GAP = 8, 2  # pixels per video pixel; video pixels between cells


def before_after_grid(before: np.ndarray, after: np.ndarray, seeds_per_prompt: int,
                      prompts: int = 4, seeds: int = 4) -> np.ndarray:
    """uint8 [N, F, H, W, 3] twice (pairs in the same order, prompt-major) → one image.

    For each of the first `prompts` prompts, its first `seeds` seeds: a row of the base's videos,
    then the same seeds after training (each video's frames side by side)."""
    if before.shape != after.shape:
        raise ValueError(f"before/after grid: the evaluations differ in shape {before.shape} vs {after.shape}; "
                         "both must sample the same (prompt, seed) pairs")
    idx, k = shown_pairs(before.shape[0], seeds_per_prompt, prompts, seeds)
    rows = []
    for p in range(len(idx) // k):
        row = idx[p * k:(p + 1) * k]
        rows += [before[row], after[row]]
    return grid_image(np.concatenate(rows), per_row=k, scale=SCALE, gap=GAP)


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
    on the row (rows of `row_px` pixels, `gap_px` apart, as cluster.runs.media.grid_image draws them)."""
    from PIL import Image, ImageDraw, ImageFont

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
                       prompts: list[str] | None = None) -> Path:
    """The grid as a PNG, each row labelled; `prompts`: the evaluation's prompts, in pair order."""
    import imageio.v3 as iio

    grid = before_after_grid(before, after, seeds_per_prompt)
    idx, k = shown_pairs(before.shape[0], seeds_per_prompt)
    labels = row_labels(len(idx) // k, prompts)
    iio.imwrite(path, labelled(grid, labels, before.shape[2] * SCALE, GAP * SCALE))
    return path

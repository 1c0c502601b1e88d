"""Writing videos a person can look at: GIFs (and MP4 when imageio-ffmpeg is present)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def upscale(frames: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour upscaling of uint8 [F, H, W, 3], so 16×16 toy videos are visible."""
    return frames.repeat(factor, axis=1).repeat(factor, axis=2)


def write_gif(frames: np.ndarray, path: Path, fps: float = 4.0, min_size: int = 128) -> Path:
    import imageio.v3 as iio  # lazy: imageio (kept out of vgrpo --help)

    factor = max(1, min_size // max(frames.shape[1], 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, upscale(frames, factor), extension=".gif", duration=1000 / fps, loop=0)
    return path


def grid_image(frames: np.ndarray, per_row: int, scale: int = 8, gap: int = 2) -> np.ndarray:
    """uint8 [N, F, H, W, 3] → one image: N/per_row rows, each video's frames side by side."""
    n, _, h, _, _ = frames.shape
    rows = []
    for i in range(0, n, per_row):
        cells = [np.concatenate(list(frames[j]), axis=1) for j in range(i, min(i + per_row, n))]
        pad = np.full((h, gap, 3), 128, np.uint8)
        rows.append(np.concatenate([c for cell in cells for c in (cell, pad)][:-1], axis=1))
    width = max(r.shape[1] for r in rows)
    rows = [np.pad(r, ((0, 0), (0, width - r.shape[1]), (0, 0)), constant_values=128) for r in rows]
    sep = np.full((gap, width, 3), 128, np.uint8)
    grid = np.concatenate([r for row in rows for r in (row, sep)][:-1], axis=0)
    return grid.repeat(scale, axis=0).repeat(scale, axis=1)

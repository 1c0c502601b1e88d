"""Writing videos a person can look at: GIFs (and MP4 when imageio-ffmpeg is present)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def upscale(frames: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour upscaling of uint8 [F, H, W, 3], so 16×16 toy videos are visible."""
    return frames.repeat(factor, axis=1).repeat(factor, axis=2)


def write_gif(frames: np.ndarray, path: Path, fps: float = 4.0, min_size: int = 128) -> Path:
    import imageio.v3 as iio

    factor = max(1, min_size // max(frames.shape[1], 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, upscale(frames, factor), extension=".gif", duration=1000 / fps, loop=0)
    return path

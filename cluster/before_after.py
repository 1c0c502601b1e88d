"""The before/after picture of a run: the same (prompt, seed) evaluation pairs, ODE-sampled by the
base and by the trained policy, one PNG a reader can judge by eye (`run_dir/before_after.png`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cluster.media import grid_image


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
    return grid_image(np.concatenate(rows), per_row=k)


def shown_pairs(n: int, seeds_per_prompt: int, prompts: int = 4, seeds: int = 4) -> tuple[list[int], int]:
    """(indices of the pairs the grid shows, prompt-major; seeds shown per prompt). The frames of
    just these pairs, with `seeds_per_prompt` = the second value, give the same grid."""
    k = min(seeds, seeds_per_prompt)
    return [p * seeds_per_prompt + s for p in range(min(prompts, n // seeds_per_prompt)) for s in range(k)], k


def write_before_after(path: Path, before: np.ndarray, after: np.ndarray, seeds_per_prompt: int) -> Path:
    import imageio.v3 as iio

    iio.imwrite(path, before_after_grid(before, after, seeds_per_prompt))
    return path

"""The before/after PNG: rows alternate the base's and the trained policy's videos of the same pairs."""

import numpy as np
import pytest

from cluster.before_after import before_after_grid
from cluster.media import grid_image


def _videos(n: int, value_of) -> np.ndarray:
    v = np.zeros((n, 2, 3, 3, 3), np.uint8)  # [N, F, H, W, 3]
    for i in range(n):
        v[i] = value_of(i)
    return v


def test_rows_alternate_before_and_after_on_the_same_pairs():
    per = 5                                      # seeds per prompt; 3 prompts → 15 pairs
    before = _videos(15, lambda i: i)            # each video a flat colour = its pair index
    after = _videos(15, lambda i: 100 + i)
    grid = before_after_grid(before, after, per, prompts=2, seeds=3)
    # independent reference: the rows built by hand from pair indices
    idx = [[0, 1, 2], [5, 6, 7]]
    ref = np.concatenate([before[idx[0]], after[idx[0]], before[idx[1]], after[idx[1]]])
    assert np.array_equal(grid, grid_image(ref, per_row=3))
    # the second row of the picture (after, prompt 0, seed 0) shows pair 0 after training
    cell = 3 * 8                                 # H·scale
    assert grid[cell + 2 * 8 + 1, 0, 0] == 100


def test_different_pairs_are_refused():
    with pytest.raises(ValueError, match="same \\(prompt, seed\\) pairs"):
        before_after_grid(_videos(4, lambda i: i), _videos(8, lambda i: i), 4)

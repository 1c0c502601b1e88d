"""The before/after PNG: rows alternate the base's and the trained policy's videos of the same pairs."""

import numpy as np
import pytest

from cluster.evaluation.before_after import before_after_grid
from cluster.runs.media import grid_image


def _videos(n: int, value_of, size: int = 3) -> np.ndarray:
    v = np.zeros((n, 2, size, size, 3), np.uint8)  # [N, F, H, W, 3]
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


def test_each_picture_row_is_labelled_beside_it_and_the_videos_are_unchanged(tmp_path):
    import imageio.v3 as iio

    from cluster.evaluation.before_after import write_before_after

    per, prompts = 4, ["a red square moving left", "a green square moving right", "a blue square moving up"]
    before = _videos(12, lambda i: i, size=16)                     # the toy model's 16x16 frames
    after = _videos(12, lambda i: 100 + i, size=16)
    png = iio.imread(write_before_after(tmp_path / "ba.png", before, after, per, prompts))
    grid = before_after_grid(before, after, per, prompts=3, seeds=4)
    strip = png.shape[1] - grid.shape[1]
    assert strip > 0 and np.array_equal(png[:, strip:], grid)      # the videos, pixel for pixel
    ink = (png[:, :strip] < 128).any(axis=(1, 2))                   # rows of the strip with dark text
    row, gap = 16 * 8, 2 * 8                                        # H·scale, gap·scale (grid_image)
    bands = [ink[r * (row + gap):r * (row + gap) + row] for r in range(6)]
    assert all(b.any() for b in bands)                              # every picture row has its label
    in_gaps = [ink[r * (row + gap) + row:(r + 1) * (row + gap)] for r in range(5)]
    assert not any(g.any() for g in in_gaps)                        # and no text strays into the gaps
    labels = [png[r * (row + gap):r * (row + gap) + row, :strip] for r in range(6)]
    assert np.array_equal(labels[1], labels[3]) and np.array_equal(labels[3], labels[5])  # "after" ×3
    assert not np.array_equal(labels[0], labels[2])                 # each "before" names its prompt
    assert not np.array_equal(labels[0], labels[1])
    # without prompts (a caller that has none): "before" / "after" only, the same on every prompt's rows
    bare = iio.imread(write_before_after(tmp_path / "bare.png", before, after, per))
    strip = bare.shape[1] - grid.shape[1]
    rows_ = [bare[r * (row + gap):r * (row + gap) + row, :strip] for r in range(6)]
    assert np.array_equal(rows_[0], rows_[2]) and not np.array_equal(rows_[0], rows_[1])
    assert (rows_[0] < 128).any()


def test_labels_of_tiny_videos_stay_inside_their_rows(tmp_path):
    import imageio.v3 as iio

    from cluster.evaluation.before_after import write_before_after

    before, after = _videos(8, lambda i: i), _videos(8, lambda i: 100 + i)   # 3x3 frames: 24-pixel rows
    png = iio.imread(write_before_after(tmp_path / "ba.png", before, after, 4, ["a red square moving left"] * 2))
    strip = png.shape[1] - before_after_grid(before, after, 4).shape[1]
    ink = (png[:, :strip] < 128).any(axis=(1, 2))
    row, gap = 3 * 8, 2 * 8
    assert all(ink[r * (row + gap):r * (row + gap) + row].any() for r in range(4))
    assert not any(ink[r * (row + gap) + row:(r + 1) * (row + gap)].any() for r in range(3))

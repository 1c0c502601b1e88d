"""The before/after PNG: rows alternate the base's and the trained policy's videos of the same pairs;
a video's frames stand apart; in the toy world the square's path is drawn after its frames."""

import numpy as np
import pytest

from cluster.evaluation.before_after import FRAME_GAP, FRAME_GREY, GAP, SCALE, before_after_grid


def _videos(n: int, value_of, size: int = 3) -> np.ndarray:
    v = np.zeros((n, 2, size, size, 3), np.uint8)  # [N, F, H, W, 3]
    for i in range(n):
        v[i] = value_of(i)
    return v


S, G, FG = SCALE, GAP * SCALE, FRAME_GAP     # screen pixels: per video pixel, between cells, between frames


def _cell(grid, row: int, video: int, frame: int, shape, trails: bool = False) -> np.ndarray:
    """The screen pixels of one frame, found from the layout alone: rows of H·S pixels and videos
    of F frames (plus the path cell with trails), G apart; frames FG apart."""
    f, h, w = shape[1:4]
    cells = f + int(trails)
    video_w = cells * w * S + (cells - 1) * FG
    y, x = row * (h * S + G), video * (video_w + G) + frame * (w * S + FG)
    return grid[y:y + h * S, x:x + w * S]


def test_rows_alternate_before_and_after_on_the_same_pairs():
    per = 5                                      # seeds per prompt; 3 prompts → 15 pairs
    before = _videos(15, lambda i: i)            # each video a flat colour = its pair index …
    before[:, 1] += 50                           # … and its second frame 50 brighter (frame order shows)
    after = _videos(15, lambda i: 100 + i)
    grid = before_after_grid(before, after, per, prompts=2, seeds=3)
    # independent reference: which pair each picture row shows, by hand
    rows = [(before, [0, 1, 2]), (after, [0, 1, 2]), (before, [5, 6, 7]), (after, [5, 6, 7])]
    for r, (videos, pairs) in enumerate(rows):
        for j, pair in enumerate(pairs):
            for f in range(2):
                want = videos[pair, f].repeat(S, axis=0).repeat(S, axis=1)
                assert np.array_equal(_cell(grid, r, j, f, before.shape), want), (r, j, f)
    assert grid.shape == (4 * 3 * S + 3 * G, 3 * (2 * 3 * S + FG) + 2 * G, 3)


def test_frames_stand_apart_and_videos_further():
    before, after = _videos(4, lambda i: 200), _videos(4, lambda i: 200)   # bright frames: gaps show as grey
    grid = before_after_grid(before, after, 4, prompts=1, seeds=2)
    h, w = 3 * S, 3 * S
    band = grid[:h]                                                      # the first picture row
    frame_gap = band[:, w:w + FG]                                        # between frame 0 and frame 1
    assert frame_gap.shape[1] == FG and (frame_gap == FRAME_GREY).all()
    video_gap = band[:, 2 * w + FG:2 * w + FG + G]                      # between video 0 and video 1
    assert (video_gap == 128).all() and FRAME_GREY != 128
    assert (grid[h:h + G] == 128).all()                                  # between the before and after rows


def test_the_toy_squares_path_is_drawn_after_its_frames():
    from common import toyworld as tw
    from common.toyscore import centroids, foreground

    prompts = ["a red square moving right", "a blue square moving up"]
    videos = np.stack([tw.render(p) for p in prompts])                  # [2, 6, 16, 16, 3]: ground-truth motion
    empty = np.zeros_like(videos)                                       # no square: nothing to draw
    grid = before_after_grid(np.concatenate([videos, videos]), np.concatenate([empty, empty]), 2,
                             prompts=2, seeds=2, trails=True)
    f = videos.shape[1]
    for j, frames in enumerate(videos):
        cell = _cell(grid, 0, j, f, videos.shape, trails=True)          # the cell after the last frame
        white = cell.min(axis=-1) > 100                                 # the path's grey-to-white ink
        c, _ = centroids(foreground(frames))                            # (y, x) per frame, video pixels
        ys, xs = np.nonzero(white)
        assert white.sum() > 20, "the path is drawn"
        start, end = c[0] * S, c[-1] * S                                # screen pixels
        assert np.hypot(ys - start[0], xs - start[1]).min() < 3        # it begins at frame 0's centroid
        assert np.hypot(ys - end[0], xs - end[1]).min() < 3            # and ends at the last frame's
        spread_y, spread_x = np.ptp(ys), np.ptp(xs)
        if "right" in prompts[j]:
            assert spread_x > 3 * spread_y and xs.mean() > start[1]    # along the motion, not across
        else:
            assert spread_y > 3 * spread_x and ys.mean() < start[0]
        assert np.array_equal(_cell(grid, 0, j, 0, videos.shape, trails=True),
                              frames[0].repeat(S, axis=0).repeat(S, axis=1))   # the frames themselves unchanged
    for j in range(2):                                                  # the empty videos' cells: no path
        assert not (_cell(grid, 1, j, f, videos.shape, trails=True).min(axis=-1) > 100).any()


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

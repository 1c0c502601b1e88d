"""Frame sampling, resizing and the Qwen-VL patchify, against transformers and hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from reward_worker import vision as V


def test_sample_indices_hand_computed():
    # The Qwen-VL video recipe VideoAlign was trained with: clamp, round to even, cap at F.
    # 6 frames at 16 fps is 0.375 s: 0.75 frames at 2 fps → the minimum of 4, evenly spread.
    assert V.sample_indices(6, 16.0, 2.0).tolist() == [0, 2, 3, 5]
    # 81 frames at 16 fps: 10.125 → 10 frames (even), linspace(0, 80, 10) rounded.
    assert V.sample_indices(81, 16.0, 2.0).tolist() == [0, 9, 18, 27, 36, 44, 53, 62, 71, 80]
    # 30 frames at 10 fps, 2 fps → 6 (already even).
    assert len(V.sample_indices(30, 10.0, 2.0)) == 6
    # 5 s at 1 fps asks for an odd 5 frames: the count is rounded to an even number.
    assert len(V.sample_indices(80, 16.0, 1.0)) % 2 == 0
    # The cap: 1000 s at 16 fps would be 2000 frames at 2 fps.
    assert len(V.sample_indices(16_000, 16.0, 2.0)) == 768


def test_sample_indices_never_repeat_frames_and_reject_bad_input():
    # A 3-frame video: the upper bound is its own length floored to even, so 2 frames, not 4.
    assert V.sample_indices(3, 16.0).tolist() == [0, 2]
    assert V.sample_indices(2, 16.0).tolist() == [0, 1]
    with pytest.raises(ValueError, match="too short"):
        V.sample_indices(1, 16.0)
    with pytest.raises(ValueError, match="at least one frame"):
        V.sample_indices(0, 16.0)
    with pytest.raises(ValueError, match="positive"):
        V.sample_indices(10, 0.0)


def test_stride_indices_one_frame_per_half_second():
    # 53 frames at 16 fps (TAGRPO's videos): t = 0, 0.5, …, 3.0 s → frames 0, 8, …, 48.
    assert V.stride_indices(53, 16.0, 2.0).tolist() == list(range(0, 49, 8))
    # 24 fps → every 12th frame; a non-integer step takes the frame at or before each time.
    assert V.stride_indices(25, 24.0, 2.0).tolist() == [0, 12, 24]
    assert V.stride_indices(10, 5.0, 2.0).tolist() == [0, 2, 5, 7]
    assert V.stride_indices(1, 16.0).tolist() == [0]


def test_frame_patches_keep_aspect_and_match_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    frames = torch.randint(0, 256, (2, 56, 112, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    patches, grids = V.frame_patches(frames, V.QWEN2_VL, 8 * 28 * 28, 8 * 28 * 28)
    ref = Qwen2VLImageProcessorPil(do_resize=False)(images=[f.numpy() for f in frames], return_tensors="pt")
    assert grids.tolist() == ref["image_grid_thw"].tolist() == [[1, 4, 8]] * 2   # 56×112 kept, 2:1
    torch.testing.assert_close(patches, ref["pixel_values"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("hw", [(480, 832), (16, 16), (720, 1280), (1080, 1920), (100, 3000), (29, 57)])
def test_smart_resize_matches_transformers(hw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    for lo, hi in [(128 * 28 * 28, 200_704), (56 * 56, 28 * 28 * 1280)]:
        assert V.smart_resize(*hw, 28, lo, hi) == reference(*hw, 28, lo, hi)
    h, w = V.smart_resize(*hw, 28, 128 * 28 * 28, 200_704)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 200_704


def test_resize_shapes_range_and_identity():
    x = torch.randint(0, 256, (3, 20, 24, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    y = V.resize(x, 56, 84)
    assert y.shape == (3, 3, 56, 84) and y.dtype == torch.uint8
    assert torch.equal(V.resize(x, 20, 24), x.permute(0, 3, 1, 2))
    flat = torch.full((1, 20, 24, 3), 77, dtype=torch.uint8)
    assert torch.equal(V.resize(flat, 56, 28), torch.full((1, 3, 56, 28), 77, dtype=torch.uint8))


def test_patchify_hand_computed_order():
    # patch 1, temporal 2, merge 2: frame t at (y, x) holds t·8 + y·4 + x.
    spec = V.PatchSpec(patch_size=1, temporal_patch_size=2, merge_size=2, mean=(0,) * 3, std=(1,) * 3)
    frames = torch.arange(16, dtype=torch.float32).view(2, 1, 2, 4)
    patches, grid = V.patchify(frames, spec)
    assert grid.tolist() == [1, 2, 4]
    # Merge windows row-major, positions inside a window row-major; each patch = (frame 0, frame 1).
    assert patches.tolist() == [[0, 8], [1, 9], [4, 12], [5, 13], [2, 10], [3, 11], [6, 14], [7, 15]]


def test_patchify_odd_frame_count_repeats_last_frame():
    spec = V.PatchSpec(patch_size=1, temporal_patch_size=2, merge_size=1, mean=(0,) * 3, std=(1,) * 3)
    frames = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1)
    patches, grid = V.patchify(frames, spec)
    assert grid.tolist() == [2, 1, 1] and patches.tolist() == [[0, 1], [2, 2]]
    with pytest.raises(ValueError, match="multiple of 28"):
        V.patchify(torch.zeros(2, 3, 30, 28), V.QWEN2_VL)


def test_image_patches_match_transformers_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    img = torch.randint(0, 256, (56, 84, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ref = Qwen2VLImageProcessorPil(do_resize=False)(images=[img.numpy()], return_tensors="pt")
    mine, grid = V.image_patches(img, V.QWEN2_VL, 56, 84)
    assert grid.tolist() == ref["image_grid_thw"][0].tolist() == [1, 4, 6]
    torch.testing.assert_close(mine, ref["pixel_values"], atol=1e-6, rtol=0)


def test_video_patches_grid_and_token_count():
    video = torch.randint(0, 256, (6, 20, 24, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    patches, grid, idx = V.video_patches(video, V.QWEN2_VL, video_fps=16.0)
    h, w = V.smart_resize(20, 24, 28, 128 * 28 * 28, 200_704)
    assert idx.tolist() == [0, 2, 3, 5]
    assert grid.tolist() == [2, h // 14, w // 14]
    assert patches.shape == (2 * (h // 14) * (w // 14), 3 * 2 * 14 * 14)
    assert V.QWEN2_VL.tokens(grid) == 2 * (h // 28) * (w // 28)
    # Qwen3-VL: 16-pixel patches, [-1, 1] normalisation.
    p3, g3, _ = V.video_patches(video, V.QWEN3_VL, 16.0, min_pixels=32 * 32, max_pixels=64 * 64)
    assert g3.tolist() == [2, 2, 2] and p3.shape == (8, 3 * 2 * 16 * 16)
    assert p3.min() >= -1.0 and p3.max() <= 1.0

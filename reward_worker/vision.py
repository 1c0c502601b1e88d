"""Video → Qwen-VL vision input, without torchvision.

Three steps, as the Qwen-VL reward models were fed in training:
1. sample frames at a target rate (2 fps): the Qwen-VL video recipe (an even count, at least
   4, at most 768, never more than the video has), or a plain stride for per-frame scorers;
2. resize each frame to a multiple of the patch factor within a pixel budget (bicubic,
   antialiased, rounded back to uint8 as torchvision does on uint8 tensors);
3. rescale, normalise and cut into flattened patches in the order the vision tower reads
   them (temporal patch, then 2×2 merge windows), with the (t, h, w) patch grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PatchSpec:
    """How a Qwen-VL vision tower cuts pixels into tokens."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD

    @property
    def factor(self) -> int:
        """Frame sides are multiples of this (one merged token covers factor × factor pixels)."""
        return self.patch_size * self.merge_size

    def tokens(self, grid_thw: Tensor) -> int:
        """Language-model tokens one visual input takes: t·h·w / merge²."""
        return int(grid_thw.prod()) // self.merge_size**2


QWEN2_VL = PatchSpec()
QWEN3_VL = PatchSpec(patch_size=16, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


def sample_indices(num_frames: int, video_fps: float, fps: float = 2.0, min_frames: int = 4,
                   max_frames: int = 768, frame_factor: int = 2) -> Tensor:
    """Frame indices for sampling at `fps` a video of `num_frames` frames recorded at `video_fps`,
    by the Qwen-VL video recipe VideoAlign was trained with.

    The count num_frames / video_fps · fps is clamped to [min_frames, max_frames] (the upper
    bound never above the video's own length), then rounded to a multiple of `frame_factor`
    and capped at the frame count; the indices are evenly spaced and rounded. [N] int64
    """
    if num_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    if video_fps <= 0 or fps <= 0:
        raise ValueError(f"video_fps and fps must be positive, got {video_fps} and {fps}")
    lo = math.ceil(min_frames / frame_factor) * frame_factor
    hi = math.floor(min(max_frames, num_frames) / frame_factor) * frame_factor
    n = min(max(num_frames / video_fps * fps, lo), hi)
    n = min(round(n / frame_factor) * frame_factor, num_frames)
    if n < frame_factor:
        raise ValueError(f"a video of {num_frames} frame(s) is too short to sample; the scorer "
                         f"needs at least {frame_factor}")
    return torch.linspace(0, num_frames - 1, n).round().long()


def stride_indices(num_frames: int, video_fps: float, fps: float = 2.0) -> Tensor:
    """The frames at times 0, 1/fps, 2/fps, … s (nearest earlier frame): a plain `fps` sampling
    for scorers that rate frames one by one. [N] int64"""
    if num_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    if video_fps <= 0 or fps <= 0:
        raise ValueError(f"video_fps and fps must be positive, got {video_fps} and {fps}")
    step = video_fps / fps                                                   # frames per sample
    n = math.floor((num_frames - 1) / step + 1e-9) + 1
    return (torch.arange(n, dtype=torch.float64) * step + 1e-9).floor().long()


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """The (h, w) nearest to the input with both sides multiples of `factor` and h·w within
    [min_pixels, max_pixels], keeping the aspect ratio as well as the rounding allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {height}x{width} is over 200; the vision tower cannot take it")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def resize(frames: Tensor, height: int, width: int) -> Tensor:
    """uint8 [F, H, W, 3] → uint8 [F, 3, height, width], bicubic with antialiasing."""
    x = frames.permute(0, 3, 1, 2).float()                                    # [F, 3, H, W]
    if (x.shape[-2], x.shape[-1]) == (height, width):
        return x.to(torch.uint8)
    x = F.interpolate(x, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return x.round().clamp(0, 255).to(torch.uint8)


def normalize(frames: Tensor, spec: PatchSpec) -> Tensor:
    """uint8 [F, 3, H, W] → fp32 (x/255 - mean) / std."""
    mean = torch.tensor(spec.mean, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, dtype=torch.float32).view(1, 3, 1, 1)
    return (frames.float() / 255.0 - mean) / std


def patchify(frames: Tensor, spec: PatchSpec) -> tuple[Tensor, Tensor]:
    """fp32 [T, C, H, W] (H, W multiples of spec.factor) → (patches [t·h·w, C·tp·p·p], grid [3]).

    An odd T repeats its last frame to fill the last temporal patch. Patches are ordered
    by temporal patch, then merge window (row-major), then position inside the window.
    """
    T, C, H, W = frames.shape
    p, tp, m = spec.patch_size, spec.temporal_patch_size, spec.merge_size
    if H % spec.factor or W % spec.factor:
        raise ValueError(f"frame size {H}x{W} is not a multiple of {spec.factor}; resize first")
    if T % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - T % tp, -1, -1, -1)])
    gt, gh, gw = frames.shape[0] // tp, H // p, W // p
    x = frames.reshape(gt, tp, C, gh // m, m, p, gw // m, m, p)
    # → [gt, gh/m, gw/m, m, m, C, tp, p, p]: each token's merge window is contiguous
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    patches = x.reshape(gt * gh * gw, C * tp * p * p)
    return patches, torch.tensor([gt, gh, gw])


def video_patches(frames: Tensor, spec: PatchSpec, video_fps: float, fps: float = 2.0,
                  min_pixels: int = 128 * 28 * 28, max_pixels: int = 200_704) -> tuple[Tensor, Tensor, Tensor]:
    """One video uint8 [F, H, W, 3] → (patches [N, D], grid [3], sampled frame indices [n])."""
    idx = sample_indices(frames.shape[0], video_fps, fps)
    h, w = smart_resize(frames.shape[1], frames.shape[2], spec.factor, min_pixels, max_pixels)
    x = normalize(resize(frames[idx], h, w), spec)                           # [n, 3, h, w]
    patches, grid = patchify(x, spec)
    return patches, grid, idx


def image_patches(image: Tensor, spec: PatchSpec, height: int, width: int) -> tuple[Tensor, Tensor]:
    """One image uint8 [H, W, 3] resized to exactly (height, width) → (patches [N, D], grid [3])."""
    if height % spec.factor or width % spec.factor:
        raise ValueError(f"image size {height}x{width} is not a multiple of {spec.factor}")
    x = normalize(resize(image[None], height, width), spec)                  # [1, 3, h, w]
    return patchify(x, spec)


def frame_patches(frames: Tensor, spec: PatchSpec, min_pixels: int, max_pixels: int) -> tuple[Tensor, Tensor]:
    """Frames rated one by one as images: uint8 [n, H, W, 3] → (patches [n·N, D], grids [n, 3]).

    Each frame keeps its aspect ratio within [min_pixels, max_pixels] (smart_resize)."""
    h, w = smart_resize(frames.shape[1], frames.shape[2], spec.factor, min_pixels, max_pixels)
    x = normalize(resize(frames, h, w), spec)                                # [n, 3, h, w]
    out = [patchify(x[i:i + 1], spec) for i in range(x.shape[0])]
    return torch.cat([p for p, _ in out]), torch.stack([g for _, g in out])

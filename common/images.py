"""Condition images (I2V first frames): decode, check, and fit to the model's resolution.

A condition's image travels by reference: `Condition.image_path` names a file the rollout and
reward roles can read (shared storage, like model.path). Each decodes it when it needs it — the
rollout actor once per group (and encodes it: the learner trains on that encoding and never
opens the file), the reward actor once per scored group — through `condition_image`, cached per
process, so the pixels never pass through the driver.

Fitting follows HunyuanVideo 1.5's I2V pipeline (VaeImageProcessor.resize, resize_mode
"crop"): scale the image, keeping its aspect ratio, until it covers the target, resample
with Lanczos, then crop the centre. An image already at the target size is left untouched.
"""

from __future__ import annotations

import functools
import io
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

ACCEPTED_MODES = ("RGB", "L", "P")
"""Modes decoded as RGB. Alpha (RGBA, LA, P with transparency), CMYK and high-bit-depth
modes are refused: their conversion to the RGB a video model sees is a choice for the user."""


class ImageError(ValueError):
    """An image that cannot be a first frame; the message names the file and the fix."""


def decode(data: bytes, where: str):
    """Bytes of an image file → an RGB PIL image; ImageError names `where` and the fix."""
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{where}: not a decodable image ({type(e).__name__}: {e}); "
                         "save it as PNG or JPEG") from None
    if img.mode not in ACCEPTED_MODES or (img.mode == "P" and "transparency" in img.info):
        raise ImageError(f"{where}: image mode {img.mode!r}"
                         f"{' with transparency' if img.mode == 'P' else ''} is not RGB; convert it "
                         "(e.g. PIL: Image.open(p).convert('RGB').save(p))")
    return img.convert("RGB")


def fit(img, height: int, width: int) -> np.ndarray:
    """Resize (aspect kept, covering the target, Lanczos) and centre-crop → uint8 [H, W, 3]."""
    w, h = img.size
    if (w, h) != (width, height):
        scale = max(width / w, height / h)
        nw, nh = max(width, round(w * scale)), max(height, round(h * scale))
        img = img.resize((nw, nh), resample=Image.LANCZOS)
        left, top = (nw - width) // 2, (nh - height) // 2
        img = img.crop((left, top, left + width, top + height))
    return np.asarray(img, dtype=np.uint8).copy()


def load_image(path: str | Path, height: int, width: int) -> Tensor:
    """The first frame at `path`, fitted to height × width: uint8 [H, W, 3] (cached per process)."""
    p = str(Path(path).expanduser())
    try:
        mtime = os.stat(p).st_mtime_ns
    except OSError as e:
        raise ImageError(f"{p}: condition image not readable ({e.strerror}); every role must see the "
                         "dataset's folder (shared storage)") from None
    return _load(p, int(height), int(width), mtime).clone()  # the cached copy stays untouched


@functools.lru_cache(maxsize=512)
def _load(path: str, height: int, width: int, mtime_ns: int) -> Tensor:
    return torch.from_numpy(fit(decode(Path(path).read_bytes(), path), height, width))


def condition_image(condition, height: int, width: int) -> Tensor | None:
    """A Condition's first frame at the model's resolution: its in-memory `image`, else the file
    at `image_path`, else None (text-to-video). uint8 [H, W, 3]"""
    if getattr(condition, "image", None) is not None:
        return condition.image
    path = getattr(condition, "image_path", None)
    return None if path is None else load_image(path, height, width)


def condition_images(conditions, height: int, width: int) -> Tensor | None:
    """Every condition's first frame stacked (uint8 [B, H, W, 3]), or None when none has one."""
    imgs = [condition_image(c, height, width) for c in conditions]
    if all(i is None for i in imgs):
        return None
    if any(i is None for i in imgs):
        raise ValueError("a batch mixes conditions with and without a first frame")
    return torch.stack(imgs)


def resolve_images(images, batch: int, height: int, width: int) -> Tensor | None:
    """What a reward call receives for its condition images — None, a tensor uint8 [B, H, W, 3],
    one path (the group's condition) or one path per video — as uint8 [B, H, W, 3] or None."""
    if images is None or isinstance(images, Tensor):
        return images
    if isinstance(images, (str, Path)):
        return load_image(images, height, width).unsqueeze(0).expand(batch, -1, -1, -1)
    paths = list(images)
    if len(paths) != batch:
        raise ValueError(f"got {len(paths)} condition images for {batch} videos")
    return torch.stack([load_image(p, height, width) for p in paths])


def reward_images(condition, size: int) -> Tensor | str | None:
    """What the reward role gets for a group's first frames: the path (read there), the
    in-memory image expanded to the group, or None for text-to-video."""
    if condition.image is not None:
        return condition.image.unsqueeze(0).expand(size, -1, -1, -1)
    return condition.image_path

"""Verifiable measurements of a toy-world video (pure numpy), behind the toy reward heads.

Each head lies in [0, 1]; 1 is a perfect rendering of the prompt.
- VQ (visual quality): per frame, the geometric mean of
  `clean` (share of foreground mass inside a box around the centroid: background noise and
  stray blobs lower it), `size` (mass against the square's area, min(m/A, A/m)) and
  `crisp` (1 - mean 4·m·(1-m) over pixels: half-lit pixels everywhere lower it); averaged
  over frames.
- MQ (motion quality): geometric mean of `smooth` (exp(-mean |d_f - d̄| / 0.5 px): jitter of
  the per-frame displacement around its mean), `steady` (exp(-cv/0.2) of the per-frame mass:
  flicker, vanishing) and `speed` (exp(-||d̄| - v*| / v*), v* the world's speed). It does not
  look at the direction; TA does.
- TA (text alignment): mean of `colour` (softmax probability of the prompt's colour against
  the palette, from the mean foreground colour) and `direction` (net displacement projected
  on the prompt's direction, clip(p/travel, 0, 1)·exp(-2·(q/travel)²) with q the sideways
  part).
- With an I2V condition image, MQ's speed and TA's direction use the I2V travel
  (toyworld.I2V_TRAVEL_FRAC).
- IA (image alignment, image-to-video only): geometric mean of `match` (the first frame
  against the condition image: 1 - Σ|f0 - img| / (Σ f0 + Σ img) over RGB, 1 = identical,
  0 = disjoint), `keep_colour` (the colour softmax of the whole video against the image's
  palette colour) and `keep_size` (per frame min(m/m_img, m_img/m), m the foreground mass,
  averaged over frames).
The foreground is the per-pixel max channel / 255 (the background is black).
"""

from __future__ import annotations

import numpy as np

from common import toyworld as tw

HEADS: tuple[str, ...] = ("VQ", "MQ", "TA")
I2V_HEADS: tuple[str, ...] = (*HEADS, "IA")
MIN_MASS = 0.5
"""A frame with less foreground mass than this (pixels) has no object."""
_PALETTE = np.asarray([tw.COLOURS[c] for c in tw.COLOURS], dtype=np.float64) / 255.0   # [K, 3]
_COLOUR_TEMP = 0.05


def foreground(frames: np.ndarray) -> np.ndarray:
    """uint8 [F, H, W, 3] → soft mask [F, H, W] in [0, 1]."""
    return frames.max(axis=-1).astype(np.float64) / 255.0


def centroids(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mask [F, H, W] → (centroid [F, 2] (y, x), mass [F]); NaN centroid where a frame is empty."""
    F, H, W = mask.shape
    mass = mask.sum(axis=(1, 2))                                          # [F]
    yy, xx = np.meshgrid(np.arange(H) + 0.5, np.arange(W) + 0.5, indexing="ij")
    with np.errstate(invalid="ignore", divide="ignore"):
        cy = (mask * yy).sum(axis=(1, 2)) / mass
        cx = (mask * xx).sum(axis=(1, 2)) / mass
    c = np.stack([cy, cx], axis=1)
    c[mass < MIN_MASS] = np.nan
    return c, mass


def visual_parts(frames: np.ndarray) -> dict[str, np.ndarray]:
    """VQ's parts per frame [F]: clean, size, crisp (0 where a frame has no object), and mass/area."""
    mask = foreground(frames)
    F, H, W = mask.shape
    area = tw.side(H) ** 2
    half = tw.side(H) / 2 + 1.0                   # box half-width: the square plus a pixel
    c, mass = centroids(mask)
    yy, xx = np.meshgrid(np.arange(H) + 0.5, np.arange(W) + 0.5, indexing="ij")
    out = {k: np.zeros(F) for k in ("clean", "size", "crisp")}
    for f in range(F):
        if not np.isfinite(c[f]).all():
            continue
        box = (np.abs(yy - c[f, 0]) <= half) & (np.abs(xx - c[f, 1]) <= half)
        out["clean"][f] = mask[f][box].sum() / mass[f]
        out["size"][f] = min(mass[f] / area, area / mass[f])
        out["crisp"][f] = 1.0 - float(np.mean(4.0 * mask[f] * (1.0 - mask[f])))
    out["mass/area"] = mass / area
    return out


def visual_quality(frames: np.ndarray) -> float:
    p = visual_parts(frames)
    # frame by frame as scalars: numpy's vectorised power can round the last bit differently
    return float(np.mean([float((cl * si * cr) ** (1 / 3)) if cl > 0 else 0.0
                          for cl, si, cr in zip(p["clean"].tolist(), p["size"].tolist(), p["crisp"].tolist(), strict=True)]))


def motion_parts(frames: np.ndarray, travel_px: float | None = None) -> dict[str, float] | None:
    """MQ's parts: smooth, steady, speed and |d̄|/v*; None when a frame has no object."""
    mask = foreground(frames)
    F, H, _ = mask.shape
    c, mass = centroids(mask)
    if F < 2 or not np.isfinite(c).all():
        return None
    d = np.diff(c, axis=0)                                                # [F-1, 2]
    d_mean = d.mean(axis=0)
    v_star = (tw.travel(H) if travel_px is None else travel_px) / (F - 1)
    return {"smooth": float(np.exp(-np.linalg.norm(d - d_mean, axis=1).mean() / 0.5)),
            "steady": float(np.exp(-(mass.std() / mass.mean()) / 0.2)),
            "speed": float(np.exp(-abs(np.linalg.norm(d_mean) - v_star) / v_star)),
            "|d|/v*": float(np.linalg.norm(d_mean) / v_star)}


def motion_quality(frames: np.ndarray, travel_px: float | None = None) -> float:
    p = motion_parts(frames, travel_px)
    return 0.0 if p is None else float((p["smooth"] * p["steady"] * p["speed"]) ** (1 / 3))


def colour_score(frames: np.ndarray, colour: str) -> float:
    """Probability of `colour` under a softmax over palette distances of the mean foreground colour."""
    mask = foreground(frames)
    solid = mask > 0.5
    if solid.sum() == 0:
        return 0.0
    rgb = frames[solid].astype(np.float64) / 255.0                        # [N, 3]
    mean = rgb.mean(axis=0)
    logits = -((_PALETTE - mean) ** 2).sum(axis=1) / _COLOUR_TEMP
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return float(p[list(tw.COLOURS).index(colour)])


def displacement(frames: np.ndarray) -> np.ndarray | None:
    """Net centroid motion first → last frame (y, x) in px, or None when a frame is empty."""
    c, _ = centroids(foreground(frames))
    if not np.isfinite(c).all():
        return None
    return c[-1] - c[0]


def direction_score(frames: np.ndarray, direction: str, travel_px: float | None = None) -> float:
    d = displacement(frames)
    if d is None:
        return 0.0
    t = tw.travel(frames.shape[1]) if travel_px is None else travel_px
    u = np.asarray(tw.DIRECTIONS[direction])
    p = float(d @ u)
    q = float(abs(d[0] * u[1] - d[1] * u[0]))
    return float(np.clip(p / t, 0.0, 1.0) * np.exp(-2.0 * (q / t) ** 2))


def predicted_direction(frames: np.ndarray, min_travel: float = 1.0) -> str | None:
    """The direction word whose axis the net motion follows most, or None if it hardly moves."""
    d = displacement(frames)
    if d is None or np.linalg.norm(d) < min_travel:
        return None
    return max(tw.DIRECTIONS, key=lambda k: float(d @ np.asarray(tw.DIRECTIONS[k])))


def nearest_colour(image: np.ndarray) -> str | None:
    """The palette colour closest to the mean solid foreground colour of uint8 [H, W, 3], or None if empty."""
    solid = foreground(image[None])[0] > 0.5
    if solid.sum() == 0:
        return None
    mean = image[solid].astype(np.float64).mean(axis=0) / 255.0
    return list(tw.COLOURS)[int(((_PALETTE - mean) ** 2).sum(axis=1).argmin())]


def image_alignment(frames: np.ndarray, image: np.ndarray) -> dict[str, float]:
    """IA and its parts: does the video start at the image, and keep its square's colour and size?"""
    if image.shape != frames.shape[1:] or image.dtype != np.uint8:
        raise ValueError(f"image must be uint8 {tuple(frames.shape[1:])}, got {image.dtype} {tuple(image.shape)}")
    f0, img = frames[0].astype(np.float64), image.astype(np.float64)
    total = f0.sum() + img.sum()
    match = 1.0 - float(np.abs(f0 - img).sum() / total) if total > 0 else 1.0
    colour = nearest_colour(image)
    keep_colour = colour_score(frames, colour) if colour is not None else 0.0
    m_img = foreground(image[None])[0].sum()
    mass = foreground(frames).sum(axis=(1, 2))                           # [F]
    keep_size = float(np.mean([min(m / m_img, m_img / m) if m > 0 and m_img > 0 else 0.0 for m in mass]))
    ia = float((max(match, 0.0) * keep_colour * keep_size) ** (1 / 3))
    return {"IA": ia, "match": match, "keep_colour": keep_colour, "keep_size": keep_size}


def score_video(frames: np.ndarray, prompt: str, image: np.ndarray | None = None) -> dict[str, float]:
    """All heads and their parts for one video uint8 [F, H, W, 3] (with IA when the I2V
    condition image uint8 [H, W, 3] is given); ValueError on a bad prompt or image."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    spec = tw.parse_prompt(prompt)
    # an I2V square travels the shorter I2V distance (toyworld.I2V_TRAVEL_FRAC)
    t = None if image is None else tw.travel(frames.shape[1], tw.I2V_TRAVEL_FRAC)
    colour = colour_score(frames, spec.colour)
    direction = direction_score(frames, spec.direction, t)
    out = {
        "VQ": visual_quality(frames),
        "MQ": motion_quality(frames, t),
        "TA": 0.5 * (colour + direction),
        "colour": colour,
        "direction": direction,
        "direction_correct": float(predicted_direction(frames) == spec.direction),
    }
    if image is not None:
        out.update(image_alignment(frames, image))
    return out

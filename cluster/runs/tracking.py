"""Experiment trackers: every metrics.jsonl row, the sample videos and the reward curve, sent to
TensorBoard, Weights & Biases and MLflow (`log.backends`).

Only the driver process opens a tracker (`vgrpo train` attaches it to the RunDir); actors report
their figures through the step record and never import this module. metrics.jsonl stays the
record of the run: a tracker that fails is switched off with one warning and the run goes on.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from cluster.runs import trackers
from common.config import ConfigError, RunConfig

log = logging.getLogger("vgrpo.tracking")

# backend -> the module it imports (its extra in pyproject.toml has the backend's name)
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
STATE_FILE = "trackers.json"  # tracker run ids, so a resumed run continues the same tracker runs


def check_installed(cfg: RunConfig) -> None:
    """Fail before anything starts when a requested backend's package is missing."""
    for name in cfg.log.trackers:
        if importlib.util.find_spec(MODULES[name]) is None:
            raise ConfigError(f"log.backends lists {name!r} but the {MODULES[name]} package is not "
                              f"installed; run: pip install 'vgrpo[{name}]'")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite values of a metrics row (the step is the x axis, not a metric)."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


def video_grid(frames: np.ndarray, per_row: int, cell: int = 64, gap: int = 2) -> np.ndarray:
    """uint8 [N, F, H, W, 3] → one video uint8 [F, H', W', 3]: the N videos tiled per_row wide,
    each scaled by an integer factor towards `cell` pixels (16×16 toy videos become visible,
    720p videos do not make a grid of gigabytes)."""
    n, f, h, w, c = frames.shape
    side = max(h, w)
    if side < cell:
        k = cell // side
        frames = frames.repeat(k, axis=2).repeat(k, axis=3)
    elif side > 4 * cell:
        k = side // (4 * cell)
        frames = frames[:, :, ::k, ::k]
    n, f, h, w, c = frames.shape
    per_row = max(1, min(per_row, n))
    rows = math.ceil(n / per_row)
    out = np.full((f, rows * (h + gap) - gap, per_row * (w + gap) - gap, c), 128, np.uint8)
    for i in range(n):
        r, col = divmod(i, per_row)
        out[:, r * (h + gap): r * (h + gap) + h, col * (w + gap): col * (w + gap) + w] = frames[i]
    return out


def tiled(frames: np.ndarray) -> np.ndarray:
    """Videos [N, F, H, W, 3] in the given order as one tiled video, at most 4 per row."""
    return video_grid(frames, per_row=min(len(frames), 4))


def encode_gif(frames: np.ndarray, fps: float) -> bytes:
    """uint8 [F, H, W, 3] → GIF bytes."""
    import imageio.v3 as iio  # lazy: imageio (kept out of vgrpo --help)

    return iio.imwrite("<bytes>", frames, extension=".gif", duration=1000 / fps, loop=0)


class Tracker:
    """Fans each call out to the open backends (cluster/runs/trackers.py); a backend that raises is
    dropped, and closed when it still can be."""

    def __init__(self, backends: list[Any]):
        self.backends = backends

    @classmethod
    def open(cls, cfg: RunConfig, run_path: Path, resume_step: int | None = None) -> Tracker:
        check_installed(cfg)
        state_file = Path(run_path) / STATE_FILE
        state = json.loads(state_file.read_text()) if state_file.is_file() else {}
        backends = []
        for name in cfg.log.trackers:
            try:
                backends.append(trackers.BACKENDS[name](cfg, Path(run_path), state, resume_step))
            except Exception as e:  # not logged in, server unreachable, …: say so in one line
                for b in backends:
                    b.close("failed")
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise ConfigError(f"log.backends: {name} could not start ({type(e).__name__}: {first}); "
                                  f"fix that or drop {name!r} from log.backends") from None
        state_file.write_text(json.dumps(state, indent=2))
        return cls(backends)

    def _each(self, method: str, *args) -> None:
        for b in list(self.backends):
            try:
                getattr(b, method)(*args)
            except Exception as e:  # metrics.jsonl has it all; the run goes on without this tracker
                log.warning("%s: %s failed (%s: %s); no more logging to %s", b.name, method,
                            type(e).__name__, e, b.name)
                self.backends.remove(b)
                if method != "close":
                    try:
                        b.close("failed")
                    except Exception as close_error:  # it is gone either way
                        log.debug("%s: close after failure: %s", b.name, close_error)

    def metrics(self, record: dict[str, Any]) -> None:
        self._each("metrics", scalars(record), int(record["step"]))

    def video(self, tag: str, frames: np.ndarray, path: Path, step: int, fps: float) -> None:
        """frames uint8 [F, H, W, 3]; written once as a GIF at `path`, then sent to each backend."""
        gif = encode_gif(frames, fps)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gif)
        from PIL import Image  # lazy: PIL (kept out of vgrpo --help)

        with Image.open(path) as im:
            w, h = im.size
        self._each("video", tag, gif, path, (h, w), step)

    def image(self, tag: str, path: Path, step: int) -> None:
        self._each("image", tag, path, step)

    def summary(self, values: dict[str, float], step: int) -> None:
        self._each("summary", values, step)

    def close(self, state: str = "finished") -> None:
        self._each("close", state)
        self.backends = []

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
import os
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ConfigError, RunConfig, to_dict

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


def eval_grid(frames: np.ndarray, seeds: int, limit: int) -> np.ndarray:
    """The evaluation's videos (prompt-major, `seeds` per prompt) as one tiled video of at most
    `limit` of them: the first seed of every prompt first, so a short grid shows every prompt."""
    n = len(frames)
    order = [p * seeds + s for s in range(seeds) for p in range(n // seeds)][:limit]
    return video_grid(frames[order], per_row=min(len(order), 4))


def encode_gif(frames: np.ndarray, fps: float) -> bytes:
    """uint8 [F, H, W, 3] → GIF bytes."""
    import imageio.v3 as iio

    return iio.imwrite("<bytes>", frames, extension=".gif", duration=1000 / fps, loop=0)


# --- backends: each takes finished values; none of them decides what is logged ----------------


class TensorBoard:
    """Scalars through torch's SummaryWriter; videos as animated-GIF image summaries, the form
    TensorBoard's own add_video writes (done here directly, so moviepy is not needed)."""

    name = "tensorboard"

    def __init__(self, cfg: RunConfig, run_path: Path, state: dict, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # on resume, events past the checkpoint's step are dropped, as metrics.jsonl drops them
        self.writer = SummaryWriter(str(run_path / "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)

    def metrics(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def _image(self, tag: str, data: bytes, shape: tuple[int, int], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        img = Summary.Image(height=shape[0], width=shape[1], colorspace=3, encoded_image_string=data)
        self.writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=img)]), step)

    def video(self, tag: str, gif: bytes, path: Path, shape: tuple[int, int], step: int) -> None:
        self._image(tag, gif, shape, step)

    def image(self, tag: str, path: Path, step: int) -> None:
        from PIL import Image

        with Image.open(path) as im:
            w, h = im.size
        self._image(tag, path.read_bytes(), (h, w), step)

    def summary(self, values: dict[str, float], step: int) -> None:
        self.metrics(values, step)

    def close(self, state: str) -> None:
        self.writer.close()


class Wandb:
    """One W&B run per run directory: its id is kept in trackers.json and reused on resume."""

    name = "wandb"

    def __init__(self, cfg: RunConfig, run_path: Path, state: dict, resume_step: int | None):
        import wandb

        w = cfg.log.wandb
        run_id = state.setdefault("wandb_id", uuid.uuid4().hex[:12])
        self.wandb = wandb
        self.run = wandb.init(project=w.project, entity=w.entity, name=w.name or run_path.name,
                              tags=list(w.tags) or None, mode=w.mode, dir=str(run_path), id=run_id,
                              resume="allow", config=to_dict(cfg),  # secrets masked
                              allow_val_change=True, reinit="create_new")

    def metrics(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def video(self, tag: str, gif: bytes, path: Path, shape: tuple[int, int], step: int) -> None:
        self.run.log({tag: self.wandb.Video(str(path), format="gif")}, step=step)

    def image(self, tag: str, path: Path, step: int) -> None:
        self.run.log({tag: self.wandb.Image(str(path))}, step=step)

    def summary(self, values: dict[str, float], step: int) -> None:
        self.run.summary.update(values)

    def close(self, state: str) -> None:
        self.run.finish(exit_code=0 if state == "finished" else 1)


class Mlflow:
    """One MLflow run per run directory (its id kept in trackers.json); videos go as artifacts."""

    name = "mlflow"

    def __init__(self, cfg: RunConfig, run_path: Path, state: dict, resume_step: int | None):
        from mlflow.tracking import MlflowClient

        m = cfg.log.mlflow
        uri = m.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:  # a file store in the run directory: MLflow 3 asks for an explicit opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_path / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if "mlflow_run_id" in state:
            self.run_id = state["mlflow_run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        exp = self.client.get_experiment_by_name(m.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(m.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_path.name).info.run_id
        state["mlflow_run_id"] = self.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in _flatten(to_dict(cfg)).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i: i + 100])

    def metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i: i + 1000])

    def video(self, tag: str, gif: bytes, path: Path, shape: tuple[int, int], step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=f"videos/{tag}")

    def image(self, tag: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path="images")

    def summary(self, values: dict[str, float], step: int) -> None:
        self.metrics(values, step)

    def close(self, state: str) -> None:
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "interrupted": "KILLED"}.get(state, "FAILED"))


BACKENDS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Tracker:
    """Fans each call out to the open backends; a backend that raises is closed and dropped."""

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
                backends.append(BACKENDS[name](cfg, Path(run_path), state, resume_step))
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

    def metrics(self, record: dict[str, Any]) -> None:
        self._each("metrics", scalars(record), int(record["step"]))

    def video(self, tag: str, frames: np.ndarray, path: Path, step: int, fps: float) -> None:
        """frames uint8 [F, H, W, 3]; written once as a GIF at `path`, then sent to each backend."""
        gif = encode_gif(frames, fps)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gif)
        from PIL import Image

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


def eval_pairs(cfg: RunConfig, n: int | None = None) -> list[tuple[str, int]]:
    """The fixed evaluation pairs, the first seed of every prompt first (so a short list shows
    every prompt)."""
    from cluster.prompts import load_prompts
    from common.toyworld import eval_seeds

    prompts = [c.prompt for c in load_prompts(cfg.train.eval_prompts)]
    pairs = [(p, s) for s in eval_seeds(cfg.train.eval_seeds) for p in prompts]
    return pairs if n is None else pairs[:n]


def step_videos(driver) -> None:
    """Every log.video_every steps: the fixed evaluation pairs sampled with the actors' current
    weights, one tiled video (always written to samples/, and sent to each tracker)."""
    from cluster.evaluate import sample_pairs

    every = driver.cfg.log.video_every
    if not every or driver.step % every:
        return
    pairs = eval_pairs(driver.cfg, driver.cfg.log.video_pairs)
    try:
        frames = sample_pairs(driver.rollouts, pairs).numpy()
    except Exception as e:  # a rollout actor restarting: the video waits for the next turn, the run goes on
        log.warning("step %d: no sample video (%s: %s)", driver.step, type(e).__name__, e)
        return
    driver.run_dir.log_video("videos/train", video_grid(frames, per_row=min(len(pairs), 4)), driver.step)

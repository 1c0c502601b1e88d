"""The experiment-tracker backends behind `log.backends`: TensorBoard, W&B and MLflow.

Each takes finished values from cluster.runs.tracking.Tracker and stores them with its own library;
none decides what is logged. Each imports its library only when opened (they are extras).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from common.config import RunConfig, to_dict


class TensorBoard:
    """Scalars through torch's SummaryWriter; videos as animated-GIF image summaries, the form
    TensorBoard's own add_video writes (done here directly, so moviepy is not needed)."""

    name = "tensorboard"

    def __init__(self, cfg: RunConfig, run_path: Path, state: dict, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard

        # on resume, events past the checkpoint's step are dropped, as metrics.jsonl drops them
        self.writer = SummaryWriter(str(run_path / "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)

    def metrics(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def _image(self, tag: str, data: bytes, shape: tuple[int, int], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # optional: tensorboard

        img = Summary.Image(height=shape[0], width=shape[1], colorspace=3, encoded_image_string=data)
        self.writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=img)]), step)

    def video(self, tag: str, gif: bytes, path: Path, shape: tuple[int, int], step: int) -> None:
        self._image(tag, gif, shape, step)

    def image(self, tag: str, path: Path, step: int) -> None:
        from PIL import Image  # lazy: PIL (kept out of vgrpo --help)

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
        import wandb  # optional: wandb

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
        from mlflow.tracking import MlflowClient  # optional: mlflow

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
        from mlflow.entities import Param  # optional: mlflow

        params = [Param(k, str(v)[:500]) for k, v in _flatten(to_dict(cfg)).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i: i + 100])

    def metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # optional: mlflow

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i: i + 1000])

    def video(self, tag: str, gif: bytes, path: Path, shape: tuple[int, int], step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=tag)

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



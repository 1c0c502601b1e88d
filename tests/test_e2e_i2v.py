"""Image-to-video end to end: a two-row manifest with images through the real rollout, reward and
learner actors (the Driver, as `vgrpo train` runs it), then `vgrpo eval` on the run."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from cluster.driver.driver import Driver
from cluster.runs.run_dir import RunDir
from common import toyworld as tw
from common.config import load_config

STEPS = 2


def _manifest(tmp_path):
    """Two (image, prompt) rows in a new folder: first frames of toy I2V videos, as PNG files."""
    from PIL import Image

    folder = tmp_path / "data"
    folder.mkdir()
    rows = []
    for i, (prompt, seed) in enumerate([("a red square moving right", 0), ("a blue square moving up", 1)]):
        Image.fromarray(tw.i2v_condition(prompt, seed)).save(folder / f"f{i}.png")
        rows.append(json.dumps({"prompt": prompt, "image": f"f{i}.png", "id": f"row{i}"}))
    m = folder / "manifest.jsonl"
    m.write_text("\n".join(rows) + "\n")
    return m


def test_i2v_driver_trains_on_a_manifest(ray_session, tmp_path):
    import ray

    m = _manifest(tmp_path)
    cfg = load_config("configs/toy_i2v.yaml", [
        f"train.prompts={m}", f"train.eval_prompts={m}", "train.mode=sync", f"train.steps={STEPS}",
        "train.groups_per_step=2", "train.eval_seeds=1", "train.checkpoint_every=2", "sampler.group_size=4",
        "schedule.steps=6", "bank.capacity=4", "optim.micro_batch=4", f"run.root={tmp_path}", "run.name=i2v"])
    run_dir = RunDir.create(cfg)
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        # the driver holds paths, never pixels
        assert [c.name for c in driver.conditions] == ["row0", "row1"]
        assert all(c.image is None and c.image_path for c in driver.conditions)
        before = driver.evaluate("before", gifs=2)
        driver.run()
        driver.checkpoint()
        after = driver.evaluate("after", gifs=2)
        rows = [json.loads(line) for line in run_dir.metrics_file.read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert ray.get([a.version.remote() for a in driver.rollouts]) == [STEPS]
        # the reward role scored image alignment from the files
        assert "IA" in before.heads and np.isfinite(after.values).all()
        assert before.column("IA").min() > 0.5             # the base starts its videos at the image
        # bank entries name no file: they carry the condition as the rollout encoded it from the
        # first frame's file (the learner trained on them with no encoder)
        from common.images import condition_image
        from rollout_worker.models.toy import ToyVideoModel

        entries = [e for c in driver.conditions for e in driver.bank.entries(c.id)]
        encoder = ToyVideoModel.from_config(cfg)
        assert entries
        for e in entries:
            t, c = e.trajectory, next(c for c in driver.conditions if c.id == e.trajectory.condition.id)
            assert t.condition.image_path is None and t.condition.image is None
            want = encoder.encode([c.prompt], condition_image(c, cfg.model.height, cfg.model.width)[None])
            assert all(torch.equal(t.cond.tensors[k], want.tensors[k]) for k in want.tensors)
        # the GIFs show the first frame beside the video: [F, H, W + 1 + W, 3]
        gifs = sorted(run_dir.samples.glob("*.gif"))
        assert len(gifs) == 4
        g = iio.imread(gifs[0], index=None)
        assert g.shape[1] * (2 * tw.SIZE + 1) == g.shape[2] * tw.SIZE
    finally:
        driver.teardown()
    # `vgrpo eval` on the run: the same first frames, by path, in this process
    from cluster.cli import main

    out = tmp_path / "ev"
    assert main(["eval", str(run_dir.path), "--seeds", "1", "--out", str(out)]) == 0
    offline = json.loads((out / "eval.json").read_text())
    assert offline["IA_mean"] == pytest.approx(after.to_dict()["IA_mean"], abs=1e-5)
    grid = iio.imread(out / "grid.png")
    assert grid.shape[1] > grid.shape[0]                   # image + frames per row



def test_sample_takes_the_first_frame(tmp_path, capsys):
    """`vgrpo sample base -c configs/toy_i2v.yaml --image PNG`: the GIF shows the image beside the video."""
    from PIL import Image

    from cluster.cli import main

    img = tmp_path / "f.png"
    Image.fromarray(tw.i2v_condition("a red square moving up", 3)).save(img)
    out = tmp_path / "s.gif"
    assert main(["sample", "base", "-c", "configs/toy_i2v.yaml", "--prompt", "a red square moving up",
                 "--image", str(img), "--out", str(out)]) == 0
    assert "IA" in capsys.readouterr().out
    g = iio.imread(out, index=None)
    assert g.shape[1] * (2 * tw.SIZE + 1) == g.shape[2] * tw.SIZE
    # an I2V run without a first frame, or a bad image: one line, exit 2
    assert main(["sample", "base", "-c", "configs/toy_i2v.yaml", "--prompt", "a red square moving up"]) == 2
    (tmp_path / "bad.png").write_bytes(b"nope")
    assert main(["sample", "base", "-c", "configs/toy_i2v.yaml", "--prompt", "a red square moving up",
                 "--image", str(tmp_path / "bad.png")]) == 2
    assert "not a decodable image" in capsys.readouterr().err

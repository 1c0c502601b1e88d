"""Image-to-video datasets: JSONL manifests and caption folders, one line per defect, images by path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from cluster.cli import main
from cluster.data import manifests as datasets
from cluster.data.prompts import load_prompts
from common import toyworld as tw
from common.config import ConfigError
from common.images import condition_image, condition_images, load_image, resolve_images
from common.types import Condition


def _png(path, size=(24, 16), colour=(255, 0, 0), mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour if mode in ("RGB", "RGBA") else 128).save(path)
    return path


def _manifest(tmp_path, rows):
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_manifest_rows_become_conditions_by_path(tmp_path):
    _png(tmp_path / "img" / "a.png", colour=(255, 0, 0))
    _png(tmp_path / "img" / "b.png", colour=(0, 0, 255))
    m = _manifest(tmp_path, [
        {"prompt": "a cat", "image": "img/a.png", "id": "cat-a", "negative_prompt": "blurry"},
        {"prompt": "a cat", "image": "img/b.png"},
        "",                                                     # blank lines are skipped
        {"prompt": "a cat", "image": "img/a.png", "id": "cat-a2", "negative_prompt": "blurry"},  # same row
    ])
    conds = load_prompts(str(m))
    assert len(conds) == 2
    a, b = conds
    assert (a.prompt, a.name, a.negative_prompt, a.image) == ("a cat", "cat-a", "blurry", None)
    assert a.image_path == str((tmp_path / "img" / "a.png").resolve())
    # the same prompt with two images: two conditions (two bank slots); the id covers the image bytes
    assert a.id != b.id and len(a.id) == len(b.id) == 16
    assert a.id == datasets.i2v_condition_id("a cat", (tmp_path / "img" / "a.png").read_bytes(), "blurry")
    # the pixels are read lazily, fitted to the model's resolution
    img = condition_image(a, 16, 16)
    assert img.dtype == torch.uint8 and tuple(img.shape) == (16, 16, 3)
    assert img[..., 0].min() == 255 and img[..., 1:].max() == 0


def test_manifest_defects_one_line_each_and_exit_2(tmp_path, capsys):
    _png(tmp_path / "ok.png")
    _png(tmp_path / "rgba.png", mode="RGBA")
    _png(tmp_path / "cmyk.jpg", mode="CMYK")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    m = _manifest(tmp_path, [
        {"prompt": "fine", "image": "ok.png"},                # line 1: good
        {"prompt": "x", "image": "missing.png"},              # 2: missing image
        {"prompt": "x", "image": "broken.png"},               # 3: undecodable
        {"image": "ok.png"},                                  # 4: missing prompt
        {"prompt": "x", "image": "rgba.png"},                 # 5: wrong mode
        {"prompt": "x", "image": "cmyk.jpg"},                 # 6: wrong mode
        '{"prompt": "x", ',                                   # 7: not JSON
        {"prompt": "x", "image": "ok.png", "colour": "red"},  # 8: unknown field
        {"prompt": 3, "image": "ok.png"},                     # 9: wrong type
        {"prompt": "y", "image": "ok.png", "id": "a"},        # 10
        {"prompt": "z", "image": "ok.png", "id": "a"},        # 11: duplicate id
    ])
    with pytest.raises(ConfigError) as e:
        load_prompts(str(m))
    lines = str(e.value).splitlines()
    assert [int(ln.split(":")[1]) for ln in lines] == [2, 3, 4, 5, 6, 7, 8, 9, 11]
    expect = {2: "not found", 3: "not a decodable image", 4: "missing 'prompt'", 5: "mode 'RGBA'",
              6: "mode 'CMYK'", 7: "not a JSON object", 8: "unknown field", 9: "'prompt' must be a string",
              11: "already used"}
    for ln in lines:
        assert ln.startswith(str(m)) and expect[int(ln.split(":")[1])] in ln, ln
    # the CLI: the same lines, exit 2, no traceback
    assert main(["data", "check", str(m)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == len(lines) and "Traceback" not in err


def test_folder_of_images_with_captions(tmp_path):
    _png(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("a red\nsquare\n")
    _png(tmp_path / "b.jpg", colour=(0, 255, 0))
    (tmp_path / "b.txt").write_text("a green square")
    conds = load_prompts(str(tmp_path))
    assert [(c.name, c.prompt) for c in conds] == [("a", "a red square"), ("b", "a green square")]
    assert all(c.image_path and c.image is None for c in conds)


def test_folder_defects_one_line_each(tmp_path):
    _png(tmp_path / "good.png")
    (tmp_path / "good.txt").write_text("fine")
    _png(tmp_path / "nocap.png")                               # missing prompt
    (tmp_path / "orphan.txt").write_text("no image")          # missing image
    _png(tmp_path / "grey16.png", mode="I;16")                # wrong mode
    (tmp_path / "grey16.txt").write_text("x")
    (tmp_path / "bad.png").write_bytes(b"garbage")            # undecodable
    (tmp_path / "bad.txt").write_text("x")
    _png(tmp_path / "empty.png")
    (tmp_path / "empty.txt").write_text("  \n")                # empty prompt
    with pytest.raises(ConfigError) as e:
        load_prompts(str(tmp_path))
    lines = str(e.value).splitlines()
    assert len(lines) == 5, lines
    text = "\n".join(lines)
    for name, what in [("orphan.txt", "caption without an image"), ("nocap.png", "no caption"),
                       ("grey16.png", "mode 'I;16'"), ("bad.png", "not a decodable image"),
                       ("empty.txt", "prompt is empty")]:
        assert any(name in ln and what in ln for ln in lines), (name, text)


def test_fit_matches_diffusers_crop_resize():
    """Independent reference: diffusers' VaeImageProcessor.resize(resize_mode='crop') (HunyuanVideo 1.5 I2V)."""
    from diffusers.image_processor import VaeImageProcessor

    from common.images import fit

    rng = np.random.default_rng(0)
    proc = VaeImageProcessor()
    for w, h, tw_, th in [(40, 30, 16, 16), (30, 50, 24, 16), (64, 36, 32, 18), (16, 16, 16, 16)]:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        ref = np.asarray(proc.resize(img, th, tw_, resize_mode="crop"))
        assert np.array_equal(fit(img, th, tw_), ref), (w, h, tw_, th)


def test_images_travel_by_path_and_are_read_once(tmp_path):
    p = _png(tmp_path / "a.png", size=(16, 16), colour=(0, 255, 0))
    c = Condition("c", "p", image_path=str(p))
    a, b = load_image(p, 16, 16), load_image(p, 16, 16)
    a[0, 0] = 7                                                # a caller's copy: the cache is untouched
    assert b[0, 0, 1] == 255
    assert tuple(condition_images([c, c], 16, 16).shape) == (2, 16, 16, 3)
    assert tuple(resolve_images(str(p), 3, 16, 16).shape) == (3, 16, 16, 3)
    assert resolve_images(None, 3, 16, 16) is None
    with pytest.raises(ValueError, match="mixes"):
        condition_images([c, Condition("t", "p")], 16, 16)
    with pytest.raises(ValueError, match="not readable"):
        load_image(tmp_path / "gone.png", 16, 16)


def test_task_and_prompt_set_must_agree():
    i2v = load_prompts("toy-i2v-eval")
    datasets.check_task(i2v, "i2v", "toy-i2v-eval")
    with pytest.raises(ConfigError, match="model.task = 't2v'"):
        datasets.check_task(i2v, "t2v", "toy-i2v-eval")
    with pytest.raises(ConfigError, match="needs a first frame per prompt"):
        datasets.check_task(load_prompts("toy-eval"), "i2v", "toy-eval")


def test_committed_toy_i2v_sets_are_what_the_generator_writes(tmp_path):
    from rollout_worker.models.toy_i2v_data import write_sets

    write_sets(tmp_path)
    for split in ("train", "eval"):
        committed = datasets.BUILTIN_MANIFESTS[f"toy-i2v-{split}"]
        assert committed.read_text() == (tmp_path / f"{split}.jsonl").read_text()
        for row in map(json.loads, committed.read_text().splitlines()):
            got = np.asarray(Image.open(committed.parent / row["image"]))
            seed = int(row["image"].rsplit("_", 1)[1].split(".")[0])
            assert np.array_equal(got, tw.i2v_condition(row["prompt"], seed))
    train, ev = load_prompts("toy-i2v-train"), load_prompts("toy-i2v-eval")
    # held out: no eval prompt and no eval image is used in training
    assert not {c.prompt for c in train} & {c.prompt for c in ev}
    assert not {open(c.image_path, "rb").read() for c in train} & {open(c.image_path, "rb").read() for c in ev}
    assert len(train) == 48 and len(ev) == 32


def test_bank_entries_keep_neither_the_image_path_nor_the_pixels():
    """An I2V entry names its encoded condition's record (the first frame's VAE latents, encoded
    once by the rollout), never a file for the learner to open nor the pixels."""
    import dataclasses

    from memory_bank.codec import decode, encode, encode_cond
    from memory_bank.tensorfile import loads
    from tests.bank_helpers import make_group

    g = make_group()
    cond = dataclasses.replace(g.condition, image_path="/data/frames/a.png")
    traj = dataclasses.replace(g.members[0], condition=cond)
    ck, _ = encode_cond(cond.id, g.cond)
    meta, blob = encode("0" * 32, traj, g.scores.heads, g.scores.values[0], float(g.composite[0]), cond_key=ck)
    assert "image_path" not in meta and meta["cond_key"] == ck
    assert "image" not in loads(bytes(blob))
    back = decode(meta, bytes(blob)).trajectory.condition
    assert (back.image_path, back.image) == (None, None)

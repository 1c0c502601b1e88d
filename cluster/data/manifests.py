"""Image-to-video datasets: a JSONL manifest, or a folder of images with a caption beside each.

Manifest (`*.jsonl`), one JSON object per line (blank lines are skipped):
    {"prompt": "a red square moving left", "image": "images/red_0.png",
     "id": "red-0", "negative_prompt": "blurry"}
`prompt` and `image` are required; `image` is relative to the manifest's folder (or absolute);
`id` (unique) names the row's samples; `negative_prompt` is kept on the condition.

Folder: `NAME.png` (or .jpg, .jpeg, .webp, .bmp) with its caption in `NAME.txt` (UTF-8; line
breaks become spaces).

Every image is decoded once here, so a bad row stops the run before any actor starts: every
defect gets one line naming the file (and line) and the fix, all reported together. Rows
carry the image by path (common/images.py); each role decodes and fits it to the model's
resolution itself. A condition's id hashes the prompt, the negative prompt and the image's
bytes: the same prompt with two images is two conditions (two bank slots).
"""

from __future__ import annotations

import hashlib
import json
import sys
import unicodedata
from pathlib import Path

import numpy as np

from cluster.data.text import clean_prompt, iter_lines
from common.config import ConfigError, DataConfig
from common.images import ImageError, condition_image, decode
from common.types import Condition

TOY_I2V_DIR = Path(__file__).resolve().parents[2] / "rollout_worker" / "models" / "assets" / "toy_i2v"
BUILTIN_MANIFESTS = {"toy-i2v-train": TOY_I2V_DIR / "train.jsonl", "toy-i2v-eval": TOY_I2V_DIR / "eval.jsonl"}
"""The toy world's I2V sets, committed (written by `vgrpo toy i2v-data`)."""
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
FIELDS = ("prompt", "image", "id", "negative_prompt")


def i2v_condition_id(prompt: str, image_bytes: bytes, negative_prompt: str | None = None) -> str:
    """A stable id over the text and the image's bytes (16 hex digits, like text-only ids)."""
    h = hashlib.sha1()
    for part in (prompt.encode("utf-8"), (negative_prompt or "").encode("utf-8"),
                 hashlib.sha1(image_bytes).digest()):
        h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest()[:16]


class _Rows:
    """Collects conditions and defects; `done()` raises one ConfigError listing every defect."""

    def __init__(self, source: Path):
        self.source = source
        self.defects: list[str] = []
        self.conditions: dict[str, Condition] = {}
        self.names: dict[str, str] = {}

    def image(self, path: Path, where: str) -> bytes | None:
        if not path.is_file():
            self.defects.append(f"{where}: image {str(path)!r} not found; fix the path "
                                "(relative to the manifest's folder) or add the file")
            return None
        data = path.read_bytes()
        try:
            decode(data, f"{where}: image {str(path)!r}")
        except ImageError as e:
            self.defects.append(str(e))
            return None
        return data

    def add(self, prompt: str, image: Path, data: bytes, where: str, name: str | None = None,
            negative: str | None = None) -> None:
        try:
            prompt = clean_prompt(prompt, where)
            negative = None if negative is None else clean_prompt(negative, where, "negative_prompt")
        except ConfigError as e:
            self.defects.append(str(e))
            return
        if not prompt:
            self.defects.append(f"{where}: the prompt is empty; write the caption")
            return
        if name is not None:
            if name in self.names:
                self.defects.append(f"{where}: id {name!r} is already used by {self.names[name]}; ids must be unique")
                return
            self.names[name] = where
        cid = i2v_condition_id(prompt, data, negative)
        self.conditions.setdefault(cid, Condition(id=cid, prompt=prompt, image_path=str(image.resolve()),
                                                  negative_prompt=negative, name=name))

    def done(self) -> list[Condition]:
        if self.defects:
            raise ConfigError("\n".join(self.defects))
        if not self.conditions:
            raise ConfigError(f"{self.source}: holds no (image, prompt) rows")
        return list(self.conditions.values())


def _parse_row(line: str, where: str) -> tuple[object, str | None]:
    """json.loads of one manifest line, or (None, the defect) for any line it cannot read:
    malformed JSON, nesting deeper than Python recurses, an integer past Python's digit limit."""
    try:
        return json.loads(line), None
    except json.JSONDecodeError as e:
        why = f"{e.msg} at column {e.colno}"
    except RecursionError:
        why = "nested too deeply; a row is one flat object"
    except ValueError as e:  # int("1" * 5000): past sys.get_int_max_str_digits()
        why = (f"a number longer than {sys.get_int_max_str_digits()} digits" if "digits" in str(e)
               else str(e).splitlines()[0][:120])
    return None, f'{where}: not a JSON object ({why}); write {{"prompt": "...", "image": "..."}}'


def read_manifest(path: Path, limits: DataConfig | None = None) -> list[Condition]:
    """A JSONL manifest → one Condition per distinct (prompt, negative prompt, image bytes);
    read one bounded line at a time, at most `limits.max_prompts` rows (data.*; defaults when None)."""
    path, limits = Path(path), limits or DataConfig()
    rows = _Rows(path)
    count = 0
    for i, line in iter_lines(path, "manifest", limits):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        count += 1
        if count > limits.max_prompts:
            raise ConfigError(f"{where}: more than data.max_prompts = {limits.max_prompts:,} rows; "
                              "use fewer or raise data.max_prompts")
        row, defect = _parse_row(line, where)
        if defect is not None:
            rows.defects.append(defect)
            continue
        if not isinstance(row, dict):
            rows.defects.append(f'{where}: not a JSON object; write {{"prompt": "...", "image": "..."}}')
            continue
        unknown = sorted(set(row) - set(FIELDS))
        wrong = [f for f in FIELDS if f in row and not isinstance(row[f], str)]
        missing = [f for f in ("prompt", "image") if not row.get(f) and f not in wrong]
        if unknown or wrong or missing:
            parts = ([f"missing {' and '.join(repr(f) for f in missing)}"] if missing else []) + \
                    ([f"{', '.join(repr(f) for f in wrong)} must be a string"] if wrong else []) + \
                    ([f"unknown field(s) {unknown}; expected {list(FIELDS)}"] if unknown else [])
            rows.defects.append(f"{where}: {'; '.join(parts)}")
            continue
        surrogates = [f for f in FIELDS if f in row and any(unicodedata.category(c) == "Cs" for c in row[f])]
        if surrogates:  # a JSON "\ud800": not text, and no file name or id can hold it
            rows.defects.append(f"{where}: {', '.join(repr(f) for f in surrogates)} holds a lone surrogate "
                                "(a \\ud800-\\udfff escape without its pair), which is not text; write the "
                                "character itself (UTF-8)")
            continue
        image = (path.parent / row["image"]).expanduser()
        data = rows.image(image, where)
        if data is not None:
            rows.add(row["prompt"], image, data, where, row.get("id"), row.get("negative_prompt"))
    return rows.done()


def read_folder(folder: Path, limits: DataConfig | None = None) -> list[Condition]:
    """A folder of NAME.png + NAME.txt pairs → one Condition per pair (sorted by name); at most
    `limits.max_prompts` images (data.*; defaults when None)."""
    folder, limits = Path(folder), limits or DataConfig()
    if not folder.is_dir():
        raise ConfigError(f"{folder}: dataset folder not found")
    rows = _Rows(folder)
    images: dict[str, Path] = {}
    for p in sorted(folder.iterdir()):
        if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file():
            if len(images) == limits.max_prompts:
                raise ConfigError(f"{folder}: more than data.max_prompts = {limits.max_prompts:,} images; "
                                  "use fewer or raise data.max_prompts")
            if p.stem in images:
                rows.defects.append(f"{p}: a second image for {p.stem!r} (also {images[p.stem].name}); keep one")
                continue
            images[p.stem] = p
    captions = {p.stem: p for p in sorted(folder.glob("*.txt")) if p.is_file()}
    for stem in sorted(set(captions) - set(images)):
        rows.defects.append(f"{captions[stem]}: caption without an image; add {stem}.png or remove it")
    for stem, image in images.items():
        where = str(image)
        cap = captions.get(stem)
        if cap is None:
            rows.defects.append(f"{where}: no caption; write the prompt into {stem}.txt beside it")
            continue
        if cap.stat().st_size > limits.max_line_bytes:
            rows.defects.append(f"{cap}: the caption is {cap.stat().st_size:,} bytes, more than "
                                f"data.max_line_bytes = {limits.max_line_bytes:,}")
            continue
        try:
            text = " ".join(cap.read_text(encoding="utf-8").split())
        except UnicodeDecodeError as e:
            rows.defects.append(f"{cap}: not UTF-8 text (byte {e.start})")
            continue
        data = rows.image(image, where)
        if data is not None:
            rows.add(text, image, data, str(cap), stem)
    return rows.done()


def image_paths(spec: str) -> list[str]:
    """The first-frame files a prompt set names, as the conditions carry them (absolute), without
    decoding any: what the cluster preflight looks for on each rollout and reward node. [] for a
    text prompt set; rows the manifest cannot parse are left to `read_manifest`."""
    path = BUILTIN_MANIFESTS.get(spec, Path(spec))
    if path.suffix.lower() == ".jsonl":
        out = []
        for _, line in iter_lines(path, "manifest", DataConfig()):
            try:
                row = json.loads(line) if line.strip() else None
            except (ValueError, RecursionError):  # read_manifest names the line
                continue
            if isinstance(row, dict) and isinstance(row.get("image"), str) and row["image"]:
                out.append(str((path.parent / row["image"]).expanduser().resolve()))
        return out
    if path.is_dir():
        return [str(p.resolve()) for p in sorted(path.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
    return []


# --- a dataset in a run --------------------------------------------------------------------


def check_task(conditions: list[Condition], task: str, spec: str) -> None:
    """model.task and the prompt set agree: i2v needs a first frame on every row, t2v none."""
    with_image = sum(c.is_i2v for c in conditions)
    if task == "i2v" and with_image < len(conditions):
        raise ConfigError(f"{spec}: model.task = 'i2v' needs a first frame per prompt, but "
                          f"{len(conditions) - with_image} of {len(conditions)} rows have none; use a JSONL "
                          "manifest or an image folder (docs/datasets.md)")
    if task == "t2v" and with_image:
        raise ConfigError(f"{spec}: its rows carry first frames, but model.task = 't2v'; set "
                          "model.task: i2v (with an I2V model) or use a text prompt set")


def side_by_side(frames: np.ndarray, condition: Condition, model_cfg, gap: int = 1) -> np.ndarray:
    """A video uint8 [F, H, W, 3] with its condition's first frame to its left in every frame
    (unchanged for text-to-video), so a viewer sees the image beside what came of it."""
    image = condition_image(condition, model_cfg.height, model_cfg.width)
    if image is None:
        return frames
    F, H = frames.shape[:2]
    img = np.broadcast_to(image.numpy()[None], (F, *image.shape))
    sep = np.full((F, H, gap, 3), 128, np.uint8)
    return np.concatenate([img, sep, frames], axis=2)

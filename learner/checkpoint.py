"""Checkpoint directories: written whole into a temp dir, then renamed into place.

Layout: `<root>/step_00000042/{trainer.pt, extra.json}`. `trainer.pt` is the trainer's
state dict (torch.save, read back with weights_only=True); `extra.json` holds what the
driver adds (data cursor, bank watermark) as JSON. Only the newest `keep` survive.

`root` may also be an fsspec URI (s3://, gs://, …): common/storage.py then writes the same
layout object by object, trainer.pt last, and the functions return URIs (str) instead of Paths.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from common import storage

PREFIX = "step_"
STATE_FILE, EXTRA_FILE = "trainer.pt", "extra.json"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def list_checkpoints(root: str | os.PathLike, marker: str = STATE_FILE) -> list[Path]:
    """Complete checkpoints under root (step dirs holding `marker`), oldest first."""
    if storage.is_uri(root):
        return storage.list_steps(root, PREFIX, marker)
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and p.name[len(PREFIX):].isdigit() and (p / marker).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def save(root: str | os.PathLike, step: int, state: dict, extra: dict, keep: int) -> Path:
    """Write step's checkpoint atomically, then drop all but the newest `keep`."""
    try:
        extra_json = json.dumps(extra, sort_keys=True)
    except TypeError as e:
        raise TypeError(f"checkpoint extra must be JSON-serialisable (data cursor, bank watermark): {e}") from None
    if storage.is_uri(root):
        files = {EXTRA_FILE: extra_json.encode(), STATE_FILE: lambda f: torch.save(state, f)}
        return storage.save_step(root, f"{PREFIX}{step:08d}", files, STATE_FILE, keep, PREFIX)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        torch.save(state, tmp / STATE_FILE)
        (tmp / EXTRA_FILE).write_text(extra_json, encoding="utf-8")
        final = step_dir(root, step)
        if final.exists():  # re-saving a step: move the old one aside first, rename is atomic
            old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for stale in list_checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint dir, or a root holding several (the newest is taken)."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        return p
    found = list_checkpoints(p)
    if not found:
        raise FileNotFoundError(f"{p}: no checkpoint here (expected {STATE_FILE} or {PREFIX}NNNNNNNN/ dirs)")
    return found[-1]


def load(path: str | os.PathLike, map_location="cpu") -> tuple[dict, dict, Path]:
    """(trainer state, extra, the dir read). Tensors only: nothing arbitrary is unpickled."""
    if storage.is_uri(path):
        d = storage.resolve_step(path, PREFIX, STATE_FILE)
        state = torch.load(io.BytesIO(storage.read_bytes(storage.join(d, STATE_FILE))),
                           map_location=map_location, weights_only=True)
        extra_uri = storage.join(d, EXTRA_FILE)
        return state, json.loads(storage.read_bytes(extra_uri)) if storage.exists(extra_uri) else {}, d
    d = resolve(path)
    state = torch.load(d / STATE_FILE, map_location=map_location, weights_only=True)
    extra_file = d / EXTRA_FILE
    extra = json.loads(extra_file.read_text(encoding="utf-8")) if extra_file.is_file() else {}
    return state, extra, d

"""Prompt sets: a built-in toy set by name, a text file with one prompt per line, or an
image-to-video dataset (a JSONL manifest or a folder of images with captions, cluster/data/manifests.py)."""

from __future__ import annotations

from pathlib import Path

from cluster.data import manifests as datasets
from cluster.data.text import condition_id, read_prompt_file
from common.config import DataConfig
from common.toyworld import PROMPT_SETS
from common.types import Condition


def load_prompts(spec: str, limits: DataConfig | None = None) -> list[Condition]:
    """`toy-train`, `toy-eval`, `toy-world`; `toy-i2v-train`, `toy-i2v-eval` (the committed toy
    I2V manifests); a JSONL manifest (`*.jsonl`); a folder of images with captions; or the
    path of a prompts file. A file is read within `limits` (the run's `data` section; its
    defaults when None)."""
    if spec in datasets.BUILTIN_MANIFESTS:
        return datasets.read_manifest(datasets.BUILTIN_MANIFESTS[spec], limits)
    if spec in PROMPT_SETS:
        prompts = list(PROMPT_SETS[spec])
    elif Path(spec).suffix.lower() == ".jsonl":
        return datasets.read_manifest(Path(spec), limits)
    elif Path(spec).is_dir():
        return datasets.read_folder(Path(spec), limits)
    else:
        prompts = read_prompt_file(Path(spec), limits)
    seen: dict[str, Condition] = {}
    for p in prompts:
        seen.setdefault(p, Condition(id=condition_id(p), prompt=p))
    return list(seen.values())

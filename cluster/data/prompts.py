"""Prompt sets: a built-in toy set by name, a text file with one prompt per line, or an
image-to-video dataset (a JSONL manifest or a folder of images with captions, cluster/data/manifests.py)."""

from __future__ import annotations

import hashlib
import unicodedata
from pathlib import Path

from common.config import ConfigError
from common.types import Condition

MAX_PROMPT_CHARS = 4096


def condition_id(prompt: str) -> str:
    """A stable id for a prompt: the same text always lands in the same bank slot."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def clean_prompt(prompt: str, where: str) -> str:
    text = unicodedata.normalize("NFC", prompt).strip()
    if any(unicodedata.category(ch) == "Cc" for ch in text):
        raise ConfigError(f"{where}: prompt contains a control character")
    if len(text) > MAX_PROMPT_CHARS:
        raise ConfigError(f"{where}: prompt is {len(text)} characters long; the limit is {MAX_PROMPT_CHARS}")
    return text


def read_lines(path: Path, what: str) -> list[str]:
    """A UTF-8 text file's lines, or one ConfigError naming the file (`what`: prompts file, manifest)."""
    if not path.is_file():
        raise ConfigError(f"{path}: {what} not found")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_prompt_file(path: Path) -> list[str]:
    """One prompt per line; blank lines and lines starting with # are skipped."""
    lines = read_lines(path, "prompts file")
    prompts = [clean_prompt(line, f"{path}:{i}") for i, line in enumerate(lines, 1)
               if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ConfigError(f"{path}: the prompts file holds no prompts (one per line; # starts a comment)")
    return prompts


def load_prompts(spec: str) -> list[Condition]:
    """`toy-train`, `toy-eval`, `toy-world`; `toy-i2v-train`, `toy-i2v-eval` (the committed toy
    I2V manifests); a JSONL manifest (`*.jsonl`); a folder of images with captions; or the
    path of a prompts file."""
    from cluster.data import manifests as datasets
    from common.toyworld import PROMPT_SETS

    if spec in datasets.BUILTIN_MANIFESTS:
        return datasets.read_manifest(datasets.BUILTIN_MANIFESTS[spec])
    if spec in PROMPT_SETS:
        prompts = list(PROMPT_SETS[spec])
    elif Path(spec).suffix.lower() == ".jsonl":
        return datasets.read_manifest(Path(spec))
    elif Path(spec).is_dir():
        return datasets.read_folder(Path(spec))
    else:
        prompts = read_prompt_file(Path(spec))
    seen: dict[str, Condition] = {}
    for p in prompts:
        seen.setdefault(p, Condition(id=condition_id(p), prompt=p))
    return list(seen.values())

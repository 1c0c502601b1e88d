"""The text rules every prompt source follows: NFC, no control characters, a length limit, a
stable id, and one clear line for a file that is missing or not UTF-8."""

from __future__ import annotations

import hashlib
import unicodedata
from pathlib import Path

from common.config import ConfigError

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

"""The text rules every prompt source follows: NFC, no control characters or lone surrogates, a
length limit, a stable id; and a file read one bounded line at a time (data.* bounds), with one
clear line for a file that is missing, too large or not UTF-8."""

from __future__ import annotations

import hashlib
import itertools
import unicodedata
from collections.abc import Iterator
from pathlib import Path

from common.config import ConfigError, DataConfig

MAX_PROMPT_CHARS = 4096


def condition_id(prompt: str) -> str:
    """A stable id for a prompt: the same text always lands in the same bank slot."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def clean_prompt(prompt: str, where: str, field: str = "prompt") -> str:
    """The prompt in NFC without surrounding space, or one ConfigError naming `where` and `field`."""
    surrogate = next((ch for ch in prompt if unicodedata.category(ch) == "Cs"), None)
    if surrogate is not None:  # a JSON "\ud800", or undecodable bytes of a command line
        raise ConfigError(f"{where}: {field} holds a lone surrogate ({ascii(surrogate)}), which is not text; "
                          "write the character itself (UTF-8)")
    text = unicodedata.normalize("NFC", prompt).strip()
    if any(unicodedata.category(ch) == "Cc" for ch in text):
        raise ConfigError(f"{where}: {field} contains a control character")
    if len(text) > MAX_PROMPT_CHARS:
        raise ConfigError(f"{where}: {field} is {len(text)} characters long; the limit is {MAX_PROMPT_CHARS}")
    return text


def iter_lines(path: Path, what: str, limits: DataConfig) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 text file (`what`: prompts file, manifest), one line at a
    time, split on "\n" only (a U+2028 inside a prompt stays in it; "\r\n" ends a line too).
    The file's size is checked before it is read, a line longer than `limits.max_line_bytes` is
    refused as soon as it is met, and anything wrong is one ConfigError naming the file (and line)."""
    if not path.is_file():
        raise ConfigError(f"{path}: {what} not found")
    size = path.stat().st_size
    if size > limits.max_file_bytes:
        raise ConfigError(f"{path}: the {what} is {size:,} bytes, more than data.max_file_bytes = "
                          f"{limits.max_file_bytes:,}; split it or raise data.max_file_bytes")
    cap = limits.max_line_bytes
    read = 0
    with path.open("rb") as f:
        for i in itertools.count(1):
            raw = f.readline(cap + 1)  # at most the bound and its newline are ever held
            if not raw:
                return
            if len(raw) > cap and not raw.endswith(b"\n"):
                raise ConfigError(f"{path}:{i}: line is longer than data.max_line_bytes = {cap:,} bytes; "
                                  "one prompt (or manifest row) per line, or raise data.max_line_bytes")
            if read + len(raw) > limits.max_file_bytes:  # it grew while being read
                raise ConfigError(f"{path}: the {what} grew past data.max_file_bytes = "
                                  f"{limits.max_file_bytes:,} while being read")
            try:
                text = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{i}: not UTF-8 text (byte {read + e.start} of the file)") from None
            read += len(raw)
            yield i, text.removesuffix("\n").removesuffix("\r")


def read_prompt_file(path: Path, limits: DataConfig | None = None) -> list[str]:
    """One prompt per line; blank lines and lines starting with # are skipped; at most
    `limits.max_prompts` prompts (data.*; the defaults when None)."""
    limits = limits or DataConfig()
    prompts: list[str] = []
    for i, line in iter_lines(path, "prompts file", limits):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if len(prompts) == limits.max_prompts:
            raise ConfigError(f"{path}:{i}: more than data.max_prompts = {limits.max_prompts:,} prompts; "
                              "use fewer or raise data.max_prompts")
        prompts.append(clean_prompt(line, f"{path}:{i}"))
    if not prompts:
        raise ConfigError(f"{path}: the prompts file holds no prompts (one per line; # starts a comment)")
    return prompts

"""The `UrlServer` actor: reads the bank's URL file on the driver's node for a worker on another
node (memory_bank/ref.py says why). It imports nothing but the standard library, so its Ray
worker starts in a fraction of a second and holds no torch: a zero-CPU reader of one small file."""

from __future__ import annotations

from pathlib import Path


class UrlServer:
    def __init__(self, path: str):
        self.path = path  # the file's path, not its content: arguments are kept by Ray

    def url(self) -> str:
        return Path(self.path).read_text().strip()

"""How an actor in another process reaches the bank: by reference, never with the password.

A `BankRef` holds the bank config with `redis_url` removed, plus where the URL lives: the
name of an environment variable every worker has (a KubeRay pod gets it from a Secret), or a
0600 file on this node (the embedded server, which listens on loopback only). Ray pickles
actor arguments into its control store, so the URL itself never goes into them.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.config import BankConfig


@dataclass(frozen=True)
class BankRef:
    cfg: BankConfig                # redis_url is always None here
    env: str | None = None         # read the URL from this environment variable
    file: str | None = None        # or from this file (mode 0600)

    def url(self) -> str:
        if self.env:
            url = os.environ.get(self.env)
            if not url:
                raise RuntimeError(f"bank: ${self.env} is not set on this worker; set it on every node "
                                   "(bank.redis_url_env), as the driver has it")
            return url
        if self.file:
            try:
                return Path(self.file).read_text().strip()
            except OSError as e:
                raise RuntimeError(f"bank: cannot read the Redis URL file {self.file} ({e.strerror}); "
                                   "with an embedded Redis every actor must run on the driver's node, "
                                   "otherwise set bank.redis_url_env on every node") from None
        raise RuntimeError("bank reference names neither an environment variable nor a file")

    def open(self):
        """A MemoryBank on its own connection (one per actor process)."""
        from memory_bank.bank import MemoryBank
        from memory_bank.connect import client_from_url

        return MemoryBank(client_from_url(self.url(), self.cfg.allow_no_password), self.cfg)


def make_ref(cfg: BankConfig, url: str, secret_dir: str | Path | None = None) -> tuple[BankRef, Path | None]:
    """A reference for `url`: the env variable when that is where the URL came from, else a
    0600 file in a fresh 0700 directory (returned, for the caller to delete at teardown)."""
    bare = cfg.model_copy(update={"redis_url": None})
    if cfg.redis_url is None and os.environ.get(cfg.redis_url_env) == url:
        return BankRef(bare, env=cfg.redis_url_env), None
    folder = Path(tempfile.mkdtemp(prefix="vgrpo-bank-", dir=secret_dir))
    os.chmod(folder, 0o700)
    path = folder / "redis_url"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url)
    return BankRef(bare, file=str(path)), folder

"""Where run files live: a local path (the default) or an object-store URI through fsspec.

A location is a plain string. `/var/lib/vgrpo/runs/x` and `runs/x` are local;
`s3://bucket/runs/x`, `gs://…`, `memory://…` (any scheme fsspec knows, with its driver
installed: s3fs, gcsfs, …) are not. Credentials come from the driver's usual sources (the
environment, a mounted config, workload identity), never from the run config.

Step directories. A checkpoint is a directory `<root>/<prefix><step:08d>/` of a few files, one
of which (the marker) marks it complete. An object store has no atomic directory rename, so
the files are written one object each, the marker last: a reader that lists only directories
holding the marker never sees a half-written checkpoint (a single PUT is atomic). The local
path keeps its rename-into-place writer (learner/checkpoint.py); this module serves the URIs.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Callable
from typing import IO, Any

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")

Writer = Callable[[IO[bytes]], Any]   # writes one file's bytes into an open binary file


def is_uri(location: str | os.PathLike) -> bool:
    """True for `scheme://…` other than file://, i.e. what fsspec serves rather than the OS."""
    m = _SCHEME.match(str(location)) if isinstance(location, str) else None
    return bool(m) and m.group(1).lower() != "file"


def filesystem(uri: str):
    """(fsspec filesystem, path inside it) for a URI; names the missing driver when absent."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except ImportError as e:
        scheme = _SCHEME.match(uri).group(1)
        raise ImportError(f"{uri}: the {scheme}:// filesystem needs its fsspec driver "
                          f"(e.g. pip install s3fs for s3://, gcsfs for gs://): {e}") from None
    return fs, path


def join(uri: str, *parts: str) -> str:
    return posixpath.join(uri.rstrip("/"), *parts)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    with fs.open(path, "rb") as f:
        return f.read()


def write(uri: str, data: bytes | Writer) -> None:
    """One object: bytes, or a writer called with the open file."""
    fs, path = filesystem(uri)
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data)


def step_name(prefix: str, step: int) -> str:
    return f"{prefix}{step:08d}"


def list_steps(root: str, prefix: str, marker: str) -> list[str]:
    """Complete step directories under root (holding `marker`), oldest first, as URIs."""
    fs, path = filesystem(root)
    if not fs.isdir(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = posixpath.basename(entry.rstrip("/"))
        if (name.startswith(prefix) and name[len(prefix):].isdigit()
                and fs.isfile(posixpath.join(entry, marker))):
            found.append((int(name[len(prefix):]), join(root, name)))
    return [uri for _, uri in sorted(found)]


def save_step(root: str, name: str, files: dict[str, bytes | Writer], marker: str, keep: int,
              prefix: str) -> str:
    """Write `<root>/<name>/` file by file with `marker` last, then keep only the newest `keep`
    complete steps. A re-saved step first loses its marker, so it is never read half-new."""
    if marker not in files:
        raise ValueError(f"save_step: the marker {marker!r} must be one of the files {sorted(files)}")
    d = join(root, name)
    fs, dpath = filesystem(d)
    if fs.exists(posixpath.join(dpath, marker)):
        fs.rm(posixpath.join(dpath, marker))
    for fname, data in files.items():
        if fname != marker:
            write(join(d, fname), data)
    write(join(d, marker), files[marker])
    for stale in list_steps(root, prefix, marker)[:-keep]:
        sfs, spath = filesystem(stale)
        sfs.rm(posixpath.join(spath, marker))   # unlisted first, then removed
        sfs.rm(spath, recursive=True)
    return d


def resolve_step(location: str, prefix: str, marker: str) -> str:
    """A step directory, or a root holding several (the newest complete one is taken)."""
    if exists(join(location, marker)):
        return location.rstrip("/")
    found = list_steps(location, prefix, marker)
    if not found:
        raise FileNotFoundError(f"{location}: no checkpoint here (expected {marker} or "
                                f"{prefix}NNNNNNNN/ dirs)")
    return found[-1]

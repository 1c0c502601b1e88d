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

`Uri` is a URI string that joins with `/` and answers the few pathlib questions the run code asks
(name, parent, exists, is_file, read_text, …), so code written against a Path also runs on a
`s3://` location. `location()` gives a Path for a local path and a Uri for the rest.

The driver keeps a run's own files (metrics, status, media, tracker logs) in a local staging folder
and mirrors them to the object store (`push_tree`, each file one PUT: a reader sees the old or the
new file, never half); `pull_tree` brings them back for `vgrpo resume`/`eval`/`export`.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import logging
import os
import posixpath
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from common.errors import UserError

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


class StoreUnavailable(UserError, RuntimeError):
    """The object store cannot be used at all: its endpoint does not answer, or there are no
    credentials. The message names the URL and what to set; the CLI prints it as one line, exit 2."""


# The drivers' own exception classes, by name (botocore's for s3fs, google-auth's for gcsfs), so
# that no driver is imported to recognise them; a class counts when it or a base has the name.
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ProxyConnectionError"}
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "DefaultCredentialsError"}
_CREDENTIALS_HOW = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or give the pod an IAM role)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file (or give the pod a "
          "workload identity)",
}
_ENDPOINT_HOW = {
    "s3": "set AWS_ENDPOINT_URL to the S3 endpoint that serves it (unset for AWS itself) and check "
          "that this machine reaches it",
}


def explain(e: BaseException, uri: str) -> StoreUnavailable | None:
    """A StoreUnavailable naming `uri` and what to set when `e` (or what it was raised from) is an
    unreachable endpoint or missing credentials; None for any other error."""
    m = _SCHEME.match(uri)
    scheme = m.group(1).lower() if m else ""
    scheme = {"s3a": "s3", "gcs": "gs"}.get(scheme, scheme)
    seen = 0
    while e is not None and seen < 8:
        names = {c.__name__ for c in type(e).__mro__}
        if names & _UNREACHABLE:
            kw = getattr(e, "kwargs", None) or {}
            url = urlsplit(str(kw.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or ""))
            at = f" at {url.scheme}://{url.netloc}" if url.netloc else ""
            how = _ENDPOINT_HOW.get(scheme, "check the filesystem's endpoint and this machine's network")
            return StoreUnavailable(f"{uri}: cannot reach the object store{at} ({type(e).__name__}); {how}")
        if names & _NO_CREDENTIALS:
            how = _CREDENTIALS_HOW.get(scheme, f"set the {scheme}:// filesystem's credentials")
            return StoreUnavailable(f"{uri}: no credentials for the object store ({type(e).__name__}); {how}")
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _explained(at: int = 0):
    """Decorate a function whose argument `at` is a URI: an unreachable endpoint or missing
    credentials, met while it (or, for a generator, its iteration) runs, becomes StoreUnavailable."""
    def wrap(fn):
        def translate(e: Exception, args) -> None:
            err = None if isinstance(e, UserError) else explain(e, str(args[at]))
            if err is not None:
                raise err from None

        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def gen(*args, **kw):
                try:
                    yield from fn(*args, **kw)
                except Exception as e:
                    translate(e, args)
                    raise
            return gen

        @functools.wraps(fn)
        def call(*args, **kw):
            try:
                return fn(*args, **kw)
            except Exception as e:
                translate(e, args)
                raise
        return call
    return wrap

Writer = Callable[[IO[bytes]], Any]   # writes one file's bytes into an open binary file


def is_uri(location: str | os.PathLike) -> bool:
    """True for `scheme://…` other than file://, i.e. what fsspec serves rather than the OS."""
    m = _SCHEME.match(str(location)) if isinstance(location, str) else None
    return bool(m) and m.group(1).lower() != "file"


def filesystem(uri: str):
    """(fsspec filesystem, path inside it) for a URI; names the missing driver when absent."""
    import fsspec  # lazy: fsspec (kept out of vgrpo --help)

    _quiet_orphan_tasks()
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except ImportError as e:
        scheme = _SCHEME.match(uri).group(1)
        raise ImportError(f"{uri}: the {scheme}:// filesystem needs its fsspec driver "
                          f"(e.g. pip install s3fs for s3://, gcsfs for gs://): {e}") from None
    return fs, path


class _OrphanTaskFilter:
    """Drops asyncio's "Task exception was never retrieved" for a connection error of an HTTP
    client's own write task: when an endpoint dies mid-upload, aiohttp (under s3fs) leaves one per
    open request, logged with its traceback, while the request itself fails and is reported in one
    line (`explain`). Any other orphaned task's error is still logged."""

    def filter(self, record) -> bool:
        exc = (record.args or {}).get("exception") if isinstance(record.args, dict) else None
        exc = exc or (record.exc_info[1] if record.exc_info else None)
        if not str(record.msg).startswith("Task exception was never retrieved") or exc is None:
            return True
        names = {c.__name__ for c in type(exc).__mro__}
        return not names & {"ClientConnectionError", "ClientConnectionResetError", "ServerDisconnectedError"}


_FILTER = _OrphanTaskFilter()


def _quiet_orphan_tasks() -> None:
    logger = logging.getLogger("asyncio")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


def join(uri: str, *parts: str) -> str:
    return posixpath.join(uri.rstrip("/"), *parts)


def _fresh(uri: str):
    """(filesystem, path) with the filesystem's listing cache dropped: another process (the
    learner, a second driver) may have written since this one last listed."""
    fs, path = filesystem(uri)
    fs.invalidate_cache()
    return fs, path


@_explained()
def exists(uri: str) -> bool:
    fs, path = _fresh(uri)
    return fs.exists(path)


class Uri(str):
    """A URI that joins like a Path (`Uri("s3://b/run") / "checkpoints"`) and answers the pathlib
    questions run code asks. A str, so it pickles to actors and every function here takes it."""

    def __new__(cls, value: str):
        return super().__new__(cls, str(value).rstrip("/"))

    def __truediv__(self, part: str | os.PathLike) -> Uri:
        return Uri(join(self, str(part)))

    @property
    def name(self) -> str:
        return posixpath.basename(self)

    @property
    def parent(self) -> Uri:
        scheme, _, rest = self.partition("://")
        return Uri(f"{scheme}://{posixpath.dirname(rest)}")

    def exists(self) -> bool:
        return exists(self)

    @_explained()
    def is_file(self) -> bool:
        fs, path = _fresh(self)
        try:  # not fs.isfile, which answers False for any error, an unreachable endpoint too
            return fs.info(path)["type"] == "file"
        except Exception as e:
            if explain(e, self) is not None:
                raise
            return False

    @_explained()
    def is_dir(self) -> bool:
        fs, path = _fresh(self)
        return fs.isdir(path)

    @_explained()
    def iterdir(self) -> Iterator[Uri]:
        fs, path = _fresh(self)
        if fs.isdir(path):
            for entry in fs.ls(path, detail=False):
                if entry.rstrip("/") != path.rstrip("/"):
                    yield self / posixpath.basename(entry.rstrip("/"))

    def glob(self, pattern: str) -> Iterator[Uri]:
        return (p for p in self.iterdir() if fnmatch.fnmatch(p.name, pattern))

    def read_bytes(self) -> bytes:
        return read_bytes(self)

    def read_text(self, encoding: str = "utf-8") -> str:
        return read_bytes(self).decode(encoding)

    def write_bytes(self, data: bytes) -> None:
        write(self, data)

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        write(self, text.encode(encoding))

    @_explained()
    def open(self, mode: str = "rb"):
        fs, path = filesystem(self)
        return fs.open(path, mode)

    @_explained()
    def size(self) -> int:
        fs, path = _fresh(self)
        return fs.size(path)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object stores have no folders: a prefix exists once an object is under it."""

    def resolve(self) -> Uri:
        return self


def location(where: str | os.PathLike) -> Path | Uri:
    """A Path for a local path, a Uri for an object-store URI."""
    return Uri(str(where)) if is_uri(where) else Path(where)


@_explained()
def remove(uri: str) -> None:
    """Delete an object or everything under a prefix (nothing there: nothing to do)."""
    fs, path = _fresh(uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@_explained(at=1)
def push_tree(local: Path, uri: str, skip: tuple[str, ...] = (),
              sent: dict[str, tuple[int, int]] | None = None) -> dict[str, tuple[int, int]]:
    """Upload the files under `local` that changed since `sent` (relative path → (size, mtime)),
    each as one object under `uri`; top-level names in `skip` stay local. Returns the new `sent`."""
    sent = dict(sent or {})
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        rel = f.relative_to(local).as_posix()
        if rel.split("/", 1)[0] in skip or ".tmp" in f.name:
            continue
        st = f.stat()
        sig = (st.st_size, st.st_mtime_ns)
        if sent.get(rel) != sig:
            write(join(uri, rel), f.read_bytes())
            sent[rel] = sig
    return sent


@_explained()
def pull_tree(uri: str, local: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[int, int]]:
    """Download every object under `uri` into `local` but the top-level names in `skip`; returns
    what push_tree would take as already sent."""
    fs, path = _fresh(uri)
    sent = {}
    if not fs.isdir(path):
        return sent
    for obj in fs.find(path):
        rel = posixpath.relpath(obj, path)
        if rel.split("/", 1)[0] in skip:
            continue
        dest = local / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        with fs.open(obj, "rb") as src:
            dest.write_bytes(src.read())
        st = dest.stat()
        sent[rel] = (st.st_size, st.st_mtime_ns)
    return sent


@_explained()
def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    with fs.open(path, "rb") as f:
        return f.read()


# Object stores have no folders, and their drivers' makedirs creates a *bucket* that is not there:
# a mistyped run.root must fail, not make one.
OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}


@_explained()
def write(uri: str, data: bytes | Writer) -> None:
    """One object: bytes, or a writer called with the open file."""
    with open_write(uri) as f:
        if callable(data):
            data(f)
        else:
            f.write(data)


def open_write(where: str | os.PathLike) -> IO[bytes]:
    """A file opened for writing: a local path (its folders made), or one object of a URI
    (written as the bytes come, in the driver's parts; complete when closed)."""
    if not is_uri(where):
        Path(where).parent.mkdir(parents=True, exist_ok=True)
        return open(where, "wb")  # noqa: SIM115 (the caller closes it)
    fs, path = filesystem(str(where))
    parent = posixpath.dirname(path)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if parent and not protocols & OBJECT_STORES:
        fs.makedirs(parent, exist_ok=True)
    return fs.open(path, "wb")


def open_read(where: str | os.PathLike) -> IO[bytes]:
    """A file opened for reading, local or one object of a URI."""
    if not is_uri(where):
        return open(where, "rb")  # noqa: SIM115 (the caller closes it)
    fs, path = filesystem(str(where))
    return fs.open(path, "rb")


def step_name(prefix: str, step: int) -> str:
    return f"{prefix}{step:08d}"


@_explained()
def list_steps(root: str, prefix: str, marker: str) -> list[Uri]:
    """Complete step directories under root (holding `marker`), oldest first, as URIs."""
    fs, path = _fresh(root)
    if not fs.isdir(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = posixpath.basename(entry.rstrip("/"))
        if (name.startswith(prefix) and name[len(prefix):].isdigit()
                and fs.isfile(posixpath.join(entry, marker))):
            found.append((int(name[len(prefix):]), Uri(join(root, name))))
    return [uri for _, uri in sorted(found)]


@_explained()
def save_step(root: str, name: str, files: dict[str, bytes | Writer], marker: str, keep: int,
              prefix: str) -> Uri:
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
    return Uri(d)


@_explained()
def resolve_step(location: str, prefix: str, marker: str) -> Uri:
    """A step directory, or a root holding several (the newest complete one is taken)."""
    if exists(join(location, marker)):
        return Uri(location)
    found = list_steps(location, prefix, marker)
    if not found:
        raise FileNotFoundError(f"{location}: no checkpoint here (expected {marker} or "
                                f"{prefix}NNNNNNNN/ dirs)")
    return found[-1]

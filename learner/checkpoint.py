"""Checkpoint directories: written whole into a temp dir, then renamed into place.

Layout: `<root>/step_00000042/{trainer.pt, extra.json}`. `trainer.pt` is the trainer's
state dict (torch.save, read back with weights_only=True); `extra.json` holds what the
driver adds (data cursor, bank watermark) as JSON. Only the newest `keep` survive, pruned only
after the new one is in place.

A checkpoint as a whole (cluster/driver/checkpoint.py): the driver first writes the bank's dump and
has the learner ranks write the policy (`policy/`, `write_policy`) into `stage(root, step)` (a hidden `.stage-step_N` dir locally, the unlisted
step dir on an object store); the learner's `save` then adds the trainer state last, fsyncs, and
renames it into place (or writes the marker last), so a step dir is visible only when every file
of it is written. A full disk is `DiskFull`: one line, and the older checkpoints stay.

`root` may also be an fsspec URI (s3://, gs://, …): common/storage.py then writes the same
layout object by object, trainer.pt last (a step without it is never listed: the object-store
counterpart of the temp dir), and the functions return `storage.Uri`s instead of Paths.

`verify` reads a checkpoint back before anything is started on it: a damaged file becomes one
`CheckpointError` line naming the file, what is wrong and what to do, instead of a traceback in
an actor. torch.load does not check the zip CRCs of a `trainer.pt`, so `verify` does.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import tempfile
import uuid
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from common import storage
from common.errors import UserError
from common.policy_layout import POLICY_DIR
from learner import policy_writer
from learner.finite_guard import check_weights

PREFIX = "step_"
STATE_FILE, EXTRA_FILE = "trainer.pt", "extra.json"
META_FILE = "meta.json"  # the marker of the sharded layout (learner/dist_checkpoint.py)


class CheckpointError(UserError, ValueError):
    """A checkpoint file is missing or damaged; the message names the file, the fault and the fix."""


class DiskFull(CheckpointError):
    """A checkpoint could not be written for want of space; nothing of it is visible."""


STAGE = ".stage-"   # the hidden dir a checkpoint is assembled in before it is renamed into place


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC (or a quota), also when it reached us wrapped (a Ray task error's text)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e).lower()
    return "no space left on device" in text or "disk quota exceeded" in text


NEARLY_FULL = 1 << 20   # free bytes below which a failed write is taken as a full disk whatever it said


def out_of_space(e: BaseException, where: str | os.PathLike, needed: int = 0) -> bool:
    """A write to `where` failed with `e`: was it for want of space? Whatever layer reported it:
    ENOSPC (is_disk_full), or any other exception (torch's zip writer says `RuntimeError:
    unexpected pos …`) while the filesystem holding `where` has less free than the write
    still `needed` (bytes), or nearly nothing. Check before the failed write's bytes are removed."""
    if is_disk_full(e):
        return True
    if not isinstance(e, Exception) or storage.is_uri(where):
        return False  # a kill (KeyboardInterrupt, SystemExit) is not a full disk; an object store has no df
    p = Path(where)
    while not p.exists() and p != p.parent:  # the nearest dir that exists: the same filesystem
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except (OSError, ValueError):
        return False
    return free < max(needed, NEARLY_FULL)


def state_bytes(state) -> int:
    """The bytes of the tensors in a (nested) state dict: what writing it needs at least."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def unwritten(state, f: Path) -> int:
    """What of `state` a failed write to `f` had still to write (its tensors' bytes less the file's)."""
    try:
        done = f.stat().st_size
    except OSError:
        done = 0
    return max(0, state_bytes(state) - done)


def disk_full_line(root: str | os.PathLike, step: int, path: str | os.PathLike | None = None) -> str:
    """The one line a full disk gives: where, how much is free, which checkpoint stands. `root`:
    the checkpoints dir; `path`: a file of the run dir a write outside a checkpoint failed on."""
    try:
        free = f"{shutil.disk_usage(path or root).free / 2**20:.1f} MiB free"
    except (OSError, ValueError):
        free = "free space unknown"
    done = list_checkpoints(root)
    stands = f"the newest complete checkpoint, {done[-1].name}, stands" if done else "no complete checkpoint yet"
    if path is not None:
        return (f"{path}: no space left on device at step {step} ({free}); the run stops and {stands}; "
                "free space, then continue with vgrpo resume")
    return (f"{root}: no space left on device writing the checkpoint of step {step} ({free}); nothing of it "
            f"was kept and {stands}; free space (or lower train.keep_checkpoints), then continue with vgrpo resume")


def stage(root: str | os.PathLike, step: int) -> Path:
    """Where the driver writes a checkpoint's bank dump and policy before `save` adds the trainer
    state and makes it visible: a fresh hidden dir locally; on an object store the step dir
    itself, unlisted first (its marker goes) when a step is saved again."""
    if storage.is_uri(root):
        d = storage.Uri(storage.join(str(root), f"{PREFIX}{step:08d}"))
        for marker in (STATE_FILE, META_FILE):
            if (d / marker).exists():
                storage.remove(d / marker)
        storage.remove(d / POLICY_DIR)   # an earlier save's shards (maybe of another rank count)
        return d
    d = Path(root) / f"{STAGE}{PREFIX}{step:08d}"
    shutil.rmtree(d, ignore_errors=True)   # what a killed run left half-written
    d.mkdir(parents=True)
    return d


def take_stage(root: Path, step: int) -> Path:
    """The dir `save` writes into: the driver's stage for this step when there is one, else a fresh one."""
    d = root / f"{STAGE}{PREFIX}{step:08d}"
    if d.is_dir():
        return d
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def write_torch(state: dict, path: Path) -> None:
    """torch.save through our own file. A full disk still often surfaces as torch's
    `RuntimeError: unexpected pos 1408 vs 1302` (the zip writer checks its own offsets): callers
    tell it apart with `out_of_space`, not by the exception's type."""
    with open(path, "wb") as f:
        torch.save(state, f)


def seal(tmp: Path, final: Path) -> None:
    """fsync every file and dir under tmp, rename it to final (an older final is moved aside
    first), fsync the parent: after a power cut the dir is there whole or not at all."""
    for p in sorted(tmp.rglob("*"), key=lambda q: -len(q.parts)) + [tmp]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if final.exists():  # re-saving a step: move the old one aside first, rename is atomic
        old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    check_finite(state, f"checkpoint of step {step}")
    if storage.is_uri(root):
        files = {EXTRA_FILE: extra_json.encode(), STATE_FILE: lambda f: torch.save(state, f)}
        return storage.save_step(root, f"{PREFIX}{step:08d}", files, STATE_FILE, keep, PREFIX)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = take_stage(root, step)
    try:
        write_torch(state, tmp / STATE_FILE)
        (tmp / EXTRA_FILE).write_text(extra_json, encoding="utf-8")
        final = step_dir(root, step)
        seal(tmp, final)
    except BaseException as e:
        full = out_of_space(e, tmp, unwritten(state, tmp / STATE_FILE))  # before the partial file goes
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFull(disk_full_line(root, step)) from None
        raise
    prune(root, keep)
    return final


def prune(root: Path, keep: int, marker: str = STATE_FILE) -> None:
    """After a new checkpoint is in place: all but the newest `keep`, and what killed writes left."""
    for stale in list_checkpoints(root, marker)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    for left in root.glob(f"{STAGE}{PREFIX}*"):
        shutil.rmtree(left, ignore_errors=True)


def check_finite(state: dict, what: str) -> None:
    """A trainer state's weights (policy.params) are never saved NaN/inf (learner/finite_guard.py)."""
    policy = state.get("policy")
    if isinstance(policy, dict) and isinstance(policy.get("params"), dict):
        check_weights(policy["params"], what)


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint dir, or a root holding several (the newest is taken)."""
    p = storage.location(path)
    if (p / STATE_FILE).is_file():
        return p
    found = list_checkpoints(p)
    if not found:
        raise CheckpointError(f"{p}: no checkpoint here (expected {STATE_FILE} or {PREFIX}NNNNNNNN/ dirs)")
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
    state = load_state_file(d / STATE_FILE, map_location)
    return state, read_extra(d / EXTRA_FILE), d


def write_policy(path: str | os.PathLike, payload: dict, ema: bool, version: int, decay: float, *,
                 wire: dict | None = None, configs: dict[str, str] | None = None, rank: int = 0, world: int = 1,
                 wait: Callable[[], None] | None = None) -> None:
    """The exported policy, `policy/` (what `vgrpo eval` and `vgrpo export` read): the weights or,
    with optim.ema_decay, their moving average, in diffusers' sharded safetensors layout
    (common/policy_layout.py), its metadata saying which. A learner group calls it on every rank
    with its own shards (learner/policy_writer.py: no rank holds the whole model); one process
    with its whole payload writes it alone."""
    policy_writer.write(path, payload, policy_writer.policy_meta(ema, version, decay), wire=wire,
                        configs=configs, rank=rank, world=world, wait=wait)


# --- verification: one line per damaged file ----------------------------------------------------

def step_dirs(root: str | os.PathLike) -> list[Path]:
    """Every step_NNNNNNNN dir under root, complete or not, oldest first. On an object store only
    complete ones: a step without its marker is a write still under way (or one a kill cut
    short), as a local `.tmp-` dir is, and never one to verify or fall back to."""
    if storage.is_uri(root):
        found = {d for marker in (STATE_FILE, META_FILE) for d in list_checkpoints(root, marker)}
        return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))
    root = Path(root)
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and p.name[len(PREFIX):].isdigit()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def set_aside_hint(d: Path) -> str:
    """The fix for a damaged newest checkpoint: move it aside, which resumes from the one before."""
    older = [p for p in step_dirs(d.parent) if p != d and int(p.name[len(PREFIX):]) < int(d.name[len(PREFIX):])]
    if not older:
        return "no older checkpoint to fall back to; restore the file or start a new run"
    return f"restore the file, or move {d.name} out of {d.parent} to resume from {older[-1].name}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


@contextlib.contextmanager
def readable(f: Path) -> Iterator[Path]:
    """A local path holding f's bytes: f itself, or a temp copy of an object-store file (torch
    and zipfile read local files; the messages still name f)."""
    if not storage.is_uri(f):
        yield f
        return
    with tempfile.TemporaryDirectory(prefix="vgrpo-ckpt-") as tmp:
        local = Path(tmp) / f.name
        local.write_bytes(storage.read_bytes(f))
        yield local


def check_torch_file(f: Path) -> str | None:
    """What is wrong with a torch.save file, or None: present, a whole zip, every CRC right."""
    if not f.is_file():
        return "missing"
    with readable(f) as local:
        return _check_zip(local)


def _check_zip(f: Path) -> str | None:
    if f.stat().st_size == 0:
        return "empty (0 bytes)"
    try:
        with zipfile.ZipFile(f) as z:
            bad = z.testzip()  # reads every member and checks its CRC-32
    except zipfile.BadZipFile:
        return "truncated or not a torch.save file (its zip directory is missing or broken)"
    except (OSError, EOFError, zlib.error, ValueError) as e:
        return f"truncated or damaged ({_first_line(e)})"
    if bad is not None:
        return f"damaged: member {bad!r} fails its CRC-32 check (bytes changed after it was written)"
    return None


def load_state_file(f: Path, map_location="cpu", mmap: bool = False) -> dict:
    """torch.load a state file (tensors only), or CheckpointError naming it."""
    try:
        with readable(f) as local:
            state = torch.load(local, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing") from None
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError… for a bad file
        raise CheckpointError(f"{f}: cannot be loaded ({_first_line(e)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f}: holds a {type(state).__name__}, not a state dict")
    return state


def read_extra(f: Path, keys: tuple[str, ...] = ()) -> dict:
    """extra.json as a dict holding integer `keys`, or CheckpointError naming the file."""
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (the checkpoint is incomplete)")
    try:
        extra = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON, truncated or damaged ({e})") from None
    except RecursionError:  # 100,000 nested brackets: nothing vgrpo writes
        raise CheckpointError(f"{f}: nested too deeply to be vgrpo's (damaged or not written by vgrpo)") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"{f}: holds a JSON {type(extra).__name__}, not an object")
    for k in keys:
        if not isinstance(extra.get(k), int) or isinstance(extra.get(k), bool):
            raise CheckpointError(f"{f}: {k!r} is {extra.get(k)!r}, not an integer (damaged or not written by vgrpo)")
    return extra


def verify_file(f: Path, keys: tuple[str, ...] = ()) -> None:
    """A torch.save state file: whole, CRCs right, loadable as tensors, holding `keys`."""
    problem = check_torch_file(f)
    if problem is not None:
        raise CheckpointError(f"{f}: {problem}; {set_aside_hint(f.parent)}")
    try:
        state = load_state_file(f, mmap=True)  # mmap: the pickle is checked, the tensors are not read
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {set_aside_hint(f.parent)}") from None
    lacking = [k for k in keys if k not in state]
    if lacking:
        raise CheckpointError(f"{f}: lacks {', '.join(lacking)} (not a trainer checkpoint); {set_aside_hint(f.parent)}")


def verify(d: str | os.PathLike, state_keys: tuple[str, ...] = (), extra_keys: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError (one line: file, fault, fix) unless step dir `d` reads back whole."""
    d = storage.location(d)
    verify_file(d / STATE_FILE, state_keys)
    try:
        read_extra(d / EXTRA_FILE, extra_keys)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {set_aside_hint(d)}") from None

"""A run's trained policy as files: which checkpoints hold it, which config and checkpoint a
target names (a run dir, a checkpoint dir or 'base'), and reading it with one-line errors.
Evaluation and export both read it; it loads no model.

A checkpoint's policy is `policy/` in diffusers' sharded safetensors layout (common/policy_layout.py:
per trained expert a folder of an index and its shards, config.json for a full fine-tune), which
`PolicyFiles` reads shard by shard, so a reader holds one shard at a time; a checkpoint written
before it holds one `policy.safetensors`, read whole as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from common import storage
from common.config import ConfigError, load_config
from common.policy_layout import CONFIG_FILE, EXPERTS, LEGACY_FILE, POLICY_DIR, WEIGHTS_INDEX

POLICY_FILE = LEGACY_FILE   # the single-file policy of checkpoints written before policy/
FIX = "restore it, or evaluate an older checkpoint dir (TARGET/checkpoints/step_NNNNNNNN)"


def policy_path(ckpt):
    """What a checkpoint's policy is read from, and what messages name: policy/ (when its index
    is there) or a legacy policy.safetensors."""
    d = storage.location(ckpt)
    if (d / POLICY_DIR / EXPERTS[0] / WEIGHTS_INDEX).is_file() or not (d / LEGACY_FILE).is_file():
        return d / POLICY_DIR
    return d / LEGACY_FILE


def has_policy(ckpt) -> bool:
    """Whether a checkpoint dir holds a complete policy: the index is written last."""
    d = storage.location(ckpt)
    return (d / POLICY_DIR / EXPERTS[0] / WEIGHTS_INDEX).is_file() or (d / LEGACY_FILE).is_file()


def policy_checkpoints(run) -> list:
    """A run's checkpoint dirs that hold the exported policy, oldest first (Paths, or Uris for a
    run on an object store)."""
    from learner.checkpoint import step_dirs  # heavy: torch (the CLI imports this module at start)

    root = storage.location(run) / "checkpoints"
    if not root.is_dir():
        return []
    # step_dirs: on an object store only those whose marker is written (the policy goes in first)
    return [d for d in step_dirs(root) if has_policy(d)]


def resolve_target(target: str, config: str | None, step: int | None = None):
    """(config, checkpoint dir or None) for a run dir (its newest checkpoint, or `step`'s), a
    checkpoint dir, or 'base'. A run may live on an object store (s3://…)."""
    if target == "base":
        return load_config(config), None
    p = storage.location(target)
    if (p / "config.yaml").is_file():
        ckpts = policy_checkpoints(p)
        if step is not None:
            ckpts = [d for d in ckpts if d.name == f"step_{step:08d}"]
            if not ckpts:
                have = ", ".join(str(int(d.name[5:])) for d in policy_checkpoints(p)) or "none"
                raise ConfigError(f"--step {step}: {p} has no checkpoint of that step with a policy "
                                  f"({POLICY_DIR}/) (kept: {have})")
        if not ckpts:
            raise ConfigError(f"{p}: no checkpoint with a policy ({POLICY_DIR}/) under {p / 'checkpoints'}")
        return load_config(p / "config.yaml"), ckpts[-1]
    if has_policy(p) and (p.parent.parent / "config.yaml").is_file():
        return load_config(p.parent.parent / "config.yaml"), p
    raise ConfigError(f"{p}: not a run directory (config.yaml) or a checkpoint dir (with {POLICY_DIR}/)")


def _error(message: str):
    from learner.checkpoint import CheckpointError  # lazy: torch (kept out of vgrpo --help)

    return CheckpointError(message)


class PolicyFiles:
    """A checkpoint's policy, opened: every index read and every shard's header checked against
    it and against the file's size (a missing, truncated or foreign shard is one line naming it)
    before any tensor is read; then the tensors shard by shard (`parts`), each checked finite.
    Keys are the payload's (`transformer.…`/`transformer_2.…` when both Wan 2.2 experts trained).
    A legacy policy.safetensors is read whole here, as it always was."""

    def __init__(self, ckpt):
        self.ckpt = storage.location(ckpt)
        self.path = policy_path(self.ckpt)
        self.legacy = self.path.name == LEGACY_FILE
        self.meta: dict[str, str] = {}
        self.shards: list[tuple[str, object, list[str]]] = []   # (expert, file, its file keys)
        self.shapes: dict[str, tuple[int, ...]] = {}              # payload key -> shape
        if self.legacy:
            self._payload, self.meta = read_policy_file(self.path)
            self.shapes = {k: tuple(v.shape) for k, v in self._payload.items()}
            return
        self.experts = [e for e in EXPERTS if (self.path / e / WEIGHTS_INDEX).is_file()]
        if not self.experts:
            raise _error(f"{self.path / EXPERTS[0] / WEIGHTS_INDEX}: missing; {FIX}")
        self.prefixed = len(self.experts) > 1
        for expert in self.experts:
            self._open_expert(expert)
        if not self.shapes:
            raise _error(f"{self.path}: holds no tensors; {FIX}")

    def _key(self, expert: str, file_key: str) -> str:
        return f"{expert}.{file_key}" if self.prefixed else file_key

    def _open_expert(self, expert: str) -> None:
        index_file = self.path / expert / WEIGHTS_INDEX
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            meta = {k: str(v) for k, v in (index.get("metadata") or {}).items() if k.startswith("vgrpo.")}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise _error(f"{index_file}: damaged ({type(e).__name__}); {FIX}") from None
        self.meta = self.meta or meta
        by_file: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(name, []).append(key)
        for name, keys in sorted(by_file.items()):
            f = self.path / expert / name
            header = read_header(f)
            for k in keys:
                if k not in header:
                    raise _error(f"{f}: lacks {k!r}, which {WEIGHTS_INDEX} places there; {FIX}")
                self.shapes[self._key(expert, k)] = tuple(header[k]["shape"])
            self.shards.append((expert, f, keys))

    def names(self) -> list[str]:
        return list(self.shapes)

    def expert_shapes(self, expert: str) -> dict[str, tuple[int, ...]]:
        """{key in the model: shape} of one expert's tensors (policy/ only)."""
        if not self.prefixed:
            return dict(self.shapes) if expert == EXPERTS[0] else {}
        return {k.split(".", 1)[1]: s for k, s in self.shapes.items() if k.split(".", 1)[0] == expert}

    def config(self, expert: str) -> dict | None:
        """The expert's config.json in the checkpoint (a full fine-tune's), or None."""
        if self.legacy or not (self.path / expert / CONFIG_FILE).is_file():
            return None
        return json.loads((self.path / expert / CONFIG_FILE).read_text(encoding="utf-8"))

    def parts(self) -> Iterator[dict]:
        """The tensors, one shard at a time (payload keys), each checked finite."""
        if self.legacy:
            yield self._payload
            return
        for expert, f, keys in self.shards:
            tensors = read_shard(f)
            yield {self._key(expert, k): tensors[k] for k in keys}

    def read_all(self) -> dict:
        out: dict = {}
        for part in self.parts():
            out.update(part)
        return out


def read_header(f) -> dict:
    """A safetensors file's header (name -> dtype, shape, offsets), checked against the file's
    size; CheckpointError naming the file when it is missing, truncated or not safetensors."""
    try:
        with storage.open_read(str(f)) as h:
            n = int.from_bytes(h.read(8), "little")
            if n <= 0 or n > 100 * 2**20:
                raise ValueError(f"a header of {n} bytes")
            head = json.loads(h.read(n))
        size = f.size() if storage.is_uri(str(f)) else Path(f).stat().st_size
        tensors = {k: v for k, v in head.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except FileNotFoundError:
        raise _error(f"{f}: missing; {FIX}") from None
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise _error(f"{f}: truncated or damaged safetensors file ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:120] if str(e) else ''}); {FIX}") from None
    if size != 8 + n + end:
        raise _error(f"{f}: truncated or damaged safetensors file ({size} bytes, its header says "
                     f"{8 + n + end}); {FIX}")
    return tensors


def read_shard(f) -> dict:
    """The tensors of one safetensors file, each checked finite (safetensors has no checksum:
    flipped bytes show up, if at all, as NaN/inf)."""
    return _read(f)[0]


def check_finite(local: Path, name=None) -> None:
    """Every value of a local safetensors file finite, read one tensor at a time (memory-mapped);
    the message names `name` (where it came from), else the file."""
    import torch  # heavy: torch and safetensors, only when a policy is read
    from safetensors import SafetensorError, safe_open

    name = name or local
    try:
        with safe_open(str(local), "pt") as sf:
            for k in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                v = sf.get_tensor(k)
                if v.is_floating_point() and not torch.isfinite(v).all():
                    raise _error(f"{name}: tensor {k!r} holds NaN/inf (a damaged file); {FIX}")
                del v
    except (SafetensorError, OSError) as e:
        raise _error(f"{name}: truncated or damaged safetensors file ({e}); {FIX}") from None


def read_policy(ckpt) -> dict:
    """A checkpoint's whole policy (payload keys), or CheckpointError: one line naming the file and the fault."""
    return PolicyFiles(ckpt).read_all()


def read_policy_file(f: Path) -> tuple[dict, dict[str, str]]:
    """(tensors, metadata) of a legacy policy.safetensors, local or on an object store;
    CheckpointError (one line naming the file and the fault) when it is missing or damaged."""
    payload, meta = _read(f, metadata=True)
    if not payload:
        raise _error(f"{f}: holds no tensors; {FIX}")
    return payload, meta


def _read(f, metadata: bool = False) -> tuple[dict, dict[str, str]]:
    import torch  # heavy: torch and safetensors, only when a policy is read
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load, load_file

    meta: dict[str, str] = {}
    try:
        if storage.is_uri(str(f)):  # an object read whole (one shard)
            data = storage.read_bytes(f)
            tensors = load(data)
            meta = _metadata(data) if metadata else {}
        else:  # memory-mapped
            tensors = load_file(str(f))
            if metadata:
                with safe_open(str(f), "pt") as sf:
                    meta = dict(sf.metadata() or {})
    except FileNotFoundError:
        raise _error(f"{f}: missing; {FIX}") from None
    except (SafetensorError, OSError) as e:
        raise _error(f"{f}: truncated or damaged safetensors file ({e}); {FIX}") from None
    bad = next((k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if bad is not None:
        raise _error(f"{f}: tensor {bad!r} holds NaN/inf (a damaged file); {FIX}")
    return tensors, meta


def _metadata(data: bytes) -> dict[str, str]:
    """A safetensors file's __metadata__ (its header: 8-byte little-endian length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8:8 + n]).get("__metadata__") or {})

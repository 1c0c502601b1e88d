"""What a resume reads from a run directory, checked field by field before Ray starts.

A kill, a full disk or a hand can leave any of these files wrong; each check here reads one as
the record it should be and raises one line naming the file and the field (a `UserError`, exit 2),
so nothing is started, written or half-restored on bad input:

- `status.json`: the run's state and sessions (a stale `running` is recognised: `stale_note`);
- `trainer.pt`: the trainer state's structure and every tensor's shape, against the optimizer's
  and anchors' copies and the model itself (toy built; wan and hunyuan15 built on meta);
- `bank/index.json`: the dump's counts, sizes and offsets (a negative byte count would disable
  `bank.max_bytes`) and its namespace. Its SHA-256 and entries are checked when it is restored
  (memory_bank/dump.py);
- extra.json's bank snapshot: its format and the namespace it is for, against `bank.namespace`
  (`vgrpo resume RUN bank.namespace=other` would otherwise fail in the driver's setup, after Ray).

extra.json's driver fields are `DriverState.from_saved`'s (cluster/driver/state.py).
"""

from __future__ import annotations

import json
import math
import os
import socket
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from cluster.driver.state import DriverState
from cluster.runs.run_dir import RunFileError, is_stale
from common.families import FAMILIES
from learner.checkpoint import EXTRA_FILE, STATE_FILE, CheckpointError, load_state_file, read_extra
from memory_bank.bank import snapshot_problem
from rollout_worker.models import build_model
from rollout_worker.models.base import is_local

STATES = ("running", "finished", "stopped")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


# --- status.json ------------------------------------------------------------------------------

def check_status(f: Path) -> dict[str, Any]:
    """status.json as vgrpo writes it ({} when there is none), or RunFileError naming the field."""
    if not f.is_file():
        return {}
    try:
        status = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RunFileError(f"{f}: not valid JSON ({str(e)[:80]}); delete it, it is rewritten on resume") from None

    def bad(field: str, what: str) -> RunFileError:
        return RunFileError(f"{f}: field {field!r} must be {what}, got {_short(status.get(field))}; "
                            "fix or delete the file (it is rewritten on resume)")

    if not isinstance(status, dict):
        raise RunFileError(f"{f}: holds a JSON {type(status).__name__}, not an object; delete it")
    if status.get("state") not in STATES:
        raise bad("state", f"one of {', '.join(STATES)}")
    if "pid" in status and not (_count(status["pid"]) and status["pid"] > 0):
        raise bad("pid", "a process id > 0")
    if "host" in status and not isinstance(status["host"], str):
        raise bad("host", "a host name")
    sessions = status.get("sessions", [])
    if not isinstance(sessions, list) or not all(
            isinstance(s, list) and len(s) == 2 and _time(s[0]) and (s[1] is None or (_time(s[1]) and s[1] >= s[0]))
            for s in sessions):
        raise bad("sessions", "a list of [start, end or null] times, end >= start")
    if "updated" in status and not _time(status["updated"]):
        raise bad("updated", "a time")
    return status


def check_not_running(f: Path, status: dict[str, Any]) -> str | None:
    """Refuse a resume while the run's driver is alive on this host; the note for a stale one."""
    if status.get("state") != "running" or status.get("host") != socket.gethostname() \
            or status.get("pid") == os.getpid():  # this process's own earlier session (tests resume in-process)
        return None
    if not is_stale(status):
        raise RunFileError(f"{f}: the run is still running (pid {status['pid']} on this host); "
                           "stop it first (Ctrl-C, or kill -TERM it), then resume")
    return (f"{f}: the last session (pid {status['pid']}) ended without saying why (killed or crashed); "
            "resuming from its last checkpoint")


# --- trainer.pt -------------------------------------------------------------------------------

def check_trainer_state(ckpt: Path, cfg, step: int) -> None:
    """A single-rank trainer.pt: its structure, its shapes against each other and against the
    model this run builds (model_shapes); CheckpointError naming the file and the field."""
    f = ckpt / "trainer.pt"
    state = load_state_file(f, mmap=True)

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{f}: {field} {what} (damaged, or not written for this run's settings)")

    need(_count(state.get("version")) and state.get("version") == step, "'version'",
         f"is {_short(state.get('version'))}, not the step {step} its extra.json records")
    need(state.get("finetune") == cfg.optim.finetune, "'finetune'",
         f"is {_short(state.get('finetune'))}, this run has optim.finetune={cfg.optim.finetune!r} (resume with that)")
    policy = state.get("policy")
    need(isinstance(policy, dict) and isinstance(policy.get("params"), dict) and policy["params"]
         and isinstance(policy.get("anchors"), dict), "'policy'", "is not {params, anchors} of tensors")
    params = policy["params"]
    shapes = {n: tuple(t.shape) for n, t in params.items() if _is_tensor(t)}
    need(len(shapes) == len(params), "'policy.params'", "holds a value that is not a tensor")
    for n, want in model_shapes(cfg).items():
        need(shapes.get(n) == want, f"'policy.params.{n}'", f"has shape {shapes.get(n)}, the model's weight has {want}")
    for a, tensors in policy["anchors"].items():
        for n, t in (tensors or {}).items():
            need(_is_tensor(t) and tuple(t.shape) == shapes.get(n), f"'policy.anchors.{a}.{n}'",
                 f"has shape {_shape(t)}, the weight has {shapes.get(n)}")
    _check_optimizer(state.get("optimizer"), list(shapes.values()), need)
    rng = state.get("rng")
    need(isinstance(rng, dict) and _is_tensor(rng.get("torch")) and isinstance(rng.get("python"), list),
         "'rng'", f"is {_short(rng)}, not the torch and python generator states")


def _is_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor)


def _shape(t: Any) -> Any:
    return tuple(t.shape) if _is_tensor(t) else type(t).__name__


def _check_optimizer(opt: Any, shapes: list[tuple], need) -> None:
    need(isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list),
         "'optimizer'", "is not an optimizer state dict")
    for i, s in opt["state"].items():
        need(isinstance(i, int) and 0 <= i < len(shapes) and isinstance(s, dict), f"'optimizer.state.{i}'",
             f"names no weight (there are {len(shapes)})")
        for k in ("exp_avg", "exp_avg_sq"):
            if k in s:
                need(_is_tensor(s[k]) and tuple(s[k].shape) == shapes[i], f"'optimizer.state.{i}.{k}'",
                     f"has shape {_shape(s[k])}, its weight has {shapes[i]}")


def model_shapes(cfg) -> dict[str, tuple]:
    """The trainable weights' shapes of the model this run builds, as the learner names them.
    Toy: built (CPU-sized by design). wan / hunyuan15: the transformer(s) alone from their
    config.json, parameters and LoRA adapters on the meta device (no weight read, nothing
    allocated: a 14B expert costs the driver no memory). {} for a hub id: nothing is fetched
    before Ray starts (the learner's load_state_dict checks the names there)."""
    from learner.policy import Policy  # heavy: torch

    toy = not FAMILIES[cfg.model.family].needs_path  # ships its own weights: built whole
    if not toy and not (cfg.model.path and is_local(cfg.model.path)):
        return {}
    model = build_model(cfg) if toy else build_model(cfg, "cpu", components="transformer", empty=True)
    with nullcontext() if toy else torch.device("meta"):
        policy = Policy(model, cfg.optim, [], seed=cfg.train.seed)
    return {n: tuple(p.shape) for n, p in policy.params.items()}


# --- bank/index.json --------------------------------------------------------------------------

def check_bank_snapshot(ckpt: Path, extra: dict[str, Any], namespace: str) -> None:
    """extra.json's bank snapshot (null when the checkpoint has none): one this run's bank can
    restore, of this run's bank.namespace; CheckpointError naming the field and the fix."""
    snap = extra.get("bank")
    if snap is None or (why := snapshot_problem(snap, namespace)) is None:
        return
    f = ckpt / EXTRA_FILE
    if isinstance(snap, dict) and isinstance(snap.get("namespace"), str) and snap["namespace"] != namespace:
        raise CheckpointError(
            f"{f}: field 'bank.namespace' is {snap['namespace']!r}: the run's bank data is in that "
            f"namespace, and this resume has bank.namespace={namespace!r}; resume with "
            f"bank.namespace={snap['namespace']} (or without overriding it)")
    raise CheckpointError(f"{f}: field 'bank' is not a bank snapshot this vgrpo restores: {why}")


def check_bank_index(ckpt: Path, namespace: str | None = None) -> None:
    """The bank dump's index, when there is one: every count, size and offset a whole number
    >= 0 (the entries inside the file's size), and of `namespace` when given; CheckpointError
    naming the field."""
    f = ckpt / "bank" / "index.json"
    if not f.is_file():
        return
    try:
        index = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({str(e)[:80]}); move {f.parent} aside to resume "
                              "with an empty bank") from None

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{f}: {field} {what}; move {f.parent} aside to resume with an empty bank")

    need(isinstance(index, dict), "the index", "is not a JSON object")
    need(_count(index.get("size")), "'size'", f"must be a byte count >= 0, got {_short(index.get('size'))}")
    for key in ("entries", "cond_records"):  # cond_records: codec format 3's condition records
        located = index.get(key, {} if key == "cond_records" else None)
        need(isinstance(located, dict), f"'{key}'", "must be a map of id -> [offset, meta bytes, blob bytes]")
        for eid, loc in located.items():
            need(isinstance(loc, list) and len(loc) == 3 and all(map(_count, loc)) and sum(loc) <= index["size"],
                 f"'{key}.{eid}'", f"must be 3 byte counts >= 0 inside the file's {index['size']} bytes, "
                 f"got {_short(loc)}")
    einfo = index.get("einfo")
    need(isinstance(einfo, dict), "'einfo'", "must be a map of entry id -> accounting")
    for eid, raw in einfo.items():
        try:
            info = json.loads(raw) if isinstance(raw, str) else None
        except ValueError:
            info = None
        need(isinstance(info, dict) and _count(info.get("b")), f"'einfo.{eid}'",
             f"must hold a byte count 'b' >= 0, got {_short(raw)}")
    groups = index.get("groups")
    need(isinstance(groups, list), "'groups'", "must be a list of queued groups")
    for i, g in enumerate(groups):
        fields = g.get("fields") if isinstance(g, dict) else None
        need(isinstance(fields, dict) and isinstance(g.get("id"), str), f"'groups[{i}]'", "must be {id, fields}")
        nbytes = fields.get("bytes", "0")
        need(isinstance(nbytes, str) and nbytes.isdigit(), f"'groups[{i}].fields.bytes'",
             f"must be a byte count >= 0, got {_short(nbytes)}")
    counts = index.get("counts", {})
    need(isinstance(counts, dict) and all(isinstance(v, str) and v.lstrip("-").isdigit() and not v.startswith("-")
                                          for v in counts.values()), "'counts'", "must be counts >= 0")
    if namespace is not None and isinstance(index.get("namespace"), str) and index["namespace"] != namespace:
        raise CheckpointError(
            f"{f}: field 'namespace' is {index['namespace']!r}: the run's bank data is in that namespace, "
            f"and this resume has bank.namespace={namespace!r}; resume with bank.namespace="
            f"{index['namespace']} (or without overriding it)")


def check_saved_state(run_dir, ckpt, cfg) -> list[str]:
    """Every file a resume reads, as the record it should be (the checks above):
    extra.json as a DriverState, trainer.pt's structure and shapes, the bank dump's counts,
    status.json and metrics.jsonl. One line naming the file and the field (exit 2) before
    anything starts; returns the notes (a stale `running` status, a torn last metrics line)."""
    extra = read_extra(ckpt / EXTRA_FILE)
    saved = DriverState.from_saved(extra, str(ckpt / EXTRA_FILE))
    check_bank_snapshot(ckpt, extra, cfg.bank.namespace)
    if (ckpt / STATE_FILE).is_file():  # a sharded checkpoint's shards are checked by its ranks
        check_trainer_state(ckpt, cfg, saved.step)
    check_bank_index(ckpt, cfg.bank.namespace)
    status = check_status(run_dir.status_file)
    notes = [n for n in (check_not_running(run_dir.status_file, status),
                         run_dir.metrics_rows()[1]) if n]
    return notes

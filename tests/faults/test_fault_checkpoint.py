"""Damaged files on disk: a truncated, bit-flipped or missing trainer.pt, a missing or truncated
extra.json, a damaged policy.safetensors, damaged toy weights, and the sharded (FSDP) layout.

Every case runs the real `vgrpo` CLI in a subprocess on files written by the real savers and then
damaged, and checks: exit status 2, exactly one stderr line naming the file, no traceback, and not
one byte of the run directory changed (nothing written, nothing overwritten).

The CLI refusals are batched: the `batch` fixture prepares every batched case on its own copy of
the pristine run (damaged as the test says, hashed before), runs them all in ONE child Python that
forks a fresh `python -m cluster.cli` process per case (tests/cli_batch.py: its own fds 1 and 2,
cwd, env, exit status; the imports paid once), and each test asserts on its own case's result.
These stay genuine standalone `python -m cluster.cli` subprocesses (`_vgrpo`), so the real process
boundary stays covered for every command: eval and sample
(test_damaged_policy_on_eval_and_sample_is_one_line_and_writes_nothing), train
(test_train_on_damaged_toy_weights_fails_before_any_actor[truncated]), resume
(test_sharded_checkpoint_damage_is_one_line, whose damage comes in steps around the run, and
test_a_wan_trainer_state_of_another_shape_is_one_line_before_ray, whose env differs).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cli_batch import BatchResult, run_batch
from fault_helpers import ROOT
from safetensors.torch import save_file

from cluster.runs.run_dir import RunDir
from common.config import load_config
from learner import checkpoint, dist_checkpoint
from learner.checkpoint import CheckpointError
from learner.trainer import Trainer
from rollout_worker.models import build_model
from rollout_worker.models.toy import ToyVideoModel

pytestmark = pytest.mark.timeout(300)

STEPS = (2, 3)  # two checkpoints: a damaged newest one names the older one to fall back to


def _write_toy(path: Path) -> Path:
    path.mkdir(parents=True)
    ToyVideoModel.from_pretrained(None).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A run dir (config.yaml, checkpoints/step_{2,3}/{trainer.pt, extra.json, policy.safetensors})
    written by Trainer.save_checkpoint and the driver's policy export, plus a toy model dir."""
    base = tmp_path_factory.mktemp("pristine")
    toy = _write_toy(base / "toy")
    cfg = load_config(ROOT / "configs/quickstart.yaml",
                      [f"run.root={base}", "run.name=run", f"model.path={toy}"])
    run = RunDir.create(cfg)
    trainer = Trainer(cfg, build_model(cfg)).setup()
    for step in STEPS:
        trainer.version = step  # as if `step` optimizer steps were done
        extra = {"step": step, "cursor": 2 * step, "open": {}, "counts": {}, "uncommitted": [], "bank": None}
        d = trainer.save_checkpoint(run.checkpoints, extra)
        save_file({k: v.contiguous() for k, v in trainer.weights_payload().items()}, str(d / "policy.safetensors"))
    return base


def _copy_pristine(pristine: Path, dest: Path) -> Path:
    shutil.copytree(pristine / "toy", dest / "toy")
    shutil.copytree(pristine / "run", dest / "run")
    cfg = (dest / "run/config.yaml").read_text().replace(str(pristine / "toy"), str(dest / "toy"))
    (dest / "run/config.yaml").write_text(cfg)
    return dest


@pytest.fixture
def work(pristine, tmp_path) -> Path:
    """A fresh copy of the pristine run dir and toy model for one test to damage."""
    return _copy_pristine(pristine, tmp_path)


def _hashes(*roots: Path) -> dict[str, str]:
    """Every file and dir under roots: sha256 of files, 'dir' for dirs."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            out[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _vgrpo(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def _assert_one_line(out: subprocess.CompletedProcess, names: Path, *needles: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("error: ") and str(names) in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _truncate(f: Path, keep: float = 0.5) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])


def _flip(f: Path, at: int, value: int | None = None) -> None:
    data = bytearray(f.read_bytes())
    data[at] = (data[at] ^ 0xFF) if value is None else value
    f.write_bytes(bytes(data))


def _tensor_offset(f: Path) -> int:
    """An offset inside the biggest tensor's data of a torch.save zip (past its local header)."""
    import zipfile

    with zipfile.ZipFile(f) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
        with open(f, "rb") as fh:
            fh.seek(info.header_offset + 26)
            n, m = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
        return info.header_offset + 30 + n + m + info.file_size // 2


NEWEST, OLDER = f"step_{STEPS[1]:08d}", f"step_{STEPS[0]:08d}"


@dataclass
class Case:
    """One batched refusal: its own copy of the pristine run (`work`), the file its line must name,
    the copy's hashes once damaged (before the CLI ran), the CLI invocations, and their results."""

    work: Path
    f: Path
    before: dict[str, str]
    calls: list[list[str]]
    out: list[BatchResult] = field(default_factory=list)


def _prepared(work: Path, f: Path, *calls: list[str]) -> Case:
    return Case(work, f, _hashes(work), list(calls))


@pytest.fixture(scope="module")
def batch(pristine, tmp_path_factory) -> dict[tuple[str, str], Case]:
    """Every batched case prepared on its own copy of the pristine run, then all of them run in one
    child (tests/cli_batch.py: a fresh forked `python -m cluster.cli` process per invocation)."""
    prepare = {
        **{("damaged checkpoint", case): (lambda w, c=case, f=file: _damaged_checkpoint(w, c, f))
           for case, file, _ in DAMAGED_CHECKPOINT},
        **{("driver field", name): (lambda w, n=name, v=value: _wrong_driver_field(w, n, v))
           for name, value, _ in DRIVER_FIELDS},
        **{("damage", case): (lambda w, c=case: _damaged(w, c)) for case in DAMAGE},
        **{("namespace", where): (lambda w, x=where: _other_namespace(w, x)) for where in NAMESPACE_WHERE},
        ("nan policy", ""): _nan_policy,
        ("train", "nan"): lambda w: _damaged_toy_train(w, "nan"),
        ("toy weights", ""): _damaged_toy_all_commands,
    }
    cases = {key: prep(_copy_pristine(pristine, tmp_path_factory.mktemp("case"))) for key, prep in prepare.items()}
    results = iter(run_batch([call for c in cases.values() for call in c.calls], timeout=240))
    for c in cases.values():
        c.out = [next(results) for _ in c.calls]
    assert next(results, None) is None
    return cases


DAMAGED_CHECKPOINT = [
    ("truncated trainer.pt", "trainer.pt", ["truncated"]),
    ("bit-flipped trainer.pt", "trainer.pt", ["CRC-32"]),
    ("no trainer.pt", "trainer.pt", ["missing"]),
    ("no extra.json", "extra.json", ["missing"]),
    ("truncated extra.json", "extra.json", ["not valid JSON"]),
]


def _damaged_checkpoint(work: Path, case: str, file: str) -> Case:
    d = work / "run/checkpoints" / NEWEST
    f = d / file
    if case.startswith("truncated"):
        _truncate(f)
    elif case.startswith("bit-flipped"):
        _flip(f, _tensor_offset(f))  # torch.load alone reads this file without complaint
    else:
        f.unlink()
    return _prepared(work, f, ["resume", str(work / "run")])


@pytest.mark.parametrize("case, file, needles", DAMAGED_CHECKPOINT)
def test_resume_with_a_damaged_checkpoint_is_one_line_and_changes_nothing(batch, case, file, needles):
    c = batch["damaged checkpoint", case]  # _damaged_checkpoint, run in the batch
    line = _assert_one_line(c.out[0], c.f, *needles)
    assert f"move {NEWEST} out of" in line and f"resume from {OLDER}" in line  # the fix is named
    assert _hashes(c.work) == c.before


DRIVER_FIELDS = [
    ("open", {"x": "g1"}, "'open' must be a map of cursor -> group id or null"),
    ("counts", {"groups_trained": -4}, "'counts' must be a map of name -> count"),
    ("uncommitted", "g0000001-v1", "'uncommitted' must be a list of group ids"),
    ("cursor", -3, "'cursor' must be a whole number >= 0"),
]


def _wrong_driver_field(work: Path, name: str, value) -> Case:
    import json

    f = work / "run/checkpoints" / NEWEST / "extra.json"
    extra = json.loads(f.read_text())
    extra[name] = value
    f.write_text(json.dumps(extra))
    return _prepared(work, f, ["resume", str(work / "run")])


@pytest.mark.parametrize("field, value, needle", DRIVER_FIELDS)
def test_resume_with_wrong_driver_fields_is_one_line_before_ray(batch, field, value, needle):
    """extra.json's driver fields are read as a DriverState before Ray starts: a wrong-typed one
    is one line naming the file and the field, and nothing changes."""
    c = batch["driver field", field]  # _wrong_driver_field, run in the batch
    out = c.out[0]
    _assert_one_line(out, c.f, needle)
    assert "Ray" not in out.stdout + out.stderr  # it stopped before starting anything
    assert not out.ray_initialized
    assert _hashes(c.work) == c.before


def _edit_state(d: Path, edit) -> Path:
    """trainer.pt loaded, changed by `edit`, saved whole again (its CRCs right: only the fields lie)."""
    f = d / "trainer.pt"
    state = torch.load(f, weights_only=True)
    edit(state)
    torch.save(state, f)
    return f


def _one_element(state: dict) -> None:  # every weight 1 element: copy_ would broadcast it silently
    params = state["policy"]["params"]
    for n in params:
        params[n] = params[n].flatten()[:1].clone()


def _bank_index(d: Path, **fields) -> Path:
    """A bank dump index as memory_bank/dump.py writes it (no entries), with `fields` replaced."""
    import json

    index = {"format": 1, "namespace": "vgrpo", "time": 0.0, "groups": [], "conds": {}, "bankz": {},
             "einfo": {}, "counts": {"pushed": "4"}, "entries": {}, "sha256": "", "size": 0, **fields}
    (d / "bank").mkdir(exist_ok=True)
    (d / "bank/index.json").write_text(json.dumps(index))
    return d / "bank/index.json"


def _status(run: Path, **fields) -> Path:
    import json
    import socket

    status = {"state": "stopped", "reason": None, "pid": 12345, "host": socket.gethostname(),
              "sessions": [[1.0, 2.0]], "updated": 2.0, **fields}
    (run / "status.json").write_text(json.dumps(status))
    return run / "status.json"


DAMAGE = {  # case -> (damage(work, newest dir) -> the file named, what the line says)
    "1-element weights": (lambda w, d: _edit_state(d, _one_element), "policy.params."),
    "another fine-tune mode": (lambda w, d: _edit_state(d, lambda s: s.update(finetune="full")), "'finetune'"),
    "rng {}": (lambda w, d: _edit_state(d, lambda s: s.update(rng={})), "'rng'"),
    "version not the step": (lambda w, d: _edit_state(d, lambda s: s.update(version=99)), "'version'"),
    "negative entry bytes in the bank dump": (
        lambda w, d: _bank_index(d, einfo={"e1": '{"b": -21000000, "c": 0.5}'}), "'einfo.e1'"),
    "negative group bytes in the bank dump": (
        lambda w, d: _bank_index(d, groups=[{"id": "g1", "fields": {"bytes": "-5"}}]), "'groups[0].fields.bytes'"),
    "bank entries past the file": (
        lambda w, d: _bank_index(d, size=10, entries={"e1": [0, 8, 100]}), "'entries.e1'"),
    "a negative condition record size in the bank dump": (
        lambda w, d: _bank_index(d, size=10, cond_records={"c1": [0, -1, 5]}), "'cond_records.c1'"),
    "status sessions not a list": (lambda w, d: _status(w / "run", sessions="x"), "'sessions'"),
    "status pid negative": (lambda w, d: _status(w / "run", pid=-1), "'pid'"),
    "status of a live run": (lambda w, d: _status(w / "run", state="running", pid=os.getpid()), "still running"),
    "100k-deep extra.json": (
        lambda w, d: (d / "extra.json").write_text("[" * 100_000 + "]" * 100_000) and d / "extra.json",
        "nested too deeply"),
    "metrics line damaged before the last": (
        lambda w, d: (w / "run/metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
        and w / "run/metrics.jsonl", "line 2 is damaged"),
}


def _damaged(work: Path, case: str) -> Case:
    damage, _ = DAMAGE[case]
    f = damage(work, work / "run/checkpoints" / NEWEST)
    return _prepared(work, f, ["resume", str(work / "run")])


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_reads_trainer_state_status_bank_dump_and_metrics_before_ray(batch, case):
    """Fields a crash or a hand leaves wrong in trainer.pt, the bank dump, status.json or
    metrics.jsonl: one line naming the file and the field, exit 2, before Ray, nothing changed."""
    _, needle = DAMAGE[case]
    c = batch["damage", case]  # _damaged, run in the batch
    out = c.out[0]
    _assert_one_line(out, c.f, needle)
    assert "Ray" not in out.stdout + out.stderr
    assert not out.ray_initialized
    assert _hashes(c.work) == c.before


def _snapshot(d: Path, **fields) -> Path:
    """extra.json with the bank snapshot a run on the default namespace writes (`fields` replaced)."""
    import json

    f = d / "extra.json"
    extra = json.loads(f.read_text())
    extra["bank"] = {"format": 1, "namespace": "vgrpo", "time": 0.0, "pending": [],
                     "banked": {"c0": ["a" * 32]}, "counts": {"pushed": 4}, **fields}
    f.write_text(json.dumps(extra))
    return f


NAMESPACE_WHERE = ["extra.json", "bank/index.json"]


def _other_namespace(work: Path, where: str) -> Case:
    d = work / "run/checkpoints" / NEWEST
    f = _snapshot(d) if where == "extra.json" else _bank_index(d, format=2)
    return _prepared(work, f, ["resume", str(work / "run"), "bank.namespace=other"])


@pytest.mark.parametrize("where", NAMESPACE_WHERE)
def test_resume_with_another_bank_namespace_is_one_line_before_ray(batch, where):
    """`vgrpo resume RUN bank.namespace=other` on a run whose bank data is in 'vgrpo' (was: a
    ValueError traceback from the driver's setup, after Ray and the actors had started)."""
    c = batch["namespace", where]  # _other_namespace, run in the batch
    out = c.out[0]
    _assert_one_line(out, c.f, "'vgrpo'", "bank.namespace='other'", "resume with bank.namespace=vgrpo")
    assert "Ray" not in out.stdout + out.stderr
    assert not out.ray_initialized
    assert _hashes(c.work) == c.before


@pytest.mark.parametrize("fields, needle", [
    ({"format": 7}, "unknown format '7'"),
    ({"banked": {"c0": "not a list"}}, "'banked' must map condition id -> [entry id]"),
    ({"namespace": "other"}, "'bank.namespace' is 'other'"),
])
def test_a_bank_snapshot_the_bank_cannot_restore_is_refused_before_ray(work, fields, needle):
    from cluster.driver.saved_state import check_saved_state

    f = _snapshot(work / "run/checkpoints" / NEWEST, **fields)
    run = RunDir.open(work / "run")
    with pytest.raises(CheckpointError) as err:
        check_saved_state(run, run.checkpoints / NEWEST, load_config(work / "run/config.yaml"))
    assert str(f) in str(err.value) and needle in str(err.value) and "\n" not in str(err.value)
    _snapshot(work / "run/checkpoints" / NEWEST)       # the run's own snapshot passes
    check_saved_state(run, run.checkpoints / NEWEST, load_config(work / "run/config.yaml"))


def test_a_torn_last_metrics_line_is_dropped_with_a_note_and_a_stale_status_recognised(work):
    """What a SIGKILL leaves: half a metrics line, and status.json still `running` with a dead
    pid. Both are read before Ray as notes, the torn line is dropped on resume, and the stale
    session is closed (its wall time no longer grows)."""
    import json

    from cluster.cli.runs_cmd import describe
    from cluster.driver.saved_state import check_saved_state

    run = RunDir.open(work / "run")
    rows = [{"step": s, "reward_mean": 0.1 * s} for s in (1, 2, 3, 4)]
    run.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "rew')
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _status(work / "run", state="running", pid=dead.pid, sessions=[[100.0, None]], updated=160.0)
    assert describe(work / "run")["status"] == "stopped"  # `vgrpo runs` sees it for what it is
    cfg = load_config(work / "run/config.yaml")
    notes = check_saved_state(run, run.checkpoints / NEWEST, cfg)
    assert any("torn last line" in n and "metrics.jsonl" in n for n in notes), notes
    assert any(f"pid {dead.pid}" in n and "ended without saying why" in n for n in notes), notes
    assert run.truncate_metrics(3) is not None  # what the driver's restore does: no crash
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]
    run.set_status("running")
    sessions = run.read_status()["sessions"]
    assert sessions[0] == [100.0, 160.0] and sessions[1][1] is None


def test_damaged_policy_on_eval_and_sample_is_one_line_and_writes_nothing(work):
    f = work / "run/checkpoints" / NEWEST / "policy.safetensors"
    _truncate(f)
    before = _hashes(work)
    _assert_one_line(_vgrpo("eval", str(work / "run")), f, "truncated or damaged")
    _assert_one_line(_vgrpo("sample", str(work / "run"), "--prompt", "a red square moving up",
                            "--out", str(work / "run/s.gif")), f, "truncated or damaged")
    assert _hashes(work) == before  # no eval/ dir, no GIF


def _nan_policy(work: Path) -> Case:
    f = work / "run/checkpoints" / NEWEST / "policy.safetensors"
    header = 8 + int.from_bytes(f.read_bytes()[:8], "little")
    for i in range(4):  # one fp32 weight := 0xFFFFFFFF, a NaN
        _flip(f, header + 4 * 10 + i, 0xFF)
    return _prepared(work, f, ["eval", str(work / "run")])


def test_nan_bytes_in_policy_are_named(batch):
    """safetensors has no checksum: bytes that turn a weight into NaN are caught by value."""
    c = batch["nan policy", ""]  # _nan_policy, run in the batch
    _assert_one_line(c.out[0], c.f, "NaN/inf")
    assert _hashes(c.work) == c.before


def _damaged_toy_train(work: Path, how: str) -> Case:
    f = work / "toy/toy.safetensors"
    if how == "truncated":
        _truncate(f, 0.9)
    else:
        header = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        for i in range(4):
            _flip(f, header + 4 * 100 + i, 0xFF)
    return _prepared(work, f, ["train", "-c", "configs/quickstart.yaml", "--no-eval", f"run.root={work / 'runs'}",
                               "run.name=x", f"model.path={work / 'toy'}"])


@pytest.mark.parametrize("how", ["truncated", "nan"])
def test_train_on_damaged_toy_weights_fails_before_any_actor(batch, work, how):
    if how == "truncated":  # a genuine `python -m cluster.cli train` subprocess
        c = _damaged_toy_train(work, how)
        out = _vgrpo(*c.calls[0])
    else:  # _damaged_toy_train, run in the batch
        c = batch["train", how]
        out = c.out[0]
    _assert_one_line(out, c.f, "truncated or damaged" if how == "truncated" else "NaN/inf")
    assert _hashes(c.work) == c.before and not (c.work / "runs").exists()  # not even an empty run dir


def _damaged_toy_all_commands(work: Path) -> Case:
    f = work / "toy/toy.safetensors"
    _truncate(f, 0.9)
    before = _hashes(work)
    cfg = work / "base.yaml"
    cfg.write_text(f"model:\n  family: toy\n  path: {work / 'toy'}\n")
    before[str(cfg)] = hashlib.sha256(cfg.read_bytes()).hexdigest()
    return Case(work, f, before, [["resume", str(work / "run")], ["eval", str(work / "run")],
                                  ["sample", "base", "-c", str(cfg), "--prompt", "a red square",
                                   "--out", str(work / "s.gif")]])


def test_resume_eval_and_sample_on_damaged_toy_weights(batch):
    c = batch["toy weights", ""]  # _damaged_toy_all_commands, run in the batch (in this order)
    _assert_one_line(c.out[0], c.f, "truncated or damaged")  # resume
    _assert_one_line(c.out[1], c.f, "truncated or damaged")  # eval
    _assert_one_line(c.out[2], c.f, "truncated or damaged")  # sample
    assert _hashes(c.work) == c.before


def test_pristine_checkpoint_verifies_and_damage_is_caught_in_process(work):
    """No false alarm on what the savers wrote; the loaders raise CheckpointError, not a traceback."""
    root = work / "run/checkpoints"
    assert dist_checkpoint.verify_newest(root, 1) == root / NEWEST
    state, extra, d = checkpoint.load(root)
    assert d == root / NEWEST and state["version"] == STEPS[1] and extra["step"] == STEPS[1]
    _truncate(root / NEWEST / "trainer.pt")
    with pytest.raises(CheckpointError, match="trainer.pt: cannot be loaded"):
        checkpoint.load(root)
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        dist_checkpoint.verify_newest(work / "empty", 1)


# --- the sharded (FSDP) layout ----------------------------------------------------------------------

WORLD = 2


def _save_shards(rank: int, root: str, init: str) -> None:
    """One learner rank: dist_checkpoint.save's own collective write of its shard."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        g = torch.Generator().manual_seed(rank)
        state = {"version": 3, "finetune": "lora", "policy": {"w": torch.randn(64, 64, generator=g)},
                 "optimizer": {"state": {}}, "kl": {"lam": 0.1}, "rng": {"torch": torch.get_rng_state()}}
        extra = {"step": 3, "cursor": 6, "open": {}, "counts": {}, "uncommitted": [], "bank": None}
        dist_checkpoint.save(root, 3, state, extra, keep=2)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(pristine, tmp_path_factory) -> Path:
    """A run dir whose config has 2 learner ranks and whose checkpoint two gloo ranks wrote."""
    base = tmp_path_factory.mktemp("sharded")
    shutil.copytree(pristine / "run", base / "run")
    shutil.rmtree(base / "run/checkpoints")
    cfg = load_config(base / "run/config.yaml", ["pools.learner.num_actors=2"])
    from common.config import save_config

    save_config(cfg, base / "run/config.yaml")
    mp.spawn(_save_shards, args=(str(base / "run/checkpoints"), f"file://{base / 'rdzv'}"), nprocs=WORLD)
    (base / "rdzv").unlink(missing_ok=True)
    return base


def test_sharded_checkpoint_damage_is_one_line(sharded, tmp_path):
    shutil.copytree(sharded / "run", tmp_path / "run")
    d = tmp_path / "run/checkpoints/step_00000003"
    assert sorted(p.name for p in d.iterdir()) == ["extra.json", "meta.json", "rank00000.pt", "rank00001.pt"]
    assert dist_checkpoint.verify_newest(d.parent, WORLD) == d            # no false alarm
    with pytest.raises(CheckpointError, match=r"written by 2 learner ranks, this run has 1 .*num_actors=2"):
        dist_checkpoint.verify_newest(d.parent, 1)
    single = tmp_path / "single"  # a single-rank checkpoint, resumed by a run with 2 learner ranks
    checkpoint.save(single, 1, {"version": 1}, {"step": 1, "cursor": 1}, keep=1)
    with pytest.raises(CheckpointError, match=r"single-rank checkpoint .*num_actors=1"):
        dist_checkpoint.verify_newest(single, WORLD)
    with pytest.raises(CheckpointError, match=r"trainer.pt: lacks finetune, policy, optimizer, kl, rng"):
        dist_checkpoint.verify_newest(single, 1)  # a whole torch file, but not a trainer's state
    # through the CLI: a resume with another learner rank count is one line, before Ray, and writes nothing
    before = _hashes(tmp_path)
    _assert_one_line(_vgrpo("resume", str(tmp_path / "run"), "pools.learner.num_actors=1"), d,
                     "written by 2 learner ranks, this run has 1", "num_actors=2")
    assert _hashes(tmp_path) == before
    _truncate(d / "rank00001.pt")
    before = _hashes(tmp_path)
    _assert_one_line(_vgrpo("resume", str(tmp_path / "run")), d / "rank00001.pt", "truncated")
    (d / "meta.json").write_text('{"world_size": ')
    with pytest.raises(CheckpointError, match="meta.json: damaged"):
        dist_checkpoint.verify_newest(d.parent, WORLD)
    assert all(_hashes(tmp_path)[k] == v for k, v in before.items() if not k.endswith("meta.json"))



def test_policy_that_does_not_fit_the_model_is_named(work):
    """A whole safetensors file whose names are not the run's model (config edited after training)."""
    from safetensors.torch import load_file

    from cluster.evaluation.policy import load_policy
    from cluster.runs.policy_file import POLICY_FILE, resolve_target

    cfg, ckpt = resolve_target(str(work / "run"), None)
    assert ckpt == work / "run/checkpoints" / NEWEST
    load_policy(cfg, ckpt)  # the saved one fits
    payload = load_file(str(ckpt / POLICY_FILE))
    payload["blocks.99.not_a_weight"] = torch.zeros(2)
    save_file(payload, str(ckpt / POLICY_FILE))
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / POLICY_FILE)) + ": does not fit the run's model"):
        load_policy(cfg, ckpt)


def _grown(state: dict, name: str) -> None:
    """`name` one row longer, in the weights and every anchor alike: consistent with each other,
    so only the model's own shape can tell."""
    policy = state["policy"]
    t = policy["params"][name]
    policy["params"][name] = torch.zeros((t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype)
    for anchor in policy["anchors"].values():
        if name in anchor:
            anchor[name] = policy["params"][name].clone()


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_wan_trainer_state_of_another_shape_is_one_line_before_ray(tmp_path, finetune):
    """A tiny real Wan (diffusers classes saved by their own save_pretrained), its trainer.pt
    written by the real Trainer, one tensor then of a shape this model's config does not give:
    `vgrpo resume` says so in one line naming the file and the tensor, exit 2, before Ray. The
    shapes come from the transformer's config.json built on the meta device, no weight read."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from cluster.driver.saved_state import model_shapes
    from rollout_worker.models.tiny import tiny_wan_components

    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **tiny_wan_components("t2v")).save_pretrained(tmp_path / "wan")
    cfg = load_config(ROOT / "configs/quickstart.yaml", [
        "model.family=wan", "model.task=t2v", f"model.path={tmp_path / 'wan'}", "model.num_frames=5",
        "model.height=16", "model.width=16", "model.max_sequence_length=16", "model.dtype=float32",
        f"optim.finetune={finetune}", f"run.root={tmp_path}", "run.name=run"])
    run = RunDir.create(cfg)
    trainer = Trainer(cfg, build_model(cfg, "cpu", components="transformer")).setup()
    trainer.version = 2
    d = trainer.save_checkpoint(run.checkpoints, {"step": 2, "cursor": 4, "open": {}, "counts": {},
                                                  "uncommitted": [], "bank": None})
    shapes = model_shapes(cfg)
    assert shapes == {n: tuple(p.shape) for n, p in trainer.policy.params.items()}  # meta == the real build
    name = next(n for n, s in shapes.items() if len(s) == 2)
    f = _edit_state(d, lambda s: _grown(s, name))
    before = _hashes(tmp_path / "run")
    # transformers warns on stderr that torchvision is missing (this venv's, not vgrpo's line)
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "resume", str(tmp_path / "run")], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                              "TRANSFORMERS_VERBOSITY": "error"}, capture_output=True, text=True, timeout=240)
    _assert_one_line(out, f, f"'policy.params.{name}'", "the model's weight has")
    assert "Ray" not in out.stdout + out.stderr
    assert _hashes(tmp_path / "run") == before


@pytest.mark.parametrize("family, variant", [("wan", "i2v_a14b"), ("hunyuan15", "i2v")])
def test_model_shapes_on_meta_are_the_built_learners_for_every_family(tmp_path, family, variant):
    """What the resume check compares trainer.pt with (built on meta: no weights read) is what the
    real learner build trains, for Wan 2.2's two experts and HunyuanVideo 1.5, LoRA and full."""
    from test_learner_lean import _cfg, _save  # tiny real Wan / HunyuanVideo 1.5 checkpoints

    from cluster.driver.saved_state import model_shapes
    from learner.policy import Policy

    _save(family, variant, tmp_path / "ckpt")
    for finetune in ("lora", "full"):
        cfg = _cfg(family, "i2v", tmp_path / "ckpt", optim={"finetune": finetune, "lora_rank": 4})
        real = Policy(build_model(cfg, "cpu", components="transformer"), cfg.optim, [], seed=cfg.train.seed)
        want = {n: tuple(p.shape) for n, p in real.params.items()}
        assert model_shapes(cfg) == want and want

"""A checkpoint as a whole: visible only when every file of it is written, older ones pruned only
after it, and a full disk is one line (a real, small tmpfs: the kernel's own ENOSPC).

The driver's writer (cluster/driver/checkpoint.py) runs here on a real Trainer, a real bank on a
real redis-server and real files; the learner is the Trainer in this process, as a learner rank
with one process runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from bank_helpers import make_group
from helpers_tiny import TinyVideoModel

from cluster.driver.checkpoint import write_checkpoint
from cluster.driver.state import DriverState
from cluster.runs.policy_file import has_policy, policy_checkpoints
from common import storage
from common.config import RunConfig
from common.policy_layout import POLICY_DIR
from learner import checkpoint, dist_checkpoint
from learner.checkpoint import DiskFull, write_policy
from learner.trainer import Trainer
from memory_bank.dump import restore_bank

SHAPE = (4, 6, 16, 16)  # with 8 layers, each part of a checkpoint is many pages


class OneRank:
    """What write_checkpoint asks of the learner (LearnerGroup.save_checkpoint / save_policy),
    done as a single learner rank does it, on a real Trainer in this process."""

    def __init__(self, trainer: Trainer, die_in: str | None = None):
        self.trainer, self.die_in = trainer, die_in

    def save_policy(self, path) -> None:
        if self.die_in == "policy":
            raise SystemExit("killed while writing the policy")  # not caught: what a kill leaves
        t = self.trainer
        write_policy(path, t.weights_payload(ema=True), ema=t.exports_ema, version=t.version,
                     decay=t.cfg.optim.ema_decay)

    def save_checkpoint(self, root, extra):
        return storage.location(self.trainer.save_checkpoint(root, extra))


def _trainer() -> Trainer:
    cfg = RunConfig.model_validate({"optim": {"finetune": "full"}, "train": {"keep_checkpoints": 1}})
    return Trainer(cfg, TinyVideoModel(seed=0, layers=8)).setup()


def _fill(bank) -> None:
    for i in range(4):
        bank.push_group(make_group(f"c{i % 2}", f"g{i}", g=2, seed=i, shape=SHAPE))
    bank.commit(bank.pull(2, 0), 1)


def _save(rank: OneRank, bank, root, step: int):
    rank.trainer.version = step
    notes: list[str] = []
    return write_checkpoint(rank, bank, DriverState(step=step, cursor=step), root, notes.append), notes


def _du(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) → a fresh tmpfs of that many bytes at a new dir; unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.parametrize("fails_in", ["bank dump", "policy", "trainer state"])
def test_a_full_disk_is_one_line_and_the_last_complete_checkpoint_stands(small_disk, bank, tmp_path, fails_in):
    _fill(bank)
    rank = OneRank(_trainer())
    # the parts' sizes, from one checkpoint written where there is room
    probe, _ = _save(rank, bank, tmp_path / "probe", 1)
    sizes = {"bank dump": _du(probe / "bank"), "policy": _du(probe / POLICY_DIR),
             "trainer state": _du(probe) - _du(probe / "bank") - _du(probe / POLICY_DIR)}
    assert min(sizes.values()) > 8 * 4096, sizes  # each part is many pages: the fill below is exact enough
    order = ["bank dump", "policy", "trainer state"]  # the order the parts are written in
    before = sum(sizes[p] for p in order[:order.index(fails_in)])
    disk = small_disk(_du(probe) + before + sizes[fails_in] // 2 + 64 * 1024)
    root = disk / "checkpoints"
    first, _ = _save(rank, bank, root, 1)
    # fill the disk so that the next checkpoint runs out of room half-way through `fails_in`
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - before - sizes[fails_in] // 2))

    with pytest.raises(DiskFull) as err:
        _save(rank, bank, root, 2)
    line = str(err.value)
    assert "\n" not in line and "no space left on device" in line and "step 2" in line, line
    assert "step_00000001, stands" in line and str(root) in line, line
    # nothing of step 2 is visible or left behind; step 1 is whole: state, bank, policy
    assert [p.name for p in root.iterdir()] == ["step_00000001"]
    assert checkpoint.list_checkpoints(root) == [first]
    assert dist_checkpoint.verify_newest(root, 1) == first
    assert [p.name for p in policy_checkpoints(disk)] == ["step_00000001"]
    assert (first / "bank" / "index.json").is_file() and has_policy(first)
    bank.clear()
    assert "restored" in restore_bank(bank, first)


@pytest.fixture(params=["local", "s3"])
def ckpt_root(request, tmp_path):
    if request.param == "local":
        return tmp_path / "checkpoints"
    return storage.Uri(request.getfixturevalue("s3_root")) / f"run-{uuid.uuid4().hex[:6]}" / "checkpoints"


def test_a_kill_part_way_through_a_checkpoint_leaves_it_invisible_and_the_older_one_whole(bank, ckpt_root):
    """Killed after the bank dump, before the policy and the trainer state: resume, eval and
    sample see only the older checkpoint, whole; the next checkpoint clears what was left."""
    _fill(bank)
    trainer = _trainer()
    first, _ = _save(OneRank(trainer), bank, ckpt_root, 1)
    with pytest.raises(SystemExit):
        _save(OneRank(trainer, die_in="policy"), bank, ckpt_root, 2)
    assert [p.name for p in checkpoint.list_checkpoints(ckpt_root)] == ["step_00000001"]
    assert dist_checkpoint.verify_newest(ckpt_root, 1).name == "step_00000001"
    assert [p.name for p in policy_checkpoints(ckpt_root.parent)] == ["step_00000001"]
    state, extra, d = checkpoint.load(ckpt_root)
    assert d.name == "step_00000001" and extra["step"] == 1 and state["version"] == 1
    assert (first / "bank" / "index.json").is_file() and has_policy(first)
    # the next checkpoint is whole, and then the only one (train.keep_checkpoints = 1)
    third, _ = _save(OneRank(trainer), bank, ckpt_root, 3)
    assert [p.name for p in checkpoint.list_checkpoints(ckpt_root)] == ["step_00000003"]
    assert (third / "bank" / "index.json").is_file() and has_policy(third)
    if not storage.is_uri(ckpt_root):
        assert sorted(p.name for p in ckpt_root.iterdir()) == ["step_00000003"]  # no stage left over


def test_a_checkpoint_saved_again_at_the_same_step_is_never_seen_half_new(bank, ckpt_root):
    """The final checkpoint of a run often repeats the last periodic one's step: killed part-way,
    the step is either the old checkpoint whole or (on an object store) not listed at all."""
    _fill(bank)
    trainer = _trainer()
    _save(OneRank(trainer), bank, ckpt_root, 1)
    with torch.no_grad():
        for p in trainer.policy.optim_parameters():
            p.add_(1.0)
    with pytest.raises(SystemExit):
        _save(OneRank(trainer, die_in="policy"), bank, ckpt_root, 1)
    listed = checkpoint.list_checkpoints(ckpt_root)
    if storage.is_uri(ckpt_root):
        assert listed == []  # unlisted before any of its files changed
    else:
        assert [p.name for p in listed] == ["step_00000001"]
        assert has_policy(listed[0]) and (listed[0] / "bank" / "index.json").is_file()


def _fill_up(disk: Path) -> Path:
    """Take every free byte of the mount (the kernel's own ENOSPC from then on)."""
    filler = disk / "filler"
    try:  # closing raises too when a short write left bytes in the file's buffer
        with open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError:
        pass
    try:  # the last partial chunk: single bytes
        with open(filler, "ab", buffering=0) as f:
            while f.write(b"\0"):
                pass
    except OSError:
        pass
    return filler


@pytest.mark.timeout(900)
def test_a_disk_that_fills_up_during_vgrpo_train_stops_it_in_one_line_and_resume_goes_on(small_disk, ray_address):
    """The real `vgrpo train` with run.root on a small tmpfs that fills up mid-run (after the
    first checkpoint): it stops with one line saying the disk is full and naming the path, a
    non-zero exit and no traceback; the complete checkpoint before it stands; and once space is
    freed `vgrpo resume` continues from it. Both commands join the session's Ray cluster."""
    import sys

    from fault_helpers import ROOT, TWO_PROMPTS, when

    from cluster.runs.run_dir import RunDir

    disk = small_disk(64 * 1024 * 1024)
    prompts = disk.parent / "prompts.txt"
    prompts.write_text(TWO_PROMPTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "2000",
           "RAY_ADDRESS": ray_address}
    args = ["-c", "configs/quickstart.yaml", "--no-eval", f"run.root={disk}", "run.name=full",
            "train.mode=sync", "train.steps=40", "train.groups_per_step=2", "train.checkpoint_every=2",
            "sampler.group_size=4", "schedule.steps=6", "bank.capacity=64", f"train.prompts={prompts}",
            "health.enabled=false"]
    run = disk / "full"
    driver = subprocess.Popen([sys.executable, "-m", "cluster.cli", "train", *args], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert when(lambda: checkpoint.list_checkpoints(run / "checkpoints"), 400, poll_s=0.5), \
            "the run wrote no checkpoint"
        first = checkpoint.list_checkpoints(run / "checkpoints")[-1]
        filler = _fill_up(disk)                            # mid-run: the disk is full from here on
        out, err = driver.communicate(timeout=400)
    finally:
        driver.kill()
    assert driver.returncode not in (0, None), (out[-2000:], err[-2000:])
    assert "Traceback" not in out + err, err[-4000:]
    full = [ln for ln in (out + err).splitlines() if "no space left on device" in ln.lower()]
    assert full and str(disk) in full[-1], (out[-2000:], err[-2000:])
    stands = checkpoint.list_checkpoints(run / "checkpoints")
    assert first in stands and dist_checkpoint.verify_newest(run / "checkpoints", 1) == stands[-1]
    step = int(stands[-1].name.split("_")[-1])
    filler.unlink()                                        # space again
    resumed = subprocess.run([sys.executable, "-m", "cluster.cli", "resume", str(run), f"train.steps={step + 2}",
                              "--no-eval"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "Traceback" not in resumed.stderr, resumed.stdout[-3000:]
    # it went on from that checkpoint: the rows past it (the lost step's, a torn one) were dropped
    assert [r["step"] for r in RunDir.open(run).read_metrics()] == list(range(1, step + 3))
    assert checkpoint.list_checkpoints(run / "checkpoints")[-1].name == f"step_{step + 2:08d}"


def _fill_leaving(disk: Path, leave: int, name: str = "filler") -> Path:
    """Fill the mount so that `leave` bytes stay free."""
    filler = disk / name
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
    return filler


class FillsDuringState(OneRank):
    """The learner rank, while the disk fills up (another writer) just before its trainer state."""

    def __init__(self, trainer: Trainer, disk: Path, leave: int):
        super().__init__(trainer)
        self.disk, self.leave = disk, leave

    def save_checkpoint(self, root, extra):
        _fill_leaving(self.disk, self.leave, "filler-late")
        return super().save_checkpoint(root, extra)


def test_a_disk_full_that_torchs_zip_writer_reports_as_unexpected_pos_is_one_line(small_disk, bank):
    """torch's zip writer reports a full disk in the middle of trainer.pt as `RuntimeError:
    unexpected pos …`, not ENOSPC: it is still the one-line DiskFull (the free space is checked
    when a write fails), through the learner's save and the driver's writer, and the last
    complete checkpoint stands."""
    _fill(bank)
    trainer = _trainer()
    disk = small_disk(16 * 1024 * 1024)
    root = disk / "checkpoints"
    first, _ = _save(OneRank(trainer), bank, root, 1)
    # where torch says `unexpected pos` on this disk: the free bytes left before its trainer state
    probe, leave = disk / "probe.pt", None
    for room in range(0, 256 * 1024, 1024):
        filler = _fill_leaving(disk, room)
        try:
            checkpoint.write_torch(trainer.state_dict(), probe)
        except RuntimeError as e:
            if "unexpected pos" in str(e):
                leave = room
        except OSError:
            pass
        finally:
            probe.unlink(missing_ok=True)
            filler.unlink()
        if leave is not None:
            break
    assert leave is not None, "torch's zip writer said ENOSPC at every fill: nothing to test here"

    # 1. the learner's own save (trainer.pt into a full disk)
    filler = _fill_leaving(disk, leave)
    trainer.version = 2
    with pytest.raises(DiskFull) as err:
        trainer.save_checkpoint(root, {"step": 2})
    line = str(err.value)
    assert "\n" not in line and "no space left on device" in line and "step 2" in line, line
    assert "step_00000001, stands" in line, line
    assert checkpoint.list_checkpoints(root) == [first]
    filler.unlink()

    # 2. the driver's writer: bank dump and policy written, then the disk fills during trainer.pt
    with pytest.raises(DiskFull) as err:
        _save(FillsDuringState(trainer, disk, leave), bank, root, 2)
    line = str(err.value)
    assert "\n" not in line and "no space left on device" in line and "step 2" in line, line
    assert [p.name for p in root.iterdir()] == ["step_00000001"]  # nothing of step 2 is left
    assert dist_checkpoint.verify_newest(root, 1) == first
    assert (first / "bank" / "index.json").is_file() and has_policy(first)

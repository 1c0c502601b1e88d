"""Bank update strategies (fifo, fifo_s2, sdu) at N in {4, 8, 16}, staleness, backpressure."""

from __future__ import annotations

import pytest
from bank_helpers import make_group

from memory_bank.errors import BankFull


def _round(bank, cid: str, step: int, version: int = 0, composite=None, g: int = 2):
    """Push one group of `cid`, pull it, commit it at `step`; returns the batch."""
    bank.push_group(make_group(cid, f"{cid}-s{step}", version=version, g=g, seed=step,
                               composite=composite))
    batch = bank.pull(1, version=version)
    bank.commit(batch, step)
    return batch


@pytest.mark.parametrize("bank", [{"capacity": n} for n in (4, 8, 16)], indirect=True)
def test_fifo_keeps_last_n_every_step(bank):
    n = bank.cfg.capacity
    for step in range(1, n + 3):                # 2 members per step
        batch = _round(bank, "c", step)
        assert len(batch.bank[0]) == min(2 * (step - 1), n)   # earlier entries join the batch
    entries = bank.entries("c")
    assert len(entries) == n
    # the newest n members, oldest first
    want = [(f"c-s{s}", m) for s in range(1, n + 3) for m in range(2)][-n:]
    assert [(e.trajectory.group_id, e.trajectory.member) for e in entries] == want
    # evicted entries' keys are gone, and the byte count matches what is left
    assert bank.stats()["entries"] == n
    assert len(list(bank.r.scan_iter(match=f"{bank.keys.namespace}:e:*"))) == 2 * n


@pytest.mark.parametrize("bank", [{"capacity": 4, "strategy": "fifo_s2"}], indirect=True)
def test_fifo_s2_updates_every_second_step(bank):
    sizes = []
    for step in range(1, 7):
        _round(bank, "c", step)
        sizes.append(len(bank.entries("c")))
    assert sizes == [0, 2, 2, 4, 4, 4]
    assert {e.trajectory.group_id for e in bank.entries("c")} == {"c-s4", "c-s6"}
    assert bank.stats()["entries"] == 4          # members of odd steps were deleted


@pytest.mark.parametrize("bank", [{"capacity": n, "strategy": "sdu"} for n in (4, 8, 16)],
                         indirect=True)
def test_sdu_keeps_extremes_when_full(bank):
    n = bank.cfg.capacity
    comps = []
    for step in range(1, n + 6):
        pair = [float(step * 10), float(-step * 10 + 3)] if step % 2 else [0.1 * step, 0.2 * step]
        comps += pair
        _round(bank, "c", step, composite=pair)
        kept = sorted(e.composite for e in bank.entries("c"))
        srt = sorted(comps)
        want = srt if len(srt) <= n else srt[: n // 2] + srt[len(srt) - (n - n // 2):]
        assert kept == pytest.approx(want), step


@pytest.mark.parametrize("bank", [{"capacity": 8, "max_staleness": 2}], indirect=True)
def test_staleness_filter(bank):
    for v in range(5):                           # one banked group per version 0..4
        _round(bank, "c", step=v + 1, version=v)
    bank.push_group(make_group("c", "fresh", version=5))
    batch = bank.pull(1, version=5)
    versions = sorted({t.policy_version for t, _, _ in batch.bank[0]})
    assert versions == [3, 4]                    # 5 - v <= 2
    assert len(bank.entries("c")) == 8           # stale entries stay listed, unused


def test_bank_entries_carry_scores_in_group_head_order(bank):
    _round(bank, "c", 1)
    bank.push_group(make_group("c", "next", seed=9))
    batch = bank.pull(1, 0)
    stored = {e.id: e for e in bank.entries("c")}
    for traj, scores, comp in batch.bank[0]:
        e = stored[traj.bank_id]
        assert scores.shape == (3,) and scores.tolist() == e.scores.tolist()
        assert comp == e.composite


@pytest.mark.parametrize("bank", [{"max_bytes": 2 << 20, "capacity": 16}], indirect=True)
def test_backpressure_and_fresh_never_evicted(bank):
    pushed = 0
    while bank.has_space():          # estimated with the largest group pushed so far
        bank.push_group(make_group(f"c{pushed}", f"g{pushed}", seed=pushed))
        pushed += 1
        assert bank.stats()["bytes"] <= bank.cfg.max_bytes
    assert pushed >= 2
    assert bank.wait_for_space(0.2) is False
    # push_group enforces the bound itself: a group that does not fit is refused, whole
    with pytest.raises(BankFull, match=rf"over bank.max_bytes={bank.cfg.max_bytes}"):
        bank.push_group(make_group("late", "late"))
    st = bank.stats()
    assert st["fresh"] == pushed and st["bytes"] <= bank.cfg.max_bytes
    assert len(list(bank.r.scan_iter(match=f"{bank.keys.namespace}:e:*"))) == 2 * 4 * pushed
    # Training drains the queue; banked entries are evicted to make room, fresh ones never.
    trained = []
    step = 0
    while True:
        batch = bank.pull(1, 0)
        if not batch.fresh:
            break
        step += 1
        bank.commit(batch, step)
        trained.append(batch.fresh[0].group_id)
        assert batch.fresh[0].size == 4
    assert len(trained) == pushed
    assert bank.stats()["banked"] > 0 and bank.has_space() and bank.wait_for_space(0.1)
    for i in range(pushed):          # a full bank of banked entries still takes new groups
        bank.push_group(make_group("new", f"n{i}", seed=100 + i))
        assert bank.stats()["bytes"] <= bank.cfg.max_bytes
    assert bank.stats()["fresh"] == pushed


@pytest.mark.parametrize("bank", [{"capacity": 4, "enabled": False}], indirect=True)
def test_disabled_bank_is_a_plain_queue(bank):
    for step in range(1, 4):
        batch = _round(bank, "c", step)
        assert len(batch.fresh) == 1 and batch.bank[0] == []
    assert bank.entries("c") == [] and bank.stats()["entries"] == 0

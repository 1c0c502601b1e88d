"""The quarantine (dead letters) on a real redis-server: an entry that decodes but cannot be
trained leaves the bank with its reason recorded and counted, is never banked or pulled again,
and the records are bounded."""

from __future__ import annotations

import json

import pytest
from bank_helpers import make_group

import memory_bank.bank as bank_module


def test_a_quarantined_banked_entry_leaves_the_bank_with_its_reason(bank):
    bank.push_group(make_group("c", "g0", g=3, seed=0, version=2))
    bank.commit(bank.pull(1, 2), 1)
    banked = [e.id for e in bank.entries("c")]
    before = bank.stats()["bytes"]
    size = json.loads(bank.r.hget(bank.keys.einfo, banked[1]))["b"]
    bank.quarantine(banked[1], "latent shape [4, 6, 16, 16] is not this model's\n[16, 21, 30, 53]")
    assert [e.id for e in bank.entries("c")] == [banked[0], banked[2]]
    assert not bank.r.exists(bank.keys.meta(banked[1]), bank.keys.blob(banked[1]))  # data deleted
    assert bank.stats()["bytes"] == before - size
    (rec,) = bank.quarantined()
    assert rec["id"] == banked[1] and rec["condition"] == "c" and rec["version"] == 2
    assert rec["banked"] is True and "\n" not in rec["reason"]
    assert rec["reason"] == "latent shape [4, 6, 16, 16] is not this model's [16, 21, 30, 53]"
    assert bank.quarantine_count() == 1 and bank.stats()["quarantined"] == 1
    # never pulled again
    bank.push_group(make_group("c", "g1", g=2, seed=1, version=2))
    assert sorted(t.bank_id for t, _, _ in bank.pull(1, 2).bank[0]) == sorted([banked[0], banked[2]])


def test_a_quarantined_member_of_a_queued_group_is_never_banked(bank):
    bank.push_group(make_group("c", "g0", g=3, seed=0))
    batch = bank.pull(1, 0)
    bad = batch.fresh[0].members[1].bank_id
    bank.quarantine(bad, "image_path names a file outside the run's data roots")
    bank.commit(batch, 1)                          # the caller kept every member: still not banked
    assert sorted(e.id for e in bank.entries("c")) == sorted(
        m.bank_id for m in batch.fresh[0].members if m.bank_id != bad)
    assert not bank.r.exists(bank.keys.blob(bad))
    (rec,) = bank.quarantined()
    assert rec["id"] == bad and rec["banked"] is False and rec["condition"] == "c"


def test_quarantine_records_are_bounded_newest_kept(bank, monkeypatch):
    monkeypatch.setattr(bank_module, "QUARANTINE_CAP", 3)
    bank.push_group(make_group("c", "g0", g=5, seed=0))
    ids = [m.bank_id for m in bank.pull(1, 0).fresh[0].members]
    for i, eid in enumerate(ids):
        bank.quarantine(eid, f"reason {i}")
    assert [r["reason"] for r in bank.quarantined()] == ["reason 4", "reason 3", "reason 2"]
    assert bank.quarantine_count() == 5
    with pytest.raises(ValueError, match="entry id"):
        bank.quarantine("../../etc/passwd", "not an entry id")

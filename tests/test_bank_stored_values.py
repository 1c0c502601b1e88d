"""Every value the bank reads back from Redis is parsed defensively, on a real server: an index
value (an entry's `einfo`, a group record, a condition record's `cinfo`, the trash, a quarantine
record, a counter) that a bit flip or a hand made 1e999, NaN, negative or 10**400 never raises
out of the bank. An entry whose index info is unreadable is skipped, counted (`corrupt`), logged
and quarantined with its reason; a group whose record is unreadable is dropped as corrupt; every
other entry is pulled, the scripts go on, and the byte accounting stays exact."""

from __future__ import annotations

import json
import logging
import math

import pytest
from bank_helpers import check_accounting, make_group

import memory_bank.bank as bank_module

SMALL = (2, 2, 4, 4)
HUGE = "1" + "0" * 400    # 10**400: a valid JSON number, inf as a double, no int64
BAD = {"1e999": "1e999", "NaN": "NaN", "negative": "-7", "huge": HUGE}
WHOLE = "(whole value)"


def _set_json_field(bank, key: str, field_id: str, name: str, literal: str) -> None:
    """Replace one field of a JSON value in a hash with a raw JSON literal (1e999, NaN, ...);
    name WHOLE: the whole value."""
    if name == WHOLE:
        bank.r.hset(key, field_id, literal)
        return
    d = json.loads(bank.r.hget(key, field_id))
    d[name] = "@@"
    bank.r.hset(key, field_id, json.dumps(d).replace('"@@"', literal))


def _banked(bank, cid: str = "c", n: int = 3) -> list[str]:
    bank.push_group(make_group(cid, f"{cid}-g0", g=n, seed=0, shape=SMALL))
    bank.commit(bank.pull(1, 0), 1)
    return [e.id for e in bank.entries(cid)]


@pytest.mark.parametrize("value", list(BAD))
@pytest.mark.parametrize("field", ["v", "b", "c", "cond", "k", WHOLE])
def test_a_banked_entry_with_an_unreadable_index_value_is_quarantined_and_the_rest_pulled(bank, caplog, field, value):
    banked = _banked(bank)
    _set_json_field(bank, bank.keys.einfo, banked[1], field, BAD[value])
    bank.push_group(make_group("c", "g1", g=2, seed=1, shape=SMALL))
    with caplog.at_level(logging.ERROR, logger="memory_bank.bank"):
        batch = bank.pull(1, 0)
    got = [t.bank_id for t, _, _ in batch.bank[0]]
    if field == "c" and value == "negative":      # a negative reward is a reward: kept
        assert got == banked and bank.quarantined() == [] and bank.stats()["corrupt"] == 0
    else:
        assert [g.group_id for g in batch.fresh] == ["g1"] and got == [banked[0], banked[2]]
        (rec,) = bank.quarantined()
        assert rec["id"] == banked[1] and rec["condition"] == "c" and rec["banked"] is True
        assert rec["reason"].startswith("unreadable index info: ")
        assert f"field '{field}'" in rec["reason"] if field != WHOLE else "not an object" in rec["reason"]
        assert bank.stats()["corrupt"] == 1 and bank.quarantine_count() == 1
        assert banked[1] in caplog.text and "unreadable index info" in caplog.text
        assert not bank.r.exists(bank.keys.meta(banked[1]), bank.keys.blob(banked[1]))
        assert not bank.r.hexists(bank.keys.einfo, banked[1])
    check_accounting(bank)
    bank.commit(batch, 2)                         # the scripts go on, the accounting stays exact
    check_accounting(bank)
    bank.push_group(make_group("c", "g2", g=2, seed=2, shape=SMALL))
    assert len(bank.pull(1, 0).fresh) == 1


def test_an_overflowing_version_was_an_overflow_error_out_of_pull(bank):
    """The issue's case: {"v": 1e999} is valid JSON, read as inf; int(inf) raised OverflowError
    out of MemoryBank.pull (and out of every resume that pulled it)."""
    banked = _banked(bank)
    _set_json_field(bank, bank.keys.einfo, banked[0], "v", "1e999")
    bank.push_group(make_group("c", "g1", g=2, seed=1, shape=SMALL))
    batch = bank.pull(1, 0)
    assert [t.bank_id for t, _, _ in batch.bank[0]] == banked[1:]


@pytest.mark.parametrize("field", ["v", "b", "c", "cond", "k", WHOLE])
def test_a_queued_member_with_an_unreadable_index_value_is_quarantined_once_banked(bank, field):
    """A queued member's index info is read by the scripts at commit (its bytes, its condition
    record) and by the next pull once it is banked: neither raises, the pull quarantines it."""
    bank.push_group(make_group("c", "g0", g=3, seed=0, shape=SMALL))
    eids = bank.r.hget(bank.keys.group("g0"), "eids").decode().split()
    _set_json_field(bank, bank.keys.einfo, eids[0], field, "1e999")
    batch = bank.pull(1, 0)
    assert len(batch.fresh[0].members) == 3       # its data is sound: the group trains whole
    bank.commit(batch, 1)
    bank.push_group(make_group("c", "g1", g=2, seed=1, shape=SMALL))
    batch = bank.pull(1, 1)
    assert sorted(t.bank_id for t, _, _ in batch.bank[0]) == sorted(eids[1:])
    assert [r["id"] for r in bank.quarantined()] == [eids[0]]
    bank.commit(batch, 2)
    check_accounting(bank)


@pytest.mark.parametrize("value", list(BAD))
def test_a_group_record_with_an_unreadable_version_is_dropped_and_the_next_pulled(bank, value):
    for i in range(2):
        bank.push_group(make_group("c", f"g{i}", g=2, seed=i, shape=SMALL))
    bank.r.hset(bank.keys.group("g0"), "version", BAD[value])
    batch = bank.pull(2, 0)
    assert [g.group_id for g in batch.fresh] == ["g1"] and bank.dropped_ids == ["g0"]
    assert bank.stats()["corrupt"] == 1 and bank.stats()["dropped"] == 1
    bank.commit(batch, 1)
    check_accounting(bank)
    assert bank.stats()["queued_bytes"] == 0


@pytest.mark.parametrize("value", list(BAD))
def test_a_group_record_with_unreadable_bytes_trains_and_its_bytes_are_counted_from_its_entries(bank, value):
    bank.push_group(make_group("c", "g0", g=2, seed=0, shape=SMALL))
    bank.r.hset(bank.keys.group("g0"), "bytes", BAD[value])
    batch = bank.pull(1, 0)
    assert [g.group_id for g in batch.fresh] == ["g0"]
    bank.commit(batch, 1)
    assert bank.stats()["queued_bytes"] == 0 and bank.stats()["banked"] == 2
    check_accounting(bank)


@pytest.mark.parametrize("value", list(BAD))
@pytest.mark.parametrize("field", ["b", "n", "q", WHOLE])
def test_a_condition_record_with_unreadable_accounting_is_counted_again(bank, field, value):
    """cinfo's {b, n, q}, read by the scripts only: a damaged one is counted again from what is
    stored (the record's own bytes, the entries naming it), never raises and never deletes a
    record that entries still name."""
    bank.cfg.capacity = 2                       # each commit evicts: the scripts read cinfo often
    bank.push_group(make_group("c", "g0", g=3, seed=0, shape=SMALL))
    (ck,) = [k.decode() for k in bank.r.hkeys(bank.keys.cinfo)]
    _set_json_field(bank, bank.keys.cinfo, ck, field, BAD[value])
    bank.push_group(make_group("c", "g1", g=3, seed=1, shape=SMALL))
    batch = bank.pull(2, 0)
    assert [len(g.members) for g in batch.fresh] == [3, 3]
    bank.commit(batch, 1)
    check_accounting(bank)
    bank.push_group(make_group("c", "g2", g=2, seed=2, shape=SMALL))
    batch = bank.pull(1, 1)
    assert len(batch.bank[0]) == 2 and bank.stats()["corrupt"] == 0
    bank.commit(batch, 2)
    bank.discard([], after_version=-1)          # every banked entry goes, and the record with them
    assert check_accounting(bank) == {} and bank.stats()["bytes"] == 0


@pytest.mark.parametrize("value", list(BAD))
def test_the_quarantine_of_an_entry_with_unreadable_index_info_records_what_it_can(bank, value):
    """What admission quarantines carries its index info into the dead letter: a version that
    is no number is left out of the record instead of failing the script."""
    banked = _banked(bank)
    _set_json_field(bank, bank.keys.einfo, banked[0], "v", BAD[value])
    bank.quarantine(banked[0], "policy version outside 0..1")
    (rec,) = bank.quarantined()
    assert rec["id"] == banked[0] and rec["banked"] is True
    assert rec.get("version") in (None, -7)
    assert [e.id for e in bank.entries("c")] == banked[1:]
    check_accounting(bank)


@pytest.mark.parametrize("value", list(BAD))
def test_damaged_trash_quarantine_records_and_counters_are_read_without_raising(bank, value, monkeypatch):
    monkeypatch.setattr(bank_module, "QUARANTINE_CAP", 2)
    banked = _banked(bank)
    bank.quarantine(banked[0], "a reason")
    bank.quarantine(banked[1], "another")
    k = bank.keys
    _set_json_field(bank, k.quarantine, banked[0], "time", BAD[value])
    _set_json_field(bank, k.quarantine, banked[1], "seq", BAD[value])
    recs = bank.quarantined()
    assert sorted(r["id"] for r in recs) == sorted(banked[:2])
    assert all(isinstance(r["time"], float) and math.isfinite(r["time"]) for r in recs)
    bank.quarantine(banked[2], "third")       # over the cap: the records are sorted by sequence
    assert len(bank.quarantined()) == 2 and bank.quarantine_count() == 3
    bank.r.hset(k.trash, "f" * 32, BAD[value])
    bank.r.hset(k.counts, "pushed", BAD[value])
    st = bank.stats()
    assert st["pushed"] == 0 and st["trash"] == 1 and st["trash_bytes"] == 0
    assert bank.snapshot()["counts"]["pushed"] == 0
    assert bank.sweep_orphans()["entries"] == 1

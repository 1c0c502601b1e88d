"""Encoded conditions in the bank (the group format's item 2), on a real redis-server: one record
per condition and encoding, not per member; counted in the bytes and the byte bound; deleted
with the last entry that names it, whatever removes that entry (FIFO, SDU, the byte bound, a
skipped step, a dropped group, a discard); one object per record in a pull.

Every test ends with `_check_accounting`, which recomputes each record's references and the
byte counters from the raw Redis structures (einfo, the group records, the queue lists) and
compares them with what the scripts keep."""

from __future__ import annotations

import re

import pytest
import torch
from bank_helpers import check_accounting as _check_accounting
from bank_helpers import json_hash as _json_hash
from bank_helpers import make_cond, make_group

from common.types import Cond
from memory_bank import scripts
from memory_bank.codec import cond_nbytes, encode_cond
from memory_bank.errors import BankFull, DuplicateGroup

SMALL = (2, 2, 4, 4)


def test_a_condition_is_stored_once_for_all_its_groups(bank):
    groups = [make_group("c0", f"g{i}", g=4, seed=i, shape=SMALL) for i in range(3)]
    for g in groups:
        bank.push_group(g)
    cinfo = _check_accounting(bank)
    key, fields = encode_cond("c0", groups[0].cond)
    assert list(cinfo) == [key] and cinfo[key]["n"] == cinfo[key]["q"] == 12
    assert cinfo[key]["b"] == cond_nbytes(fields) > groups[0].cond.nbytes()
    st = bank.stats()
    assert st["cond_records"] == 1 and st["entries"] == 12
    # one pull: every trajectory of the condition shares one Cond, equal to what was encoded
    batch = bank.pull(2, 0)
    bank.commit(batch, 1)
    batch = bank.pull(1, 0)
    conds = {id(t.cond) for t in batch.fresh[0].members} | {id(t.cond) for t, _, _ in batch.bank[0]}
    assert len(conds) == 1 and len(batch.bank[0]) == 8
    got = batch.fresh[0].cond
    assert all(torch.equal(got.tensors[n], groups[0].cond.tensors[n]) for n in got.tensors)
    assert all(torch.equal(got.uncond[n], groups[0].cond.uncond[n]) for n in got.uncond)
    _check_accounting(bank)


def test_another_encoding_of_a_condition_is_another_record(bank):
    a = make_group("c0", "ga", g=2, seed=1, shape=SMALL)
    b = make_group("c0", "gb", g=2, seed=2, shape=SMALL)
    other = make_cond("c0", encoder="another-model")
    for m in b.members:
        m.cond = other
    bank.push_group(a)
    bank.push_group(b)
    assert len(_check_accounting(bank)) == 2
    first = bank.pull(1, 0)
    bank.commit(first, 1)
    batch = bank.pull(1, 0)
    assert batch.fresh[0].cond.encoder == "another-model"
    assert {t.cond.encoder for t, _, _ in batch.bank[0]} == {"test-encoder"}   # each its own
    _check_accounting(bank)


@pytest.mark.parametrize("bank", [{"capacity": 2, "strategy": "fifo"}, {"capacity": 2, "strategy": "sdu"},
                                  {"enabled": False}], indirect=True)
def test_a_record_goes_with_the_last_entry_that_names_it(bank):
    """FIFO and SDU trims, and a bank that banks nothing: when no entry names a record, it goes."""
    bank.push_group(make_group("c0", "g0", g=3, seed=0, shape=SMALL))
    bank.push_group(make_group("c1", "g1", g=3, seed=1, shape=SMALL))
    bank.commit(bank.pull(2, 0), 1)
    cinfo = _check_accounting(bank)
    kept = 0 if not bank.cfg.enabled else 2
    assert sorted(d["n"] for d in cinfo.values()) == ([kept, kept] if kept else [])
    assert all(d["q"] == 0 for d in cinfo.values())
    bank.discard([], after_version=-1)                 # every banked entry: the records go too
    assert _check_accounting(bank) == {} and bank.bytes_used() == 0 == bank.queued_bytes()


def test_the_byte_bound_evicts_records_with_their_entries(bank):
    probe = make_group("c0", "probe", g=2, seed=0, shape=SMALL)
    bank.push_group(probe)
    per_group = bank.group_bytes                       # entries + the record: what one group adds
    bank.commit(bank.pull(1, 0), 1)
    bank.cfg = bank.cfg.model_copy(update={"max_bytes": int(per_group * 2.5)})
    for i in range(1, 6):                              # a new condition each: old ones must go
        bank.push_group(make_group(f"c{i}", f"g{i}", g=2, seed=i, shape=SMALL))
        bank.commit(bank.pull(1, 0), i + 1)
        _check_accounting(bank)
        assert bank.bytes_used() <= bank.cfg.max_bytes
    left = {d["cond"] for d in _check_accounting(bank).values()}
    assert "c0" not in left and left <= {f"c{i}" for i in range(1, 6)}


def test_a_full_bank_counts_the_condition_a_group_brings(bank):
    """A push that fits only without its condition record is refused: the record is queued
    bytes too, and the refused push leaves no record behind."""
    g = make_group("c0", "g0", g=2, seed=0, shape=SMALL)
    bank.cfg = bank.cfg.model_copy(update={"max_bytes": 1 << 20})
    bank.push_group(g)
    need = bank.queued_bytes()
    bank.clear()
    entries_only = need - cond_nbytes(encode_cond("c0", g.cond)[1])
    bank.cfg = bank.cfg.model_copy(update={"max_bytes": entries_only})
    with pytest.raises(BankFull, match=r"needs \d+ more") as e:
        bank.push_group(make_group("c0", "g1", g=2, seed=0, shape=SMALL))
    needs = int(re.search(r"needs (\d+) more", str(e.value)).group(1))
    # the record counted: within a few bytes of the first push (each entry's `created` time is
    # a float's repr, whose length varies), and over what the entries alone would take
    assert abs(needs - need) <= 8 and needs > entries_only
    assert _check_accounting(bank) == {} and bank.stats()["entries"] == 0


def test_a_refused_duplicate_leaves_no_record(bank):
    bank.push_group(make_group("c0", "dup", g=2, shape=SMALL))
    bank.r.delete(bank.keys.fresh)                     # the group record stays: a duplicate id
    with pytest.raises(DuplicateGroup):
        bank.push_group(make_group("c9", "dup", g=2, shape=SMALL))
    assert [d["cond"] for d in _json_hash(bank, bank.keys.cinfo).values()] == ["c0"]
    assert len(list(bank.r.scan_iter(match=f"{bank.keys.namespace}:*condrec:*"))) == 1


@pytest.mark.parametrize("bank", [{"enabled": False}], indirect=True)
def test_a_known_record_is_not_resent_and_a_dropped_one_is_written_again(bank, monkeypatch):
    """A push is one round trip. The producer writes a condition's record with its first group
    and then neither resends it nor asks whether it is there; when it was dropped since (its last
    entries left the bank), the push script answers 'missing' and the record is written again."""
    sent: list[list] = []
    real = scripts.wire.execute
    monkeypatch.setattr(scripts.wire, "execute", lambda client, cmds: sent.append(list(cmds)) or real(client, cmds))
    monkeypatch.setattr(bank.r, "execute_command", lambda *a, **kw: pytest.fail(f"redis-py call {a[0]}"))
    record = bank.keys.cond_record(encode_cond("c0", make_cond("c0"))[0])

    def push(gid: str, seed: int) -> list[bool]:
        """Push a group of c0; for each round trip it took, whether it wrote the record."""
        sent.clear()
        bank.push_group(make_group("c0", gid, g=2, seed=seed, shape=SMALL))
        return [any(c[:2] == ("HSET", record) for c in cmds) for cmds in sent
                if any(c[0] != "EVAL" for c in cmds)]   # not a script the server had to be sent

    assert push("g0", 0) == [True]
    assert push("g1", 1) == [False]
    monkeypatch.undo()
    bank.commit(bank.pull(2, 0), 1)                    # nothing banked: the record goes too
    assert not bank.r.exists(record) and _check_accounting(bank) == {}
    monkeypatch.setattr(scripts.wire, "execute", lambda client, cmds: sent.append(list(cmds)) or real(client, cmds))
    assert push("g2", 2) == [False, True]              # refused as missing, then written
    assert push("g3", 3) == [False]
    monkeypatch.undo()
    batch = bank.pull(2, 0)
    assert [g.size for g in batch.fresh] == [2, 2]
    assert all(torch.equal(g.cond.tensors["text"], make_cond("c0").tensors["text"]) for g in batch.fresh)
    _check_accounting(bank)


def test_a_stored_record_is_read_back_once_per_producer(bank, monkeypatch):
    """encode_cond reads a record back by decode's rules before it is stored; a key names its
    bytes, so a record this producer stored is not read back on each later push (at Wan scale
    that is a pass over megabytes of text embedding per push). Another condition, or another
    encoding of this one, is a new key and is read back."""
    from memory_bank import codec

    reads: list[str] = []
    real = codec._decode_cond
    monkeypatch.setattr(codec, "_decode_cond", lambda fields, *a, **kw: reads.append(fields["key"]) or real(fields, *a, **kw))
    for i in range(3):
        bank.push_group(make_group("c0", f"g{i}", g=2, seed=i, shape=SMALL))
    key0 = encode_cond("c0", make_cond("c0"))[0]
    assert reads == [key0, key0]                       # the first push, and the line above
    bank.push_group(make_group("c1", "h0", g=2, seed=9, shape=SMALL))
    key1 = encode_cond("c1", make_cond("c1"))[0]
    assert reads[2:] == [key1, key1]
    bad = make_group("c0", "g9", g=2, seed=0, shape=SMALL)
    two_rows = Cond({"text": torch.zeros(2, 3)}, None, bad.cond.encoder)
    for m in bad.members:                              # what is checked before the key, each time
        m.cond = two_rows
    with pytest.raises(ValueError, match="do not have one row"):
        bank.push_group(bad)
    monkeypatch.undo()
    assert [g.size for g in bank.pull(4, 0).fresh] == [2, 2, 2, 2]
    _check_accounting(bank)


def test_a_pull_reads_the_condition_records_with_the_entries(bank, monkeypatch):
    """A pull is two round trips (move the groups, read their entries): the records its fresh
    groups and banked entries name are read with the entries. A group whose record names no
    condition record key (pushed by an older bank) still has its record read, in a third."""
    for i in range(2):
        bank.push_group(make_group(f"c{i}", f"a{i}", g=2, seed=i, shape=SMALL))
    bank.commit(bank.pull(2, 0), 1)                    # banked: the next groups' bank entries
    bank.push_group(make_group("c0", "b0", g=2, seed=10, shape=SMALL))
    bank.push_group(make_group("c2", "b1", g=2, seed=11, shape=SMALL))   # nothing banked of c2
    bank.r.hdel(bank.keys.group("b1"), "ck")
    sent: list[list] = []
    real = scripts.wire.execute
    monkeypatch.setattr(scripts.wire, "execute", lambda client, cmds: sent.append(list(cmds)) or real(client, cmds))
    pipelines = []
    real_pipe = bank.r.pipeline
    monkeypatch.setattr(bank.r, "pipeline", lambda *a, **kw: pipelines.append(1) or real_pipe(*a, **kw))
    batch = bank.pull(1, 1)
    assert len([c for c in sent if any(x[0] != "EVAL" for x in c)]) == 2 and pipelines == []
    assert batch.fresh[0].group_id == "b0" and len(batch.bank[0]) == 2
    assert {id(t.cond) for t in batch.fresh[0].members} == {id(t.cond) for t, _, _ in batch.bank[0]}
    assert torch.equal(batch.fresh[0].cond.tensors["text"], make_cond("c0").tensors["text"])
    batch = bank.pull(1, 1)                            # b1 names no key: its record read after
    assert pipelines == [1] and batch.fresh[0].group_id == "b1"
    assert torch.equal(batch.fresh[0].cond.tensors["text"], make_cond("c2").tensors["text"])
    monkeypatch.undo()
    _check_accounting(bank)


def test_a_damaged_record_drops_its_group_and_entries(bank):
    bank.push_group(make_group("c0", "g0", g=2, shape=SMALL))
    ck = next(iter(_json_hash(bank, bank.keys.cinfo)))
    blob = bytearray(bank.r.hget(bank.keys.cond_record(ck), "blob"))
    blob[-1] ^= 0x01
    bank.r.hset(bank.keys.cond_record(ck), "blob", bytes(blob))
    batch = bank.pull(1, 0)
    assert batch.fresh == [] and bank.dropped_ids == ["g0"] and bank.stats()["corrupt"] >= 1
    assert _check_accounting(bank) == {}


def test_members_must_share_an_encoded_condition(bank):
    g = make_group("c0", "g0", g=2, shape=SMALL)
    g.members[1].cond = Cond(dict(g.cond.tensors), None, g.cond.encoder)
    with pytest.raises(ValueError, match="member 1: no encoded condition shared"):
        bank.push_group(g)
    g.members[1].cond = None
    with pytest.raises(ValueError, match="Trajectory.cond"):
        bank.push_group(g)
    assert bank.stats()["entries"] == 0

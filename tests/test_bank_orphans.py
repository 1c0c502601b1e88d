"""Orphans on a real redis-server: a reply lost after Redis ran a push or a commit leaves the
evicted entries' keys behind, outside bank.max_bytes; the next evicting call reclaims them.
Entries written by a push whose script never ran are found by the sweep at resume."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid

import pytest
import redis
from bank_helpers import make_group

from common.config import BankConfig
from memory_bank import scripts, wire
from memory_bank.bank import MemoryBank
from memory_bank.errors import BankUnavailable
from memory_bank.ownership import claim_namespace


def _stored_ids(bank: MemoryBank) -> set[str]:
    return {bank.keys.entry_id(k.decode()) for k in bank.r.scan_iter(match=bank.keys.entry_pattern)}


def _orphans(bank: MemoryBank) -> set[str]:
    return _stored_ids(bank) - {e.decode() for e in bank.r.hkeys(bank.keys.einfo)}


def _assert_accounting_is_real(bank: MemoryBank) -> None:
    """Every stored entry is indexed, every condition record is counted, and the byte counter is
    the indexed entries' bytes plus their condition records'."""
    einfo = {e.decode(): json.loads(v) for e, v in bank.r.hgetall(bank.keys.einfo).items()}
    cinfo = {c.decode(): json.loads(v) for c, v in bank.r.hgetall(bank.keys.cinfo).items()}
    assert _stored_ids(bank) == set(einfo)
    assert {d["k"] for d in einfo.values()} == set(cinfo)
    prefix = bank.keys.cond_record_prefix
    records = {k.decode()[len(prefix):] for k in bank.r.scan_iter(match=prefix + "*")}
    assert records == set(cinfo)       # no condition record outside the accounting
    assert int(bank.r.get(bank.keys.bytes) or 0) == sum(d["b"] for d in [*einfo.values(), *cinfo.values()])
    assert bank.r.hlen(bank.keys.trash) == 0


def _losing_replies_of(monkeypatch, source: str) -> None:
    """Redis runs the script, the caller never sees the reply (and its retries are spent)."""
    sha, real = hashlib.sha1(source.encode()).hexdigest(), wire.execute

    def execute(client, commands):
        out = real(client, commands)
        ran = [r for c, r in zip(commands, out, strict=True)
               if c[:2] in (("EVALSHA", sha), ("EVAL", source)) and not isinstance(r, Exception)]
        if ran:
            raise redis.ConnectionError("connection reset before the reply arrived")
        return out

    monkeypatch.setattr(wire, "execute", execute)


# About 172 KB per member in a 1 MiB bank. A push of 4 members evicts the 4 banked ones to make
# room (byte bound); a commit of 2 members with capacity 2 evicts the 2 banked ones (capacity).
@pytest.mark.parametrize("lost,capacity,g", [("push", 8, 4), ("commit", 2, 2)])
def test_lost_replies_leave_orphans_that_the_next_call_reclaims(redis_server, monkeypatch, lost,
                                                                capacity, g):
    cfg = BankConfig(namespace=f"orph{uuid.uuid4().hex[:8]}", capacity=capacity,
                     max_staleness=100, max_bytes=1 << 20)
    bank = MemoryBank(redis_server.client(), cfg)
    bank.push_group(make_group("c", "warm", g=g, seed=99))
    bank.commit(bank.pull(1, 0), 0)
    source = scripts.PUSH if lost == "push" else scripts.COMMIT
    seen = 0
    for i in range(10):
        with monkeypatch.context() as m:
            if lost == "push":
                _losing_replies_of(m, source)
                with pytest.raises(BankUnavailable):
                    bank.push_group(make_group("c", f"g{i}", g=g, seed=i))
                seen = max(seen, len(_orphans(bank)))
                m.undo()
                batch = bank.pull(1, 0)                  # the lost push did queue the group
                assert [g.group_id for g in batch.fresh] == [f"g{i}"]
                bank.commit(batch, i + 1)
            else:
                bank.push_group(make_group("c", f"g{i}", g=g, seed=i))
                batch = bank.pull(1, 0)
                _losing_replies_of(m, source)
                with pytest.raises(BankUnavailable):
                    bank.commit(batch, i + 1)
                seen = max(seen, len(_orphans(bank)))
    assert seen >= 2                                     # what issue 35 found: orphans appear
    if lost == "commit":                                 # ...and stay until the next evicting call
        assert _orphans(bank) and bank.stats()["trash"] >= len(_orphans(bank))
        bank.push_group(make_group("c", "last", g=g, seed=50))
        bank.commit(bank.pull(1, 0), 20)
    _assert_accounting_is_real(bank)
    st = bank.stats()
    assert st["committed"] == (11 if lost == "push" else 12) and (st["fresh"], st["pending"]) == (0, 0)
    bank.clear()


def test_sweep_at_resume_deletes_entries_a_push_wrote_but_never_queued(redis_server, monkeypatch,
                                                                        caplog):
    cfg = BankConfig(namespace=f"orph{uuid.uuid4().hex[:8]}", lease_ttl_s=5)
    bank = MemoryBank(redis_server.client(), cfg)
    lease = claim_namespace(bank, "run-o")
    bank.push_group(make_group("c", "g0", g=2, seed=0))
    real = wire.execute

    def writes_only(client, commands):   # the producer dies after its writes, before the script
        real(client, [c for c in commands if c[0] in ("HSET", "SET")])
        raise redis.ConnectionError("producer killed")

    with monkeypatch.context() as m:
        m.setattr(wire, "execute", writes_only)
        with pytest.raises(BankUnavailable):
            bank.push_group(make_group("c1", "g1", g=3, seed=1))   # its condition record first
    assert len(_orphans(bank)) == 3
    assert bank.sweep_orphans(min_age_s=3600) == {"entries": 0, "bytes": 0, "cond_records": 0}  # in flight?
    lease.release()
    resumed = MemoryBank(redis_server.client(), cfg)
    with caplog.at_level(logging.WARNING, logger="memory_bank.orphans"):
        lease = claim_namespace(resumed, "run-o", resume=True)
    assert "reclaimed 3 orphan entries" in caplog.text and "1 condition records" in caplog.text
    assert "3 written by pushes" in caplog.text
    _assert_accounting_is_real(resumed)
    assert resumed.stats()["orphans_reclaimed"] == 4
    assert [g.group_id for g in resumed.pull(5, 0).fresh] == ["g0"]
    lease.release()
    resumed.clear()

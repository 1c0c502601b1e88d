"""The bank's data in a checkpoint: a dump restores the exact bank into an empty Redis (the
default embedded server keeps nothing across a restart), and a resume that cannot restore it
says so in one line without writing anything."""

from __future__ import annotations

import json

import pytest
import torch
from bank_helpers import make_group

from common import storage
from common.config import BankConfig
from memory_bank.bank import MemoryBank
from memory_bank.dump import DATA, DIR, INDEX, dump_bank, restore_bank, step_dir
from memory_bank.embedded import EmbeddedRedis

SMALL = (2, 2, 4, 4)
KEYS = ("fresh", "pending", "banked", "entries", "conditions", "pushed", "committed", "bytes",
        "queued_bytes", "cond_records")


def _filled(bank: MemoryBank) -> None:
    """Two conditions with banked entries, one pending group, two queued groups."""
    for i in range(4):
        bank.push_group(make_group(f"c{i % 2}", f"old{i}", g=2, seed=i, shape=SMALL))
    bank.commit(bank.pull(4, 0), 1)
    for i in range(3):
        bank.push_group(make_group(f"c{i % 2}", f"new{i}", g=2, seed=10 + i, shape=SMALL))
    assert len(bank.pull(1, 1).fresh) == 1            # new0 in flight at the checkpoint


def _state(bank: MemoryBank) -> dict:
    st = bank.stats()
    return {
        "stats": {k: st[k] for k in KEYS},
        "banked": {c: [(e.id, e.trajectory.x.clone(), e.scores, e.trajectory.trained_times)
                       for e in bank.entries(c)] for c in ("c0", "c1")},
    }


@pytest.fixture(params=["local", "s3"])
def ckpt_dir(request, tmp_path):
    """A checkpoint dir: local, or on a real S3 endpoint on loopback (moto's server, via s3fs)."""
    if request.param == "local":
        return tmp_path
    return storage.Uri(request.getfixturevalue("s3_root")) / "checkpoints" / "step_00000001"


def test_checkpoint_restores_the_bank_into_an_empty_redis(ckpt_dir):
    cfg = BankConfig(namespace="ckpt", capacity=8)
    with EmbeddedRedis() as first:                      # aof off: nothing survives it
        bank = MemoryBank(first.client(), cfg)
        _filled(bank)
        before = _state(bank)
        assert dump_bank(bank, ckpt_dir) is None
        if storage.is_uri(ckpt_dir):  # the index, the marker, is the last object written
            assert sorted(p.name for p in (ckpt_dir / DIR).iterdir()) == [DATA, INDEX]
            assert dump_bank(bank, ckpt_dir) is None   # a re-dump replaces it whole
    with EmbeddedRedis() as second:                     # the resumed run's new, empty server
        bank = MemoryBank(second.client(), cfg)
        note = restore_bank(bank, ckpt_dir)
        assert note == f"bank: restored 8 banked entries and 3 queued groups from {ckpt_dir / DIR}"
        after = _state(bank)
        # the pending group is queued again, first; every other figure is as it was
        assert after["stats"] == {**before["stats"], "fresh": 3, "pending": 0}
        for c in ("c0", "c1"):
            assert [e[0] for e in after["banked"][c]] == [e[0] for e in before["banked"][c]]
            for a, b in zip(after["banked"][c], before["banked"][c], strict=True):
                assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and a[3] == b[3]
        batch = bank.pull(5, 1)
        assert [g.group_id for g in batch.fresh] == ["new0", "new1", "new2"]
        assert [len(b) for b in batch.bank] == [4, 4, 4]   # each with its condition's bank
        bank.commit(batch, 2)
        assert bank.stats()["committed"] == 7 and bank.stats()["corrupt"] == 0


def test_restore_keeps_what_redis_still_holds(bank, tmp_path):
    _filled(bank)
    dump_bank(bank, tmp_path)
    before = _state(bank)["stats"]
    note = restore_bank(bank, tmp_path)
    assert note.startswith("bank: kept the 14 entries Redis still holds")
    assert _state(bank)["stats"] == before


def test_a_resume_that_cannot_restore_says_so_and_writes_nothing(bank, tmp_path):
    _filled(bank)
    dump_bank(bank, tmp_path)
    bank.clear()
    # 1. no bank data in the checkpoint
    missing = restore_bank(bank, tmp_path / "elsewhere")
    assert "cannot restore the bank" in missing and INDEX in missing and "\n" not in missing
    # 2. a damaged entries file: one line naming it, nothing written
    data = tmp_path / DIR / DATA
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    damaged = restore_bank(bank, tmp_path)
    assert "\n" not in damaged and f"{DATA} is damaged" in damaged and "empty bank" in damaged
    assert list(bank.r.scan_iter(match=f"{bank.keys.namespace}:*")) == []
    # 3. another namespace's dump
    index = tmp_path / DIR / INDEX
    index.write_text(json.dumps({**json.loads(index.read_text()), "namespace": "other"}))
    assert "bank.namespace 'other'" in restore_bank(bank, tmp_path)


def test_step_dir_finds_the_checkpoint_under_a_root(tmp_path):
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / "extra.json").write_text("{}")
    assert step_dir(tmp_path, 4) == tmp_path / "step_00000004"
    assert step_dir(tmp_path / "step_00000004", 4) == tmp_path / "step_00000004"


def _as_format_1(src) -> None:
    """Rewrite a dump as an older vgrpo wrote it: index format 1, entries of bank format 2 (every
    recorded step, no condition record: `trained_steps` and `image_path` instead of `cond_key`),
    with the offsets and digest made to match: a well-formed old dump."""
    import hashlib

    index_path, data_path = src / INDEX, src / DATA
    index, data = json.loads(index_path.read_text()), data_path.read_bytes()
    out, entries = bytearray(), {}
    for eid, (off, n_meta, n_blob) in index["entries"].items():
        meta = json.loads(data[off:off + n_meta])
        del meta["cond_key"]
        meta.update(format="2", trained_steps=meta["step_indices"], image_path="/data/frame.png")
        m = json.dumps(meta).encode()
        entries[eid] = [len(out), len(m), n_blob]
        out += m + data[off + n_meta:off + n_meta + n_blob]
    data_path.write_bytes(bytes(out))
    del index["cond_records"]
    index.update(format=1, entries=entries, size=len(out), sha256=hashlib.sha256(out).hexdigest())
    index_path.write_text(json.dumps(index))


def test_a_dump_of_an_older_format_is_refused_in_one_line(bank, tmp_path):
    """A bank written before conditions travelled with the data holds entries the learner could
    only train by re-encoding their prompts: the resume says why in one line and starts with an
    empty bank, writing nothing."""
    _filled(bank)
    dump_bank(bank, tmp_path)
    bank.clear()
    _as_format_1(tmp_path / DIR)
    note = restore_bank(bank, tmp_path)
    assert "\n" not in note and note.endswith("resuming with an empty bank")
    assert "format 1, a bank written by an older vgrpo (its entries carry no encoded condition" in note
    assert list(bank.r.scan_iter(match=f"{bank.keys.namespace}:*")) == []


def test_a_dump_keeps_each_condition_record_once_and_counts_it_again(tmp_path):
    """Condition records travel in the dump once each; a restore counts their references from the
    entries it restores, so a record leaves with the last of its entries there too."""
    cfg = BankConfig(namespace="ckptc", capacity=2)
    with EmbeddedRedis() as first:
        bank = MemoryBank(first.client(), cfg)
        _filled(bank)
        assert bank.stats()["cond_records"] == 2
        dump_bank(bank, tmp_path)
        index = json.loads((tmp_path / DIR / INDEX).read_text())
        assert len(index["cond_records"]) == 2 and len(index["entries"]) == 4 + 6   # banked + queued
        cinfo = {k: json.loads(v) for k, v in bank.r.hgetall(bank.keys.cinfo).items()}
    with EmbeddedRedis() as second:
        bank = MemoryBank(second.client(), cfg)
        restore_bank(bank, tmp_path)
        assert {k: json.loads(v) for k, v in bank.r.hgetall(bank.keys.cinfo).items()} == cinfo
        bytes_before = bank.stats()["bytes"]
        batch = bank.pull(5, 1)
        for g, b in zip(batch.fresh, batch.bank, strict=True):
            assert all(t.cond is g.cond for t, _, _ in b)       # one object per record and pull
        bank.commit(batch, 2)
        bank.discard([], after_version=-1)                      # every banked entry goes
        st = bank.stats()
        assert (st["entries"], st["cond_records"], st["bytes"], st["queued_bytes"]) == (0, 0, 0, 0), st
        assert bytes_before > 0 and list(bank.r.scan_iter(match="ckptc:*condrec*")) == []


def _dumped(bank: MemoryBank, tmp_path, fill) -> None:
    """`fill` the bank, dump it and empty it: the dump is the only copy."""
    fill(bank)
    assert dump_bank(bank, tmp_path) is None
    bank.clear()


def _edit_index(tmp_path, edit) -> None:
    """Change index.json (entries.bin, which the checksum covers, is untouched)."""
    f = tmp_path / DIR / INDEX
    index = json.loads(f.read_text())
    edit(index)
    f.write_text(json.dumps(index))


def _nothing_written(bank: MemoryBank) -> bool:
    return list(bank.r.scan_iter(match=f"{bank.keys.namespace}:*")) == []


def _first(index: dict, key: str) -> str:
    return next(iter(index[key]))


def _einfo(field: str, literal: str):
    def edit(index):
        eid = _first(index, "einfo")
        d = json.loads(index["einfo"][eid])
        d[field] = "@@"
        index["einfo"][eid] = json.dumps(d).replace('"@@"', literal)
    return edit


LIES = {  # a checksum-valid dump whose index lies: what the one line names
    "an entry counted 1 byte": (_einfo("b", "1"), "'einfo."),
    "an entry counted -21000000 bytes": (_einfo("b", "-21000000"), "'einfo."),
    "an entry counted 1e999 bytes": (_einfo("b", "1e999"), "'einfo."),
    "an entry of version NaN": (_einfo("v", "NaN"), "'einfo."),
    "an entry of version 10**400": (_einfo("v", "1" + "0" * 400), "'einfo."),
    "a group counted 1 byte": (lambda ix: ix["groups"][0]["fields"].update(bytes="1"), "'groups[0].fields.bytes'"),
    "a group of version -3": (lambda ix: ix["groups"][0]["fields"].update(version="-3"), "'groups[0].fields.version'"),
    "a counter NaN": (lambda ix: ix["counts"].update(pushed="NaN"), "'counts.pushed'"),
    "an entry at a negative offset": (
        lambda ix: ix["entries"].update({_first(ix, "entries"): [-100, 10, 10]}), "'entries."),
    "an entry in two groups": (lambda ix: ix["groups"].append(ix["groups"][0]), "more than once"),
    "an entry without its accounting": (lambda ix: ix["einfo"].pop(_first(ix, "einfo")), "'einfo'"),
}


@pytest.mark.parametrize("case", list(LIES))
def test_a_checksum_valid_dump_with_wrong_byte_counts_is_refused_before_writing(bank, tmp_path, case):
    """restore_bank checks every count the bank will keep, whoever calls it: an index that lies
    (a byte count below what the entry holds would let a dump overfill the bank) is refused in
    one line naming the field, and nothing is written."""
    edit, needle = LIES[case]
    _dumped(bank, tmp_path, _filled)
    _edit_index(tmp_path, edit)
    note = restore_bank(bank, tmp_path)
    assert "\n" not in note and note.startswith("bank: cannot restore the bank from")
    assert needle in note and note.endswith("resuming with an empty bank")
    assert _nothing_written(bank)


def _big(bank: MemoryBank, queued: int, banked: int) -> None:
    """Groups of 2 members of about 170 kB each: `banked` committed ones, then `queued` queued."""
    for i in range(banked):
        bank.push_group(make_group(f"c{i % 2}", f"old{i}", g=2, seed=i))
    if banked:
        bank.commit(bank.pull(banked, 0), 1)
    for i in range(queued):
        bank.push_group(make_group(f"c{i % 2}", f"new{i}", g=2, seed=10 + i))


@pytest.mark.parametrize("bank", [{"max_bytes": 8 << 20}], indirect=True)
def test_a_dump_whose_queued_groups_exceed_the_bank_is_refused_before_writing(bank, tmp_path):
    """The issue's case, smaller: a checksum-valid dump of more queued groups than this bank's
    bank.max_bytes holds (they are never evicted) is refused in one line, nothing written."""
    _dumped(bank, tmp_path, lambda b: _big(b, queued=4, banked=0))
    need = sum(int(g["fields"]["bytes"]) for g in json.loads((tmp_path / DIR / INDEX).read_text())["groups"])
    small = MemoryBank(bank.r, bank.cfg.model_copy(update={"max_bytes": 1 << 20}))
    note = restore_bank(small, tmp_path)
    assert "\n" not in note and note.endswith("resuming with an empty bank"), note
    assert "4 queued groups need" in note and "over bank.max_bytes=1048576" in note
    assert need > 1 << 20 and _nothing_written(bank)


@pytest.mark.parametrize("bank", [{"max_bytes": 8 << 20}], indirect=True)
def test_a_dump_over_the_bank_leaves_out_its_oldest_banked_entries(bank, tmp_path):
    """Banked entries are a cache: a dump holding more than this bank's bank.max_bytes keeps its
    queued groups and its newest banked entries, the oldest left out (said in the line)."""
    from bank_helpers import check_accounting

    _dumped(bank, tmp_path, lambda b: _big(b, queued=2, banked=4))
    index = json.loads((tmp_path / DIR / INDEX).read_text())
    order = sorted(index["bankz"], key=index["bankz"].get)        # oldest first
    small = MemoryBank(bank.r, bank.cfg.model_copy(update={"max_bytes": 1 << 20}))
    note = restore_bank(small, tmp_path)
    st = small.stats()
    out = len(order) - st["banked"]
    assert "\n" not in note and "2 queued groups" in note and f"left out the {out} oldest banked entries" in note, note
    assert st["fresh"] == 2 and st["bytes"] <= 1 << 20 and 0 < out < len(order)
    kept = [e.id for c in ("c0", "c1") for e in small.entries(c)]
    assert sorted(kept) == sorted(order[out:])
    check_accounting(small)
    batch = small.pull(2, 1)
    assert [g.group_id for g in batch.fresh] == ["new0", "new1"]
    small.commit(batch, 2)
    check_accounting(small)

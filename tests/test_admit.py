"""learner/admit.py on real decoded-shaped groups (tests/bank_helpers.py): what decodes but does not
fit this run is taken out of the batch, each kind one way, and the rest is kept as it was."""

from __future__ import annotations

import torch
from bank_helpers import SHAPE, make_group

from common.sde import Sage, Schedule
from common.types import TrainBatch
from learner.admit import Admission, admit

SPEC = make_group().members[0].spec
ADM = Admission(SPEC, SHAPE)


def _ids(group, prefix: str) -> None:
    for i, t in enumerate(group.members):
        t.bank_id = f"{prefix}{i:02d}".ljust(32, "0")


def _batch(*groups, bank=None) -> TrainBatch:
    for n, g in enumerate(groups):
        _ids(g, f"{n:02d}")
    return TrainBatch(fresh=list(groups), bank=bank or [[] for _ in groups], version=5)


def test_a_group_of_another_latent_shape_is_quarantined_whole_and_the_rest_kept():
    good, bad = make_group("c0", "g0", seed=0), make_group("c1", "g1", seed=1, shape=(4, 6, 8, 8))
    batch = _batch(good, bad)
    v = admit(batch, ADM, version=5)
    assert batch.fresh == [good] and len(batch.bank) == 1
    assert v.quarantined == {"g1": "latent shape [4, 6, 8, 8] is not this model's [4, 6, 16, 16]"}
    assert sorted(v.quarantine) == sorted(t.bank_id for t in bad.members)   # every member a dead letter
    assert v.dropped == {"g1": "quarantined: latent shape [4, 6, 8, 8] is not this model's [4, 6, 16, 16]"}
    assert not v.resampled and not v.evict


def test_one_member_from_the_future_takes_its_whole_group_out():
    group = make_group("c0", "g0", version=3)
    group.members[2].policy_version = 10 ** 38                          # a 39-digit version the codec reads
    batch = _batch(group)
    v = admit(batch, ADM, version=5)
    assert batch.fresh == [] and list(v.quarantined) == ["g0"]
    assert v.quarantine == {group.members[2].bank_id: v.quarantined["g0"]}  # only the culprit is a dead letter
    assert "outside 0..5" in v.quarantined["g0"] and "39 digits" in v.quarantined["g0"]


def test_a_group_without_its_encoded_condition_is_quarantined():
    group = make_group("c0", "g0")
    for t in group.members:
        t.cond = None
    v = admit(_batch(group), ADM, version=5)
    assert v.quarantined == {"g0": "no encoded condition"}


def test_other_settings_are_resampled_and_evicted_not_quarantined():
    """A resume with another η: the old run's queued group is dropped (its condition drawn again),
    its banked entries are evicted; nothing goes to the quarantine."""
    old = make_group("c0", "g-old", seed=0)
    other = Sage(0.9).spec(Schedule.explicit(list(SPEC.sigmas)))
    for t in old.members:
        t.spec = other
    new = make_group("c1", "g-new", seed=1)
    banked_old, banked_new = make_group("c1", "gb", seed=2).members[:2]
    banked_old.spec, banked_old.bank_id, banked_new.bank_id = other, "b" * 32, "d" * 32
    entry = lambda t: (t, torch.zeros(3), 1.0)  # noqa: E731   (trajectory, head scores, composite)
    batch = _batch(old, new, bank=[[], [entry(banked_old), entry(banked_new)]])
    v = admit(batch, ADM, version=5)
    assert batch.fresh == [new] and [e[0] for e in batch.bank[0]] == [banked_new]
    assert list(v.resampled) == ["g-old"] and not v.quarantined and not v.quarantine
    assert v.evict == {"c1": ["b" * 32]}
    assert "sage(eta=0.9" in v.resampled["g-old"] and "this run samples with sage(eta=0.5" in v.resampled["g-old"]
    assert v.notes() == [f"bank: evicted 1 banked entry sampled with other settings ({v.resampled['g-old']})"]


def test_a_banked_entry_shared_by_two_groups_is_taken_out_once():
    g0, g1 = make_group("c0", "g0", seed=0), make_group("c0", "g1", seed=1)
    stale = make_group("c0", "gb", seed=2).members[0]
    stale.bank_id, stale.policy_version = "e" * 32, 99
    entry = (stale, torch.zeros(3), 1.0)
    batch = _batch(g0, g1, bank=[[entry], [entry]])
    v = admit(batch, ADM, version=5)
    assert batch.fresh == [g0, g1] and batch.bank == [[], []]
    assert list(v.quarantine) == ["e" * 32] and len(v.notes()) == 1 and "quarantined banked entry" in v.notes()[0]

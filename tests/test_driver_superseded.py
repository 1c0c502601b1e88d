"""Which pulled groups still stand for their cursor (DriverState.superseded), and a resume whose
bank holds two queued attempts of one cursor (the real redis-server): one stands for it, the
other is superseded, and the cursor counts once."""

from __future__ import annotations

from bank_helpers import make_group

from cluster.driver.resume import reconcile
from cluster.driver.state import DriverState, attempt_of, group_id


def test_attempt_of_reads_the_suffix_group_id_writes():
    assert [attempt_of(group_id(12, 3, a)) for a in (0, 1, 7)] == [0, 1, 7]
    assert attempt_of("grp-1") == 0 and attempt_of("g0000001-v2-x") == 0


def test_a_group_stands_for_its_cursor_only_as_the_attempt_the_driver_holds():
    s = DriverState(open={1: None, 2: None, 3: group_id(3, 0, 1), 4: group_id(4, 0)})
    s.attempts[2] = 1                          # cursor 2 was drawn again after its first attempt
    pulled = [group_id(0, 0),                  # cursor 0 was trained already
              group_id(1, 0),                  # drawn, its receipt not yet read: stands
              group_id(2, 0), group_id(2, 0, 1),  # the first attempt is superseded, the redraw stands
              group_id(3, 0), group_id(3, 0, 1),  # the cursor's receipt named attempt 1
              group_id(4, 0), "foreign-id"]       # the receipt's own; not a driver id: left alone
    assert s.superseded(pulled) == [group_id(0, 0), group_id(2, 0), group_id(3, 0)]


def test_a_resume_with_two_queued_attempts_of_one_cursor_counts_it_once(bank):
    ids = [group_id(3, 0), group_id(3, 0, 1), group_id(4, 0)]
    for i, g in enumerate(ids):
        bank.push_group(make_group(f"c{g[:8]}", g, seed=i))
    state, lines = DriverState(step=0, cursor=5), []
    reconcile(state, bank, opened={3, 4}, note=lines.append)
    assert state.counts["groups_produced"] == 2 and state.replay == [] and sorted(state.open) == [3, 4]
    stale = state.superseded(bank.queued_ids())
    assert len(stale) == 1 and stale[0] in ids[:2] and state.open[3] in ids[:2] and state.open[3] != stale[0]

"""The driver's failure bookkeeping, without a cluster: refilled groups and the stop after a run of failures."""

import pytest

from cluster.driver import MAX_FAILED_IN_ROW, Driver, StopRun
from cluster.prompts import load_prompts
from cluster.run_dir import RunDir
from common.config import load_config


def _driver(tmp_path):
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=t"])
    d = Driver(cfg, RunDir.create(cfg))
    d.conditions = load_prompts(cfg.train.prompts)  # what setup() loads, without starting a cluster
    return d


def test_a_run_of_failed_groups_stops_the_run_with_its_reason(tmp_path):
    d = _driver(tmp_path)
    cursors = [d.next_condition()[2] for _ in range(MAX_FAILED_IN_ROW)]
    assert set(d.open) == set(cursors)
    for n in cursors[:-1]:
        d._abandon(n)                      # each failed group leaves the open set: it is drawn anew
    assert d.failed_in_row == MAX_FAILED_IN_ROW - 1 and set(d.open) == {cursors[-1]}
    with pytest.raises(StopRun, match=f"{MAX_FAILED_IN_ROW} groups in a row failed"):
        d._abandon(cursors[-1])
    assert not d.open


def test_the_prompt_stream_is_a_seeded_permutation_per_epoch(tmp_path):
    d = _driver(tmp_path)
    n = len(d.conditions)
    first = [d.next_condition() for _ in range(n)]
    assert sorted(c.id for c, _, _ in first) == sorted(c.id for c in d.conditions)  # each once per epoch
    again = _driver(tmp_path)
    assert [(c.id, s) for c, s, _ in (again.next_condition() for _ in range(n))] == \
        [(c.id, s) for c, s, _ in first]   # same seed, same stream

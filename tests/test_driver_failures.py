"""The driver's failure bookkeeping: refilled groups and the stop after a run of failures (without a
cluster), and a learner that dies while its weights are packed (one real actor)."""

from types import SimpleNamespace

import pytest

from cluster.data.prompts import load_prompts
from cluster.driver.errors import StopRun
from cluster.driver.fleet import MAX_FAILED_IN_ROW, RolloutFleet
from cluster.driver.state import DriverState
from cluster.driver.stream import PromptStream
from cluster.driver.versions import Versions
from common.config import load_config


def _driver(tmp_path):
    """The prompt stream and the fleet's failure counter over one DriverState, as setup() wires
    them, without starting a cluster."""
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=t"])
    state = DriverState()
    stream = PromptStream(load_prompts(cfg.train.prompts), cfg.train.seed, state)
    fleet = RolloutFleet(cfg, [], state, stream, versions=Versions(0), on_sync_error=lambda: None,
                         timers={}, metrics=None, note=print)
    return SimpleNamespace(next_condition=stream.next, _abandon=fleet.abandon, open=state.open,
                           conditions=stream.conditions, fleet=fleet)


def test_a_run_of_failed_groups_stops_the_run_with_its_reason(tmp_path):
    d = _driver(tmp_path)
    cursors = [d.next_condition()[2] for _ in range(MAX_FAILED_IN_ROW)]
    assert set(d.open) == set(cursors)
    for n in cursors[:-1]:
        d._abandon(n)                      # a failed group stays open: its cursor is drawn again
    assert d.fleet.failed_in_row == MAX_FAILED_IN_ROW - 1 and set(d.open) == set(cursors)
    with pytest.raises(StopRun, match=f"{MAX_FAILED_IN_ROW} groups in a row failed"):
        d._abandon(cursors[-1])
    assert set(d.open) == set(cursors)     # a checkpoint now records every one to draw again


def test_a_failed_group_is_drawn_again_with_the_same_cursor_and_condition(tmp_path):
    d = _driver(tmp_path)
    first = [d.next_condition() for _ in range(3)]
    d._abandon(first[1][2])
    cond, seed, cursor = d.next_condition()
    assert cursor == first[1][2] and cond.id == first[1][0].id   # same place in the prompt stream
    assert seed != first[1][1]             # a new seed: a failure the seed caused is not repeated
    # then the stream goes on where it was: the same conditions as a run without the failure
    other = _driver(tmp_path)
    clean = [other.next_condition()[0].id for _ in range(4)]
    after = d.next_condition()
    assert after[2] == 3 and [c.id for c, _, _ in first] + [after[0].id] == clean


def test_the_prompt_stream_is_a_seeded_permutation_per_epoch(tmp_path):
    d = _driver(tmp_path)
    n = len(d.conditions)
    first = [d.next_condition() for _ in range(n)]
    assert sorted(c.id for c, _, _ in first) == sorted(c.id for c in d.conditions)  # each once per epoch
    again = _driver(tmp_path)
    assert [(c.id, s) for c, s, _ in (again.next_condition() for _ in range(n))] == \
        [(c.id, s) for c, s, _ in first]   # same seed, same stream


def test_a_learner_that_dies_before_its_weights_are_packed_stops_the_run_in_one_line(ray_session, tmp_path):
    """The learner dies after its step, while rank 0 packs the weights for the object store (a
    kill that lands between `train` and `publish`): a StopRun naming the learner, the learner
    marked lost (no checkpoint is attempted from it), not a RayActorError out of Driver.run."""
    import os

    import ray

    from cluster.driver.publish import Publisher

    @ray.remote(num_cpus=0)
    class Rank0:
        def die(self):
            os._exit(1)

    rank0 = Rank0.remote()

    class Learner:  # the learner group's one call here, on a real actor that dies during it
        def weights_record(self, version, checksum, ema):
            return ray.get(rank0.die.remote())

    from cluster.driver.driver import Driver
    from cluster.runs.run_dir import RunDir

    d = _driver(tmp_path)
    d.run_dir, d.learner_lost = RunDir.create(d.fleet.cfg), False  # what the driver's stop line reads
    lost = []
    pub = Publisher(d.fleet.cfg, Learner(), d.fleet, registry=None, on_learner_error=lambda: lost.append(1),
                    timers={"publish": 0.0}, metrics=None, learner_died=lambda what: Driver._learner_died(d, what))
    with pytest.raises(StopRun, match=r"^weight sync of version 3 failed: the learner died \(.*\); continue from "
                                      r"the last checkpoint with: vgrpo resume \S+$"):
        pub.publish(3)
    assert lost == [1] and pub.published == 0 and d.fleet.versions.current == 0 and d.learner_lost

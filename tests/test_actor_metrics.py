"""What each actor verb records about itself (common/actor_metrics.py), on the memory backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common import actor_metrics
from common.metrics import Metrics
from common.types import Scores


@pytest.fixture
def recorded(monkeypatch):
    """One memory-backed Metrics per role, in place of this process's Ray-backed ones."""
    made: dict[str, Metrics] = {}

    def fake(role, pool=None):
        return made.setdefault(role, Metrics(backend="memory", role=role, pool=pool or f"{role}-pool"))

    monkeypatch.setattr(actor_metrics, "role_metrics", fake)
    return made


def test_reward_verb_counts_videos_invalid_rows_and_head_means(recorded):
    class Scorer:
        cfg = SimpleNamespace(name="videoalign")

        @actor_metrics.exports_score
        def score(self, values):
            return Scores(["VQ", "TA"], values)

    nan = float("nan")
    out = Scorer().score(torch.tensor([[1.0, 2.0], [3.0, 6.0], [nan, nan]]))
    assert out.values.shape == (3, 2)   # the verb's result passes through untouched
    m = recorded["reward"]
    assert m.pool == "reward-pool"
    assert m.value("vgrpo_videos_scored_total") == 3
    assert m.value("vgrpo_invalid_rewards_total", head="videoalign") == 1
    # means over the valid rows only, per head
    assert m.value("vgrpo_reward", head="VQ") == pytest.approx(2.0)
    assert m.value("vgrpo_reward", head="TA") == pytest.approx(4.0)
    assert m.value("vgrpo_stage_seconds", stage="score")["count"] == 1


def test_learner_rank_zero_speaks_for_the_group(recorded):
    class Rank:
        def __init__(self, rank):
            self.rank = rank

        @actor_metrics.exports_train_step
        def train_step(self, batch):
            return {"loss": 0.5, "kl/d_anchor": 0.01, "adv_std": 0.9, "lr": 1e-4}

        @actor_metrics.exports_weights_payload
        def weights_payload(self):
            return {"w": torch.zeros(4, 8)} if self.rank == 0 else None

    batch = SimpleNamespace(fresh=[1, 2, 3])
    Rank(1).train_step(batch)
    Rank(1).weights_payload()
    assert "learner" not in recorded or not recorded["learner"]._values
    Rank(0).train_step(batch)
    Rank(0).weights_payload()
    m = recorded["learner"]
    assert m.value("vgrpo_train_steps_total") == 1 and m.value("vgrpo_groups_trained_total") == 3
    assert m.value("vgrpo_loss") == 0.5 and m.value("vgrpo_kl", term="anchor") == 0.01
    assert m.value("vgrpo_weight_sync_bytes") == 4 * 8 * 4


def test_rollout_weight_load_times_only_loaded_versions(recorded):
    class Rollout:
        held = 2

        def version(self):
            return self.held

        @actor_metrics.exports_weight_load
        def set_weights(self, payload, version, checksum=None):
            if version <= self.held:
                return False
            self.held = version
            return True

    r = Rollout()
    r.set_weights({"w": torch.zeros(10)}, 1)
    m = recorded["rollout"]
    with pytest.raises(KeyError):
        m.value("vgrpo_weight_sync_seconds")
    assert m.value("vgrpo_policy_version") == 2
    r.set_weights({"w": torch.zeros(10)}, 3)
    assert m.value("vgrpo_weight_sync_seconds")["count"] == 1
    assert m.value("vgrpo_weight_sync_bytes") == 40 and m.value("vgrpo_policy_version") == 3


def test_a_failing_metric_never_fails_the_verb(recorded, caplog):
    class Broken:
        cfg = SimpleNamespace(name="x")

        @actor_metrics.exports_score
        def score(self):
            return "not scores"

    assert Broken().score() == "not scores"
    assert "metrics for score not recorded" in caplog.text


@pytest.mark.parametrize("bank", [{"capacity": 2}], indirect=True)
def test_bank_counts_only_trimmed_entries(bank, recorded):
    """capacity 2 per condition: two groups of 2 bank 4 members, and 2 are trimmed."""
    from bank_helpers import make_group

    for i in range(2):
        bank.push_group(make_group(cid="c", group_id=f"g{i}", version=0, g=2, seed=i))
        bank.commit(bank.pull(1, 0), step=i)
    assert len(bank.entries("c")) == 2
    assert recorded["bank"].value("vgrpo_bank_evictions_total") == 2


@pytest.mark.parametrize("bank", [{"max_bytes": 2 << 20, "capacity": 16}], indirect=True)
def test_every_banked_entry_is_kept_or_counted_as_evicted(bank, recorded):
    """Under the byte bound, room is made at push and at commit; each entry that leaves the
    bank is counted once, wherever it was evicted."""
    from bank_helpers import make_group

    rounds = 12
    for i in range(rounds):  # distinct conditions: no capacity trims, only the byte bound
        bank.push_group(make_group(f"c{i}", f"g{i}", seed=i))
        bank.commit(bank.pull(1, 0), step=i + 1)
    banked = bank.stats()["banked"]
    evicted = recorded["bank"].value("vgrpo_bank_evictions_total")
    assert evicted > 0 and evicted == 4 * rounds - banked


def test_an_object_store_publish_records_the_bytes_the_actors_load(recorded, ray_session):
    """weight_sync.transport=object_store publishes through weights_record (no PublishReport):
    rank 0 records the record's bytes and the publish's seconds; other ranks record nothing."""
    from learner.weight_sync import put_stream, stream_state

    class Rank:
        def __init__(self, rank):
            self.rank = rank

        @actor_metrics.exports_weights_record
        def weights_record(self, version):
            if self.rank != 0:
                return None
            return put_stream(stream_state({"w": torch.zeros(4, 8), "b": torch.zeros(3)}, 1 << 20, version), None)

    Rank(1).weights_record(1)
    assert "learner" not in recorded or not recorded["learner"]._values
    Rank(0).weights_record(1)
    m = recorded["learner"]
    assert m.value("vgrpo_weight_sync_bytes") == (32 + 3) * 4
    assert m.value("vgrpo_stage_seconds", stage="publish")["count"] == 1

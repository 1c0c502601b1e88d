"""common/dispatch.verb on real Ray actors: who gets the call, what comes back, errors surface,
and a collective group's call fails fast when one rank fails while its peers wait on it."""

from __future__ import annotations

import time

import pytest

from common.dispatch import RankFailed, verb


def _rank_class():
    """Defined in a function, so Ray ships the class by value (workers cannot import tests/)."""

    class Rank:
        def __init__(self, r: int):
            self.r, self.calls = r, 0

        def echo(self, x, scale=1):
            self.calls += 1
            return (self.r, x * scale)

        def fail_on(self, r):
            if self.r == r:
                raise ValueError(f"rank {r} failed")
            return self.r

        def count(self):
            return self.calls

        def step(self, fails: int, peers_s: float, dies: bool = False):
            """Rank `fails` raises (or its process exits) at once; the others take peers_s, as
            ranks waiting on it in a collective would until the group's timeout."""
            if self.r == fails:
                if dies:
                    import os

                    os._exit(1)
                raise ValueError(f"rank {fails} ran out of memory")
            time.sleep(peers_s)
            return self.r

    return Rank


class Group:
    to_all = verb("echo")
    to_rank0 = verb("echo", on="rank0")
    every = verb("echo", collect="all")
    fire = verb("echo", collect="none")
    as_ref = verb("echo", ref=True)
    fail = verb("fail_on")
    doubled = verb("echo", post=lambda self, out: (out[0], out[1] * 2))

    def __init__(self, ray, n):
        self.ranks = [ray.remote(_rank_class()).options(num_cpus=0).remote(r) for r in range(n)]


class CollectiveGroup(Group):
    """Ranks of one collective group (LearnerGroup's protocol: a grace, and kill())."""

    step = verb("step")
    rank_failure_grace_s = 1.0

    def __init__(self, ray, n):
        super().__init__(ray, n)
        self.ray, self.killed = ray, 0

    def kill(self):
        self.killed += 1
        for r in self.ranks:
            self.ray.kill(r, no_restart=True)


def test_dispatch_modes_on_real_actors(ray_session):
    ray = ray_session
    g = Group(ray, 3)
    try:
        assert g.to_all(5) == (0, 5)
        assert ray.get([r.count.remote() for r in g.ranks]) == [1, 1, 1]  # every rank ran it
        assert g.to_rank0(2, scale=3) == (0, 6)                        # keyword arguments travel
        assert ray.get([r.count.remote() for r in g.ranks]) == [2, 1, 1]  # rank 0 alone
        assert g.every(1) == [(0, 1), (1, 1), (2, 1)]
        assert g.fire(1) is None
        assert ray.get(g.as_ref(7)) == (0, 7)
        assert g.doubled(4) == (0, 8)
        with pytest.raises(ray.exceptions.RayTaskError, match="rank 2 failed"):
            g.fail(2)                                                  # an error on any rank surfaces
        assert Group.to_rank0.__doc__.startswith("`echo` on rank 0")
    finally:
        for r in g.ranks:
            ray.kill(r)


def test_a_rank_that_fails_while_its_peers_wait_stops_the_group_within_the_grace(ray_session):
    ray = ray_session
    g = CollectiveGroup(ray, 3)
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        g.step(1, peers_s=120)                 # without the grace: 120 s, the peers' collective timeout
    took = time.monotonic() - t0
    assert took < 30, took
    assert isinstance(err.value, ray.exceptions.RayActorError)  # the driver's "learner lost" path
    assert (err.value.rank, err.value.waiting, g.killed) == (1, [0, 2], 1)
    assert "rank 1 failed (ValueError: rank 1 ran out of memory)" in str(err.value)
    assert "rank_failure_grace_s" in str(err.value)
    for r in g.ranks:                          # the waiting ranks were stopped, not left in the call
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(r.count.remote(), timeout=30)


def test_peers_that_end_within_the_grace_give_the_calls_own_errors(ray_session):
    """The rule applies only to peers still in the call: one that finishes within the grace
    (after its own share, or failing too) leaves the group alone, and Ray's error is raised."""
    ray = ray_session
    g = CollectiveGroup(ray, 2)
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="rank 1 ran out of memory"):
            g.step(1, peers_s=0.2)
        assert g.killed == 0 and g.to_all(3) == (0, 3)   # the group still answers
        with pytest.raises(ray.exceptions.RayTaskError, match="rank 0 ran out of memory"):
            g.step(0, peers_s=0.0)
        assert g.killed == 0
    finally:
        g.kill()


def test_a_rank_whose_process_dies_stops_the_group_and_its_death_is_the_error(ray_session):
    ray = ray_session
    g = CollectiveGroup(ray, 2)
    with pytest.raises(RankFailed) as err:
        g.step(1, peers_s=120, dies=True)
    assert err.value.rank == 1 and isinstance(err.value.error, ray.exceptions.RayActorError)
    g2 = CollectiveGroup(ray, 2)
    try:                                        # when the peer ends too, the dead rank's error comes first
        with pytest.raises(ray.exceptions.RayActorError):
            g2.step(1, peers_s=0.1, dies=True)
        assert g2.killed == 0
    finally:
        g2.kill()

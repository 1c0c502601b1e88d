"""common/dispatch.verb on real Ray actors: who gets the call, what comes back, errors surface."""

from __future__ import annotations

import pytest

from common.dispatch import verb


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

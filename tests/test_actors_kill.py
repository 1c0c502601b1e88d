"""kill_and_wait returns only once the actors are gone, so a call right after it fails."""

import pytest


def test_kill_and_wait_leaves_no_actor_answering(ray_session):
    from common.actors import kill_and_wait

    @ray_session.remote(num_cpus=0)
    class Echo:
        def ping(self) -> int:
            return 1

    actors = [Echo.remote() for _ in range(3)]
    assert ray_session.get([a.ping.remote() for a in actors]) == [1, 1, 1]
    assert kill_and_wait(actors, timeout_s=30) == []
    for a in actors:
        with pytest.raises(ray_session.exceptions.RayActorError):
            ray_session.get(a.ping.remote(), timeout=10)
    assert kill_and_wait(actors, timeout_s=5) == []  # already dead: returns at once

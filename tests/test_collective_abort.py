"""A weight-group member killed mid-broadcast: the others return at once, and the group regroups.

Gloo, real Ray: the publisher (this process, rank 0, as learner rank 0 is) streams a version
slowly (each tensor takes a while to produce, as an FSDP gather does) to two restartable actors
that hold a `WeightReceiver`, as rollout actors do. One of them is killed (os.kill, SIGKILL,
from a thread) as soon as its first bucket has arrived. The publisher and the surviving member
must both give up well within `weight_sync.timeout_s`: the publisher's broadcast fails (or it
sees the member's call fail) and it aborts the group, and the survivor, waiting in the
broadcast of a bucket that will never be sent, sees the abort in the group's store. Then the
next version goes to the survivor and to the restarted member over a new group, whole (each
bucket's digest checked on arrival, and the state they hold compared with the one sent). Once
more with a member that drops out of a broadcast alive, which gloo does not report (as NCCL does
not report a machine that vanished): only its Ray call ending tells the publisher.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from common import weights as W
from common.config import WeightSyncConfig
from common.weight_group import WeightSyncTimeout
from learner.weight_sync import WeightPublisher, WeightStream
from rollout_worker.weight_receiver import WeightReceiver

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 30.0          # weight_sync.timeout_s: without the abort, the survivor waits this long
WELL_WITHIN_S = TIMEOUT_S / 4
TENSORS, NUMEL = 16, 16 * 1024   # 16 float32 tensors of 64 KiB: 8 buckets of 128 KiB
PAUSE_S = 0.1                    # producing each tensor (the whole stream: about 1.6 s)


def _member_class():
    """Defined here so that Ray ships it by value (the workers cannot import tests/)."""

    class Member:
        """What a rollout actor does with the collective transport, without a model: join the group,
        take part in a version's broadcasts, keep what arrived (checked bucket by bucket)."""

        def __init__(self):
            self.receiver = WeightReceiver()
            self.version, self.state = 0, {}
            self.armed = False
            self.last: tuple[float, str] | None = None   # when the last receive ended, and how

        def pid(self) -> int:
            return os.getpid()

        def arm(self, how: str) -> None:
            """For the next version: `kill` (killed from a thread once its first bucket has
            arrived) or `leave` (alive, but takes no part in its broadcasts: what a member whose
            death neither gloo nor NCCL reports looks like to the others)."""
            self.armed = how

        def join_weight_group(self, host, port, prefix, rank, world_size, backend, timeout_s) -> int:
            self.receiver.join(host, port, prefix, rank, world_size, backend, timeout_s)
            return rank

        def receive_weights(self, version: int, manifest: dict) -> bool:
            got: dict = {}
            if self.armed == "leave":
                self.armed = False
                raise RuntimeError("left the broadcast")

            def sink(views: dict) -> None:
                got.update({k: v.clone() for k, v in views.items()})
                if self.armed == "kill":
                    self.armed = False
                    threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGKILL), daemon=True).start()

            try:
                self.receiver.receive(manifest, sink)
            except Exception as e:
                self.last = (time.time(), f"{type(e).__name__}: {e}")
                raise
            self.last = (time.time(), "ok")
            self.version, self.state = version, got
            return True

        def held(self) -> dict:
            return {"version": self.version, "checksum": W.checksum(self.state) if self.state else None,
                    "last": self.last, "pid": os.getpid()}

    return Member


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"block.{i:02d}.weight": torch.randn(NUMEL, generator=g) for i in range(TENSORS)}


def _slow_stream(state: dict, bucket_bytes: int, version: int) -> WeightStream:
    """The state as the learner streams it: each tensor produced only when its bucket is filled."""
    m = W.plan(state, bucket_bytes, version)

    def produce():
        for e in m.entries:
            time.sleep(PAUSE_S)
            yield state[e.name]

    return WeightStream(m, produce())


def _back(ray, actor, old_pid: int, timeout_s: float = 60.0) -> int:
    """The actor's pid once Ray has restarted it as a new process."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid = ray.get(actor.pid.remote(), timeout=timeout_s)
            if pid != old_pid:
                return pid
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            pass
        assert time.monotonic() < deadline, "the killed member was not restarted"
        time.sleep(0.2)


def _failed_publish(pub, ray, survivor, version: int, culprit: str) -> str:
    """Publish `version` while a member drops out; the publisher and the survivor must both be
    back well within the timeout (the survivor only answers once its broadcast has ended)."""
    t0 = time.time()
    with pytest.raises(WeightSyncTimeout, match=culprit) as failed:
        pub.publish(_slow_stream(_state(version), pub.cfg.bucket_bytes, version), version)
    publisher_s = time.time() - t0
    held = ray.get(survivor.held.remote(), timeout=TIMEOUT_S)
    assert held["last"] is not None, held
    when, how = held["last"]
    assert publisher_s < WELL_WITHIN_S, (publisher_s, str(failed.value))
    assert when - t0 < WELL_WITHIN_S, (when - t0, how)
    assert how.startswith("WeightGroupAborted") and "aborted by rank 0" in how, how
    assert held["version"] < version                 # a version cut short is not taken
    return str(failed.value)


def _whole(ray, pub, members, version: int) -> list[dict]:
    """The next version reaches every member whole (digests checked per bucket on arrival; the
    state each holds compared with the one sent)."""
    state = _state(version)
    assert pub.publish(_slow_stream(state, pub.cfg.bucket_bytes, version), version).answers == [True, True]
    held = ray.get([m.held.remote() for m in members], timeout=30)
    assert [(h["version"], h["checksum"]) for h in held] == [(version, W.checksum(state))] * 2
    return held


def test_member_killed_mid_broadcast_others_return_at_once_and_next_version_arrives_whole(ray_session):
    ray = ray_session
    remote = ray.remote(num_cpus=0, max_restarts=1)(_member_class())
    members = [remote.remote(), remote.remote()]
    pids = ray.get([m.pid.remote() for m in members], timeout=120)
    cfg = WeightSyncConfig(transport="collective", checksum="fast", timeout_s=TIMEOUT_S,
                           bucket_mb=TENSORS * NUMEL * 4 / 8 / 2**20)
    pub = WeightPublisher(cfg, members, names=["rollout actor 0", "rollout actor 1"])
    try:
        # version 1: actor 1 is killed once its first bucket is in; actor 0 is left waiting for
        # a bucket that will never come (without the abort, until its timeout)
        ray.get(members[1].arm.remote("kill"), timeout=30)
        msg = _failed_publish(pub, ray, members[0], 1, r"rollout actor 1 died")
        assert "rollout actor 0 (left with the group)" in msg, msg
        # it comes back as a new process; the next publish regroups around it
        new_pid = _back(ray, members[1], pids[1])
        held = _whole(ray, pub, members, 2)
        assert [h["pid"] for h in held] == [pids[0], new_pid]
        # version 3: actor 0 leaves the broadcast without a word from gloo (as a member on a
        # machine that vanished would): the publisher sees its call end and aborts the group
        ray.get(members[0].arm.remote("leave"), timeout=30)
        _failed_publish(pub, ray, members[1], 3, r"rollout actor 0 failed: RuntimeError: left the broadcast")
        _whole(ray, pub, members, 4)
    finally:
        pub.close()
        for m in members:
            ray.kill(m)

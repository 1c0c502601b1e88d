"""Waiting for the role actors to load: the first one that fails stops the run at once, in one line.

The driver creates every role's actors and then waits for them (the reward models' heads, the
learner's setup, the rollout actors' first ping). `Startup.get` is that wait: like `ray.get`, but
while it waits it looks, once a second, at every actor it watches. An actor whose load raised,
or whose process died while loading (which Ray would restart up to max_restarts times, each
time loading again), ends the wait with `RoleFailed`: the actor, its node and its own error in
one line, instead of a traceback after the wait's timeout (a reward model's 900 s, a learner's
load_timeout_s).
"""

from __future__ import annotations

import time
from typing import Any

from cluster.driver.errors import RoleFailed
from common.errors import last_line

POLL_S = 1.0
SETUP_HINT = "fix it and start the run again"


class Startup:
    def __init__(self, poll_s: float = POLL_S):
        self.poll_s = poll_s
        self.watched: dict[str, Any] = {}  # actor id (hex) -> label

    def watch(self, label: str, actor) -> None:
        self.watched[actor._actor_id.hex()] = label

    def get(self, refs: list, timeout_s: float, labels: list[str] | None = None, what: str = "") -> list:
        """ray.get(refs, timeout=timeout_s), ended at once by a watched actor that fails, or by a
        ref that fails (`labels[i]` names the actor behind refs[i])."""
        import ray  # heavy: ray

        refs = list(refs)
        labels = labels or [what or "a role actor"] * len(refs)
        pending = dict(zip(refs, labels, strict=True))
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ray.exceptions.GetTimeoutError(
                    f"{', '.join(sorted(set(pending.values())))}: not ready within {timeout_s:.0f} s")
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(self.poll_s, left))
            for ref in ready:
                label = pending.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise RoleFailed(self._line(label, self._cause(e), self._node(e))) from None
            self.check()
        return ray.get(refs)

    def check(self) -> None:
        """RoleFailed for the first watched actor that died or is restarting (its load failed)."""
        for info in _actor_states(set(self.watched)):
            restarts = int(info.get("NumRestarts") or 0)
            if info.get("State") in ("DEAD", "RESTARTING") or restarts > 0:
                node = (info.get("Address") or {}).get("IPAddress") or "?"
                why = _death_cause(info.get("DeathCause"))
                if restarts and info.get("State") != "DEAD":
                    why = f"its process died while loading and Ray is restarting it ({why})"
                raise RoleFailed(self._line(self.watched[info["ActorID"]], why, node))

    @staticmethod
    def _line(label: str, why: str, node: str) -> str:
        return f"{label} failed while it loaded, on node {node}: {why}; {SETUP_HINT}"

    def _cause(self, e: BaseException) -> str:
        """The actor's own error: from Ray's record of its death when it has one (a failed
        constructor, a killed process), else the error's last line."""
        import ray  # heavy: ray

        actor_id = getattr(e, "actor_id", None)
        if isinstance(e, ray.exceptions.ActorDiedError) and actor_id:
            for info in _actor_states({actor_id}):
                return _death_cause(info.get("DeathCause"))
        return last_line(e)

    @staticmethod
    def _node(e: BaseException) -> str:
        ip = getattr(getattr(e, "cause", None), "ip", None) or getattr(e, "ip", None)
        if ip:
            return str(ip)
        actor_id = getattr(e, "actor_id", None)
        for info in _actor_states({actor_id} if actor_id else set()):
            return (info.get("Address") or {}).get("IPAddress") or "?"
        return "?"


def _actor_states(ids: set[str]) -> list[dict]:
    """Ray's record (GCS) of each actor in `ids`; [] where Ray does not say."""
    if not ids:
        return []
    import ray  # heavy: ray

    try:
        if len(ids) == 1:
            table = {i: ray._private.state.actors(actor_id=i) for i in ids}
        else:  # one call for the job's actors
            table = ray._private.state.actors(job_id=ray.JobID.from_hex(ray.get_runtime_context().get_job_id()))
    except Exception:  # noqa: BLE001 - a debugging API: the refs' own errors still stop the wait
        return []
    return [dict(info, ActorID=i) for i, info in table.items() if i in ids and info]


def _death_cause(cause) -> str:
    """One line from Ray's ActorDeathCause: the constructor's exception, or how the process died."""
    if cause is None:
        return "it died"
    try:
        if cause.HasField("creation_task_failure_context"):
            text = cause.creation_task_failure_context.formatted_exception_string
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            return lines[-1][:300] if lines else "its constructor raised"
        if cause.HasField("actor_died_error_context"):
            msg = cause.actor_died_error_context.error_message
            return msg.split(" Some common causes")[0].strip()[:300]
    except (AttributeError, ValueError):
        pass
    return str(cause).strip().splitlines()[0][:300] if str(cause).strip() else "it died"

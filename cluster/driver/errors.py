"""How the control loop stops, and how it rides out a Redis outage."""

from __future__ import annotations

from common.errors import UserError
from common.retry import retry_outage


class StopRun(Exception):
    """Raised inside the loop when the run cannot go on (the reason is in the message)."""


class ClusterRefused(UserError):
    """The cluster cannot run this config (cluster/driver/cluster_check.py): one line per failure,
    each naming the role, the node and the fix."""


class RoleFailed(UserError):
    """A role's actor failed while it loaded (cluster/driver/startup.py): one line naming the actor,
    its node and its error; the run stops at once instead of waiting out a timeout."""


class LeaseStop(StopRun):
    """Another run holds the bank's lease: one line, whichever path found out (the driver's lease
    thread, or a bank script's refusal, LeaseLost, on the driver, the learner or a rollout actor)."""

    def __init__(self, namespace: str):
        super().__init__(f"lost the bank lease on namespace {namespace!r} to another run; this run "
                         "stops without training, committing or checkpointing further")


def is_lease_lost(e: BaseException) -> bool:
    """A bank script's LeaseLost, raised here or in an actor (Ray wraps it: the cause is kept)."""
    from memory_bank.errors import LeaseLost  # heavy: torch, redis

    return isinstance(e, LeaseLost) or isinstance(getattr(e, "cause", None), LeaseLost)


class ConfigStop(StopRun):
    """The run cannot go on with its settings (bank.max_bytes below one step's groups): it stops
    like any StopRun, with a checkpoint, and `vgrpo train` exits 2 (bad input) instead of 1."""


def bank_call(what: str, fn, *args, outage_s: float, metrics=None, **kw):
    """A bank call (here, or on an actor through Ray) retried with backoff while Redis is
    unreachable, for up to `outage_s` (common/retry.py); then StopRun naming the call and cause."""
    from memory_bank.errors import BankUnavailable  # heavy: torch, redis

    def count(*_) -> None:
        if metrics is not None:
            metrics.inc("vgrpo_errors_total", 1, kind="redis_unreachable")

    try:
        return retry_outage(lambda: fn(*args, **kw), outage_s=outage_s, what=what, errors=BankUnavailable,
                            on_retry=count)
    except BankUnavailable as e:
        raise StopRun(f"memory bank unreachable for {outage_s:.0f}s during {what} "
                      f"({str(e).splitlines()[0]}); stopping") from None

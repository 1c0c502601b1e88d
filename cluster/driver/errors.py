"""How the control loop stops, and how it rides out a Redis outage."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("vgrpo.driver")


class StopRun(Exception):
    """Raised inside the loop when the run cannot go on (the reason is in the message)."""


def bank_call(what: str, fn, *args, outage_s: float, metrics=None, **kw):
    """A bank call (here, or on an actor through Ray) retried with backoff while Redis is
    unreachable, for up to `outage_s`; then StopRun with the call's name and the cause."""
    import ray

    from memory_bank.errors import BankUnavailable

    deadline, delay = time.monotonic() + outage_s, 0.25
    while True:
        try:
            return fn(*args, **kw)
        except (BankUnavailable, ray.exceptions.RayTaskError) as e:
            cause = e if isinstance(e, BankUnavailable) else getattr(e, "cause", None)
            if not isinstance(cause, BankUnavailable):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise StopRun(f"memory bank unreachable for {outage_s:.0f}s during {what} "
                              f"({str(cause).splitlines()[0]}); stopping") from None
            if metrics is not None:
                metrics.inc("vgrpo_errors_total", 1, kind="redis_unreachable")
            log.warning("%s; retrying %s in %.1fs (%.0fs left)", cause, what, min(delay, left), left)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)

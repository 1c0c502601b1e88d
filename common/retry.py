"""One retry loop for outages: a call retried with backoff while a service is unreachable.

The rollout actor's push into the memory bank and the driver's bank calls both ride out a
Redis outage for `bank.outage_s`: 0.25 s doubling to 5 s between tries, then the last error is
raised and the caller says what stops. The error type is a parameter (common imports no role),
so `errors=BankUnavailable` from memory_bank.errors is what both pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_DELAY_S, MAX_DELAY_S = 0.25, 5.0


def outage_cause(e: BaseException, errors: type[BaseException] | tuple[type[BaseException], ...]
                 ) -> BaseException | None:
    """The outage error `e` is or carries, else None. An error a remote call raised comes back
    wrapped (Ray's RayTaskError); its `cause` is the error the callee raised."""
    if isinstance(e, errors):
        return e
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, errors) else None


def retry_outage(fn: Callable[[], T], *, outage_s: float, what: str,
                 errors: type[BaseException] | tuple[type[BaseException], ...],
                 on_retry: Callable[[BaseException, float, float], None] | None = None) -> T:
    """`fn()`, retried while it raises one of `errors` (or a wrapper whose `cause` is one), for up
    to `outage_s` seconds from the first try. Any other error goes up at once; once the time is
    spent the last outage error is raised itself. `on_retry(error, delay_s, left_s)` runs before
    each wait (a metric, say); `what` names the call in the log line."""
    deadline, delay = time.monotonic() + outage_s, FIRST_DELAY_S
    while True:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 — sorted below: only an outage is retried
            cause = outage_cause(e, errors)
            if cause is None:
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise cause from None
            wait = min(delay, left)
            if on_retry is not None:
                on_retry(cause, wait, left)
            log.warning("%s; retrying %s in %.1fs (%.0fs left)", str(cause).splitlines()[0], what, wait, left)
            time.sleep(wait)
            delay = min(delay * 2, MAX_DELAY_S)

"""Whether a process of this host is alive, for the records that name one (a run's status.json,
a bank lease): stdlib only, so any role may ask."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True unless `pid` is certainly gone; another user's process, or a value no pid can have
    (a stored number out of range), counts as alive: nothing is taken from a holder in doubt."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True

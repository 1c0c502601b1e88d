"""The one mark of a user error: the input or the environment is wrong, not the program.

The CLI prints such an error as one line and exits 2, with no traceback; raised inside a Ray
actor it still is one (the CLI reads the `cause` Ray wraps it in). Each error class adds the
Python type its callers already catch (ValueError, FileNotFoundError, ...)."""

from __future__ import annotations


class UserError(Exception):
    """Input or environment the user must fix; the message names the field or file and the fix."""


def last_line(e: BaseException, limit: int = 300) -> str:
    """The cause's own message: its type and the last non-empty line, cut to a readable length
    (a Ray error's `cause` is the error the actor raised)."""
    cause = getattr(e, "cause", None) or e
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    text = f"{type(cause).__name__}: {lines[-1]}" if lines else type(cause).__name__
    return text if len(text) <= limit else text[:limit] + "…"

"""The one mark of a user error: the input or the environment is wrong, not the program.

The CLI prints such an error as one line and exits 2, with no traceback; raised inside a Ray
actor it still is one (the CLI reads the `cause` Ray wraps it in). Each error class adds the
Python type its callers already catch (ValueError, FileNotFoundError, ...)."""

from __future__ import annotations


class UserError(Exception):
    """Input or environment the user must fix; the message names the field or file and the fix."""

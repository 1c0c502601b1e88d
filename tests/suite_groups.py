"""How `make test` splits the suite between its two pytest-xdist workers (`-n 2 --dist loadgroup`).

Every test that touches the session's Ray (the `ray_session` or `ray_address` fixture, or the mark
`pytest.mark.session_ray` where it asks for one through `request.getfixturevalue`) is in ONE unit
of work: one worker runs them in order on the one Ray the session starts, as a serial run
would. Every other test goes with its file, so the other worker takes the unit tests and the CLI
runs that start a Ray of their own. A test that shares a module-scoped fixture (a finished run, a
cluster of namespaces) with a test on the session's Ray goes with it, so that fixture is built
once, on one worker.

Why: the end-to-end tests keep about 1.5 of the 2 cores busy (their actors start and import in
parallel); the others are single-threaded and left the second core idle. A second worker that
also started a session Ray would pay its start and run two Ray-heavy tests at once (measured:
10 % gain with the CPU 95 % busy); this split keeps one session Ray.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

SESSION_RAY = "session-ray"
SESSION_RAY_FIXTURES = frozenset({"ray_session", "ray_address"})


@dataclass(frozen=True)
class Entry:
    nodeid: str
    fixtures: frozenset[str]         # every fixture it uses, directly or through others
    module_fixtures: frozenset[str]  # those of them built once per module (or class, or package)
    marked: bool = False             # pytest.mark.session_ray

    @property
    def file(self) -> str:
        return self.nodeid.split("::", 1)[0]


def groups(tests: Iterable[Entry]) -> dict[str, str]:
    """{nodeid: xdist group}: SESSION_RAY, or the test's file."""
    tests = list(tests)
    ray = {t.nodeid for t in tests if t.marked or SESSION_RAY_FIXTURES & t.fixtures}
    grew = True
    while grew:  # a module fixture a session-ray test uses takes the file's other users along
        shared = {(t.file, f) for t in tests if t.nodeid in ray for f in t.module_fixtures}
        joined = {t.nodeid for t in tests if t.nodeid not in ray and any((t.file, f) in shared for f in t.module_fixtures)}
        ray |= joined
        grew = bool(joined)
    return {t.nodeid: SESSION_RAY if t.nodeid in ray else t.file for t in tests}

"""Fan-out verbs for a group of Ray actors that act as one role (verl's dispatch/collect pairs).

A group class lists its verbs declaratively instead of writing each fan-out by hand:

    class LearnerGroup:
        commit = verb("commit", on="rank0")           # only rank 0 holds the bank connection
        save_policy = verb("save_policy", collect="none")  # every rank joins the gather

- `on="all"`: the same arguments to every actor; every call is awaited (a collective needs
  every rank, and an error on any rank surfaces).
- `on="rank0"`: the call goes to the first actor only.
- `collect="rank0"`: the first actor's result; `"all"`: the list; `"none"`: None.
- `ref=True`: return rank 0's ObjectRef without waiting (the other calls still run).

The owning object has `ranks`, a list of actor handles. When it also has `rank_failure_grace_s`
and `kill()`, its ranks are one collective group: a call that fails on one rank (or whose process
dies) while others are still running leaves them waiting on it in a collective that cannot
complete until the group's own timeout (learner.collective_timeout_s, 30 min by default, on
every GPU of the group). `ray.get` raises the first error at once, but the group's next call
would queue behind the waiting ones, and the group would go on out of step. So the others get
`rank_failure_grace_s` to finish or fail too; past it the ranks are killed and `RankFailed` (a
`RayActorError`: the group is gone) names the rank and its error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import ray

from common.errors import last_line


class RankFailed(ray.exceptions.RayActorError):
    """One rank's call failed while its peers were still in it: the group was stopped."""

    def __init__(self, rank: int, waiting: list[int], cause: BaseException, grace_s: float):
        self.rank, self.waiting, self.error, self.grace_s = rank, waiting, cause, grace_s
        who = f"rank {waiting[0]} was" if len(waiting) == 1 else f"ranks {', '.join(map(str, waiting))} were"
        super().__init__(error_msg=(
            f"rank {rank} failed ({last_line(cause)}) while {who} "
            f"still in the call {grace_s:g} s later (learner.rank_failure_grace_s): they were waiting "
            "on it in a collective that cannot complete, and the group's ranks were stopped"))

    def __reduce__(self):  # pickles as what it is (Ray ships errors between processes)
        return (RankFailed, (self.rank, self.waiting, self.error, self.grace_s))


def why_lost(e: BaseException) -> str:
    """What a lost group's error says in a one-line message: RankFailed's own account, else the
    error's type (Ray's actor-death text is pages long)."""
    return str(e) if isinstance(e, RankFailed) else type(e).__name__


def verb(method: str, *, on: Literal["all", "rank0"] = "all",
         collect: Literal["rank0", "all", "none"] = "rank0", ref: bool = False,
         post: Callable[[Any, Any], Any] | None = None, doc: str | None = None):
    """A method that dispatches `method` to the group's ranks and collects the result;
    `post(self, result)` may turn the collected result into what the caller gets."""

    def call(self, *args: Any, **kwargs: Any) -> Any:
        ranks = self.ranks if on == "all" else self.ranks[:1]
        refs = [getattr(r, method).remote(*args, **kwargs) for r in ranks]
        if ref:
            return refs[0]
        grace_s = getattr(self, "rank_failure_grace_s", None)
        values = ray.get(refs) if grace_s is None or len(refs) < 2 else in_step(refs, grace_s, self.kill)
        out = values[0] if collect == "rank0" else values if collect == "all" else None
        return post(self, out) if post is not None else out

    call.__name__ = method
    call.__doc__ = doc or f"`{method}` on {'every rank' if on == 'all' else 'rank 0'}, {collect} collected."
    return call


def in_step(refs: list, grace_s: float, kill: Callable[[], Any]) -> list:
    """`ray.get(refs)` for the calls of one collective group, which fails fast: once a call has
    failed, the others get `grace_s` to end; if some are still running then, `kill()` and
    RankFailed. Of several errors, a dead rank's comes first (the group is gone), then the lowest
    rank's, each raised as Ray raised it."""
    index = {r: i for i, r in enumerate(refs)}
    values: list = [None] * len(refs)
    errors: dict[int, BaseException] = {}

    def take(ready: list) -> None:
        for r in ready:
            try:
                values[index[r]] = ray.get(r)
            except ray.exceptions.RayError as e:
                errors[index[r]] = e

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        take(ready)
        if errors and pending:  # the rest get the grace, together
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
            take(ready)
            if pending:
                first = min(errors)
                kill()
                raise RankFailed(first, sorted(index[r] for r in pending), errors[first], grace_s) \
                    from errors[first]
    if errors:
        dead = [i for i, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)]
        raise errors[min(dead or errors)]
    return values

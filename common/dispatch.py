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

The owning object has `ranks`, a list of actor handles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal


def verb(method: str, *, on: Literal["all", "rank0"] = "all",
         collect: Literal["rank0", "all", "none"] = "rank0", ref: bool = False,
         post: Callable[[Any, Any], Any] | None = None, doc: str | None = None):
    """A method that dispatches `method` to the group's ranks and collects the result;
    `post(self, result)` may turn the collected result into what the caller gets."""

    def call(self, *args: Any, **kwargs: Any) -> Any:
        import ray

        ranks = self.ranks if on == "all" else self.ranks[:1]
        refs = [getattr(r, method).remote(*args, **kwargs) for r in ranks]
        if ref:
            return refs[0]
        values = ray.get(refs)
        out = values[0] if collect == "rank0" else values if collect == "all" else None
        return post(self, out) if post is not None else out

    call.__name__ = method
    call.__doc__ = doc or f"`{method}` on {'every rank' if on == 'all' else 'rank 0'}, {collect} collected."
    return call

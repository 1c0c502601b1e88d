"""What the driver process takes out of Ray: the spy the data-plane assertions read
(tests/test_e2e_driver.py). Group tensors must never reach the driver: every object it takes out of
Ray (`ray.get`, from any of its threads) is walked and its tensor/array/bytes payload summed, and its
own bank connection must never push, pull or commit."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

DATA_TYPES = ("Group", "Trajectory", "TrainBatch", "Scores")


def payload_bytes(obj, seen: set | None = None) -> tuple[int, set[str]]:
    """(bytes of tensors, arrays and byte strings inside obj, names of the classes met)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0, set()
    seen.add(id(obj))
    names = {type(obj).__name__}
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), names
    if isinstance(obj, np.ndarray):
        return obj.nbytes, names
    if isinstance(obj, bytes | bytearray | memoryview):
        return len(obj), names
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple | set):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        items = []
    total = 0
    for x in items:
        n, more = payload_bytes(x, seen)
        total += n
        names |= more
    return total, names


class DriverIngress:
    """Counts what the driver process takes out of Ray, and its own bank's data calls."""

    def __init__(self, monkeypatch, driver):
        import ray

        self.bytes, self.types, self.calls = 0, set(), 0
        self.bank_data_calls: list[str] = []
        real_get = ray.get

        def get(refs, *a, **kw):
            out = real_get(refs, *a, **kw)
            n, names = payload_bytes(out)
            self.bytes += n
            self.types |= names
            self.calls += 1
            return out

        monkeypatch.setattr(ray, "get", get)
        for verb in ("push_group", "pull", "commit"):
            def spy(*a, _verb=verb, _real=getattr(driver.bank, verb), **kw):
                self.bank_data_calls.append(_verb)
                return _real(*a, **kw)
            monkeypatch.setattr(driver.bank, verb, spy)

"""The rollout side of the `collective` weight transport.

A RolloutActor owns one WeightReceiver: `join` connects to the publisher's group as rank
1..n, `receive` takes a manifest, joins the publisher's broadcast of each bucket, rebuilds
the state dict and verifies the checksum. Loading it (and ignoring a stale version) stays
with the actor's `set_weights`, so both transports end in the same place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common import weights as W
from common.weight_group import Backend, WeightSyncTimeout, join_as_peer


class WeightReceiver:
    def __init__(self) -> None:
        self._pg = None
        self.rank: int | None = None

    @property
    def joined(self) -> bool:
        return self._pg is not None

    def join(self, host: str, port: int, prefix: str, rank: int, world_size: int,
             backend: Backend, timeout_s: float) -> None:
        """Join (or re-join: the old group is dropped) the publisher's weight group."""
        self._pg = None
        self._pg = join_as_peer(host, port, prefix, rank, world_size, backend, timeout_s)
        self.rank = rank

    def receive(self, manifest: dict, device: torch.device | str = "cpu") -> tuple[W.Manifest, dict[str, Tensor]]:
        """Receive one version's buckets; returns (manifest, verified state dict on `device`)."""
        if self._pg is None:
            raise RuntimeError("receive_weights called before join_weight_group")
        m = W.Manifest.from_dict(manifest)
        buckets = W.empty_buckets(m, device)
        try:
            for b in buckets:
                self._pg.broadcast(b, 0).wait()  # bounded by the group's timeout
        except RuntimeError as e:
            self._pg = None  # the publisher rebuilds the group after a failure
            raise WeightSyncTimeout(f"weight group rank {self.rank}: broadcast of version "
                                    f"{m.version} from the publisher failed ({e})") from None
        state = W.unflatten(m, buckets)
        W.verify(state, m.checksum, who=f"weight group rank {self.rank}, version {m.version}")
        return m, state


# --- the object-store transport's payload --------------------------------------------------

class PackedWeights:
    """A weights payload as numpy arrays: Ray stores numpy buffers out of band, so one
    `ray.put` writes each tensor's bytes once and every reader maps them without a copy
    (torch tensors are pickled instead: a copy on put and another on every get)."""

    def __init__(self, arrays: dict, dtypes: dict[str, str]):
        self.arrays, self.dtypes = arrays, dtypes

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack(payload: dict[str, Tensor]) -> PackedWeights:
    """Zero-copy numpy views of CPU tensors (dtypes numpy lacks, such as bf16, as same-size ints)."""
    arrays, dtypes = {}, {}
    for name, t in payload.items():
        t = t.detach().cpu().contiguous()
        dtypes[name] = str(t.dtype).removeprefix("torch.")
        try:
            arrays[name] = t.numpy()
        except TypeError:
            arrays[name] = t.view(_SAME_SIZE[t.element_size()]).numpy()
    return PackedWeights(arrays, dtypes)


def unpack(packed: PackedWeights) -> dict[str, Tensor]:
    """Tensors viewing the packed arrays (read-only when they come from the object store:
    load them with a copy, as load_state_dict does)."""
    import warnings

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": we only read it
        for name, a in packed.arrays.items():
            t = torch.from_numpy(a)
            want = getattr(torch, packed.dtypes[name])
            out[name] = t if t.dtype == want else t.view(want)
    return out

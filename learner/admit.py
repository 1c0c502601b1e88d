"""What a pulled batch may train on: an entry that decodes but does not fit this run is taken
out before the step, never left to crash it (docs/reliability.md).

The codec already refuses what is wrong inside an entry (memory_bank/codec.py). What it cannot
know is this run: its model and its sampling settings. Two kinds of misfit, each handled one way:

- **other settings**: sampled with another SDE scheme, η or schedule than this run's (a resume
  with changed `sde.*` or `schedule.*` meets the old run's queued groups and banked entries).
  Nothing is wrong with them; they are not this run's data. A fresh group of them is dropped and
  its condition drawn again; a banked entry is evicted.
- **untrainable**: a latent shape that is not this model's, a policy version the learner has not
  reached, no encoded condition. Quarantined with the reason (MemoryBank.quarantine: a dead letter,
  counted and listed); a fresh group of them is drawn again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sde import SchemeSpec
from common.types import TrainBatch, Trajectory


@dataclass(frozen=True)
class Admission:
    """This run's expectations of a trajectory."""

    spec: SchemeSpec                    # what this run's rollouts are stamped with (common.sde.rollout_spec)
    latent_shape: tuple[int, ...]       # (C, F, H, W) of this model's latents

    def other_settings(self, t: Trajectory) -> str | None:
        if t.spec == self.spec:
            return None
        return f"sampled with {t.spec.describe()}; this run samples with {self.spec.describe()}"

    def untrainable(self, t: Trajectory, version: int) -> str | None:
        shape = tuple(t.final_latents.shape)
        if shape != self.latent_shape:
            return f"latent shape {list(shape)} is not this model's {list(self.latent_shape)}"
        if not 0 <= t.policy_version <= version:
            return f"policy version {_short(t.policy_version)} is outside 0..{version} (the learner's)"
        if t.cond is None:
            return "no encoded condition"
        return None


@dataclass
class Verdict:
    """What `admit` took out of a batch (the batch itself is edited in place)."""

    resampled: dict[str, str] = field(default_factory=dict)     # fresh group id -> why (other settings)
    quarantined: dict[str, str] = field(default_factory=dict)   # fresh group id -> why (untrainable)
    quarantine: dict[str, str] = field(default_factory=dict)    # entry id -> why: the bank's dead letters
    evict: dict[str, list[str]] = field(default_factory=dict)   # condition id -> banked entry ids (other settings)
    evicted_why: str = ""                                       # the first evicted entry's settings
    banked_quarantined: list[str] = field(default_factory=list) # one line per banked entry quarantined

    @property
    def dropped(self) -> dict[str, str]:
        """Fresh group id -> why, for the driver (PullReceipt.reasons; its first word is the kind)."""
        return {**{g: f"other settings: {w}" for g, w in self.resampled.items()},
                **{g: f"quarantined: {w}" for g, w in self.quarantined.items()}}

    def notes(self) -> list[str]:
        """Lines for the driver's log about the banked entries taken out (dropped groups have their own)."""
        n = sum(map(len, self.evict.values()))
        evicted = [f"bank: evicted {n} banked entr{'y' if n == 1 else 'ies'} sampled with other settings "
                   f"({self.evicted_why})"] if n else []
        return evicted + self.banked_quarantined


def admit(batch: TrainBatch, adm: Admission, version: int) -> Verdict:
    """Take the misfits out of `batch`: fresh groups with any misfit member, banked entries that
    misfit. A group is judged whole (its advantages are relative to all its members)."""
    out, keep = Verdict(), []
    bank = batch.bank or [[] for _ in batch.fresh]
    for group, entries in zip(batch.fresh, bank, strict=True):
        settings = next(filter(None, map(adm.other_settings, group.members)), None)
        bad = {t.bank_id: why for t in group.members if (why := adm.untrainable(t, version)) is not None}
        if bad:
            out.quarantined[group.group_id] = next(iter(bad.values()))
            out.quarantine.update({eid: why for eid, why in bad.items() if eid})
        elif settings is not None:
            out.resampled[group.group_id] = settings
        else:
            keep.append((group, _banked(group.condition.id, entries, adm, version, out)))
    batch.fresh = [g for g, _ in keep]
    batch.bank = [e for _, e in keep]
    return out


def _banked(cid: str, entries: list, adm: Admission, version: int, out: Verdict) -> list:
    usable = []
    for entry in entries:
        t = entry[0]
        if (why := adm.untrainable(t, version)) is not None:
            if t.bank_id in out.quarantine:
                continue
            out.quarantine[t.bank_id] = why
            out.banked_quarantined.append(f"bank: quarantined banked entry {t.bank_id} of condition {cid} ({why})")
        elif (why := adm.other_settings(t)) is not None:
            if t.bank_id not in (ids := out.evict.setdefault(cid, [])):  # two groups of one condition share it
                ids.append(t.bank_id)
            out.evicted_why = out.evicted_why or why
        else:
            usable.append(entry)
    return usable


def _short(v: int) -> str:
    s = str(v)
    return s if len(s) <= 20 else s[:8] + f"…({len(s)} digits)"

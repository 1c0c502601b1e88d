"""Training health: the checks users of diffusion RL trainers otherwise do by hand.

`HealthMonitor` is fed one step record at a time (cluster/driver/step_record.py's row) and, every
`health.eval_every` steps, one held-out ODE evaluation (cluster/evaluation/evaluate.EvalResult). Each check
is a small function returning `(check, message)` pairs; the monitor gives them the level the
config asks for (`health.stop_on` / `health.off`, else warn) and keeps the run's health summary.

Checks:
- numerics     the first update: max |log r| over rows the current weights sampled, recomputed by
               the learner, against health.numerics_frac·grpo.clip_eps (sampler/learner mismatch);
               and health.nonfinite_max optimizer steps in a row skipped for a non-finite loss or
               gradient (learner/finite_guard.py)
- clip         clip fraction of on-policy rows above health.clipfrac_max
- approx_kl    approximate KL of on-policy rows above health.approx_kl_max
- zero_spread  share of groups whose rewards are all equal, and which heads are saturated
- head_against a reward head trending down while the composite trends up (slope z over a window)
- kl_growth    the KL to the anchor (or D_step) growing more than health.kl_growth_max× in a window
- hacking      held out: the training reward rises while a held-out head falls (paired z)
- stagnation   held out: no head moves over health.stagnation_evals evaluations (paired z)

Pure: no Ray; the step records' spread keys (`SPREAD_PREFIX`) are made on the learner
(learner/advantages.group_spread).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from rich.table import Table

from cluster.evaluation.evaluate import paired
from common.config import RunConfig
from common.methods import kl_of
from learner.advantages import SPREAD_PREFIX

CHECKS = ("numerics", "clip", "approx_kl", "zero_spread", "head_against", "kl_growth", "hacking", "stagnation")
LEVEL_CODE = {"ok": 0, "warn": 1, "stop": 2}
Message = tuple[str, str]           # (check, one-line message)


@dataclass(frozen=True)
class Finding:
    check: str
    level: Literal["warn", "stop"]
    step: int
    message: str

    def line(self) -> str:
        return f"health {self.level} at step {self.step}: {self.check}: {self.message}"


# --- statistics ---------------------------------------------------------------------------

def slope_z(ys: Sequence[float]) -> float:
    """t-statistic of the least-squares slope of ys over 0..n-1 (0 with under three finite points;
    ±inf for an exact line)."""
    pts = [(float(i), float(y)) for i, y in enumerate(ys) if y is not None and math.isfinite(y)]
    n = len(pts)
    if n < 3:
        return 0.0
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in pts)
    scale = max(abs(my), max(abs(y) for _, y in pts), 1e-12)
    if resid <= (1e-12 * scale) ** 2 * n:  # an exact line: the sign of the slope, if any
        return 0.0 if abs(slope) <= 1e-12 * scale else math.copysign(math.inf, slope)
    se = math.sqrt(resid / (n - 2) / sxx)
    return slope / se


def _num(record: dict[str, Any], key: str) -> float:
    v = record.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.nan


# --- per-step checks (each returns its messages) -------------------------------------------

def check_numerics(record: dict[str, Any], cfg: RunConfig) -> list[Message]:
    v, n = _num(record, "logratio_onpolicy_absmax"), _num(record, "onpolicy_rows")
    limit = cfg.health.numerics_frac * cfg.grpo.clip_eps
    if not v > limit:  # NaN (no on-policy rows) passes here; the monitor waits for a step with some
        return []
    return [("numerics", f"max |log r| = {v:.2e} on {n:.0f} on-policy rows recomputed with the weights that "
             f"sampled them exceeds {cfg.health.numerics_frac:g}·grpo.clip_eps = {limit:.1e}, so ratios are "
             "clipped by numerics alone; likely causes: a dtype/autocast mismatch between sampler and learner, "
             "a different sde.scheme, η or σ schedule, or classifier-free guidance differing between them")]


def check_nonfinite(record: dict[str, Any], cfg: RunConfig, in_a_row: int) -> list[Message]:
    """`in_a_row` steps skipped by the finite-update guard, this one included."""
    n = cfg.health.nonfinite_max
    if in_a_row < n:
        return []
    return [("numerics", f"{in_a_row} optimizer steps in a row had a non-finite loss or gradient and were skipped "
             f"(health.nonfinite_max = {n}; the weights are unchanged, nothing trains); the last from group(s) "
             f"{record.get('nonfinite_groups')}: check those groups' latents and rewards, or lower optim.lr")]


def check_on_policy(record: dict[str, Any], cfg: RunConfig) -> list[Message]:
    out: list[Message] = []
    h = cfg.health
    clip, akl = _num(record, "clipfrac_onpolicy"), _num(record, "approx_kl_onpolicy")
    if clip > h.clipfrac_max:
        out.append(("clip", f"{clip:.0%} of on-policy rows are clipped (health.clipfrac_max = {h.clipfrac_max:g}, "
                    f"grpo.clip_eps = {cfg.grpo.clip_eps:g}): the learner's log-probs differ from the sampler's"))
    if akl > h.approx_kl_max:
        out.append(("approx_kl", f"approx-KL of on-policy rows is {akl:.2e} (health.approx_kl_max = "
                    f"{h.approx_kl_max:g}): the learner's log-probs differ from the sampler's"))
    return out


def check_zero_spread(record: dict[str, Any], cfg: RunConfig) -> list[Message]:
    limit = cfg.health.zero_spread_max
    share = _num(record, f"{SPREAD_PREFIX}composite")
    if not math.isfinite(share):
        share = _num(record, "zero_std_frac")
    heads = {k[len(SPREAD_PREFIX):]: float(v) for k, v in record.items()
             if k.startswith(SPREAD_PREFIX) and k != f"{SPREAD_PREFIX}composite" and v is not None and v >= limit}
    named = ", ".join(f"{h} ({v:.0%} of groups)" for h, v in heads.items())
    if share >= limit:
        cause = f"saturated head(s): {named}" if named else "no single head is flat: the heads cancel out"
        return [("zero_spread", f"{share:.0%} of groups have equal rewards (zero spread) and teach nothing; {cause}")]
    if heads:
        return [("zero_spread", f"saturated head(s) with zero spread: {named}; they add no signal")]
    return []


# --- the monitor ---------------------------------------------------------------------------

class HealthMonitor:
    """Feed `observe(record)` once per step and `observe_eval(step, result)` per held-out evaluation.
    Both return the new findings; `record_keys` gives what goes into the step's row, `summary` the
    run's health section, `stop_reason` the one line a `stop` finding ends the run with."""

    def __init__(self, cfg: RunConfig):
        self.cfg, self.h = cfg, cfg.health
        w = self.h.window
        self.composite: deque[float] = deque(maxlen=w)
        self.heads: dict[str, deque[float]] = {}
        self.kl: dict[str, deque[float]] = {t: deque(maxlen=w) for t in ("anchor", "pi0", "step")}
        self.rewards: list[tuple[int, float]] = []   # (step, training reward) for the held-out checks
        self.evals: list[tuple[int, Any]] = []       # (step, EvalResult)
        self.findings: list[Finding] = []
        self.firing: set[str] = set()                # checks that fired at the last observation
        self.against: set[str] = set()               # heads head_against flagged in the training trend
        self.cleared: dict[str, str] = {}            # of those, the ones held out rose: head → the numbers
        self.numerics: dict[str, float] | None = None
        self.skipped_in_a_row = 0                    # steps the finite-update guard skipped, in a row
        self.values: dict[str, float] = {}           # the last trend / held-out numbers, for the row
        self.stop_reason: str | None = None

    @property
    def anchor(self) -> str | None:
        return kl_of(self.cfg).anchor

    # 1. per step
    def observe(self, record: dict[str, Any], skipped_in_a_row: int | None = None) -> list[Finding]:
        """skipped_in_a_row: the steps the finite-update guard skipped in a row, this one included,
        as the driver counts them (across a resume); None: counted from the rows observed."""
        step = int(record.get("step", 0))
        msgs: list[Message] = []
        if self.numerics is None and _num(record, "onpolicy_rows") > 0:  # the first update with fresh rows
            self.numerics = {"step": step, "logratio_onpolicy_absmax": _num(record, "logratio_onpolicy_absmax"),
                             "onpolicy_rows": _num(record, "onpolicy_rows"),
                             "limit": self.h.numerics_frac * self.cfg.grpo.clip_eps,
                             "clip_eps": self.cfg.grpo.clip_eps}
            msgs += check_numerics(record, self.cfg)
        self.skipped_in_a_row = (skipped_in_a_row if skipped_in_a_row is not None
                                 else self.skipped_in_a_row + 1 if record.get("update_skipped") == 1.0 else 0)
        msgs += check_nonfinite(record, self.cfg, self.skipped_in_a_row)
        msgs += check_on_policy(record, self.cfg)
        msgs += check_zero_spread(record, self.cfg)
        msgs += self._trends(record)
        reward = _num(record, "reward_mean")
        if math.isfinite(reward):
            self.rewards.append((step, reward))
        return self._emit(step, msgs, per_step=True)

    def _trends(self, record: dict[str, Any]) -> list[Message]:
        out: list[Message] = []
        w, z = self.h.window, self.h.z
        self.composite.append(_num(record, "reward_mean"))
        for k in record:
            if k.startswith("reward/"):
                self.heads.setdefault(k[len("reward/"):], deque(maxlen=w)).append(_num(record, k))
        if len(self.composite) == w:
            zc = slope_z(self.composite)
            self.values["trend_z/composite"] = zc
            for head, ys in self.heads.items():
                zh = slope_z(ys)
                self.values[f"trend_z/{head}"] = zh
                if zc > z and zh < -z:
                    self.against.add(head)
                    out.append(("head_against", f"reward head {head} falls (trend z = {zh:.1f}) while the composite "
                                f"rises (z = {zc:.1f}) over the last {w} steps: the composite is bought with {head}"))
        for term, key in (("anchor", "kl/d_anchor"), ("pi0", "kl/d_pi0"), ("step", "kl/d_step")):
            ys = self.kl[term]
            if not math.isfinite(_num(record, key)):
                continue  # not measured at this step (π_0 is measured every health.kl_pi0_every steps)
            ys.append(_num(record, key))
            if len(ys) < w or (term == "pi0" and self.anchor == "pi0"):
                continue  # the last w measurements; with the π_0 anchor, `anchor` is the same series
            third = max(1, w // 3)
            first, last = list(ys)[:third], list(ys)[-third:]
            # means of thirds, so one spike does not count; a KL that starts at 0 (the anchor was
            # just taken) or a k1 D_step below 0 is measured from health.kl_floor
            base, now = sum(first) / third, sum(last) / third
            growth = now / max(base, self.h.kl_floor)
            self.values[f"kl_growth/{term}"] = growth
            if growth > self.h.kl_growth_max:
                name = {"anchor": f"the {self.anchor} anchor", "pi0": "π_0 (the initial policy)",
                        "step": "the sampling policy (D_step)"}[term]
                out.append(("kl_growth", f"KL to {name} grew {growth:.1f}× over {w} steps (to {now:.2e}): "
                            "the policy is running away; raise kl.lam or lower optim.lr"))
        return out

    # 2. held-out evaluations
    def observe_eval(self, step: int, result: Any) -> list[Finding]:
        self.evals.append((step, result))
        msgs = self.held_out_checks()
        return self._emit(step, msgs, per_step=False)

    def held_out_checks(self) -> list[Message]:
        out: list[Message] = []
        if len(self.evals) < 2:
            return out
        (s0, base), last = self.evals[0], self.evals[-1][1]
        out += hacking(paired(base, last), [r for s, r in self.rewards if s > s0], s0, self.h.z)
        for row in paired(base, last):
            self.values[f"heldout_z/{row.key}"] = row.z
        n = self.h.stagnation_evals
        if len(self.evals) > n:
            (sa, a), (sb, b) = self.evals[-1 - n], self.evals[-1]
            rows = paired(a, b)
            if all(abs(r.z) < self.h.stagnation_z for r in rows):
                worst = max(rows, key=lambda r: abs(r.z))
                out.append(("stagnation", f"held-out rewards did not move over the last {n} evaluations "
                            f"(steps {sa} → {sb}, largest |paired z| = {abs(worst.z):.1f} on {worst.key} < "
                            f"{self.h.stagnation_z:g}): training has stalled"))
        return out

    def final(self, before: Any, after: Any, step: int) -> list[Finding]:
        """The before/after evaluation of the whole run, through the hacking check."""
        rows = paired(before, after)
        msgs = hacking(rows, [r for _, r in self.rewards], 0, self.h.z, "before → after")
        # head_against reads the training samples' trend; where the held-out pairs show the head
        # rising (paired z > health.z), that warning is not confirmed and does not set the status
        held = {r.key: r for r in rows}
        self.cleared = {h: f"{h} {held[h].diff:+.3f} (z {held[h].z:.1f})" for h in sorted(self.against)
                        if h in held and held[h].z > self.h.z}
        return self._emit(step, msgs, per_step=False)

    def not_confirmed(self, f: Finding) -> bool:
        """A head_against finding when every head it flagged rose on the held-out pairs."""
        return f.check == "head_against" and bool(self.against) and self.against <= self.cleared.keys()

    # 3. levels, the row, the summary
    def _emit(self, step: int, msgs: list[Message], per_step: bool) -> list[Finding]:
        new: list[Finding] = []
        for check, text in msgs:
            level = self.h.level(check)
            if level == "off":
                continue
            f = Finding(check, level, step, text)
            self.findings.append(f)
            if level == "stop" and self.stop_reason is None:
                self.stop_reason = f"health check '{check}' failed: {text}"
            if check not in self.firing or level == "stop":  # a warning that goes on is reported once
                new.append(f)
        fired = {c for c, _ in msgs}
        if per_step:
            self.firing = {c for c in self.firing if c in ("hacking", "stagnation")} | fired
        else:
            self.firing = {c for c in self.firing if c not in ("hacking", "stagnation")} | fired
        return new

    def record_keys(self, step_findings: list[Finding]) -> dict[str, Any]:
        """What the step's metrics.jsonl row gets: the status code, the trend numbers, the lines."""
        out: dict[str, Any] = {"health/status": LEVEL_CODE[self.status()]}
        out.update({f"health/{k}": v for k, v in self.values.items()})
        if step_findings:
            out["health/findings"] = [f.line() for f in step_findings]
        return out

    def status(self) -> str:
        levels = {f.level for f in self.findings if not self.not_confirmed(f)}
        return "stop" if "stop" in levels else "warn" if "warn" in levels else "ok"

    def summary(self) -> dict[str, Any]:
        checks: dict[str, Any] = {}
        for c in CHECKS:
            fs = [f for f in self.findings if f.check == c]
            checks[c] = {"level": self.h.level(c), "fired": len(fs),
                         "first_step": fs[0].step if fs else None, "last": fs[-1].message if fs else None}
            if fs and self.not_confirmed(fs[-1]):
                checks[c]["held_out"] = (f"not confirmed held out: before → after {', '.join(self.cleared.values())}; "
                                         "the training samples' trend only")
        return {"status": self.status(), "stop_reason": self.stop_reason, "numerics": self.numerics,
                "held_out_evals": [s for s, _ in self.evals], "checks": checks,
                "findings": [asdict(f) for f in self.findings[-50:]]}


def hacking(rows: list[Any], train_rewards: Sequence[float], since: int, z: float,
            where: str | None = None) -> list[Message]:
    """A held-out head falling (paired z < -z) while the reward rises: the training reward's
    trend, or the held-out composite itself (the trained objective on unseen pairs)."""
    rising = []
    zt = slope_z(train_rewards)
    if zt > z:
        rising.append(f"the training reward rose (trend z = {zt:.1f})")
    comp = next((r for r in rows if r.key == "composite"), None)
    if comp is not None and comp.z > z:
        rising.append(f"the held-out composite rose {comp.diff:+.3f} (paired z = {comp.z:.1f})")
    falling = [r for r in rows if r.key != "composite" and r.z < -z]
    if not rising or not falling:
        return []
    heads = ", ".join(f"{r.key} {r.diff:+.3f} (paired z = {r.z:.1f})" for r in falling)
    return [("hacking", f"held-out {heads} {where or f'since step {since}'} while {' and '.join(rising)}: "
             "the reward is being gamed")]


def health_table(summary: dict[str, Any], title: str = "training health"):
    """The final console table: one row per check that is on."""
    t = Table(title=f"{title}: {summary['status']}")
    for col in ("check", "level", "fired", "first step", "last finding"):
        t.add_column(col, justify="right" if col in ("fired", "first step") else "left", overflow="fold")
    for name, c in summary["checks"].items():
        if c["level"] == "off":
            continue
        last = c["last"] or "ok"
        if c.get("held_out"):
            last = f"{c['held_out']}. {last}"
        t.add_row(name, c["level"], str(c["fired"]), "—" if c["first_step"] is None else str(c["first_step"]), last)
    n = summary.get("numerics")
    if n:
        t.caption = (f"first update: max |log r| = {n['logratio_onpolicy_absmax']:.2e} on "
                     f"{n['onpolicy_rows']:.0f} on-policy rows (limit {n['limit']:.1e})")
    return t

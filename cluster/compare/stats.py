"""Paired statistics for `vgrpo compare`: the Student-t quantile, paired differences between rows
on the same seeds, the verdict on a claim, and the cost ratio of two rows on the seeds both ran
(with a paired bootstrap interval). numpy and the standard library only.

Two rows run with the same train.seed share the base, the prompt stream's seeds and the fixed
eval pairs, so row A's gain minus row B's gain on one seed cancels what the seed and the pairs
contribute to both. Over seeds those differences are independent draws: mean, standard error
and a 95% Student-t interval with n − 1 degrees of freedom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

CONFIDENCE = 0.95
RESOLUTION = 0.02  # the composite effect the comparison must separate (issue: "comparison power")


# --- 1. the Student-t distribution -------------------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))  # the even step
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))  # the odd step
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 ≤ x ≤ 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x = {x} is outside [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    # the continued fraction converges fast for x < (a+1)/(a+b+2); use the symmetry otherwise
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, dof: int) -> float:
    """P(T ≤ t) for Student's t with `dof` degrees of freedom:
    1 − ½·I_{ν/(ν+t²)}(ν/2, ½) for t ≥ 0, and its mirror for t < 0."""
    if dof < 1:
        raise ValueError(f"t_cdf: dof = {dof}: needs at least 1 degree of freedom")
    tail = 0.5 * betainc(dof / 2.0, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, dof: int) -> float:
    """The t with P(T ≤ t) = p, by bisection on t_cdf (monotone), to about 1e-10."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p = {p} must lie strictly between 0 and 1")
    if p < 0.5:
        return -t_quantile(1.0 - p, dof)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, dof) < p:  # bracket: t_{0.9995, 1} ≈ 637, so this doubles a few times at most
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, dof) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# --- 2. paired differences between rows --------------------------------------------------------

def run_gains(run: dict[str, Any]) -> dict[str, float]:
    """One run's gains on its eval pairs: key (composite, each head) → mean(after − before)."""
    # lazy: torch, rich (kept out of vgrpo --help)
    from cluster.evaluation.evaluate import EvalResult, paired

    heads = run["heads"]
    try:
        diffs = paired(EvalResult.from_record(run["before"], heads), EvalResult.from_record(run["after"], heads))
    except ValueError:
        raise ValueError(f"run {run.get('row')!r} seed {run.get('seed')}: before and after cover different pairs") from None
    return {d.key: d.diff for d in diffs}


@dataclass
class Paired:
    """Row A − row B over the seeds both ran: per-seed differences and their 95% interval."""

    diffs: dict[int, float]   # train.seed → gain(A) − gain(B)
    mean: float
    se: float                 # nan with one seed
    low: float                # nan with one seed: no interval from one draw
    high: float

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0

    @property
    def sd(self) -> float:
        """The spread of the per-seed differences (nan with one seed)."""
        return self.se * math.sqrt(self.n)

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if math.isnan(x) else x
        return {"mean": self.mean, "se": num(self.se), "ci95": [num(self.low), num(self.high)],
                "half_width": num(self.half_width), "n": self.n,
                "seeds_for_resolution": None if self.n < 2 else seeds_needed(self.sd),
                "per_seed": {str(s): d for s, d in sorted(self.diffs.items())}}


def paired_difference(runs: list[dict[str, Any]], a: str, b: str, key: str = "composite") -> Paired | None:
    """gain(a) − gain(b) on each train.seed both rows finished; None when they share no seed.

    Runs of a and b on one seed must cover the same number of eval pairs (the same budget)."""
    by = {(r["row"], r["seed"]): r for r in runs}
    seeds = sorted({s for row, s in by if row == a} & {s for row, s in by if row == b})
    if not seeds:
        return None
    diffs = {}
    for s in seeds:
        ra, rb = by[(a, s)], by[(b, s)]
        if len(ra["after"]["composite"]) != len(rb["after"]["composite"]):
            raise ValueError(f"seed {s}: rows {a!r} and {b!r} were evaluated on different pair sets")
        diffs[s] = run_gains(ra)[key] - run_gains(rb)[key]
    x = np.array([diffs[s] for s in seeds])
    mean = float(x.mean())
    if len(x) < 2:
        return Paired(diffs, mean, math.nan, math.nan, math.nan)
    se = float(x.std(ddof=1) / math.sqrt(len(x)))
    half = t_quantile(0.5 + CONFIDENCE / 2.0, len(x) - 1) * se
    return Paired(diffs, mean, se, mean - half, mean + half)


def seeds_needed(sd: float, half_width: float = RESOLUTION, most: int = 1000) -> int | None:
    """The fewest seeds n ≥ 2 whose 95% interval half-width t_{0.975, n−1}·sd/√n is ≤ half_width,
    for a spread `sd` of the per-seed differences; None above `most`."""
    for n in range(2, most + 1):
        if t_quantile(0.5 + CONFIDENCE / 2.0, n - 1) * sd / math.sqrt(n) <= half_width:
            return n
    return None


def verdict(p: Paired | None) -> str:
    """'reproduces' (interval above 0), 'contradicted' (below 0), else 'not resolved'."""
    if p is None:
        return "not run"
    if p.n < 2:
        return "not resolved (one seed: no interval)"
    if p.low > 0:
        return "reproduces"
    if p.high < 0:
        return "contradicted"
    return "not resolved"


def claim_verdict(parts: list[str]) -> str:
    """A claim against several rows holds only if it holds against each of them."""
    if any(v == "contradicted" for v in parts):
        return "contradicted"
    if parts and all(v == "reproduces" for v in parts):
        return "reproduces"
    if any(v == "not run" for v in parts):
        return "not run" if all(v == "not run" for v in parts) else "not resolved"
    return "not resolved"


# --- 3. how many seeds each row needs ----------------------------------------------------------

def seed_targets(runs: list[dict[str, Any]], pairs: list[tuple[str, str]], done: dict[str, int],
                 most: int) -> dict[str, int]:
    """row → the seeds it should have, from the spread of the seeds run so far: each pair (a, b)
    whose composite interval is wider than ±RESOLUTION asks both rows for seeds_needed(its spread),
    at most `most`; a row no pair asks more of keeps `done[row]`.

    The second stage of a two-stage design: the first stage (every row at the matrix's `seeds`)
    measures the spread, the second runs the seeds it says. A pair with fewer than 2 seeds, or an
    interval already within ±RESOLUTION, asks for nothing."""
    target = dict(done)
    for a, b in pairs:
        p = paired_difference(runs, a, b)
        if p is None or p.n < 2 or p.half_width <= RESOLUTION:
            continue
        need = seeds_needed(p.sd, most=most) or most
        for row in (a, b):
            if row in target:
                target[row] = max(target[row], min(need, most))
    return target


# --- 4. cost ratios on the seeds both rows ran -------------------------------------------------

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # the resampling is seeded: a report's intervals are the same on every rerun


@dataclass(frozen=True)
class CostRatio:
    """Row A's gain per rollout unit over row B's, both taken on exactly the seeds both ran.

    ratio = (mean gain_A / mean units_A) / (mean gain_B / mean units_B), every mean over `seeds`;
    nan unless both mean gains are positive (a ratio of a loss means nothing). low, high: the 95%
    paired bootstrap interval over those seeds (nan with one seed or no ratio)."""

    seeds: tuple[int, ...]
    gain: float        # mean gain of A over `seeds`
    units: float       # mean rollout units (seconds, or GPU-seconds) of A over `seeds`
    ref_gain: float
    ref_units: float
    ratio: float
    low: float
    high: float

    @property
    def n(self) -> int:
        return len(self.seeds)

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | str | None:
            return None if math.isnan(x) else ("inf" if math.isinf(x) else x)
        return {"seeds": list(self.seeds), "n": self.n, "gain": self.gain, "rollout_units": self.units,
                "ref_gain": self.ref_gain, "ref_rollout_units": self.ref_units, "ratio": num(self.ratio),
                "ci95": [num(self.low), num(self.high)], "resamples": BOOTSTRAP_RESAMPLES,
                "bootstrap_seed": BOOTSTRAP_SEED}


def rate_ratio(gain: np.ndarray, units: np.ndarray, ref_gain: np.ndarray, ref_units: np.ndarray) -> np.ndarray:
    """(gain / units) / (ref_gain / ref_units), elementwise; +inf where ref_gain ≤ 0 (the
    reference gained nothing, so no finite factor describes the row against it)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (gain * ref_units) / (units * ref_gain)
    return np.where(ref_gain > 0, r, np.inf)


def cost_ratio(gain: dict[int, float], units: dict[int, float], ref_gain: dict[int, float],
               ref_units: dict[int, float]) -> CostRatio | None:
    """Row A against row B on the seeds both ran (train.seed → a run's composite gain and its
    rollout units); None when they share no seed with finite, positive units.

    The interval resamples those seeds with replacement (the same draw for both rows: paired),
    BOOTSTRAP_RESAMPLES times from a generator seeded with BOOTSTRAP_SEED, and takes the 2.5% and
    97.5% points of the resampled ratios (no interpolation, so an unbounded resample stays ∞)."""
    def ok(u: dict[int, float], s: int) -> bool:
        return s in u and math.isfinite(u[s]) and u[s] > 0
    seeds = tuple(sorted(s for s in set(gain) & set(ref_gain) if ok(units, s) and ok(ref_units, s)))
    if not seeds:
        return None
    g, u = np.array([gain[s] for s in seeds]), np.array([units[s] for s in seeds])
    gr, ur = np.array([ref_gain[s] for s in seeds]), np.array([ref_units[s] for s in seeds])
    means = (float(g.mean()), float(u.mean()), float(gr.mean()), float(ur.mean()))
    if not (means[0] > 0 and means[2] > 0):
        return CostRatio(seeds, *means, math.nan, math.nan, math.nan)
    ratio = float(rate_ratio(*(np.array(m) for m in means)))
    if len(seeds) < 2:
        return CostRatio(seeds, *means, ratio, math.nan, math.nan)
    idx = np.random.default_rng(BOOTSTRAP_SEED).integers(0, len(seeds), size=(BOOTSTRAP_RESAMPLES, len(seeds)))
    draws = rate_ratio(g[idx].mean(1), u[idx].mean(1), gr[idx].mean(1), ur[idx].mean(1))
    alpha = (1.0 - CONFIDENCE) / 2.0
    low, high = np.quantile(draws, [alpha, 1.0 - alpha], method="inverted_cdf")
    return CostRatio(seeds, *means, ratio, float(low), float(high))

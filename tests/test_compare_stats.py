"""`vgrpo compare`'s statistics: the Student-t quantile, paired differences against a reference
row, the claims' verdicts, and the matrix keys that declare them (parallel, reference, claims)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cluster.compare.matrix import load_matrix
from cluster.compare.report import claims_section, paired_table
from cluster.compare.stats import (
    betainc,
    cost_ratio,
    paired_difference,
    seed_targets,
    seeds_needed,
    t_cdf,
    t_quantile,
    verdict,
)
from common.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


# --- 1. the t distribution against published values ---------------------------------------------

# Two-sided 95% (and other) critical values as printed in standard t tables (e.g. NIST/SEMATECH
# e-Handbook of Statistical Methods, table 1.3.6.7.2), 3 decimals.
PUBLISHED = [(0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 3, 3.182), (0.975, 5, 2.571),
             (0.975, 10, 2.228), (0.975, 20, 2.086), (0.975, 30, 2.042), (0.975, 60, 2.000),
             (0.975, 100, 1.984), (0.95, 4, 2.132), (0.95, 10, 1.812), (0.995, 10, 3.169),
             (0.995, 2, 9.925), (0.90, 7, 1.415)]


@pytest.mark.parametrize("p, dof, want", PUBLISHED)
def test_t_quantile_matches_published_tables(p, dof, want):
    assert t_quantile(p, dof) == pytest.approx(want, abs=6e-4)
    assert t_quantile(1 - p, dof) == pytest.approx(-want, abs=6e-4)  # symmetric


def test_t_cdf_matches_closed_forms_and_the_normal_limit():
    for t in (-7.0, -1.3, 0.0, 0.4, 2.5, 30.0):
        # dof 1 is the Cauchy distribution; dof 2 has F(t) = 1/2 + t / (2 sqrt(2 + t²))
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    # many degrees of freedom: the standard normal, Φ(1.959964) = 0.975
    assert t_quantile(0.975, 100_000) == pytest.approx(1.959964, abs=1e-4)
    # I_x(a, 1) = x^a and I_x(1, b) = 1 − (1 − x)^b
    for x in (0.01, 0.3, 0.77, 0.999):
        assert betainc(2.5, 1.0, x) == pytest.approx(x ** 2.5, rel=1e-12)
        assert betainc(1.0, 3.5, x) == pytest.approx(1 - (1 - x) ** 3.5, rel=1e-12)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        t_quantile(1.0, 3)


# --- 2. paired differences on synthetic run records ------------------------------------------

def _run(row: str, seed: int, gain: float, skew: float = 0.0, n_pairs: int = 5) -> dict:
    """A run whose gain is exactly `gain` on the composite (= VQ + TA) and gain/2 ± skew per head."""
    rng = np.random.default_rng([seed, 99])
    before = rng.normal(size=(n_pairs, 2))                 # the same base on the same pairs per seed
    after = before + np.array([gain / 2 + skew, gain / 2 - skew])
    return {"row": row, "seed": seed, "heads": ["VQ", "TA"], "wall_s": 1.0, "steps": 2,
            "before": {"values": before.tolist(), "composite": before.sum(1).tolist()},
            "after": {"values": after.tolist(), "composite": after.sum(1).tolist()}}


def _runs(rows: dict[str, list[float]]) -> list[dict]:
    return [_run(r, s, g, skew=0.01 * s) for r, gs in rows.items() for s, g in enumerate(gs)]


# reference gains 0.05 each seed; hand-computed below
REF = [0.05, 0.05, 0.05]


def test_paired_difference_by_hand():
    runs = _runs({"ref": REF, "up": [0.10, 0.14, 0.12]})
    p = paired_difference(runs, "up", "ref")
    # differences 0.05, 0.09, 0.07: mean 0.07, sd sqrt((0.02² + 0.02² + 0) / 2) = 0.02,
    # se 0.02 / sqrt(3) = 0.0115470, half-width t_{0.975,2} · se = 4.302653 · 0.0115470 = 0.049683
    assert p.n == 3 and p.diffs == pytest.approx({0: 0.05, 1: 0.09, 2: 0.07})
    assert p.mean == pytest.approx(0.07) and p.se == pytest.approx(0.0115470, abs=1e-7)
    assert p.low == pytest.approx(0.07 - 0.049683, abs=1e-6) and p.high == pytest.approx(0.07 + 0.049683, abs=1e-6)
    # per head: VQ gets gain/2 + 0.01·seed in both rows, so its difference is half the composite's
    assert paired_difference(runs, "up", "ref", "VQ").mean == pytest.approx(0.035)
    # only the seeds both rows finished are paired
    runs_missing = [r for r in runs if not (r["row"] == "up" and r["seed"] == 1)]
    p2 = paired_difference(runs_missing, "up", "ref")
    assert sorted(p2.diffs) == [0, 2] and p2.mean == pytest.approx(0.06)
    assert paired_difference(runs, "up", "nobody") is None


def test_seeds_needed_by_hand():
    assert seeds_needed(0.02) == 7        # see test_paired_table_in_markdown
    assert seeds_needed(0.0) == 2         # no spread: the fewest seeds with an interval
    # sd 0.05: needs t_{n−1}/√n ≤ 0.4; n = 27: 2.056/5.196 = 0.3957, n = 26: 2.060/5.099 = 0.404
    assert seeds_needed(0.05) == 27
    assert seeds_needed(10.0) is None


def test_seed_targets_give_each_wide_pair_the_seeds_its_spread_needs():
    # "noisy" − ref differs by 0.05 ± 0.05 over 8 seeds (sd 0.05 · √(8/7) by construction below);
    # "tight" − ref by 0.01 exactly: already resolved, so it asks for nothing
    alt = [0.05 if s % 2 else -0.05 for s in range(8)]
    runs = _runs({"ref": [0.05] * 8, "noisy": [0.10 + a for a in alt], "tight": [0.06] * 8})
    sd = float(np.std(alt, ddof=1))
    # by hand from the published t table: the fewest n with t_{0.975, n−1} · sd / √n ≤ 0.02
    # (sd = 0.05345: n = 30 gives 2.045 · 0.05345 / 5.477 = 0.01996, n = 29 gives 2.048 · 0.05345 / 5.385 = 0.02033)
    assert sd == pytest.approx(0.053452, abs=1e-6)
    done = {"ref": 8, "noisy": 8, "tight": 8}
    got = seed_targets(runs, [("noisy", "ref"), ("tight", "ref")], done, most=40)
    assert got == {"ref": 30, "noisy": 30, "tight": 8}
    # the cap, and a pair of non-reference rows (a claim) raises both of its rows
    assert seed_targets(runs, [("noisy", "ref")], done, most=20) == {"ref": 20, "noisy": 20, "tight": 8}
    assert seed_targets(runs, [("noisy", "tight")], done, most=40) == {"ref": 8, "noisy": 30, "tight": 30}
    # one seed: no spread to plan from; an unknown row: no pair
    one = _runs({"ref": [0.05], "noisy": [0.3]})
    assert seed_targets(one, [("noisy", "ref")], {"ref": 1, "noisy": 1}, most=40) == {"ref": 1, "noisy": 1}
    assert seed_targets(runs, [("gone", "ref")], done, most=40) == done


@pytest.mark.parametrize("gains, want", [
    ([0.10, 0.14, 0.12], "reproduces"),          # differences +0.05 +0.09 +0.07: CI [+0.020, +0.120]
    ([0.00, -0.04, -0.02], "contradicted"),      # differences −0.05 −0.09 −0.07: CI [−0.120, −0.020]
    ([0.10, 0.02, 0.06], "not resolved"),        # differences +0.05 −0.03 +0.01: CI contains 0
])
def test_each_verdict(gains, want):
    p = paired_difference(_runs({"ref": REF, "x": gains}), "x", "ref")
    assert verdict(p) == want
    one = paired_difference(_runs({"ref": REF[:1], "x": gains[:1]}), "x", "ref")
    assert one.n == 1 and math.isnan(one.low) and verdict(one).startswith("not resolved")
    assert verdict(None) == "not run"


def test_paired_table_in_markdown():
    runs = _runs({"ref": REF, "up": [0.10, 0.14, 0.12], "tight": [0.06, 0.061, 0.059]})
    md = paired_table(runs, "ref", ["ref", "up", "tight"])
    lines = md.splitlines()
    assert lines[0] == "## Paired difference vs ref"
    assert lines[2] == "| method | seeds | Δ composite − ref | Δ VQ − ref | Δ TA − ref | CI half-width (composite) |"
    up = next(x for x in lines if x.startswith("| up |"))
    assert "| 3 | +0.070 [+0.020, +0.120] |" in up and up.endswith("| 0.050 > 0.02 |")
    tight = next(x for x in lines if x.startswith("| tight |"))
    # differences 0.010, 0.011, 0.009: se 0.000577, half-width 0.0025
    assert "+0.010 [+0.008, +0.012]" in tight and tight.endswith("| 0.002 ≤ 0.02 |")
    assert not any(x.startswith("| ref |") for x in lines)
    assert "1 of 2 composite intervals have half-width ≤ 0.02 (largest 0.050)" in md
    assert "not resolved in every row" in md
    # up's per-seed spread is sd 0.02: t_{0.975,n−1}·0.02/√n ≤ 0.02 needs t_{n−1} ≤ √n, first at
    # n = 7 (t_6 = 2.447 ≤ 2.646; n = 6: t_5 = 2.571 > 2.449)
    assert "the widest row (up) would need about 7 seeds" in md
    assert paired_table(runs, None, ["ref", "up"]) == ""


def test_claims_section_verdicts_and_a_claim_against_several_rows():
    from cluster.compare.matrix import Claim

    runs = _runs({"ref": REF, "up": [0.10, 0.14, 0.12], "down": [0.00, -0.04, -0.02],
                  "flat": [0.10, 0.02, 0.06]})
    claims = [Claim("up beats ref", "up", ("ref",)), Claim("ref beats up", "ref", ("up",)),
              Claim("flat beats ref", "flat", ("ref",)), Claim("up beats ref and down", "up", ("ref", "down")),
              Claim("ref beats up and down", "ref", ("up", "down")), Claim("ghost beats ref", "ghost", ("ref",))]
    md, data = claims_section(runs, claims)
    lines = md.splitlines()
    assert lines[0] == "## Which claims reproduce"
    assert "- **up beats ref**: reproduces. up − ref = +0.070 [+0.020, +0.120], 3 seeds: reproduces." in lines
    assert "- **ref beats up**: contradicted. ref − up = -0.070 [-0.120, -0.020], 3 seeds: contradicted." in lines
    assert any(x.startswith("- **flat beats ref**: not resolved. flat − ref = +0.010 [") for x in lines)
    assert "- **up beats ref and down**: reproduces." in lines      # +0.07 and +0.14 over each seed
    assert "- **ref beats up and down**: contradicted." in lines    # one contradiction is enough
    assert "- **ghost beats ref**: not run. ghost − ref: not run." in lines
    i = lines.index("- **up beats ref and down**: reproduces.")
    assert lines[i + 1].startswith("  - up − ref = +0.070") and lines[i + 2].startswith("  - up − down = +0.140")
    assert [d["verdict"] for d in data] == ["reproduces", "contradicted", "not resolved", "reproduces",
                                            "contradicted", "not run"]
    assert data[0]["comparisons"][0]["ci95"] == pytest.approx([0.020317, 0.119683], abs=1e-5)
    assert "at least as good" in md  # the rule for that wording is stated


def test_write_report_puts_paired_numbers_and_claims_in_compare_json(tmp_path):
    from cluster.compare.runner import write_report

    p = tmp_path / "m.yaml"
    p.write_text(f"base: {QUICKSTART}\nseeds: 3\nreference: ref\n"
                 "rows: {ref: [kl.strategy=none], up: [kl.strategy=dual]}\n"
                 "claims: [{claim: up wins, better: up, worse: ref}]\n")
    m = load_matrix(p)
    runs = _runs({"ref": REF, "up": [0.10, 0.14, 0.12]})
    metrics = {r: [[{"step": 1, "reward_mean": 0.5}]] * 3 for r in ("ref", "up")}
    md = write_report(m, {"runs": runs, "metrics": metrics, "failed": {}, "interrupted": False},
                      tmp_path, "vgrpo compare -c m.yaml", 60.0, parallel=2)
    text = md.read_text()
    assert "## Paired difference vs ref" in text and "## Which claims reproduce" in text
    assert "3 seed(s) per row; 2 run(s) at once." in text
    j = json.loads((tmp_path / "compare.json").read_text())
    assert j["reference"] == "ref" and set(j["paired"]) == {"up"}
    assert j["paired"]["up"]["composite"]["mean"] == pytest.approx(0.07)
    assert j["paired"]["up"]["composite"]["per_seed"] == pytest.approx({"0": 0.05, "1": 0.09, "2": 0.07})
    assert j["resolution"]["up"] == pytest.approx(0.049683, abs=1e-6)
    assert j["paired"]["up"]["composite"]["seeds_for_resolution"] == 7  # sd 0.02 (test_seeds_needed_by_hand)
    assert j["claims"][0]["verdict"] == "reproduces"


def test_cost_ratio_by_hand():
    """Two seeds: a resample is seed 0 twice, seed 1 twice (a quarter each) or one of each, so the
    95% interval's ends are the ratios on seed 0 alone and seed 1 alone."""
    gain, units = {0: 0.04, 1: 0.02, 5: 1.0}, {0: 10.0, 1: 10.0, 5: 1.0}   # seed 5: the reference never ran it
    ref_gain, ref_units = {0: 0.01, 1: 0.01, 2: 0.5}, {0: 20.0, 1: 20.0, 2: 1.0}
    c = cost_ratio(gain, units, ref_gain, ref_units)
    assert c.seeds == (0, 1) and c.n == 2
    assert c.ratio == pytest.approx((0.03 / 10) / (0.01 / 20))                     # 6.0
    assert (c.low, c.high) == pytest.approx(((0.02 / 10) / (0.01 / 20), (0.04 / 10) / (0.01 / 20)))  # 4, 8
    one = cost_ratio({0: 0.04}, {0: 10.0}, ref_gain, ref_units)
    assert one.n == 1 and one.ratio == pytest.approx(8.0) and math.isnan(one.low)    # no interval from one seed
    loss = cost_ratio({0: -0.04, 1: 0.01}, units, ref_gain, ref_units)
    assert math.isnan(loss.ratio) and math.isnan(loss.high)                         # no ratio of a loss
    assert cost_ratio({7: 0.1}, {7: 1.0}, ref_gain, ref_units) is None              # no seed in common
    # a resample where the reference gains nothing is an unbounded ratio
    wide = cost_ratio({0: 0.02, 1: 0.02}, units, {0: 0.03, 1: -0.01}, ref_units)
    assert wide.ratio == pytest.approx((0.02 / 10) / (0.01 / 20)) and math.isinf(wide.high)


# --- 3. the matrix keys ----------------------------------------------------------------------

def _matrix(tmp_path, extra: str) -> Path:
    p = tmp_path / "m.yaml"
    p.write_text(f"base: {QUICKSTART}\nbudget: [train.steps=4]\nseeds: 2\n"
                 "rows:\n  A: [kl.strategy=dual]\n  B (x, y): [kl.strategy=none]\n  C: [kl.strategy=fixed]\n" + extra)
    return p


def test_matrix_reads_parallel_reference_and_claims(tmp_path):
    m = load_matrix(_matrix(tmp_path, "parallel: 3\nreference: A\nclaims:\n"
                                      "  - {claim: A wins, better: A, worse: \"B (x, y)\"}\n"
                                      "  - {claim: A beats both, better: A, worse: [\"B (x, y)\", C]}\n"))
    assert m.parallel == 3 and m.reference == "A"
    assert [(c.claim, c.better, c.worse) for c in m.claims] == [
        ("A wins", "A", ("B (x, y)",)), ("A beats both", "A", ("B (x, y)", "C"))]
    q = m.for_mode(quick=True, seeds=4)
    assert (q.parallel, q.reference, q.claims, q.seeds) == (3, "A", m.claims, 4)
    d = load_matrix(_matrix(tmp_path, ""))
    assert (d.parallel, d.reference, d.claims) == (1, None, [])
    assert d.most_seeds == 2 and d.pairs() == []  # no most_seeds: no second stage


def test_most_seeds_and_the_pairs_it_plans_for(tmp_path):
    m = load_matrix(_matrix(tmp_path, "most_seeds: 12\nreference: A\n"
                                      "claims: [{claim: C beats B, better: C, worse: \"B (x, y)\"},"
                                      " {claim: B loses, better: A, worse: \"B (x, y)\"}]\n"))
    assert (m.seeds, m.most_seeds) == (2, 12)
    # each row against the reference, then each claim's pair, each once
    assert m.pairs() == [("B (x, y)", "A"), ("C", "A"), ("C", "B (x, y)"), ("A", "B (x, y)")]
    assert m.for_mode(quick=True).most_seeds == m.for_mode(quick=True).seeds  # --quick: no second stage
    assert m.for_mode(quick=False, seeds=20).most_seeds == 20                # --seeds above the cap
    assert m.for_mode(quick=False, seeds=4).most_seeds == 12


@pytest.mark.parametrize("extra, needle", [
    ("claims:\n  - {claim: A beats D, better: A, worse: D}\n", "claim 'A beats D': unknown row 'D'"),
    ("claims:\n  - {claim: Z wins, better: Z, worse: [A]}\n", "claim 'Z wins': unknown row 'Z'"),
    ("claims:\n  - {claim: A beats B, better: A, worse: [B (x, y)]}\n", "claim 'A beats B': unknown row 'B (x'"),
    ("claims:\n  - {claim: no worse, better: A, worse: []}\n", "claim 'no worse': better must be a row name"),
    ("claims:\n  - {claim: self, better: A, worse: [A, C]}\n", "claim 'self': row 'A' is both better and worse"),
    ("claims:\n  - {claim: typo, better: A, worst: C}\n", "claim 'typo': expected exactly the keys"),
    ("claims:\n  - A beats C\n", "claims[0]: expected exactly the keys"),
    ("claims: {claim: x}\n", "claims: expected a list"),
    ("reference: Nope\n", "reference = 'Nope' is not a row"),
    ("parallel: 0\n", "parallel = 0: must be an integer ≥ 1"),
    ("most_seeds: 1\n", "most_seeds = 1: must be an integer ≥ seeds (2)"),
    ("most_seeds: lots\n", "most_seeds = 'lots': must be an integer ≥ seeds (2)"),
])
def test_a_bad_claim_or_reference_is_one_clear_error(tmp_path, extra, needle):
    with pytest.raises(ConfigError) as e:
        load_matrix(_matrix(tmp_path, extra))
    assert needle in str(e.value) and len(str(e.value).splitlines()) == 1


def test_compare_toy_declares_the_papers_claims_on_its_rows():
    m = load_matrix(ROOT / "configs" / "compare_toy.yaml")
    assert m.reference == "DanceGRPO" and m.parallel >= 1
    c = {r: m.config(r, 0) for r in m.rows}
    by_name = {cl.claim: cl for cl in m.claims}
    sage = by_name["SAGE-GRPO beats DanceGRPO and FlowGRPO"]
    assert c[sage.better].sde.scheme == "sage" and c[sage.better].kl.strategy == "dual"
    assert {c[w].sde.scheme for w in sage.worse} == {"dance", "flow"}
    tag = by_name["TAGRPO beats DanceGRPO"]
    assert c[tag.better].align.enabled and c[tag.better].bank.enabled and tag.worse == ("DanceGRPO",)
    # the second stage plans for these pairs: each row against DanceGRPO, and SAGE-GRPO − FlowGRPO
    assert ("SAGE-GRPO", "FlowGRPO") in m.pairs() and all((r, "DanceGRPO") in m.pairs() for r in m.rows
                                                          if r != "DanceGRPO")


def test_compare_toy_ablations_declares_the_papers_ablation_claims():
    m = load_matrix(ROOT / "configs" / "compare_toy_ablations.yaml")
    c = {r: m.config(r, 0) for r in m.rows}
    kl = {c[r].kl.strategy: r for r in m.rows if r.startswith("SAGE") and c[r].grpo.equalizer}
    assert set(kl) == {"none", "fixed", "step", "moving", "dual"}
    no_eq = [r for r in m.rows if r.startswith("SAGE") and not c[r].grpo.equalizer]
    assert len(no_eq) == 1 and c[no_eq[0]].kl.strategy == "dual"
    banks = {c[r].bank.strategy: r for r in m.rows if c[r].bank.enabled and c[r].align.enabled}
    assert set(banks) == {"fifo", "fifo_s2", "sdu"}
    by_name = {cl.claim: cl for cl in m.claims}
    dual = by_name["the dual moving KL is at least as good as the other KL strategies"]
    assert dual.better == kl["dual"] and set(dual.worse) == {kl[s] for s in ("none", "fixed", "step", "moving")}
    assert by_name["the equalizer helps"].worse == (no_eq[0],)
    assert (by_name["the FIFO bank beats FIFO-S2"].better, by_name["the FIFO bank beats FIFO-S2"].worse) == (
        banks["fifo"], (banks["fifo_s2"],))
    assert (by_name["FIFO-S2 beats SDU"].better, by_name["FIFO-S2 beats SDU"].worse) == (banks["fifo_s2"], (banks["sdu"],))
    both = by_name["alignment plus bank beats either alone"]
    assert c[both.better].bank.enabled and c[both.better].align.enabled
    assert {(c[w].bank.enabled, c[w].align.enabled) for w in both.worse} == {(True, False), (False, True)}


def test_a_moving_anchor_that_never_moves_within_the_budget_is_named():
    from cluster.compare.matrix import load_matrix

    body = ("base: {base}\nbudget: [train.steps=8{extra}]\nseeds: 1\n"
            "rows:\n  fixed: [kl.strategy=fixed]\n  dual: [kl.strategy=dual]\n")
    base = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.yaml"
        p.write_text(body.format(base=base, extra=""))  # the quickstart's anchor_period is 10 > 8 steps
        (w,) = load_matrix(p).warnings()
        assert w.startswith("row 'dual': kl.strategy=dual refreshes its anchor every 10 steps but the budget trains 8")
        p.write_text(body.format(base=base, extra=", kl.anchor_period=3"))
        assert load_matrix(p).warnings() == []
    # the shipped matrix measures what its rows say, in both budgets
    for name in ("compare_toy.yaml", "compare_toy_ablations.yaml"):
        shipped = load_matrix(base.parent / name)
        assert shipped.warnings() == [] and shipped.for_mode(quick=True).warnings() == []

"""`vgrpo compare`: matrix files, the table and curve writers, and one tiny real comparison."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cluster.compare.matrix import load_matrix
from cluster.compare.report import (
    cost_ratios,
    costs,
    gains,
    markdown_table,
    mean_curve,
    plot_curves,
    ranking_section,
)
from common.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
MATRICES = ["compare_toy", "compare_toy_ablations", "compare_toy_i2v", "ablate_equalizer", "ablate_kl", "ablate_lambda", "ablate_bank"]


def _matrix(tmp_path, rows: str, extra: str = "") -> Path:
    p = tmp_path / "m.yaml"
    p.write_text(f"base: {QUICKSTART}\nbudget: [train.steps=4]\nseeds: 2\n{extra}rows:\n{rows}")
    return p


# --- 1. matrix files ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", MATRICES)
def test_shipped_matrices_validate_and_share_one_budget(name):
    m = load_matrix(ROOT / "configs" / f"{name}.yaml")
    assert len(m.rows) >= 2
    for mode in (False, True):
        mm = m.for_mode(quick=mode)
        cfgs = [mm.config(r, 0) for r in mm.rows]
        # the budget is the same in every row
        budget = {(c.train.steps, c.train.groups_per_step, c.sampler.group_size, c.train.eval_seeds) for c in cfgs}
        assert len(budget) == 1
        # and the rows really differ from each other
        dumps = {json.dumps(c.model_dump(mode="json"), sort_keys=True) for c in cfgs}
        assert len(dumps) == len(cfgs)
        # runs in flight at once are sync: an async run keeps both of a laptop's cores busy
        if m.parallel > 1:
            assert {c.train.mode for c in cfgs} == {"sync"}, name


def test_compare_toy_rows_are_the_methods_and_quick_is_smaller():
    m = load_matrix(ROOT / "configs" / "compare_toy.yaml")
    c = {r: m.config(r, 0) for r in m.rows}
    assert c["DanceGRPO"].sde.scheme == "dance" and c["FlowGRPO"].sde.scheme == "flow"
    assert c["CPS"].sde.scheme == "cps"
    sage = c["SAGE-GRPO"]
    assert (sage.sde.scheme, sage.grpo.equalizer, sage.kl.strategy) == ("sage", True, "dual")
    assert not sage.align.enabled and not sage.bank.enabled
    tag = c["TAGRPO"]
    assert (tag.sde.scheme, tag.kl.strategy, tag.align.enabled, tag.bank.enabled) == ("dance", "none", True, True)
    # the cost methods against DanceGRPO: MixGRPO's window (Flash: DPM-2M on a compressed tail),
    # DiffusionNFT's loss on ODE rollouts, Flash-GRPO's one rectified step per group
    mix, flash_mix, nft, flash = c["MixGRPO"], c["MixGRPO-Flash"], c["DiffusionNFT"], c["Flash-GRPO"]
    assert (mix.sampler.train_steps, mix.sampler.untrained_steps, mix.sampler.post_solver) == ("window", "ode", "euler")
    assert (flash_mix.sampler.post_solver, flash_mix.sampler.post_compress) == ("dpm2", 0.4)
    assert (nft.grpo.loss, nft.sampler.post_solver, nft.model.guidance_scale) == ("nft", "dpm2", 1.0)
    assert (flash.sampler.train_steps, flash.grpo.rectify, flash.sde.scheme) == ("one_per_group", True, "flash")
    assert {"MixGRPO", "DiffusionNFT", "Flash-GRPO"} <= {cl.better for cl in m.claims}
    # the quickstart row is configs/quickstart.yaml itself, at the shared budget
    from common.config import apply_overrides, read_yaml, validate
    own = [r for r in m.rows if r.startswith("vgrpo quickstart")]
    assert len(own) == 1 and m.rows[own[0]] == []
    want = validate(apply_overrides(read_yaml(QUICKSTART), [*m.budget, "train.seed=0"]))
    assert c[own[0]].model_dump() == want.model_dump()
    # two stages: 8 seeds, then up to most_seeds where an interval is wider than ±0.02
    assert m.seeds >= 8 and m.most_seeds > m.seeds
    q = m.for_mode(quick=True)
    full_cfg, quick_cfg = m.config("CPS", 0), q.config("CPS", 0)
    assert quick_cfg.train.steps < full_cfg.train.steps and q.seeds < m.seeds and q.most_seeds == q.seeds
    assert quick_cfg.train.eval_seeds < full_cfg.train.eval_seeds
    assert m.for_mode(quick=True, seeds=5).seeds == 5
    assert m.config("CPS", 2).train.seed == 2


def test_compare_toy_ablations_change_one_part_per_row():
    m = load_matrix(ROOT / "configs" / "compare_toy_ablations.yaml")
    c = {r: m.config(r, 0) for r in m.rows}
    assert [c[r].kl.strategy for r in m.rows if r.startswith("SAGE")] == ["none", "fixed", "step", "moving",
                                                                           "dual", "dual"]
    tag = {r: (c[r].bank.enabled, c[r].align.enabled) for r in m.rows if r.startswith("TAGRPO")}
    assert set(tag.values()) == {(True, True), (False, True), (True, False)}

    def differs(a: str, b: str) -> set[str]:
        da, db = c[a].model_dump(), c[b].model_dump()
        return {f"{k}.{kk}" for k in da for kk in da[k] if da[k][kk] != db[k][kk]}
    # each SAGE row differs from the full method in its trust region or its equalizer only
    for r in m.rows:
        if r.startswith("SAGE") and r != "SAGE (dual moving KL)":
            assert differs(r, "SAGE (dual moving KL)") in ({"kl.strategy"}, {"grpo.equalizer"}), r
    assert differs("TAGRPO (FIFO-S2 bank + align)", "TAGRPO (bank + align)") == {"bank.strategy"}


@pytest.mark.parametrize("rows, needle", [
    ("  good: [kl.strategy=dual]\n  bad row: [sde.scheme=bogus]\n", "row 'bad row': sde.scheme = 'bogus'"),
    ("  typo: [kl.strategyy=none]\n", "row 'typo': kl.strategyy: unknown key"),
    ("  cheat: [train.steps=400]\n", "row 'cheat': train.steps is part of the shared budget"),
    ("  notalist: kl.strategy=none\n", "row 'notalist': expected a list"),
    ("  noeq: [kl.strategy]\n", "row 'noeq': override 'kl.strategy'"),
])
def test_a_bad_row_is_one_clear_error_naming_row_and_field(tmp_path, rows, needle):
    with pytest.raises(ConfigError) as e:
        load_matrix(_matrix(tmp_path, rows))
    assert needle in str(e.value)


def test_bad_matrix_structure(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("base: nowhere.yaml\nrows: {a: []}\n")
    with pytest.raises(ConfigError, match="nowhere.yaml: config file not found"):
        load_matrix(p)
    with pytest.raises(ConfigError, match="quick.budget.*row 'a'|row 'a'.*sde.eta"):
        load_matrix(_matrix(tmp_path, "  a: []\n", "quick: {budget: [sde.eta=-1]}\n"))
    p.write_text(f"base: {QUICKSTART}\nrowz: {{a: []}}\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_matrix(p)


# --- 2. writers on synthetic data --------------------------------------------------------------

def _run(row, seed, gain, n=6, heads=("VQ", "TA")):
    rng = np.random.default_rng(seed)
    before = rng.normal(size=(n, len(heads)))
    after = before + gain + rng.normal(scale=0.01, size=before.shape)
    return {"row": row, "seed": seed, "heads": list(heads), "wall_s": 10.0 + seed,
            "before": {"values": before.tolist(), "composite": before.sum(1).tolist()},
            "after": {"values": after.tolist(), "composite": after.sum(1).tolist()}}


def test_gains_are_paired_means_with_stderr_over_seeds():
    runs = [_run("A", 0, 0.1), _run("A", 1, 0.3), _run("B", 0, -0.2)]
    g = gains(runs)
    per_seed = [np.mean(np.array(r["after"]["values"])[:, 0] - np.array(r["before"]["values"])[:, 0])
                for r in runs[:2]]
    m, se, n, over_pairs = g["A"]["VQ"]
    assert m == pytest.approx(np.mean(per_seed)) and n == 2 and not over_pairs
    assert se == pytest.approx(np.std(per_seed, ddof=1) / math.sqrt(2))
    assert g["A"]["composite"][0] == pytest.approx(0.4, abs=0.02)   # two heads, gain 0.2 each on avg
    mb, seb, nb, over_pairs_b = g["B"]["TA"]
    assert mb == pytest.approx(-0.2, abs=0.02) and nb == 1 and over_pairs_b and 0 < seb < 0.01


def test_markdown_table_and_curve_plot(tmp_path):
    runs = [_run("A", 0, 0.1), _run("A", 1, 0.3), _run("B", 0, -0.2)]
    metrics = {"A": [[{"step": s, "reward_mean": float(s), "reward/VQ": 1.0, "reward/TA": 2.0} for s in (1, 2, 3)],
                     [{"step": s, "reward_mean": float(s) + 2, "reward/VQ": 3.0} for s in (1, 2)]],
               "B": [[{"step": s, "reward_mean": -float(s)} for s in (1, 2, 3, 4)]]}
    md = markdown_table(runs, metrics, ["B", "A"])
    lines = md.splitlines()
    assert lines[0].startswith("| method | seeds | Δ composite | Δ VQ | Δ TA |")
    row_b, row_a = lines[2], lines[3]
    assert row_b.startswith("| B | 1 | -0.") and "†" in row_b
    assert float(row_b.split("|")[3].split("±")[0]) == pytest.approx(-0.4, abs=0.02)
    assert row_a.startswith("| A | 2 | +0.") and "†" not in row_a
    assert float(row_a.split("|")[3].split("±")[0]) == pytest.approx(0.4, abs=0.02)
    assert "| -4.000 |" in row_b  # last 25% of B's 4 steps: step 4
    assert "one seed" in md
    xs, ys = mean_curve(metrics["A"], "reward_mean")
    assert xs.tolist() == [1, 2] and ys.tolist() == [2.0, 3.0]  # steps every seed reached
    png = plot_curves(metrics, ["VQ", "TA"], tmp_path / "c.png", title="t")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000


def test_cost_columns_and_ranking_by_gain_per_rollout_second():
    runs = [_run("A", 0, 0.1), _run("A", 1, 0.3), _run("B", 0, -0.2), _run("C", 0, 0.05), _run("C", 1, 0.05)]

    def ms(gen, train):  # a run's metrics rows: cumulative stage seconds, the last row holds the run's
        return [{"step": 1, "reward_mean": 0.0, "time/generate": gen / 2, "time/train": train / 2},
                {"step": 2, "reward_mean": 0.0, "time/generate": gen, "time/train": train}]
    metrics = {"A": [ms(10.0, 4.0), ms(20.0, 6.0)], "B": [ms(5.0, 1.0)], "C": [ms(2.0, 8.0), ms(2.0, 8.0)]}
    g = gains(runs)
    md = markdown_table(runs, metrics, ["A", "B", "C"])
    head, row_a = md.splitlines()[0], md.splitlines()[2]
    assert head.endswith("| rollout s | learner s | Δ composite / rollout-s |")
    cells = [c.strip() for c in row_a.split("|")]
    assert cells[-4:-1] == ["15.0", "5.0", f"{g['A']['composite'][0] / 15.0:+.5f}"]
    assert "time/generate" in md
    cost = costs(g, metrics, ["A", "B", "C"])
    assert cost["C"].gain_per_rollout == pytest.approx(g["C"]["composite"][0] / 2.0)
    rank = ranking_section(cost, "C", cost_ratios(runs, metrics, ["A", "B", "C"], "C")).splitlines()
    order = [line.split("|")[2].strip() for line in rank if line.split("|")[1:2] and line.split("|")[1].strip().isdigit()]
    want = sorted("ABC", key=lambda r: -cost[r].gain_per_rollout)
    assert order == want and order[-1] == "B"                     # a loss ranks last
    ratio = cost["A"].gain_per_rollout / cost["C"].gain_per_rollout
    assert f"{ratio:.2f}×" in next(line for line in rank if "| A |" in line)
    assert next(line for line in rank if "| B |" in line).endswith("| — |")  # no ratio of a loss
    # with GPUs on the rollout actors the unit is the rollout-GPU-second
    gpu = costs(g, metrics, ["A", "B", "C"], {"A": 2.0, "B": 2.0, "C": 2.0})
    assert gpu["A"].gain_per_rollout == pytest.approx(cost["A"].gain_per_rollout / 2)
    assert "Δ composite / rollout-GPU-s" in markdown_table(runs, metrics, ["A"], {"A": 2.0})


def _exact(row, seed, gain, n=6, heads=("VQ", "TA")):
    """A run whose composite gain is exactly `gain` on every pair (half of it per head)."""
    rng = np.random.default_rng([seed, 7])
    before = rng.normal(size=(n, len(heads)))
    after = before + gain / len(heads)
    return {"row": row, "seed": seed, "heads": list(heads), "wall_s": 1.0,
            "before": {"values": before.tolist(), "composite": before.sum(1).tolist()},
            "after": {"values": after.tolist(), "composite": after.sum(1).tolist()}}


def _secs(rollout):
    return [{"step": 1, "reward_mean": 0.0, "time/generate": rollout, "time/train": 1.0}]


def test_a_cost_ratio_never_mixes_seed_sets():
    """The reference ran seeds 0-3 and gained much more on 0-1 than on 2-3; the row ran 0-1 only. Its
    ratio must be taken against the reference's seeds 0-1 alone (gains and seconds), not the
    reference's mean over all four, and the ranking must say it rests on 2 seeds."""
    ref_gain, ref_secs = [0.08, 0.06, 0.01, 0.01], [10.0, 12.0, 30.0, 30.0]
    runs = [_exact("D", s, g) for s, g in enumerate(ref_gain)] + [_exact("X", 0, 0.05), _exact("X", 1, 0.03)]
    metrics = {"D": [_secs(t) for t in ref_secs], "X": [_secs(5.0), _secs(7.0)]}
    cost = costs(gains(runs), metrics, ["D", "X"])
    r = cost_ratios(runs, metrics, ["D", "X"], "D")
    assert r["X"].seeds == (0, 1) and r["D"].seeds == (0, 1, 2, 3)
    matched = (0.04 / 6.0) / (0.07 / 11.0)                    # both rows on seeds 0 and 1: 1.048
    assert r["X"].ratio == pytest.approx(matched)
    mixed = cost["X"].gain_per_rollout / cost["D"].gain_per_rollout  # the reference on its 4 seeds: 3.42
    assert abs(mixed - matched) > 1.0
    line = next(x for x in ranking_section(cost, "D", r).splitlines() if "| X |" in x)
    cells = [c.strip() for c in line.split("|")]
    assert cells[6] == "2" and cells[7].startswith(f"{matched:.2f}× [")
    assert next(x for x in ranking_section(cost, "D", r).splitlines() if "| D |" in x).endswith(
        "| 4 | 1 (the reference) |")
    # on the same seeds the matched ratio is the rows' own quotient
    same = [_exact("D", s, g) for s, g in enumerate(ref_gain[:2])] + [_exact("X", 0, 0.05), _exact("X", 1, 0.03)]
    m2 = {"D": [_secs(t) for t in ref_secs[:2]], "X": metrics["X"]}
    c2 = costs(gains(same), m2, ["D", "X"])
    assert cost_ratios(same, m2, ["D", "X"], "D")["X"].ratio == pytest.approx(
        c2["X"].gain_per_rollout / c2["D"].gain_per_rollout)


def test_cost_ratio_interval_is_a_seeded_paired_bootstrap_and_lands_in_compare_json(tmp_path):
    from cluster.compare.runner import write_report

    runs = [_exact("ref", s, g) for s, g in enumerate([0.02, 0.03, 0.025, 0.02, 0.04])] + \
           [_exact("up", s, g) for s, g in enumerate([0.05, 0.02, 0.06, 0.04, 0.05])]
    metrics = {"ref": [_secs(t) for t in (20.0, 22.0, 21.0, 19.0, 20.0)],
               "up": [_secs(t) for t in (10.0, 11.0, 9.0, 10.0, 12.0)]}
    a = cost_ratios(runs, metrics, ["ref", "up"], "ref")["up"]
    b = cost_ratios(runs, metrics, ["ref", "up"], "ref")["up"]
    assert a == b and a.n == 5 and a.low < a.ratio < a.high          # deterministic, around the estimate
    p = tmp_path / "m.yaml"
    p.write_text(f"base: {QUICKSTART}\nseeds: 5\nreference: ref\nrows: {{ref: [kl.strategy=none], up: [kl.strategy=dual]}}\n")
    write_report(load_matrix(p), {"runs": runs, "metrics": metrics, "failed": {}, "interrupted": False},
                 tmp_path, "vgrpo compare -c m.yaml", 1.0)
    j = json.loads((tmp_path / "compare.json").read_text())["cost_ratio"]["up"]
    assert j["n"] == 5 and j["seeds"] == [0, 1, 2, 3, 4]
    assert j["ratio"] == pytest.approx(a.ratio) and j["ci95"] == pytest.approx([a.low, a.high])
    assert "| 5 | " + f"{a.ratio:.2f}× [{a.low:.2f}×, {a.high:.2f}×] |" in (tmp_path / "compare.md").read_text()


# --- 3. one real tiny comparison through Driver ------------------------------------------------

def test_tiny_compare_runs_rows_through_driver_reuses_finished_runs_and_runs_two_at_once(ray_session, tmp_path):
    """Two rows through Driver one at a time, each measuring its own before-evaluation, and a second
    call that reuses the finished runs; then the same runs two in flight at once (threads, one Ray
    cluster, one shared before-evaluation): sync mode is deterministic given train.seed, so every
    record is identical to the one-at-a-time run's."""
    from cluster.compare.runner import run_matrix, write_report

    p = tmp_path / "tiny.yaml"
    p.write_text(
        f"base: {QUICKSTART}\n"
        "budget: [train.steps=2, train.groups_per_step=1, train.eval_seeds=1, sampler.group_size=4,\n"
        "         schedule.steps=4, bank.capacity=4, train.checkpoint_every=1000, train.mode=sync]\n"
        "seeds: 1\nparallel: 2\n"
        "rows:\n  SAGE dual: [kl.strategy=dual]\n  FlowGRPO: [sde.scheme=flow, sde.eta=null, kl.strategy=none]\n")
    m = load_matrix(p)
    assert m.parallel == 2
    notes: list[str] = []
    out = tmp_path / "out"
    one = run_matrix(m, out, note=notes.append, share_before=False, parallel=1)
    assert not one["failed"] and not one["interrupted"], one["failed"]
    assert [r["row"] for r in one["runs"]] == ["SAGE dual", "FlowGRPO"]
    for r in one["runs"]:
        assert r["steps"] == 2 and len(r["after"]["composite"]) == 4  # 4 eval prompts × 1 seed
    # measured separately, both rows' before-evaluations agree: sharing one is sound
    b0, b1 = (np.array(r["before"]["values"]) for r in one["runs"])
    np.testing.assert_allclose(b0, b1, atol=1e-5)
    assert [[row["step"] for row in ms[0]] for ms in one["metrics"].values()] == [[1, 2], [1, 2]]
    flow_cfg = (out / "FlowGRPO" / "seed0" / "config.yaml").read_text()
    assert "scheme: flow" in flow_cfg
    md = write_report(m, one, out, "vgrpo compare -c tiny.yaml", 1.0)
    text = md.read_text()
    assert "| SAGE dual | 1 |" in text and "| FlowGRPO | 1 |" in text
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "compare.json").read_text())
    assert set(summary["gains"]) == {"SAGE dual", "FlowGRPO"}
    for c in summary["cost"].values():   # measured in the same runs, from their metrics.jsonl
        assert c["rollout_s"] > 0 and c["learner_s"] > 0 and c["gain_per_rollout"] == c["gain"] / c["rollout_s"]
    assert "## Ranking by gain per rollout-s" in text
    assert ray_session.is_initialized()  # the fixture's cluster is left running
    # a second call reuses the finished runs instead of training again
    reused: list[str] = []
    again = run_matrix(m, out, note=reused.append, parallel=1)
    assert sum("reusing" in n for n in reused) == 2
    assert again["runs"] == one["runs"]

    # the same runs two at once (the matrix's parallel: 2) give the same records
    two = run_matrix(m, tmp_path / "two", note=notes.append)
    assert not two["failed"] and not two["interrupted"], two["failed"]
    assert not any("holds" in n for n in notes)  # the session's cluster fits two runs: no cut
    strip = lambda r: {k: v for k, v in r.items() if k != "wall_s"}  # noqa: E731
    assert [strip(r) for r in one["runs"]] == [strip(r) for r in two["runs"]]
    assert [r["row"] for r in two["runs"]] == ["SAGE dual", "FlowGRPO"]  # plan order, whatever finished first
    # not vacuous: training moved the policy, and the two methods moved it differently
    a, b = (np.array(r["after"]["values"]) for r in two["runs"])
    assert not np.array_equal(a, b) and not np.array_equal(a, np.array(two["runs"][0]["before"]["values"]))
    # the training rewards per step too (the rest of a metrics row is timing)
    rewards = lambda res: {r: [[{k: v for k, v in row.items() if k == "step" or k.startswith("reward")}  # noqa: E731
                                for row in ms] for ms in per_row] for r, per_row in res["metrics"].items()}
    assert rewards(one) == rewards(two) and rewards(two)["FlowGRPO"][0][1]["reward_mean"] is not None


def test_cli_reports_a_bad_matrix_in_one_line_before_running_anything(tmp_path, capsys):
    from cluster.cli import main

    bad = _matrix(tmp_path, "  ok: []\n  broken: [kl.lam=-3]\n")
    assert main(["compare", "-c", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "row 'broken': kl.lam = -3" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing ran, nothing was written
    assert main(["compare", "-c", str(ROOT / "configs" / "ablate_kl.yaml"), "--rows", "nope",
                 "--out", str(tmp_path / "o2")]) == 2
    assert "--rows: unknown row(s) ['nope']" in capsys.readouterr().err


def test_cli_parallel_wins_over_the_matrix_and_is_checked(tmp_path, capsys, monkeypatch):
    import cluster.cli.compare_cmd as cc
    from cluster.cli import main

    kl = str(ROOT / "configs" / "ablate_kl.yaml")
    assert main(["compare", "-c", kl, "--parallel", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--parallel 0: must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    seen = []

    def fake_run_matrix(matrix, out, rows, note, parallel):  # records what the CLI passes, trains nothing
        seen.append((matrix.parallel, parallel))
        return {"runs": [], "metrics": {}, "failed": {}, "interrupted": False}

    monkeypatch.setattr(cc, "run_matrix", fake_run_matrix)
    assert main(["compare", "-c", kl, "--parallel", "3", "--out", str(tmp_path / "a")]) == 0
    assert main(["compare", "-c", kl, "--out", str(tmp_path / "b")]) == 0
    assert seen == [(1, 3), (1, 1)]  # ablate_kl.yaml sets no parallel: 1
    assert "1 run(s) at once" in (tmp_path / "b" / "compare.md").read_text()
    assert "3 run(s) at once" in (tmp_path / "a" / "compare.md").read_text()


def test_before_cache_measures_each_key_once_across_threads_and_retries_after_a_failure():
    import threading

    from cluster.compare.runner import BeforeCache

    cache, calls, release = BeforeCache(), [], threading.Event()

    def measure():
        calls.append(threading.current_thread().name)
        release.wait(timeout=60)  # held until the other thread has started asking
        return "base"

    got: list[str] = []
    first = threading.Thread(target=lambda: got.append(cache.get("k", measure)), name="first")
    first.start()
    second = threading.Thread(target=lambda: got.append(cache.get("k", measure)), name="second")
    second.start()
    release.set()
    first.join(60)
    second.join(60)
    assert got == ["base", "base"] and len(calls) == 1  # whichever interleaving: measured once
    assert cache.get("k", lambda: "never") == "base"

    def broken():
        raise RuntimeError("setup failed")

    with pytest.raises(RuntimeError):
        cache.get("other", broken)
    assert cache.get("other", lambda: "measured again") == "measured again"  # a failure is not cached


def test_ctrl_c_stops_every_run_in_flight_and_any_run_that_starts_after():
    import threading

    from cluster.compare.runner import ActiveDrivers

    class FakeDriver:  # only the attribute the Ctrl-C path touches
        def __init__(self):
            self.stop_requested = threading.Event()

    active = ActiveDrivers()
    a, b, late = FakeDriver(), FakeDriver(), FakeDriver()
    active.add(a)
    active.add(b)
    active.discard(b)  # finished before Ctrl-C
    active.stop_all()
    assert a.stop_requested.is_set() and not b.stop_requested.is_set() and active.stopping.is_set()
    active.add(late)
    assert late.stop_requested.is_set()


def test_imports_are_warmed_in_the_main_thread_before_parallel_runs():
    """In a fresh interpreter two Drivers building the toy model at once raced in diffusers' lazy
    module ("cannot import name 'WanTransformer3DModel'"); run_matrix loads it once first."""
    import subprocess
    import sys

    code = (
        "import sys, threading\n"
        "from common.config import load_config\n"
        "from cluster.compare.runner import _warm_imports\n"
        "from cluster.driver.preflight import check_model_path\n"
        f"cfg = load_config({str(QUICKSTART)!r})\n"
        "assert 'diffusers.models.transformers.transformer_wan' not in sys.modules\n"
        "_warm_imports(cfg)\n"
        "assert 'diffusers.models.transformers.transformer_wan' in sys.modules\n"
        "errors = []\n"
        "def load():\n"
        "    try:\n"
        "        check_model_path(cfg)\n"
        "    except Exception as e:\n"
        "        errors.append(e)\n"
        "ts = [threading.Thread(target=load) for _ in range(2)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "assert not errors, errors\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_runs_go_seed_by_seed_so_a_cut_short_comparison_keeps_every_row_paired():
    from cluster.compare.runner import run_order

    plan = [(i, row, s) for i, (row, s) in enumerate((r, s) for r in ("A", "B", "C") for s in range(3))]
    order = run_order(plan)
    assert [(row, s) for _, row, s in order][:3] == [("A", 0), ("B", 0), ("C", 0)]
    # after any prefix of whole seeds, every row has the same seeds
    for k in (3, 6, 9):
        seen = {}
        for _, row, s in order[:k]:
            seen.setdefault(row, set()).add(s)
        assert len({frozenset(v) for v in seen.values()}) == 1 and len(seen) == 3


def test_second_stage_runs_the_seeds_a_wide_interval_asks_for_and_keeps_pairs_paired(tmp_path, monkeypatch):
    """The rounds of run_matrix with the training replaced by synthetic records (a pure test of the
    plan; the real Driver path is test_tiny_compare_runs_rows_through_driver_and_reuses_finished_runs):
    "noisy" differs from the reference by 0.05 ± 0.0535 per seed, "steady" by exactly 0.01."""
    import cluster.compare.runner as cc
    import cluster.driver.pools as pools

    class Handle:
        def shutdown(self) -> None:
            pass

    def fake_run_one(cfg, before_cache=None, note=print, active=None):
        from common.config import save_config

        path = Path(cfg.run.root) / cfg.run.name
        path.mkdir(parents=True)
        save_config(cfg, path / "config.yaml")  # as RunDir.create does; a later call reuses by it
        (path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 2.0}) + "\n")
        s, row = cfg.train.seed, Path(cfg.run.root).name
        gain = {"ref": 0.05, "noisy": 0.10 + (0.05 if s % 2 else -0.05), "steady": 0.06}[row]
        before = np.zeros((4, 2))
        after = before + gain / 2
        ev = lambda v: {"values": v.tolist(), "composite": v.sum(1).tolist()}  # noqa: E731
        return {"row": None, "seed": s, "heads": ["VQ", "TA"], "steps": 1, "wall_s": 0.0,
                "before": ev(before), "after": ev(after)}

    monkeypatch.setattr(cc, "run_one", fake_run_one)
    monkeypatch.setattr(pools, "init_ray", lambda cfg, copies=1: Handle())
    monkeypatch.setattr(cc, "_warm_imports", lambda cfg: None)
    monkeypatch.setattr(cc, "_fit_parallel", lambda cfg, parallel, note: parallel)
    p = _matrix(tmp_path, "  ref: [kl.strategy=none]\n  noisy: [kl.strategy=dual]\n  steady: [kl.strategy=fixed]\n",
                "reference: ref\nmost_seeds: 40\n")
    m = load_matrix(p).for_mode(quick=False, seeds=8)
    notes: list[str] = []
    result = cc.run_matrix(m, tmp_path / "out", note=notes.append, parallel=2)
    seeds = {}
    for r in result["runs"]:
        seeds.setdefault(r["row"], []).append(r["seed"])
    # sd 0.0535 over 8 seeds needs 30 (test_seed_targets_give_each_wide_pair_the_seeds_its_spread_needs);
    # the reference runs them too, so every seed of "noisy" is paired; "steady" is resolved at 8
    assert seeds == {"ref": list(range(30)), "noisy": list(range(30)), "steady": list(range(8))}
    assert any("noisy 8 → 30" in n and "ref 8 → 30" in n for n in notes)
    # with the 30 seeds the noisy interval is within ±0.02, and a second call reuses every run
    from cluster.compare.stats import paired_difference
    assert paired_difference(result["runs"], "noisy", "ref").half_width <= 0.02
    again = cc.run_matrix(m, tmp_path / "out", note=notes.append, parallel=2)
    assert len(again["runs"]) == 68 and sum("reusing" in n for n in notes) == 68
    # the report says how the seeds were chosen, and each row's count
    md = cc.write_report(m, result, tmp_path / "out", "vgrpo compare -c m.yaml", 1.0).read_text()
    assert "8 seeds per row, then up to 40 for a row whose paired interval was wider than ±0.02" in md
    assert "| noisy | 30 |" in md and "| steady | 8 |" in md
    # without most_seeds above seeds there is one stage
    one = cc.run_matrix(load_matrix(p).for_mode(quick=True, seeds=8), tmp_path / "quick", note=notes.append)
    assert len(one["runs"]) == 24

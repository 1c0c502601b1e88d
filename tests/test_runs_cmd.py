"""`vgrpo runs`: one line per run directory with its step, status (and why it stopped), last
reward, before → after result and wall time, from the files `vgrpo train` writes."""

from __future__ import annotations

import json
import subprocess
import sys

from cluster.cli import main
from cluster.runs.run_dir import RunDir
from common.config import load_config


def _run(root, name: str, rewards: list[float], steps: int = 10) -> RunDir:
    rd = RunDir.create(load_config(None, [f"run.root={root}", f"run.name={name}", f"train.steps={steps}"]))
    for i, r in enumerate(rewards, 1):
        rd.log({"step": i, "time_s": 2.0 * i, "reward_mean": r, "bank/bytes": float("nan")})
    return rd


def _listed(capsys, root) -> dict[str, dict]:
    capsys.readouterr()
    assert main(["runs", str(root), "--json"]) == 0
    return {r["run"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}


def test_runs_lists_step_status_reward_result_and_wall_time(tmp_path, capsys):
    done = _run(tmp_path, "done", [0.1, 0.2, 0.3], steps=3)
    done.set_status("running")
    done.summary_file.write_text(json.dumps({"before": {"composite_mean": 0.11}, "after": {"composite_mean": 0.42}}))
    done.set_status("finished")
    stopped = _run(tmp_path, "stopped", [0.5, 0.4])
    stopped.set_status("running")
    stopped.set_status("stopped", "the learner died (RayActorError)")
    live = _run(tmp_path, "live", [0.7])
    live.set_status("running")  # this test's own process: alive
    dead = _run(tmp_path, "dead", [])
    dead.set_status("running")
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    status = json.loads(dead.status_file.read_text())
    status["pid"] = int(proc.stdout)  # a process that has exited: killed before it could say so
    dead.status_file.write_text(json.dumps(status))
    (tmp_path / "not-a-run").mkdir()

    runs = _listed(capsys, tmp_path)
    assert sorted(runs) == ["dead", "done", "live", "stopped"]
    d = runs["done"]
    assert (d["step"], d["steps"], d["status"], d["reason"]) == (3, 3, "finished", None)
    assert (d["reward"], d["before"], d["after"]) == (0.3, 0.11, 0.42)
    sessions = json.loads(done.status_file.read_text())["sessions"]
    assert d["wall_s"] == sessions[0][1] - sessions[0][0]
    s = runs["stopped"]
    assert (s["step"], s["status"], s["reason"], s["reward"]) == (2, "stopped", "the learner died (RayActorError)", 0.4)
    assert s["before"] is None and s["after"] is None
    assert (runs["live"]["status"], runs["live"]["reward"]) == ("running", 0.7)
    assert runs["dead"]["status"] == "stopped" and "killed or crashed" in runs["dead"]["reason"]
    assert (runs["dead"]["step"], runs["dead"]["reward"]) == (0, None)

    # the table a person reads holds the same facts
    assert main(["runs", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for part in ("done", "3/3", "finished", "0.300", "0.110 → 0.420", "stopped: the learner died", "2/10"):
        assert part in text


def test_runs_resumed_run_sums_its_sessions(tmp_path, capsys):
    rd = _run(tmp_path, "r", [0.1])
    for state in ("running", "stopped", "running", "finished"):
        rd.set_status(state)
    sessions = json.loads(rd.status_file.read_text())["sessions"]
    assert len(sessions) == 2 and all(end is not None for _, end in sessions)
    assert _listed(capsys, tmp_path)["r"]["wall_s"] == sum(end - start for start, end in sessions)


def test_runs_on_a_missing_root_says_so_in_one_line(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nope: no such folder" in err


def test_runs_lists_a_run_whose_files_are_damaged(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text("train: [unclosed\n")
    (broken / "summary.json").write_text("{not json")
    (broken / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.2}\n{"step": 2, "rew')  # cut by a kill
    r = _listed(capsys, tmp_path)["broken"]
    assert (r["step"], r["steps"], r["status"], r["reward"], r["after"]) == (1, None, "unknown", 0.2, None)

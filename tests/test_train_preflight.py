"""`vgrpo train` checks every input before it creates a run directory, and a run that fails
before its first checkpoint leaves no run directory behind."""

from __future__ import annotations

import importlib.util

import pytest

from cluster.cli import main


def _train(tmp_path, *overrides: str) -> int:
    return main(["train", "-c", "configs/quickstart.yaml", f"run.root={tmp_path / 'runs'}", "run.name=r",
                 *overrides])


CASES = {
    "missing prompts file": (["train.prompts=/nonexistent/prompts.txt"],
                             "train.prompts: /nonexistent/prompts.txt: prompts file not found"),
    "missing eval prompts": (["train.eval_prompts=/nonexistent/eval.txt"],
                             "train.eval_prompts: /nonexistent/eval.txt: prompts file not found"),
    "missing model path": (["model.path=/nonexistent/toy.safetensors"],
                           "model.path '/nonexistent/toy.safetensors' does not exist"),
    "wan without a model path": (["model.family=wan"], "model.path is required for model.family = 'wan'"),
    "reward without a path": (["rewards.models=[{name: videoalign}]"],
                              "rewards.models[0].path is required for name = 'videoalign'"),
    "missing reward path": (["rewards.models=[{name: hpsv3, path: /nonexistent/hpsv3}]"],
                            "rewards.models[0].path = '/nonexistent/hpsv3' does not exist"),
    "reward with no scorer": (["rewards.models=[{name: ocr}]"], "rewards.models.0.name = 'ocr': has no scorer; use one of toy, toy_i2v"),
    "unknown backend": (["log.backends=[neptune]"], "log.backends.0 = 'neptune' is not allowed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_in_one_line_and_leaves_no_run_directory(tmp_path, capsys, case):
    overrides, message = CASES[case]
    assert _train(tmp_path, *overrides) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert not (tmp_path / "runs").exists()


def test_missing_tracker_package_names_the_pip_install_before_anything_starts(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert _train(tmp_path, "log.backends=[jsonl,wandb]") == 2
    assert capsys.readouterr().err.strip() == ("error: log.backends lists 'wandb' but the wandb package is "
                                               "not installed; run: pip install 'vgrpo[wandb]'")
    assert not (tmp_path / "runs").exists()


def test_a_run_that_fails_while_starting_is_removed(tmp_path, monkeypatch):
    """Past the checks (here: the actors fail to start), the half-made run directory goes too."""
    from cluster.driver.driver import Driver

    made = []

    def setup(self, resume=None):
        made.append(self.run_dir.path)
        assert (self.run_dir.path / "config.yaml").is_file()
        raise RuntimeError("no GPU for the rollout actor")

    monkeypatch.setattr(Driver, "setup", setup)
    with pytest.raises(RuntimeError, match="no GPU"):
        _train(tmp_path)
    assert made and not made[0].exists()


def test_a_run_stopped_by_a_fault_is_kept_with_its_reason(tmp_path, monkeypatch, capsys):
    """The driver stops cleanly after its checkpoint: the run stays, status.json says why."""
    import json

    from cluster.driver.driver import Driver

    def run(self, progress=None):
        self.state.step = 1
        self.run_dir.log({"step": 1, "time_s": 1.0, "reward_mean": 0.5})
        self.stop_reason = "the learner died (RayActorError)"

    def checkpoint(self):
        (self.run_dir.checkpoints / f"step_{self.step:08d}").mkdir()

    for name, fn in {"setup": lambda self, resume=None: None, "run": run, "checkpoint": checkpoint,
                     "heads": lambda self: [], "teardown": lambda self: None}.items():
        monkeypatch.setattr(Driver, name, fn)
    assert _train(tmp_path, "--no-eval") == 1
    run_dir = tmp_path / "runs" / "r"
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["reason"]) == ("stopped", "the learner died (RayActorError)")
    capsys.readouterr()
    assert main(["runs", str(tmp_path / "runs"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert (listed["status"], listed["reason"], listed["step"], listed["reward"]) == \
        ("stopped", "the learner died (RayActorError)", 1, 0.5)

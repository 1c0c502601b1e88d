"""Bounds on the config: values no real run reaches are refused at load in one line naming the
field (they were met as overflows deep in Ray, Redis or a socket, or as a busy loop); errors stay
readable whatever the input's size or depth; `run.name` is a name, not a path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("override, field", [
    ("model.num_frames=1000000", "model.num_frames"),
    ("model.height=100000", "model.height"),
    ("pools.rollout.num_actors=1000000", "pools.rollout.num_actors"),
    ("pools.reward.num_gpus=100000", "pools.reward.num_gpus"),
    ("train.groups_per_step=1000000", "train.groups_per_step"),
    ("train.steps=1000000000000", "train.steps"),
    ("train.seed=-1", "train.seed"),
    ("train.seed=18446744073709551616", "train.seed"),
    ("weight_sync.timeout_s=1e300", "weight_sync.timeout_s"),
    ("bank.lease_ttl_s=1e300", "bank.lease_ttl_s"),
    ("bank.lease_ttl_s=1e-6", "bank.lease_ttl_s"),          # renewed 7,413 times a second
    ("bank.outage_s=1e300", "bank.outage_s"),
    ("sampler.timeout_s=1e300", "sampler.timeout_s"),
    ("learner.collective_timeout_s=1e300", "learner.collective_timeout_s"),
    ("learner.checkpoint_timeout_s=172800", "learner.checkpoint_timeout_s"),
    ("learner.rank_failure_grace_s=0", "learner.rank_failure_grace_s"),
    ("learner.rank_failure_grace_s=1e300", "learner.rank_failure_grace_s"),
    ("bank.max_bytes=1e30", "bank.max_bytes"),
])
def test_values_no_real_run_reaches_are_refused_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    line = str(err.value)
    assert "\n" not in line and field in line and len(line) < 400, line


@pytest.mark.parametrize("override", [
    "model.num_frames=121", "pools.rollout.num_actors=512", "train.seed=4294967295",
    "weight_sync.timeout_s=86400", "bank.lease_ttl_s=0.3", "train.steps=100000"])
def test_the_bounds_leave_real_runs_alone(override):
    load_config(None, [override])


def _bomb(path: Path) -> Path:
    """A few hundred bytes of YAML aliases that expand to 9^7 strings."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcde", "bcdef", strict=True):
        lines.append(f"{name}: &{name} [{','.join(['*' + prev] * 9)}]")
    lines.append("train:\n  prompts: [" + ",".join(["*f"] * 9) + "]")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_alias_bomb_gives_a_short_error(tmp_path):
    f = _bomb(tmp_path / "bomb.yaml")
    assert f.stat().st_size < 400
    with pytest.raises(ConfigError) as err:
        load_config(f)
    line = str(err.value)
    assert "\n" not in line and "train.prompts" in line and len(line) < 1000, len(line)


@pytest.mark.parametrize("where", ["file", "override"])
def test_deeply_nested_yaml_is_one_line(tmp_path, where):
    deep = "[" * 50_000 + "]" * 50_000
    if where == "file":
        f = tmp_path / "deep.yaml"
        f.write_text(f"train:\n  prompts: {deep}\n")
        args: tuple = (f, [])
    else:
        args = (None, [f"train.prompts={deep}"])
    with pytest.raises(ConfigError, match="nested too deeply") as err:
        load_config(*args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".", "a\\b", "x\x00y", "tab\there", "/abs", ""])
def test_run_name_must_be_a_name_not_a_path(name):
    with pytest.raises(ConfigError, match="run.name") as err:
        load_config(None, [f"run.name={name!r}" if name else "run.name=''"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["quickstart", "wan-2.2_lora.v3", "café", "run 7"])
def test_ordinary_run_names_are_kept(name, tmp_path):
    from cluster.runs.run_dir import RunDir

    cfg = load_config(None, [f"run.name={name!r}", f"run.root={tmp_path}"])
    rd = RunDir.create(cfg)
    assert rd.path.parent == tmp_path and rd.path.name == name


def test_the_cli_refuses_a_bomb_and_a_negative_seed_in_one_short_line(tmp_path):
    f = _bomb(tmp_path / "bomb.yaml")
    for args in (["train", "-c", str(f)], ["train", "-c", "configs/quickstart.yaml", "train.seed=-1"]):
        out = subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and len(lines[0]) < 1000, out.stderr[-2000:]
        assert "Traceback" not in out.stderr


@pytest.mark.parametrize("where", ["override", "file"])
def test_a_5000_digit_number_is_one_line_naming_the_field_or_file(tmp_path, where):
    """yaml reads digits with int(), which refuses more than sys.get_int_max_str_digits() (4300)."""
    digits = "7" * 5000
    if where == "override":
        args = ["train", "-c", "configs/quickstart.yaml", f"train.seed={digits}"]
        needle = "override 'train.seed': a number longer than 4300 digits"
    else:
        f = tmp_path / "big.yaml"
        f.write_text(f"train:\n  seed: {digits}\n")
        args, needle = ["train", "-c", str(f)], f"{f}: a number longer than 4300 digits"
    out = subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines[0].startswith(f"error: {needle}") and len(lines[0]) < 300, lines


def test_an_unreadable_yaml_date_in_an_override_is_left_to_the_field():
    """A ValueError from yaml other than the digit limit (a date 2024-13-45) keeps the text as typed."""
    assert load_config(None, ["train.prompts=2024-13-45"]).train.prompts == "2024-13-45"
    with pytest.raises(ConfigError, match="train.seed"):
        load_config(None, ["train.seed=2024-13-45"])

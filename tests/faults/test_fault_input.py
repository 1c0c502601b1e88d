"""Bad input gets one clear line naming the field or file, before anything starts; and the
security rules that are checked statically. Covered elsewhere, not repeated here: malformed
YAML, unknown keys, wrong types, ranges and the config fuzz (tests/test_config.py); corrupt and
foreign-shaped blobs, pickles and the codec fuzz (tests/test_bank_codec.py); password-less
external Redis refused unless allowed (tests/test_bank_server.py); no public Redis or dashboard
Service in the Helm chart (tests/test_deploy_chart.py::test_no_public_services_by_default)."""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata

import pytest
from fault_helpers import ROOT

from cluster.data.prompts import load_prompts
from cluster.data.text import MAX_PROMPT_CHARS
from common.config import ConfigError


def _train(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", "train", "-c", "configs/quickstart.yaml", "--no-eval",
         f"run.root={tmp_path}", "run.name=bad", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kind", ["missing", "incomplete"])
def test_bad_model_path_is_one_line_exit_2(tmp_path, kind):
    path = tmp_path / "wan-model"
    if kind == "incomplete":
        (path / "transformer").mkdir(parents=True)
    out = _train(tmp_path, "model.family=wan", f"model.path={path}")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert str(path) in lines[0]
    assert ("does not exist" if kind == "missing" else "model_index.json") in lines[0]


def test_empty_prompts_file_names_the_file(tmp_path):
    for text in ("", "\n\n", "# only a comment\n"):
        f = tmp_path / "p.txt"
        f.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(str(f)) + ".*no prompts"):
            load_prompts(str(f))
    with pytest.raises(ConfigError, match="not found"):
        load_prompts(str(tmp_path / "missing.txt"))


def test_unusual_unicode_prompts_load_normalised(tmp_path):
    f = tmp_path / "p.txt"
    nfd = unicodedata.normalize("NFD", "a café scene")
    f.write_text(f"{nfd}\na café scene\n赤い四角が右に動く 🎈\nمربع أحمر\nzero\u200bwidth\n", encoding="utf-8")
    conds = load_prompts(str(f))
    assert [c.prompt for c in conds] == ["a café scene", "赤い四角が右に動く 🎈", "مربع أحمر", "zero\u200bwidth"]
    assert len({c.id for c in conds}) == len(conds)           # NFD and NFC spellings are one condition


@pytest.mark.parametrize("line, needle", [
    ("x" * (MAX_PROMPT_CHARS + 1), f"limit is {MAX_PROMPT_CHARS}"),
    ("bell\x07inside", "control character"),
])
def test_long_or_control_prompts_name_file_and_line(tmp_path, line, needle):
    f = tmp_path / "p.txt"
    f.write_text(f"a red square moving up\n{line}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{f}:2") + ".*" + re.escape(needle)):
        load_prompts(str(f))


def test_non_utf8_prompts_file_names_the_file(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"a red square \xff moving up\n")
    with pytest.raises(ConfigError, match=re.escape(str(f)) + ".*not UTF-8"):
        load_prompts(str(f))


def _sources(*dirs):
    for d in dirs:
        yield from (p for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)


def test_ray_token_auth_is_never_turned_off():
    # Ray 2.60 turns token auth on by default; nothing on the driver or worker path may opt out
    offenders = [str(p) for p in _sources("cluster", "common", "learner", "rollout_worker", "reward_worker",
                                          "memory_bank", "benchmarks")
                 if re.search(r"RAY_AUTH_MODE|auth_mode\s*=", p.read_text(encoding="utf-8"))]
    assert not offenders
    deploy = [str(p) for p in (ROOT / "deploy").rglob("*") if p.is_file()
              and re.search(r"RAY_AUTH_MODE\W+disabled", p.read_text(errors="ignore"))]
    assert not deploy


def test_nothing_read_from_redis_is_unpickled():
    for p in _sources("memory_bank"):
        text = p.read_text(encoding="utf-8")
        assert not re.search(r"\bimport pickle\b|\bpickle\.loads?\b|cloudpickle|torch\.load\(", text), p


def test_a_bank_that_cannot_hold_one_step_exits_2(ray_session, tmp_path, capfd):
    """bank.max_bytes below one step's groups is refused at the first group pushed (a rollout
    actor finds it): the run stops naming the field and the bound needed, exit 2 as bad input.
    In this process on the session's Ray (its start is not what is tested); capfd reads the
    process's own stdout and stderr, whatever wrote them."""
    from cluster.cli import main

    capfd.readouterr()
    rc = main(["train", "-c", str(ROOT / "configs/quickstart.yaml"), "--no-eval", f"run.root={tmp_path}",
               "run.name=small-bank", "bank.max_bytes=1048576", "health.enabled=false"])
    out = capfd.readouterr()
    assert rc == 2, (out.out[-2000:], out.err[-2000:])
    said = " ".join((out.out + out.err).split())
    assert "bank.max_bytes=1048576 cannot hold one training step" in said and "set bank.max_bytes to at least" in said
    assert "Traceback" not in out.err

"""`vgrpo sample --prompt`: an empty prompt, one outside the reward model's grammar (the toy world
reads only "a COLOUR SHAPE moving DIRECTION" and scores anything else NaN) or one that is not
text is refused in one line, exit 2, before anything is sampled; a NaN score is never printed as
a result (`composite nan` with exit 0, before)."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.cli import main
from common import scorers


def _sample(capsys, tmp_path, prompt: str, *extra) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    rc = main(["sample", "base", "--prompt", prompt, "--out", str(tmp_path / "s.gif"), *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err.strip().splitlines()


@pytest.mark.parametrize("prompt", ["", "   ", "\t"])
def test_an_empty_prompt_is_refused(tmp_path, capsys, prompt):
    rc, out, err = _sample(capsys, tmp_path, prompt)
    assert rc == 2 and err == ["error: --prompt is empty (or only spaces); give the text to sample"], err
    assert "composite" not in out and not (tmp_path / "s.gif").exists()


@pytest.mark.parametrize("prompt, word", [("hello world", "does not read"),
                                          ("a pink square moving up", "unknown colour 'pink'"),
                                          ("a red circle moving left", "unknown shape 'circle'")])
def test_a_prompt_outside_the_toy_grammar_is_refused_before_sampling(tmp_path, capsys, prompt, word):
    rc, out, err = _sample(capsys, tmp_path, prompt)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: --prompt: outside the grammar of reward model 'toy'") and word in err[0], err
    assert "composite" not in out and not (tmp_path / "s.gif").exists()


def test_a_lone_surrogate_from_the_command_line_is_refused(tmp_path, capsys):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates."""
    rc, _, err = _sample(capsys, tmp_path, "a red square moving \udcff")
    assert rc == 2 and len(err) == 1 and "--prompt: prompt holds a lone surrogate ('\\udcff')" in err[0], err


def test_a_prompt_in_the_grammar_is_scored(tmp_path, capsys):
    rc, out, err = _sample(capsys, tmp_path, "  a red square moving left ")
    assert rc == 0 and " nan" not in out and "composite " in out and (tmp_path / "s.gif").is_file(), (out, err)


def test_a_nan_score_is_never_printed_as_a_result(tmp_path, capsys, monkeypatch):
    """A scorer that declares no grammar and scores NaN anyway: one line, exit 2, no `composite nan`."""
    monkeypatch.setitem(scorers.SCORERS, "toy", dataclasses.replace(scorers.SCORERS["toy"], grammar=None))
    rc, out, err = _sample(capsys, tmp_path, "hello world")
    assert rc == 2 and "composite" not in out, out
    assert err == ["error: --prompt 'hello world': the reward models gave no finite score (heads VQ, MQ, TA); "
                   "is the prompt one they can read?"], err

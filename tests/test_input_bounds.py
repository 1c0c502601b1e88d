"""Prompt sets are read within bounds (`data.*`): a prompts file's or manifest's size is checked
before it is read, its lines are read one at a time and split on "\\n" only, a too-long line is
refused as soon as it is met, and the prompt count is bounded. A manifest line that Python's json
cannot read (nested too deeply, a 5000-digit number) or that holds a lone surrogate is one line
naming the file, the line and the field. Each through `vgrpo data check` (and `vgrpo train`'s
preflight): one line, exit 2, no traceback."""

from __future__ import annotations

import os
import time
import tracemalloc

import pytest
from PIL import Image

from cluster.cli import main
from cluster.data.prompts import load_prompts
from common.config import load_config


def _check(capsys, spec, *extra) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main(["data", "check", str(spec), *extra])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, captured.err.strip().splitlines()


def _config(tmp_path, *overrides) -> str:
    f = tmp_path / "bounds.yaml"
    f.write_text("data:\n" + "".join(f"  {o}\n" for o in overrides))
    return str(f)


def test_a_sparse_4_gib_prompts_file_is_refused_without_reading_it(tmp_path, capsys):
    f = tmp_path / "huge.txt"
    with f.open("wb"):
        pass
    os.truncate(f, 4 << 30)                       # sparse: 4 GiB of zeros, none on disk
    tracemalloc.start()
    t0 = time.monotonic()
    rc, err = _check(capsys, f)
    took = time.monotonic() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert rc == 2 and len(err) == 1, err
    assert str(f) in err[0] and "4,294,967,296 bytes" in err[0] and "data.max_file_bytes" in err[0], err
    assert took < 5 and peak < 16 << 20, (took, peak)  # reading it took 4 GiB (a MemoryError)


def test_the_file_size_bound_is_a_setting(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("a red square moving left\n" * 100)   # 2,500 bytes
    rc, err = _check(capsys, f, "-c", _config(tmp_path, "max_file_bytes: 2000"))
    assert rc == 2 and len(err) == 1 and "2,500 bytes" in err[0] and "data.max_file_bytes = 2,000" in err[0], err
    assert _check(capsys, f, "-c", _config(tmp_path, "max_file_bytes: 2500"))[0] == 0


@pytest.mark.parametrize("kind", ["prompts", "manifest"])
def test_a_long_line_is_refused_as_soon_as_it_is_met(tmp_path, capsys, kind):
    """A 4 MiB line under data.max_line_bytes = 64 KiB: refused naming its line, having held
    no more than the bound of it (the whole file read first held it all, twice)."""
    f = tmp_path / ("p.txt" if kind == "prompts" else "m.jsonl")
    good = "a red square moving left" if kind == "prompts" else '{"prompt": "a red square", "image": "x.png"}'
    with f.open("w") as out:
        out.write(f"{good}\n{good}\n")
        out.write("x" * (4 << 20) + "\n")
        out.write(f"{good}\n")
    tracemalloc.start()
    rc, err = _check(capsys, f, "-c", _config(tmp_path, "max_line_bytes: 65536"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {f}:3: line is longer than data.max_line_bytes = 65,536 bytes"), err
    assert peak < 1 << 20, peak


@pytest.mark.parametrize("kind", ["prompts", "manifest", "folder"])
def test_the_prompt_count_is_bounded(tmp_path, capsys, kind):
    if kind == "prompts":
        spec = tmp_path / "p.txt"
        spec.write_text("# five prompts\n" + "".join(f"a red square moving {d}\n\n"
                                                      for d in ("left", "right", "up", "down", "left")))
    else:
        (tmp_path / "images").mkdir()
        for i in range(5):
            Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "images" / f"r{i}.png")
            (tmp_path / "images" / f"r{i}.txt").write_text("a red square moving left")
        spec = tmp_path / "images"
        if kind == "manifest":
            spec = tmp_path / "m.jsonl"
            spec.write_text("".join(f'{{"prompt": "a red square moving left", "image": "images/r{i}.png"}}\n'
                                    for i in range(5)))
    rc, err = _check(capsys, spec, "-c", _config(tmp_path, "max_prompts: 4"))
    assert rc == 2 and len(err) == 1 and "more than data.max_prompts = 4" in err[0], err
    where = {"prompts": f"{spec}:10:", "manifest": f"{spec}:5:", "folder": f"{spec}:"}[kind]
    assert err[0].startswith(f"error: {where}"), err
    assert _check(capsys, spec, "-c", _config(tmp_path, "max_prompts: 5"))[0] == 0


def test_train_refuses_too_many_prompts_before_anything_starts(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("a red square moving left\na blue square moving up\na red square moving up\n")
    args = ["train", "-c", "configs/quickstart.yaml", "--no-eval", f"run.root={tmp_path / 'runs'}",
            f"train.prompts={f}", "data.max_prompts=2"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: train.prompts: {f}:3: more than data.max_prompts = 2 prompts; use fewer or raise "
                   "data.max_prompts"], err
    assert not (tmp_path / "runs").exists()


def test_lines_split_on_newline_only(tmp_path):
    """U+2028 (LINE SEPARATOR) and U+2029 inside a prompt keep it one prompt (str.splitlines split
    it in two, silently); Windows line endings still end lines."""
    f = tmp_path / "p.txt"
    f.write_bytes("a red square\u2028moving left\r\na blue\u2029square\r\nthird".encode())
    prompts = [c.prompt for c in load_prompts(str(f))]
    assert prompts == ["a red square\u2028moving left", "a blue\u2029square", "third"], prompts


def test_a_utf8_bom_is_not_part_of_the_first_prompt(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes("\ufeffa red square moving left\n".encode())
    assert [c.prompt for c in load_prompts(str(f))] == ["a red square moving left"]


def test_not_utf8_names_the_line(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_bytes(b"a red square moving left\nbad \xff byte\n")
    rc, err = _check(capsys, f)
    assert rc == 2 and err == [f"error: {f}:2: not UTF-8 text (byte 29 of the file)"], err


def test_the_defaults_leave_real_sets_alone():
    d = load_config(None).data
    assert d.max_file_bytes >= 64 << 20 and d.max_line_bytes >= 64 << 10 and d.max_prompts >= 100_000
    assert load_config(None, ["data.max_prompts=1000000"]).data.max_prompts == 1_000_000
    assert len(load_prompts("toy-i2v-train")) > 0 and len(load_prompts("toy-world")) == 16


# --- manifest lines Python's json cannot read, and lone surrogates ----------------------------------

def _manifest(tmp_path, line: str):
    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "r.png")
    f = tmp_path / "m.jsonl"
    f.write_text('{"prompt": "a red square moving left", "image": "r.png"}\n' + line + "\n")
    return f


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "a", "image": "r.png", "id": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"prompt": "a", "image": "r.png", "id": ' + "7" * 5000 + "}", "a number longer than 4300 digits"),
    ("[" * 100_000, "nested too deeply"),
    ("-" + "9" * 5000, "a number longer than 4300 digits"),
])
def test_a_manifest_line_json_cannot_read_is_one_line(tmp_path, capsys, line, needle):
    f = _manifest(tmp_path, line)
    rc, err = _check(capsys, f)
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {f}:2: not a JSON object"), err
    assert needle in err[0] and len(err[0]) < 300, err


@pytest.mark.parametrize("field", ["prompt", "negative_prompt", "id", "image"])
@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "\\udc80"])
def test_a_lone_surrogate_in_a_manifest_is_one_line_naming_the_field(tmp_path, capsys, field, escape):
    row = {"prompt": "a red square moving left", "image": "r.png", "negative_prompt": "blurry", "id": "r"}
    row[field] = f"a{escape}b" if field != "image" else f"r{escape}.png"
    line = "{" + ", ".join(f'"{k}": "{v}"' for k, v in row.items()) + "}"
    f = _manifest(tmp_path, line)
    rc, err = _check(capsys, f)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {f}:2: '{field}' holds a lone surrogate"), err


def test_a_paired_surrogate_escape_is_text(tmp_path, capsys):
    f = _manifest(tmp_path, '{"prompt": "a red square \\ud83c\\udf88 moving left", "image": "r.png"}')
    assert _check(capsys, f)[0] == 0
    assert "\U0001f388" in load_prompts(str(f))[1].prompt


def test_train_refuses_a_surrogate_before_anything_starts(tmp_path, capsys):
    f = _manifest(tmp_path, '{"prompt": "a red square moving left", "image": "r.png", "negative_prompt": "\\ud800"}')
    args = ["train", "-c", "configs/toy_i2v.yaml", "--no-eval", f"run.root={tmp_path / 'runs'}", f"train.prompts={f}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: train.prompts: {f}:2: 'negative_prompt' holds a lone"), err
    assert not (tmp_path / "runs").exists()

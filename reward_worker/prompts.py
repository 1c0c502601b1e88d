"""Where each scorer's text comes from.

VideoAlign and HPSv3 were trained on their authors' prompt templates, and score correctly only
with them. Those templates are upstream's sentences, so they are never committed here: they
are read at run time, with `ast` (nothing is imported or executed), from upstream's release:

- HPSv3: the `hpsv3` wheel on PyPI (`pip install --no-deps hpsv3`; its dependencies pin an
  old transformers), file `hpsv3/dataset/data_collator_qwen.py`.
- VideoAlign: a checkout of github.com/KwaiVGI/VideoAlign, file `prompt_template.py`.

`TEST_*` below are this project's own placeholder wording, only for the toy and tiny test
models; a real checkpoint never sees them.

Q-Save's rubric is this project's reconstruction: its weights and prompt are not public.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from common.scorers import SCORERS

SYSTEM = "You are a helpful assistant."
"""The default system turn of the Qwen2-VL chat template (both released scorers used it)."""


class TemplateError(FileNotFoundError):
    """An upstream template could not be found or read; the message says how to get it."""


def read_str_constants(path: Path, names: tuple[str, ...]) -> dict[str, str]:
    """Module-level string constants `names` of a Python file, read with ast (never imported)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise TemplateError(f"{path}: cannot read it as Python ({type(e).__name__})") from None
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in names:
                    found[target.id] = node.value.value
    missing = [n for n in names if n not in found]
    if missing:
        raise TemplateError(f"{path}: no string constant {missing}; is this the upstream release "
                            "the scorer was trained with?")
    return found


# --- VideoAlign ------------------------------------------------------------------------

VIDEOALIGN_FILE = SCORERS["videoalign"].template_file  # declared with the scorer (common/scorers.py)
VIDEOALIGN_CONSTANT = {"detailed_special": "DETAILED_PROMPT_WITH_SPECIAL_TOKEN"}
"""Upstream's template types that carry the three reward tokens (the released model's)."""
VIDEOALIGN_HOW = SCORERS["videoalign"].template_how


def videoalign_template(checkout: str | None, template_type: str = "detailed_special") -> str:
    """Upstream's VideoAlign template (with a `{text_prompt}` field) from a checkout."""
    if checkout is None:
        raise TemplateError(f"VideoAlign needs upstream's prompt template: {VIDEOALIGN_HOW}")
    if template_type not in VIDEOALIGN_CONSTANT:
        raise TemplateError(f"VideoAlign prompt_template_type {template_type!r} has no reward tokens; "
                            f"this scorer reads {sorted(VIDEOALIGN_CONSTANT)}")
    p = Path(checkout).expanduser()
    path = p if p.is_file() else p / VIDEOALIGN_FILE
    if not path.is_file():
        raise TemplateError(f"{path}: not found; {VIDEOALIGN_HOW}")
    name = VIDEOALIGN_CONSTANT[template_type]
    return read_str_constants(path, (name,))[name]


# --- HPSv3 -----------------------------------------------------------------------------

HPSV3_FILE = Path(SCORERS["hpsv3"].template_file)
HPSV3_HOW = SCORERS["hpsv3"].template_how


@dataclass(frozen=True)
class HPSv3Template:
    instruction: str
    """Upstream's instruction, with a `{text_prompt}` field."""
    reward_suffix: str
    """Upstream's closing text that carries the `<|Reward|>` token."""

    def user_text(self, caption: str) -> str:
        return self.instruction.format(text_prompt=caption) + self.reward_suffix


def hpsv3_template(location: str | None = None) -> HPSv3Template:
    """Upstream's HPSv3 text, from the installed wheel or a folder/file given as `location`."""
    if location is None:
        spec = importlib.util.find_spec("hpsv3")               # locates; does not import it
        if spec is None or not spec.submodule_search_locations:
            raise TemplateError(f"HPSv3 needs upstream's instruction text: {HPSV3_HOW}")
        path = Path(next(iter(spec.submodule_search_locations))).parent / HPSV3_FILE
    else:
        p = Path(location).expanduser()
        path = p if p.is_file() else p / HPSV3_FILE
    if not path.is_file():
        raise TemplateError(f"{path}: not found; {HPSV3_HOW}")
    c = read_str_constants(path, ("INSTRUCTION", "prompt_with_special_token"))
    return HPSv3Template(c["INSTRUCTION"], c["prompt_with_special_token"])


# --- the project's own wording: toy and tiny test models only ---------------------------

TEST_VIDEOALIGN_TEMPLATE = (
    "[test wording, not VideoAlign's] Rate the frames. Look: <|VQ_reward|> Motion: <|MQ_reward|> "
    "Caption - {text_prompt} Match: <|TA_reward|>")
"""For tiny random models only. Token order as upstream: VQ and MQ before the caption, TA after."""

TEST_HPSV3_TEMPLATE = HPSv3Template(
    instruction="[test wording, not HPSv3's] Rate this image for: {text_prompt}",
    reward_suffix="\nScore: <|Reward|>\n")
"""For tiny random models only; the reward token sits inside the user turn, as upstream."""


# --- Q-Save: this project's reconstruction ---------------------------------------------

QSAVE_NOTE = SCORERS["qsave"].caveat  # declared with the scorer (common/scorers.py)
QSAVE_SCALE = (1.0, 5.0)
"""Q-Save's answers are read on this scale; a value outside it is an unparsable answer."""


def qsave(prompt: str) -> str:
    """User text after the video: the rubric and the exact answer format (our reconstruction)."""
    lo, hi = (int(v) for v in QSAVE_SCALE)
    return (
        f"Score this generated video on three criteria, each from {lo} (very poor) to {hi} "
        "(excellent); decimals are allowed.\n"
        "- visual quality: sharpness, detail, colour, no artefacts or distortions in any frame;\n"
        "- dynamic quality: natural, smooth, physically plausible motion of subjects and "
        "camera, with enough movement for the scene;\n"
        "- alignment: how faithfully the video shows the caption's subjects, attributes, "
        "actions and setting.\n"
        f"Caption: {prompt.strip()}\n"
        "Answer with exactly three lines and nothing else:\n"
        "visual quality: <score>\n"
        "dynamic quality: <score>\n"
        "alignment: <score>"
    )

"""Rubric texts for the VLM scorers (our own wording).

VideoAlign and HPSv3 read a hidden state at their reward tokens, so the text only frames
the question; Q-Save writes its answer, so its rubric fixes an answer format that
`reward_worker.models.qsave.parse_scores` reads.
"""

from __future__ import annotations

SYSTEM = "You are a helpful assistant."


def videoalign(prompt: str, tokens: tuple[str, str, str]) -> str:
    """User text after the video; `tokens` are the VQ, MQ and TA reward tokens, in that order."""
    vq, mq, ta = tokens
    return (
        "You are judging a generated video against the caption it was made from.\n"
        f"Caption: {prompt.strip()}\n"
        "Judge three things separately.\n"
        "Visual quality: are the frames sharp, clean and free of artefacts, with a pleasing look? "
        f"Visual quality score: {vq}\n"
        "Motion quality: do objects and camera move smoothly and plausibly, without jitter, "
        f"flicker or deformation? Motion quality score: {mq}\n"
        "Text alignment: does the video show what the caption asks for, its subjects, "
        f"attributes, actions and scene? Text alignment score: {ta}"
    )


def hpsv3(prompt: str) -> str:
    """User text after the image; the reward token follows the assistant turn's start."""
    return (
        "Rate how much people would prefer this generated image for its caption, taking "
        "into account how well it follows the caption and how good it looks.\n"
        f"Caption: {prompt.strip()}"
    )


QSAVE_SCALE = (1.0, 5.0)
"""Q-Save's answers are read on this scale; a value outside it is an unparsable answer."""


def qsave(prompt: str) -> str:
    """User text after the video: the rubric and the exact answer format."""
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

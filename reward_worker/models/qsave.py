"""Q-Save: a Qwen3-VL evaluator that writes its visual-quality, dynamic-quality and alignment
scores as text. Prompt → generate → parse.

Q-Save's weights and prompt are not public. Its rubric and answer format here
(`prompts.qsave`, `parse_scores`) are this project's reconstruction, for a Qwen3-VL checkpoint
the user supplies; scores from it are not the paper's Q-Save scores.

An answer that does not parse is an invalid reward, not a crash: that video's row is NaN (the
reward actor counts it as an invalid member), `parse_failures` goes up and the running total
is logged.
"""

from __future__ import annotations

import logging
import math
import re

import torch
from torch import Tensor

from common.config import RewardModelConfig
from reward_worker import prompts
from reward_worker.base import RewardModel
from reward_worker.models import qwen_inputs as qi
from reward_worker.vision import QWEN3_VL, video_patches

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
MIN_PIXELS, MAX_PIXELS = 64 * 32 * 32, 192 * 32 * 32
"""Per-frame pixel budget (multiples of Qwen3-VL's 32-pixel token side)."""

_LABELS = {
    "visual_quality": r"visual[\s_-]*quality",
    "dynamic_quality": r"(?:dynamic|motion)[\s_-]*quality",
    "alignment": r"(?:text[\s_-]*)?alignment",
}
# label, then on the same line a few non-digit characters (": ", " score = ", '": '), the
# number (a sign in front makes it unreadable), and an optional "/ N" or "out of N".
_VALUE = r"[^\d\n]{0,16}?(?<![-\d.])(\d+(?:\.\d+)?)(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?"
_PATTERNS = {k: re.compile(r"\b" + v + r"\b" + _VALUE, re.IGNORECASE) for k, v in _LABELS.items()}


def parse_scores(text: str, scale: tuple[float, float] = prompts.QSAVE_SCALE) -> tuple[float, float, float] | None:
    """(visual quality, dynamic quality, alignment) from an answer, or None when it does not parse.

    Each label must carry a number on its own line, inside `scale`; a stated denominator must
    be the scale's top ("4/5"); a label given twice with different values is ambiguous.
    """
    lo, hi = scale
    out = []
    for pattern in _PATTERNS.values():
        values = set()
        for m in pattern.finditer(text):
            v = float(m.group(1))
            if m.group(2) is not None and float(m.group(2)) != hi:
                return None
            values.add(v)
        if len(values) != 1:
            return None
        (v,) = values
        if not (lo <= v <= hi) or not math.isfinite(v):
            return None
        out.append(v)
    return out[0], out[1], out[2]


class QSave(RewardModel):
    name = "qsave"
    heads = ("visual_quality", "dynamic_quality", "alignment")

    def __init__(self, vlm, tokenizer, *, video_fps: float = 16.0, sample_fps: float | None = None,
                 max_new_tokens: int = 64, device: torch.device | str = "cpu"):
        self.vlm, self.tokenizer = vlm, tokenizer
        self.video_fps, self.sample_fps, self.max_new_tokens = video_fps, sample_fps or 2.0, max_new_tokens
        self.device = torch.device(device)
        self.parse_failures = 0
        self.last_answers: list[str] = []

    @classmethod
    def from_pretrained(cls, cfg: RewardModelConfig) -> QSave:
        # heavy: transformers
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        if cfg.path is None:
            raise qi.RewardLoadError("rewards.models[].path is not set; point it at the Q-Save model folder")
        root = qi.local_dir(cfg.path, "rewards.models[].path")
        # The tokenizer comes from base_path when given (a fine-tune saved without one), else path.
        tok_dir = qi.local_dir(cfg.base_path, "rewards.models[].base_path") if cfg.base_path else root
        if not any((tok_dir / f).is_file() for f in TOKENIZER_FILES):
            raise qi.RewardLoadError(f"{tok_dir}: no tokenizer files; set rewards.models[].base_path to the "
                                     "Qwen3-VL base it was fine-tuned from")
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        device = qi.resolve_device(cfg.device)
        vlm = Qwen3VLForConditionalGeneration.from_pretrained(root, dtype=qi.torch_dtype(cfg.dtype))
        vlm.to(device).eval()
        log.info("Q-Save loaded from %s (tokenizer %s) on %s; %s", root, tok_dir, device, prompts.QSAVE_NOTE)
        return cls(vlm, tokenizer, video_fps=cfg.video_fps, sample_fps=cfg.sample_fps,
                   max_new_tokens=cfg.max_new_tokens, device=device)

    @torch.no_grad()
    def generate(self, frames: Tensor, prompts_: list[str]) -> list[str]:
        """The evaluator's answers, greedy. frames uint8 [B, F, H, W, 3]."""
        # 1. Vision input per video; each temporal patch is introduced by its time in seconds.
        pix, grids, texts = [], [], []
        tp = QWEN3_VL.temporal_patch_size
        for video, prompt in zip(frames, prompts_, strict=True):
            p, g, idx = video_patches(video, QWEN3_VL, self.video_fps, self.sample_fps, MIN_PIXELS, MAX_PIXELS)
            secs = idx.float() / self.video_fps                                 # [n]
            stamps = [float(secs[i:i + tp].mean()) for i in range(0, len(secs), tp)]
            per_step = int(g[1] * g[2]) // QWEN3_VL.merge_size**2
            pix.append(p)
            grids.append(g)
            texts.append(qi.chat(qi.placeholder_timed(per_step, stamps) + prompts.qsave(prompt), system=None))
        # 2. Generate (left-padded so every row continues from its last token).
        ids, mask = qi.tokenize(self.tokenizer, texts, side="left")
        video_id = self.vlm.config.video_token_id
        out = self.vlm.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            pixel_values_videos=torch.cat(pix).to(self.device, self.vlm.dtype),
            video_grid_thw=torch.stack(grids).to(self.device),
            mm_token_type_ids=((ids == video_id).int() * 2).to(self.device),   # 0 text, 2 video
            max_new_tokens=self.max_new_tokens, do_sample=False)
        return self.tokenizer.batch_decode(out[:, ids.shape[1]:].cpu(), skip_special_tokens=True)

    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Tensor:
        """Parsed scores [B, 3]; a row whose answer does not parse is NaN."""
        self.last_answers = self.generate(frames, prompts)
        rows = []
        for answer in self.last_answers:
            parsed = parse_scores(answer)
            if parsed is None:
                self.parse_failures += 1
                log.warning("Q-Save answer did not parse (invalid reward; %d so far): %r",
                            self.parse_failures, answer[:200])
                parsed = (math.nan,) * len(self.heads)
            rows.append(parsed)
        return torch.tensor(rows, dtype=torch.float32).view(len(rows), len(self.heads))

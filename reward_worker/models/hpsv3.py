"""HPSv3: Qwen2-VL-7B + an MLP head (hidden → 1024 → 16 → 2) read at a `<|Reward|>` token.

The head predicts (μ, σ) of a preference score; μ is the score. Inputs follow the released
recipe (MizzenAI/HPSv3 `inference.py`, read, not copied): one user turn holding the image and
then upstream's instruction with the caption and its closing text, which carries
`<|Reward|>`, so the token sits inside the user turn; each image keeps its aspect ratio and is
resized to about 256·28² pixels (smart_resize with min = max = 256·28²). The instruction is
read at run time from the `hpsv3` wheel (`reward_worker.prompts`), never imported.

A video scores the mean μ over its frames sampled at 2 fps. The released `HPSv3.safetensors`
is a full state dict with transformers 4.4x names, remapped and loaded strictly.
"""

from __future__ import annotations

import logging

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from common.config import RewardModelConfig
from reward_worker import prompts
from reward_worker.base import RewardModel
from reward_worker.models import qwen_inputs as qi
from reward_worker.vision import QWEN2_VL, frame_patches, stride_indices

log = logging.getLogger(__name__)

BASE_MODEL = "Qwen/Qwen2-VL-7B-Instruct"
REWARD_TOKEN = "<|Reward|>"
CHECKPOINT_FILE = "HPSv3.safetensors"
PIXELS = 256 * 28 * 28
"""Upstream's min = max pixel budget per image."""
EMBED_KEY = "model.embed_tokens.weight"                    # released (legacy) name


def reward_head(hidden: int) -> nn.Sequential:
    """hidden → 1024 → 16 → 2 (μ, σ); the indices 0, 3, 5 match the released keys."""
    return nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05),
                         nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2))


def build_network(config, vocab_size: int | None = None):
    """Qwen2-VL with the reward head as `rm_head`. Random weights; load a checkpoint next."""
    from transformers import Qwen2VLForConditionalGeneration  # heavy: transformers

    vlm = Qwen2VLForConditionalGeneration(config)
    if vocab_size is not None and vocab_size != vlm.get_input_embeddings().num_embeddings:
        vlm.resize_token_embeddings(vocab_size)          # the released model added <|Reward|>
    vlm.rm_head = reward_head(config.text_config.hidden_size)
    return vlm


def load_released(vlm, state: dict[str, Tensor], source: str) -> None:
    missing, unexpected = vlm.load_state_dict(qi.remap(state, qi.legacy_to_current), strict=False)
    if missing or unexpected:
        raise qi.RewardLoadError(
            f"{source}: not an HPSv3 checkpoint for this base model: {len(missing)} missing keys "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")


class HPSv3(RewardModel):
    name = "hpsv3"
    heads = ("HPS",)

    def __init__(self, vlm, tokenizer, template: prompts.HPSv3Template, *, video_fps: float = 16.0,
                 sample_fps: float | None = None, norm: dict[str, tuple[float, float]] | None = None,
                 device: torch.device | str = "cpu", pixels: int = PIXELS):
        """`template`: upstream's text (tests pass their own)."""
        self.vlm = vlm.eval()
        self.tokenizer = tokenizer
        self.template = template
        (self.token_id,) = qi.add_special_tokens(tokenizer, (REWARD_TOKEN,))
        if template.user_text("x").count(REWARD_TOKEN) != 1:
            raise prompts.TemplateError(f"the HPSv3 template must hold one {REWARD_TOKEN}")
        self.video_fps, self.sample_fps, self.pixels = video_fps, sample_fps or 2.0, pixels
        mean, std = (norm or {}).get("HPS", (0.0, 1.0))
        self.mean, self.std = float(mean), float(std)
        self.device = torch.device(device)

    @classmethod
    def from_pretrained(cls, cfg: RewardModelConfig) -> HPSv3:
        from transformers import AutoConfig, AutoTokenizer  # heavy: transformers

        # 1. Locate the safetensors file (a folder holding it, or the file), and upstream's text.
        if cfg.path is None:
            raise qi.RewardLoadError(f"rewards.models[].path is not set; point it at {CHECKPOINT_FILE}")
        root = qi.local_dir(cfg.path, "rewards.models[].path")
        ckpt = root / CHECKPOINT_FILE if root.is_dir() else root
        if not ckpt.is_file():
            raise qi.RewardLoadError(f"{ckpt}: not found; download MizzenAI/HPSv3 ({CHECKPOINT_FILE}) there")
        template = prompts.hpsv3_template(cfg.template_path)
        # 2. Base tokenizer and config; then build, load strictly, move.
        base = qi.local_dir(cfg.base_path or BASE_MODEL, "rewards.models[].base_path")
        tokenizer = AutoTokenizer.from_pretrained(base)
        state = load_file(str(ckpt))
        if EMBED_KEY not in state:
            raise qi.RewardLoadError(f"{ckpt}: has no {EMBED_KEY}; not a released HPSv3 state dict")
        vlm = build_network(AutoConfig.from_pretrained(base), state[EMBED_KEY].shape[0])
        load_released(vlm, state, str(ckpt))
        device = qi.resolve_device(cfg.device)
        vlm.to(device=device, dtype=qi.torch_dtype(cfg.dtype))
        vlm.rm_head.float()                              # trained in fp32 on a bf16 backbone
        log.info("HPSv3 loaded from %s on %s", ckpt, device)
        return cls(vlm, tokenizer, template, video_fps=cfg.video_fps, sample_fps=cfg.sample_fps,
                   norm=cfg.head_norm, device=device)

    def inputs(self, images: Tensor, prompts_: list[str]) -> qi.QwenInputs:
        """What the released processor would hand the model. images uint8 [N, H, W, 3], all one size."""
        pix, grids = frame_patches(images, QWEN2_VL, self.pixels, self.pixels)  # [N·n, D], [N, 3]
        n = pix.shape[0] // images.shape[0]
        texts = [qi.chat(qi.placeholder("image", QWEN2_VL.tokens(g)) + self.template.user_text(p))
                 for g, p in zip(grids, prompts_, strict=True)]
        return qi.build_inputs(self.tokenizer, texts, list(pix.split(n)), list(grids), "image")

    @torch.no_grad()
    def score_images(self, images: Tensor, prompts_: list[str]) -> Tensor:
        """uint8 [N, H, W, 3] with a prompt each → μ fp32 [N]."""
        inputs = self.inputs(images, prompts_)
        hidden = qi.last_hidden(self.vlm, inputs, self.device)
        at = qi.read_at(hidden, inputs.input_ids.to(self.device), [self.token_id])[:, 0]   # [N, D]
        return self.vlm.rm_head(at.float())[:, 0].cpu()                                   # [N] μ

    def frame_indices(self, num_frames: int) -> Tensor:
        """The frames scored: one every 1/sample_fps seconds from the first. [n]"""
        return stride_indices(num_frames, self.video_fps, self.sample_fps)

    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Tensor:
        """Mean μ over frames sampled at `sample_fps`. frames uint8 [B, F, H, W, 3] → [B, 1]"""
        B, F = frames.shape[:2]
        idx = self.frame_indices(F)                                             # [n]
        flat = frames[:, idx].flatten(0, 1)                                    # [B·n, H, W, 3]
        mu = self.score_images(flat, [p for p in prompts for _ in idx]).view(B, len(idx))
        return ((mu.mean(dim=1, keepdim=True) - self.mean) / self.std).float()

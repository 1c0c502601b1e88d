"""VideoAlign (VideoReward): Qwen2-VL-2B + LoRA + a linear head read at three reward tokens.

The released checkpoint (`checkpoint-*/model.pth`) is the full state dict of the PEFT-wrapped
model, saved with transformers 4.4x key names; it is remapped to transformers 5 names and
loaded strictly. Scores are normalised per head with the published mean and std.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from common.config import RewardModelConfig
from reward_worker import prompts
from reward_worker.base import RewardModel
from reward_worker.models import qwen_inputs as qi
from reward_worker.vision import QWEN2_VL, video_patches

log = logging.getLogger(__name__)

BASE_MODEL = "Qwen/Qwen2-VL-2B-Instruct"
REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
PUBLISHED_NORM: dict[str, tuple[float, float]] = {
    "VQ": (3.6757, 2.2476), "MQ": (1.1646, 1.3811), "TA": (2.8105, 2.5121)}
"""Per-head (mean, std) published with the VideoReward checkpoint."""
LORA_R, LORA_ALPHA = 64, 128
LM_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
"""Every linear layer of the language model (none in the vision tower, lm_head or head)."""
PEFT_PREFIX = "base_model.model."
EMBED_KEY = PEFT_PREFIX + "model.embed_tokens.weight"          # released (legacy) name
MIN_PIXELS, MAX_PIXELS = 128 * 28 * 28, 200_704


def build_network(config, vocab_size: int | None = None, r: int = LORA_R, alpha: float = LORA_ALPHA):
    """Qwen2-VL + reward head, LoRA-wrapped as in training. Random weights; load a checkpoint next."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2VLForConditionalGeneration

    vlm = Qwen2VLForConditionalGeneration(config)
    if vocab_size is not None and vocab_size != vlm.get_input_embeddings().num_embeddings:
        vlm.resize_token_embeddings(vocab_size)          # the released model added its reward tokens
    vlm.rm_head = nn.Linear(config.text_config.hidden_size, 1, bias=False)
    lora = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=LM_TARGETS)
    return get_peft_model(vlm, lora)


def released_state_dict(net) -> dict[str, Tensor]:
    """The network's state dict in the released layout (PEFT prefix, transformers 4.4x names)."""
    return qi.remap(net.state_dict(), qi.current_to_legacy, PEFT_PREFIX)


def load_released(net, state: dict[str, Tensor], source: str) -> None:
    """Load a released-layout state dict strictly; a mismatch names the keys and the file."""
    current = qi.remap(state, qi.legacy_to_current, PEFT_PREFIX)
    missing, unexpected = net.load_state_dict(current, strict=False)
    if missing or unexpected:
        raise qi.RewardLoadError(
            f"{source}: not a VideoReward checkpoint for this base model: {len(missing)} missing keys "
            f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")


def find_checkpoint(root: Path) -> Path:
    """`root` itself, root/model.pth, or the newest root/checkpoint-*/model.pth."""
    if root.is_file():
        return root
    if (root / "model.pth").is_file():
        return root / "model.pth"
    steps = sorted(root.glob("checkpoint-*/model.pth"), key=lambda p: int(p.parent.name.split("-")[-1]))
    if not steps:
        raise qi.RewardLoadError(f"{root}: no model.pth nor checkpoint-*/model.pth; download "
                                 "KwaiVGI/VideoReward there")
    return steps[-1]


class VideoAlign(RewardModel):
    name = "videoalign"
    heads = ("VQ", "MQ", "TA")

    def __init__(self, net, tokenizer, *, video_fps: float = 16.0, sample_fps: float = 2.0,
                 norm: dict[str, tuple[float, float]] | None = None, device: torch.device | str = "cpu"):
        self.net = net.eval()
        self.tokenizer = tokenizer
        self.token_ids = qi.add_special_tokens(tokenizer, REWARD_TOKENS)
        rows = net.get_input_embeddings().num_embeddings
        if max(self.token_ids) >= rows:
            raise ValueError(f"reward token ids {self.token_ids} exceed the model's {rows} embeddings")
        self.video_fps, self.sample_fps = video_fps, sample_fps
        norm = PUBLISHED_NORM if norm is None else norm
        self.mean = torch.tensor([norm.get(h, (0.0, 1.0))[0] for h in self.heads])  # [3]
        self.std = torch.tensor([norm.get(h, (0.0, 1.0))[1] for h in self.heads])   # [3]
        self.device = torch.device(device)

    @classmethod
    def from_pretrained(cls, cfg: RewardModelConfig) -> VideoAlign:
        from transformers import AutoConfig, AutoTokenizer

        # 1. Locate the checkpoint and its training config.
        if cfg.path is None:
            raise qi.RewardLoadError("rewards.models[].path is not set; point it at the VideoReward folder")
        root = qi.local_dir(cfg.path, "rewards.models[].path")
        ckpt = find_checkpoint(root)
        meta_file = root / "model_config.json" if root.is_dir() else root.parent.parent / "model_config.json"
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        lora = meta.get("peft_lora_config", {})
        base = cfg.base_path or meta.get("model_config", {}).get("model_name_or_path") or BASE_MODEL
        # 2. Base tokenizer and config (the base weights are all in the checkpoint).
        tokenizer = AutoTokenizer.from_pretrained(qi.local_dir(base, "rewards.models[].base_path"))
        config = AutoConfig.from_pretrained(qi.local_dir(base, "rewards.models[].base_path"))
        # 3. Build, load strictly, move.
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        if EMBED_KEY not in state:
            raise qi.RewardLoadError(f"{ckpt}: has no {EMBED_KEY}; not a released VideoReward state dict")
        net = build_network(config, state[EMBED_KEY].shape[0], lora.get("lora_r", LORA_R),
                            lora.get("lora_alpha", LORA_ALPHA))
        load_released(net, state, str(ckpt))
        device = qi.resolve_device(cfg.device)
        net.to(device=device, dtype=qi.torch_dtype(cfg.dtype))
        log.info("VideoAlign loaded from %s (base %s) on %s", ckpt, base, device)
        return cls(net, tokenizer, video_fps=cfg.video_fps, sample_fps=cfg.sample_fps,
                   norm=cfg.head_norm, device=device)

    @torch.no_grad()
    def raw_scores(self, frames: Tensor, prompts_: list[str]) -> Tensor:
        """Unnormalised head outputs. frames uint8 [B, F, H, W, 3] → fp32 [B, 3]"""
        # 1. Vision input per video, and the chat text with one pad token per merged patch.
        pix, grids, texts = [], [], []
        for video, prompt in zip(frames, prompts_, strict=True):
            p, g, _ = video_patches(video, QWEN2_VL, self.video_fps, self.sample_fps, MIN_PIXELS, MAX_PIXELS)
            pix.append(p)
            grids.append(g)
            vision = qi.placeholder("video", QWEN2_VL.tokens(g))
            texts.append(qi.chat(vision + prompts.videoalign(prompt, REWARD_TOKENS)))
        ids, mask = qi.tokenize(self.tokenizer, texts, side="right")
        # 2. Forward and read the head at the three reward tokens.
        vlm = self.net.get_base_model()
        hidden = qi.last_hidden(vlm, ids.to(self.device), mask.to(self.device),
                                torch.cat(pix).to(self.device), torch.stack(grids).to(self.device), "video")
        at = qi.read_at(hidden, ids.to(self.device), self.token_ids)          # [B, 3, D]
        return vlm.rm_head(at).squeeze(-1).float().cpu()                       # [B, 3]

    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Tensor:
        return (self.raw_scores(frames, prompts) - self.mean) / self.std

"""VideoAlign (VideoReward): Qwen2-VL-2B + LoRA + a linear head read at three reward tokens.

Inputs follow the released recipe (KwaiVGI/VideoAlign `inference.py`, read, not copied):
- the chat has one user turn: the video, then upstream's template with the caption, whose
  VQ and MQ reward tokens come before the caption and the TA token after it (the template is
  read from the user's checkout at run time, see `reward_worker.prompts`);
- frames are sampled at the checkpoint's `data_config.fps` by the Qwen-VL video recipe and
  resized within [128·28², data_config.max_frame_pixels];
- the head's outputs at the reward tokens are normalised with the checkpoint's
  `inference_config` (VQ_mean, VQ_std, …), when it has one, as upstream does.

The released checkpoint (`checkpoint-*/model.pth`) is the full state dict of the PEFT-wrapped
model, saved with transformers 4.4x key names; it is remapped to transformers 5 names and
loaded strictly.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
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
HEADS = ("VQ", "MQ", "TA")
REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
LM_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
"""Upstream puts LoRA on every Linear outside `visual`, `lm_head`, `rm_head`, `embed_tokens`:
the language model's projections."""
PEFT_PREFIX = "base_model.model."
EMBED_KEY = PEFT_PREFIX + "model.embed_tokens.weight"          # released (legacy) name
VIDEO_MIN_PIXELS = 128 * 28 * 28
"""The Qwen-VL video reader's lower pixel bound; upstream sets only the upper one."""


@dataclass(frozen=True)
class Recipe:
    """What the checkpoint's model_config.json fixes about its inputs and outputs."""

    fps: float = 2.0
    max_pixels: int = 200_704
    template_type: str = "detailed_special"
    output_dim: int = 1
    lora_r: int = 64
    lora_alpha: float = 128
    base: str = BASE_MODEL
    norm: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def from_model_config(cls, meta: dict, source: str) -> Recipe:
        data, model = meta.get("data_config", {}), meta.get("model_config", {})
        lora, inf = meta.get("peft_lora_config", {}), meta.get("inference_config") or {}
        if data.get("num_frames") is not None:
            raise qi.RewardLoadError(f"{source}: data_config.num_frames is set; this scorer samples by fps only")
        if data.get("sample_type", "uniform") != "uniform":
            raise qi.RewardLoadError(f"{source}: data_config.sample_type {data['sample_type']!r} is not "
                                     "supported; only uniform")
        if model.get("reward_token", "special") != "special" or model.get("use_special_tokens") is False:
            raise qi.RewardLoadError(f"{source}: model_config does not read special reward tokens")
        norm = {h: (float(inf[f"{h}_mean"]), float(inf[f"{h}_std"])) for h in HEADS if f"{h}_mean" in inf}
        return cls(fps=float(data.get("fps", 2.0)), max_pixels=int(data.get("max_frame_pixels", 200_704)),
                   template_type=data.get("prompt_template_type", "detailed_special"),
                   output_dim=int(model.get("output_dim", 1)), lora_r=int(lora.get("lora_r", 64)),
                   lora_alpha=float(lora.get("lora_alpha", 128)),
                   base=model.get("model_name_or_path") or BASE_MODEL, norm=norm)


def reward_head(hidden: int, output_dim: int) -> nn.Linear:
    """Upstream's head: hidden → output_dim, no bias (1 = one score per reward token; 3 = the
    diagonal of a 3×3 read)."""
    if output_dim not in (1, 3):
        raise qi.RewardLoadError(f"VideoAlign output_dim {output_dim}: expected 1 or 3")
    return nn.Linear(hidden, output_dim, bias=False)


def build_network(config, vocab_size: int | None = None, recipe: Recipe | None = None):
    """Qwen2-VL + reward head, LoRA-wrapped as in training. Random weights; load a checkpoint next."""
    # heavy: transformers, peft
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2VLForConditionalGeneration

    recipe = recipe or Recipe()
    vlm = Qwen2VLForConditionalGeneration(config)
    if vocab_size is not None and vocab_size != vlm.get_input_embeddings().num_embeddings:
        vlm.resize_token_embeddings(vocab_size)          # the released model added its reward tokens
    vlm.rm_head = reward_head(config.text_config.hidden_size, recipe.output_dim)
    lora = LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=LM_TARGETS)
    return get_peft_model(vlm, lora)


def load_released(net, state: dict[str, Tensor], source: str) -> None:
    """Load a released-layout state dict strictly; a mismatch names the keys and the file."""
    current = qi.remap(state, qi.legacy_to_current, PEFT_PREFIX)
    try:
        missing, unexpected = net.load_state_dict(current, strict=False)
    except RuntimeError as e:                            # shape mismatches
        raise qi.RewardLoadError(f"{source}: does not fit this base model: {str(e).splitlines()[1:2]}") from None
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


def read_model_config(root: Path) -> tuple[Recipe, Path]:
    """The checkpoint folder's model_config.json as a Recipe (it must be there: it fixes the inputs)."""
    meta_file = root / "model_config.json" if root.is_dir() else root.parent.parent / "model_config.json"
    if not meta_file.is_file():
        raise qi.RewardLoadError(f"{meta_file}: not found; it ships with KwaiVGI/VideoReward and fixes "
                                 "the frame rate, pixel budget and score normalisation")
    return Recipe.from_model_config(json.loads(meta_file.read_text()), str(meta_file)), meta_file


class VideoAlign(RewardModel):
    name = "videoalign"
    heads = HEADS

    def __init__(self, net, tokenizer, template: str, *, video_fps: float = 16.0, recipe: Recipe | None = None,
                 sample_fps: float | None = None, norm: dict[str, tuple[float, float]] | None = None,
                 device: torch.device | str = "cpu"):
        """`template`: upstream's text with a `{text_prompt}` field (tests pass their own)."""
        self.net = net.eval()
        self.tokenizer = tokenizer
        self.template = template
        self.token_ids = qi.add_special_tokens(tokenizer, REWARD_TOKENS)
        rows = net.get_input_embeddings().num_embeddings
        if max(self.token_ids) >= rows:
            raise ValueError(f"reward token ids {self.token_ids} exceed the model's {rows} embeddings")
        for tok in REWARD_TOKENS:
            if template.count(tok) != 1:
                raise prompts.TemplateError(f"the VideoAlign template has {template.count(tok)} {tok}; "
                                            "expected one")
        self.recipe = recipe or Recipe()
        self.video_fps = video_fps
        self.sample_fps = sample_fps or self.recipe.fps
        norm = self.recipe.norm if norm is None else norm
        self.mean = torch.tensor([norm.get(h, (0.0, 1.0))[0] for h in self.heads])  # [3]
        self.std = torch.tensor([norm.get(h, (0.0, 1.0))[1] for h in self.heads])   # [3]
        self.device = torch.device(device)

    @classmethod
    def from_pretrained(cls, cfg: RewardModelConfig) -> VideoAlign:
        from transformers import AutoConfig, AutoTokenizer  # heavy: transformers

        # 1. Locate the checkpoint, its model_config.json and upstream's template.
        if cfg.path is None:
            raise qi.RewardLoadError("rewards.models[].path is not set; point it at the VideoReward folder")
        root = qi.local_dir(cfg.path, "rewards.models[].path")
        ckpt = find_checkpoint(root)
        recipe, _ = read_model_config(root)
        template = prompts.videoalign_template(cfg.template_path, recipe.template_type)
        # 2. Base tokenizer and config (the base weights are all in the checkpoint).
        base = qi.local_dir(cfg.base_path or recipe.base, "rewards.models[].base_path")
        tokenizer = AutoTokenizer.from_pretrained(base)
        config = AutoConfig.from_pretrained(base)
        # 3. Build, load strictly, move.
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        if EMBED_KEY not in state:
            raise qi.RewardLoadError(f"{ckpt}: has no {EMBED_KEY}; not a released VideoReward state dict")
        net = build_network(config, state[EMBED_KEY].shape[0], recipe)
        load_released(net, state, str(ckpt))
        device = qi.resolve_device(cfg.device)
        net.to(device=device, dtype=qi.torch_dtype(cfg.dtype))
        log.info("VideoAlign loaded from %s (base %s) on %s", ckpt, base, device)
        return cls(net, tokenizer, template, video_fps=cfg.video_fps, recipe=recipe, sample_fps=cfg.sample_fps,
                   norm=cfg.head_norm, device=device)

    def user_text(self, caption: str) -> str:
        return self.template.format(text_prompt=caption)

    def inputs(self, frames: Tensor, prompts_: list[str]) -> qi.QwenInputs:
        """What the released processor would hand the model. frames uint8 [B, F, H, W, 3]"""
        pix, grids, texts = [], [], []
        for video, prompt in zip(frames, prompts_, strict=True):
            p, g, _ = video_patches(video, QWEN2_VL, self.video_fps, self.sample_fps, VIDEO_MIN_PIXELS,
                                    self.recipe.max_pixels)
            pix.append(p)
            grids.append(g)
            texts.append(qi.chat(qi.placeholder("video", QWEN2_VL.tokens(g)) + self.user_text(prompt)))
        return qi.build_inputs(self.tokenizer, texts, pix, grids, "video")

    @torch.no_grad()
    def raw_scores(self, frames: Tensor, prompts_: list[str]) -> Tensor:
        """Unnormalised head outputs. frames uint8 [B, F, H, W, 3] → fp32 [B, 3]"""
        inputs = self.inputs(frames, prompts_)
        vlm = self.net.get_base_model()
        hidden = qi.last_hidden(vlm, inputs, self.device)
        at = qi.read_at(hidden, inputs.input_ids.to(self.device), self.token_ids)  # [B, 3, D]
        out = vlm.rm_head(at)                                                    # [B, 3, output_dim]
        out = out[..., 0] if out.shape[-1] == 1 else out.diagonal(dim1=1, dim2=2)
        return out.float().cpu()                                                 # [B, 3]

    def score(self, frames: Tensor, prompts: list[str], images: Tensor | None = None) -> Tensor:
        return (self.raw_scores(frames, prompts) - self.mean) / self.std

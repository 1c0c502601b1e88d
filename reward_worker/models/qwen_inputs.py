"""Shared plumbing of the Qwen-VL scorers: chat text, tokens, vision embeddings, key layouts.

The processor's job is done here by hand (vision.py cuts the patches), so a scorer needs
only a tokenizer and the model, and tiny test models need no files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from common.errors import UserError
from reward_worker.prompts import SYSTEM

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
PAD_TOKEN = {"image": "<|image_pad|>", "video": "<|video_pad|>"}


def chat(user: str, system: str | None = SYSTEM, assistant: str = "") -> str:
    """One user turn in the Qwen chat format, ending where the assistant's answer starts."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}"


def placeholder(kind: Literal["image", "video"], n_tokens: int) -> str:
    """Qwen2-VL: one visual input as vision-start, n pad tokens, vision-end."""
    return VISION_START + PAD_TOKEN[kind] * n_tokens + VISION_END


def placeholder_timed(tokens_per_step: int, timestamps: list[float]) -> str:
    """Qwen3-VL video: each temporal patch gets its own block, preceded by its time."""
    return "".join(f"<{t:.1f} seconds>" + placeholder("video", tokens_per_step) for t in timestamps)


def token_id(tokenizer, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer has no token {token!r}; is this the model's own tokenizer?")
    return int(tid)


def add_special_tokens(tokenizer, tokens: tuple[str, ...]) -> list[int]:
    """Add the reward tokens (as the released models did at training time) and return their ids."""
    missing = [t for t in tokens if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    return [token_id(tokenizer, t) for t in tokens]


def tokenize(tokenizer, texts: list[str], side: Literal["left", "right"]) -> tuple[Tensor, Tensor]:
    """Texts → (input_ids [B, L], attention_mask [B, L]) padded on `side` with the pad token."""
    pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token")
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(L - len(r), L)
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


@dataclass
class QwenInputs:
    """Everything one forward of a Qwen-VL reward model reads, as the released processor made it."""

    input_ids: Tensor            # [B, L] int64, right-padded
    attention_mask: Tensor       # [B, L] int64
    pixel_values: Tensor         # [N, C·tp·p·p] fp32 patches of every visual input in order
    grid_thw: Tensor             # [V, 3] int64, one row per visual input
    kind: Literal["image", "video"]

    @property
    def position_ids(self) -> Tensor:
        """[3, B, L]: 0…L-1 on all three rope axes. The released reward models called the text
        model directly with embeddings and no positions, which is what that model then uses."""
        B, L = self.input_ids.shape
        return torch.arange(L).view(1, 1, L).expand(3, B, L)


def build_inputs(tokenizer, texts: list[str], pixels: list[Tensor], grids: list[Tensor],
                 kind: Literal["image", "video"]) -> QwenInputs:
    ids, mask = tokenize(tokenizer, texts, side="right")
    return QwenInputs(ids, mask, torch.cat(pixels), torch.stack(grids), kind)


def vision_embeds(vlm, input_ids: Tensor, pixels: Tensor, grid_thw: Tensor,
                  kind: Literal["image", "video"]) -> Tensor:
    """Token embeddings with the vision tower's outputs put in place of the pad tokens. [B, L, D]"""
    core = vlm.model                                                        # Qwen2VLModel
    embeds = core.get_input_embeddings()(input_ids)                         # [B, L, D]
    get = core.get_video_features if kind == "video" else core.get_image_features
    feats = torch.cat(get(pixels, grid_thw).pooler_output, dim=0)            # [N_tok, D]
    pad_id = vlm.config.video_token_id if kind == "video" else vlm.config.image_token_id
    mask = input_ids == pad_id                                              # [B, L]
    if int(mask.sum()) != feats.shape[0]:
        raise ValueError(f"{int(mask.sum())} {kind} pad tokens but {feats.shape[0]} vision features")
    return embeds.masked_scatter(mask[..., None].expand_as(embeds), feats.to(embeds.dtype))


def last_hidden(vlm, inputs: QwenInputs, device: torch.device) -> Tensor:
    """The language model's final hidden states for `inputs`. [B, L, D]"""
    ids = inputs.input_ids.to(device)
    dtype = next(vlm.model.visual.parameters()).dtype
    embeds = vision_embeds(vlm, ids, inputs.pixel_values.to(device, dtype), inputs.grid_thw.to(device),
                           inputs.kind)
    out = vlm.model.language_model(inputs_embeds=embeds, attention_mask=inputs.attention_mask.to(device),
                                   position_ids=inputs.position_ids.to(device), use_cache=False)
    return out.last_hidden_state


def read_at(hidden: Tensor, input_ids: Tensor, token_ids: list[int]) -> Tensor:
    """Hidden states at each reward token, one of each per row. [B, K, D]"""
    out = []
    for tid in token_ids:
        hits = (input_ids == tid).nonzero()                                 # [n, 2] (row, pos)
        if hits.shape[0] != input_ids.shape[0] or not torch.equal(hits[:, 0], torch.arange(input_ids.shape[0])):
            raise ValueError(f"every row needs exactly one reward token {tid}; the prompt lost it")
        out.append(hidden[hits[:, 0], hits[:, 1]])                          # [B, D]
    return torch.stack(out, dim=1)


# --- checkpoint key layouts ------------------------------------------------------------
# Checkpoints saved with transformers 4.4x name the language model `model.*` and the vision
# tower `visual.*`; transformers 5 nests both under `model.` (`model.language_model.*`,
# `model.visual.*`). lm_head and the reward heads keep their names.


def legacy_to_current(key: str) -> str:
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + key[len("model."):]
    return key


def current_to_legacy(key: str) -> str:
    if key.startswith("model.visual."):
        return key[len("model."):]
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


def remap(state: dict[str, Tensor], fn, prefix: str = "") -> dict[str, Tensor]:
    """Apply a key map under an optional prefix (e.g. PEFT's `base_model.model.`)."""
    out = {}
    for k, v in state.items():
        if not k.startswith(prefix):
            raise ValueError(f"checkpoint key {k!r} lacks the expected prefix {prefix!r}")
        out[prefix + fn(k[len(prefix):])] = v
    return out


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("rewards.models[].device = 'cuda' but this actor sees no GPU; give the "
                           "reward pool GPUs (pools.reward.num_gpus) or use device: auto")
    return torch.device(name)


# --- locating checkpoints --------------------------------------------------------------


class RewardLoadError(UserError, FileNotFoundError):
    """A reward checkpoint is missing or does not fit; the message names the path and the fix."""


def local_dir(path_or_id: str, field: str) -> Path:
    """A local directory, or a hub id resolved through the local Hugging Face cache."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        return p
    try:
        from huggingface_hub import snapshot_download  # heavy: huggingface_hub

        return Path(snapshot_download(path_or_id))
    except Exception as e:  # noqa: BLE001 - any hub failure means the same thing to the user
        raise RewardLoadError(f"{field} = {path_or_id!r}: not a local path, and the hub gave "
                              f"{type(e).__name__}; download it and point {field} at the folder") from None

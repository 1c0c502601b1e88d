"""The one interface the sampler and the learner use to drive a video model.

An adapter owns the text/image encoders, the transformer(s) and the decoder of one model
family. The sampler owns the loop; the adapter never calls a scheduler.

Latent layout is the transformer's: [B, C, F, H, W].
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from common.errors import UserError
from common.types import Cond  # the data contract (re-exported: adapters build it)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Components = Literal["all", "transformer"]
"""What `build_model` loads: everything (the rollout: encoders, transformer(s), VAE), or the
transformer(s) alone (the learner, which trains on the conditions the rollout encoded)."""


class ModelLoadError(UserError, FileNotFoundError):
    """A model path is missing or incomplete; the message names the path and what is missing."""


class NoEncoders(RuntimeError):
    """An encoder or the VAE was called on a model built with components='transformer'."""


class VideoModel(ABC):
    """A model family's adapter. Subclasses: toy, wan, hunyuan15."""

    family: str = "base"
    device: torch.device = torch.device("cpu")
    components: Components = "all"
    """"transformer": built without text/image encoders and VAE; encode and decode refuse."""
    needs_sigma_next: bool = False
    """Whether `velocity` also takes the step's end, `sigma_next=[B]` (MeanFlow checkpoints read it)."""

    @property
    @abstractmethod
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F, H, W) of one video's latents."""

    @abstractmethod
    def encode(self, prompts: list[str], images: Tensor | None = None) -> Cond:
        """Encode a batch of conditions once (text, plus uint8 [B, H, W, 3] first frames for I2V).

        Adapters that run CFG also take `negative_prompts` (one per row, None = model.negative_prompt);
        callers pass it only when a row has one (`negative_kwargs`)."""

    @abstractmethod
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v_θ(x, σ, c) with classifier-free guidance inside. x [B, C, F, H, W], σ [B] → [B, C, F, H, W]."""

    @abstractmethod
    def decode(self, latents: Tensor) -> Tensor:
        """Final latents [B, C, F, H, W] → uint8 frames [B, F, H, W, 3] (denormalised as the pipelines do)."""

    @abstractmethod
    def trainable_module(self) -> nn.Module:
        """The module the learner trains (and a weights payload targets)."""

    def transformers(self) -> list[nn.Module]:
        """The diffusers transformer(s) `velocity` runs: what sequence parallelism, the attention
        backend and block compilation act on (Wan 2.2: both experts)."""
        return [self.trainable_module()]

    def enable_sp(self, mesh) -> None:
        """Split every transformer's video tokens over the mesh's "ulysses" ranks (Ulysses SP,
        rollout_worker/models/sp.py); every rank of the mesh calls it at once, after LoRA injection."""
        # heavy: diffusers
        from rollout_worker.models.sp import check_splittable, enable_sp, video_tokens

        sp = mesh["ulysses"].size()
        for t in self.transformers():
            check_splittable(t, video_tokens(t, self.latent_shape), sp, "parallel.sp")
            enable_sp(t, mesh)

    def trains_sigma(self, sigma: float) -> bool:
        """Whether a step at σ_k runs a trainable module (False where a frozen expert runs it)."""
        return True

    def rows_per_sample(self, cond: Cond) -> int:
        """Transformer rows one sample takes in a forward: 2 where CFG's cond and uncond inputs
        run in one forward (the default, when `cond` has uncond inputs), else 1."""
        return 1 if cond.uncond is None else 2

    def initial_noise(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        """ε ~ N(0, I), drawn on the CPU from `generator` so it is the same on every device. [B, C, F, H, W]"""
        return torch.randn((batch, *self.latent_shape), generator=generator,
                           dtype=torch.float32).to(self.device)

    def load_weights(self, payload: dict[str, Tensor], strict: bool = True) -> None:
        """Load a state dict (full, or only the adapter weights, or one bucket of either) into
        the trainable module, each tensor copied into place (rounded to the weight's dtype)."""
        copy_weights(self.weight_targets(payload, strict), payload)

    def weight_targets(self, names, strict: bool = True) -> dict[str, Tensor]:
        """The trainable module's tensors that payload keys `names` load into.

        A full payload also loads into a module that holds a LoRA adapter: peft keeps the
        base weights under `….base_layer.…`, so plain keys are mapped there. strict: a key the
        module lacks is refused (before anything is loaded); otherwise it is skipped."""
        own = self.trainable_module().state_dict(keep_vars=True)
        out, unknown = {}, []
        for k in names:
            target = own.get(_peft_base_key(k, own))
            if target is None:
                unknown.append(k)
            else:
                out[k] = target
        if strict and unknown:
            raise KeyError(f"weights payload has keys the model lacks: {unknown[:5]}")
        return out

    def _require_encoders(self, what: str) -> None:
        if self.components != "all":
            raise NoEncoders(f"{self.family}: {what} needs the encoders/VAE, but this model was built with "
                             f"components={self.components!r} (the learner's build: it trains on the "
                             "conditions the rollout encoded, Trajectory.cond)")


@torch.no_grad()
def copy_weights(targets: dict[str, Tensor], payload: dict[str, Tensor]) -> None:
    """Copy each payload tensor into its target (a shape mismatch is refused, never broadcast)."""
    for k, v in payload.items():
        t = targets.get(k)
        if t is None:
            continue
        if t.shape != v.shape:
            raise ValueError(f"weights payload {k!r}: shape {tuple(v.shape)}, the model's is {tuple(t.shape)}")
        t.copy_(v)


def _peft_base_key(key: str, own) -> str:
    """`a.b.weight` → `a.b.base_layer.weight` when only the latter exists (a LoRA-wrapped layer)."""
    if key in own:
        return key
    head, _, leaf = key.rpartition(".")
    wrapped = f"{head}.base_layer.{leaf}"
    return wrapped if wrapped in own else key


def in_compute_dtype(cond: Cond, dtype: torch.dtype) -> Cond:
    """The condition's floating tensors in the transformer's compute dtype (masks untouched): a
    no-op where the rollout encoded them in model.dtype, as it does for the learner's own run."""
    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cond._map(cast)


def cast_params(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every floating parameter of `module` in `dtype`, buffers untouched (in place).

    This is the compute copy FSDP2 makes with MixedPrecisionPolicy(param_dtype=dtype): one
    dtype for all weights, diffusers' keep-in-fp32 modules included. The sampler holds exactly
    these values, so it computes the learner's velocities bit for bit. Buffers (RoPE tables)
    stay as built, as FSDP2 leaves them.
    """
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return module


def configure_vae(vae: nn.Module, cfg) -> None:
    """Tiled and/or sliced decoding as `model.vae_tiling` / `model.vae_slicing` ask."""
    if cfg.vae_tiling:
        vae.enable_tiling()
    if cfg.vae_slicing:
        vae.enable_slicing()


def frames_to_uint8(video: Tensor) -> Tensor:
    """A decoder's [B, 3, F, H, W] output in [-1, 1] → uint8 [B, F, H, W, 3], rounded as diffusers does."""
    video = (video.float() / 2 + 0.5).clamp(0, 1)
    return (video * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()


def require_dir(path: str | Path, needed: list[str], what: str) -> Path:
    """Check that a local model directory exists and holds the files a loader needs."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{what}: model path {str(p)!r} does not exist")
    lacking = [n for n in needed if not (p / n).exists()]
    if lacking:
        raise ModelLoadError(f"{what}: model path {str(p)!r} is incomplete; missing {', '.join(lacking)}")
    return p


def require_weights(root: Path, parts: list[str], what: str) -> None:
    """Each listed component folder that exists must hold weights (*.safetensors or *.bin)."""
    for p in parts:
        d = root / p
        if d.is_dir() and not any(d.glob("*.safetensors")) and not any(d.glob("*.bin")):
            raise ModelLoadError(f"{what}: model path {str(root)!r} is incomplete; {p}/ holds no weights "
                                 "(*.safetensors or *.bin)")


def is_local(path: str) -> bool:
    """A path that looks local (absolute, relative, or existing) rather than a hub id."""
    return path.startswith((".", "/", "~")) or Path(path).exists() or path.count("/") != 1


def negative_kwargs(conditions) -> dict:
    """`encode` keyword for the conditions' own negative prompts (a dataset's `negative_prompt`),
    or nothing when none has one (so adapters without CFG need not take it)."""
    negs = [getattr(c, "negative_prompt", None) for c in conditions]
    return {} if all(n is None for n in negs) else {"negative_prompts": negs}


def encoder_fingerprint(model_cfg, negative_prompt: str | None) -> str:
    """What encodes a condition, as one stable string: the model (family, path, dtype, task,
    resolution, text length), whether CFG runs (the unconditional text is then encoded too) and
    the negative prompt it uses. The bank keys a stored condition by it (with its id)."""
    m = model_cfg
    return json.dumps({"family": m.family, "path": m.path, "dtype": m.dtype, "task": m.task,
                       "frames": m.num_frames, "height": m.height, "width": m.width,
                       "max_sequence_length": m.max_sequence_length, "cfg": m.guidance_scale > 1.0,
                       "negative": m.negative_prompt if negative_prompt is None else negative_prompt},
                      sort_keys=True)


def first_frame_pil(img: Tensor):
    """An I2V first frame, uint8 [H, W, 3], as the PIL image diffusers' processors take."""
    from PIL import Image  # optional: only an I2V encode needs it

    arr = img.detach().cpu().numpy() if isinstance(img, Tensor) else np.asarray(img)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[-1] != 3:
        raise ValueError(f"a first frame must be uint8 [H, W, 3], got {arr.dtype} {tuple(arr.shape)}")
    return Image.fromarray(arr)


TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # the diffusers pipelines' names for them


def _text_encoders(pipe, device, offload: bool) -> list[nn.Module]:
    if not offload or torch.device(device).type == "cpu":
        return []
    return [m for name in TEXT_ENCODERS if (m := getattr(pipe, name, None)) is not None]


def park_text_encoders(pipe, device, offload: bool) -> None:
    """Once the pipeline is on `device`: with model.text_encoder_offload, its text encoders wait in
    host memory (on Wan, UMT5-XXL's 10.6 GiB of an 80 GB GPU while the rollout generates)."""
    for m in _text_encoders(pipe, device, offload):
        m.to("cpu")


@contextmanager
def text_encoders_on(pipe, device, offload: bool) -> Iterator[None]:
    """The text encoders on `device` for one encode, back on the host after it (with offload;
    without, they never left the device)."""
    moved = _text_encoders(pipe, device, offload)
    for m in moved:
        m.to(device)
    try:
        yield
    finally:
        for m in moved:
            m.to("cpu")

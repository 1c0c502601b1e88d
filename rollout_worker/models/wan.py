"""Wan 2.1 / 2.2 (T2V and I2V) through diffusers' own classes.

The adapter holds a diffusers pipeline object only as the container of its components
and for its public encoders (`encode_prompt`, `encode_image`, `prepare_latents`); the
sampler owns the loop. Conventions follow `WanPipeline.__call__`:
- the transformer gets timestep t = σ·1000;
- Wan 2.2 runs `transformer` (high-noise expert) while t ≥ boundary_ratio·1000, with
  `guidance_scale`, and `transformer_2` below it, with `guidance_scale_2`;
- CFG runs only when guidance_scale > 1; I2V concatenates [x, mask, condition latents];
- latents are denormalised with the VAE's latents_mean/std before decoding.

Wan 2.2 TI2V-5B (model_index.json `expand_timesteps`, the Wan 2.2 VAE: 48 channels, 16x spatial)
gives the transformer one timestep per video token, [B, F·H·W / patch] (`token_timesteps`). Its
I2V does not concatenate: the first latent frame of the input *is* the image's latents, at
timestep 0, while every other token is at t. Here the first frame is held for the whole rollout:
the transformer sees the image's latents there (as the pipeline), and `velocity` returns there
(x - c) / σ, the velocity whose clean estimate x - σ·v is the image's latents c. It does not
depend on the weights, so those elements add the same to every log-prob (log r is unchanged) and
the first frame follows the noise path to c, ending at c at σ = 0 (the pipeline overwrites it
with c at the end instead).

Precision: the VAE loads in fp32 (as diffusers documents for Wan; a bf16 load would round its
weights), the transformer(s) hold every weight in `model.dtype` (see `base.cast_params`).

components="transformer" (the learner) loads the transformer(s) alone: no UMT5, no CLIP, no VAE
weights (the VAE's config.json gives the latent shape); `encode` and `decode` then refuse.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from common.config import ModelConfig
from rollout_worker.models.base import (
    DTYPES,
    Components,
    Cond,
    ModelLoadError,
    VideoModel,
    cast_params,
    configure_vae,
    first_frame_pil,
    frames_to_uint8,
    in_compute_dtype,
    is_local,
    park_text_encoders,
    require_dir,
    require_weights,
    text_encoders_on,
)
from rollout_worker.models.empty import has_meta_parameters, parameters_on_meta
from rollout_worker.models.kernels import configure_kernels

_NEEDED = ["model_index.json", "vae/config.json", "text_encoder/config.json", "tokenizer"]
_ENCODERS = ("text_encoder", "tokenizer", "image_encoder", "image_processor")
"""The pipeline's components a transformer-only build leaves out (with the VAE)."""


def _check_local(path: str, task: str, components: Components = "all") -> None:
    """Name the first missing piece of a local Wan checkpoint before diffusers fails obscurely."""
    root = require_dir(path, _NEEDED if components == "all" else _NEEDED[:2], "wan")
    index = json.loads((root / "model_index.json").read_text(encoding="utf-8"))
    parts = [k for k in ("transformer", "transformer_2") if (index.get(k) or [None])[0] is not None]
    if task == "i2v" and components == "all" and (index.get("image_encoder") or [None])[0] is not None:
        parts += ["image_encoder", "image_processor"]
    if not any(p.startswith("transformer") for p in parts):
        raise ModelLoadError(f"wan: model path {path!r} is incomplete; model_index.json names no transformer")
    require_dir(root, [f"{p}/{'preprocessor_config.json' if p == 'image_processor' else 'config.json'}"
                       for p in parts], "wan")
    require_weights(root, ["transformer", "transformer_2"] + (["vae", "text_encoder"] if components == "all" else []),
                    "wan")


def _skipped(task: str) -> dict[str, None]:
    """The encoders a transformer-only build passes as None (the I2V pipeline also has CLIP's)."""
    return {k: None for k in _ENCODERS if task == "i2v" or k in ("text_encoder", "tokenizer")}


def _has_part(index: dict, name: str) -> bool:
    return (index.get(name) or [None])[0] is not None


def _empty_transformer(path: str, subfolder: str):
    """The expert in `subfolder` built from its config.json, parameters on meta (no weights read)."""
    from diffusers import WanTransformer3DModel  # heavy: diffusers

    config = WanTransformer3DModel.load_config(path, subfolder=subfolder)
    with parameters_on_meta():
        return WanTransformer3DModel.from_config(config)


def _container(pipe_cls, index: dict, parts: dict, task: str):
    """The pipeline object holding `parts` (no encoders, no VAE), configured as model_index.json."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # heavy: diffusers

    kw = {"boundary_ratio": index.get("boundary_ratio"), "expand_timesteps": index.get("expand_timesteps", False)}
    return pipe_cls(vae=None, scheduler=FlowMatchEulerDiscreteScheduler(), transformer=parts["transformer"],
                    transformer_2=parts.get("transformer_2"), **_skipped(task), **kw)


def _vae_dims(config) -> tuple[int, int, int]:
    """(latent channels, temporal factor, spatial factor) from the VAE's config (a config.json
    read without the model may omit the factors: AutoencoderKLWan's defaults, 4 and 8)."""
    return (int(config["z_dim"]), int(config.get("scale_factor_temporal", 4)),
            int(config.get("scale_factor_spatial", 8)))


class WanVideoModel(VideoModel):
    """Wan 2.x adapter. Build with `from_pretrained` (a checkpoint) or `from_components` (tests).

    `vae_config` stands in for the VAE's own config when the pipeline holds no VAE
    (components="transformer")."""

    family = "wan"

    def __init__(self, pipe, cfg: ModelConfig, device: torch.device | str = "cpu", vae_config=None,
                 low_noise_left_out: bool = False):
        """low_noise_left_out: the checkpoint has a low-noise expert the learner does not build
        (train_experts=high_noise; `velocity` then refuses rows below the boundary)."""
        self.cfg, self.pipe, self.device = cfg, pipe, torch.device(device)
        self.low_noise_left_out = low_noise_left_out
        self.components = "all" if pipe.vae is not None else "transformer"
        self.vae_dims = _vae_dims(pipe.vae.config if pipe.vae is not None else vae_config)
        # Wan 2.2 TI2V-5B: per-token timesteps, and I2V holds the first frame (no concatenation)
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False))
        self.transformer, self.transformer_2 = pipe.transformer, pipe.transformer_2
        if self.transformer is None:
            raise ModelLoadError("wan: the checkpoint has no `transformer` (the high-noise expert); "
                                 "boundary_ratio=1.0 checkpoints are not supported")
        boundary = cfg.boundary_ratio if cfg.boundary_ratio is not None else pipe.config.get("boundary_ratio")
        two = self.transformer_2 is not None or low_noise_left_out
        if two and boundary is None:
            raise ModelLoadError("wan: two experts need model.boundary_ratio (none in config or checkpoint)")
        if not two and cfg.boundary_ratio is not None:
            raise ValueError("model.boundary_ratio is set but the checkpoint has one expert (no transformer_2)")
        if cfg.train_experts == "high_noise" and not two:
            raise ValueError("model.train_experts=high_noise needs a Wan 2.2 checkpoint with transformer_2")
        self.boundary_timestep = None if not two else boundary * 1000.0
        self.guidance_scale = cfg.guidance_scale
        self.guidance_scale_2 = cfg.guidance_scale if cfg.guidance_scale_2 is None else cfg.guidance_scale_2
        for t in (self.transformer, self.transformer_2):
            if t is not None:
                cast_params(t, DTYPES[cfg.dtype])
        if pipe.vae is not None:
            configure_vae(pipe.vae, cfg)
        configure_kernels(self.transformers(), cfg)
        self._check_shapes()
        self._freeze()
        if not any(has_meta_parameters(t) for t in (self.transformer, self.transformer_2) if t is not None):
            pipe.to(self.device)  # an empty build stays on meta until the learner shards and loads it
            park_text_encoders(pipe, self.device, cfg.text_encoder_offload)

    # --- construction ------------------------------------------------------------------

    @classmethod
    def from_components(cls, components: dict, cfg: ModelConfig, device="cpu",
                        parts: Components = "all") -> WanVideoModel:
        """From built modules (keys as WanPipeline's: transformer, vae, text_encoder, tokenizer, …);
        parts="transformer" drops the encoders and the VAE (keeping only the VAE's config)."""
        # heavy: diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline

        comps = dict(components)
        comps.setdefault("scheduler", FlowMatchEulerDiscreteScheduler())  # unused: the sampler owns the loop
        vae_config = None
        if parts == "transformer":
            vae_config = dict(comps["vae"].config)
            comps.update(_skipped(cfg.task), vae=None)
        pipe_cls = WanImageToVideoPipeline if cfg.task == "i2v" else WanPipeline
        return cls(pipe_cls(**comps), cfg, device, vae_config)

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                        device="cpu", components: Components = "all", empty: bool = False) -> WanVideoModel:
        """Load a diffusers-format Wan checkpoint (local directory or hub id) in `dtype`; the VAE in
        fp32. components="transformer": the transformer(s) only (the VAE's config, not its weights),
        and with train_experts=high_noise the high-noise expert alone (the only one a trained row
        runs). empty: those transformer(s) with their parameters on the meta device, built from
        their configs; the learner loads each rank's shard (learner/shard_load.py)."""
        # heavy: diffusers
        from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline

        path = str(path)
        if is_local(path):
            _check_local(path, cfg.task, components)
        pipe_cls = WanImageToVideoPipeline if cfg.task == "i2v" else WanPipeline
        try:
            if components == "transformer":
                vae_config = AutoencoderKLWan.load_config(path, subfolder="vae")
                index = pipe_cls.load_config(path)  # model_index.json
                left_out = cfg.train_experts == "high_noise" and _has_part(index, "transformer_2")
                experts = ["transformer"] + (["transformer_2"] if _has_part(index, "transformer_2") and not left_out
                                             else [])
                if empty:
                    parts = {k: _empty_transformer(path, k) for k in experts}
                    pipe = _container(pipe_cls, index, parts, cfg.task)
                else:
                    skip = {"transformer_2": None} if left_out else {}
                    pipe = pipe_cls.from_pretrained(path, vae=None, torch_dtype=dtype, **_skipped(cfg.task), **skip)
                return cls(pipe, cfg, device, vae_config, low_noise_left_out=left_out)
            if empty:
                raise ValueError("an empty build is of the transformer(s) alone (components='transformer')")
            # the VAE loads in fp32 from the file: upcasting a bf16 load would keep its rounded weights
            vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
            pipe = pipe_cls.from_pretrained(path, vae=vae, torch_dtype=dtype)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"wan: could not load model path {path!r}: {e}") from e
        return cls(pipe, cfg, device)

    def _check_shapes(self) -> None:
        c = self.cfg
        z, st, ss = self.vae_dims
        if c.num_frames % st != 1:
            raise ValueError(f"model.num_frames = {c.num_frames}: Wan needs num_frames = {st}·k + 1")
        mult = ss * self.transformer.config.patch_size[1]
        if c.height % mult or c.width % mult:
            raise ValueError(f"model.height/width = {c.height}x{c.width}: Wan needs multiples of {mult}")
        want = z if c.task == "t2v" or self.expand_timesteps else 2 * z + st
        for name, t in (("transformer", self.transformer), ("transformer_2", self.transformer_2)):
            if t is not None and t.config.in_channels != want:
                raise ModelLoadError(f"wan: {name} takes {t.config.in_channels} channels, but model.task = "
                                     f"{c.task!r} needs {want}; is this a {'t2v' if c.task == 'i2v' else 'i2v'} "
                                     "checkpoint?")

    def _freeze(self) -> None:
        for m in (self.pipe.text_encoder, self.pipe.vae, getattr(self.pipe, "image_encoder", None)):
            if m is not None:
                m.requires_grad_(False)
        if self.cfg.train_experts == "high_noise" and self.transformer_2 is not None:
            self.transformer_2.requires_grad_(False)

    # --- VideoModel --------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (model.dtype): what inputs are cast to. Not the parameters' dtype,
        which is fp32 in the learner under FSDP2 (the masters; FSDP2 gathers them in this dtype)."""
        return DTYPES[self.cfg.dtype]

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        c, (z, st, ss) = self.cfg, self.vae_dims
        return z, (c.num_frames - 1) // st + 1, c.height // ss, c.width // ss

    @torch.no_grad()
    def encode(self, prompts: list[str], images: Tensor | None = None,
               negative_prompts: list[str | None] | None = None) -> Cond:
        self._require_encoders("encode")
        # 1. Text (and the negative prompt when CFG runs), as WanPipeline.encode_prompt does
        do_cfg = self.guidance_scale > 1.0
        negs = [self.cfg.negative_prompt if n is None else n for n in (negative_prompts or [None] * len(prompts))]
        with text_encoders_on(self.pipe, self.device, self.cfg.text_encoder_offload):
            prompt_embeds, negative_embeds = self.pipe.encode_prompt(
                prompt=list(prompts), negative_prompt=negs if do_cfg else None,
                do_classifier_free_guidance=do_cfg, max_sequence_length=self.cfg.max_sequence_length,
                device=self.device)
        tensors = {"encoder_hidden_states": prompt_embeds.to(self.dtype)}  # [B, L, D]
        uncond = {"encoder_hidden_states": negative_embeds.to(self.dtype)} if do_cfg else None
        if self.cfg.task == "t2v":
            return Cond(tensors, uncond)
        # 2. I2V: first-frame condition latents with their mask, and CLIP features (Wan 2.1)
        if images is None or len(images) != len(prompts):
            raise ValueError("model.task = 'i2v' needs one first frame (uint8 [H, W, 3]) per prompt")
        conds, feats = [], []
        for img in images:
            pil = first_frame_pil(img)
            pixels = self.pipe.video_processor.preprocess(pil, height=self.cfg.height, width=self.cfg.width)
            # the pipeline's own encode: the frame padded to the clip with its mask, or (per-token
            # timesteps) the frame alone, normalised with the VAE's latents_mean/std
            _, condition, *_ = self.pipe.prepare_latents(
                pixels.to(self.device, torch.float32), 1, self.pipe.vae.config.z_dim, self.cfg.height,
                self.cfg.width, self.cfg.num_frames, torch.float32, self.device, None,
                latents=torch.zeros(1, *self.latent_shape, device=self.device))
            conds.append(condition)  # [1, 4 + C, F, H, W]; per-token timesteps: [1, C, 1, H, W]
            if self.transformer.config.image_dim is not None:
                if getattr(self.pipe, "image_encoder", None) is None:
                    raise ModelLoadError("wan: this I2V transformer takes CLIP features, but the checkpoint "
                                         "has no image_encoder")
                feats.append(self.pipe.encode_image(pil, self.device))  # [1, N, D_img]
        tensors["first_frame" if self.expand_timesteps else "condition"] = torch.cat(conds).to(self.dtype)
        if feats:
            tensors["encoder_hidden_states_image"] = torch.cat(feats).to(self.dtype)
        return Cond(tensors, uncond)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(x.shape[0]) * 1000.0
        if self.transformer_2 is None:
            if self.low_noise_left_out and not bool((t >= self.boundary_timestep).all()):
                raise ValueError(f"wan: a row at t = {float(t.min()):g} < {self.boundary_timestep:g} runs the "
                                 "low-noise expert, which this learner does not build (model.train_experts="
                                 "high_noise trains only rows at or above model.boundary_ratio)")
            return self._guided(self.transformer, self.guidance_scale, x, t, cond)
        high = t >= self.boundary_timestep  # [B] which samples the high-noise expert serves
        if bool(high.all()):
            return self._guided(self.transformer, self.guidance_scale, x, t, cond)
        if not bool(high.any()):
            return self._guided(self.transformer_2, self.guidance_scale_2, x, t, cond)
        v = torch.empty(x.shape, dtype=torch.float32, device=self.device)
        v[high] = self._guided(self.transformer, self.guidance_scale, x[high], t[high], cond.index(high))
        v[~high] = self._guided(self.transformer_2, self.guidance_scale_2, x[~high], t[~high],
                                cond.index(~high))
        return v

    def _guided(self, model: nn.Module, scale: float, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """One batched forward over [cond; uncond] and the CFG mix, in fp32. [B, C, F, H, W]"""
        x_in, cond = x.to(self.device, self.dtype), in_compute_dtype(cond, self.dtype)
        first = cond.tensors.get("first_frame")  # [B, C, 1, H, W]: TI2V-5B's I2V holds it
        if "condition" in cond.tensors:
            x_in = torch.cat([x_in, cond.tensors["condition"]], dim=1)  # [B, 2C + 4, F, H, W]
        if first is not None:
            x_in = torch.cat([first, x_in[:, :, 1:]], dim=2)
        kw = {k: v for k, v in cond.tensors.items() if k not in ("condition", "first_frame")}
        ts = self.token_timesteps(model, t, x.shape, held=first is not None) if self.expand_timesteps else t
        do_cfg = self.guidance_scale > 1.0 and cond.uncond is not None
        if do_cfg:
            n = x.shape[0]
            kw = {k: torch.cat([v, cond.uncond.get(k, v)]) for k, v in kw.items()}
            x_in, ts = torch.cat([x_in, x_in]), torch.cat([ts, ts])
        out = model(hidden_states=x_in, timestep=ts, return_dict=False, **kw)[0].float()
        if do_cfg:
            v_cond, v_uncond = out[:n], out[n:]
            out = v_uncond + scale * (v_cond - v_uncond)
        if first is not None:  # the held frame's velocity points at the image's latents (module docstring)
            sigma = (t / 1000.0).view(-1, 1, 1, 1, 1)
            out[:, :, :1] = (x[:, :, :1].to(out.device, torch.float32) - first.float()) / sigma
        return out

    @staticmethod
    def token_timesteps(model: nn.Module, t: Tensor, shape, held: bool) -> Tensor:
        """Per-token timesteps [B, S] for x of `shape` [B, C, F, H, W]: t on every token of the
        transformer's patch grid, 0 on the first latent frame's tokens when it is held (I2V), as
        WanPipeline / WanImageToVideoPipeline build them with expand_timesteps."""
        pt, ph, pw = model.config.patch_size  # Wan: (1, 2, 2), one latent frame per token frame
        _, _, f, h, w = shape
        grid = torch.ones(f // pt, h // ph, w // pw, dtype=torch.float32, device=t.device)
        if held:
            grid[0] = 0.0
        return t.view(-1, 1) * grid.flatten().view(1, -1)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        self._require_encoders("decode")
        vae = self.pipe.vae
        z = latents.to(self.device, vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
        video = vae.decode(z * std + mean, return_dict=False)[0]  # [B, 3, F', H', W'] in [-1, 1]
        return frames_to_uint8(video)

    def trainable_module(self) -> nn.Module:
        """`transformer` alone (Wan 2.1, or train_experts=high_noise); else both experts in a ModuleDict."""
        if self.transformer_2 is None or self.cfg.train_experts == "high_noise":
            return self.transformer
        if not hasattr(self, "_experts"):
            self._experts = nn.ModuleDict({"transformer": self.transformer, "transformer_2": self.transformer_2})
        return self._experts

    def transformers(self) -> list[nn.Module]:
        return [t for t in (self.transformer, self.transformer_2) if t is not None]

    def trains_sigma(self, sigma: float) -> bool:
        return expert_trains(sigma, self.boundary_timestep, self.cfg.train_experts)


def expert_trains(sigma: float, boundary_timestep: float | None, train_experts: str) -> bool:
    """Whether a step at σ runs a trained expert: with train_experts=high_noise, only steps the
    high-noise expert serves (t = 1000σ at or above the boundary); None: one expert (Wan 2.1)."""
    if boundary_timestep is None or train_experts == "all":
        return True
    t = torch.tensor(sigma, dtype=torch.float32) * 1000.0  # the same fp32 test as velocity's
    return bool(t >= boundary_timestep)

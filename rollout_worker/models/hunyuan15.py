"""HunyuanVideo 1.5 (T2V and I2V) through diffusers' own classes.

As in `HunyuanVideo15Pipeline.__call__`: the transformer takes [x, condition latents, mask]
along channels, timestep t = σ·1000, the Qwen2.5-VL and ByT5 text states with their masks,
and SigLIP image states (zeros for T2V, which the transformer reads as "no image"). CFG is
uncond + g·(cond - uncond), run only when guidance_scale > 1, with the cond and the uncond rows
in forwards of their own as the pipeline's guider runs them. Latents are divided by the
VAE's scaling_factor before decoding.

The pipeline's guider (the checkpoint's `guider/` config) is honoured: its formulation and
rescale are applied, and a guidance-distilled checkpoint (guider scale 1.0: CFG is in the
weights) refuses model.guidance_scale > 1, which would guide twice. MeanFlow (step-distilled)
transformers get `timestep_r` = the step's end σ'·1000, as HunyuanVideo15ImageToVideoPipeline
passes `timesteps[i + 1]` (0 after the last step); the T2V pipeline passes none.

components="transformer" (the learner) loads the transformer and the guider's config alone: no
Qwen2.5-VL, ByT5, SigLIP or VAE weights (the VAE's config.json gives the latent shape);
`encode` and `decode` then refuse.
"""

from __future__ import annotations

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
from rollout_worker.models.hunyuan15_attention import use_key_mask_attention
from rollout_worker.models.kernels import configure_kernels

_TEXT_KEYS = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
              "encoder_attention_mask_2")
_NEEDED = ["model_index.json", "transformer/config.json", "vae/config.json", "text_encoder/config.json",
           "text_encoder_2/config.json", "tokenizer", "tokenizer_2"]
_NEEDED_I2V = ["image_encoder/config.json", "feature_extractor"]


def _pipeline_class(task: str):
    # heavy: diffusers
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    return HunyuanVideo15ImageToVideoPipeline if task == "i2v" else HunyuanVideo15Pipeline


class Hunyuan15VideoModel(VideoModel):
    """HunyuanVideo 1.5 adapter. Build with `from_pretrained` (a checkpoint) or `from_components` (tests)."""

    family = "hunyuan15"

    def __init__(self, pipe, cfg: ModelConfig, device: torch.device | str = "cpu", *, transformer=None,
                 guider=None, vae_config=None):
        """`pipe`: the whole pipeline; or None with the `transformer`, the `guider` and the VAE's
        `vae_config` alone (components="transformer")."""
        self.cfg, self.pipe, self.device = cfg, pipe, torch.device(device)
        self.components = "all" if pipe is not None else "transformer"
        self.transformer = pipe.transformer if pipe is not None else transformer
        self.guider = getattr(pipe, "guider", None) if pipe is not None else guider
        self.vae_dims = _vae_dims(pipe.vae.config if pipe is not None else vae_config)
        self.guidance_scale = cfg.guidance_scale
        _check_guidance(cfg.guidance_scale, self.guider)
        # MeanFlow: the I2V pipeline feeds the step's end as timestep_r; the T2V pipeline does not
        self.needs_sigma_next = bool(self.transformer.config.get("use_meanflow", False)) and cfg.task == "i2v"
        if cfg.guidance_scale_2 is not None or cfg.boundary_ratio is not None:
            raise ValueError("model.guidance_scale_2 / model.boundary_ratio are Wan 2.2 options; "
                             "HunyuanVideo 1.5 has one transformer")
        if cfg.train_experts != "all":
            raise ValueError("model.train_experts = 'high_noise' is a Wan 2.2 option")
        _, st, ss = self.vae_dims
        if cfg.num_frames % st != 1:
            raise ValueError(f"model.num_frames = {cfg.num_frames}: HunyuanVideo 1.5 needs {st}·k + 1")
        if cfg.height % ss or cfg.width % ss:
            raise ValueError(f"model.height/width = {cfg.height}x{cfg.width}: need multiples of {ss}")
        cast_params(self.transformer, DTYPES[cfg.dtype])
        use_key_mask_attention(self.transformer)  # no dense S×S mask; none at all where nothing is padded
        configure_kernels(self.transformers(), cfg)  # the learner's transformer-only build too
        if pipe is None:
            if not has_meta_parameters(self.transformer):  # an empty build waits for the learner's load
                self.transformer.to(self.device)
            return
        for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae, getattr(pipe, "image_encoder", None)):
            if m is not None:
                m.requires_grad_(False)
        configure_vae(pipe.vae, cfg)
        pipe.to(self.device)
        park_text_encoders(pipe, self.device, cfg.text_encoder_offload)

    # --- construction ------------------------------------------------------------------

    @classmethod
    def from_components(cls, components: dict, cfg: ModelConfig, device="cpu",
                        parts: Components = "all") -> Hunyuan15VideoModel:
        """From built modules (keys as HunyuanVideo15Pipeline's: transformer, vae, text_encoder, …);
        parts="transformer" keeps the transformer, the guider and the VAE's config only."""
        # heavy: diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.guiders import ClassifierFreeGuidance

        comps = dict(components)
        comps.setdefault("scheduler", FlowMatchEulerDiscreteScheduler())  # unused: the sampler owns the loop
        comps.setdefault("guider", ClassifierFreeGuidance(guidance_scale=max(cfg.guidance_scale, 1.0)))
        if parts == "transformer":
            return cls(None, cfg, device, transformer=comps["transformer"], guider=comps["guider"],
                       vae_config=dict(comps["vae"].config))
        return cls(_pipeline_class(cfg.task)(**comps), cfg, device)

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                        device="cpu", components: Components = "all", empty: bool = False) -> Hunyuan15VideoModel:
        """Load a diffusers-format HunyuanVideo 1.5 checkpoint (local directory or hub id) in `dtype`;
        components="transformer": the transformer and the guider only (the VAE's config, not its weights).
        empty: the transformer with its parameters on the meta device, built from its config; the
        learner loads each rank's shard (learner/shard_load.py)."""
        path = str(path)
        lean = components == "transformer"
        if empty and not lean:
            raise ValueError("an empty build is of the transformer alone (components='transformer')")
        if is_local(path):
            needed = _NEEDED[:3] if lean else _NEEDED + (_NEEDED_I2V if cfg.task == "i2v" else [])
            root = require_dir(path, needed, "hunyuan15")
            require_weights(root, ["transformer"] if lean else
                            ["transformer", "vae", "text_encoder", "text_encoder_2", "image_encoder"], "hunyuan15")
        try:
            if lean:
                return cls(None, cfg, device, **_load_transformer_only(path, cfg.task, dtype, empty))
            pipe = _pipeline_class(cfg.task).from_pretrained(path, torch_dtype=dtype)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"hunyuan15: could not load model path {path!r}: {e}") from e
        return cls(pipe, cfg, device)

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

    def _text(self, prompts: list[str]) -> dict[str, Tensor]:
        with text_encoders_on(self.pipe, self.device, self.cfg.text_encoder_offload):
            out = self.pipe.encode_prompt(prompt=prompts, device=self.device, dtype=self.dtype,
                                          batch_size=len(prompts))
        return dict(zip(_TEXT_KEYS, out, strict=True))  # [B, L, D], [B, L], [B, L2, D2], [B, L2]

    @torch.no_grad()
    def encode(self, prompts: list[str], images: Tensor | None = None,
               negative_prompts: list[str | None] | None = None) -> Cond:
        self._require_encoders("encode")
        B, shape = len(prompts), self.latent_shape
        # 1. Text, and the negative prompt (per row, else model.negative_prompt) when CFG runs
        tensors = self._text(list(prompts))
        negs = [self.cfg.negative_prompt if n is None else n for n in (negative_prompts or [None] * B)]
        uncond = self._text(negs) if self.guidance_scale > 1.0 else None
        # 2. Image states and first-frame condition latents + mask (zeros for T2V)
        if self.cfg.task == "t2v":
            tensors["image_embeds"] = torch.zeros(B, self.pipe.vision_num_semantic_tokens,
                                                  self.transformer.config.image_embed_dim,
                                                  dtype=self.dtype, device=self.device)
            tensors["cond_latents"] = torch.zeros(B, *shape, dtype=self.dtype, device=self.device)
            tensors["mask"] = torch.zeros(B, 1, *shape[1:], dtype=self.dtype, device=self.device)
            return Cond(tensors, uncond)
        if images is None or len(images) != B:
            raise ValueError("model.task = 'i2v' needs one first frame (uint8 [H, W, 3]) per prompt")
        embeds, conds, masks = [], [], []
        for img in images:
            pil = self.pipe.video_processor.resize(first_frame_pil(img), height=self.cfg.height, width=self.cfg.width,
                                                   resize_mode="crop")
            embeds.append(self.pipe.encode_image(image=pil, batch_size=1, device=self.device, dtype=self.dtype))
            c, m = self.pipe.prepare_cond_latents_and_mask(
                latents=torch.zeros(1, *shape, device=self.device), image=pil, batch_size=1,
                height=self.cfg.height, width=self.cfg.width, dtype=self.dtype, device=self.device)
            conds.append(c)   # [1, C, F, H, W], first frame set
            masks.append(m)   # [1, 1, F, H, W], 1 on the first frame
        tensors.update(image_embeds=torch.cat(embeds), cond_latents=torch.cat(conds), mask=torch.cat(masks))
        return Cond(tensors, uncond)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond, sigma_next: Tensor | None = None) -> Tensor:
        n = x.shape[0]
        t = (torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000.0)
        extra = {}
        if self.needs_sigma_next:
            if sigma_next is None:
                raise ValueError("this MeanFlow checkpoint needs sigma_next (the step's end) for timestep_r")
            t_r = torch.as_tensor(sigma_next, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000.0
            extra["timestep_r"] = t_r.to(self.dtype)
        cond = in_compute_dtype(cond, self.dtype)
        c = cond.tensors
        x_in = torch.cat([x.to(self.device, self.dtype), c["cond_latents"], c["mask"]], dim=1)  # [B, 2C+1, F, H, W]
        v_cond = self._forward(x_in, t, c["image_embeds"], {k: c[k] for k in _TEXT_KEYS}, extra)
        if self.guidance_scale <= 1.0 or cond.uncond is None:
            return v_cond
        # the unconditional rows in a forward of their own, as HunyuanVideo15Pipeline's guider runs
        # them: a group's rows then share one text length, so nothing is padded (no attention mask)
        v_uncond = self._forward(x_in, t, c["image_embeds"], {k: cond.uncond[k] for k in _TEXT_KEYS}, extra)
        return _guide(self.guider, self.guidance_scale, v_cond, v_uncond)

    def _forward(self, x_in: Tensor, t: Tensor, image_embeds: Tensor, text: dict[str, Tensor],
                 extra: dict[str, Tensor]) -> Tensor:
        """The transformer over the rows of x_in, one forward per set of rows with the same text
        masks (a group's rows are one), each without its padding, so no forward needs an
        attention mask and a row's result does not depend on its batch mates' texts. fp32"""
        sets = _rows_by_text_mask(text)
        if len(sets) == 1:
            return self._unpadded(x_in, t, image_embeds, text, extra)
        out = None
        for rows in sets:
            part = self._unpadded(x_in[rows], t[rows], image_embeds[rows], {k: v[rows] for k, v in text.items()},
                                  {k: v[rows] for k, v in extra.items()})
            out = part.new_empty((x_in.shape[0], *part.shape[1:])) if out is None else out
            out[rows] = part
        return out

    def _unpadded(self, x_in: Tensor, t: Tensor, image_embeds: Tensor, text: dict[str, Tensor],
                  extra: dict[str, Tensor]) -> Tensor:
        text, image_embeds = _without_padding(text, image_embeds, self.cfg.task)
        return self.transformer(hidden_states=x_in, image_embeds=image_embeds, timestep=t.to(self.dtype),
                                return_dict=False, **text, **extra)[0].float()

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """One video at a time: the VAE's causal attention mask ([B, L, L] against [B, 1, L, C]
        queries) only broadcasts for B = 1 in diffusers' AutoencoderKLHunyuanVideo15."""
        self._require_encoders("decode")
        vae = self.pipe.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor
        video = torch.cat([vae.decode(z[i:i + 1], return_dict=False)[0] for i in range(len(z))])
        return frames_to_uint8(video)  # [B, 3, F', H', W'] in [-1, 1] → uint8 [B, F', H', W', 3]

    def trainable_module(self) -> nn.Module:
        return self.transformer

    def rows_per_sample(self, cond: Cond) -> int:
        return 1  # CFG's cond and uncond rows run in forwards of their own (velocity)


def _rows_by_text_mask(text: dict[str, Tensor]) -> list[Tensor]:
    """Row indices grouped by equal (Qwen, ByT5) attention masks, in a fixed order."""
    masks = torch.cat([text["encoder_attention_mask"], text["encoder_attention_mask_2"]], dim=1)
    kinds, which = torch.unique(masks, dim=0, return_inverse=True)
    return [torch.nonzero(which == i).flatten() for i in range(len(kinds))]


def _without_padding(kw: dict[str, Tensor], image_embeds: Tensor, task: str) -> tuple[dict[str, Tensor], Tensor]:
    """Encoder inputs of rows with the same text masks without the tokens no row attends to: the
    text padding, and T2V's image tokens (zeros, which the transformer masks out). Nothing is then
    padded, so attention runs without a mask (hunyuan15_attention.py); a padded token never
    reaches a valid one, so the video tokens' output is the padded forward's."""
    out = dict(kw)
    for states, mask in (("encoder_hidden_states", "encoder_attention_mask"),
                         ("encoder_hidden_states_2", "encoder_attention_mask_2")):
        keep = out[mask][0].bool()  # [L]: the tokens every row attends to (the rows' masks are equal)
        out[states], out[mask] = out[states][:, keep], out[mask][:, keep]
    return out, (image_embeds[:, :0] if task == "t2v" else image_embeds)


def _vae_dims(config) -> tuple[int, int, int]:
    """(latent channels, temporal factor, spatial factor) from the VAE's config (a config.json
    read without the model may omit them: AutoencoderKLHunyuanVideo15's defaults, 32, 4, 16)."""
    return (int(config.get("latent_channels", 32)), int(config.get("temporal_compression_ratio", 4)),
            int(config.get("spatial_compression_ratio", 16)))


def _load_transformer_only(path: str, task: str, dtype: torch.dtype, empty: bool = False) -> dict:
    """The transformer (in `dtype`; empty: parameters on meta, no weights read), the guider
    model_index.json names, and the VAE's config."""
    # heavy: diffusers
    import diffusers.guiders
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    index = _pipeline_class(task).load_config(path)  # model_index.json
    guider_cls = (index.get("guider") or [None, None])[1]
    guider = None if guider_cls is None else \
        getattr(diffusers.guiders, guider_cls).from_pretrained(path, subfolder="guider")
    if empty:
        with parameters_on_meta():
            transformer = HunyuanVideo15Transformer3DModel.from_config(
                HunyuanVideo15Transformer3DModel.load_config(path, subfolder="transformer"))
    else:
        transformer = HunyuanVideo15Transformer3DModel.from_pretrained(path, subfolder="transformer",
                                                                       torch_dtype=dtype)
    return {"transformer": transformer,
            "guider": guider, "vae_config": AutoencoderKLHunyuanVideo15.load_config(path, subfolder="vae")}


def _check_guidance(scale: float, guider) -> None:
    """A guidance-distilled checkpoint (its guider runs scale 1.0 or is off) takes no CFG on top."""
    if guider is None or scale <= 1.0:
        return
    distilled = not guider._enabled or (guider.guidance_scale == 0.0 if guider.use_original_formulation
                                         else guider.guidance_scale == 1.0)
    if distilled:
        raise ValueError(f"model.guidance_scale = {scale}: this checkpoint's guider runs guidance "
                         f"{guider.guidance_scale} (guidance-distilled: CFG is in its weights), so CFG on top "
                         "would guide twice; set model.guidance_scale: 1.0")


def _guide(guider, scale: float, v_cond: Tensor, v_uncond: Tensor) -> Tensor:
    """The guider's CFG mix (its formulation and rescale) at `scale`, in fp32."""
    original = guider is not None and guider.use_original_formulation
    v = (v_cond if original else v_uncond) + scale * (v_cond - v_uncond)
    rescale = 0.0 if guider is None else guider.guidance_rescale
    if rescale > 0.0:
        from diffusers.guiders.guider_utils import rescale_noise_cfg  # heavy: diffusers

        v = rescale_noise_cfg(v, v_cond, rescale)
    return v

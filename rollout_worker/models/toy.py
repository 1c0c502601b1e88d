"""The toy video model: diffusers' real WanTransformer3DModel, tiny, in pixel space.

- Latents are the video itself in [-1, 1], layout [B, 3, F, H, W]; decode is the identity
  codec (clamp, rescale to uint8, [B, F, H, W, 3]).
- Text encoder: frozen random embeddings, one per word, drawn from a generator seeded by
  (encoder seed, crc32(word)) — no vocabulary file, any word gets a stable vector, and the
  empty prompt (all-zero padding) is the unconditional input for CFG.
- The transformer sees 10 input channels: the noisy video (3), the I2V condition video (3)
  plus a mask channel (1), and fixed (t, y, x) coordinates in [-1, 1] (3). The condition
  layout is the checkpoint's `i2v_layout`:
  - `first_frame` (Wan 2.1/2.2 I2V): the first frame sits at frame 0 of an otherwise black
    condition video and the mask is 1 on frame 0 only — the first-frame latent and its mask,
    concatenated on the channels, as WanImageToVideoPipeline builds them;
  - `broadcast` (the T2V base, and checkpoints without the key): the first frame at every frame,
    mask 1 everywhere.
  A T2V row (no image) is all zeros in both layouts, so one checkpoint serves T2V and I2V.
- A checkpoint is `NAME.safetensors` (transformer weights) + `NAME.json` (configs and the
  pretraining record). `from_pretrained(None)` loads the committed one in assets/.
- components="transformer" (the learner): no word encoder; `encode` and `decode` refuse.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from common.policy_layout import WEIGHTS_INDEX
from rollout_worker.models.base import Components, Cond, ModelLoadError, VideoModel
from rollout_worker.models.kernels import configure_kernels

ASSETS = Path(__file__).parent / "assets"
BASE_CHECKPOINT = ASSETS / "toy_base.safetensors"
DIR_WEIGHTS, DIR_META = "toy.safetensors", "toy.json"
DIFFUSERS_DIR = "transformer"   # an exported toy pipeline: WanTransformer3DModel.from_pretrained reads it
IN_CHANNELS = 10   # noisy video 3 + first frame 3 + first-frame mask 1 + coordinates 3
BASE_I2V_CHECKPOINT = ASSETS / "toy_i2v_base.safetensors"
I2V_LAYOUTS = ("broadcast", "first_frame")

DEFAULT_TRANSFORMER: dict[str, Any] = {
    "patch_size": [1, 4, 4], "num_attention_heads": 4, "attention_head_dim": 16,
    "in_channels": IN_CHANNELS, "out_channels": 3, "text_dim": 32, "freq_dim": 64,
    "ffn_dim": 128, "num_layers": 4, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32,
}
DEFAULT_TEXT: dict[str, Any] = {"dim": 32, "max_len": 8, "seed": 20240}
DEFAULT_WORLD: dict[str, Any] = {"num_frames": 6, "height": 16, "width": 16}


class WordEncoder:
    """Frozen text encoder: prompt → [L, D] random per-word vectors, zero-padded to max_len."""

    def __init__(self, dim: int, max_len: int, seed: int):
        self.dim, self.max_len, self.seed = dim, max_len, seed
        self._cache: dict[str, Tensor] = {}

    def word(self, w: str) -> Tensor:
        if w not in self._cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(w.encode()))
            self._cache[w] = torch.randn(self.dim, generator=g)
        return self._cache[w]

    def __call__(self, prompts: list[str]) -> Tensor:
        out = torch.zeros(len(prompts), self.max_len, self.dim)            # [B, L, D]
        for i, p in enumerate(prompts):
            words = p.lower().replace(".", " ").split()[: self.max_len]
            for j, w in enumerate(words):
                out[i, j] = self.word(w)
        return out


def _build_transformer(cfg: dict[str, Any]) -> nn.Module:
    from diffusers import WanTransformer3DModel  # heavy: diffusers

    kw = dict(cfg)
    kw["patch_size"] = tuple(kw["patch_size"])
    return WanTransformer3DModel(**kw)


def _resolve(path: str | Path | None) -> tuple[list[Path], Path]:
    """(weights files, sidecar) for a file path, a directory or None (the committed checkpoint).
    A directory holds toy.safetensors + toy.json, or (as `vgrpo export --pipeline` writes it) a
    diffusers `transformer/` folder (one safetensors file, or an index and its shards) + toy.json."""
    p = BASE_CHECKPOINT if path is None else Path(path).expanduser()
    if p.is_dir() and (p / DIFFUSERS_DIR / "config.json").is_file():
        weights, meta = [p / DIFFUSERS_DIR / "diffusion_pytorch_model.safetensors"], p / DIR_META
        index = p / DIFFUSERS_DIR / WEIGHTS_INDEX
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"toy model: {str(index)!r} is malformed ({e})") from None
            weights = [p / DIFFUSERS_DIR / n for n in names]
    elif p.is_dir():
        weights, meta = [p / DIR_WEIGHTS], p / DIR_META
    else:
        weights, meta = [p], p.with_suffix(".json")
    if not any(w.exists() for w in weights) and not p.exists():
        raise ModelLoadError(f"toy model: checkpoint path {str(p)!r} does not exist")
    lacking = [str(f) for f in (*weights, meta) if not f.is_file()]
    if lacking:
        raise ModelLoadError(f"toy model: checkpoint {str(p)!r} is incomplete; missing {', '.join(lacking)}")
    return weights, meta


class ToyVideoModel(VideoModel):
    family = "toy"

    def __init__(self, transformer_cfg: dict[str, Any] | None = None, text_cfg: dict[str, Any] | None = None,
                 world: dict[str, Any] | None = None, guidance_scale: float = 1.0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 i2v_layout: str = "first_frame", components: Components = "all"):
        if i2v_layout not in I2V_LAYOUTS:
            raise ModelLoadError(f"toy model: i2v_layout {i2v_layout!r} is not one of {list(I2V_LAYOUTS)}")
        self.i2v_layout = i2v_layout
        self.transformer_cfg = dict(transformer_cfg or DEFAULT_TRANSFORMER)
        self.text_cfg = dict(text_cfg or DEFAULT_TEXT)
        self.world = dict(world or DEFAULT_WORLD)
        self.guidance_scale = float(guidance_scale)
        self.dtype = dtype
        self.device = torch.device(device)
        self.meta: dict[str, Any] = {}
        self.components = components
        self.text_encoder = WordEncoder(**self.text_cfg) if components == "all" else None
        self.transformer = _build_transformer(self.transformer_cfg).to(self.device)
        if dtype != torch.float32:
            self.transformer.to(dtype)
        self.transformer.requires_grad_(True)

    # --- loading -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, dtype: torch.dtype = torch.float32,
                        guidance_scale: float = 1.0, device: str | torch.device = "cpu",
                        components: Components = "all") -> ToyVideoModel:
        """Load NAME.safetensors + NAME.json (or a directory holding toy.safetensors + toy.json)."""
        weights, meta_path = _resolve(path)
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            model = cls(meta["transformer"], meta["text"], meta["world"], guidance_scale, dtype, device,
                        meta.get("i2v_layout", "broadcast"), components)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"toy model: sidecar {str(meta_path)!r} is malformed ({e})") from None
        state = {}
        for w in weights:
            try:
                part = load_file(str(w))
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"toy model: weights {str(w)!r} are unreadable, truncated or damaged "
                                     f"({e}); restore the file or point model.path elsewhere") from None
            # safetensors has no checksum: flipped bytes in the data show up, if at all, as NaN/inf
            bad = next((k for k, v in part.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
            if bad is not None:
                raise ModelLoadError(f"toy model: weights {str(w)!r} hold NaN/inf in {bad!r} (a damaged "
                                     "file); restore it or point model.path elsewhere")
            state.update(part)
        where = str(weights[0] if len(weights) == 1 else weights[0].parent)
        missing, unexpected = model.transformer.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ModelLoadError(f"toy model: weights {where!r} do not fit the sidecar's config "
                                 f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        model.meta = meta
        return model

    @classmethod
    def from_config(cls, cfg, components: Components = "all") -> ToyVideoModel:
        """From a common.config.RunConfig: its model.path, dtype and guidance_scale."""
        m = cfg.model
        path = cls.checkpoint_path(cfg)
        model = cls.from_pretrained(path, getattr(torch, m.dtype), m.guidance_scale, components=components)
        want = {"num_frames": m.num_frames, "height": m.height, "width": m.width}
        if want != {k: model.world[k] for k in want}:
            raise ModelLoadError(f"toy model: model.num_frames/height/width = {want} do not match the "
                                 f"checkpoint's {model.world} (path {str(path or BASE_CHECKPOINT)!r})")

        configure_kernels(model.transformers(), m)
        return model

    @staticmethod
    def checkpoint_path(cfg) -> str | Path | None:
        """The checkpoint a config loads: model.path, else the committed base of the task (None
        for T2V; the I2V one conditions on a first frame as Wan I2V does)."""
        m = cfg.model
        return m.path if m.path is not None or m.task == "t2v" else BASE_I2V_CHECKPOINT

    @staticmethod
    def sidecar(path: str | Path | None) -> dict[str, Any]:
        """A checkpoint's NAME.json: the transformer's config, the text encoder, the world."""
        _, meta = _resolve(path)
        try:
            return json.loads(meta.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"toy model: sidecar {str(meta)!r} is malformed ({e})") from None

    @classmethod
    def check(cls, cfg) -> None:
        """Load cfg.model.path here exactly as every actor will, so that a damaged checkpoint is one
        ModelLoadError line in the driver before any actor starts (the toy model is about 1 MB)."""
        cls.from_config(cfg)

    def save_pretrained(self, path: str | Path, record: dict[str, Any] | None = None) -> Path:
        """Write NAME.safetensors + NAME.json (a directory gets toy.safetensors + toy.json)."""
        p = Path(path)
        weights = p / DIR_WEIGHTS if p.is_dir() else p
        weights.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu", torch.float32).contiguous()
                 for k, v in self.transformer.state_dict().items()}
        save_file(state, str(weights))
        meta = {"format": "vgrpo-toy/1", "transformer": self.transformer_cfg, "text": self.text_cfg,
                "world": self.world, "i2v_layout": self.i2v_layout, **(record or {})}
        weights.with_name(weights.stem + ".json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        return weights

    # --- VideoModel ----------------------------------------------------------------------

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        return 3, self.world["num_frames"], self.world["height"], self.world["width"]

    def trainable_module(self) -> nn.Module:
        return self.transformer

    def encode(self, prompts: list[str], images: Tensor | None = None,
               negative_prompts: list[str | None] | None = None) -> Cond:
        self._require_encoders("encode")
        B, (_, _, H, W) = len(prompts), self.latent_shape
        text = self.text_encoder(prompts)                                  # [B, L, D]
        image = torch.zeros(B, 4, H, W)                                    # rgb + mask
        if images is not None:
            if images.dtype != torch.uint8 or tuple(images.shape) != (B, H, W, 3):
                raise ValueError(f"images must be uint8 [{B}, {H}, {W}, 3], got "
                                 f"{images.dtype} {tuple(images.shape)}")
            image[:, :3] = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
            image[:, 3] = 1.0
        # CFG's unconditional text: the empty prompt (zeros), or a row's negative prompt
        negs = [n or "" for n in (negative_prompts or [None] * B)]
        uncond = {"text": self.text_encoder(negs), "image": image.clone()} if self.guidance_scale != 1.0 else None
        return Cond({"text": text, "image": image}, uncond).to(self.device)

    def _coords(self, B: int) -> Tensor:
        _, F, H, W = self.latent_shape
        axes = [torch.linspace(-1, 1, n) for n in (F, H, W)]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij"))           # [3, F, H, W]
        return grid.expand(B, -1, -1, -1, -1).to(self.device)

    def _forward(self, x: Tensor, sigma: Tensor, text: Tensor, image: Tensor) -> Tensor:
        B, _, F = x.shape[:3]
        if self.i2v_layout == "broadcast":
            cond_img = image[:, :, None].expand(-1, -1, F, -1, -1)         # [B, 4, F, H, W]
        else:                                                              # frame 0 given, the rest black
            cond_img = torch.cat([image[:, :, None], image.new_zeros(B, 4, F - 1, *image.shape[2:])], dim=2)
        inp = torch.cat([x.float(), cond_img.float(), self._coords(B)], dim=1)  # [B, 10, F, H, W]
        t = (sigma.float().reshape(-1).expand(B) * 1000.0).to(self.dtype)
        out = self.transformer(inp.to(self.dtype), t, text.to(self.dtype), return_dict=False)[0]
        return out.float()                                                 # [B, 3, F, H, W]

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        sigma = torch.as_tensor(sigma, device=x.device).reshape(-1).expand(x.shape[0])
        c = cond.tensors
        if self.guidance_scale == 1.0 or cond.uncond is None:
            return self._forward(x, sigma, c["text"], c["image"])
        u = cond.uncond
        v = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]),
                          torch.cat([c["text"], u["text"]]), torch.cat([c["image"], u["image"]]))
        v_c, v_u = v.chunk(2)
        return v_u + self.guidance_scale * (v_c - v_u)

    def decode(self, latents: Tensor) -> Tensor:
        self._require_encoders("decode")
        x = latents.detach().float().clamp(-1, 1)
        return ((x + 1.0) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()  # [B, F, H, W, 3]

    @staticmethod
    def encode_frames(frames: Tensor) -> Tensor:
        """The identity codec's inverse: uint8 [B, F, H, W, 3] → latents in [-1, 1] [B, 3, F, H, W]."""
        return frames.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0

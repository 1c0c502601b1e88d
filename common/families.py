"""Model families as declarations: one `FamilySpec` per `model.family`.

Pure data (and a lazy path to the adapter, imported only when a model is built, as the scorers'
are): what model building, LoRA, export, the plan, the preflight and the learner's lean setup
need to know of a family. Adding a family is its adapter (rollout_worker/models/), this entry,
the config name and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath


@dataclass(frozen=True)
class Released:
    """One released checkpoint as the plan sizes it without its weights on disk: the keys of its
    transformer's and VAE's config.json that differ from the diffusers class defaults (copied
    from the hub repository's files, named in the entry's comment), and whether it runs two
    experts (Wan 2.2 A14B's high- and low-noise transformers)."""
    transformer: dict = field(default_factory=dict)
    vae: dict = field(default_factory=dict)
    two_experts: bool = False
    expand_timesteps: bool = False      # per-token timesteps; the I2V first frame is encoded alone


@dataclass(frozen=True)
class FamilySpec:
    adapter: str                        # "module:Class", a rollout_worker.models.base.VideoModel
    transformer: str                    # the diffusers transformer class (export, the plan)
    pipelines: dict[str, str]           # model.task -> the diffusers pipeline class ({}: none, the adapter is one)
    lora_targets: tuple[str, ...]       # its blocks' attention projections (diffusers module names)
    vae: str | None = None              # the diffusers VAE class (the plan probes it); None: pixel space
    # conditioning tensors per row, (tokens, width), from the released encoders' configs; None tokens:
    # the config's model.max_sequence_length
    text: tuple[tuple[int | None, int], ...] = ()
    image_states: tuple[int, int] | None = None  # image-encoder states (tokens, width) every row carries
    # frozen modules every rollout rank loads besides the transformer(s), in parameters (published sizes)
    frozen: dict[str, float] = field(default_factory=dict)
    cfg_in_one_forward: bool = True     # CFG's cond and uncond rows share a transformer forward
    lean_sharded: bool = True           # sharded learner ranks build it on meta and read their own rows
    needs_path: bool = True             # model.path must name a checkpoint (the toy ships its own weights
                                        # and pipeline: no diffusers base to link or load)
    expert_boundary: bool = False       # two experts switch at model_index.json's boundary_ratio (Wan 2.2)
    lora_on_transformer: bool = False   # diffusers' pipeline has no load_lora_weights; its transformer does
    draws_trails: bool = False          # the before/after grid draws the toy square's path (what its rewards score)
    # --- what `vgrpo plan` needs of the architecture (cluster/plan/) ---
    planned: bool = True                # `vgrpo plan` sizes it (the toy is not sized)
    joint_text: bool = False            # text (and image) tokens join the video tokens in self-attention;
                                        # False: the video attends to them by cross-attention
    vae_fp32: bool = False              # the VAE always loads in fp32, whatever model.dtype
    i2v_encodes_clip: bool = False      # I2V encodes the first frame padded to the whole clip
    # peak VAE decode feature maps: channels at full resolution, frames per causal chunk (None: all
    # at once), tile size in pixels
    vae_decode: tuple[int, int | None, int] = (96, 4, 256)
    released: dict[str, Released] = field(default_factory=dict)  # hub id -> its sizes
    # transformer config keys per model.task when no checkpoint or release names the sizes
    task_transformer: dict[str, dict] = field(default_factory=dict)


# The released Wan checkpoints (their transformer/config.json and vae/config.json on the hub; the
# class defaults of WanTransformer3DModel are the 14B's, of AutoencoderKLWan Wan 2.1's VAE).
WAN_RELEASES = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": Released({"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": Released(),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": Released(two_experts=True),
    # [x, mask, condition] = 16 + 4 + 16 input channels
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": Released({"in_channels": 36}, two_experts=True),
    # one 5B transformer (3072 wide, 30 blocks) over the Wan 2.2 VAE: 48 latent channels, 16x spatial
    # (a 2x2 patchify inside the VAE), per-token timesteps. Its 48 latents_mean/std are not sizes.
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": Released(
        {"num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48, "out_channels": 48},
        {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True, "in_channels": 12,
         "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4},
        expand_timesteps=True),
}
# HunyuanVideo 1.5's 480p checkpoints are the class defaults of its transformer and VAE.
HUNYUAN15_RELEASES = {
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v": Released(),
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v": Released(),
}

FAMILIES: dict[str, FamilySpec] = {
    "toy": FamilySpec("rollout_worker.models.toy:ToyVideoModel", "WanTransformer3DModel", {},
                      ("to_q", "to_k", "to_v", "to_out.0"), lean_sharded=False, needs_path=False,
                      draws_trails=True, planned=False),
    # Wan 2.x: UMT5-XXL text encoder (d_model 4096) and the Wan VAE
    "wan": FamilySpec("rollout_worker.models.wan:WanVideoModel", "WanTransformer3DModel",
                      {"t2v": "WanPipeline", "i2v": "WanImageToVideoPipeline"},
                      ("to_q", "to_k", "to_v", "to_out.0"), vae="AutoencoderKLWan", text=((None, 4096),),
                      frozen={"text_encoder": 5.7e9, "vae (fp32)": 0.127e9}, expert_boundary=True,
                      vae_fp32=True, i2v_encodes_clip=True, vae_decode=(96, 4, 256),
                      released=WAN_RELEASES, task_transformer={"i2v": {"in_channels": 36}}),
    # HunyuanVideo 1.5: Qwen2.5-VL-7B text model (hidden 3584), ByT5 glyph encoder (256 tokens of
    # 1472), SigLIP image states (729 of 1152); its guidance runs cond and uncond apart
    "hunyuan15": FamilySpec("rollout_worker.models.hunyuan15:Hunyuan15VideoModel",
                            "HunyuanVideo15Transformer3DModel",
                            {"t2v": "HunyuanVideo15Pipeline", "i2v": "HunyuanVideo15ImageToVideoPipeline"},
                            ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                             "to_add_out"),
                            vae="AutoencoderKLHunyuanVideo15", text=((None, 3584), (256, 1472)),
                            image_states=(729, 1152), cfg_in_one_forward=False, lora_on_transformer=True,
                            frozen={"text_encoder": 7.6e9, "text_encoder_2": 0.22e9, "image_encoder": 0.4e9,
                                    "vae": 0.33e9},
                            joint_text=True, vae_decode=(128, None, 256), released=HUNYUAN15_RELEASES),
}


def family_of(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise ValueError(f"model.family = {name!r} is not declared; use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def release_of(family: str, path: str | None) -> Released | None:
    """The released checkpoint `model.path` names: its hub id, or a local folder of the same name
    (a download not yet on this machine); None for anything else."""
    if not path:
        return None
    releases = family_of(family).released
    if path in releases:
        return releases[path]
    name = PurePosixPath(str(path).rstrip("/")).name
    return next((r for hub, r in releases.items() if PurePosixPath(hub).name == name), None)

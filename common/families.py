"""Model families as declarations: one `FamilySpec` per `model.family`.

Pure data (and a lazy path to the adapter, imported only when a model is built, as the scorers'
are): what model building, LoRA, export, the plan, the preflight and the learner's lean setup
need to know of a family. Adding a family is its adapter (rollout_worker/models/), this entry,
the config name and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


FAMILIES: dict[str, FamilySpec] = {
    "toy": FamilySpec("rollout_worker.models.toy:ToyVideoModel", "WanTransformer3DModel", {},
                      ("to_q", "to_k", "to_v", "to_out.0"), lean_sharded=False, needs_path=False,
                      draws_trails=True),
    # Wan 2.x: UMT5-XXL text encoder (d_model 4096) and the Wan VAE
    "wan": FamilySpec("rollout_worker.models.wan:WanVideoModel", "WanTransformer3DModel",
                      {"t2v": "WanPipeline", "i2v": "WanImageToVideoPipeline"},
                      ("to_q", "to_k", "to_v", "to_out.0"), vae="AutoencoderKLWan", text=((None, 4096),),
                      frozen={"text_encoder": 5.7e9, "vae (fp32)": 0.127e9}, expert_boundary=True),
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
                                    "vae": 0.33e9}),
}


def family_of(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise ValueError(f"model.family = {name!r} is not declared; use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]

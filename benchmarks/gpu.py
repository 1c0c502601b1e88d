"""`--gpu` sizing for the benchmarks: small Wan 2.2 and HunyuanVideo 1.5 transformers on CUDA.

The CPU benchmarks use 1-layer, 2×8-head transformers where fixed costs dominate. On a GPU the
same benchmarks run with "small" transformers of the real classes (4 layers of Wan 2.1-1.3B
width: 12 heads × 128; HunyuanVideo 1.5: 16 heads × 128) over 33-frame videos, so the
transformer dominates as it does in production. Text encoders and VAEs stay tiny: the ratios
are about the sampler's and learner's overhead around the transformer, not the encoders.
Weights are random; no checkpoint is downloaded.
"""

from __future__ import annotations

import sys

import torch

# the videos the --gpu benchmarks generate. The tiny VAEs compress less than the real ones
# (Wan 8×/4×, HunyuanVideo 1.5 4×/2× here vs 16×/4×), so sizes are picked for ~4-6k tokens.
WAN_VIDEO = {"num_frames": 33, "height": 240, "width": 416}       # 9 × 15 × 26 = 3510 tokens
HUNYUAN_VIDEO = {"num_frames": 25, "height": 64, "width": 112}    # 13 × 16 × 28 = 5824 tokens
WAN_SMALL = {"num_layers": 4, "num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960}
HUNYUAN_SMALL = {"num_layers": 4, "num_refiner_layers": 1, "num_attention_heads": 16, "attention_head_dim": 128}


def require_cuda(flag: str = "--gpu") -> torch.device:
    """The CUDA device, or exit with one clear line saying why there is none."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        print(f"error: {flag}: CUDA is not available on this machine (torch {torch.__version__}, "
              f"CUDA build {built}); run the benchmarks without {flag}", file=sys.stderr)
        raise SystemExit(2)
    return torch.device("cuda", 0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wan22_small_transformer(seed: int = 0, in_channels: int = 4, out_channels: int = 4):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), in_channels=in_channels, out_channels=out_channels, text_dim=16, freq_dim=256,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024, **WAN_SMALL).eval()


def wan22_small_components() -> dict:
    """Wan 2.2 T2V-A14B's structure (two experts, boundary 0.875) at small width and depth."""
    from rollout_worker.models.tiny import tiny_wan_components

    comps = tiny_wan_components("t2v_a14b")
    comps["transformer"] = wan22_small_transformer(0)
    comps["transformer_2"] = wan22_small_transformer(1)
    comps["boundary_ratio"] = 0.875
    return comps


def hunyuan15_small_transformer(task: str = "t2v"):
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, mlp_ratio=4.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
        text_embed_2_dim=16, image_embed_dim=12, rope_axes_dim=(16, 56, 56), target_size=16, task_type=task,
        **HUNYUAN_SMALL).eval()


def hunyuan15_small_components(task: str = "t2v") -> dict:
    from rollout_worker.models.tiny import tiny_hunyuan15_components

    comps = tiny_hunyuan15_components(task)
    comps["transformer"] = hunyuan15_small_transformer(task)
    return comps


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def save_wan22_small(path: str) -> str:
    """A diffusers-format small Wan 2.2 checkpoint in `path`, loadable by model.family=wan."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    WanPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **wan22_small_components()).save_pretrained(path)
    return path


def wan22_small_overrides(path: str) -> list[str]:
    """Dotted overrides that put a config on the small Wan 2.2 in `path`, in bf16, at WAN_VIDEO."""
    v = WAN_VIDEO
    return ["model.family=wan", f"model.path={path}", "model.dtype=bfloat16", "model.boundary_ratio=0.875",
            f"model.num_frames={v['num_frames']}", f"model.height={v['height']}", f"model.width={v['width']}",
            "model.max_sequence_length=32", "model.guidance_scale=4.0"]

"""HunyuanVideo 1.5's joint attention: the memory a forward adds with diffusers' dense S×S mask,
with the key-mask processor, and with the adapter's unpadded inputs (no mask), side by side.

`python -m benchmarks.hunyuan_attention_memory` builds a 2-block HunyuanVideo15Transformer3DModel
(width 16) and runs one no-grad T2V forward of one row at 6400 video tokens with the encoders'
padded lengths (1000 Qwen, 256 ByT5, 729 image tokens; 40 valid prompt tokens), each mode in a
fresh process; it prints each mode's resident-memory rise during the forward and its ratio to
diffusers'. The mask's S² bytes dominate at this width, as they do at 480p (S ≈ 35k).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

MODES = ("diffusers", "key mask", "unpadded")


def _one(mode: str) -> dict:
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    from rollout_worker.models.hunyuan15 import _without_padding
    from rollout_worker.models.hunyuan15_attention import use_key_mask_attention

    torch.set_num_threads(1)
    torch.manual_seed(0)
    t = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
        text_embed_2_dim=16, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v").eval()
    text = {"encoder_hidden_states": torch.randn(1, 1000, 16),
            "encoder_attention_mask": torch.cat([torch.ones(1, 40), torch.zeros(1, 960)], 1),
            "encoder_hidden_states_2": torch.randn(1, 256, 16), "encoder_attention_mask_2": torch.zeros(1, 256)}
    image = torch.zeros(1, 729, 12)
    if mode != "diffusers":
        use_key_mask_attention(t)
    if mode == "unpadded":
        text, image = _without_padding(text, image, "t2v")
    x = torch.randn(1, 9, 4, 40, 40)
    tokens = 6400 + text["encoder_hidden_states"].shape[1] + text["encoder_hidden_states_2"].shape[1] + image.shape[1]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        t(hidden_states=x, timestep=torch.tensor([700.0]), image_embeds=image, return_dict=False, **text)
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"mode": mode, "tokens": tokens, "rise_mib": rise / 2**20}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(_one(sys.argv[1])))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed blocks leave RSS
    rows = [json.loads(subprocess.run([sys.executable, "-m", "benchmarks.hunyuan_attention_memory", m],
                                      capture_output=True, text=True, env=env, check=True).stdout.splitlines()[-1])
            for m in MODES]
    ref = rows[0]["rise_mib"]
    for r in rows:
        print(f"{r['mode']:<10} S = {r['tokens']:>5}  forward adds {r['rise_mib']:7.1f} MiB  "
              f"({r['rise_mib'] / ref:.3f} of diffusers')")


if __name__ == "__main__":
    main()

"""How the transformers' kernels run: the attention backend (`model.attention_backend`) and
regional compilation of their blocks (`model.compile`). Both act on `VideoModel.transformers()`,
the same way in the sampler and the learner, so both sides compute the same velocities.

The backend packages are CUDA-only; nothing here imports them, it only asks whether they are
installed, so a missing one is refused in one line where the model is built.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from common.config import ConfigError, ModelConfig

# model.attention_backend → diffusers' AttentionBackendName, and the package each one needs
DIFFUSERS_BACKEND = {"native": "native", "flash": "flash", "flash3": "_flash_3", "sage": "sage"}
PACKAGE = {"flash": ("flash_attn", "flash-attn"), "flash3": ("flash_attn_interface", "flash-attn 3 (hopper/ build)"),
           "sage": ("sageattention", "sageattention")}


def check_backend(name: str) -> None:
    """Refuse a backend whose package is not installed in this process (one line)."""
    if name not in DIFFUSERS_BACKEND:
        raise ConfigError(f"model.attention_backend = {name!r} is not one of {', '.join(DIFFUSERS_BACKEND)}")
    if name in PACKAGE:
        module, pip = PACKAGE[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"model.attention_backend = {name!r} needs the {pip} package ({module}), which is "
                              "not installed here; install it on the GPU workers or use native")


def configure_kernels(transformers: list[nn.Module], cfg: ModelConfig) -> None:
    """Set the attention backend and compile the blocks of each transformer, as `cfg` asks.

    `native` leaves diffusers' default dispatch (torch SDPA) untouched. Compilation is regional
    (diffusers' compile_repeated_blocks: each block compiled in place, parameter names kept, so
    state dicts and weight payloads are unchanged); it runs lazily at the first forward."""
    for t in transformers:
        if cfg.attention_backend != "native" and type(t).__name__ == "HunyuanVideo15Transformer3DModel":
            # its joint attention always masks the text padding; diffusers' flash and sage kernels take no mask
            raise ConfigError(f"model.attention_backend = {cfg.attention_backend!r}: HunyuanVideo 1.5's attention is "
                              "masked, which diffusers' flash and sage kernels refuse; use native")
    check_backend(cfg.attention_backend)
    for t in transformers:
        if cfg.attention_backend != "native":
            t.set_attention_backend(DIFFUSERS_BACKEND[cfg.attention_backend])
        if cfg.compile:
            t.compile_repeated_blocks()

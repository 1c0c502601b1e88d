"""model.attention_backend and model.compile on the tiny real Wan transformer (CPU).

A backend whose package is missing is refused in one line naming the field; `native` leaves
diffusers' dispatch as it is; compiled blocks give the eager velocity and gradients.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from common.config import ConfigError, ModelConfig
from rollout_worker.models.kernels import PACKAGE
from rollout_worker.models.tiny import tiny_wan_components
from rollout_worker.models.wan import WanVideoModel

MC = dict(family="wan", num_frames=5, height=32, width=32, guidance_scale=2.0, max_sequence_length=8)


def _model(**kw) -> WanVideoModel:
    return WanVideoModel.from_components(tiny_wan_components("t2v"), ModelConfig(**MC, **kw))


@pytest.mark.parametrize("backend", sorted(PACKAGE))
def test_a_backend_without_its_package_is_one_line(backend):
    if importlib.util.find_spec(PACKAGE[backend][0]) is not None:
        pytest.skip(f"{PACKAGE[backend][0]} is installed here")
    with pytest.raises(ConfigError) as e:
        _model(attention_backend=backend)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"model.attention_backend = {backend!r} needs")


@pytest.mark.parametrize("backend", sorted(PACKAGE))
def test_hunyuan15_refuses_a_kernel_without_masks(backend):
    from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel
    from rollout_worker.models.tiny import tiny_hunyuan15_components

    mc = ModelConfig(family="hunyuan15", num_frames=5, height=16, width=16, attention_backend=backend)
    with pytest.raises(ConfigError, match=rf"model.attention_backend = '{backend}': HunyuanVideo 1.5's attention "
                                          "is masked") as e:
        Hunyuan15VideoModel.from_components(tiny_hunyuan15_components(), mc)
    assert "\n" not in str(e.value)


def test_native_leaves_the_dispatch_as_it_is():
    model = _model(attention_backend="native")
    processors = [m.processor for m in model.transformer.modules() if hasattr(m, "processor")]
    assert processors and all(p._attention_backend is None for p in processors)


def _velocity_and_grads(model: WanVideoModel):
    cond = model.encode(["a red cat", "a blue dog"])
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    v = model.velocity(x, torch.tensor([0.7, 0.3]), cond)
    v.square().mean().backward()
    return v.detach(), {n: p.grad for n, p in model.transformer.named_parameters() if p.grad is not None}


@pytest.mark.timeout(900)
def test_compiled_blocks_give_the_eager_velocity_and_gradients():
    eager, compiled = _model(), _model(compile=True)
    assert all(b._compiled_call_impl is not None for b in compiled.transformer.blocks)
    assert list(compiled.transformer.state_dict()) == list(eager.transformer.state_dict())  # names kept
    v1, g1 = _velocity_and_grads(eager)
    try:
        v2, g2 = _velocity_and_grads(compiled)
    except Exception as e:  # inductor needs a working C++ toolchain
        if type(e).__name__ in ("BackendCompilerFailed", "InductorError", "CppCompileError"):
            pytest.skip(f"torch.compile cannot build on this machine: {str(e).splitlines()[0]}")
        raise
    torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5)
    assert set(g2) == set(g1) and len(g1) > 10
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["wan", "hunyuan15"])
def test_the_learners_transformer_only_build_gets_the_kernels_too(family):
    """The learner builds the transformer(s) alone (parts="transformer"); it must run the same
    kernels as the sampler, or the two sides' velocities could differ."""
    from rollout_worker.models.hunyuan15 import Hunyuan15VideoModel
    from rollout_worker.models.tiny import tiny_hunyuan15_components

    if family == "wan":
        cls, comps, mc = WanVideoModel, tiny_wan_components("t2v"), dict(MC)
    else:
        cls, comps = Hunyuan15VideoModel, tiny_hunyuan15_components()
        mc = dict(family="hunyuan15", num_frames=5, height=16, width=16)
    lean = cls.from_components(comps, ModelConfig(**mc, compile=True), parts="transformer")
    assert lean.components == "transformer"
    blocks = [m for t in lean.transformers() for m in t.modules() if m._compiled_call_impl is not None]
    assert blocks, "no block of the transformer-only build was compiled"
    if family == "hunyuan15":  # and the masked-attention refusal holds there as well
        with pytest.raises(ConfigError, match="HunyuanVideo 1.5's attention is masked"):
            cls.from_components(tiny_hunyuan15_components(), ModelConfig(**mc, attention_backend="flash"),
                                parts="transformer")

"""The LoRA adapter's initial lora_A comes from a seed (the learner: train.seed), not from torch's
global RNG, whose state differs per process: without it two runs of one config diverge after
their first optimizer step (found by `vgrpo compare --parallel`'s determinism test)."""

from __future__ import annotations

import pytest
import torch

from common.config import load_config
from learner.trainer import Trainer
from rollout_worker.models import build_model
from rollout_worker.models.lora import inject_lora, lora_targets


def _lora_a(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if ".lora_A." in n}


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    cfg = load_config(None, ["model.family=toy"])
    m = build_model(cfg).trainable_module()
    torch.manual_seed(seed + 1000)  # whatever the global RNG holds must not matter
    return _lora_a(inject_lora(m, cfg.model.family, cfg.optim, seed=seed))


def test_lora_a_comes_from_the_seed_and_leaves_the_global_rng_alone():
    a, b, c = _adapter(3), _adapter(3), _adapter(4)
    assert a and a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(a[k].abs().sum() > 0 for k in a)           # really initialized, not zeros
    assert not all(torch.equal(a[k], c[k]) for k in a)    # another seed, another init
    cfg = load_config(None, ["model.family=toy"])
    m = build_model(cfg).trainable_module()
    torch.manual_seed(7)
    state = torch.get_rng_state()
    inject_lora(m, cfg.model.family, cfg.optim, seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_learner_seeds_its_adapter_with_train_seed():
    for seed in (3, 4):
        cfg = load_config(None, ["model.family=toy", "optim.finetune=lora", f"train.seed={seed}"])
        torch.manual_seed(99 + seed)
        tr = Trainer(cfg, build_model(cfg)).setup()
        got = _lora_a(tr.policy.module)
        want = _adapter(seed)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_adapter_is_peft_lora_linear_module_for_module_value_for_value(dtype):
    """Held to peft itself (peft 0.21, `inject_adapter_in_model` with LoraConfig(r, lora_alpha,
    target_modules, lora_dropout=0, init_lora_weights=True)) on diffusers' Wan transformer: the
    same state-dict keys, the same initial values from the same seed (then widened to fp32, as
    inject_lora does after peft), the same trainable set, and the same forward, bit for bit, once
    B is non-zero."""
    from helpers_tiny import TEXT_DIM, tiny_wan
    from peft import LoraConfig, inject_adapter_in_model

    cfg = load_config(None, ["model.family=wan", "optim.lora_rank=4", "optim.lora_alpha=8"])
    targets = lora_targets("wan", cfg.optim)
    ours = inject_lora(tiny_wan(1, layers=2).to(dtype), "wan", cfg.optim, seed=5)
    theirs = tiny_wan(1, layers=2).to(dtype)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        theirs = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                                    init_lora_weights=True), theirs, adapter_name="default")
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b) and any(".lora_A.default." in k for k in a)
    for k in a:
        want = b[k].float() if ".lora_" in k else b[k]
        assert a[k].dtype == want.dtype and torch.equal(a[k], want), k
    assert ({n for n, p in ours.named_parameters() if p.requires_grad}
            == {n for n, p in theirs.named_parameters() if p.requires_grad})
    g = torch.Generator().manual_seed(0)
    for m in (ours, theirs):  # the same non-zero B in both, and peft's adapters widened as ours
        for n, p in m.named_parameters():
            if ".lora_" in n:
                p.data = p.data.float()
            if ".lora_B." in n:
                p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1
    x = torch.randn(1, 3, 2, 4, 4, generator=g).to(dtype)
    text = torch.randn(1, 4, TEXT_DIM, generator=g).to(dtype)
    t = torch.tensor([500.0])
    with torch.no_grad():
        got = ours(x, t, text, return_dict=False)[0]
        want = theirs(x, t, text, return_dict=False)[0]
    assert got.dtype == dtype and torch.equal(got, want)
    assert not torch.equal(got, tiny_wan(1, layers=2).to(dtype)(x, t, text, return_dict=False)[0])

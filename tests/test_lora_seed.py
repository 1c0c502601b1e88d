"""The LoRA adapter's initial lora_A comes from a seed (the learner: train.seed), not from torch's
global RNG, whose state differs per process: without it two runs of one config diverge after
their first optimizer step (found by `vgrpo compare --parallel`'s determinism test)."""

from __future__ import annotations

import torch

from common.config import load_config
from learner.trainer import Trainer
from rollout_worker.models import build_model
from rollout_worker.models.lora import inject_lora


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

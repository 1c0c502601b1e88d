"""The reference Trainer on a tiny Wan transformer: ratio check, KL facts, J_align's sign,
rank splitting, the weights payload round trip and checkpoint resume."""

from __future__ import annotations

import pytest
import torch
from helpers_tiny import TinyVideoModel, sample_group

from common.config import RunConfig
from common.sde import log_prob
from common.types import Condition, TrainBatch
from learner import checkpoint
from learner.losses import LossConfig, compute_loss
from learner.rows import build_rows, micro_batches
from learner.trainer import Trainer
from rollout_worker.models.lora import inject_lora


def _cfg(**sections) -> RunConfig:
    base = {"optim": {"micro_batch": 5, "lr": 1e-2, "lora_rank": 4}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return RunConfig.model_validate(base)


def _batch(model, seed: int, groups: int = 2, version: int = 0) -> TrainBatch:
    fresh = []
    for c in range(groups):
        g = sample_group(model, Condition(f"c{c}", f"prompt {c}"), group_size=3, seed=seed + c,
                         version=version)
        g.composite = torch.stack([t.final_latents[0].mean() for t in g.members])  # [G]
        fresh.append(g)
    return TrainBatch(fresh)


def _kl_terms(tr: Trainer, rows) -> tuple[float, float]:
    mb = next(micro_batches(rows, rows.n))
    cond = tr.conditions(rows).index(mb.cond_idx)
    av = tr.policy.anchor_velocity("moving", mb.x, mb.sigma, cond)
    with torch.no_grad():
        _, s = compute_loss(mb, cond, tr.policy.velocity, rows.scheme, tr.method.loss_cfg, 1.0, rows.n,
                            rows.n_align, av)
    return float(s["kl/d_anchor"]), float(s["kl/d_step"])


def test_ratio_is_one_on_fresh_on_policy_data():
    model = TinyVideoModel()
    tr = Trainer(_cfg(), model).setup()
    for step in range(3):  # also after updates: the batch comes from the current weights
        st = tr.train_step(_batch(model, seed=10 * step, version=tr.version))
        assert st["logratio_first_absmax"] < 1e-5
        assert abs(st["ratio_mean"] - 1.0) < 1e-5 and st["clipfrac"] == 0.0
        assert st["grad_norm"] > 0
    assert tr.version == 3


def test_kl_terms_zero_at_anchor_and_quadratic_in_perturbation():
    model = TinyVideoModel()
    tr = Trainer(_cfg(kl={"d_step": "exact", "strategy": "dual"}), model).setup()
    rows = build_rows(_batch(model, seed=0), tr.cfg)
    d_anchor, d_step = _kl_terms(tr, rows)
    # D_step compares with the sampler's recorded μ_old: the same weights, but the sampler's batch
    # shape rounds the velocity differently by an ulp, hence ≈1e-14 rather than 0
    assert d_anchor == 0.0 and d_step < 1e-12
    base = tr.policy.snapshot()
    gen = torch.Generator().manual_seed(1)
    direction = {n: torch.randn(p.shape, generator=gen) for n, p in base.items()}

    def at(delta):
        with torch.no_grad():
            for n, p in tr.policy.params.items():
                p.copy_(base[n] + delta * direction[n])
        return _kl_terms(tr, rows)

    (a1, s1), (a2, s2) = at(1e-3), at(2e-3)
    assert a1 > 0 and s1 > 0
    assert abs(a2 / a1 - 4.0) < 0.1 and abs(s2 / s1 - 4.0) < 0.1


def test_align_gradient_step_raises_winner_log_prob():
    model = TinyVideoModel()
    tr = Trainer(_cfg(), model).setup()
    rows = build_rows(_batch(model, seed=3, groups=1), tr.cfg)
    mb = next(micro_batches(rows, rows.n))
    mb.adv.zero_()          # no policy-gradient term: the loss is γ·J_align alone
    mb.a_neg.zero_()        # only the winner's term
    cond = tr.conditions(rows).index(mb.cond_idx)
    lc = LossConfig(1e-4, "none", 1.0, 0.1, "k1", gamma=1.0, align_form="loglik")
    std = rows.scheme.std(mb.sigma, mb.sigma_next)

    def winner_logp():
        with torch.no_grad():
            mu = rows.scheme.mean(mb.x, tr.policy.velocity(mb.x, mb.sigma, cond), mb.sigma, mb.sigma_next)
            return float(log_prob(mb.x_pos, mu, std).mean())

    before = winner_logp()
    loss, _ = compute_loss(mb, cond, tr.policy.velocity, rows.scheme, lc, 0.0, rows.n, rows.n_align)
    assert loss.item() != 0.0
    loss.backward()
    with torch.no_grad():
        for p in tr.policy.trainable_parameters():
            p -= 1e-1 * p.grad
    assert winner_logp() > before


def test_rank_shares_sum_to_the_full_batch_gradient():
    model = TinyVideoModel()
    tr = Trainer(_cfg(), model).setup()
    tr.train_step(_batch(model, seed=0))  # make the LoRA B non-zero so every grad is informative
    rows = build_rows(_batch(model, seed=5), tr.cfg)
    cond_all = tr.conditions(rows)
    params = tr.policy.trainable_parameters()

    def grads(size, world):
        for p in params:
            p.grad = None
        for r in range(world):
            for mb in micro_batches(rows, size, r, world):
                loss, _ = tr.method.micro_loss(tr, rows, mb, cond_all, lam_kl=1e-3, pi0=False)
                loss.backward()
        return torch.cat([p.grad.flatten() for p in params])

    full = grads(rows.n, 1)
    assert full.abs().sum() > 0
    assert torch.allclose(grads(4, 2), full, atol=1e-6, rtol=1e-4)
    assert torch.allclose(grads(1, 3), full, atol=1e-6, rtol=1e-4)


def test_lora_payload_round_trip_onto_fresh_model():
    model = TinyVideoModel(seed=0)
    tr = Trainer(_cfg(), model).setup()
    for s in range(2):
        tr.train_step(_batch(model, seed=s))
    payload = tr.weights_payload()
    assert payload and all(".lora_" in k for k in payload)
    fresh = TinyVideoModel(seed=0)
    inject_lora(fresh.transformer, "wan", tr.cfg.optim)
    x, sig = torch.randn(2, *model.latent_shape), torch.tensor([0.9, 0.4])
    cond = model.encode(["a", "b"])
    with torch.no_grad():
        untrained = fresh.velocity(x, sig, cond)
        fresh.load_weights(payload)
        want = tr.policy.velocity(x, sig, cond)
        assert not torch.allclose(untrained, want, atol=1e-5)
        assert torch.allclose(fresh.velocity(x, sig, cond), want, atol=1e-6)


def test_full_finetune_payload_round_trip():
    model = TinyVideoModel(seed=0)
    tr = Trainer(_cfg(optim={"finetune": "full", "lr": 1e-3}), model).setup()
    tr.train_step(_batch(model, seed=0))
    fresh = TinyVideoModel(seed=0)
    fresh.load_weights(tr.weights_payload())
    x, sig, cond = torch.randn(1, *model.latent_shape), torch.tensor([0.5]), model.encode(["a"])
    with torch.no_grad():
        assert torch.equal(fresh.velocity(x, sig, cond), tr.policy.velocity(x, sig, cond))


def test_resume_from_checkpoint_gives_the_same_next_loss(tmp_path):
    cfg = _cfg(kl={"schedule": "adaptive", "d_step": "exact", "anchor_period": 2, "lam": 1e-6,
                   "lam_high": 1.0, "target": 1e-9},
               train={"keep_checkpoints": 2})
    data_model = TinyVideoModel(seed=7)
    batches = [_batch(data_model, seed=s) for s in range(4)]

    a = Trainer(cfg, TinyVideoModel(seed=0)).setup()
    for b in batches[:3]:
        a.train_step(b)
    for i in range(3):  # retention: only the newest two survive
        path = a.save_checkpoint(tmp_path, extra={"cursor": 3 + i, "bank_watermark": 17})
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000003"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    want = a.train_step(batches[3])
    a.save_checkpoint(tmp_path, extra={})
    assert len(checkpoint.list_checkpoints(tmp_path)) == 2

    b = Trainer(cfg, TinyVideoModel(seed=0)).setup()
    extra = b.load_checkpoint(path)
    assert extra == {"cursor": 5, "bank_watermark": 17} and b.version == 3
    got = b.train_step(batches[3])
    assert want["kl/d_anchor"] > 0 and want["kl/lambda"] > 1e-6  # anchors and λ state matter here
    for k in ("loss", "loss/policy", "loss/kl", "loss/align", "kl/d_anchor", "kl/d_step", "kl/lambda"):
        assert got[k] == want[k], k
    for n, p in a.policy.params.items():
        assert torch.equal(p, b.policy.params[n]), n


def test_activation_checkpointing_gives_the_same_step():
    """model.gradient_checkpointing recomputes block activations in backward: same loss and grads."""
    data = TinyVideoModel(seed=7)
    batch = _batch(data, seed=0)
    runs, calls = {}, {}
    for ckpt in (False, True):
        model = TinyVideoModel(seed=0, layers=2)
        tr = Trainer(_cfg(model={"gradient_checkpointing": ckpt}), model).setup()
        assert model.transformer.gradient_checkpointing is ckpt
        n = calls[ckpt] = [0]
        model.transformer.blocks[0].ffn.register_forward_hook(lambda *_, n=n: n.__setitem__(0, n[0] + 1))
        runs[ckpt] = (tr.train_step(batch), tr.weights_payload())
    assert calls[True][0] > calls[False][0]  # the block's layers ran again in backward
    (a, wa), (b, wb) = runs[False], runs[True]
    for k in ("loss", "loss/policy", "loss/kl", "loss/align", "grad_norm"):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-9), k
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-7)


def test_ema_payload_is_torch_averagedmodel_of_the_trained_weights(tmp_path):
    """optim.ema_decay: the exported weights are the moving average torch's own AveragedModel keeps
    with the same decay schedule (min(d, (1+t)/(10+t)) after step t), not the live weights; the
    live weights still train and sample, and a checkpoint resumes the average."""
    from torch.optim.swa_utils import AveragedModel

    decay = 0.8
    model = TinyVideoModel(seed=0)
    tr = Trainer(_cfg(optim={"ema_decay": decay}), model).setup()
    names = list(tr.policy.params)

    def avg_fn(avg, new, n_averaged):  # n_averaged updates so far, counting the copy at setup
        d = min(decay, (1.0 + n_averaged) / (10.0 + n_averaged))
        return d * avg + (1 - d) * new

    ref = AveragedModel(tr.policy.module, avg_fn=avg_fn, use_buffers=False)  # copies π0 on the first update
    ref.update_parameters(tr.policy.module)
    for s in range(4):
        tr.train_step(_batch(model, seed=s))
        ref.update_parameters(tr.policy.module)
    averaged = dict(ref.module.named_parameters())
    live, ema = tr.weights_payload(), tr.weights_payload(ema=True)
    assert set(ema) == set(live) and all(".lora_" in k for k in ema)
    for n in names:
        assert torch.allclose(ema[n], averaged[n], atol=1e-7, rtol=1e-6), n
    moved = [n for n in names if not torch.equal(ema[n], live[n])]
    assert moved, "the average must lag the live weights"
    assert torch.equal(tr.weights_payload()[names[0]], live[names[0]])  # the swap put the live ones back

    tr.save_checkpoint(tmp_path, extra={})
    back = Trainer(tr.cfg, TinyVideoModel(seed=0)).setup()
    back.load_checkpoint(tmp_path)
    assert all(torch.equal(back.weights_payload(ema=True)[n], ema[n]) for n in names)
    assert all(torch.equal(back.weights_payload()[n], live[n]) for n in names)


def test_ema_off_exports_the_live_weights():
    model = TinyVideoModel(seed=0)
    tr = Trainer(_cfg(), model).setup()
    tr.train_step(_batch(model, seed=0))
    assert not tr.exports_ema and "ema" not in tr.policy.anchors
    live = tr.weights_payload()
    assert all(torch.equal(v, live[k]) for k, v in tr.weights_payload(ema=True).items())


def test_turning_ema_on_at_a_resume_starts_the_average_at_the_resumed_weights(tmp_path):
    model = TinyVideoModel(seed=0)
    tr = Trainer(_cfg(), model).setup()
    tr.train_step(_batch(model, seed=0))
    tr.save_checkpoint(tmp_path, extra={})
    on = Trainer(_cfg(optim={"ema_decay": 0.9}), TinyVideoModel(seed=0)).setup()
    on.load_checkpoint(tmp_path)
    live = tr.weights_payload()
    assert all(torch.equal(on.weights_payload(ema=True)[k], v) for k, v in live.items())
    on.train_step(_batch(model, seed=1))  # and it moves from there
    assert any(not torch.equal(on.weights_payload(ema=True)[k], v) for k, v in live.items())


@pytest.mark.parametrize("sampled,learner", [
    (["sde.scheme=flow", "sde.eta=0.9", "sde.flow_first_step=clamp", "sde.clamp_c=0.02"], []),
    (["sde.scheme=cps", "sde.eta=0.6", "sde.cps_log_prob=mse"], ["sde.scheme=cps", "sde.cps_log_prob=gaussian"]),
    (["sde.scheme=sage", "sde.eta=1.1", "sde.clamp_c=0.05"], []),
    (["sde.scheme=dance", "sde.eta=0.4"], ["sde.scheme=flow", "sde.flow_first_step=clamp"]),
])
def test_a_trajectory_is_replayed_with_its_own_scheme_not_the_learners_config(sampled, learner):
    """The rollout's config differs from the learner's in the scheme's arguments and the schedule:
    the learner replays each step with the trajectory's spec, so with unchanged weights log r is
    exactly 0 (the real sampler and the committed toy model, as in a run). Groups of 4: with 3 the
    toy model's forward rounds differently from the learner's batch by an ulp, whatever the scheme."""
    from common.config import load_config
    from common.sde import Schedule, scheme_from_config
    from rollout_worker.models.toy import ToyVideoModel
    from rollout_worker.sampler import sample_group as sample_toy_group
    from rollout_worker.sampler import transition_log_prob

    base = ["sampler.group_size=4", "grpo.per_head_advantages=false", "align.enabled=false"]
    rollout_cfg = load_config("configs/quickstart.yaml", [*base, "schedule.steps=5", "schedule.shift=2.0", *sampled])
    learner_cfg = load_config("configs/quickstart.yaml", [*base, *learner])   # 10 steps, shift 3
    model = ToyVideoModel.from_config(learner_cfg)
    groups = [sample_toy_group(model, Condition(f"c{i}", p), rollout_cfg, seed=7 + i, policy_version=0)
              for i, p in enumerate(["a red square moving left", "a blue square moving up"])]
    for g in groups:
        g.composite = torch.stack([t.final_latents[0].mean() for t in g.members])
    spec = groups[0].members[0].spec
    sched = Schedule.from_config(rollout_cfg.schedule)
    assert spec == scheme_from_config(rollout_cfg, sched).spec(sched) and spec.sigmas == sched.sigmas
    rows = build_rows(TrainBatch(groups), learner_cfg)
    assert rows.scheme.spec(sched) == spec
    # the learner's own config would not replay it: its scheme gives another log-prob
    t = groups[0].members[0]
    own = scheme_from_config(learner_cfg, Schedule.from_config(learner_cfg.schedule))
    with torch.no_grad():
        lp_own, _ = transition_log_prob(model, own, t.x[:1], t.x_next[:1], *sched.pair(t.step_indices[0]),
                                        model.encode([t.condition.prompt]))
    assert float((lp_own - t.logp_old[0]).abs()) > 1e-3
    st = Trainer(learner_cfg, model).setup().train_step(TrainBatch(groups))
    assert st["onpolicy_rows"] == rows.n > 0
    assert st["logratio_first_absmax"] == 0.0 and st["logratio_onpolicy_absmax"] == 0.0

"""DiffusionNFT (grpo.loss=nft): its loss against the paper's equations re-implemented here, its
normalised reward, its rows, the sampling policy v_old, ODE rollouts that record no step and are
stored as their final latents only, and DPM-Solver++(2M) against diffusers' own scheduler."""

from __future__ import annotations

import math

import pytest
import torch
from helpers_methods import (
    SHAPE,
    linear_velocity,
    method_cfg,
)
from helpers_tiny import TinyVideoModel

from common.config import ConfigError, RunConfig, load_config
from common.sde import ODE, Schedule
from common.types import Condition, Group, Scores, TrainBatch, Trajectory
from learner.nft import (
    NFTMicroBatch,
    build_nft_rows,
    nft_loss,
    normalised_reward,
)
from learner.trainer import Trainer
from memory_bank.codec import decode, encode
from memory_bank.errors import CorruptEntry
from memory_bank.tensorfile import dumps, loads
from rollout_worker.dpm import DPMSolver2M
from rollout_worker.sampler import sample_group

NFT = {"grpo": {"loss": "nft", "adv_std": "batch"}, "align": {"enabled": False}, "bank": {"enabled": False},
       "kl": {"strategy": "none"}, "sampler": {"shared_noise": False, "initial_noise": "group", "group_size": 4},
       "schedule": {"steps": 5, "shift": 3.0}}


def nft_cfg(**sections) -> RunConfig:
    return method_cfg(NFT, **sections)


# --- the loss against the paper's equations ----------------------------------------------------


def reference_nft_loss(x0, xt, sigma, r, v_theta, v_old, v_ref, beta, kl_w, adv_clip):
    """DiffusionNFT's objective written out per sample from its equations (docs/algorithm.md section 6b):
    v⁺ = (1-β)·v_old + β·v_θ, v⁻ = (1+β)·v_old - β·v_θ, x̂±_0 = x_t - t·v±, each squared error
    divided by the stop-gradient mean absolute error (adaptive weighting), mixed by r, over β,
    times the advantage clip, plus the KL weight times mean (v_θ - v_ref)²."""
    total = 0.0
    n = x0.shape[0]
    for i in range(n):
        vp = (1 - beta) * v_old[i].detach() + beta * v_theta[i]
        vn = (1 + beta) * v_old[i].detach() - beta * v_theta[i]
        terms = []
        for vv in (vp, vn):
            x0_hat = xt[i] - sigma[i] * vv
            err = x0_hat - x0[i]
            w = max(float(err.detach().abs().mean()), 1e-5)
            terms.append((err ** 2).mean() / w)
        total = total + (r[i] * terms[0] + (1 - r[i]) * terms[1]) / beta
    policy = adv_clip * total / n
    kl = sum(((v_theta[i] - v_ref[i].detach()) ** 2).mean() for i in range(n)) / n
    return policy + kl_w * kl


def test_nft_loss_and_gradient_match_the_papers_equations():
    g = torch.Generator().manual_seed(0)
    n = 6
    x0 = torch.randn(n, *SHAPE, generator=g)
    sigma = torch.tensor([1.0, 0.9, 0.7, 0.5, 0.3, 0.1])
    xt = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * torch.randn(n, *SHAPE, generator=g)
    r = torch.tensor([0.0, 0.2, 0.5, 0.7, 1.0, 0.4])
    W = (torch.eye(3) + 0.1 * torch.randn(3, 3, generator=g)).requires_grad_(True)
    b = (0.1 * torch.randn(3, generator=g)).requires_grad_(True)
    W_old, b_old = W.detach() + 0.05 * torch.randn(3, 3, generator=g), b.detach()
    W_ref, b_ref = W.detach() - 0.05 * torch.randn(3, 3, generator=g), b.detach() + 0.02
    nc = RunConfig.model_validate({"nft": {"beta": 0.3, "kl": 0.05}}).nft
    v_theta = linear_velocity(W, b)

    ref = reference_nft_loss(x0, xt, sigma, r, v_theta(xt, sigma), linear_velocity(W_old, b_old)(xt, sigma),
                             linear_velocity(W_ref, b_ref)(xt, sigma), 0.3, 0.05, 5.0)
    gW_ref, gb_ref = torch.autograd.grad(ref, [W, b])

    got = 0.0
    for part in (slice(0, 4), slice(4, 6)):  # two micro-batches, summed: the full-batch loss
        mb = NFTMicroBatch(x0=x0[part], xt=xt[part], sigma=sigma[part], r=r[part],
                           mask=torch.ones(len(r[part])), cond_idx=torch.zeros(len(r[part]), dtype=torch.long))
        loss, _ = nft_loss(mb, None, v_theta, linear_velocity(W_old, b_old)(mb.xt, mb.sigma), nc, 5.0, n,
                           linear_velocity(W_ref, b_ref)(mb.xt, mb.sigma))
        got = got + loss
    gW, gb = torch.autograd.grad(got, [W, b])
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert torch.allclose(gW, gW_ref, atol=1e-6) and torch.allclose(gb, gb_ref, atol=1e-6)
    assert gW.abs().max() > 1e-3  # a real gradient, not two zeros


def test_nft_gradient_vanishes_without_signal_and_points_toward_the_positive():
    """At θ = old and r = 1/2 the implicit policies' pulls cancel; r = 1 pulls v_θ toward the sample."""
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, *SHAPE, generator=g)
    sigma = torch.tensor([0.6, 0.4])
    xt = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * torch.randn(2, *SHAPE, generator=g)
    b = torch.zeros(3, requires_grad=True)
    W = torch.eye(3)
    nc = RunConfig().nft.model_copy(update={"kl": 0.0})
    for rv, zero in ((0.5, True), (1.0, False)):
        mb = NFTMicroBatch(x0, xt, sigma, torch.full((2,), rv), torch.ones(2), torch.zeros(2, dtype=torch.long))
        loss, _ = nft_loss(mb, None, linear_velocity(W, b), linear_velocity(W, b.detach())(xt, sigma), nc, 5.0, 2)
        (grad,) = torch.autograd.grad(loss, [b])
        assert (grad.abs().max() < 1e-6) == zero
    # r = 1: a step along -grad lowers the positive policy's x0 error
    mb = NFTMicroBatch(x0, xt, sigma, torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.long))
    loss, _ = nft_loss(mb, None, linear_velocity(W, b), linear_velocity(W, b.detach())(xt, sigma), nc, 5.0, 2)
    (grad,) = torch.autograd.grad(loss, [b])

    def x0_err(bias):
        v = linear_velocity(W, bias)(xt, sigma)
        return float(((xt - sigma.view(-1, 1, 1, 1, 1) * v - x0) ** 2).mean())
    assert x0_err(b.detach() - 1e-2 * grad) < x0_err(b.detach())


# --- rows: normalised reward, σ draws, noise ------------------------------------------------


def _group(cid: str, rewards: list[float], sigmas, seed: int) -> Group:
    cond = Condition(cid, f"prompt {cid}")
    g = torch.Generator().manual_seed(seed)
    members = [Trajectory(condition=cond, group_id=cid, member=i, seed=0, spec=ODE().spec(Schedule.explicit(sigmas)),
                          guidance_scale=1.0, policy_version=0, step_indices=[], x=None, x_next=None, logp_old=None,
                          final_latents=torch.randn(SHAPE, generator=g)) for i in range(len(rewards))]
    r = torch.tensor(rewards)
    return Group(cond, cid, 0, members, Scores(["h"], r.view(-1, 1)), r)


def test_nft_rows_normalise_rewards_with_the_batch_std_and_draw_distinct_sigmas():
    sigmas = list(Schedule.linear(10, 3.0).sigmas)
    cfg = RunConfig.model_validate({**NFT, "schedule": {"steps": 10, "shift": 3.0},
                                    "grpo": {**NFT["grpo"], "per_head_advantages": False}})
    groups = [_group("a", [1.0, 2.0, 3.0, 4.0], sigmas, 0), _group("b", [0.0, 0.0, 10.0, 2.0], sigmas, 1)]
    rows = build_nft_rows(TrainBatch(groups, version=3), cfg)
    n_t = int(10 * 0.99)                                   # its int(num_steps·timestep_fraction) = 9
    assert rows.n == 8 * n_t
    allr = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 10.0, 2.0], dtype=torch.float64)
    std = allr.std(unbiased=False)                         # global std, per-group mean
    want = []
    for grp in (allr[:4], allr[4:]):
        a = ((grp - grp.mean()) / (std + 1e-8)).clamp(-5, 5)
        want += [min(max(float(x) / 5 / 2 + 0.5, 0.0), 1.0) for x in a]
    assert torch.allclose(rows.r, torch.tensor(want).repeat_interleave(n_t), atol=1e-6)
    for i in range(8):                                     # n_t distinct σ of σ_0 … σ_{T-1} per member
        s = rows.sigma[i * n_t:(i + 1) * n_t].tolist()
        assert len(set(s)) == n_t and set(s) <= set(torch.tensor(sigmas[:-1]).tolist())
        x0 = groups[i // 4].members[i % 4].final_latents
        assert torch.equal(rows.x0[i * n_t], x0)
    eps = (rows.xt - (1 - rows.sigma.view(-1, 1, 1, 1, 1)) * rows.x0) / rows.sigma.view(-1, 1, 1, 1, 1)
    assert abs(float(eps.std()) - 1.0) < 0.1              # x_t = (1-σ)·x0 + σ·ε with ε ~ N(0, I)
    again = build_nft_rows(TrainBatch(groups, version=3), cfg)
    other = build_nft_rows(TrainBatch(groups, version=4), cfg)
    assert torch.equal(again.xt, rows.xt) and not torch.equal(other.xt, rows.xt)
    assert normalised_reward(torch.tensor([-7.0, 0.0, 2.5, 9.0]), 5.0).tolist() == [0.0, 0.5, 0.75, 1.0]


# --- the data path: ODE rollouts that record no step -------------------------------------------


def test_nft_rollouts_are_ode_record_no_step_and_store_only_final_latents():
    model = TinyVideoModel()
    cfg = nft_cfg(sampler={"post_solver": "dpm2"})
    g = sample_group(model, Condition("c", "a prompt"), cfg, seed=7, policy_version=0)
    m = g.members[0]
    assert m.step_indices == [] and m.x is None and m.x_next is None and m.logp_old is None
    assert m.spec == ODE().spec(Schedule.from_config(cfg.schedule)) and m.mu_old is None  # ODE throughout
    assert not torch.allclose(g.members[0].final_latents, g.members[1].final_latents)  # own noise each
    # the final latents are DPM-Solver++(2M) over the whole schedule from member 0's noise
    s = Schedule.from_config(cfg.schedule)
    x = model.initial_noise(4, torch.Generator().manual_seed(7))[0:1]
    cond, solver = model.encode(["a prompt"]), DPMSolver2M()
    for k in range(s.steps):
        x = solver.step(x, model.velocity(x, torch.tensor([s.sigmas[k]]), cond), *s.pair(k))
    assert torch.allclose(x[0], m.final_latents, atol=1e-5)
    # the bank stores the final latents and nothing of the SDE fields
    meta, blob = encode("0123456789abcdef0123456789abcdef", m, ["h"], torch.tensor([0.5]), 0.5, cond_key="f" * 32)
    assert set(loads(blob)) == {"final_latents"} and meta["step_indices"] == "[]"
    back = decode(meta, blob).trajectory
    assert back.x is None and back.logp_old is None and torch.equal(back.final_latents, m.final_latents)
    assert back.spec == m.spec and back.step_indices == []
    assert m.nbytes() == m.final_latents.numel() * 4 + m.frames.numel()
    # an entry without steps that carries step tensors anyway is corrupt
    with pytest.raises(CorruptEntry, match="without steps"):
        decode(meta, dumps({"final_latents": m.final_latents, "x": m.final_latents[None]}))


def test_dpm_solver_2m_matches_diffusers_dpmsolver_multistep():
    from diffusers import DPMSolverMultistepScheduler

    sch = DPMSolverMultistepScheduler(solver_order=2, algorithm_type="dpmsolver++", prediction_type="flow_prediction",
                                      use_flow_sigmas=True, flow_shift=3.0, final_sigmas_type="zero")
    sch.set_timesteps(8)
    sig = sch.sigmas.tolist()
    g = torch.Generator().manual_seed(0)
    A = 0.3 * torch.randn(4, 4, generator=g)

    def vel(x, s):
        return torch.tanh(x @ A) * (1 + s) + s

    x = y = torch.randn(2, 4, generator=g)
    solver = DPMSolver2M()
    for i, t in enumerate(sch.timesteps):
        x = sch.step(vel(x, sig[i]), t, x).prev_sample
        y = solver.step(y, vel(y, sig[i]), sig[i], sig[i + 1])
        assert torch.allclose(x, y, atol=1e-6), i
    # from σ = 1 (λ = -∞) the first step is Euler's, and the next one stays first order
    s0 = DPMSolver2M()
    z = torch.randn(2, 4, generator=g)
    v = vel(z, 1.0)
    z1 = s0.step(z, v, 1.0, 0.8)
    assert torch.allclose(z1, z - 0.2 * v)
    v1 = vel(z1, 0.8)
    lam = lambda s: math.log((1 - s) / s)  # noqa: E731
    first = (0.5 / 0.8) * z1 - 0.5 * math.expm1(lam(0.8) - lam(0.5)) * (z1 - 0.8 * v1)
    assert torch.allclose(s0.step(z1, v1, 0.8, 0.5), first, atol=1e-6)


# --- the trainer: a step, v_old, the payload the rollouts get, resume ------------------------


def test_nft_trainer_steps_moves_v_old_and_sends_it_to_the_rollouts(tmp_path):
    model = TinyVideoModel()
    cfg = nft_cfg(optim={"micro_batch": 7, "lr": 1e-2, "lora_rank": 4},
                  nft={"old_rate": 0.25, "old_max": 0.5, "kl": 1e-3})
    tr = Trainer(cfg, model).setup()
    assert {"old", "pi0"} <= set(tr.policy.anchors)

    def batch():
        fresh = []
        for c in range(2):
            grp = sample_group(model, Condition(f"c{c}", f"prompt {c}"), cfg, seed=10 * tr.version + c,
                               policy_version=tr.version)
            grp.composite = torch.stack([t.final_latents[0].mean() for t in grp.members])
            grp.scores = Scores(["h"], grp.composite.view(-1, 1))
            fresh.append(grp)
        return TrainBatch(fresh, version=tr.version)

    old0 = {n: t.clone() for n, t in tr.policy.anchors["old"].items()}
    live0 = {n: p.detach().clone() for n, p in tr.policy.params.items()}
    st = tr.train_step(batch())
    assert st["grad_norm"] > 0 and st["num_rows"] == 8 * 4 and "ratio_mean" not in st.values
    d = cfg.nft.old_decay(1)                                          # 0.25 after step 1
    for n, p in tr.policy.params.items():                             # v_old ← d·v_old + (1-d)·θ
        assert torch.allclose(tr.policy.anchors["old"][n], d * old0[n] + (1 - d) * p.detach(), atol=1e-6)
        assert not torch.equal(p.detach(), live0[n])
    tr.train_step(batch())
    sent = tr.weights_payload()                                      # what the rollouts sample with: v_old
    live = {k: v for k, v in tr.weights_payload(ema=True).items()}   # the exported policy: θ
    with tr.policy.swapped("old"):
        want = tr.policy.weights_payload()
    assert all(torch.equal(sent[k], want[k]) for k in sent)
    assert any(not torch.equal(sent[k], live[k]) for k in sent)
    # a resume restores v_old with the rest
    path = tr.save_checkpoint(tmp_path)
    tr2 = Trainer(cfg, TinyVideoModel()).setup()
    tr2.load_checkpoint(path)
    assert tr2.version == 2
    assert all(torch.equal(tr2.policy.anchors["old"][n], tr.policy.anchors["old"][n]) for n in tr.policy.params)


def test_nft_learns_a_fixed_reward_on_the_tiny_model():
    """The real sampler (ODE, DPM-2M) and the NFT trainer raise a latent statistic on fixed seeds."""
    model = TinyVideoModel(seed=0)
    cfg = nft_cfg(optim={"micro_batch": 32, "lr": 1e-2, "lora_rank": 8}, nft={"kl": 0.0},
                  sampler={"post_solver": "dpm2"}, schedule={"steps": 3, "shift": 1.0})
    tr = Trainer(cfg, model).setup()
    conds = [Condition(f"c{i}", f"prompt {i}") for i in range(2)]

    def reward(grp):
        return torch.stack([t.final_latents[0].mean() for t in grp.members])

    def evaluate() -> float:
        return float(torch.stack([reward(sample_group(model, c, cfg, seed=1000 + i, policy_version=0)).mean()
                                  for i, c in enumerate(conds * 2)]).mean())

    before = evaluate()
    for step in range(25):
        with tr.exported(ema=False):   # the rollouts sample with v_old, as the driver sends it
            grp = sample_group(model, conds[step % 2], cfg, seed=step, policy_version=tr.version)
        grp.composite = reward(grp)
        grp.scores = Scores(["h"], grp.composite.view(-1, 1))
        tr.train_step(TrainBatch([grp], version=tr.version))
    after = evaluate()
    assert after > before + 0.2, (before, after)


def test_an_evaluation_samples_the_given_weights_and_leaves_the_held_version_whole():
    """DiffusionNFT's rollout actors hold v_old; an evaluation during training loads θ for itself
    (RolloutWorker.evaluating): it samples exactly what an actor holding θ samples, and afterwards
    the actor holds v_old again bit for bit, at the same version. A load that fails part-way leaves
    the held weights whole too."""
    from common.weights import checksum
    from common.weights_record import WeightsRecord
    from rollout_worker.actor import RolloutWorker

    torch.set_num_threads(1)
    cfg = load_config("configs/quickstart.yaml", ["schedule.steps=4"])
    worker, holds_theta = RolloutWorker(cfg), RolloutWorker(cfg)
    module = worker.model.trainable_module()
    g = torch.Generator().manual_seed(0)
    theta = {k: v.detach() + 0.2 * torch.randn(v.shape, generator=g)
             for k, v in module.state_dict().items() if "lora" in k}
    held = {k: v.detach().clone() for k, v in module.state_dict().items()}
    holds_theta.set_weights(theta, version=3)
    prompts, seeds = ["a red square moving left", "a blue square moving up"], [1, 2]
    with worker.evaluating(WeightsRecord(3, theta, checksum(theta, "blake2b"))):
        got = worker.sample_videos(prompts, seeds)
    assert torch.equal(got, holds_theta.sample_videos(prompts, seeds))
    assert worker.version() == 0 and all(torch.equal(v, held[k]) for k, v in module.state_dict().items())
    assert not torch.equal(worker.sample_videos(prompts, seeds), got)   # what it holds samples otherwise
    first, second = list(theta)[:2]
    bad = {first: theta[first], second: torch.zeros(3)}                   # the second tensor cannot load
    with pytest.raises(ValueError, match="shape"), worker.evaluating(WeightsRecord(4, bad)):
        pass
    assert all(torch.equal(v, held[k]) for k, v in module.state_dict().items())


# --- config ------------------------------------------------------------------------------


@pytest.mark.parametrize("override, field", [
    ("align.enabled=true", "align.enabled=false"), ("bank.enabled=true", "bank.enabled=false"),
    ("kl.strategy=fixed", "kl.strategy=none"), ("sampler.shared_noise=true", "sampler.shared_noise=false"),
])
def test_nft_config_conflicts_are_one_line_naming_the_fix(override, field):
    base = ["grpo.loss=nft", "align.enabled=false", "bank.enabled=false", "kl.strategy=none",
            "sampler.shared_noise=false", "sampler.initial_noise=group"]
    load_config(None, base)
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, override])
    assert field in str(e.value) and "\n" not in str(e.value)

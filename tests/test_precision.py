"""Mixed precision at the production dtype (bf16) on CPU: fp32 master weights and optimizer state,
fp32 LoRA adapters, and identical numerics in the sampler and the learner (log r = 0 on replay
with unchanged weights), single-process and FSDP2 over 2 ranks."""

from __future__ import annotations

import functools

import pytest
import torch

from common.config import RunConfig
from common.types import Condition, TrainBatch
from learner.actor import LearnerGroup
from learner.rows import build_rows, micro_batches
from learner.trainer import Trainer
from rollout_worker.models.lora import inject_lora, is_lora_key
from rollout_worker.models.tiny import tiny_wan_model
from rollout_worker.sampler import _velocity, sample_group

pytestmark = pytest.mark.timeout(240)

MODEL = {"family": "wan", "num_frames": 5, "height": 16, "width": 16, "guidance_scale": 2.0,
         "max_sequence_length": 16, "dtype": "bfloat16"}


def _cfg(finetune: str, **over) -> RunConfig:
    return RunConfig.model_validate({
        "model": MODEL, "schedule": {"steps": 4, "shift": 3.0}, "sde": {"scheme": "sage"},
        "sampler": {"group_size": 3, "train_steps": "all", "latent_dtype": "bfloat16"},
        "optim": {"finetune": finetune, "micro_batch": 4, "lora_rank": 4, "lr": 1e-5},
        "kl": {"strategy": "dual"},
        "pools": {"learner": {"num_cpus": 0.5, "torch_threads": 1}}, **over})


def _batch(cfg: RunConfig, groups: int = 2) -> TrainBatch:
    """Groups from the real sampler on a rollout-side model (with the same adapter for LoRA)."""
    rollout = tiny_wan_model(MODEL)
    if cfg.optim.finetune == "lora":
        inject_lora(rollout.trainable_module(), "wan", cfg.optim)
    out = []
    for c in range(groups):
        g = sample_group(rollout, Condition(id=f"c{c}", prompt=f"prompt {c}"), cfg, seed=c, policy_version=0)
        g.composite = torch.randn(g.size, generator=torch.Generator().manual_seed(c))
        out.append(g)
    return TrainBatch(fresh=out)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_bf16_replay_is_exact_and_masters_are_fp32(finetune):
    cfg = _cfg(finetune)
    batch = _batch(cfg)
    model = tiny_wan_model(MODEL)
    assert model.transformer.dtype == torch.bfloat16
    tr = Trainer(cfg, model).setup()
    pol = tr.policy
    opt_params = pol.optim_parameters()
    assert all(p.dtype == torch.float32 for p in opt_params)
    if finetune == "lora":
        assert all(is_lora_key(n) for n in pol.params) and not pol.master  # adapters are fp32 themselves
    else:
        assert {p.dtype for p in pol.params.values()} == {torch.bfloat16} and len(pol.master) == len(pol.params)

    # the learner's velocities (grad on, micro-batch rows) equal the sampler's bit for bit
    rows = build_rows(batch, cfg)
    mb = next(micro_batches(rows, cfg.optim.micro_batch))
    cond = tr.conditions(rows).index(mb.cond_idx)
    learner_v = pol.velocity(mb.x.float(), mb.sigma, cond)
    with torch.no_grad():
        sampler_v = torch.cat([_velocity(model, mb.x[i:i + 1].float(), float(mb.sigma[i]), cond.index([i]))
                               for i in range(len(mb.x))])
    assert torch.equal(learner_v.detach(), sampler_v)

    st = tr.train_step(batch)
    # log r on replay: not 0 bit for bit only because σ reaches the SDE scheme as the schedule's
    # float64 in the sampler and as float32 in the learner's rows (learner/rows.py), which moves
    # Sage's float64 variance by an ulp; measured 6e-8, far below clip ε = 1e-4.
    assert st["logratio_first_absmax"] < 1e-6
    assert st["clipfrac"] == 0.0 and st["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert st["grad_norm"] > 0
    state = [s for p in opt_params for s in tr.optimizer.state[p].values() if torch.is_tensor(s) and s.ndim]
    assert state and all(s.dtype == torch.float32 for s in state)
    if finetune == "full":
        # lr 1e-5 moves the fp32 masters by less than bf16 resolves: the compute weights are the
        # rounded masters, and the masters keep the small updates a bf16 optimizer would lose
        lost = [n for n, m in pol.master.items() if not torch.equal(m.to(torch.bfloat16).float(), m.detach())]
        assert lost
        for n, m in pol.master.items():
            assert torch.equal(pol.params[n], m.detach().to(torch.bfloat16)), n


def test_learner_sees_the_sampler_transformer_dtype():
    """Without the shared compute dtype the learner (fp32) would not replay a bf16 sampler exactly."""
    cfg = _cfg("lora")
    batch = _batch(cfg)
    fp32 = tiny_wan_model({**MODEL, "dtype": "float32"})
    st = Trainer(cfg, fp32).setup().train_step(batch)
    assert st["logratio_first_absmax"] > cfg.grpo.clip_eps  # such rows would all clip


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_fsdp2_two_ranks_replay_bf16_exactly(ray_session, finetune):
    cfg = _cfg(finetune)
    batch = _batch(cfg)
    group = LearnerGroup(cfg, model_factory=functools.partial(tiny_wan_model, MODEL), num_ranks=2)
    try:
        st = group.train_step(batch)
        assert st["logratio_first_absmax"] < 1e-6  # see test_bf16_replay_is_exact_and_masters_are_fp32
        assert st["clipfrac"] == 0.0 and st["grad_norm"] > 0
        payload = group.weights_payload()
    finally:
        group.shutdown()
    # the published weights travel in the dtype the rollout side holds them in: the fp32 masters
    # as their bf16 compute copy (full), the adapters in fp32 (LoRA)
    assert {v.dtype for v in payload.values()} == {torch.bfloat16 if finetune == "full" else torch.float32}


def _rollout_model(cfg: RunConfig, load) -> torch.nn.Module:
    model = tiny_wan_model(MODEL)
    if cfg.optim.finetune == "lora":
        inject_lora(model.trainable_module(), "wan", cfg.optim)
    load(model)
    return model


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_fsdp2_bf16_wire_gives_todays_rollout_and_replays_exactly(ray_session, finetune):
    """A publish cast to the wire dtype on each shard loads the same rollout weights, bit for bit,
    as the fp32 masters did, and a group the published weights sample replays with log r ≈ 0."""
    from common.weights import Manifest
    from rollout_worker.models.base import copy_weights
    from rollout_worker.weight_receiver import load_streamed

    def fp32_masters(rank) -> dict:  # torch's own full-state gather: what publishes sent before
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(rank.trainer.policy.module,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    cfg = _cfg(finetune, optim={"finetune": finetune, "micro_batch": 4, "lora_rank": 4, "lr": 3e-3},
               weight_sync={"bucket_mb": 1})
    batch = _batch(cfg)
    group = LearnerGroup(cfg, model_factory=functools.partial(tiny_wan_model, MODEL), num_ranks=2)
    try:
        group.train_step(batch)  # the learner's weights move away from the batch's sampler
        record = group.weights_record(1)  # bf16 buckets in the object store, checksum on (fast)
        masters = ray_session.get([r.__ray_call__.remote(fp32_masters) for r in group.ranks])[0]
        manifest = Manifest.from_dict(record.weights.manifest)
        names = [e.name for e in manifest.entries]
        assert {e.dtype for e in manifest.entries} == {"bfloat16" if finetune == "full" else "float32"}
        assert record.checksum.startswith("xxh3:")  # on by default, checked below on loading

        def streamed(model) -> None:
            targets = model.weight_targets(names)
            load_streamed(record.weights, record.checksum, lambda v: copy_weights(targets, v),
                          model.device, "test rollout")

        wire = _rollout_model(cfg, streamed)
        today = _rollout_model(cfg, lambda m: m.load_weights({k: masters[k] for k in names}))
        before = _rollout_model(cfg, lambda m: None)
        a, b = wire.trainable_module().state_dict(), today.trainable_module().state_dict()
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
        old = before.trainable_module().state_dict()
        assert any(not torch.equal(a[k], old[k]) for k in a)  # the comparison is not of unchanged weights
        # the rollout sampled by the published weights is the one the fp32 masters gave
        cond = Condition(id="c9", prompt="prompt 9")
        g_wire, g_today = (sample_group(m, cond, cfg, seed=9, policy_version=1) for m in (wire, today))
        assert all(torch.equal(x.logp_old, y.logp_old) and torch.equal(x.final_latents, y.final_latents)
                   for x, y in zip(g_wire.members, g_today.members, strict=True))
        # and the learner replays it on-policy: log r is exactly 0 (dual KL: the moving anchor's
        # forward runs first, and the root's gathered copy must not keep the anchor's weights)
        g_wire.composite = torch.randn(g_wire.size, generator=torch.Generator().manual_seed(9))
        assert group.train_step(TrainBatch(fresh=[g_wire]))["logratio_first_absmax"] == 0.0
        # control: the weights before the publish replay visibly off-policy
        g_old = sample_group(before, cond, cfg, seed=9, policy_version=1)
        g_old.composite = g_wire.composite
        assert group.train_step(TrainBatch(fresh=[g_old]))["logratio_first_absmax"] > 1e-4
    finally:
        group.shutdown()


def test_checkpoint_keeps_the_fp32_masters(tmp_path):
    cfg = _cfg("full")
    batch = _batch(cfg)
    a = Trainer(cfg, tiny_wan_model(MODEL)).setup()
    a.train_step(batch)
    path = a.save_checkpoint(tmp_path)
    b = Trainer(cfg, tiny_wan_model(MODEL)).setup()
    b.load_checkpoint(path)
    for n, m in a.policy.master.items():
        assert torch.equal(b.policy.master[n], m), n  # not the bf16 compute weights, which lose the step
        assert torch.equal(b.policy.params[n], a.policy.params[n]), n
    assert b.train_step(batch)["loss"] == a.train_step(batch)["loss"]


def test_the_moving_average_of_bf16_weights_is_kept_in_fp32():
    """optim.ema_decay with bf16 full fine-tuning: each step moves the average by (1 - d)·(θ - θ̄),
    far below what bf16 resolves; kept in fp32 from the fp32 masters it is the exact average
    (torch's own AveragedModel over the masters), and exporting it leaves the live weights as they were."""
    from torch.optim.swa_utils import get_ema_avg_fn

    cfg = _cfg("full", optim={"finetune": "full", "micro_batch": 4, "lr": 1e-5, "ema_decay": 0.99})
    batch = _batch(cfg)
    tr = Trainer(cfg, tiny_wan_model(MODEL)).setup()
    pol = tr.policy
    want = {n: m.detach().clone() for n, m in pol.master.items()}
    for _ in range(12):  # d_t = min(0.99, (1+t)/(10+t)): 0.18 at step 1 .. 0.59 at step 12
        tr.train_step(batch)
        d = min(0.99, (1 + tr.version) / (10 + tr.version))
        avg = get_ema_avg_fn(d)
        want = {n: avg(want[n], m.detach(), None) for n, m in pol.master.items()}
    ema = pol.anchors["ema"]
    assert all(e.dtype == torch.float32 for e in ema.values())
    for n in want:
        torch.testing.assert_close(ema[n], want[n], rtol=1e-6, atol=1e-7)  # lerp vs d·a + (1-d)·b: an ulp
    # the average differs from its own bf16 rounding: a bf16 copy could not hold it
    assert any(not torch.equal(e.to(torch.bfloat16).float(), e) for e in ema.values())
    live = {n: p.detach().clone() for n, p in pol.params.items()}
    exported = tr.weights_payload(ema=True)
    assert all(torch.equal(p, live[n]) for n, p in pol.params.items())  # restored exactly
    n0 = next(iter(want))
    assert torch.equal(exported[n0], want[n0].to(torch.bfloat16))
    assert all(torch.equal(e, ema[n]) for n, e in pol.anchors["ema"].items())  # and the average is intact

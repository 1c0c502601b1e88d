"""`vgrpo plan -c CONFIG [--gpu H100|H200|A100]`: print the sizing of cluster/plan/sizing.py."""

from __future__ import annotations

from cluster.cli.config_cmd import add_config_args
from cluster.driver.preflight import health_warnings
from cluster.plan.bank import bank_size
from cluster.plan.checks import refuse, run_checks
from cluster.plan.devices import (
    device_total,
    free_fraction,
    reward_memory,
    role_peaks,
    shared_devices,
)
from cluster.plan.host import POLICY_WRITE, STATE_WRITE, checkpoint_host, host_ram, peak, pods_for
from cluster.plan.sizing import (
    GB,
    GPUS,
    MFU,
    NVLINK_GBS,
    Plan,
    lean_setup,
    learner_peak,
    plan,
    rollout_peaks,
    rollout_rows,
)
from cluster.plan.timing import SAFETY
from common.config import ConfigError, load_config
from common.families import FAMILIES


def _fit(need: float, cap_gib: float) -> str:
    return "  (fits)" if need < cap_gib * GB else "  (does NOT fit)"


def _learner_header(cfg) -> str:
    pool, m = cfg.pools.learner, cfg.model
    sp = pool.parallel.sp
    ranks = (f"{pool.num_actors} FSDP2 ranks" if sp == 1 else
             f"{pool.num_actors} data-parallel ranks x sp {sp} = {pool.processes} FSDP2 processes, "
             f"1/{sp} of the video tokens each")
    return f"learner rank ({ranks}, micro-batch {cfg.optim.micro_batch}, CFG {'x2' if m.guidance_scale > 1 else 'x1'}):"


def _row(label: str, amount: str, seconds: float, note: str = "") -> str:
    return f"  {label:<24}{amount:>15}{seconds:9.1f} s" + (f"  ({note})" if note else "")


def _compute_lines(cfg, p: Plan) -> list[str]:
    sp_r, sp_l = cfg.pools.rollout.parallel.sp, cfg.pools.learner.parallel.sp
    on = {"rollout": f"on {sp_r} GPUs, sp {sp_r}" if sp_r > 1 else "",
          "train": f"on {sp_l} GPUs, sp {sp_l}" if sp_l > 1 else ""}
    trained = f"{p.flops['trained steps per video']:.0f} trained steps"
    lines = ["compute:",
             _row("rollout per video", f"{p.flops['rollout per video'] / 1e15:.1f} PFLOP",
                  p.seconds["rollout per video"], on["rollout"]),
             _row("train per video", f"{p.flops['train per video'] / 1e15:.1f} PFLOP", p.seconds["train per video"],
                  ", ".join(x for x in (trained, on["train"]) if x))]
    link = NVLINK_GBS[p.gpu]
    for role, sp in (("rollout", sp_r), ("train", sp_l)):
        if sp > 1:
            b = p.comm[f"{role} per video"]
            lines.append(_row(f"all-to-all per {role}", f"{b / GB:.1f} GiB", b / (link * 1e9),
                              f"per video and rank: Ulysses, 2 per attention, at {link:.0f} GB/s NVLink"))
    return lines


def render(cfg, p: Plan, source: str) -> str:
    a, m = p.arch, cfg.model
    cap = GPUS[p.gpu][1]
    lines = [f"vgrpo plan: {source} on {p.gpu} ({cap:.0f} GiB, {GPUS[p.gpu][0]:.0f} dense bf16 TFLOP/s, "
             f"MFU {MFU:.0%} assumed)",
             f"model: {m.family} {m.task}, {a.experts} transformer(s) of {a.params / 1e9:.2f}B "
             f"({a.layers} blocks, width {a.width}), {a.trained_experts} trained "
             f"({cfg.optim.finetune}{f', LoRA {a.lora_params / 1e6:.0f}M' if cfg.optim.finetune == 'lora' else ''}); "
             f"{m.num_frames}x{m.height}x{m.width} -> {a.tokens} video tokens; compute dtype {m.dtype}",
             "", _learner_header(cfg)]
    for k, v in p.learner.items():
        lines.append(f"  {k:<32}{v / GB:9.1f} GiB")
    for ck in (True, False):
        peak = learner_peak(p.learner, ck)
        lines.append(f"  {'peak, ' + ('with' if ck else 'without') + ' checkpointing':<32}{peak / GB:9.1f} GiB"
                     f"{_fit(peak, cap)}")
    setup = sum(p.learner_setup.values())
    where = "host" if cfg.learner.cpu_offload else "GPU"
    how = "sharded on meta, each rank reading its own rows" if lean_setup(cfg) else "one rank: the whole module"
    lines.append(f"  {'setup peak (' + where + ')':<32}{setup / GB:9.1f} GiB"
                 f"{'' if where == 'host' else ('  (fits)' if setup < cap * GB else '  (does NOT fit)')}  ({how}: "
                 + ", ".join(f"{k} {v / GB:.1f}" for k, v in p.learner_setup.items()) + " GiB)")
    ck = checkpoint_host(cfg, p)
    lines.append(f"  {'checkpoint save (host, per rank)':<32}{max(ck.values()) / GB:9.1f} GiB  (the policy one "
                 f"tensor at a time, {ck[POLICY_WRITE] / 2**20:.1f} MiB, each rank writing its own shard files; "
                 f"then the trainer state one storage at a time, {ck[STATE_WRITE] / 2**20:.1f} MiB; no rank "
                 "holds a shard or the model)")
    fbs, sp_r = cfg.sampler.forward_batch_size, cfg.pools.rollout.parallel.sp
    rows = f"{rollout_rows(cfg)} rows per forward: " + ("the whole group, sampler.forward_batch_size null"
                                                       if fbs is None else f"sampler.forward_batch_size {fbs}")
    lines.append(f"rollout rank (G = {cfg.sampler.group_size}, {rows}"
                 + (f"; sp {sp_r}: 1/{sp_r} of the video tokens):" if sp_r > 1 else "):"))
    for k, v in p.rollout.items():
        lines.append(f"  {k:<32}{v / GB:9.1f} GiB")
    peaks = rollout_peaks(cfg, p)
    why = {"encoding": "  (weights and frozen modules + text encoders"
                       + (" + the I2V first frame through the VAE)" if cfg.model.task == "i2v" else ")"),
           "generating": "  (weights and frozen modules + activations + vae decode)",
           "receiving weights": f"  (weights and frozen modules + 2 receive buckets of "
                                f"{p.rollout_receive / 2 / 2**20:.0f} MiB, weight_sync.bucket_mb "
                                f"{cfg.weight_sync.bucket_mb:g})"}
    for what, total in peaks.items():
        lines.append(f"  {'peak while ' + what:<32}{total / GB:9.1f} GiB{_fit(total, cap)}{why[what]}")
    lines += _reward_lines(cfg, cap)
    lines += _compute_lines(cfg, p)
    lines += [f"split of {p.split['gpus']:g} GPUs that balances rollout and learner: "
              f"{p.split['rollout gpus']:.1f} rollout : {p.split['learner gpus']:.1f} learner "
              f"(rollout share {p.split['rollout share']:.0%}; configured "
              f"{cfg.pools.rollout.processes * cfg.pools.rollout.num_gpus:g} : "
              f"{cfg.pools.learner.processes * cfg.pools.learner.num_gpus:g})"]
    lines += _device_lines(cfg, p, cap)
    return "\n".join(lines)


def _reward_lines(cfg, cap: float) -> list[str]:
    mem = reward_memory(cfg)
    total = sum(mem.values())
    if total == 0:
        return []
    lines = [f"reward rank (the largest of {', '.join(r.name for r in cfg.rewards.models)}, one scoring batch):"]
    lines += [f"  {k:<32}{v / GB:9.1f} GiB" for k, v in mem.items()]
    return lines + [f"  {'peak':<32}{total / GB:9.1f} GiB{_fit(total, cap)}"]


def _free(need: float, cap: float, want: float) -> str:
    f = free_fraction(need, cap)
    return f"{f:.0%} free" + ("" if f >= want else f", below the {want:.0%} margin")


def _device_lines(cfg, p: Plan, cap: float) -> list[str]:
    """GPU memory per device: each role's peak per process, and the sum on a device roles share."""
    peaks, reserved = role_peaks(cfg, p), cfg.plan.gpu_reserved_gib * GB
    pools = cfg.pools
    on_gpu = [r for r in ("rollout", "reward", "learner") if getattr(pools, r).num_gpus > 0 and peaks[r] > 0]
    lines = ["GPU memory per device (peak per process; pools.<role>.num_gpus below 1 shares a GPU):"]
    for r in on_gpu:
        share = getattr(pools, r).num_gpus
        alone = f"{share:g} of a GPU, shared" if share < 1 else "a GPU of its own"
        lines.append(f"  {r:<32}{peaks[r] / GB:9.1f} GiB  ({alone}; {_free(peaks[r], cap, cfg.plan.min_free)})")
    for i, dev in enumerate(shared_devices(cfg)):
        total = device_total(peaks, dev, reserved)
        parts = " + ".join(f"{r} {peaks[r] / GB:.1f}" for r in dev.roles)
        lines.append(f"  {'GPU ' + str(i) + ': ' + ' + '.join(dev.roles):<32}{total / GB:9.1f} GiB{_fit(total, cap)}"
                     f"  ({parts} + {len(dev.roles)} x plan.gpu_reserved_gib {reserved / GB:g} GiB; "
                     f"{_free(total, cap, cfg.plan.min_free)})")
    return lines


def render_checks(cfg, p: Plan, checks, pods_source: str) -> str:
    """The memory bank, host RAM per role and every checked figure, one line each."""
    b = bank_size(cfg)
    lines = ["memory bank (each member stores only the steps it trains; the condition once per group):",
             f"  stored steps per member        {b.steps_per_member:9d}     latents {list(b.latent)} "
             f"{cfg.sampler.latent_dtype}{', mu_old fp32' if cfg.records_mu_old else ''}",
             f"  per member                     {b.member / 1e6:9.1f} MB",
             f"  per group                      {b.group / 1e6:9.1f} MB  (G = {cfg.sampler.group_size}, "
             f"condition {b.condition / 1e6:.1f} MB)",
             f"  per step                       {b.step / 1e9:9.2f} GB  (train.groups_per_step = "
             f"{cfg.train.groups_per_step})",
             "host RAM per process (peak):"]
    for role, parts in host_ram(cfg, p).items():
        detail = ", ".join(f"{k} {v / GB:.1f}" for k, v in parts.items())
        lines.append(f"  {role:<31}{peak(parts) / GB:9.1f} GiB  ({detail} GiB)")
    lines.append(f"checks (timeouts at least {SAFETY:g}x the estimate; pods from {pods_source}):")
    for c in checks:
        lines.append(f"  {'ok  ' if c.ok else 'FAIL'} {c.line}")
    return "\n".join(lines)


def register(sub) -> None:
    p = sub.add_parser("plan", help="estimate memory per rank, time per video and the GPU split",
                       description="Estimate, from CONFIG alone (no weights are loaded), the memory a "
                       "learner and a rollout rank need, FLOPs and seconds per rollout and per trained "
                       "video, and the rollout:learner GPU split that balances the two.")
    add_config_args(p)
    p.add_argument("--gpu", default=None, choices=sorted(GPUS),
                   help="the GPU to plan for (default: the config's plan.gpu)")
    p.add_argument("--values", default=None, metavar="FILE",
                   help="a Helm values file whose pods to check (default: the config's plan.pods, else "
                   "the repository's deploy/helm/vgrpo/values.yaml)")
    p.set_defaults(func=run)


def render_layout(cfg, source: str) -> str:
    """The GPU layout alone, for a family the plan cannot size whose pools ask for GPUs (the toy
    twin of a GPU recipe, configs/toy_1gpu_shared.yaml): each role's share and the devices they share."""
    pools, fam = cfg.pools, cfg.model.family
    sim = "; simulated (pools.simulated_gpus): every role computes on the CPU" if pools.simulated_gpus else ""
    lines = [f"vgrpo plan: {source}: model.family = {fam!r} is not sized (no memory or time plan); its GPU layout only",
             f"GPU layout (pools.<role>.num_gpus below 1 shares a GPU{sim}):"]
    for r in ("rollout", "reward", "learner"):
        share = getattr(pools, r).num_gpus
        if share > 0:
            lines.append(f"  {r:<36}{share:g} of a GPU" + (", shared" if share < 1 else " (its own)"))
    for i, dev in enumerate(shared_devices(cfg)):
        shares = [s for _, s in dev.shares]
        lines.append(f"  {'GPU ' + str(i) + ': ' + ' + '.join(dev.roles):<36}"
                     f"{' + '.join(f'{s:g}' for s in shares)} = {sum(shares):g} of the GPU")
    lines.append(f"plan: GPU layout only for model.family = {fam!r}")
    return "\n".join(lines)


def run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    if not FAMILIES[cfg.model.family].planned and any(getattr(cfg.pools, r).num_gpus > 0 for r in
                                                       ("rollout", "reward", "learner")):
        print(render_layout(cfg, args.config or "defaults"))
        return 0
    try:
        p = plan(cfg, args.gpu)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pods, source = pods_for(cfg, args.values)
    checks = run_checks(cfg, p, pods)
    print(render(cfg, p, args.config or "defaults"))
    print(render_checks(cfg, p, checks, source))

    for line in health_warnings(cfg):  # training health: settings that fail silently (docs/health.md)
        print(f"warning: {line}")
    refuse(checks)  # the first failing check, in one line (exit 2)
    print(f"plan: GPU memory, bank, timeouts and pods ok for {p.gpu}")
    return 0

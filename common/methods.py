"""RL methods as declarations: what the rollout, the planner and the health checks must know of
each `grpo.loss`, the KL strategies' anchors, and each upstream's advantage normalisation, as
pure data.

The learner's side of a method (its rows, micro-batches, loss and what it does after a step) is
its entry in `learner/methods/`, named here by a lazy path as Flow-Factory names its trainers.
Adding a method is its learner entry, this declaration, the config name and tests: a method's own
hyperparameters are declared here (`params`, set with `grpo.params.<name>`), the settings its loss
needs (`requires`) and its rollouts' stochastic band (`sde_band`) too, so no other module changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KLStrategy:
    anchor: str | None    # the policy D_anchor is taken against: "pi0" (fixed), "moving", or none
    step: bool            # D_step, the KL between the sampling and the updated policy, is on


KL_STRATEGIES: dict[str, KLStrategy] = {  # kl.strategy -> its terms (docs/algorithm.md section 5)
    "none": KLStrategy(None, False),
    "fixed": KLStrategy("pi0", False),
    "step": KLStrategy(None, True),
    "moving": KLStrategy("moving", False),
    "dual": KLStrategy("moving", True),
}


@dataclass(frozen=True)
class MethodParam:
    """One of a method's own hyperparameters (`grpo.params.<name>`), with its upstream default."""

    default: float
    doc: str                  # what it is, and which upstream config sets the default
    low: float = 0.0          # the allowed range, inclusive
    high: float = math.inf
    integer: bool = False


@dataclass(frozen=True)
class MethodSpec:
    impl: str             # the learner's entry, "module:Class" (learner/methods/), imported when built
    records_steps: bool   # rollouts record SDE steps (x_k, x_k+1, logp_old) that the loss replays;
                          # False: ODE rollouts whose clean final latents the loss trains on
    uses_kl_strategy: bool  # kl.strategy's anchors and λ_KL apply (False: the method has its own KL)
    anchors: Callable[..., frozenset[str]]  # cfg -> the anchors its loss evaluates (a no-grad forward each per row)
    rows_per_video: Callable[..., int] | None = None  # cfg -> learner rows per video; None: the steps a member trains
    rollout_anchor: str | None = None  # the policy anchor the rollouts sample instead of θ (None: θ); with one, an
                                       # evaluation loads the exported policy for itself (section 6b)
    notes: str = ""
    params: dict[str, MethodParam] = field(default_factory=dict)  # its own hyperparameters (grpo.params)
    requires: tuple[str, ...] = ()   # "key.path=value" settings its loss needs; a config that differs is refused
    records_mu_old: bool = False     # its loss reads the sampling policy's mean μ_old at each recorded step
    sde_band: tuple[float, float] | None = None  # ODE rollouts (records_steps False) that take the configured
                                     # SDE scheme's step where the step ends at σ in [lo, hi], unrecorded
    micro_batch_rows: Callable[..., int] | None = None  # cfg -> rows in one micro-batch (its batching, e.g.
                                     # whole groups); None: optim.micro_batch


METHODS: dict[str, MethodSpec] = {  # grpo.loss -> its declaration
    "grpo": MethodSpec("learner.methods.grpo:GRPO", records_steps=True, uses_kl_strategy=True,
                       anchors=lambda cfg: frozenset({KL_STRATEGIES[cfg.kl.strategy].anchor} - {None}),
                       notes="the clipped surrogate on recorded SDE steps (every scheme's method: "
                             "SAGE-GRPO, TAGRPO, DanceGRPO, FlowGRPO, CPS, MixGRPO, Flash-GRPO)"),
    "nft": MethodSpec("learner.methods.nft:NFT", records_steps=False, uses_kl_strategy=False,
                      # its sampling policy v_old on every row, and π_0 for its KL
                      anchors=lambda cfg: frozenset({"old"} | ({"pi0"} if cfg.nft.kl > 0 else set())),
                      rows_per_video=lambda cfg: max(1, int(_steps(cfg) * cfg.nft.timestep_fraction)),
                      rollout_anchor="old",  # the rollouts sample v_old; evaluations, θ
                      notes="DiffusionNFT: a flow-matching loss on fresh ODE rollouts' final latents "
                            "(docs/algorithm.md section 6b; its KL to π_0 is nft.kl)"),
    "grpo_guard": MethodSpec(
        "learner.methods.grpo_guard:GRPOGuard", records_steps=True, uses_kl_strategy=False,
        anchors=lambda cfg: frozenset({"pi0"} if method_params(cfg)["kl"] > 0 else set()),
        records_mu_old=True,  # its own KL and step weight (1/|dt|) replace kl.strategy's and the equalizer's
        requires=("align.enabled=false", "kl.strategy=none", "grpo.equalizer=false", "grpo.rectify=false"),
        params={"clip": MethodParam(2e-6, "ε of the clipped RatioNorm ratio: flow_grpo config/grpo_guard.py "
                                          "general_ocr_sd3_rationorm train.clip_range (4e-6 for pickscore); "
                                          "verl-omni's example clip_ratio", high=1.0),
                "kl": MethodParam(0.0, "β of FlowGRPO's KL to π_0, mean((μ_θ − μ_π0)²)/(2·std_dev_t²): "
                                       "train.beta, 0 in every recipe of flow_grpo config/grpo_guard.py")},
        notes="GRPO-Guard: FlowGRPO's clipped surrogate with the ratio normalised (RatioNorm) and each step's "
              "loss over |dt| (docs/algorithm.md section 6c)"),
    "dgpo": MethodSpec(
        "learner.methods.dgpo:DGPO", records_steps=False, uses_kl_strategy=False,
        anchors=lambda cfg: frozenset({"old", "pi0"}),  # its EMA reference for the clip, π_0 for d_ref and KL
        rows_per_video=lambda cfg: int(min(method_params(cfg)["timesteps"], method_params(cfg)["trunc_steps"] + 1,
                                           _steps(cfg))),
        # its group weight sums over a (group, timestep) unit: a micro-batch holds whole units
        micro_batch_rows=lambda cfg: cfg.sampler.group_size * max(1, cfg.optim.micro_batch // cfg.sampler.group_size),
        params={"beta_dpo": MethodParam(100.0, "β_dpo in the group weight σ(Σ A·β_dpo·Δd / G): Luo-Yihong/DGPO "
                                               "config/dgpo.py general_ocr/geneval train.beta_dpo (10 for pickscore)"),
                "kl": MethodParam(0.02, "β of mean((v_θ − v_π0)²): config/dgpo.py general_ocr/geneval train.beta "
                                        "(0.001 for pickscore)"),
                "clip": MethodParam(1e-2, "c of its PPO-style cut on exp(d_old − d): config/dgpo.py clip_range"),
                "timesteps": MethodParam(4, "M schedule indices trained per step: num_train_timesteps", low=1,
                                         integer=True),
                "trunc_steps": MethodParam(6, "indices drawn from 0 … trunc_steps: config/dgpo.py trunc_steps "
                                                 "(4 for geneval)", integer=True),
                "ref_decay_rate": MethodParam(1e-3, "its EMA reference's decay min(max, rate·t): 0.001"),
                "ref_decay_max": MethodParam(0.3, "that decay's cap: 0.3", high=1.0)},
        notes="DGPO: a group-level preference loss on ODE rollouts' final latents, micro-batches of whole "
              "groups (docs/algorithm.md section 6c)"),
    "awm": MethodSpec(
        "learner.methods.awm:AWM", records_steps=False, uses_kl_strategy=False,
        anchors=lambda cfg: frozenset(({"pi0"} if method_params(cfg)["kl"] > 0 else set())
                                      | ({"old"} if method_params(cfg)["ema_kl"] > 0 else set())),
        rows_per_video=lambda cfg: int(method_params(cfg)["timesteps"]),
        sde_band=(0.3, 0.9),  # its stochasticity_control_function: noise where 0.3 ≤ t ≤ 0.9, ODE elsewhere
        params={"kl": MethodParam(0.003, "β of mean((v_θ − v_π0)²): scxue/advantage_weighted_matching "
                                         "config/dgx_awm.py ocr_sd3_no_cfg train.beta (geneval 0.001, pickscore 1e-4)"),
                "ema_kl": MethodParam(1.0, "β_ema of mean((v_θ − v_ema)²): its train.ema_beta"),
                "clip": MethodParam(1.0, "ε of its clipped ratio: its train.clip_range"),
                "timesteps": MethodParam(6, "M schedule indices per sample: train.train_timesteps", low=1, integer=True),
                "timestep_fraction": MethodParam(0.9, "indices up to int(T·fraction): train.timestep_fraction",
                                                 high=1.0),
                "first_index": MethodParam(1, "the first index drawn: 1 for its time_type discrete_wo_init "
                                                 "(ocr, geneval), 0 for discrete (pickscore)", high=1, integer=True),
                "advantage_max": MethodParam(1.0, "Â = clip(A)/adv_clip·advantage_max: train.advantage_max"),
                "ghuber_power": MethodParam(0.25, "p of its ghuber weighting: train.ghuber_power", low=1e-3),
                "ema_decay_rate": MethodParam(1e-3, "the EMA's decay min(max, rate·t): kl_ema_decay_type linear"),
                "ema_decay_max": MethodParam(0.3, "that decay's cap: train.kl_ema_decay", high=1.0)},
        notes="AWM: the flow-matching loss weighted by advantage on the final latents of rollouts stochastic "
              "only where σ is in [0.3, 0.9] (docs/algorithm.md section 6c)"),
}


@dataclass(frozen=True)
class AdvantageNorm:
    """How a stats set's rewards become advantages: A = (R - mean) / (std + eps) (docs/algorithm.md
    section 4); the same std is the divisor with grpo.adv_std=batch."""

    ddof: int       # 0: the population std (numpy's np.std); 1: the unbiased one (torch's .std())
    eps: float      # added to the std
    source: str     # the upstream code it transcribes


ADV_NORMS: dict[str, AdvantageNorm] = {  # grpo.adv_norm -> its normalisation (a row names its upstream's)
    "population": AdvantageNorm(0, 1e-8, "vgrpo's own (SAGE-GRPO, TAGRPO, CPS and the quickstart rows)"),
    "flow_grpo": AdvantageNorm(0, 1e-4, "flow_grpo, flow_grpo/stat_tracking.py PerPromptStatTracker.update: "
                                        "np.std(...) + 1e-4, per prompt or with global_std over the batch; "
                                        "DiffusionNFT and Flash-GRPO train with their copies of it"),
    "dance_grpo": AdvantageNorm(1, 1e-8, "DanceGRPO, fastvideo/train_grpo_*.py train_one_step: "
                                         "(r - r.mean()) / (r.std() + 1e-8) with torch's std, per reward head "
                                         "in train_grpo_hunyuan.py; MixGRPO's fastvideo/train_grpo_flux.py "
                                         "keeps it (advantage_aggr)"),
}


def adv_norm_of(cfg) -> AdvantageNorm:
    """The advantage normalisation a run's rows declare (grpo.adv_norm)."""
    return ADV_NORMS[cfg.grpo.adv_norm]


def _steps(cfg) -> int:
    """The schedule's step count (common.sde.Schedule.from_config(cfg.schedule).steps)."""
    sigmas = cfg.schedule.sigmas
    return len(sigmas) - 1 if sigmas is not None else cfg.schedule.steps


def method_of(cfg) -> MethodSpec:
    """The declaration of a run's method (cfg: a RunConfig)."""
    return METHODS[cfg.grpo.loss]


def micro_batch_rows(cfg) -> int:
    """Rows in one of the learner's micro-batches: optim.micro_batch, or what the method's batching
    makes of it (MethodSpec.micro_batch_rows)."""
    rows = method_of(cfg).micro_batch_rows
    return rows(cfg) if rows is not None else cfg.optim.micro_batch


def method_params(cfg) -> dict[str, float]:
    """grpo.loss's own hyperparameters: the declared upstream defaults, with grpo.params over them."""
    given = cfg.grpo.params
    return {name: float(given.get(name, p.default)) for name, p in method_of(cfg).params.items()}


def params_problem(loss: str, given: dict[str, float]) -> str | None:
    """One line naming the first grpo.params entry that grpo.loss=`loss` does not declare or that is
    out of its range; None when every one fits."""
    declared = METHODS[loss].params
    for name, value in given.items():
        p = declared.get(name)
        if p is None:
            have = ", ".join(declared) or "none"
            return f"grpo.params.{name}: grpo.loss={loss} has no parameter {name!r} (its parameters: {have})"
        if not p.low <= value <= p.high or (p.integer and value != int(value)):
            kind = "an integer" if p.integer else "a number"
            return f"grpo.params.{name} = {value}: must be {kind} in [{p.low}, {p.high}] ({p.doc})"
    return None


def kl_of(cfg) -> KLStrategy:
    """The KL terms a run's loss carries: kl.strategy's for a method that uses it, else none."""
    return KL_STRATEGIES[cfg.kl.strategy] if method_of(cfg).uses_kl_strategy else KL_STRATEGIES["none"]

"""Checks `vgrpo train` runs before it creates a run directory: every input a run reads at
start-up (prompt sets, model path, reward checkpoints, tracker packages), each failure one
line naming the field and the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from cluster.driver.pools import job_runtime_env
from cluster.plan.checks import refuse, run_checks
from cluster.plan.sizing import plan
from cluster.runs.tracking import check_installed
from common import storage
from common.config import ConfigError, RunConfig
from common.families import FAMILIES
from common.scorers import scorer_spec


def check_prompts(cfg: RunConfig) -> None:
    """Every prompt set loads and fits model.task (I2V: a first frame per row), the held-out
    health set too."""
    # lazy: torch, PIL (kept out of vgrpo --help)
    from cluster.data.manifests import check_task
    from cluster.data.prompts import load_prompts

    sets = {"train.prompts": cfg.train.prompts, "train.eval_prompts": cfg.train.eval_prompts,
            "health.eval_prompts": cfg.health.eval_prompts}
    for field, spec in sets.items():
        if spec is None:
            continue
        try:
            check_task(load_prompts(spec, cfg.data), cfg.model.task, spec)
        except ConfigError as e:
            raise ConfigError(f"{field}: {e}") from None


def check_rewards(cfg: RunConfig) -> None:
    """Every reward model has a scorer, no two report the same head name (common/rewards.py),
    a scorer whose upstream template ships with no wheel names its template_path, and reward
    checkpoints named as local paths exist; hub ids are left to the loader. Each reward node's own
    files are checked on the cluster (cluster/driver/cluster_check.py)."""
    # lazy: torch (kept out of vgrpo --help)
    from reward_worker.registry import config_heads
    from rollout_worker.models.base import is_local

    for i, m in enumerate(cfg.rewards.models):
        field = f"rewards.models[{i}]"
        try:
            spec = scorer_spec(m.name, f"{field}.name")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not spec.needs_path:
            continue
        if m.path is None:
            raise ConfigError(f"{field}.path is required for name = {m.name!r}; "
                              "point it at the downloaded checkpoint")
        for key in ("path", "base_path"):
            value = getattr(m, key)
            if value and is_local(value) and not Path(value).expanduser().exists():
                raise ConfigError(f"{field}.{key} = {value!r} does not exist; download the checkpoint "
                                  "there or fix the path")
        if spec.template_file and not spec.template_wheel and m.template_path is None:
            raise ConfigError(f"{field}.template_path is required for name = {m.name!r} (upstream's "
                              f"{spec.template_file}, never shipped here): {spec.template_how}")
    config_heads(cfg.rewards.models)


def check_model_path(cfg: RunConfig) -> None:
    """Fail before any actor starts when model.path is missing or plainly incomplete."""
    # lazy: torch (kept out of vgrpo --help)
    from rollout_worker.models.base import ModelLoadError, is_local, require_dir

    path = cfg.model.path
    if not FAMILIES[cfg.model.family].needs_path:
        if path is not None and not Path(path).exists():
            raise ModelLoadError(f"model.path {path!r} does not exist")
        # lazy: torch, safetensors (kept out of vgrpo --help)
        from rollout_worker.models.toy import ToyVideoModel
        return ToyVideoModel.check(cfg)  # damaged weights: one line here, not a traceback per actor
    if path is None:
        raise ModelLoadError(f"model.path is required for model.family = {cfg.model.family!r}")
    if is_local(path):
        require_dir(path, ["model_index.json"], f"model.family = {cfg.model.family!r}")


def check_experts(cfg: RunConfig) -> None:
    """Wan 2.2 with train_experts=high_noise: no trained step on the frozen low-noise expert, by
    the config's model.boundary_ratio or, without one, a local checkpoint's model_index.json
    (the learner checks a hub checkpoint's when it builds)."""
    from common.experts import rows_on_frozen_expert  # lazy: torch (kept out of vgrpo --help)

    boundary = cfg.model.boundary_ratio
    index = Path(cfg.model.path or "") / "model_index.json"
    if boundary is None and FAMILIES[cfg.model.family].expert_boundary and index.is_file():
        boundary = json.loads(index.read_text(encoding="utf-8")).get("boundary_ratio")
    msg = rows_on_frozen_expert(cfg, boundary)
    if msg is not None:
        raise ConfigError(msg)


def check_plan(cfg: RunConfig) -> None:
    """`vgrpo plan`'s checks on the config's own GPU (plan.gpu): a bank that holds
    bank.headroom_steps steps, timeouts that fit their work, pods (plan.pods, which the Helm
    chart writes) that hold their processes, and every pool with GPUs within plan.gpu's memory
    (unless preflight.skip_gpu_memory_check). Families without a plan (toy) are not sized."""
    if not FAMILIES[cfg.model.family].planned:
        return

    try:
        p = plan(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    refuse(run_checks(cfg, p, cfg.plan.pods))  # GPU memory first (unless preflight.skip_gpu_memory_check)


def job_run_root(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """Under `ray job submit` the entrypoint runs in Ray's per-job copy of the working directory
    (session_*/runtime_resources/working_dir_files/...), which Ray deletes: a relative run.root is
    resolved under $HOME instead. Returns the config and, when it moved, the line that says where."""
    root = cfg.run.root
    if storage.is_uri(root) or Path(root).expanduser().is_absolute() or job_runtime_env() is None:
        return cfg, None
    target = Path.home() / root
    line = (f"run.root = {root!r} is relative and this is a Ray job, whose working directory ({os.getcwd()}) "
            f"Ray deletes: runs go to {target} (under $HOME); set run.root to an absolute path on storage the "
            "head and every learner machine share to choose the place")
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"root": str(target)})}), line


def preflight(cfg: RunConfig) -> None:
    """Everything a run checks before it starts Ray, Redis or writes a file."""
    check_installed(cfg)
    check_prompts(cfg)
    check_model_path(cfg)
    check_experts(cfg)
    check_rewards(cfg)
    check_plan(cfg)


# --- training health, before any GPU is spent (cluster/health/checks.py) ----------------------------

def health_warnings(cfg: RunConfig) -> list[str]:
    """Settings users repeatedly report as silent failures, one line each (warnings, not errors).

    A prompt group split across learner ranks needs no warning here: every rank computes the
    advantages over whole groups of the full batch before its rows are split (learner/rows.py)."""
    h, out = cfg.health, []
    g, n = cfg.sampler.group_size, cfg.train.groups_per_step
    if g < h.min_group_size:
        out.append(f"sampler.group_size = {g}: advantages from fewer than {h.min_group_size} samples per group "
                   f"are mostly noise (with 2, every group's advantages are ±1 whatever the rewards); "
                   f"raise it to {h.min_group_size} or more")
    if n < h.min_groups_per_step:
        out.append(f"train.groups_per_step = {n}: one step's gradient comes from fewer than "
                   f"{h.min_groups_per_step} prompts; raise it to {h.min_groups_per_step} or more")
    drift = measured_drift(cfg)
    if drift is not None and cfg.grpo.clip_eps <= drift[0]:
        out.append(f"grpo.clip_eps = {cfg.grpo.clip_eps:g} is not above the numeric drift max |log r| = "
                   f"{drift[0]:.2e} measured at the first update of {drift[1]} (same model): ratios would be "
                   "clipped by numerics alone; fix the sampler/learner mismatch or raise grpo.clip_eps")
    return out


def measured_drift(cfg: RunConfig) -> tuple[float, Path] | None:
    """The first-update max |log r| of the newest earlier run under run.root with the same model
    (family, path, dtype), from its health.json; None when there is none."""
    # lazy: torch, rich (kept out of vgrpo --help)
    from cluster.health.hook import HEALTH_FILE, read_health

    root = Path(cfg.run.root)
    if not root.is_dir():
        return None
    want = (cfg.model.family, cfg.model.path, cfg.model.dtype)
    found: list[tuple[float, float, Path]] = []
    for path in root.glob(f"*/{HEALTH_FILE}"):
        n = (read_health(path.parent) or {}).get("numerics")
        try:
            model = (yaml.safe_load((path.parent / "config.yaml").read_text(encoding="utf-8")) or {}).get("model") or {}
            value = float(n["logratio_onpolicy_absmax"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError, yaml.YAMLError):
            continue  # no measurement, or a damaged run directory
        if (model.get("family"), model.get("path"), model.get("dtype")) == want and value == value:
            found.append((path.stat().st_mtime, value, path.parent))
    if not found:
        return None
    _, value, run = max(found, key=lambda f: f[0])
    return value, run

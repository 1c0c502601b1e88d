"""The typed config: defaults, YAML round trip, dotted overrides, and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import (
    ConfigError,
    RunConfig,
    load_config,
    save_config,
    to_yaml,
    validate,
)

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_validate_and_sections_exist():
    cfg = RunConfig()
    for section in ("model", "schedule", "sde", "sampler", "grpo", "optim", "kl", "align", "bank",
                    "rewards", "pools", "weight_sync", "train", "run"):
        assert hasattr(cfg, section)
    assert cfg.sde.resolved_eta == 0.5  # sage's default η
    assert cfg.model_copy(update={"sde": cfg.sde.model_copy(update={"scheme": "flow"})}).sde.resolved_eta == 0.7


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["sde.scheme=flow", "kl.strategy=step", "schedule.sigmas=[1.0, 0.5, 0.0]",
                             "rewards.models=[{name: videoalign, weights: {VQ: 0.5, MQ: 0.5, TA: 1.0}}]"])
    text = to_yaml(cfg)
    again = validate(yaml.safe_load(text))
    assert again == cfg
    path = tmp_path / "c.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["train.steps=7", "optim.lr=3e-4", "align.enabled=false", "model.path=/x/y"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 3e-4
    assert cfg.align.enabled is False and cfg.model.path == "/x/y"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sde:\n  scheme: dance\ntrain:\n  steps: 3\n")
    cfg = load_config(path, ["train.steps=5"])
    assert cfg.sde.scheme == "dance" and cfg.train.steps == 5


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["sde.scheme=foo"], ["sde.scheme", "'foo'", "'ode'", "'sage'"]),
        (["sde.shceme=flow"], ["sde.shceme", "unknown key"]),
        (["train.steps=many"], ["train.steps", "'many'", "integer"]),
        (["optim.lr=-1"], ["optim.lr", "-1", "greater than 0"]),
        (["optim.ema_decay=1.0"], ["optim.ema_decay", "1.0", "less than 1"]),  # 1 would never move
        (["sampler.timeout_s=0"], ["sampler.timeout_s", "0", "greater than 0"]),
        (["bank.outage_s=-5"], ["bank.outage_s", "-5", "greater than 0"]),
        (["kl.strategy=dual2"], ["kl.strategy", "'dual2'", "'moving'"]),
        (["bogus.key=1"], ["bogus", "unknown key"]),
        (["schedule.sigmas=[1.0, 0.5, 0.7]"], ["schedule", "strictly decreasing"]),
        (["sde.scheme"], ["override", "key.path=value"]),
        (["train.steps.x=1"], ["train.steps", "integer"]),
        (["train.steps=3", "train.steps.x=1"], ["train.steps", "not a section"]),
    ],
)
def test_bad_values_give_one_line_naming_the_field(overrides, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("sde:\n  scheme: [flow\n")
    with pytest.raises(ConfigError, match=r"broken.yaml.*line \d+.*malformed YAML"):
        load_config(path)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


def test_secrets_never_saved_or_shown(tmp_path):
    cfg = load_config(None, ["bank.redis_url=redis://:hunter2@db:6379/0"])
    assert cfg.bank.redis_url.get_secret_value().endswith("@db:6379/0")
    assert "hunter2" not in to_yaml(cfg)
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg)
    path = tmp_path / "saved.yaml"
    save_config(cfg, path)
    assert "hunter2" not in path.read_text()


@settings(max_examples=150, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["model", "sde", "scheme", "eta", "train", "steps", "kl", "bank", "x", "lr"]),
        children, max_size=4),
    max_leaves=12))
def test_fuzzed_config_data_raises_only_config_error(data):
    if not isinstance(data, dict):
        data = {"sde": data}
    try:
        validate(data)
    except ConfigError as e:
        assert "\n" not in str(e)


def test_every_shipped_config_validates():
    """Run configs load as RunConfig; comparison matrices (a `rows` key) validate every row."""
    from cluster.compare.matrix import load_matrix
    from common.config import read_yaml

    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs, "configs/ holds no YAML"
    kinds = {"run": 0, "matrix": 0}
    for path in configs:
        if "rows" in read_yaml(path):
            load_matrix(path).validate_all()
            kinds["matrix"] += 1
        else:
            load_config(path)
            kinds["run"] += 1
    assert kinds["run"] >= 4 and kinds["matrix"] >= 1, kinds


def test_cli_config_show_and_clean_error():
    exe = [sys.executable, "-m", "cluster.cli"]
    out = subprocess.run([*exe, "config", "show", "sde.scheme=cps"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["sde"]["scheme"] == "cps"
    bad = subprocess.run([*exe, "config", "show", "sde.scheme=nope"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("error:") and "sde.scheme" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("override, field", [
    ("optim.betas=[0.9, .nan]", "optim.betas.1"),
    ("rewards.models=[{name: toy, weights: {VQ: .inf}}]", "rewards.models.0.weights.VQ"),
    ("kl.lam=.nan", "kl.lam"),
    ("grpo.clip_eps=.nan", "grpo.clip_eps"),
])
def test_nan_and_inf_config_floats_are_rejected_naming_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert f"{field} = " in str(e.value) and "finite" in str(e.value) and "\n" not in str(e.value)


def test_sequence_parallel_degree_is_per_pool_and_bounded():
    cfg = load_config(None, ["pools.rollout.parallel.sp=2", "pools.learner.parallel.sp=4",
                             "pools.learner.num_actors=2"])
    assert (cfg.pools.rollout.parallel.sp, cfg.pools.learner.parallel.sp) == (2, 4)
    assert cfg.pools.learner.processes == 8 and cfg.pools.reward.processes == 1
    assert RunConfig().pools.rollout.parallel.sp == 1
    for bad, needle in (("pools.rollout.parallel.sp=0", "pools.rollout.parallel.sp = 0"),
                        ("pools.learner.parallel.sp=65", "pools.learner.parallel.sp = 65"),
                        ("pools.reward.parallel.sp=2", "the reward pool has no sequence parallelism")):
        with pytest.raises(ConfigError, match=needle) as e:
            load_config(None, [bad])
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.attention_backend = 'xformers' is not allowed"):
        load_config(None, ["model.attention_backend=xformers"])


def test_worker_env_reaches_the_runtime_env_of_the_ray_it_starts(monkeypatch):
    """The allocator's and the collectives' settings (config section env) are what init_ray hands
    Ray as every worker's environment (pure unit test: ray.init is recorded, not run)."""
    import ray

    from cluster.driver import pools

    cfg = load_config("configs/quickstart.yaml", ["env.nccl_socket_ifname=eth0", "env.extra={NCCL_DEBUG: WARN}"])
    seen = {}

    class Ctx:
        address_info: dict = {}

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw) or Ctx())
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    pools.init_ray(cfg)
    assert seen["runtime_env"]["env_vars"] == {
        "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"}
    unset = load_config("configs/quickstart.yaml", ["env.cuda_alloc_conf="]).env.variables()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in unset and "NCCL_SOCKET_IFNAME" not in unset

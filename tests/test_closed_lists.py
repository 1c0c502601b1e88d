"""Every closed list of names equals its registry, CLI choices come from them, no module outside
a variant's declaration and its own files tests its name, and a throwaway method or scorer
registered at test time is picked up with no other change."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path

import pytest
import torch
from helpers_registry import name_tests
from helpers_tiny import TinyVideoModel, sample_group

from cluster.cli import build_parser, main
from common import families, methods, scorers
from common.config import (
    BankConfig,
    GRPOConfig,
    KLConfig,
    ModelConfig,
    RewardModelConfig,
    RunConfig,
    SchemeName,
)
from common.sde import SCHEMES
from common.types import Condition, TrainBatch
from learner.methods.grpo import GRPO
from memory_bank.bank import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent


def _literal(model, field: str) -> set[str]:
    return set(typing.get_args(model.model_fields[field].annotation))


def test_each_literal_equals_its_registry():
    assert set(typing.get_args(SchemeName)) == set(SCHEMES)
    assert _literal(ModelConfig, "family") == set(families.FAMILIES)
    assert _literal(GRPOConfig, "loss") == set(methods.METHODS)
    assert _literal(GRPOConfig, "adv_norm") == set(methods.ADV_NORMS)
    assert _literal(KLConfig, "strategy") == set(methods.KL_STRATEGIES)
    assert _literal(BankConfig, "strategy") == set(STRATEGIES)


def test_reward_names_are_exactly_the_declared_scorers():
    for name, spec in scorers.SCORERS.items():  # each declared scorer loads (with a path where it needs one)
        RewardModelConfig(name=name, path="/ckpt" if spec.needs_path else None)
    with pytest.raises(ValueError, match=f"has no scorer; use one of {', '.join(scorers.SCORERS)}"):
        RewardModelConfig(name="ocr")  # priced once by the plan, never implemented


def _choices(parser: argparse.ArgumentParser, dest: str) -> list[list[str]]:
    """Every `choices` of an option named `dest`, in every sub-command."""
    out = []
    for action in parser._actions:
        if action.dest == dest and action.choices is not None:
            out.append(list(action.choices))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _choices(sub, dest)
    return out


def test_cli_choices_come_from_the_registries():
    found = _choices(build_parser(), "scheme")
    assert len(found) >= 3  # vgrpo sample, toy sample and toy grid
    assert all(set(c) == set(SCHEMES) for c in found), found


def test_vgrpo_sample_with_flash(tmp_path, capsys):
    out = tmp_path / "flash.gif"
    assert main(["sample", "base", "--prompt", "a red square moving left", "--scheme", "flash",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.is_file() and "composite nan" not in printed and "composite " in printed


def test_no_module_outside_a_declaration_tests_a_method_or_scorer_name():
    assert name_tests(set(methods.METHODS), {"common/methods.py"} |
                      {p.relative_to(ROOT).as_posix() for p in (ROOT / "learner/methods").glob("*.py")}) == []
    # "toy" is a model family too: the scan looks for the names only scorers use
    own = {"common/scorers.py"} | {p.relative_to(ROOT).as_posix() for p in (ROOT / "reward_worker/models").glob("*.py")}
    assert name_tests(set(scorers.SCORERS) - {"toy"}, own) == []


def test_the_name_scan_finds_comparisons_dict_keys_and_match_cases(tmp_path):
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "x.py").write_text(
        'def f(cfg):\n    if cfg.grpo.loss == "nft":\n        pass\n    y = {"nft": 1}\n'
        '    if cfg.grpo.loss in ("grpo", "other"):\n        pass\n'
        '    match cfg.grpo.loss:\n        case "nft":\n            pass\n    return y\n')
    found = name_tests({"grpo", "nft"}, set(), root=tmp_path)
    assert [f.split(":")[1] for f in found] == ["2", "4", "5", "8"], found


def test_scorer_heads_are_the_classes_heads():
    from reward_worker.registry import scorer_class

    for name, spec in scorers.SCORERS.items():
        assert tuple(scorer_class(name).heads) == spec.heads, name


class _Throwaway(GRPO):
    """A third method: GRPO with a fixed step size on its KL controller, to show it ran."""

    ran = 0

    def after_step(self, trainer, stats) -> None:
        type(self).ran += 1
        super().after_step(trainer, stats)


def test_a_method_declared_at_test_time_is_trained_with_no_other_change(monkeypatch):
    monkeypatch.setitem(methods.METHODS, "throwaway", methods.MethodSpec(
        f"{__name__}:_Throwaway", records_steps=True, uses_kl_strategy=True, anchors=methods.METHODS["grpo"].anchors))
    from learner.trainer import Trainer

    cfg = RunConfig.model_validate({"optim": {"micro_batch": 5, "lr": 1e-2, "lora_rank": 4}})
    cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"loss": "throwaway"})})
    model = TinyVideoModel()
    tr = Trainer(cfg, model).setup()
    assert isinstance(tr.method, _Throwaway)
    g = sample_group(model, Condition("c0", "prompt 0"), group_size=3, seed=1, version=0)
    g.composite = torch.stack([t.final_latents[0].mean() for t in g.members])
    st = tr.train_step(TrainBatch([g]))
    assert _Throwaway.ran == 1 and tr.version == 1 and st["grad_norm"] > 0


def test_a_scorer_declared_at_test_time_is_validated_built_and_priced(monkeypatch):
    from cluster.plan.host import reward_bytes
    from reward_worker.registry import build_reward_model, config_heads

    toy = scorers.SCORERS["toy"]
    monkeypatch.setitem(scorers.SCORERS, "throwaway", scorers.ScorerSpec(toy.impl, toy.heads, 1e9, False))
    m = RewardModelConfig(name="throwaway", dtype="bfloat16")
    assert type(build_reward_model(m)).__name__ == "ToyReward"
    assert reward_bytes(m) == 2e9
    hub = RewardModelConfig(name="videoalign", path="KwaiVGI/VideoReward", dtype="bfloat16")  # a hub id, not a dir
    assert reward_bytes(hub) == 2 * scorers.SCORERS["videoalign"].params
    assert tuple(config_heads([m]).names) == toy.heads

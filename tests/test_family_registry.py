"""Model families are declared once (common/families.py): the config's names equal the
declarations, a family declared at test time is built with no other change, and the places that
still test a family's name are the plan's architecture formulas, listed here, and may only shrink."""

from __future__ import annotations

import dataclasses
import typing
from collections import Counter
from pathlib import Path

from helpers_registry import name_tests

from common.config import ModelConfig, RunConfig
from common.families import FAMILIES

ROOT = Path(__file__).resolve().parent.parent

# The plan's per-family architecture numbers (FFN width, patch sizes, VAE compression, text tokens
# in attention), still written as branches on the name: each is to become a field of FamilySpec.
# Nothing may be added here; a site removed is removed from the list.
REMAINING = Counter({"cluster/plan/sizing.py": 11, "cluster/plan/timing.py": 2, "cluster/plan/steps.py": 1,
                     "cluster/plan/vae.py": 1})


def test_the_config_names_are_the_declared_families():
    assert set(typing.get_args(ModelConfig.model_fields["family"].annotation)) == set(FAMILIES)


def test_no_module_outside_the_declarations_tests_a_family_name_but_the_listed_plan_formulas():
    own = {"common/families.py", "common/scorers.py"}  # scorers: the reward named "toy" too
    own |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "rollout_worker/models").glob("*.py")}
    found = Counter(f.split(":")[0] for f in name_tests(set(FAMILIES), own))
    assert found == REMAINING, found


def test_a_family_declared_at_test_time_is_built_with_no_other_change(monkeypatch):
    from rollout_worker.models import build_model
    from rollout_worker.models.lora import lora_targets

    monkeypatch.setitem(FAMILIES, "throwaway", dataclasses.replace(FAMILIES["toy"], lora_targets=("to_q",)))
    cfg = RunConfig()
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"family": "throwaway"})})
    model = build_model(cfg, "cpu")
    assert type(model).__name__ == "ToyVideoModel"
    assert lora_targets("throwaway", cfg.optim) == ["to_q"]

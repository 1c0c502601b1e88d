"""Model families are declared once (common/families.py): the config's names equal the
declarations, no module outside them tests a family's name, a family declared at test time is
built with no other change, and the released checkpoints' sizes are declared so the plan sizes
them without their weights on disk."""

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
# in attention) are fields of FamilySpec now; no name branch is left anywhere.
REMAINING: Counter = Counter()


def test_the_config_names_are_the_declared_families():
    assert set(typing.get_args(ModelConfig.model_fields["family"].annotation)) == set(FAMILIES)


def test_no_module_outside_the_declarations_tests_a_family_name():
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


# Parameter counts of the released transformers, from their model cards and papers (Wan: "Wan:
# Open and Advanced Large-Scale Video Generative Models", Table 1 and the hub cards, 1.3B / 14B /
# 5B; HunyuanVideo 1.5: "8.3B parameters", its technical report). The cards round: the 1.3B model's
# 30 blocks of width 1536 hold 1.42B, so each count is held to within 10% of the card's figure.
CARD = {"Wan-AI/Wan2.1-T2V-1.3B-Diffusers": 1.3e9, "Wan-AI/Wan2.1-T2V-14B-Diffusers": 14e9,
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers": 14e9, "Wan-AI/Wan2.2-I2V-A14B-Diffusers": 14e9,
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": 5e9,
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v": 8.3e9,
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v": 8.3e9}


def test_every_release_is_declared_and_builds_on_meta_at_its_card_size():
    import diffusers
    import torch

    declared = {hub: (f, r) for f, spec in FAMILIES.items() for hub, r in spec.released.items()}
    assert set(declared) == set(CARD)
    for hub, (family, release) in declared.items():
        with torch.device("meta"):
            t = getattr(diffusers, FAMILIES[family].transformer).from_config(release.transformer)
        n = sum(p.numel() for p in t.parameters())
        assert abs(n / CARD[hub] - 1) < 0.10, (hub, n)


def test_a_release_named_by_hub_id_or_folder_name_is_sized_without_weights(tmp_path):
    from cluster.plan.sizing import arch
    from cluster.plan.vae import latent_shape

    def cfg_for(path, task="t2v", h=480, w=832, frames=81):
        cfg = RunConfig()
        model = cfg.model.model_copy(update={"family": "wan", "path": path, "task": task, "height": h,
                                             "width": w, "num_frames": frames, "boundary_ratio": None})
        return cfg.model_copy(update={"model": model})

    small = arch(cfg_for("Wan-AI/Wan2.1-T2V-1.3B-Diffusers"))
    assert (small.layers, small.width, small.ffn, small.experts) == (30, 1536, 8960, 1)
    # 81 frames -> 21 latent frames; 480x832 / 8 / 2 -> 30x52 patches
    assert small.tokens == 21 * 30 * 52
    # a local folder of the same name that holds no config yet is the same release
    assert arch(cfg_for(str(tmp_path / "Wan2.1-T2V-1.3B-Diffusers"))).params == small.params
    # TI2V-5B: the Wan 2.2 VAE's 48 channels at 16x, so 720p is 44x80 latents, 22x40 patches
    ti2v = cfg_for("Wan-AI/Wan2.2-TI2V-5B-Diffusers", h=704, w=1280, frames=121)
    assert latent_shape(ti2v) == (48, 31, 44, 80)
    five = arch(ti2v)
    assert (five.layers, five.width, five.tokens, five.experts) == (30, 3072, 31 * 22 * 40, 1)
    # Wan 2.2 A14B runs two experts; the release says so without a model_index.json on disk
    assert arch(cfg_for("Wan-AI/Wan2.2-T2V-A14B-Diffusers")).experts == 2

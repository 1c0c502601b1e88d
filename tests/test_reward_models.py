"""VideoAlign, HPSv3 and Q-Save on tiny random configs of their real transformers classes:
strict, exact loading of checkpoints whose key layout this test builds from upstream's module
structure (not from the project's code), the whole path to scores, and Q-Save's parsing
(no Ray here; nothing downloaded). Input recipes: test_reward_upstream_inputs.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from reward_tiny import char_tokenizer, qwen2_vl_config, qwen3_vl_config, videos

from common.config import RewardModelConfig
from reward_worker import prompts
from reward_worker.models import hpsv3 as hp
from reward_worker.models import qsave as qs
from reward_worker.models import videoalign as va
from reward_worker.models.qwen_inputs import RewardLoadError
from reward_worker.registry import build_reward_model

PROMPTS = ["a red square moves left", "a blue square moves up", "green", "a yellow square drifts"]


# --- the released layouts, built from upstream's module structure ----------------------
# Upstream's classes (transformers 4.45): Qwen2VLForConditionalGeneration held the vision tower
# as `visual.*`, the text model as `model.*` and `lm_head`; the reward models subclass it and
# add `rm_head`. VideoAlign wraps it in PEFT LoRA on every nn.Linear / nn.Embedding whose name
# has none of lm_head, rm_head, embed_tokens, visual, and saves the full wrapped state dict;
# HPSv3 saves the plain state dict, its rm_head an MLP hidden → 1024 → 16 → 2 with biases.


def legacy_name(current: str) -> str:
    """transformers 5 name → the 4.45 name upstream's checkpoints use (written for this test)."""
    for new, old in (("model.visual.", "visual."), ("model.language_model.", "model.")):
        if current.startswith(new):
            return old + current[len(new):]
    return current


def upstream_base_shapes(config, vocab: int) -> tuple[dict[str, tuple], set[str]]:
    """(legacy key → shape, legacy names of Linear/Embedding modules) of the base class."""
    from transformers import Qwen2VLForConditionalGeneration

    with torch.device("meta"):
        m = Qwen2VLForConditionalGeneration(config)
    shapes = {legacy_name(k): tuple(v.shape) for k, v in m.state_dict().items()}
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        shapes[k] = (vocab, shapes[k][1])                 # the reward tokens were added
    linear = {legacy_name(n) for n, mod in m.named_modules()
              if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding))}
    return shapes, linear


def videoalign_layout(config, vocab: int, r: int, output_dim: int) -> dict[str, tuple]:
    shapes, linear = upstream_base_shapes(config, vocab)
    shapes["rm_head.weight"] = (output_dim, config.text_config.hidden_size)
    excluded = ("lm_head", "rm_head", "embed_tokens", "visual")
    out = {}
    for key, shape in shapes.items():
        module, leaf = key.rsplit(".", 1)
        if module in linear and not any(x in module for x in excluded):
            out[f"base_model.model.{module}.base_layer.{leaf}"] = shape
            if leaf == "weight":
                out[f"base_model.model.{module}.lora_A.default.weight"] = (r, shape[1])
                out[f"base_model.model.{module}.lora_B.default.weight"] = (shape[0], r)
        else:
            out[f"base_model.model.{key}"] = shape
    return out


def hpsv3_layout(config, vocab: int) -> dict[str, tuple]:
    shapes, _ = upstream_base_shapes(config, vocab)
    h = config.text_config.hidden_size
    for i, (o, n) in {0: (1024, h), 3: (16, 1024), 5: (2, 16)}.items():
        shapes[f"rm_head.{i}.weight"], shapes[f"rm_head.{i}.bias"] = (o, n), (o,)
    return shapes


def random_state(layout: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.05 for k, shape in sorted(layout.items())}


def loaded_equals(state: dict[str, torch.Tensor], module: torch.nn.Module, prefix: str = "") -> None:
    """Every saved tensor sits, unchanged, at its transformers-5 name; nothing else exists."""
    renamed = {}
    for k, v in state.items():
        body = k[len(prefix):]
        for old, new in (("visual.", "model.visual."), ("model.", "model.language_model.")):
            if body.startswith(old):
                body = new + body[len(old):]
                break
        renamed[prefix + body] = v
    mine = module.state_dict()
    assert set(renamed) == set(mine), sorted(set(renamed) ^ set(mine))[:5]
    for k, v in renamed.items():
        assert torch.equal(mine[k], v), k


def save_base(tmp_path, config):
    """A base-model folder as on the hub: config and tokenizer, no weights (the checkpoint has them)."""
    base = tmp_path / "base"
    config.save_pretrained(base)
    char_tokenizer().save_pretrained(base)
    return base


# --- VideoAlign ------------------------------------------------------------------------


def write_videoalign(tmp_path, config, output_dim: int, r: int = 8, inference_config=None):
    tok = char_tokenizer()
    state = random_state(videoalign_layout(config, len(tok) + 3, r, output_dim), seed=output_dim)
    root = tmp_path / "VideoReward"
    (root / "checkpoint-3").mkdir(parents=True)
    (root / "checkpoint-12").mkdir()
    torch.save({"junk": torch.zeros(1)}, root / "checkpoint-3" / "model.pth")   # older step: ignored
    torch.save(state, root / "checkpoint-12" / "model.pth")
    meta = {"data_config": {"fps": 2.0, "max_frame_pixels": 200704, "num_frames": None,
                            "prompt_template_type": "detailed_special", "sample_type": "uniform"},
            "model_config": {"output_dim": output_dim, "reward_token": "special", "use_special_tokens": True},
            "peft_lora_config": {"lora_r": r, "lora_alpha": 2 * r}}
    if inference_config is not None:
        meta["inference_config"] = inference_config
    (root / "model_config.json").write_text(json.dumps(meta))
    checkout = tmp_path / "VideoAlign"
    checkout.mkdir()
    (checkout / "prompt_template.py").write_text(
        "DETAILED_PROMPT_WITH_SPECIAL_TOKEN = " + repr(prompts.TEST_VIDEOALIGN_TEMPLATE) + "\n")
    cfg = RewardModelConfig(name="videoalign", path=str(root), base_path=str(save_base(tmp_path, config)),
                            template_path=str(checkout), video_fps=8.0, device="cpu")
    return state, cfg


@pytest.mark.parametrize("output_dim", [1, 3])
def test_videoalign_loads_the_upstream_layout_exactly(tmp_path, output_dim):
    config = qwen2_vl_config(char_tokenizer())
    norm = {"VQ_mean": 1.0, "VQ_std": 2.0, "MQ_mean": 0.5, "MQ_std": 0.25, "TA_mean": -1.0, "TA_std": 4.0}
    state, cfg = write_videoalign(tmp_path, config, output_dim, inference_config=norm)
    model = build_reward_model(cfg)
    loaded_equals(state, model.net, prefix="base_model.model.")
    assert model.net.peft_config["default"].r == 8 and model.net.peft_config["default"].lora_alpha == 16
    assert model.template == prompts.TEST_VIDEOALIGN_TEMPLATE
    # Scores: head at the three reward tokens (output_dim 3: token i reads output i), then the
    # checkpoint's inference_config normalisation.
    v, caps = videos(2), PROMPTS[:2]
    raw = model.raw_scores(v, caps)
    inputs = model.inputs(v, caps)
    vlm = model.net.get_base_model()
    with torch.no_grad():
        hidden = vlm.model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                           pixel_values_videos=inputs.pixel_values, video_grid_thw=inputs.grid_thw,
                           position_ids=inputs.position_ids).last_hidden_state
    at = torch.stack([hidden[inputs.input_ids == model.tokenizer.convert_tokens_to_ids(t)]
                      for t in va.REWARD_TOKENS], dim=1)                        # [2, 3, D]
    head = state["base_model.model.rm_head.weight"]                              # [output_dim, D]
    expected = (at @ head.T)[..., 0] if output_dim == 1 else torch.einsum("bkd,kd->bk", at, head)
    torch.testing.assert_close(raw, expected, atol=1e-5, rtol=1e-5)
    mean, std = torch.tensor([1.0, 0.5, -1.0]), torch.tensor([2.0, 0.25, 4.0])
    torch.testing.assert_close(model.score(v, caps), (raw - mean) / std, atol=1e-5, rtol=1e-5)


def test_videoalign_without_inference_config_is_not_normalised(tmp_path):
    _, cfg = write_videoalign(tmp_path, qwen2_vl_config(char_tokenizer()), 1)
    model = build_reward_model(cfg)
    assert model.mean.tolist() == [0.0] * 3 and model.std.tolist() == [1.0] * 3
    torch.testing.assert_close(model.score(videos(1), PROMPTS[:1]), model.raw_scores(videos(1), PROMPTS[:1]))


def test_videoalign_load_is_strict(tmp_path):
    config = qwen2_vl_config(char_tokenizer())
    state, cfg = write_videoalign(tmp_path, config, 1)
    state.pop("base_model.model.rm_head.weight")
    state["base_model.model.extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "VideoReward" / "checkpoint-12" / "model.pth")
    with pytest.raises(RewardLoadError, match=r"model\.pth.*1 missing.*rm_head.*1 unexpected"):
        build_reward_model(cfg)
    (tmp_path / "VideoReward" / "model_config.json").unlink()
    with pytest.raises(RewardLoadError, match=r"model_config.json: not found"):
        build_reward_model(cfg)
    with pytest.raises(RewardLoadError, match="no model.pth"):
        va.find_checkpoint(tmp_path / "base")


def test_videoalign_batch_of_4_equals_one_by_one(tmp_path):
    _, cfg = write_videoalign(tmp_path, qwen2_vl_config(char_tokenizer()), 1)
    model = build_reward_model(cfg)
    v = videos(4, f=8, h=24, w=20, seed=3)
    batch = model.score(v, PROMPTS)
    one = torch.cat([model.score(v[i:i + 1], PROMPTS[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(batch, one, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(batch[0], batch[1])          # the video and prompt matter


# --- HPSv3 -----------------------------------------------------------------------------


def test_hpsv3_loads_the_upstream_layout_exactly(tmp_path):
    from safetensors.torch import save_file

    config = qwen2_vl_config(char_tokenizer())
    state = random_state(hpsv3_layout(config, len(char_tokenizer()) + 1), seed=5)
    save_file(state, str(tmp_path / hp.CHECKPOINT_FILE))
    templ = tmp_path / "hpsv3_src" / "hpsv3" / "dataset"
    templ.mkdir(parents=True)
    (templ / "data_collator_qwen.py").write_text(
        f"INSTRUCTION = {prompts.TEST_HPSV3_TEMPLATE.instruction!r}\n"
        f"prompt_with_special_token = {prompts.TEST_HPSV3_TEMPLATE.reward_suffix!r}\n")
    cfg = RewardModelConfig(name="hpsv3", path=str(tmp_path), base_path=str(save_base(tmp_path, config)),
                            template_path=str(tmp_path / "hpsv3_src"), video_fps=8.0, device="cpu")
    model = build_reward_model(cfg)
    loaded_equals(state, model.vlm)
    assert model.template == prompts.TEST_HPSV3_TEMPLATE and model.pixels == 256 * 28 * 28
    assert model.vlm.rm_head[0].weight.dtype == torch.float32
    s = model.score(videos(2, f=9, h=20, w=40), PROMPTS[:2])                 # frames 0, 4, 8
    assert s.shape == (2, 1) and torch.isfinite(s).all() and s[0, 0] != s[1, 0]
    state.pop("rm_head.5.bias")
    save_file(state, str(tmp_path / hp.CHECKPOINT_FILE))
    with pytest.raises(RewardLoadError, match=r"HPSv3\.safetensors.*rm_head\.5\.bias"):
        build_reward_model(cfg)


def test_hpsv3_batch_of_4_equals_one_by_one():
    tok = char_tokenizer()
    vlm = hp.build_network(qwen2_vl_config(tok), vocab_size=len(tok) + 1)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in vlm.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    model = hp.HPSv3(vlm, tok, prompts.TEST_HPSV3_TEMPLATE, video_fps=8.0, pixels=4 * 28 * 28)
    v = videos(4, seed=5)
    batch = model.score(v, PROMPTS)
    one = torch.cat([model.score(v[i:i + 1], PROMPTS[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(batch, one, atol=1e-5, rtol=1e-5)


# --- Q-Save ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("visual quality: 4\ndynamic quality: 3.5\nalignment: 5", (4.0, 3.5, 5.0)),
    ("Visual Quality: 4/5, Motion quality - 2 out of 5; text alignment = 1", (4.0, 2.0, 1.0)),
    ('{"visual_quality": 4, "dynamic_quality": 3, "alignment": 2}', (4.0, 3.0, 2.0)),
    ("Sure.\nVISUAL QUALITY: 2.25\nDynamic-Quality: 1\nAlignment score: 4.0\nThanks", (2.25, 1.0, 4.0)),
    ("visual quality: 4\nvisual quality: 4\ndynamic quality: 3\nalignment: 5", (4.0, 3.0, 5.0)),
    ("visual quality: 7\ndynamic quality: 3\nalignment: 5", None),          # outside 1…5
    ("visual quality: 0.5\ndynamic quality: 3\nalignment: 5", None),
    ("visual quality: -2\ndynamic quality: 3\nalignment: 5", None),          # a sign is unreadable
    ("visual quality: <score>\ndynamic quality: 3\nalignment: 5", None),     # rubric echoed back
    ("visual quality: 4\nvisual quality: 3\ndynamic quality: 3\nalignment: 5", None),  # ambiguous
    ("visual quality: 8/10\ndynamic quality: 3\nalignment: 5", None),        # another scale
    ("visual quality: 4\ndynamic quality: 3", None),                        # a label missing
    ("misalignment: 3 visual quality: 4 dynamic quality: 3", None),         # not the label
    ("visual quality:\n4\ndynamic quality: 3\nalignment: 5", None),         # number on another line
    ("", None),
    ("\n \n \x00 garbage 123", None),
])
def test_qsave_parser(text, expected):
    assert qs.parse_scores(text) == expected


def test_qsave_parse_path_with_stubbed_generate():
    model = qs.QSave(vlm=None, tokenizer=None)
    answers = ["visual quality: 4\ndynamic quality: 3\nalignment: 5", "I cannot rate this video.",
               "visual quality: 1.5\ndynamic quality: 2\nalignment: 2.5"]
    model.generate = lambda frames, prompts: answers[: len(prompts)]
    s = model.score(videos(3), PROMPTS[:3])
    assert s.shape == (3, 3) and s.dtype == torch.float32
    assert s[0].tolist() == [4.0, 3.0, 5.0] and s[2].tolist() == [1.5, 2.0, 2.5]
    assert all(math.isnan(x) for x in s[1].tolist())
    assert model.parse_failures == 1 and model.last_answers == answers


def test_qsave_tiny_qwen3_vl_whole_path_with_base_path_tokenizer(tmp_path, caplog):
    from transformers import Qwen3VLForConditionalGeneration

    tok = char_tokenizer()
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(qwen3_vl_config(tok)).save_pretrained(tmp_path / "ckpt")  # no tokenizer
    tok.save_pretrained(tmp_path / "base")
    cfg = RewardModelConfig(name="qsave", path=str(tmp_path / "ckpt"), video_fps=8.0, max_new_tokens=6,
                            device="cpu")
    # base_path is honoured: without it this checkpoint has no tokenizer, and the error says so.
    with pytest.raises(RewardLoadError, match=r"ckpt: no tokenizer files; set rewards.models\[\].base_path"):
        build_reward_model(cfg)
    model = build_reward_model(cfg.model_copy(update={"base_path": str(tmp_path / "base")}))
    with caplog.at_level("WARNING", logger="reward_worker.models.qsave"):
        s = model.score(videos(2), PROMPTS[:2])
    # A random evaluator writes garbage: every row is an invalid reward, counted, not a crash.
    assert s.shape == (2, 3) and torch.isnan(s).all()
    assert model.parse_failures == 2 and len(model.last_answers) == 2
    assert "invalid reward; 2 so far" in caplog.text


def test_qsave_unparsable_answer_is_an_invalid_reward_in_the_actor():
    from reward_worker.actor import RewardActor

    stub = qs.QSave(vlm=None, tokenizer=None)
    stub.generate = lambda frames, prompts: ["visual quality: 4\ndynamic quality: 3\nalignment: 5", "no idea"]
    actor = RewardActor(RewardModelConfig(name="qsave", path="unused"), factory=lambda cfg: stub)
    scores = actor.score(videos(2), PROMPTS[:2])
    assert scores.valid.tolist() == [True, False]
    assert actor.invalid_count() == 1 == stub.parse_failures


def test_qsave_is_marked_as_a_reconstruction_and_needs_a_path(capsys):
    from cluster.cli.config_cmd import show_config
    from common.config import ConfigError, load_config

    assert "reconstruction" in qs.__doc__ and "reconstruction" in prompts.QSAVE_NOTE
    with pytest.raises(ConfigError, match=r"^configs/wan22_i2v_tagrpo.yaml: rewards.models.0: Q-Save's "
                                          r"weights are not public: set path"):
        load_config("configs/wan22_i2v_tagrpo.yaml", ["rewards.models=[{name: qsave}]"])

    class Args:
        config, overrides = "configs/wan22_i2v_tagrpo.yaml", ["rewards.models=[{name: qsave, path: /q}]"]
    assert show_config(Args) == 0
    assert "# NOTE Q-Save's rubric and answer format are this project's reconstruction" in capsys.readouterr().out


def test_tagrpo_config_runs_as_written():
    """Its rewards load without a private Q-Save path: HPSv3 only, Q-Save left for the user to add."""
    from common.config import load_config

    cfg = load_config("configs/wan22_i2v_tagrpo.yaml")
    assert [m.name for m in cfg.rewards.models] == ["hpsv3"]
    assert all(m.path is not None for m in cfg.rewards.models)


# --- registry --------------------------------------------------------------------------


def test_registry_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="has no scorer; use one of toy"):  # refused when the config loads
        RewardModelConfig(name="ocr")
    with pytest.raises(ValueError, match="rewards.models.*ocr"):  # and by the registry (e.g. a model_construct)
        build_reward_model(RewardModelConfig.model_construct(name="ocr"))
    with pytest.raises(RewardLoadError, match="path is not set"):
        build_reward_model(RewardModelConfig(name="videoalign"))
    with pytest.raises(RewardLoadError, match="HPSv3.safetensors"):
        build_reward_model(RewardModelConfig(name="hpsv3", path=str(tmp_path)))


def test_registry_builds_toy():
    pytest.importorskip("reward_worker.models.toy")
    model = build_reward_model(RewardModelConfig(name="toy", weights={"TA": 2.0}))
    assert type(model).__name__ == "ToyReward" and model.weights["TA"] == 2.0

"""VideoAlign, HPSv3 and Q-Save on tiny random configs of their real transformers classes:
the whole path from uint8 frames and prompts to scores, and strict, exact checkpoint loading
in the released key layouts (no Ray here; nothing downloaded)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from reward_tiny import char_tokenizer, qwen2_vl_config, qwen3_vl_config, videos

from common.config import RewardModelConfig
from reward_worker.models import hpsv3 as hp
from reward_worker.models import qsave as qs
from reward_worker.models import videoalign as va
from reward_worker.models.qwen_inputs import RewardLoadError
from reward_worker.registry import build_reward_model

PROMPTS = ["a red square moves left", "a blue square moves up", "green", "a yellow square drifts"]


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every weight random (LoRA B included, which PEFT starts at zero) so equality means something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def save_base(tmp_path, config):
    """A base-model folder as on the hub: config and tokenizer, no weights (the checkpoint has them)."""
    base = tmp_path / "base"
    config.save_pretrained(base)
    char_tokenizer().save_pretrained(base)
    return base


# --- VideoAlign ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def videoalign():
    tok = char_tokenizer()
    config = qwen2_vl_config(tok)
    net = va.build_network(config, vocab_size=len(tok) + len(va.REWARD_TOKENS))
    randomize(net, 0)
    return va.VideoAlign(net, tok, video_fps=8.0), config


def test_videoalign_lora_layout():
    tok = char_tokenizer()
    net = va.build_network(qwen2_vl_config(tok))
    assert (net.peft_config["default"].r, net.peft_config["default"].lora_alpha) == (64, 128)
    lora = [n for n, _ in net.named_modules() if n.endswith("lora_A")]
    assert len(lora) == 7                                  # q k v o gate up down of the one layer
    assert all(".language_model." in n for n in lora)


def test_videoalign_whole_path(videoalign):
    model, _ = videoalign
    s = model.score(videos(2), PROMPTS[:2])
    assert s.shape == (2, 3) and s.dtype == torch.float32 and torch.isfinite(s).all()
    raw = model.raw_scores(videos(2), PROMPTS[:2])
    mean = torch.tensor([va.PUBLISHED_NORM[h][0] for h in model.heads])
    std = torch.tensor([va.PUBLISHED_NORM[h][1] for h in model.heads])
    torch.testing.assert_close(s, (raw - mean) / std)
    assert not torch.allclose(raw[0], raw[1])              # the video and prompt matter


def test_videoalign_batch_of_4_equals_one_by_one(videoalign):
    model, _ = videoalign
    v = videos(4, f=8, h=24, w=20, seed=3)
    batch = model.score(v, PROMPTS)
    one = torch.cat([model.score(v[i:i + 1], PROMPTS[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(batch, one, atol=1e-5, rtol=1e-5)


def test_videoalign_norm_override(videoalign):
    model, _ = videoalign
    plain = va.VideoAlign(model.net, char_tokenizer(), video_fps=8.0, norm={})   # no normalisation
    torch.testing.assert_close(plain.score(videos(1), PROMPTS[:1]), model.raw_scores(videos(1), PROMPTS[:1]))


def test_videoalign_released_checkpoint_round_trip(videoalign, tmp_path):
    model, config = videoalign
    state = va.released_state_dict(model.net)
    for key in ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
                "base_model.model.model.layers.0.mlp.down_proj.base_layer.weight",
                "base_model.model.model.embed_tokens.weight", "base_model.model.visual.blocks.0.attn.qkv.weight",
                "base_model.model.visual.merger.mlp.0.weight", "base_model.model.rm_head.weight",
                "base_model.model.lm_head.weight"]:
        assert key in state, key
    assert not any(k.startswith("base_model.model.model.language_model") for k in state)
    # The released folder: model_config.json and checkpoint-<step>/model.pth (older steps ignored).
    ckpt_dir = tmp_path / "VideoReward"
    (ckpt_dir / "checkpoint-3").mkdir(parents=True)
    (ckpt_dir / "checkpoint-12").mkdir()
    torch.save({"junk": torch.zeros(1)}, ckpt_dir / "checkpoint-3" / "model.pth")
    torch.save(state, ckpt_dir / "checkpoint-12" / "model.pth")
    (ckpt_dir / "model_config.json").write_text(json.dumps({"peft_lora_config": {"lora_r": 64, "lora_alpha": 128}}))
    cfg = RewardModelConfig(name="videoalign", path=str(ckpt_dir), base_path=str(save_base(tmp_path, config)),
                            video_fps=8.0, device="cpu")
    loaded = build_reward_model(cfg)
    mine, theirs = model.net.state_dict(), loaded.net.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert loaded.token_ids == model.token_ids
    torch.testing.assert_close(loaded.score(videos(2), PROMPTS[:2]), model.score(videos(2), PROMPTS[:2]),
                               atol=0, rtol=0)


def test_videoalign_load_is_strict(videoalign, tmp_path):
    model, config = videoalign
    state = va.released_state_dict(model.net)
    state.pop("base_model.model.rm_head.weight")
    state["base_model.model.extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "model.pth")
    cfg = RewardModelConfig(name="videoalign", path=str(tmp_path / "model.pth"),
                            base_path=str(save_base(tmp_path, config)))
    with pytest.raises(RewardLoadError, match=r"model\.pth.*1 missing.*rm_head.*1 unexpected"):
        build_reward_model(cfg)
    with pytest.raises(RewardLoadError, match="no model.pth"):
        va.find_checkpoint(tmp_path / "base")


# --- HPSv3 -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hpsv3():
    tok = char_tokenizer()
    config = qwen2_vl_config(tok)
    vlm = hp.build_network(config, vocab_size=len(tok) + 1)
    randomize(vlm, 1)
    return hp.HPSv3(vlm, tok, video_fps=8.0, image_size=56), config


def test_hpsv3_head_shape():
    head = hp.reward_head(32)
    assert [tuple(head[i].weight.shape) for i in (0, 3, 5)] == [(1024, 32), (16, 1024), (2, 16)]


def test_hpsv3_video_is_mean_over_2fps_frames(hpsv3):
    model, _ = hpsv3
    v = videos(2)                                           # 6 frames at 8 fps → frames 0, 2, 3, 5
    s = model.score(v, PROMPTS[:2])
    assert s.shape == (2, 1) and torch.isfinite(s).all()
    per_frame = model.score_images(v[1, [0, 2, 3, 5]], [PROMPTS[1]] * 4)
    torch.testing.assert_close(s[1, 0], per_frame.mean(), atol=1e-5, rtol=1e-5)
    assert per_frame.std() > 0                              # frames differ, so the mean is not trivial


def test_hpsv3_batch_of_4_equals_one_by_one(hpsv3):
    model, _ = hpsv3
    v = videos(4, seed=5)
    batch = model.score(v, PROMPTS)
    one = torch.cat([model.score(v[i:i + 1], PROMPTS[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(batch, one, atol=1e-5, rtol=1e-5)


def test_hpsv3_released_safetensors_round_trip(hpsv3, tmp_path):
    from safetensors.torch import save_file

    model, config = hpsv3
    state = hp.released_state_dict(model.vlm)
    for key in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "visual.blocks.0.attn.qkv.weight",
                "lm_head.weight", "rm_head.0.weight", "rm_head.3.weight", "rm_head.5.bias"]:
        assert key in state, key
    save_file({k: v.clone().contiguous() for k, v in state.items()}, str(tmp_path / hp.CHECKPOINT_FILE))
    cfg = RewardModelConfig(name="hpsv3", path=str(tmp_path), base_path=str(save_base(tmp_path, config)),
                            video_fps=8.0, device="cpu")
    loaded = build_reward_model(cfg)
    mine, theirs = model.vlm.state_dict(), loaded.vlm.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert loaded.image_size == 448
    loaded.image_size = model.image_size
    torch.testing.assert_close(loaded.score(videos(1), PROMPTS[:1]), model.score(videos(1), PROMPTS[:1]),
                               atol=0, rtol=0)
    state.pop("rm_head.5.bias")
    save_file({k: v.clone().contiguous() for k, v in state.items()}, str(tmp_path / hp.CHECKPOINT_FILE))
    with pytest.raises(RewardLoadError, match=r"HPSv3\.safetensors.*rm_head\.5\.bias"):
        build_reward_model(cfg)


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


def test_qsave_tiny_qwen3_vl_whole_path(tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    tok = char_tokenizer()
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(qwen3_vl_config(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model = build_reward_model(RewardModelConfig(name="qsave", path=str(tmp_path), video_fps=8.0,
                                                 max_new_tokens=6, device="cpu"))
    s = model.score(videos(2), PROMPTS[:2])
    # A random evaluator writes garbage: every row is a counted failure, not a crash.
    assert s.shape == (2, 3) and torch.isnan(s).all()
    assert model.parse_failures == 2 and len(model.last_answers) == 2
    assert all(isinstance(a, str) for a in model.last_answers)


# --- registry --------------------------------------------------------------------------


def test_registry_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="rewards.models.*ocr"):
        build_reward_model(RewardModelConfig(name="ocr"))
    with pytest.raises(RewardLoadError, match="path is not set"):
        build_reward_model(RewardModelConfig(name="videoalign"))
    with pytest.raises(RewardLoadError, match="HPSv3.safetensors"):
        build_reward_model(RewardModelConfig(name="hpsv3", path=str(tmp_path)))


def test_registry_builds_toy():
    pytest.importorskip("reward_worker.models.toy")
    model = build_reward_model(RewardModelConfig(name="toy", weights={"TA": 2.0}))
    assert type(model).__name__ == "ToyReward" and model.weights["TA"] == 2.0

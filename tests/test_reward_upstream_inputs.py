"""The scorers' inputs against an independent re-implementation of the released recipes.

The reference below is written here from what upstream's inference code does (read on
GitHub / in the `hpsv3` wheel, never copied), using transformers' own pieces where they exist:

VideoAlign (KwaiVGI/VideoAlign inference.py, vision_process.py, train_reward.py):
- one user message: [video, text], text = template.format(text_prompt=caption), rendered with
  the Qwen2-VL chat template (default system turn) and add_generation_prompt;
- frames: n = clamp(F / video_fps · fps, 4, min(768, F) floored to even), rounded to even,
  capped at F; indices linspace(0, F-1, n) rounded;
- resize: smart_resize(factor 28, min 128·28², max data_config.max_frame_pixels), bicubic with
  antialias on uint8, then rescale 1/255, CLIP mean/std, 14-px patches, temporal 2, merge 2;
- the processor repeats the video pad token grid.prod() / 4 times; right padding;
- the model calls the text model with no position ids: positions 0…L-1 on every rope axis;
- scores: head at the reward tokens in sequence order (VQ, MQ, TA), (s - mean) / std with
  model_config.json inference_config.

HPSv3 (hpsv3 wheel: inference.py, dataset/utils.py, model/qwen2vl_trainer.py):
- one user message: [image, text], text = INSTRUCTION.format(text_prompt) + the closing text
  holding <|Reward|>, so the reward token is inside the user turn;
- each image: smart_resize(factor 28, min = max = 256·28²), bicubic antialias, then the
  Qwen2-VL image processor;
- a video is the mean μ over frames taken every 1/2 s.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reward_tiny import char_tokenizer, qwen2_vl_config, videos

from common.config import RewardModelConfig
from reward_worker import prompts
from reward_worker.models import hpsv3 as hp
from reward_worker.models import videoalign as va

CAPTION = "a red fox {jumps} over a log"           # braces: format() must fill only the template field
VIDEO_FPS = 8.0

# Placeholder templates (this test's own words) in upstream's structure: VideoAlign's VQ and MQ
# tokens before the caption, TA after it; HPSv3's reward token in the closing text.
PLACEHOLDER_VA = ("\nJudge it.\nLooks: <|VQ_reward|>\nEND\nMoves: <|MQ_reward|>\nEND\n"
                  "Prompt - {text_prompt}\nFits: <|TA_reward|>\nEND\n")
PLACEHOLDER_HPS_INSTRUCTION = "\nRate the picture for the prompt {text_prompt}.\n"
PLACEHOLDER_HPS_SUFFIX = "\nOverall: <|Reward|>\n\nEND\n"

QWEN2_VL_CHAT = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""The Qwen2-VL chat layout for a user turn of visual inputs and text (written for this test)."""

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


# --- the reference recipe --------------------------------------------------------------


def ref_smart_resize(h, w, lo, hi):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(h, w, 28, lo, hi)


def ref_video_frames(num_frames, video_fps, fps=2.0):
    even = lambda x: round(x / 2) * 2                                     # noqa: E731
    lo, hi = math.ceil(4 / 2) * 2, math.floor(min(768, num_frames) / 2) * 2
    n = min(even(min(max(num_frames / video_fps * fps, lo), hi)), num_frames)
    return torch.linspace(0, num_frames - 1, n).round().long().tolist()


def ref_bicubic_uint8(frames_thwc, h, w):
    x = torch.from_numpy(np.ascontiguousarray(frames_thwc)).permute(0, 3, 1, 2).float()
    if x.shape[-2:] == (h, w):
        return x
    return F.interpolate(x, size=(h, w), mode="bicubic", antialias=True).round().clamp(0, 255)


def ref_video_patches(frames_tchw):
    """Qwen2-VL's documented patch layout: t/2 × h/14 × w/14 patches, ordered by 2×2 merge window."""
    x = (frames_tchw.numpy() / 255.0 - CLIP_MEAN[:, None, None]) / CLIP_STD[:, None, None]
    T, C, H, W = x.shape
    if T % 2:
        x = np.concatenate([x, x[-1:]])
    gt, gh, gw = x.shape[0] // 2, H // 14, W // 14
    x = x.reshape(gt, 2, C, gh // 2, 2, 14, gw // 2, 2, 14)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return torch.from_numpy(x.reshape(gt * gh * gw, C * 2 * 14 * 14).astype(np.float32)), [gt, gh, gw]


def ref_tokens(tok, contents_per_row, kind, counts):
    """Render with the chat template, repeat each pad token as the processor does, pad right."""
    pad = {"image": "<|image_pad|>", "video": "<|video_pad|>"}[kind]
    rows = []
    for content, n in zip(contents_per_row, counts, strict=True):
        text = tok.apply_chat_template([{"role": "user", "content": content}], chat_template=QWEN2_VL_CHAT,
                                       tokenize=False, add_generation_prompt=True)
        assert text.count(pad) == 1
        rows.append(tok(text.replace(pad, pad * n), add_special_tokens=False)["input_ids"])
    L = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (L - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows])
    return ids, mask


def ref_plain_positions(ids):
    B, L = ids.shape
    return torch.arange(L).expand(3, B, L)


# --- VideoAlign ------------------------------------------------------------------------


def write_checkout(tmp_path, template):
    """A stand-in for a KwaiVGI/VideoAlign checkout: only prompt_template.py, with our template."""
    d = tmp_path / "VideoAlign"
    d.mkdir()
    (d / "prompt_template.py").write_text(
        "OTHER = 'not this one'\nDETAILED_PROMPT_WITH_SPECIAL_TOKEN = " + repr(template) + "\n"
        "def build_prompt(prompt, dimension, template_type):\n    raise RuntimeError('never run')\n")
    return d


@pytest.fixture(scope="module")
def videoalign_model():
    tok = char_tokenizer()
    net = va.build_network(qwen2_vl_config(tok), vocab_size=len(tok) + 3)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    recipe = va.Recipe.from_model_config(
        {"data_config": {"fps": 2.0, "max_frame_pixels": 200704, "prompt_template_type": "detailed_special"},
         "model_config": {"output_dim": 1}, "inference_config": {
             "VQ_mean": 1.5, "VQ_std": 2.0, "MQ_mean": -0.5, "MQ_std": 0.5, "TA_mean": 0.25, "TA_std": 4.0}},
        "model_config.json")
    return va.VideoAlign(net, tok, PLACEHOLDER_VA, video_fps=VIDEO_FPS, recipe=recipe)


def test_videoalign_inputs_match_the_released_recipe(videoalign_model, tmp_path):
    model = videoalign_model
    # The template reaches the model from the checkout's file, read without running it.
    assert prompts.videoalign_template(str(write_checkout(tmp_path, PLACEHOLDER_VA))) == PLACEHOLDER_VA
    vids = torch.cat([videos(1, f=12, h=40, w=72, seed=7), videos(1, f=12, h=40, w=72, seed=8)])
    caps = [CAPTION, "tiny"]
    got = model.inputs(vids, caps)
    # Reference: frames, resize, patches, then the chat text with expanded pad tokens.
    idx = ref_video_frames(12, VIDEO_FPS)
    assert idx == [0, 4, 7, 11]                      # 1.5 s at 2 fps → 3 → clamped to 4
    h, w = ref_smart_resize(40, 72, 128 * 28 * 28, 200704)
    pix, counts, grids = [], [], []
    for v in vids:
        p, g = ref_video_patches(ref_bicubic_uint8(v[idx].numpy(), h, w))
        pix.append(p)
        grids.append(g)
        counts.append(math.prod(g) // 4)
    contents = [[{"type": "video"}, {"type": "text", "text": PLACEHOLDER_VA.format(text_prompt=c)}] for c in caps]
    ids, mask = ref_tokens(model.tokenizer, contents, "video", counts)
    assert torch.equal(got.input_ids, ids) and torch.equal(got.attention_mask, mask)
    assert got.grid_thw.tolist() == grids
    torch.testing.assert_close(got.pixel_values, torch.cat(pix), atol=1e-5, rtol=0)
    assert torch.equal(got.position_ids, ref_plain_positions(ids))
    # Token order: VQ and MQ before the caption, TA after it, all inside the user turn.
    text = "".join(model.tokenizer.convert_ids_to_tokens(got.input_ids[0]))
    at = {t: text.index(t) for t in va.REWARD_TOKENS}
    cap = text.index(CAPTION)
    assert at["<|VQ_reward|>"] < at["<|MQ_reward|>"] < cap < at["<|TA_reward|>"] < text.index("<|im_start|>assistant")


def test_videoalign_scores_match_reference_forward(videoalign_model):
    model = videoalign_model
    vids, caps = videos(2, f=12, h=40, w=72, seed=3), [CAPTION, "a cat"]
    got = model.inputs(vids, caps)
    vlm = model.net.get_base_model()
    # transformers' own vision merge, with the plain positions upstream's text-model call used.
    with torch.no_grad():
        hidden = vlm.model(input_ids=got.input_ids, attention_mask=got.attention_mask,
                           pixel_values_videos=got.pixel_values, video_grid_thw=got.grid_thw,
                           position_ids=ref_plain_positions(got.input_ids)).last_hidden_state
        logits = vlm.rm_head(hidden)                                           # [B, L, 1]
    special = torch.zeros_like(got.input_ids, dtype=torch.bool)
    for t in va.REWARD_TOKENS:
        special |= got.input_ids == model.tokenizer.convert_tokens_to_ids(t)
    raw = logits[special].view(2, 3)                                          # sequence order: VQ, MQ, TA
    expected = (raw - torch.tensor([1.5, -0.5, 0.25])) / torch.tensor([2.0, 0.5, 4.0])
    torch.testing.assert_close(model.score(vids, caps), expected, atol=1e-5, rtol=1e-5)


# --- HPSv3 -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hpsv3_model():
    tok = char_tokenizer()
    vlm = hp.build_network(qwen2_vl_config(tok), vocab_size=len(tok) + 1)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in vlm.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    template = prompts.HPSv3Template(PLACEHOLDER_HPS_INSTRUCTION, PLACEHOLDER_HPS_SUFFIX)
    return hp.HPSv3(vlm, tok, template, video_fps=VIDEO_FPS, pixels=16 * 28 * 28)


def test_hpsv3_inputs_match_the_released_recipe(hpsv3_model):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = hpsv3_model
    frames = videos(1, f=2, h=30, w=90, seed=4)[0]                # a wide frame: aspect kept
    caps = [CAPTION, "b"]
    got = model.inputs(frames, caps)
    h, w = ref_smart_resize(30, 90, 16 * 28 * 28, 16 * 28 * 28)
    assert (h, w) == (84, 196)                                # 30·β, 90·β with β = √(12544/2700), ceil to 28
    resized = ref_bicubic_uint8(frames.numpy(), h, w).to(torch.uint8)          # [2, 3, h, w]
    proc = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    ref = proc(images=[r.permute(1, 2, 0).numpy() for r in resized], return_tensors="pt")
    counts = [int(g.prod()) // 4 for g in ref["image_grid_thw"]]
    text = [PLACEHOLDER_HPS_INSTRUCTION.format(text_prompt=c) + PLACEHOLDER_HPS_SUFFIX for c in caps]
    ids, mask = ref_tokens(model.tokenizer, [[{"type": "image"}, {"type": "text", "text": t}] for t in text],
                           "image", counts)
    assert torch.equal(got.input_ids, ids) and torch.equal(got.attention_mask, mask)
    assert torch.equal(got.grid_thw, ref["image_grid_thw"])
    torch.testing.assert_close(got.pixel_values, ref["pixel_values"], atol=1e-5, rtol=0)
    assert torch.equal(got.position_ids, ref_plain_positions(ids))
    # The reward token is inside the user turn, not after `assistant`.
    row = "".join(model.tokenizer.convert_ids_to_tokens(got.input_ids[0]))
    assert row.index("<|Reward|>") < row.index("<|im_end|>\n<|im_start|>assistant")


def test_hpsv3_video_is_mean_over_frames_every_half_second(hpsv3_model):
    model = hpsv3_model
    v = videos(2, f=13, h=28, w=28, seed=6)                       # 1.625 s at 8 fps → t = 0, 0.5, 1, 1.5
    assert model.frame_indices(13).tolist() == [0, 4, 8, 12]
    s = model.score(v, ["x", "y"])
    per = model.score_images(v[1, [0, 4, 8, 12]], ["y"] * 4)
    torch.testing.assert_close(s[1, 0], per.mean(), atol=1e-5, rtol=1e-5)
    # μ itself: the head's first output at the reward token, from transformers' own forward.
    got = model.inputs(v[1, :1], ["y"])
    with torch.no_grad():
        hidden = model.vlm.model(input_ids=got.input_ids, attention_mask=got.attention_mask,
                                 pixel_values=got.pixel_values, image_grid_thw=got.grid_thw,
                                 position_ids=ref_plain_positions(got.input_ids)).last_hidden_state
    at = got.input_ids[0] == model.tokenizer.convert_tokens_to_ids("<|Reward|>")
    torch.testing.assert_close(per[0], model.vlm.rm_head(hidden[0, at].float())[0, 0], atol=1e-5, rtol=1e-5)


def _wheel_constants():
    """The installed wheel's two strings, found through its file list and a regex (not the
    project's locator or its ast reader)."""
    try:
        files = importlib.metadata.files("hpsv3") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the hpsv3 wheel is not installed (make install adds it)")
    src = next(f for f in files if str(f).endswith("dataset/data_collator_qwen.py")).read_text()
    get = lambda name: re.search(rf'^{name} = """(.*?)"""', src, re.S | re.M).group(1)  # noqa: E731
    return get("INSTRUCTION"), get("prompt_with_special_token")


def test_hpsv3_real_template_from_the_wheel(hpsv3_model):
    instruction, suffix = _wheel_constants()
    t = prompts.hpsv3_template()
    assert (t.instruction, t.reward_suffix) == (instruction, suffix)
    assert t.user_text(CAPTION) == instruction.format(text_prompt=CAPTION) + suffix
    real = hp.HPSv3(hpsv3_model.vlm, char_tokenizer(), t, video_fps=VIDEO_FPS, pixels=16 * 28 * 28)
    ids = real.inputs(videos(1, f=1, h=28, w=28)[0], [CAPTION]).input_ids[0]
    assert int((ids == real.token_id).sum()) == 1
    assert CAPTION in "".join(real.tokenizer.convert_ids_to_tokens(ids))


# --- upstream text is never in the repository, and is refused when absent -------------


def test_missing_upstream_templates_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(prompts.TemplateError, match=r"git clone https://github.com/KwaiVGI/VideoAlign"):
        prompts.videoalign_template(None)
    with pytest.raises(prompts.TemplateError, match=r"prompt_template.py: not found"):
        prompts.videoalign_template(str(tmp_path))
    (tmp_path / "prompt_template.py").write_text("X = 1\n")
    with pytest.raises(prompts.TemplateError, match="no string constant"):
        prompts.videoalign_template(str(tmp_path))
    with pytest.raises(prompts.TemplateError, match="pip install --no-deps hpsv3"):
        prompts.hpsv3_template(str(tmp_path / "nowhere"))
    monkeypatch.setattr(prompts.importlib.util, "find_spec", lambda name: None)     # wheel not installed
    with pytest.raises(prompts.TemplateError, match=r"^HPSv3 needs upstream's instruction text: pip install "
                                                    r"--no-deps hpsv3"):
        prompts.hpsv3_template()


def test_real_videoalign_checkpoint_without_checkout_is_refused(tmp_path):
    from reward_worker.registry import build_reward_model

    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "model.pth").write_bytes(b"")
    (tmp_path / "model_config.json").write_text(json.dumps({"data_config": {}}))
    with pytest.raises(prompts.TemplateError, match=r"^VideoAlign needs upstream's prompt template: git clone"):
        build_reward_model(RewardModelConfig(name="videoalign", path=str(tmp_path)))


def test_no_upstream_sentence_is_committed():
    """No line of the wheel's HPSv3 text appears in the project's sources or configs."""
    from pathlib import Path

    instruction, suffix = _wheel_constants()
    lines = [ln.strip() for ln in (instruction + suffix).splitlines() if len(ln.strip()) > 30]
    assert len(lines) >= 3
    root = Path(__file__).resolve().parents[1]
    for path in list((root / "reward_worker").rglob("*.py")) + list((root / "configs").glob("*.yaml")):
        text = path.read_text()
        assert not any(ln in text for ln in lines), path

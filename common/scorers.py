"""Reward models as declarations: one `ScorerSpec` per `rewards.models[].name`.

Each entry names its implementation by a lazy path (imported only when the scorer is built: a toy
run never imports transformers), the heads it reports, the released checkpoint's size (the plan's
host table) and whether it needs a checkpoint. The config's validation, the plan, the preflight
and the reward registry read it; adding a reward model is its module, this entry, and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common import toyscore, toyworld


@dataclass(frozen=True)
class ScorerGPU:
    """What `vgrpo plan` needs to size one scoring forward on the GPU (from the released configs):
    the language model's and the vision tower's (width, FFN width), the pixels of one merged
    visual token (it is also 4 vision patches), the most pixels a sampled frame is resized to,
    the pixel budget a sampled frame is resized within, and whether frames are rated one by one as
    images (else as one video, 2 frames per token)."""
    lm: tuple[int, int]
    vision: tuple[int, int]
    token_pixels: int
    pixels: tuple[int, int]     # (min, max) pixels of a resized frame
    per_frame: bool = False


@dataclass(frozen=True)
class ScorerSpec:
    impl: str                 # "module:Class", a reward_worker.base.RewardModel
    heads: tuple[str, ...]    # the scores it reports, in order (the class says the same: tested)
    params: float             # parameters of the released checkpoint (the plan's host RAM and GPU)
    needs_path: bool          # rewards.models[].path must name a checkpoint (toy scorers: none)
    notes: str = ""           # what a user should know before choosing it
    caveat: str = ""          # said whenever a config uses it (`vgrpo config show`, the scorer's load log)
    path_at_load: str = ""    # when set, a config without rewards.models[].path is refused as it loads, with this
    grammar: Callable[[str], object] | None = None
    """Reads a prompt, raising ValueError (saying why) for one the scorer cannot score (it would
    score NaN); None: any text. `vgrpo sample` refuses such a prompt before sampling."""
    gpu: ScorerGPU | None = None  # its forward's sizes (the plan's reward rank); None: nothing on a GPU
    template_file: str = ""   # upstream's template file inside rewards.models[].template_path (a checkout or wheel)
    template_wheel: str = ""  # the package that carries it when template_path is None ("": template_path is required)
    template_how: str = ""    # how to get it


# Qwen2-VL-2B / -7B and Qwen3-VL-8B (their config.json): LM (hidden_size, intermediate_size), vision
# tower (embed_dim or hidden_size, its MLP width); a merged token covers (patch·2)² pixels. The
# pixel budgets are the scorers' own (reward_worker/models: VideoAlign's VIDEO_MIN_PIXELS and
# max_frame_pixels as released, HPSv3's PIXELS, Q-Save's MIN_PIXELS and MAX_PIXELS).
_QWEN2_VL_2B = ScorerGPU((1536, 8960), (1280, 5120), 28 * 28, (128 * 28 * 28, 200_704))
_QWEN2_VL_7B_FRAMES = ScorerGPU((3584, 18944), (1280, 5120), 28 * 28, (256 * 28 * 28, 256 * 28 * 28),
                                per_frame=True)
_QWEN3_VL_8B = ScorerGPU((4096, 12288), (1152, 4304), 32 * 32, (64 * 32 * 32, 192 * 32 * 32))


SCORERS: dict[str, ScorerSpec] = {
    "toy": ScorerSpec("reward_worker.models.toy:ToyReward", toyscore.HEADS, 0.0, False,
                      "the toy world's verifiable rewards (common/toyscore.py)", grammar=toyworld.parse_prompt),
    "toy_i2v": ScorerSpec("reward_worker.models.toy:ToyI2VReward", toyscore.I2V_HEADS, 0.0, False,
                          "the toy rewards plus first-frame agreement", grammar=toyworld.parse_prompt),
    "videoalign": ScorerSpec("reward_worker.models.videoalign:VideoAlign", ("VQ", "MQ", "TA"), 2.21e9, True,
                             "VideoAlign (VideoReward) on Qwen2-VL-2B; template_path: a KwaiVGI/VideoAlign checkout",
                             gpu=_QWEN2_VL_2B, template_file="prompt_template.py",
                             template_how="git clone https://github.com/KwaiVGI/VideoAlign and set "
                                          "rewards.models[].template_path to that folder"),
    "hpsv3": ScorerSpec("reward_worker.models.hpsv3:HPSv3", ("HPS",), 8.29e9, True,
                        "HPSv3 on Qwen2-VL-7B, per frame; its template is read from the hpsv3 wheel",
                        gpu=_QWEN2_VL_7B_FRAMES,
                        template_file="hpsv3/dataset/data_collator_qwen.py", template_wheel="hpsv3",
                        template_how="pip install --no-deps hpsv3 (or set rewards.models[].template_path to its folder)"),
    "qsave": ScorerSpec("reward_worker.models.qsave:QSave", ("visual_quality", "dynamic_quality", "alignment"),
                        8.77e9, True, "Q-Save on Qwen3-VL-8B, for a checkpoint you supply",
                        caveat="Q-Save's rubric and answer format are this project's reconstruction; its "
                               "weights and prompt are not public",
                        path_at_load="Q-Save's weights are not public: set path to your Qwen3-VL Q-Save "
                                     "checkpoint, or remove the qsave entry", gpu=_QWEN3_VL_8B),
}


def scorer_spec(name: str, field: str = "rewards.models[].name") -> ScorerSpec:
    """The declaration of a reward model, or one line naming the field and the choices."""
    if name not in SCORERS:
        raise ValueError(f"{field} = {name!r} has no scorer; use one of {', '.join(SCORERS)}")
    return SCORERS[name]

"""A run's trained policy in the formats users take away (`vgrpo export`).

- A LoRA run becomes diffusers' LoRA file, `pytorch_lora_weights.safetensors`, written by the
  pipeline class's own `save_lora_weights` (keys `transformer.<module>.lora_A.weight`, the adapter's
  rank, alpha and target modules in the file's metadata, so `load_lora_weights` rebuilds the same
  adapter). A Wan 2.2 run that trained both experts gets a second file for `transformer_2`.
- A full fine-tune becomes a `transformer/` folder (diffusers' `save_pretrained` of the
  transformer class: config.json + safetensors, sharded when large); with `pipeline` the base's
  other components are linked (or copied) beside it, a folder `from_pretrained` loads whole.
- The toy world's transformer is diffusers' WanTransformer3DModel: it exports the same way, and
  its `--pipeline` folder (transformer/ + toy.json) is what ToyVideoModel.from_pretrained reads.
- The weights are the checkpoint's policy (`policy/`, diffusers' sharded layout; or a legacy
  `policy.safetensors`): the moving average with optim.ema_decay, else the trained weights; the
  model card (README.md) and vgrpo_export.json say which. A full fine-tune's shards are checked
  against the base's transformer (names, shapes, every value finite) and linked (or copied, one
  shard at a time) into the folder: no host holds the whole model.

The folder is written whole into a temp folder beside `out`, then renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from cluster.runs.model_card import load_snippet, model_card
from cluster.runs.policy_file import POLICY_FILE, PolicyFiles, check_finite, resolve_target
from common import storage
from common.config import ConfigError, RunConfig
from common.families import FAMILIES
from common.policy_layout import CONFIG_FILE, WEIGHTS_INDEX
from learner.checkpoint import PREFIX, CheckpointError
from rollout_worker.models.base import is_local
from rollout_worker.models.toy import DIR_META, ToyVideoModel

LORA_FILE = "pytorch_lora_weights.safetensors"   # diffusers' LORA_WEIGHT_NAME_SAFE
EXPERT_LORA_FILES = {"transformer": LORA_FILE, "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}
EXPORT_JSON = "vgrpo_export.json"
FORMAT = "vgrpo-export/1"



def export_run(run: str, out: str, step: int | None = None, pipeline: bool = False,
               command: str | None = None) -> dict[str, Any]:
    """Export RUN's checkpoint (the newest, or `step`'s) into `out`; returns vgrpo_export.json."""
    cfg, ckpt = resolve_target(run, None, step)
    files = PolicyFiles(ckpt)
    meta = files.meta
    if pipeline and cfg.optim.finetune == "lora":
        raise ConfigError("--pipeline: this is a LoRA run; its export is the adapter file, loaded onto "
                          "the base pipeline with load_lora_weights (drop --pipeline)")
    run_loc = storage.location(run)
    if not (run_loc / "config.yaml").is_file():
        run_loc = ckpt.parent.parent    # RUN was a checkpoint dir
    info = _describe(cfg, ckpt, meta, run_loc, command or f"vgrpo export {run} --out {out}")
    with _FreshFolder(out) as tmp:
        if cfg.optim.finetune == "lora":   # the adapter: a few MB, read whole
            experts = split_experts(files.read_all())
            info["files"] = write_lora(experts, cfg, tmp)
            info["lora"] = {"rank": cfg.optim.lora_rank, "alpha": cfg.optim.lora_alpha,
                            "experts": sorted(experts)}
        else:
            info["files"] = (write_full(split_experts(files.read_all()), cfg, tmp, files.path) if files.legacy
                             else copy_full(files, cfg, tmp))
            if pipeline:
                info["files"] += link_base(cfg, tmp, info["files"])
        info["pipeline"] = pipeline
        info["load"] = load_snippet(info, str(out))
        (tmp / EXPORT_JSON).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(model_card(info, cfg, _summary(run_loc)), encoding="utf-8")
    return info


def _describe(cfg: RunConfig, ckpt, meta: dict[str, str], run_loc, command: str) -> dict[str, Any]:
    """What the folder records: the base, the kind of weights, the step, where they came from."""
    weights = meta.get("vgrpo.weights") or ("ema" if cfg.optim.ema_decay > 0 else "live")
    m = cfg.model
    return {
        "format": FORMAT, "run": str(run_loc), "run_name": run_loc.name, "checkpoint": str(ckpt),
        "step": int(ckpt.name[len(PREFIX):]), "kind": cfg.optim.finetune, "weights": weights,
        "ema_decay": cfg.optim.ema_decay if weights == "ema" else None,
        "base": {"family": m.family, "task": m.task, "path": m.path, "dtype": m.dtype,
                 "num_frames": m.num_frames, "height": m.height, "width": m.width,
                 "guidance_scale": m.guidance_scale},
        "pipeline_class": FAMILIES[m.family].pipelines.get(m.task),
        "transformer_class": FAMILIES[m.family].transformer, "command": command,
        "schedule": (f"Schedule.explicit({list(cfg.schedule.sigmas)})" if cfg.schedule.sigmas is not None
                     else f"Schedule.linear({cfg.schedule.steps}, {cfg.schedule.shift})"),
    }


def _summary(run_loc) -> dict[str, Any]:
    try:
        data = json.loads((run_loc / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class _FreshFolder:
    """A temp folder beside `out` that replaces it on success (an earlier export there is
    replaced; any other non-empty folder is refused); an object-store `out` is uploaded."""

    def __init__(self, out: str):
        self.out, self.remote = out, storage.is_uri(out)
        if not self.remote:
            p = Path(out)
            if p.exists() and (not p.is_dir() or (any(p.iterdir()) and not (p / EXPORT_JSON).is_file())):
                raise ConfigError(f"--out {out}: exists and is not an earlier export; choose an empty or new folder")

    def __enter__(self) -> Path:
        parent = Path(tempfile.gettempdir()) if self.remote else Path(self.out).resolve().parent
        parent.mkdir(parents=True, exist_ok=True)
        self.tmp = parent / f".vgrpo-export-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, *_) -> None:
        try:
            if exc_type is not None:
                return
            if self.remote:
                storage.remove(self.out)
                storage.push_tree(self.tmp, self.out)
                return
            final = Path(self.out)
            if final.exists():
                old = final.with_name(f".{final.name}-old-{uuid.uuid4().hex[:8]}")
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            self.tmp.rename(final)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def split_experts(payload: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{expert: its weights}: a Wan 2.2 run that trains both experts keys them `transformer.…`
    and `transformer_2.…` (the adapter's ModuleDict); every other run trains `transformer` alone."""
    heads = {k.split(".", 1)[0] for k in payload}
    if not heads <= set(EXPERT_LORA_FILES):
        return {"transformer": payload}
    return {h: {k.split(".", 1)[1]: v for k, v in payload.items() if k.split(".", 1)[0] == h}
            for h in sorted(heads)}


def diffusers_lora_layers(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """vgrpo's adapter keys (peft's, with the adapter name: `….to_q.lora_A.default.weight`) →
    diffusers' (`….to_q.lora_A.weight`, as peft's get_peft_model_state_dict gives them), and the
    adapted modules."""
    from rollout_worker.models.lora import ADAPTER, is_lora_key  # heavy: torch

    layers, modules = {}, set()
    for k, v in weights.items():
        if not is_lora_key(k):
            raise CheckpointError(f"{POLICY_FILE}: {k!r} is not a LoRA weight, but optim.finetune = 'lora'")
        head, _, leaf = k.partition(".lora_")
        part, _, rest = leaf.partition(".")
        name = rest[len(ADAPTER) + 1:] if rest.startswith(ADAPTER + ".") else rest
        layers[f"{head}.lora_{part}.{name}"] = v.detach().to("cpu").contiguous()
        modules.add(head)
    return layers, sorted(modules)


def write_lora(experts: dict[str, dict[str, torch.Tensor]], cfg: RunConfig, out: Path) -> list[str]:
    """One diffusers LoRA file per trained expert, through the pipeline class's own writer."""
    import diffusers  # heavy: diffusers

    family = cfg.model.family
    name = FAMILIES[family].pipelines.get(cfg.model.task, "WanPipeline")  # the toy has none: Wan's
    save = getattr(getattr(diffusers, name), "save_lora_weights", None) or _save_lora_generic
    files = []
    for expert, weights in experts.items():
        layers, modules = diffusers_lora_layers(weights)
        # peft's LoraConfig fields: load_lora_weights rebuilds exactly this adapter (scale alpha/r)
        meta = {"r": cfg.optim.lora_rank, "lora_alpha": cfg.optim.lora_alpha,
                "target_modules": modules, "lora_dropout": 0.0}
        save(str(out), transformer_lora_layers=layers, transformer_lora_adapter_metadata=meta,
             weight_name=EXPERT_LORA_FILES[expert])
        files.append(EXPERT_LORA_FILES[expert])
    return files


def _save_lora_generic(save_directory: str, transformer_lora_layers: dict, transformer_lora_adapter_metadata: dict,
                       weight_name: str) -> None:
    """The same file for a pipeline class without a LoRA mixin (HunyuanVideo15Pipeline in diffusers
    0.42): diffusers' own writer under the `transformer.` prefix its transformers' loader reads."""
    from diffusers.loaders.lora_base import LoraBaseMixin  # heavy: diffusers

    LoraBaseMixin.write_lora_layers(
        state_dict={f"transformer.{k}": v for k, v in transformer_lora_layers.items()},
        save_directory=save_directory, is_main_process=True, weight_name=weight_name, save_function=None,
        safe_serialization=True,
        lora_adapter_metadata={f"transformer.{k}": v for k, v in transformer_lora_adapter_metadata.items()})


def transformer_config(cfg: RunConfig, expert: str) -> dict[str, Any]:
    """The trained transformer's diffusers config: the base's `<expert>/config.json`, or the toy
    checkpoint's sidecar."""
    import diffusers  # heavy: diffusers

    if not FAMILIES[cfg.model.family].needs_path:
        kw = dict(ToyVideoModel.sidecar(ToyVideoModel.checkpoint_path(cfg))["transformer"])
        kw["patch_size"] = tuple(kw["patch_size"])
        return kw
    cls = getattr(diffusers, FAMILIES[cfg.model.family].transformer)
    return dict(cls.load_config(cfg.model.path, subfolder=expert))


def write_full(experts: dict[str, dict[str, torch.Tensor]], cfg: RunConfig, out: Path, source) -> list[str]:
    """Each trained expert of a legacy policy.safetensors (`source`) as a diffusers model folder,
    via the transformer class's save_pretrained (built on the meta device: no copy of the
    weights is made, the policy's tensors are saved)."""
    import diffusers  # heavy: diffusers

    cls = getattr(diffusers, FAMILIES[cfg.model.family].transformer)
    for expert, weights in experts.items():
        with torch.device("meta"):
            module = cls.from_config(transformer_config(cfg, expert))
        try:
            module.load_state_dict(weights, strict=True, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"{source}: does not fit the base's {expert} "
                                  f"({str(e).splitlines()[0]}); was the config edited after training?") from None
        module.save_pretrained(out / expert)
    return list(experts) + _toy_sidecar(cfg, out)


def copy_full(files: PolicyFiles, cfg: RunConfig, out: Path) -> list[str]:
    """Each trained expert of a checkpoint's policy/ as a diffusers model folder: its names and
    shapes checked against the base's transformer built on the meta device, then its index and
    shards linked (or copied, one shard at a time) and each shard's values checked finite, one
    tensor's worth of memory at a time. config.json: the checkpoint's own, else the base's."""
    import diffusers  # heavy: diffusers

    cls = getattr(diffusers, FAMILIES[cfg.model.family].transformer)
    for expert in files.experts:
        conf = files.config(expert) or transformer_config(cfg, expert)
        with torch.device("meta"):
            module = cls.from_config({k: v for k, v in conf.items() if not k.startswith("_")})
        want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        have = files.expert_shapes(expert)
        wrong = sorted(set(want) ^ set(have)) or sorted(k for k in want if want[k] != have[k])
        if wrong:
            k = wrong[0]
            why = (f"{k!r} is {have.get(k)} in the checkpoint, {want.get(k)} in the base's {expert}"
                   if k in want and k in have else
                   f"{k!r} is {'missing' if k in want else 'not a weight of the base'}")
            raise CheckpointError(f"{files.path / expert}: does not fit the base's {expert} ({why}); "
                                  "was the config edited after training?")
        folder = out / expert
        folder.mkdir()
        conf["_class_name"] = FAMILIES[cfg.model.family].transformer
        (folder / CONFIG_FILE).write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _fetch(files.path / expert / WEIGHTS_INDEX, folder / WEIGHTS_INDEX)
        for shard_expert, f, _ in files.shards:
            if shard_expert == expert:
                _fetch(f, folder / f.name)
                check_finite(folder / f.name, f)   # every value, one tensor at a time
    return list(files.experts) + _toy_sidecar(cfg, out)


def _fetch(src, dst: Path) -> None:
    """A file into the export: a hard link where the filesystem allows, else a copy in chunks
    (an object-store source streamed down)."""
    if not storage.is_uri(str(src)):
        _link_or_copy(src, dst)
        return
    with storage.open_read(str(src)) as r, open(dst, "wb") as w:
        shutil.copyfileobj(r, w, 16 * 2**20)


def _toy_sidecar(cfg: RunConfig, out: Path) -> list[str]:
    """The toy's pipeline: its text encoder and world beside the transformer (toy.json)."""
    if FAMILIES[cfg.model.family].needs_path:
        return []
    side = ToyVideoModel.sidecar(ToyVideoModel.checkpoint_path(cfg))
    (out / DIR_META).write_text(json.dumps(side, indent=2) + "\n", encoding="utf-8")
    return [DIR_META]


def link_base(cfg: RunConfig, out: Path, trained: dict) -> list[str]:
    """The base pipeline's other components beside the exported transformer(s): hard links where
    the filesystem allows (no copy of a 20 GB text encoder), else copies."""
    if not FAMILIES[cfg.model.family].needs_path:
        return []   # transformer/ + toy.json is the whole toy pipeline
    base = Path(cfg.model.path).expanduser()
    if not is_local(cfg.model.path) or not (base / "model_index.json").is_file():
        raise ConfigError(f"--pipeline: model.path {cfg.model.path!r} is not a local diffusers folder "
                          "(model_index.json); download it and point model.path at it, or export without "
                          "--pipeline and load the transformer into the base pipeline")
    names = []
    for entry in sorted(base.iterdir()):
        if entry.name in trained or entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, out / entry.name, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, out / entry.name)
        names.append(entry.name)
    return names


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)

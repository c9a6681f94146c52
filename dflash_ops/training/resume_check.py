"""What a resume changes, said before anything is loaded.

A run resumes from the latest checkpoint in its output directory, under the config it is started with
now. `check_resume` compares that config with the checkpoint's own (`config.yaml`, `meta.json`) before
any process, model or status file is touched: a key that changes the drafter's weights' shapes, or a
target of another shape, cannot resume (ConfigError naming each difference: the weights would not load,
or would load into another model); the loss weighting and an epochs run's other data plan are refused as
`dflash_ops.training.checkpoint` rules; a key the resume could not apply (`FIXED`: run.seed, whose data
order and random states the checkpoint's run goes on with) is refused the same way. Every other
difference is applied from this config, and returned for the run to warn about and log in its `resume`
line: the learning rate and schedule (optim.lr, warmup_ratio, schedule, total_steps, weight_decay: the
scheduler is rebuilt from them at the resumed step, `dflash_ops.training.trainer.make_scheduler`, the AdamW
moments kept), and the keys read at each step or save (max_grad_norm, data.batch_size, run.*, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dflash_ops.core.config import ConfigError, TrainConfig, target_text_config
from dflash_ops.training.checkpoint import check_loss_weighting, check_step_plan, latest_checkpoint

# Keys whose change makes the checkpoint's weights another model's.
SHAPE_KEYS = ("model.num_draft_layers", "model.block_size", "model.target_layer_ids", "model.layer_types",
              "model.sliding_window", "model.kind", "model.markov_rank", "model.confidence_head")
# Keys a resume cannot apply, and why: refused rather than announced and ignored.
FIXED = {"run.seed": "the data order and the random states go on from the checkpoint's, drawn from its seed"}
# The target's figures the drafter's weights are shaped by, as the checkpoint's drafter_config holds them.
TARGET_SHAPE = ("hidden_size", "vocab_size")


def flat(sections: dict) -> dict[str, object]:
    """{"section.key": value} of a config's sections."""
    return {f"{name}.{key}": value for name, keys in sections.items() for key, value in (keys or {}).items()}


def config_changes(cfg: TrainConfig, checkpoint: Path) -> dict[str, tuple]:
    """{key: (the checkpoint's value, this config's)} for every key that differs."""
    saved = flat(yaml.safe_load((checkpoint / "config.yaml").read_text()) or {})
    now = flat(cfg.to_dict())
    return {key: (saved[key], value) for key, value in now.items() if key in saved and saved[key] != value}


def target_changes(cfg: TrainConfig, meta: dict) -> dict[str, tuple]:
    """{"target <figure>": (the checkpoint's, the configured target's)} where the target's shape differs."""
    trained = meta.get("drafter_config") or {}
    target = target_text_config(cfg.model.target_path)
    return {f"target {name}": (trained[name], target.get(name)) for name in TARGET_SHAPE
            if name in trained and target.get(name) != trained[name]}


def describe(changes: dict[str, tuple]) -> str:
    return "; ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())


def check_resume(cfg: TrainConfig) -> tuple[Path, dict[str, tuple]] | None:
    """The checkpoint `cfg` would resume from and the keys that differ from it (applied from `cfg`: to warn
    about), None when it starts afresh. A shape change, or one of `FIXED`, is refused (ConfigError),
    nothing loaded, nothing written."""
    if not cfg.run.resume:
        return None
    checkpoint = latest_checkpoint(cfg.run.output_dir)
    if checkpoint is None:
        return None
    meta = json.loads((checkpoint / "meta.json").read_text())
    changes = config_changes(cfg, checkpoint)
    refused = {**{k: v for k, v in changes.items() if k in SHAPE_KEYS}, **target_changes(cfg, meta)}
    trained_mask = (meta.get("drafter_config") or {}).get("mask_token_id")
    configured_mask = cfg.model.mask_token_id
    if None not in (trained_mask, configured_mask) and trained_mask != configured_mask:
        refused["model.mask_token_id"] = (trained_mask, configured_mask)  # the weights learnt their mask
    if refused:
        key = next((k for k in refused if not k.startswith("target ")), "model.target_path")
        raise ConfigError(key, f"cannot resume {checkpoint}: {describe(refused)} (the checkpoint's -> this "
                          "config's) change the drafter its weights are; set them back to resume (a null "
                          "mask_token_id takes the checkpoint's), or train from scratch in another "
                          "run.output_dir (or with --fresh)")
    fixed = {k: v for k, v in changes.items() if k in FIXED}
    if fixed:
        key = next(iter(fixed))
        raise ConfigError(key, f"cannot resume {checkpoint}: {describe(fixed)} (the checkpoint's -> this "
                          f"config's) cannot be applied: {'; '.join(FIXED[k] for k in fixed)}; set it back "
                          "to resume, or train from scratch in another run.output_dir (or with --fresh)")
    check_loss_weighting(cfg.loss_weighting, meta)
    check_step_plan(cfg, meta)
    return checkpoint, changes

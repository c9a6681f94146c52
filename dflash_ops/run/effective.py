"""What `python -m dflash_ops.train CONFIG --dry-run` prints: the config as it will run (the file, the
overrides laid over it, every default filled in) and what the trainer resolves from it before its first step
(the target layers, the mask token, the loss weighting, the steps and warm-up, the data's counts, the
checkpoint it resumes), as YAML. Nothing is loaded beyond the target's config.json and tokenizer files."""

from __future__ import annotations

import yaml

from dflash_ops.core.config import TrainConfig, target_shape
from dflash_ops.core.mask_token import resolve_mask_token_id
from dflash_ops.core.target_layers import build_target_layer_ids


def resolved(cfg: TrainConfig, resuming: tuple | None) -> dict:
    """The values the run derives from `cfg`; `resuming` is `check_resume`'s answer (None: a fresh start)."""
    n_layers, vocab_size = target_shape(cfg.model.target_path)
    total = cfg.total_steps
    counts = cfg.data_counts.as_fields() if cfg.data_counts else {}
    checkpoint, changes = resuming or (None, {})
    return {
        "target_layer_ids": list(cfg.model.target_layer_ids
                                 or build_target_layer_ids(n_layers, cfg.model.num_draft_layers)),
        "mask_token_id": resolve_mask_token_id(cfg.model.mask_token_id, cfg.model.target_path, vocab_size),
        **cfg.loss_weighting,
        "total_steps": total,
        "warmup_steps": round(cfg.optim.warmup_ratio * total),
        "step_plan": cfg.step_plan,
        "data": counts,
        "layout": "pipeline" if cfg.pipeline.is_multi_process else "single process",
        "resume_from": None if checkpoint is None else str(checkpoint),
        "changed_since_checkpoint": {key: list(values) for key, values in changes.items()},
        "overrides": list(cfg.overrides),
    }


def effective_config(cfg: TrainConfig, resuming: tuple | None) -> str:
    """The YAML `--dry-run` prints: the config's sections, then `resolved:`."""
    return yaml.safe_dump({**cfg.to_dict(), "resolved": resolved(cfg, resuming)}, sort_keys=False)

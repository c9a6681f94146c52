"""Part g of the GPU check (`drafter_kinds`): the drafter step by kind, side by side in one process.

The trainer's own step (`DrafterTrainer.train_step`: layout, forward, loss, backward, clipping, AdamW) of
the DSpark recipe's drafter rank (`configs/qwen3-8b-dspark.yaml`: Qwen3-8B's width, 5 layers, bf16
autocast over fp32 master weights, batch 8 x 3072, 256 anchors of 16, the loss chunk 512; random weights
and features), at one shape for three kinds of drafter:

- `dflash`: the recipe as a DFlash drafter (`model.kind: dflash`, `loss.kind: ce`), the reference;
- `dflash_distilled`: DFlash with the recipe's mix less its confidence term (`{ce: 0.1, tvd: 0.9}`):
  the target's last hidden state sent with the features, its logits a second `[rows, vocab]` head product;
- `dspark`: the recipe itself (`model.kind: dspark`, its Markov head of rank `markov_rank`, the
  confidence head, `{ce: 0.1, tvd: 0.9, bce: 1.0}`).

The kinds take turns in one process on the same batch (the features of the target's layers; the DFlash
row reads the drafter's columns of them, the batch 0.19 GiB wider than its own at the recipe), each built
after the one before it is freed (`held_before_gib` says what was left): its warm-up steps (the first
compiles), then its measured steps, whose median is its step time, and its `max_memory_allocated` over
them (everything allocated) beside the memory model's prediction for it. Each kind's step time
over DFlash's is printed beside the ratio the cost model predicts from the shapes
(`dflash_ops.run.balance.predicted_costs`: `drafter_flops` plus `loss_section.extra_head_flops`), and
beside that model's seconds at the H200 pace of BENCHMARKS.md section 10 (`H200_DRAFTER_STEP`).
"""

from __future__ import annotations

import gc
import statistics
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DSPARK_RECIPE = ROOT / "configs" / "qwen3-8b-dspark.yaml"
KINDS = ("dflash", "dflash_distilled", "dspark")
# (warm-up steps, measured steps) per kind: on a GPU the first warm-up compiles (the first kind's: cold).
STEPS = {"full": (2, 3), "dry": (1, 2)}
DRY_MARKOV_RANK = 8  # the dry run's Markov rank at its vocabulary of 512


def kind_config(kind: str, recipe_model, recipe_loss, mode: str) -> tuple[dict, object]:
    """(model keys, loss section) of `kind` at the DSpark recipe's shape."""
    from dflash_ops.core.loss_section import LossConfig

    if kind == "dspark":
        rank = DRY_MARKOV_RANK if mode == "dry" else recipe_model.markov_rank
        return {"kind": "dspark", "markov_rank": rank, "confidence_head": recipe_model.confidence_head}, \
            recipe_loss
    dflash = {"kind": "dflash", "confidence_head": False}
    if kind == "dflash":
        return dflash, LossConfig()
    return dflash, LossConfig("mix", {t: w for t, w in recipe_loss.mix.items() if t != "bce"})


def kind_train_config(kind: str, mode: str, target_dir: Path):
    """The config of `kind`'s drafter rank as the part builds it (`gpu_check.recipe_config` of the DSpark
    recipe, `kind_config`'s keys), without building it."""
    import dataclasses

    from benchmarks.gpu_check import recipe_config

    cfg = recipe_config(mode, target_dir, DSPARK_RECIPE)
    model, loss = kind_config(kind, cfg.model, cfg.loss, mode)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model), loss=loss)


def modelled(cfg, mode: str) -> dict:
    """The cost model's FLOPs a sample of `cfg`'s drafter, and its step's seconds at the H200 pace (None on
    the dry run: the pace is the GPU's at Qwen3-8B's width)."""
    from benchmarks.gpu_check import TARGET_SHAPE
    from dflash_ops.run.balance import H200_DRAFTER_STEP, predicted_costs
    from dflash_ops.training.memory_fit import TargetShape

    t = TARGET_SHAPE[mode]
    shape = TargetShape(t["layers"], t["hidden"], t["intermediate"], t["heads"], t["kv_heads"], t["head_dim"],
                        t["vocab"], tied=False)
    _, flops = predicted_costs(cfg, shape)
    pace = H200_DRAFTER_STEP.flops_per_s()
    return {"flops": flops, "step_s": None if mode == "dry" else round(flops * cfg.data.batch_size / pace, 3)}


def kinds_part(mode: str, device: str) -> dict:
    """Run in a child process (`--part kinds`): every kind's step, one after another, on the same batch."""
    from benchmarks.gpu_check import (
        TARGET_SHAPE,
        _device_peak,
        predicted_peaks,
        recipe_batch,
        recipe_trainer,
        synced_seconds,
    )
    from dflash_ops.core.config import load_config

    dev = torch.device(device)
    recipe = load_config(DSPARK_RECIPE, check_target=False)
    warmup, measured = STEPS[mode]
    rows, batch, cfg = {}, None, None
    for kind in KINDS:
        model, loss = kind_config(kind, recipe.model, recipe.loss, mode)
        held_before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
        trainer, cfg, width, dtype = recipe_trainer(mode, dev, DSPARK_RECIPE, loss, **model)
        if batch is None:  # the target's layers and its last one: every kind reads its own columns of them
            full = TARGET_SHAPE[mode]["hidden"] * (cfg.model.num_draft_layers + 1)
            batch = recipe_batch(cfg, full, dtype, dev, torch.Generator(device=dev).manual_seed(0))
        step_batch = {**batch, "features": batch["features"][:, :width]}

        def step(step_batch=step_batch, trainer=trainer):
            return synced_seconds(lambda: trainer.train_step(**step_batch), dev)

        first_s, _ = step()
        for _ in range(warmup - 1):
            step()
        timed, peak, _ = _device_peak(lambda step=step: [step() for _ in range(measured)], dev)
        seconds = [s for s, _ in timed]
        step_s = statistics.median(seconds)
        predicted = predicted_peaks(cfg, mode)["drafter_step"]
        model_figures = modelled(cfg, mode)
        rows[kind] = {"step_s": round(step_s, 3), "steps_s": [round(s, 3) for s in seconds],
                      "first_step_s": round(first_s, 2),
                      "samples_per_s": round(cfg.data.batch_size / step_s, 3),
                      "loss": timed[-1][1].loss, "blocks": timed[-1][1].num_blocks, "features_width": width,
                      "peak_gib": round(peak / 2**30, 3),
                      "held_before_gib": None if held_before is None else round(held_before / 2**30, 3),
                      "predicted_gib": None if predicted is None else round(predicted["bytes"] / 2**30, 3),
                      "modelled_flops_per_sample": model_figures["flops"],
                      "modelled_h200_step_s": model_figures["step_s"],
                      "drafter": type(trainer.drafter).__name__, "loss_mix": cfg.loss.mix}
        del trainer, step, step_batch  # the next kind's peak is its own
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    reference = rows["dflash"]
    for kind in KINDS:
        rows[kind]["time_ratio"] = round(rows[kind]["step_s"] / reference["step_s"], 3)
        rows[kind]["modelled_ratio"] = round(rows[kind]["modelled_flops_per_sample"]
                                             / reference["modelled_flops_per_sample"], 3)
    d, t = cfg.data, TARGET_SHAPE[mode]
    rows["peak_scope"] = "cuda max_memory_allocated" if dev.type == "cuda" else \
        "resident growth during the measured steps (dry run)"
    rank = kind_config("dspark", recipe.model, recipe.loss, mode)[0]["markov_rank"]
    rows["shape"] = (f"{DSPARK_RECIPE.relative_to(ROOT)}: {cfg.model.num_draft_layers} layers, "
                     f"H {t['hidden']}, vocab {t['vocab']}, batch {d.batch_size} x {d.max_length}, "
                     f"{d.max_anchors} anchors, loss chunk {cfg.model.loss_chunk_size}, Markov rank {rank}")
    return rows


def kinds_rows(part: dict) -> list[str]:
    """Part g's lines in the check's table."""
    lines = [f"g. the drafter step by kind ({part['shape']}; {part['peak_scope']})",
             f"   {'kind':>16} | {'step s':>7} | {'samples/s':>9} | {'x dflash':>8} | {'modelled x':>10} | "
             f"{'H200 model s':>12} | {'peak GiB':>8} | {'predicted GiB':>13}"]
    lines += [f"   {kind:>16} | {part[kind]['step_s']:>7} | {part[kind]['samples_per_s']:>9} | "
              f"{part[kind]['time_ratio']:>8} | {part[kind]['modelled_ratio']:>10} | "
              f"{str(part[kind]['modelled_h200_step_s']):>12} | {part[kind]['peak_gib']:>8} | "
              f"{str(part[kind]['predicted_gib']):>13}" for kind in KINDS if kind in part]
    return lines

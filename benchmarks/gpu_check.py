"""The GPU check for one CUDA GPU, in one command: `python3 -m benchmarks.gpu_check --out DIR`.

Seven parts, each in its own process where it measures memory, on cuda:0, in this order of letters (they
run in the order of value, `gpu_check_plan.ORDER`):

a. the drafter step at the paper's shape and Qwen3-8B's width (5 layers, one sequence of 3072
   tokens with 512 anchors, blocks of 16, H 4096, vocabulary 151936; bf16 autocast over fp32
   master weights, the AdamW step included), unchunked and chunked (`benchmarks.drafter_step`):
   samples (sequences) per second and `torch.cuda.max_memory_allocated`, weights and AdamW state
   included, beside SpecForge's published figure for Qwen3-8B on 8 x H200 (about 45 GB and 7
   samples/s per trainer GPU at batch 2);
b. target capture of a random Qwen3-8B-shaped target (36 layers, bf16) on a batch of 8 x 3072
   tokens (docs/SCALE.md's target GPU): tokens/s and peak, whole batch and
   `model.target_rows_per_pass: 1`;
c. the tests that skip without CUDA (`pytest -m gpu`);
d. a short single-process training run (target and drafter on cuda:0, `dflash_ops.train`): a run
   stopped by SIGTERM checkpoints and exits 0, its resume gives the uninterrupted run's losses;
e. the recipe's drafter rank (`configs/qwen3-8b.yaml`, the trainer's own code on a random drafter and a
   random Qwen3-8B head): two optimizer steps of `DrafterTrainer.train_step` on a full batch (8 x 3072
   tokens, 512 anchors each, the chunked loss), then the held-out evaluation (`dflash_ops.training.heldout`)
   of `data.eval_examples` documents of 3072 tokens (two with a full-length response, the others'
   features held but their responses short, so that it takes seconds), beside the step's gradients and
   AdamW state as in a run. Each phase's `torch.cuda.max_memory_allocated` (everything allocated: the
   weights included), beside the memory model's prediction for that phase (`predicted_peaks`);
f. the recipe's drafter step by attention backend (`benchmarks.drafter_speed`): FlexAttention compiled
   (what a run uses on CUDA) against the tiles, batch 8 x 3072, after warm-up, with documents that change
   between steps: step time, samples/s, tokens/s, the first step's compilation, `max_memory_reserved`
   beside the prediction, new torch.compile graphs after warm-up (the goal: none), the speed-up, and
   SpecForge's published samples/s beside them. Alone (`--parts drafter_speed`) about 3 minutes.
g. the drafter step by kind (`benchmarks.gpu_check_drafter`, `drafter_kinds`): the DSpark recipe's rank
   (`configs/qwen3-8b-dspark.yaml`) beside DFlash and distilled DFlash at its shape, in one process: step
   time, each over DFlash's beside the cost model's ratio, peak beside the memory model's.
   Alone (`--parts drafter_kinds`) about 2.5 minutes.

Part f's tiles row is a part of its own, `tiles_speed`, run only when named (measured already).

It fits one 10-minute call (`benchmarks.gpu_check_plan`): the toolchain first (Triton, and a C compiler
that builds a Python extension as Triton's launcher is built), exiting 1 with what is missing before any
part; then the parts most valuable first, each started only when its estimated seconds fit what is left of
`--budget` (540 s by default), the others reported as left out.

It prints one table and a JSON line and writes both to `--out` (`gpu_check.txt`, `gpu_check.json`,
rewritten after every part); exit 0 when every part run passed. One GPU cannot show nccl between ranks,
DDP's all-reduce, or the target and drafter ranks on separate GPUs: those need the multi-GPU pipeline
test on >= 2 GPUs. `--dry-run` runs every part on CPU at a tiny width (no CUDA; the parts that run in a
process of their own on a GPU run in this one), so that the check is known to work before a GPU sees it
(`tests/dflash/test_gpu_check.py`, in make test); `--parts` runs some parts only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import gpu_check_plan as plan
from benchmarks.drafter_speed import speed_part, table_rows, with_speedup
from benchmarks.drafter_step import measure_in_subprocess, measure_one
from benchmarks.gpu_check_drafter import kinds_part, kinds_rows
from benchmarks.memory import peak_allocated_bytes, peak_rss_bytes
from dflash_ops.core.config import (
    DEFAULT_LOSS_CHUNK_SIZE,
    PipelineConfig,
    TrainConfig,
    load_config,
    with_examples,
)
from dflash_ops.core.target_layers import build_target_layer_ids
from dflash_ops.data.target import target_hidden_states

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "qwen3-8b.yaml"
SPECFORGE = "SpecForge, Qwen3-8B, 8 x H200: ~45 GB and ~7 samples/s per trainer GPU at batch 2"
NOT_SHOWN = ("one GPU cannot show: nccl between ranks, DDP's gradient all-reduce, target and drafter "
             "ranks on separate GPUs (tests/pipeline's 2-GPU test)")
# The paper's drafter step at Qwen3-8B's width, and a tiny stand-in for --dry-run.
DRAFTER_SHAPE = {"full": dict(seq_len=3072, anchors=512, layers=5, hidden=4096, intermediate=12288, heads=32,
                              kv_heads=8, head_dim=128, vocab=151936),
                 "dry": dict(seq_len=256, anchors=16, layers=2, hidden=64, intermediate=128, heads=4,
                             kv_heads=2, head_dim=16, vocab=512)}
TARGET_SHAPE = {"full": dict(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                             vocab=151936, batch=8, max_len=3072),
                "dry": dict(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                            vocab=512, batch=2, max_len=64)}


def drafter_part(mode: str, device: str) -> dict:
    # On a GPU the warm-up runs the measured shape (kernel selection, allocator growth) and the
    # fastest of 3 steps counts; the dry run only shows that the code runs.
    full = mode == "full"
    shape = {**DRAFTER_SHAPE[mode], "block_size": 16, "optimizer": True, "repeats": 3 if full else 1,
             "warmup_anchors": DRAFTER_SHAPE[mode]["anchors"] if full else 4}
    rows = {}
    for name, chunk in (("unchunked", None), ("chunked", DEFAULT_LOSS_CHUNK_SIZE)):
        one = {**shape, "chunk_size": chunk}
        r = measure_one(one, torch.device(device)) if mode == "dry" else \
            measure_in_subprocess(one, device, threads=os.cpu_count() or 1)
        rows[name] = {"samples_per_s": r["samples_per_s"], "peak_gib": r["peak_gib"], "loss": r["loss"]}
    rows["peak_ratio"] = round(rows["chunked"]["peak_gib"] / rows["unchunked"]["peak_gib"], 3)
    rows["time_ratio"] = round(rows["unchunked"]["samples_per_s"] / rows["chunked"]["samples_per_s"], 3)
    rows["reference"] = SPECFORGE
    rows["shape"] = (f"{shape['layers']} layers, H {shape['hidden']}, {shape['seq_len']} tokens, "
                     f"{shape['anchors']} anchors, AdamW")
    return rows


def random_target(shape: dict, device: torch.device):
    """A randomly initialised Qwen3 of `shape` in bf16, created on `device` (no host copy)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         head_dim=shape["head_dim"], max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def capture_part(mode: str, device: str) -> dict:
    """Run in a child process (`--part capture`): the target's peak is this process's alone."""
    shape, dev = TARGET_SHAPE[mode], torch.device(device)
    target = random_target(shape, dev)
    layer_ids = build_target_layer_ids(shape["layers"], 5)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["max_len"]), generator=g).to(dev)
    attention_mask = torch.ones_like(input_ids)
    tokens = int(attention_mask.sum())
    rows = {}
    for name, rows_per_pass in (("whole_batch", None), ("rows_per_pass_1", 1)):
        def capture(rows_per_pass=rows_per_pass):
            return target_hidden_states(target, input_ids, attention_mask, layer_ids,
                                        rows_per_pass=rows_per_pass)

        capture()  # warm-up
        timed = [synced_seconds(lambda: peak_allocated_bytes(capture, dev), dev) for _ in range(2)]
        seconds, peak = [s for s, _ in timed], timed[-1][1][1]
        rows[name] = {"tokens_per_s": round(tokens / min(seconds)), "peak_gib": round(peak / 2**30, 3)}
    rows["batch"] = f"{shape['batch']} x {shape['max_len']}"
    rows["shape"] = f"random Qwen3, {shape['layers']} layers, H {shape['hidden']}"
    return rows


# The recipe at a tiny width for --dry-run: the keys that set the drafter rank's shapes, shrunk.
RECIPE_DRY = {"model": {"num_draft_layers": 2, "loss_chunk_size": 32},
              "data": {"max_length": 64, "batch_size": 2, "max_anchors": 8, "eval_examples": 3}}
FULL_RESPONSES = 2  # held-out documents with a full-length response; the rest have 2 response tokens
PROMPT_TOKENS = 64  # every sequence's prompt (loss_mask 0, at most a quarter): the rest is response


def recipe_config(mode: str, target_dir: Path, recipe: Path = RECIPE) -> TrainConfig:
    """`recipe` (default configs/qwen3-8b.yaml; tiny for the dry run) on the random target's config at
    `target_dir`, its drafter rank alone on one device (no DDP), with its own mask token (the last row)."""
    cfg = load_config(recipe, check_target=False)
    sections = {"model": {"target_path": str(target_dir), "mask_token_id": TARGET_SHAPE[mode]["vocab"] - 1}}
    for name, values in (RECIPE_DRY if mode == "dry" else {}).items():
        sections[name] = {**sections.get(name, {}), **values}
    replaced = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in sections.items()}
    replaced["pipeline"] = PipelineConfig(device=cfg.pipeline.device)
    # The schedule needs a length; a million examples stands in for the data (the steps change no shape).
    return with_examples(dataclasses.replace(cfg, **replaced), 1_000_000)


def predicted_peaks(cfg: TrainConfig, mode: str) -> dict[str, dict | None]:
    """The memory model's prediction (`dflash_ops.training.memory_fit`) of each phase's peak on one GPU, in
    bytes with its terms; None for a phase when there is no memory model to ask. The step: a drafter rank
    with one feature batch and no DDP (a single process fed by a cache is what the model calls that);
    the held-out evaluation: the same rank with the held-out documents' features, the model's bound."""
    try:
        from dflash_ops.training import memory_fit
    except ImportError:
        return {"drafter_step": None, "heldout": None}
    t = TARGET_SHAPE[mode]
    shape = memory_fit.TargetShape(t["layers"], t["hidden"], t["intermediate"], t["heads"], t["kv_heads"],
                                   t["head_dim"], t["vocab"], tied=False)
    alone = dataclasses.replace(cfg, pipeline=PipelineConfig(device=cfg.pipeline.device),
                                data=dataclasses.replace(cfg.data, features_path="features", eval_path=None))
    held_out = dataclasses.replace(alone, data=dataclasses.replace(alone.data, eval_path=cfg.data.eval_path))
    peaks = {}
    for phase, variant in (("drafter_step", alone), ("heldout", held_out)):
        (peak,) = memory_fit.predict(variant, shape, runtime_bytes=0)  # max_memory_allocated: no context
        peaks[phase] = {"bytes": peak.total, "terms": {name: b for name, b in peak.terms if b}}
    return peaks


def synced_seconds(fn, dev: torch.device) -> tuple[float, object]:
    """(the seconds of `fn()`, its result), the device's queued work finished before and after on CUDA."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    started = time.perf_counter()
    result = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - started, result


def _device_peak(fn, dev: torch.device) -> tuple[object, int, float]:
    """(fn(), the phase's peak, its seconds): on CUDA `max_memory_allocated` since a reset, everything
    allocated; on CPU the process's resident growth during it (the dry run only shows that the code runs)."""
    started = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result = fn()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        result, peak = peak_rss_bytes(fn)
    return result, peak, time.perf_counter() - started


def recipe_trainer(mode: str, dev: torch.device, recipe: Path = RECIPE, loss=None, **model):
    """(trainer, config, width of its features, dtype): the recipe's drafter rank (`recipe_config`, its
    `model` keys replaced by `model`, its loss section by `loss`) with a random drafter around a random
    frozen embedding and lm_head of the target's shape, initialised in place on `dev`. The width is the
    features' a target rank sends: the drafter's layers, and the last one when the loss needs it."""
    from transformers import Qwen3Config

    from dflash_ops.core.loss_section import capture_layer_ids
    from dflash_ops.data.target import TargetHead
    from dflash_ops.training.trainer import DrafterTrainer, build_drafter, resolve_layer_ids

    t = TARGET_SHAPE[mode]
    with tempfile.TemporaryDirectory(prefix="gpu_check-recipe-") as tmp:
        config = Qwen3Config(vocab_size=t["vocab"], hidden_size=t["hidden"],
                             intermediate_size=t["intermediate"], num_hidden_layers=t["layers"],
                             num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"],
                             head_dim=t["head_dim"],
                             max_position_embeddings=40960, tie_word_embeddings=False)
        config.save_pretrained(tmp)  # config.json only: what the drafter's build reads of its target
        cfg = recipe_config(mode, Path(tmp), recipe)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model),
                                  loss=cfg.loss if loss is None else loss)
        torch.manual_seed(0)
        # The target's frozen embedding and lm_head in its dtype, initialised in place on the device.
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        embed = torch.nn.Embedding(t["vocab"], t["hidden"], device=dev, dtype=dtype).requires_grad_(False)
        head = torch.nn.Linear(t["hidden"], t["vocab"], bias=False, device=dev, dtype=dtype)
        head.requires_grad_(False)
        for frozen in (embed, head):
            frozen.weight.normal_(std=0.02)
        with dev:
            drafter = build_drafter(cfg, TargetHead(config, embed, head))
        layers = capture_layer_ids(resolve_layer_ids(cfg, t["layers"]), t["layers"], cfg.loss.mix)
        width = len(layers) * t["hidden"]
    return DrafterTrainer(drafter, cfg), cfg, width, dtype


def recipe_batch(cfg: TrainConfig, width: int, dtype: torch.dtype, dev: torch.device, g: torch.Generator,
                 lengths: list[int] | None = None) -> dict:
    """A packed feature batch of documents of `lengths` tokens (default: the recipe's batch, each of
    data.max_length), random features and tokens; each document's prompt is unscored."""
    d, vocab = cfg.data, cfg.model.mask_token_id
    lengths = lengths or [d.max_length] * d.batch_size
    tokens = sum(lengths)
    masks = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.int64, device=dev)
        mask[:min(PROMPT_TOKENS, n // 4)] = 0
        masks.append(mask)
    return {"features": torch.randn(tokens, width, generator=g, device=dev).to(dtype),
            "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
            "position_ids": torch.cat([torch.arange(n, device=dev) for n in lengths]),
            "input_ids": torch.randint(0, vocab, (tokens,), generator=g, device=dev),
            "loss_mask": torch.cat(masks)}


def recipe_part(mode: str, device: str) -> dict:
    """Run in a child process (`--part recipe`): the drafter rank's step and held-out evaluation."""
    from dflash_ops.training.heldout import HeldOutDocument, HeldOutEvaluator
    from dflash_ops.training.trainer import compute_precision

    t, dev = TARGET_SHAPE[mode], torch.device(device)
    trainer, cfg, width, dtype = recipe_trainer(mode, dev)
    drafter, d = trainer.drafter, cfg.data
    g, g_cpu = torch.Generator(device=dev).manual_seed(0), torch.Generator().manual_seed(0)
    prompt = min(PROMPT_TOKENS, d.max_length // 4)
    batch = recipe_batch(cfg, width, dtype, dev, g)
    trainer.train_step(**batch)  # the first step creates AdamW's moments; the second is the steady state
    result, step_peak, step_seconds = _device_peak(lambda: trainer.train_step(**batch), dev)
    batch.clear()  # the step's features go, as a run's batch does

    documents = []
    for i in range(d.eval_examples):
        start = prompt if i < FULL_RESPONSES else d.max_length - 3
        doc_mask = torch.zeros(d.max_length, dtype=torch.int64)
        doc_mask[start:] = 1
        documents.append(HeldOutDocument(torch.randn(d.max_length, width, generator=g, device=dev).to(dtype),
                                         torch.randint(0, t["vocab"] - 1, (d.max_length,), generator=g_cpu),
                                         doc_mask, start))
    heldout = HeldOutEvaluator(documents, d.max_anchors, cfg.gamma, cfg.model.loss_chunk_size,
                               lambda device: compute_precision(cfg, device))
    # In a run the evaluation follows a step: its gradients (freed at the next step) and AdamW state stay.
    evaluated, heldout_peak, heldout_seconds = _device_peak(lambda: heldout(drafter), dev)
    predicted = predicted_peaks(cfg, mode)

    def phase(peak: int, seconds: float, name: str) -> dict:
        model = predicted[name]
        return {"peak_bytes": peak, "peak_gib": round(peak / 2**30, 3), "seconds": round(seconds, 2),
                "predicted_bytes": None if model is None else model["bytes"],
                "predicted_gib": None if model is None else round(model["bytes"] / 2**30, 3),
                "predicted_terms_gib": None if model is None else {
                    k: round(v / 2**30, 3) for k, v in model["terms"].items()}}

    return {"drafter_step": {**phase(step_peak, step_seconds, "drafter_step"), "loss": result.loss,
                             "blocks": result.num_blocks,
                             "samples_per_s": round(d.batch_size / step_seconds, 3)},
            "heldout": {**phase(heldout_peak, heldout_seconds, "heldout"), "tau": evaluated.stats.tau,
                        "documents": len(documents)},
            "peak_scope": "cuda max_memory_allocated" if dev.type == "cuda" else "resident growth "
                          "during the phase (dry run)",
            "shape": (f"{cfg.model.num_draft_layers} layers, H {t['hidden']}, batch {d.batch_size} x "
                      f"{d.max_length}, {d.max_anchors} anchors, loss chunk {cfg.model.loss_chunk_size}, "
                      f"{d.eval_examples} held-out documents")}


def run_part_in_subprocess(part: str, mode: str, device: str) -> dict:
    """A part in a process of its own (its peak its own); the dry run's in this one (it only shows that the
    code runs, and a process's imports cost more CPU than its tiny shapes)."""
    if mode == "dry":
        return CHILD_PARTS[part](mode, device)
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--part", part, "--mode", mode, "--device", device]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
    if done.returncode != 0:
        raise RuntimeError(f"{part}: exit {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gpu_tests_part(mode: str, device: str) -> dict:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"status": "not run: pytest is not installed in this Python"}
    # tests/conftest.py and tests/pipeline/conftest.py import pvesim's fleet (ansible_runner), which a GPU
    # machine's Python may lack: then the trainer's GPU tests run without them (the pipeline's GPU test
    # needs 2 GPUs and skips on one anyway). Only the files that mark a test gpu are collected.
    fleet = importlib.util.find_spec("ansible_runner") is not None
    files = [str(path.relative_to(ROOT)) for folder in ("tests/dflash", "tests/pipeline")[:1 + fleet]
             for path in sorted((ROOT / folder).rglob("test_*.py")) if "mark.gpu" in path.read_text()]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files]
    cmd += [] if fleet else ["--confcutdir", "tests/dflash"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
    summary = (done.stdout.strip().splitlines() or [""])[-1].strip("= ")
    # pytest exits 5 when every test was deselected; on CPU the selected ones skip (exit 0).
    if done.returncode not in (0, 5):
        raise RuntimeError(f"pytest -m gpu: exit {done.returncode}: {done.stdout[-3000:]}")
    return {"summary": summary, "skipped": [line for line in done.stdout.splitlines() if "SKIPPED" in line],
            "paths": cmd[cmd.index("gpu") + 1:]}


def _env() -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def write_training_inputs(work: Path, device: str) -> Path:
    """A tiny random Qwen3 target, a data set of random tokens and a config training a drafter on
    them in one process on `device`; returns the config's path."""
    import yaml
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=256)).save_pretrained(work / "target")
    g = torch.Generator().manual_seed(0)
    with (work / "train.jsonl").open("w") as f:
        for _ in range(64):
            ids = torch.randint(0, 255, (64,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 8 + [1] * 56}) + "\n")
    raw = {
        "model": {"target_path": str(work / "target"), "num_draft_layers": 1, "block_size": 8,
                  "mask_token_id": 255, "dtype": "bfloat16" if device == "cuda" else "float32"},
        "data": {"path": str(work / "train.jsonl"), "max_length": 64, "batch_size": 4, "max_anchors": 16},
        "optim": {"total_steps": 8},
        # The pause lets the signal land mid-run whatever the device's speed; the resume runs without it.
        "run": {"output_dir": str(work / "run"), "save_every": 1000, "step_delay": 0.2},
        "pipeline": {"device": device},
    }
    (work / "config.yaml").write_text(yaml.safe_dump(raw))
    return work / "config.yaml"


def _events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _train(config: Path, output_dir: Path, stop_after: int | None = None) -> tuple[int, list[dict]]:
    """`python -m dflash_ops.train` with the run's output in `output_dir`; SIGTERM once step `stop_after`
    is logged. Returns (exit status, its JSON events)."""
    import yaml

    raw = yaml.safe_load(config.read_text())
    raw["run"]["output_dir"] = str(output_dir)
    if stop_after is None:
        raw["run"]["step_delay"] = 0.0
    path = output_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ops.train", "--config", str(path)], cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen += _events(line)
            if stop_after is not None and seen and seen[-1].get("event") == "step" \
                    and seen[-1]["step"] >= stop_after:
                proc.send_signal(signal.SIGTERM)
                break
        rest, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"dflash_ops.train exit {proc.returncode}: {err[-2000:]}")
    return proc.returncode, seen + _events(rest)


def training_part(mode: str, device: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = Path(tmp)
        config = write_training_inputs(work, device)
        _, reference = _train(config, work / "reference")
        _, stopped = _train(config, work / "interrupted", stop_after=3)
        _, resumed = _train(config, work / "interrupted")
    losses = {e["step"]: e["loss"] for e in reference if e["event"] == "step"}
    stop = next(e for e in stopped if e["event"] == "stop")
    again = {e["step"]: e["loss"] for e in stopped + resumed if e["event"] == "step"}
    resume = next(e for e in resumed if e["event"] == "resume")
    if resume["step"] != stop["step"] or sorted(again) != sorted(losses):
        raise RuntimeError(f"stopped at {stop['step']}, resumed at {resume['step']}, steps {sorted(again)}")
    worst = max(abs(again[s] - losses[s]) / abs(losses[s]) for s in losses)
    device_seen = next(e.get("device") for e in reference if e["event"] == "start")
    return {"device": device_seen, "steps": len(losses), "stopped_at": stop["step"], "stop": stop["reason"],
            "losses_equal": again == losses, "max_rel_loss_diff": worst,
            "loss_first_last": [losses[min(losses)], losses[max(losses)]]}


def passed(name: str, result: dict, device: str) -> bool:
    if name != "training":
        return True
    # Bitwise equal on CPU; CUDA kernels (atomics in attention's backward) need not repeat bit for bit
    # even between two uninterrupted runs, so there a relative 1e-5 counts as the same losses.
    return result["losses_equal"] or (device == "cuda" and result["max_rel_loss_diff"] <= 1e-5)


def path_rows(part: dict, paths: tuple[str, ...], rate: str, width: int) -> list[str]:
    """A part's paths side by side: each path's rate and peak."""
    label = rate.replace("_per_s", "/s")
    return [f"   {'path':>{width}} | {label:>9} | {'peak GiB':>8}"] + [
        f"   {p:>{width}} | {part[p][rate]:>9} | {part[p]['peak_gib']:>8}" for p in paths]


def table(results: dict, header: str) -> str:
    lines = [header]
    a = results.get("drafter_step", {"error": ""})
    if measured(a):
        lines += [f"a. drafter step ({a['shape']}; peak: weights, AdamW state and activations)"]
        lines += path_rows(a, ("unchunked", "chunked"), "samples_per_s", 10)
        lines += [f"   chunked/unchunked: peak {a['peak_ratio']}x, time {a['time_ratio']}x",
                  f"   reference: {a['reference']}"]
    b = results.get("target_capture", {"error": ""})
    if measured(b):
        lines += [f"b. target capture ({b['shape']}, bf16, batch {b['batch']}; peak above the weights)"]
        lines += path_rows(b, ("whole_batch", "rows_per_pass_1"), "tokens_per_s", 16)
    c = results.get("gpu_tests", {"error": ""})
    if measured(c):
        lines += [f"c. pytest -m gpu: {c.get('summary', c.get('status'))}"]
    d = results.get("training", {"error": ""})
    if measured(d):
        lines += [f"d. training on {d['device']}: {d['steps']} steps, {d['stop']} at step {d['stopped_at']}, "
                  f"resumed; losses equal: {d['losses_equal']} (max rel diff {d['max_rel_loss_diff']:.1e})"]
    e = results.get("recipe", {"error": ""})
    if measured(e):
        lines += [f"e. the recipe's drafter rank (configs/qwen3-8b.yaml: {e['shape']}; {e['peak_scope']})",
                  f"   {'phase':>12} | {'peak GiB':>8} | {'predicted GiB':>13} | {'seconds':>7}"]
        lines += [f"   {name:>12} | {e[name]['peak_gib']:>8} | {str(e[name]['predicted_gib']):>13} | "
                  f"{e[name]['seconds']:>7}" for name in ("drafter_step", "heldout")]
    speed = {k: v for name in ("drafter_speed", "tiles_speed") if measured(results.get(name))
             for k, v in results[name].items()}
    if speed:
        lines += table_rows(with_speedup(speed))
    if measured(results.get("drafter_kinds")):
        lines += kinds_rows(results["drafter_kinds"])
    lines += [f"{name}: FAILED: {(r['error'].splitlines() or [''])[0][:300]}"
              for name, r in results.items() if "error" in r]
    lines += [f"{name}: {r['left_out']}" for name, r in results.items() if "left_out" in r]
    lines += ["seconds by part (estimated on an H200): " + ", ".join(
        f"{name} {r['seconds']} ({plan.ESTIMATED_S[name]})" for name, r in results.items() if "seconds" in r)]
    lines += [NOT_SHOWN]
    return "\n".join(lines)


def measured(result: dict | None) -> bool:
    return result is not None and "error" not in result and "left_out" not in result


PARTS = {"drafter_step": drafter_part, "target_capture": lambda mode, device: run_part_in_subprocess(
    "capture", mode, device), "gpu_tests": gpu_tests_part, "training": training_part,
         "recipe": lambda mode, device: run_part_in_subprocess("recipe", mode, device),
         "drafter_speed": lambda mode, device: speed_part(mode, device, ("auto",)),
         "tiles_speed": lambda mode, device: speed_part(mode, device, ("tiles",)),
         "drafter_kinds": lambda mode, device: run_part_in_subprocess("kinds", mode, device)}
CHILD_PARTS = {"capture": capture_part, "recipe": recipe_part, "kinds": kinds_part}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=False, help="directory for gpu_check.txt and gpu_check.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU at a tiny width (before a GPU sees it)")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS),
                        default=[p for p in PARTS if p not in plan.OFF_UNLESS_NAMED],
                        help="the parts to run, in the order of value whatever the order given (default: all "
                             "but tiles_speed, the tiles row, measured already)")
    parser.add_argument("--budget", type=float, metavar="SECONDS",
                        help=f"start a part only when its estimated seconds fit what is left (default: "
                             f"{plan.DEFAULT_BUDGET_S:g} on a GPU, none on the dry run)")
    parser.add_argument("--part", choices=list(CHILD_PARTS), help=argparse.SUPPRESS)  # a child's part
    parser.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        print(json.dumps(CHILD_PARTS[args.part](args.mode, args.device)))
        return 0
    if not args.out:
        parser.error("--out DIR is required")
    mode, device = ("dry", "cpu") if args.dry_run else ("full", "cuda")
    budget = args.budget if args.budget is not None or args.dry_run else plan.DEFAULT_BUDGET_S
    started = time.monotonic()
    # Before any part: what the GPU's parts need, in seconds, all of it said at once.
    tools = plan.toolchain(need_triton=device == "cuda")
    problems = list(tools["problems"]) if device == "cuda" else []
    if device == "cuda" and not torch.cuda.is_available():
        problems.insert(0, f"no CUDA device is visible (torch {torch.__version__}); --dry-run runs the check "
                           "on CPU at a tiny width")
    if problems:
        print("gpu_check: nothing was measured:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (dry run, tiny width)"
    header = (f"gpu_check {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {name}; "
              f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    header += f"\ntoolchain: Triton {tools['triton'] or 'not found'}; C compiler {tools['compiler']}" + \
        "".join(f"\n  note: {note}" for note in tools["notes"])
    print(header, flush=True)
    results = {}
    for part in plan.ordered(dict.fromkeys(args.parts)):
        why = plan.fits(part, time.monotonic() - started, budget)
        if why:
            results[part] = {"left_out": why}
            print(f"{part}: {why}", flush=True)
            continue
        part_started = time.monotonic()
        try:
            results[part] = PARTS[part](mode, device)
        except Exception as exc:  # one part's failure must not hide the others' figures
            results[part] = {"error": "".join(traceback.format_exception_only(exc)).strip()}
        results[part]["seconds"] = round(time.monotonic() - part_started, 1)
        print(f"{part}: done in {results[part]['seconds']} s", flush=True)
        record, text = write_results(args, name, header, tools, budget, started, results, device)
    record, text = write_results(args, name, header, tools, budget, started, results, device)
    print(text)
    print(json.dumps(record))
    return 0 if record["ok"] else 1


def write_results(args, name, header, tools, budget, started, results, device) -> tuple[dict, str]:
    """gpu_check.txt and gpu_check.json as far as the check got: written after every part, so that a call
    cut short returns what it measured."""
    ok = all(measured(r) and passed(p, r, device) for p, r in results.items() if "left_out" not in r)
    text = table(results, header)
    record = {"device": name, "dry_run": args.dry_run, "ok": ok, "budget_s": budget, "toolchain": tools,
              "seconds": round(time.monotonic() - started, 1), "not_shown": NOT_SHOWN, **results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.txt").write_text(text + "\n")
    (out / "gpu_check.json").write_text(json.dumps(record) + "\n")
    return record, text


if __name__ == "__main__":
    sys.exit(main())

"""vLLM serving an exported drafter beside `dflash_ops.evaluate`, same prompts: `python -m benchmarks.serve`.

Needs the venv of `make serve-check` (`.cache/serve-venv`: vLLM's CPU build). Without `--config` it
trains a drafter briefly on the tiny demo assets; with `--config` and `--checkpoint` it takes that
run (the demo's, say). Then, on the held-out prompts of the config:

- exports the checkpoint (`dflash_ops.export`, `--dtype`, float32 by default);
- decodes every prompt with `dflash_ops.evaluate`'s greedy speculative decoding around the export's
  drafter (`load_export`): its output (the target's greedy), verify steps and accepted drafts;
- runs vLLM's offline API (`benchmarks/vllm_driver.py` in the serve venv, one process per engine)
  on the target alone, then with the export as a DFlash drafter at `num_speculative_tokens` =
  block_size - 1 (and at each `--also-k`), and reads its speculative decoding counters.

It prints one table (ours and vLLM's verify steps, tau, accepted drafts per position, whether each
output equals the target alone's) and a JSON line. The seconds are vLLM's `generate` call on this
CPU: they say nothing of a GPU engine's speed (docs/SERVING.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from dflash_ops.core.config import config_from_dict, load_config
from dflash_ops.data.target import load_target
from dflash_ops.run.main import run_single_process
from dflash_ops.serve.evaluate import (
    AcceptanceStats,
    end_of_text_id,
    eval_prompts,
    kind_proposer,
    speculative_decode,
)
from dflash_ops.serve.export import export_checkpoint, load_export
from dflash_ops.training.checkpoint import find_checkpoint

REPO = Path(__file__).resolve().parent.parent
SERVE_VENV = REPO / ".cache" / "serve-venv"
SERVE_PYTHON = SERVE_VENV / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_driver.py")
DSPARK_DRIVER = Path(__file__).with_name("vllm_dspark_driver.py")  # vLLM's DSpark parts, driven directly
# Written last by scripts/serve_venv.py (scripts/cached_venv.py): its absence means no usable venv.
SERVE_VENV_COMPLETE = SERVE_VENV / ".complete"
# vLLM on CPU sizes its KV cache from this (GiB); the default would take a good share of the memory.
KV_CACHE_GIB = "1"


def serve_venv_problem() -> str | None:
    """Why vLLM cannot run here, or None."""
    if not SERVE_VENV_COMPLETE.is_file():
        return f"no vLLM venv at {SERVE_VENV}: build it and run the check with `make serve-check`"
    return None


def train_tiny_drafter(workdir: Path, steps: int = 300, model: dict | None = None,
                       **sections: dict) -> tuple[Path, Path]:
    """A drafter trained `steps` steps on the tiny demo assets (b = 8), its `model` keys changed by
    `model` (a sliding window, a DSpark drafter) and those of other sections by `sections` (`loss=`,
    `data=`); its config and run directory."""
    from pvesim.fleet import prepare_assets

    raw = yaml.safe_load((prepare_assets() / "config.yaml").read_text())
    for section, keys in {"model": model or {}, **sections}.items():
        raw[section] = {**(raw.get(section) or {}), **keys}
    raw["optim"]["total_steps"] = steps
    raw["run"].update(output_dir=str(workdir / "run"), save_every=steps, eval_every=steps, log_every=steps)
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    torch.set_num_threads(1)
    if run_single_process(config_from_dict(raw)) != 0:
        raise RuntimeError(f"training the drafter of {config} failed")
    return config, workdir / "run"


def vllm_generate(request: dict, workdir: Path, name: str, timeout: float = 1200,
                  driver: Path = DRIVER) -> dict:
    """`driver` (`benchmarks/vllm_driver.py`) on `request` in the serve venv; its result (RuntimeError on
    failure, with the end of vLLM's log)."""
    request_path, result_path, log_path = (workdir / f"{name}.{ext}"
                                           for ext in ("request.json", "result.json", "log"))
    request_path.write_text(json.dumps(request))
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    with log_path.open("w") as log:
        done = subprocess.run([str(SERVE_PYTHON), str(driver), str(request_path), str(result_path)],
                              cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM ({name}) exited {done.returncode}; the end of {log_path}:\n"
                           + log_path.read_text()[-4000:])
    return json.loads(result_path.read_text())


def our_decoding(target_dir: Path, export_dir: Path, prompts: list[list[int]],
                 max_new_tokens: int) -> tuple[list[list[int]], AcceptanceStats]:
    """`dflash_ops.evaluate`'s decoding of each prompt around the export's drafter: outputs and figures."""
    target = load_target(target_dir)
    drafter, layer_ids = load_export(export_dir, target)
    propose, block_size = kind_proposer(drafter)  # drafts a step + 1: what vLLM's K + 1 verifies
    stats = AcceptanceStats("dflash_ops.evaluate", block_size)
    eos = end_of_text_id(target)
    outputs = [speculative_decode(target, propose, prompt, layer_ids, block_size, max_new_tokens, eos, stats)
               for prompt in prompts]
    return outputs, stats


def side_by_side(config_path: Path, checkpoint: Path, workdir: Path, num_prompts: int | None = None,
                 max_new_tokens: int = 64, dtype: str = "float32", also_k: tuple[int, ...] = (),
                 repeats: int = 1) -> dict:
    """Ours and vLLM's figures on the held-out prompts of `config_path`, for the drafter of `checkpoint`."""
    cfg = load_config(config_path)
    target_dir = Path(cfg.model.target_path)
    prompts = eval_prompts(Path(cfg.data.path).with_name("eval.jsonl"), cfg.data.max_length, num_prompts)
    export_dir = export_checkpoint(find_checkpoint(checkpoint), workdir / "export", dtype)
    outputs, stats = our_decoding(target_dir, export_dir, prompts, max_new_tokens)
    target_config = json.loads((target_dir / "config.json").read_text())
    request = {"target": str(target_dir), "drafter": None, "num_speculative_tokens": None, "prompts": prompts,
               "max_new_tokens": max_new_tokens, "dtype": dtype, "repeats": repeats,
               "max_model_len": target_config["max_position_embeddings"]}
    alone = vllm_generate(request, workdir, "target-alone")
    served = {}
    for k in (stats.block_size - 1, *also_k):
        with_drafter = {**request, "drafter": str(export_dir), "num_speculative_tokens": k}
        served[k] = vllm_generate(with_drafter, workdir, f"dflash-k{k}")
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "dtype": dtype,
            "block_size": stats.block_size, "ours": {**stats.as_dict(), "outputs": outputs},
            "target_alone": alone, "dflash": served}


def vllm_row(run: dict, alone: dict) -> dict:
    """vLLM's counters as our figures: tau as vLLM states it (1 + accepted / drafts, uncut); its
    speed against the target alone's in the same benchmark."""
    spec = run["spec_decode"]
    drafts = spec["num_drafts"]
    tokens = sum(map(len, run["outputs"]))
    return {"drafts": drafts, "tau": 1 + spec["num_accepted_tokens"] / drafts if drafts else None,
            "accepted_by_position": spec["accepted_per_position"], "tokens": tokens,
            "tokens_per_s": tokens / run["seconds"], "seconds": run["seconds"],
            "speed_vs_alone": alone["seconds"] / run["seconds"],
            "equal_to_alone": sum(a == b for a, b in zip(run["outputs"], alone["outputs"], strict=True))}


def format_table(result: dict) -> str:
    ours, alone = result["ours"], result["target_alone"]
    steps = ours["verify_steps"]
    same = sum(a == b for a, b in zip(ours["outputs"], alone["outputs"], strict=True))
    head = (f"{'decoder':<26} {'steps':>6} {'tau':>5} {'uncut':>6} {'= alone':>7} {'tok/s':>6} {'x':>5}  "
            f"accepted drafts at position 1..")
    lines = [f"{result['prompts']} prompts, {result['max_new_tokens']} new tokens, {result['dtype']}, "
             f"b = {result['block_size']}", head, "-" * len(head),
             f"{'dflash_ops.evaluate (export)':<26} {steps:>6} {ours['tau']:>5.2f} "
             f"{1 + sum(ours['accepted_by_position']) / steps:>6.2f} {same:>3}/{result['prompts']:<3} "
             f"{'':>6} {'':>5}  {' '.join(map(str, ours['accepted_by_position']))}"]
    for name, run in (("vLLM, target alone", alone),
                      *((f"vLLM, DFlash K = {k}", run) for k, run in result["dflash"].items())):
        row = vllm_row(run, alone)
        uncut = f"{row['tau']:>6.2f}" if row["tau"] is not None else f"{'':>6}"
        lines.append(f"{name:<26} {row['drafts'] or row['tokens']:>6} {'':>5} {uncut} "
                     f"{row['equal_to_alone']:>3}/{result['prompts']:<3} {row['tokens_per_s']:>6.0f} "
                     f"{row['speed_vs_alone']:>5.2f}  {' '.join(map(str, row['accepted_by_position']))}")
    lines.append("steps: our verify steps, vLLM's drafts (tokens for the target alone); tau: tokens the "
                 "output keeps per step; uncut: 1 + accepted drafts per step (vLLM's mean acceptance "
                 "length); = alone: outputs equal to vLLM's target alone; tok/s and x (speed over the "
                 "target alone): vLLM's generate call on this CPU, the fastest of the repeats")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path,
                        help="a training config (default: a drafter trained on the tiny demo assets)")
    parser.add_argument("--checkpoint", type=Path, help="its checkpoint or run directory (with --config)")
    parser.add_argument("--steps", type=int, default=300,
                        help="training steps of the tiny drafter (default 300)")
    parser.add_argument("--num-prompts", type=int, help="the first N held-out prompts (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the export's and vLLM's dtype (default float32, where ours and vLLM's "
                             "drafts compare)")
    parser.add_argument("--also-k", type=int, nargs="*", default=[],
                        help="other num_speculative_tokens to serve the same drafter with")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times vLLM's generate call is timed, the fastest kept (default 3)")
    parser.add_argument("--workdir", type=Path,
                        help="where the export and vLLM's logs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if (args.config is None) != (args.checkpoint is None):
        parser.error("--config and --checkpoint go together")
    problem = serve_venv_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        config, checkpoint = args.config, args.checkpoint
        if config is None:
            config, checkpoint = train_tiny_drafter(workdir, args.steps)
        result = side_by_side(config, checkpoint, workdir, args.num_prompts, args.max_new_tokens, args.dtype,
                              tuple(args.also_k), args.repeats)
    print(format_table(result))
    alone = result["target_alone"]
    figures = {"ours": {k: v for k, v in result["ours"].items() if k != "outputs"},
               "ours_equal_to_alone": result["ours"]["outputs"] == alone["outputs"],
               "target_alone": vllm_row(alone, alone),
               "dflash": {str(k): vllm_row(run, alone) for k, run in result["dflash"].items()},
               **{k: result[k] for k in ("prompts", "max_new_tokens", "dtype", "block_size")}}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regeneration's engines side by side: `python -m benchmarks.regenerate`.

One target, written by the benchmark with random weights (Qwen3, hidden 512, 8 layers, 8 heads of 64, 2 KV
heads, MLP 1536: compute dominates, and its head size is one vLLM's CPU attention takes) and the tiny demo
target's tokenizer and chat template. The prompts are chats of 4 to 60 words (~25 to ~200 tokens). The
answers vary in length as real ones do: they are sampled (temperature 1; random weights give every id about
the same chance) and four of the 384 ids end one (the target's `eos_token_id` list, at which both engines
stop), so an answer ends after ~96 tokens on average, geometrically spread, at most MAX_NEW_TOKENS (greedy,
random weights loop without meeting one: every answer then has MAX_NEW_TOKENS, where static batches lose
nothing). The same prompts go through `python -m dflash_ops.data regenerate`, in float32 (the CPU's):

- `--engine hf` at its default batch (8) and at the other `--batch-size`s given: transformers' generate on
  static, left-padded batches in prompt order;
- `--engine vllm` (the venv of `make serve-check`): vLLM's engine, continuous batching, one engine.

It prints prompts/s and output tokens/s of each, each one's ratio to hf's best batch, and one JSON line.
The seconds exclude loading: hf's from the model loaded (its `seconds` less the load, measured apart), vLLM's
from its engine ready (`generation_seconds`); the engine's start (a minute or more on CPU) is shown beside.
The machine's load average is printed before and after. Minutes: not in `make bench`.

    python -m benchmarks.regenerate [--prompts 64] [--batch-sizes 8,32,64] [--dir /tmp/bench-regenerate]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.serve import KV_CACHE_GIB, SERVE_PYTHON, serve_venv_problem
from dflash_ops.data.chat_prompts import read_rows

REPO = Path(__file__).resolve().parent.parent
SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 64, "intermediate_size": 1536, "max_position_embeddings": 512}
MAX_LENGTH = 512
MAX_NEW_TOKENS = 256
# Ids besides the tokenizer's end of text that end an answer: 4 of the 384.
MORE_ENDS = (100, 200, 300)
ENDS = (0, *MORE_ENDS)  # the demo tokenizer's end of text is id 0


def write_target(path: Path) -> Path:
    """The benchmark's target: SHAPE with random weights, the demo target's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from pvesim.fleet import prepare_assets

    demo = prepare_assets() / "target"
    tokenizer = AutoTokenizer.from_pretrained(demo, local_files_only=True)
    assert tokenizer.eos_token_id == ENDS[0], tokenizer.eos_token_id
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPE, vocab_size=len(tokenizer), tie_word_embeddings=True,
                         eos_token_id=list(ENDS),
                         pad_token_id=tokenizer.pad_token_id)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_prompts(path: Path, count: int) -> Path:
    rng = random.Random(0)
    words = ["cats", "rivers", "stars", "rain", "trees", "boats", "clouds", "songs", "stone", "light"]
    chats = [[{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(4, 60)))}]
             for _ in range(count)]
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    return path


def regenerate(target: Path, prompts: Path, out: Path, *extra: str) -> dict:
    """One `dflash_ops.data regenerate` call from nothing; its summary line."""
    for stale in out.parent.glob(out.name + "*"):
        stale.unlink()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dflash_ops.data", "regenerate", "--target", str(target),
                           "--prompts", str(prompts), "--out", str(out), "--dtype", "float32",
                           "--max-length", str(MAX_LENGTH), "--max-new-tokens", str(MAX_NEW_TOKENS),
                           "--temperature", "1", "--seed", "0", "--progress-every", "0", *extra],
                          cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"regenerate {' '.join(extra)} failed:\n{done.stderr[-4000:]}")
    return {**json.loads(done.stdout.splitlines()[-1]), "wall_s": time.perf_counter() - started}


def load_seconds(target: Path) -> float:
    """What the hf path spends before it generates: the tokenizer and the model loaded, once."""
    from dflash_ops.data.regenerate import load_tokenizer
    from dflash_ops.data.target import load_target

    started = time.perf_counter()
    load_tokenizer(str(target))
    load_target(target)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-sizes", default="8,32,64", help="hf's batch sizes (8: its default)")
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    problem = serve_venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    workdir = args.dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-regenerate-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    try:
        target = write_target(workdir / "target")
        prompts = write_prompts(workdir / "prompts.jsonl", args.prompts)
        loading = load_seconds(target)
        rows = []
        batches = args.batch_sizes.split(",")
        runs = [(f"hf, batch {b}", ["--engine", "hf", "--batch-size", b]) for b in batches]
        for name, extra in runs + [("vllm", ["--engine", "vllm", "--engine-python", str(SERVE_PYTHON)])]:
            out = workdir / f"{name.split(',')[0]}.jsonl"
            summary = regenerate(target, prompts, out, *extra)
            answers = read_rows(out)
            hf = name.startswith("hf")
            rows.append({"engine": name, "seconds": summary["seconds"] - loading if hf else
                         summary["generation_seconds"],
                         "tokens": sum(sum(row["loss_mask"]) for row in answers.values()),
                         "start_s": loading if hf else summary["seconds"] - summary["generation_seconds"],
                         "ended": sum(row["input_ids"][-1] in ENDS for row in answers.values())})
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    best = max((row for row in rows if row["engine"].startswith("hf")),
               key=lambda row: row["tokens"] / row["seconds"])
    print(f"{args.prompts} prompts, float32, sampled, answers of at most {MAX_NEW_TOKENS} tokens; target "
          f"{SHAPE}; {os.cpu_count()} CPUs, load average {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print(f"{'engine':<14}{'prompts/s':>11}{'tokens/s':>11}{'x hf best':>11}{'start s':>9}"
          f"{'tokens/answer':>15}{'ended by id':>13}")
    for row in rows:
        rate = row["tokens"] / row["seconds"]
        row.update(prompts_per_s=args.prompts / row["seconds"], tokens_per_s=rate,
                   vs_hf_best=rate / (best["tokens"] / best["seconds"]))
        print(f"{row['engine']:<14}{row['prompts_per_s']:>11.2f}{rate:>11.1f}{row['vs_hf_best']:>10.2f}x"
              f"{row['start_s']:>9.1f}{row['tokens'] / args.prompts:>15.1f}{row['ended']:>13}")
    print(json.dumps({"benchmark": "regenerate", "prompts": args.prompts, "load_before": load_before[0],
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

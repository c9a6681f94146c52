"""What a drafter rank holds: the target's head alone against the whole target.

Saves a randomly initialised Qwen3 target (36 layers) in bf16, then, each in a fresh process,
loads what a drafter rank needs and builds the drafter around it:

- head (now): `load_target_head`, the config, embedding and lm_head read from the safetensors;
- whole target (before): `load_target`, the model with every decoder layer.

Reported: the weights each process holds (every distinct tensor: what a GPU would hold), and its
resident memory growth (VmRSS after the load, every weight read once, minus after the imports)
against the target's weights on disk and the head's share of them. Prints a table, then one JSON
line.

    python -m benchmarks.drafter_rank                       # H 512, vocab 32768, 36 layers
    python -m benchmarks.drafter_rank --hidden 1024 --vocab 65536
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LOAD = """
import json, sys, torch
from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import TargetHead, load_target, load_target_head
from dflash_ops.training.trainer import build_drafter

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

path, how = sys.argv[1], sys.argv[2]
cfg = config_from_dict({"model": {"target_path": path, "num_draft_layers": 1, "mask_token_id": 0,
                                  "dtype": "bfloat16"}, "data": {"path": "unused.jsonl"}})
before = rss()
target = load_target(path, "bfloat16") if how == "whole" else None
head = load_target_head(path, "bfloat16") if target is None else TargetHead.of(target)
drafter = build_drafter(cfg, head)
weights = list(drafter.parameters()) + (list(target.parameters()) if target is not None else [])
for weight in weights:  # touch every page: safetensors may map weights lazily
    weight.detach().sum()
held = {w.data_ptr(): w.numel() * w.element_size() for w in weights}
print(json.dumps({"rss_bytes": rss() - before, "held_bytes": sum(held.values()),
                  "drafter_trainable_bytes": sum(p.numel() * p.element_size()
                                                 for p in drafter.parameters() if p.requires_grad)}))
"""


def save_target(path: Path, args) -> tuple[int, int]:
    """Write the target; return (its weight bytes, its embedding + lm_head bytes)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    head = sum(m.weight.numel() * m.weight.element_size()
               for m in (model.get_input_embeddings(), model.get_output_embeddings()))
    return total, head


def load_in_fresh_process(path: Path, how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", LOAD, str(path), how], cwd=REPO, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.drafter_rank",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dflash-drafter-rank-") as tmp:
        path = Path(tmp) / "target"
        target_bytes, head_bytes = save_target(path, args)
        head = load_in_fresh_process(path, "head")
        whole = load_in_fresh_process(path, "whole")
    mib = 2**20
    row = {
        "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "dtype": "bfloat16",
        "target_mib": round(target_bytes / mib, 1), "target_head_mib": round(head_bytes / mib, 1),
        "drafter_trainable_mib": round(head["drafter_trainable_bytes"] / mib, 1),
        "head_rank_held_mib": round(head["held_bytes"] / mib, 1),
        "whole_target_rank_held_mib": round(whole["held_bytes"] / mib, 1),
        "head_rank_held_vs_target": round(head["held_bytes"] / target_bytes, 3),
        "head_rank_rss_mib": round(head["rss_bytes"] / mib, 1),
        "whole_target_rank_rss_mib": round(whole["rss_bytes"] / mib, 1),
        "head_rank_vs_target": round(head["rss_bytes"] / target_bytes, 3),
        "whole_target_rank_vs_target": round(whole["rss_bytes"] / target_bytes, 3),
    }
    print(f"target: {args.layers} layers, H {args.hidden}, vocab {args.vocab}, bf16: {row['target_mib']} MiB "
          f"(embedding + lm_head {row['target_head_mib']} MiB); drafter weights (fp32) "
          f"{row['drafter_trainable_mib']} MiB")
    print(f"{'drafter rank loads':>20} | {'weights MiB':>11} {'RSS growth MiB':>14} {'RSS x target':>12}")
    print(f"{'head (now)':>20} | {row['head_rank_held_mib']:>11} {row['head_rank_rss_mib']:>14} "
          f"{row['head_rank_vs_target']:>12}")
    print(f"{'whole target':>20} | {row['whole_target_rank_held_mib']:>11} "
          f"{row['whole_target_rank_rss_mib']:>14} {row['whole_target_rank_vs_target']:>12}")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Target feature capture: the k layers as they are produced versus every layer's output.

Both paths run the same randomly initialised deep, narrow Qwen3 target (36 layers, like Qwen3-8B,
at a small hidden size) on the same padded batch and return the same packed `[T, k*H]` features
(checked bit for bit):

- all layers (the previous path): `output_hidden_states=True` keeps the n + 1 `[B, L, H]` layer
  outputs, every layer runs, then k of them are packed;
- capture (`dflash_ops.data.target.target_hidden_states`): hooks copy the k selected layers' real tokens
  into the packed output as they are produced, and the forward pass ends after the deepest one;
- capture, one row per pass (`model.target_rows_per_pass: 1`): the same, a row at a time.

Peak memory is what torch's own allocator holds beyond the inputs and the model (`benchmarks.memory`:
the CUDA allocator's peak, or on CPU the running sum of torch.profiler's allocation events), given
as a ratio and in units of one layer output `[B, L, H]`; time is the best of interleaved repeats.
Prints a table, then one JSON line.

    python -m benchmarks.target_capture                    # 36 layers, H 128, B 4, L 512, k 5
    python -m benchmarks.target_capture --hidden 4096 --intermediate 12288 --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hidden_states import best_seconds, ragged_lengths  # noqa: E402

from benchmarks.memory import peak_allocated_bytes  # noqa: E402
from dflash_ops.core.target_layers import build_target_layer_ids  # noqa: E402
from dflash_ops.data.target import target_hidden_states, target_hidden_states_all_layers  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_target(layers: int, hidden: int, intermediate: int, heads: int, vocab: int, dtype: torch.dtype,
                 device: torch.device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                         max_position_embeddings=4096, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval().requires_grad_(False)


def measure(args, device: torch.device) -> dict:
    dtype = DTYPES[args.dtype]
    target = build_target(args.layers, args.hidden, args.intermediate, args.heads, args.vocab, dtype, device)
    layer_ids = build_target_layer_ids(args.layers, args.k)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.max_len), generator=g).to(device)
    attention_mask = torch.zeros(args.batch, args.max_len, dtype=torch.int64, device=device)
    for row, n in enumerate(ragged_lengths(args.batch, args.max_len, args.padding)):
        attention_mask[row, :n] = 1

    def capture():
        return target_hidden_states(target, input_ids, attention_mask, layer_ids)

    def capture_by_row():
        return target_hidden_states(target, input_ids, attention_mask, layer_ids, rows_per_pass=1)

    def all_layers():
        return target_hidden_states_all_layers(target, input_ids, attention_mask, layer_ids)

    paths = {"capture": capture, "capture_by_row": capture_by_row, "all_layers": all_layers}
    peaks, features = {}, {}
    for name, fn in paths.items():
        result, peaks[name] = peak_allocated_bytes(fn, device)
        features[name] = result.features
    for name in ("capture", "capture_by_row"):
        if not torch.equal(features[name], features["all_layers"]):
            raise AssertionError(f"{name} features differ from the all-layers path")
    del features, result
    times = dict(zip(paths, best_seconds(list(paths.values()), args.repeats, device), strict=True))
    layer_bytes = args.batch * args.max_len * args.hidden * torch.finfo(dtype).bits // 8
    figures = {}
    for name in paths:
        figures[f"{name}_peak_mib"] = round(peaks[name] / 2**20, 2)
        figures[f"{name}_peak_layers"] = round(peaks[name] / layer_bytes, 2)
        figures[f"{name}_ms"] = round(times[name] * 1e3, 1)
        figures[f"{name}_peak_ratio"] = round(peaks[name] / peaks["all_layers"], 3)
        figures[f"{name}_time_ratio"] = round(times[name] / times["all_layers"], 3)
    return {
        "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "k": args.k,
        "layer_ids": layer_ids, "batch": args.batch, "max_len": args.max_len, "dtype": args.dtype,
        "padding": args.padding, "device": str(device), "layer_output_mib": round(layer_bytes / 2**20, 3),
        **figures,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.target_capture",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--k", type=int, default=5, help="target layers the drafter uses (paper: 5)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--padding", type=float, default=0.25, help="fraction of the batch that is padding")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    row = measure(args, torch.device(args.device))
    print(f"target: {row['layers']} layers, H {row['hidden']}, I {row['intermediate']}, layer ids "
          f"{row['layer_ids']}; batch {row['batch']} x {row['max_len']}, {row['dtype']} on {row['device']}; "
          f"one layer output [B, L, H] = {row['layer_output_mib']} MiB")
    print(f"{'path':>16} | {'peak MiB':>9} {'layers':>7} {'x all':>6} | {'ms':>8} {'x all':>6}")
    for name in ("capture", "capture_by_row", "all_layers"):
        print(f"{name:>16} | {row[name + '_peak_mib']:>9} {row[name + '_peak_layers']:>7} "
              f"{row[name + '_peak_ratio']:>6} | {row[name + '_ms']:>8} {row[name + '_time_ratio']:>6}")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())

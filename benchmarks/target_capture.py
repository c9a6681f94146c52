"""Target feature capture: the k layers as they are produced versus every layer's output.

Both paths run the same randomly initialised deep, narrow Qwen3 target (36 layers, like Qwen3-8B,
at a small hidden size) on the same padded batch and return the same packed `[T, k*H]` features
(checked bit for bit):

- all layers (the previous path): `output_hidden_states=True` keeps the n + 1 `[B, L, H]` layer
  outputs, every layer runs, then k of them are packed;
- capture (`dflash_ops.data.target.target_hidden_states`): hooks copy the k selected layers' real tokens
  into the packed output as they are produced, and the forward pass ends after the deepest one;
- capture, one row per pass (`model.target_rows_per_pass: 1`): the same, a row at a time;
- packed (`dflash_ops.data.target.target_document_states`, what the trainer and the feature cache run):
  the documents end to end in one row, positions restarting per document, attention within each
  document (`dflash_ops.data.document_attention`): no padding token is computed. Checked bit for bit
  against each document captured alone, and to 8 units of rounding against the padded batch (whose
  attention of a shorter row reduces over the padded length);
- packed, one row per pass: the same, a document at a time.

Then target rows/s and tokens/s (real tokens) of the padded capture and the packed one side by side,
and the packed one's speed-up; and, modelled, the same ratio at the recipe (Qwen3-8B, layers up to the
deepest captured, batches of `--recipe-batch` documents of ragged lengths up to 3072 tokens): FLOPs of
the padded batch (every row at the longest row's length, attention over every masked pair: SDPA's
masked path) over those of the packed documents (each at its own length, causal attention).

Peak memory is what torch's own allocator holds beyond the inputs and the model (`benchmarks.memory`:
the CUDA allocator's peak, or on CPU the running sum of torch.profiler's allocation events), given
as a ratio and in units of one layer output `[B, L, H]`; time is the best of interleaved repeats.
Prints a table, then one JSON line.

    python -m benchmarks.target_capture                    # 36 layers, H 128, B 4, L 512, k 5
    python -m benchmarks.target_capture --batch 8 --padding 0.4     # raggeder, as real documents are
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
from dflash_ops.data.target import (  # noqa: E402
    target_document_states,
    target_hidden_states,
    target_hidden_states_all_layers,
)
from dflash_ops.run.balance import layer_flops  # noqa: E402
from dflash_ops.training.memory_fit import TargetShape  # noqa: E402

PATHS = ("capture", "capture_by_row", "all_layers", "packed", "packed_by_row")
# Qwen3-8B's config.json: the recipe's target.
QWEN3_8B = TargetShape(num_layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                       vocab=151936, tied=False)

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
    lengths = ragged_lengths(args.batch, args.max_len, args.padding)
    for row, n in enumerate(lengths):
        attention_mask[row, :n] = 1
    documents = torch.cat([input_ids[row, :n] for row, n in enumerate(lengths)])

    def capture():
        return target_hidden_states(target, input_ids, attention_mask, layer_ids)

    def capture_by_row():
        return target_hidden_states(target, input_ids, attention_mask, layer_ids, rows_per_pass=1)

    def all_layers():
        return target_hidden_states_all_layers(target, input_ids, attention_mask, layer_ids)

    def packed():
        return target_document_states(target, documents, lengths, layer_ids)

    def packed_by_row():
        return target_document_states(target, documents, lengths, layer_ids, rows_per_pass=1)

    paths = {"capture": capture, "capture_by_row": capture_by_row, "all_layers": all_layers, "packed": packed,
             "packed_by_row": packed_by_row}
    peaks, features = {}, {}
    for name, fn in paths.items():
        result, peaks[name] = peak_allocated_bytes(fn, device)
        features[name] = result.features
    for name in ("capture", "capture_by_row"):
        if not torch.equal(features[name], features["all_layers"]):
            raise AssertionError(f"{name} features differ from the all-layers path")
    check_packed(target, input_ids, lengths, layer_ids, features, device)
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
    for name in ("capture", "packed"):
        figures[f"{name}_rows_per_s"] = round(args.batch / times[name], 2)
        figures[f"{name}_tokens_per_s"] = round(sum(lengths) / times[name], 1)
    figures["packed_speedup"] = round(times["capture"] / times["packed"], 3)
    return {
        "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "k": args.k,
        "layer_ids": layer_ids, "batch": args.batch, "max_len": args.max_len, "dtype": args.dtype,
        "padding": args.padding, "lengths": lengths, "device": str(device),
        "layer_output_mib": round(layer_bytes / 2**20, 3), **figures,
        "recipe": recipe_model(args.recipe_batch, args.recipe_batches),
    }


def check_packed(target, input_ids, lengths, layer_ids, features, device) -> None:
    """The packed features: bit for bit each document's alone; to rounding the padded batch's."""
    ones = torch.ones(1, max(lengths), dtype=torch.int64, device=device)
    alone = torch.cat([target_hidden_states(target, input_ids[row: row + 1, :n], ones[:, :n],
                                            layer_ids).features for row, n in enumerate(lengths)])
    for name in ("packed", "packed_by_row"):
        if device.type == "cpu" and not torch.equal(features[name], alone):
            raise AssertionError(f"{name} features differ from each document captured alone")
        padded = features["capture"].float()
        worst = (features[name].float() - padded).abs().max()
        if worst > 8 * torch.finfo(features[name].dtype).eps * padded.abs().max():
            raise AssertionError(f"{name} features differ from the padded batch's beyond rounding ({worst})")


def recipe_model(batch: int, batches: int, max_len: int = 3072, seed: int = 0) -> dict:
    """Modelled at the recipe: the target's FLOPs (layers 0..33, Qwen3-8B) for `batches` batches of
    `batch` documents of lengths uniform in [64, max_len], padded (each row at the batch's longest
    length; attention over all Lmax^2 pairs, masked) and packed (each document at its own length,
    causal attention over half its pairs)."""
    shape = QWEN3_8B
    deepest = max(build_target_layer_ids(shape.num_layers, 5)) + 1  # layers 0..33 of 36
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, max_len + 1, (batches, batch), generator=g)
    attention = 2.0 * shape.heads * shape.head_dim  # QK and PV: 2 x 2 FLOPs per pair and head channel / 2
    padded = packed = padded_tokens = 0.0
    for row in lengths.tolist():
        longest = max(row)
        padded += deepest * batch * (layer_flops(shape, longest) + 2 * attention * longest * longest)
        packed += deepest * sum(layer_flops(shape, n) + attention * n * n for n in row)
        padded_tokens += batch * longest
    real, rows = float(lengths.sum()), lengths.numel()
    return {"batch": batch, "batches": batches, "max_len": max_len, "mean_length": round(real / rows),
            "padding": round(1 - real / padded_tokens, 3),
            "padded_tflop_per_row": round(padded / rows / 1e12, 2),
            "packed_tflop_per_row": round(packed / rows / 1e12, 2), "speedup": round(padded / packed, 3)}


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
    parser.add_argument("--recipe-batch", type=int, default=8, help="documents a batch in the recipe's model")
    parser.add_argument("--recipe-batches", type=int, default=2000, help="batches the recipe's model draws")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    row = measure(args, torch.device(args.device))
    print(f"target: {row['layers']} layers, H {row['hidden']}, I {row['intermediate']}, layer ids "
          f"{row['layer_ids']}; batch {row['batch']} x {row['max_len']}, {row['dtype']} on {row['device']}; "
          f"one layer output [B, L, H] = {row['layer_output_mib']} MiB")
    print(f"{'path':>16} | {'peak MiB':>9} {'layers':>7} {'x all':>6} | {'ms':>8} {'x all':>6}")
    for name in PATHS:
        print(f"{name:>16} | {row[name + '_peak_mib']:>9} {row[name + '_peak_layers']:>7} "
              f"{row[name + '_peak_ratio']:>6} | {row[name + '_ms']:>8} {row[name + '_time_ratio']:>6}")
    print(f"document lengths {row['lengths']} ({sum(row['lengths'])} of {row['batch'] * row['max_len']} "
          f"padded tokens): target rows/s padded {row['capture_rows_per_s']}, "
          f"packed {row['packed_rows_per_s']} (tokens/s {row['capture_tokens_per_s']} vs "
          f"{row['packed_tokens_per_s']}): packed {row['packed_speedup']}x")
    r = row["recipe"]
    print(f"modelled at the recipe (Qwen3-8B layers 0-33, {r['batches']} batches of {r['batch']} documents "
          f"of 64-{r['max_len']} tokens, mean {r['mean_length']}, {r['padding']:.0%} padding): "
          f"{r['padded_tflop_per_row']} TFLOP a row padded, {r['packed_tflop_per_row']} packed: "
          f"{r['speedup']}x")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())

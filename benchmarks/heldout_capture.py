"""Target rank 0's held-out capture: its peak beside the memory model's, in rows versus in one forward.

Target rank 0 computes drafter 0's held-out features once, at the start. It used to run one forward over
every held-out row (`data.eval_examples`, 64 in the recipe); `dflash_ops.run.pipeline.send_heldout` now
computes and sends them `data.batch_size` rows at a time (in passes of `model.target_rows_per_pass`), so
the rank's peak is that of a training batch, which the memory model predicts (`memory_fit.target_peak`:
`features_out` + `capture_working_set`). On one randomly initialised Qwen3 target (MLP 3H, as Qwen3's)
and one held-out set of full-length rows, this measures torch's allocator peak (`benchmarks.memory`:
on CPU the running sum of torch.profiler's allocation events) of:

- all at once: `step_features` over every held-out row (the old path);
- in batches: `step_features` over `--batch` rows at a time, each batch's features dropped before the
  next (what `send_heldout` does once `dist.send` returns);
- in batches of one row a pass (`model.target_rows_per_pass: 1`).

and prints each beside the model's prediction for a training batch (and, for the first, the model's
terms at the held-out row count), with the ratio measured / predicted. The features of the three paths are
checked equal.

    python -m benchmarks.heldout_capture               # 8 layers, H 256, 64 rows of 512, batch 8: ~1 min
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.memory import peak_allocated_bytes
from benchmarks.target_capture import build_target
from dflash_ops.core.config import config_from_dict
from dflash_ops.core.target_layers import build_target_layer_ids
from dflash_ops.data.examples import Example
from dflash_ops.data.target import step_features
from dflash_ops.training import memory_fit


def shape_of(args) -> memory_fit.TargetShape:
    return memory_fit.TargetShape(args.layers, args.hidden, args.intermediate, args.heads,
                                  max(1, args.heads // 2), args.hidden // args.heads, args.vocab, tied=False)


def predicted(args, rows: int, rows_per_pass: int | None) -> int:
    """The memory model's `features_out` + `capture_working_set` for a batch of `rows` full rows."""
    cfg = config_from_dict({
        "model": {"target_path": "unused", "num_draft_layers": 1, "dtype": "float32",
                  "target_layer_ids": build_target_layer_ids(args.layers, args.k),
                  "target_rows_per_pass": rows_per_pass},
        "data": {"path": "unused", "max_length": args.max_len, "batch_size": rows},
        "run": {"output_dir": "unused"}, "pipeline": {"device": "cpu"}})
    terms = dict(memory_fit.target_peak(cfg, shape_of(args), 0).terms)
    return terms["features_out"] + terms["capture_working_set"]


def measure(args) -> dict:
    device = torch.device("cpu")
    target = build_target(args.layers, args.hidden, args.intermediate, args.heads, args.vocab,
                          torch.float32, device)
    layer_ids = build_target_layer_ids(args.layers, args.k)
    g = torch.Generator().manual_seed(0)
    held_out = [Example(torch.randint(0, args.vocab, (args.max_len,), generator=g),
                        torch.ones(args.max_len, dtype=torch.int64)) for _ in range(args.rows)]
    chunks = [held_out[i:i + args.batch] for i in range(0, args.rows, args.batch)]

    def all_at_once():
        return step_features(target, held_out, layer_ids, None, device)["features"]

    def in_batches(rows_per_pass):
        def run():
            kept = []
            for chunk in chunks:
                features = step_features(target, chunk, layer_ids, rows_per_pass, device)["features"]
                kept.append(features.clone() if args.check else None)  # the check's copy, not counted below
                del features  # sent: `dist.send` has returned
            return kept
        return run

    whole, whole_peak = peak_allocated_bytes(all_at_once, device)  # the features' buffer included
    del whole
    rows = {"all at once": (whole_peak, predicted(args, args.rows, None), args.rows, args.rows)}
    for name, rows_per_pass in (("in batches", None), ("in batches, 1 row a pass", 1)):
        args.check = False
        _, peak = peak_allocated_bytes(in_batches(rows_per_pass), device)
        per_pass = rows_per_pass or args.batch
        rows[name] = (peak, predicted(args, args.batch, rows_per_pass), args.batch, per_pass)
    args.check = True
    reference = torch.cat(in_batches(1)())
    if not torch.equal(reference, all_at_once()):
        raise AssertionError("the held-out features differ between the paths")
    return {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "k": args.k,
            "rows": args.rows, "max_len": args.max_len, "batch": args.batch,
            "working_elements_model": memory_fit.capture_working_elements(shape_of(args)),
            "paths": {name: figures(args, *row) for name, row in rows.items()}}


def figures(args, peak: int, model: int, batch: int, per_pass: int) -> dict:
    """A path's peak and the model's, and its pass's working set (the peak less the batch's features) per
    (row of the pass, token, hidden channel), in float32 elements."""
    features = batch * args.max_len * args.k * args.hidden * 4
    return {"peak_mib": round(peak / 2**20, 1), "predicted_mib": round(model / 2**20, 1),
            "measured_over_predicted": round(peak / model, 2),
            "working_elements": round((peak - features) / (per_pass * args.max_len * args.hidden * 4), 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.heldout_capture",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64, help="held-out rows (the recipe's eval_examples)")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="data.batch_size")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    row = measure(args)
    print(f"target: {row['layers']} layers, H {row['hidden']}, I {row['intermediate']}, k {row['k']}; "
          f"{row['rows']} held-out rows of {row['max_len']} tokens, batch {row['batch']}, float32 on cpu")
    print(f"{'path':>26} | {'peak MiB':>9} | {'model MiB':>9} | {'measured / model':>16} | "
          f"working elements (model {row['working_elements_model']})")
    for name, p in row["paths"].items():
        ratio = p["measured_over_predicted"]
        print(f"{name:>26} | {p['peak_mib']:>9} | {p['predicted_mib']:>9} | {ratio:>16} | "
              f"{p['working_elements']}")
    whole, batched = row["paths"]["all at once"]["peak_mib"], row["paths"]["in batches"]["peak_mib"]
    print(f"in batches holds {batched / whole:.3f}x the peak of all at once")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())

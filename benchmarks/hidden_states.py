"""Packed versus padded hidden states: peak memory and time, side by side in one process.

Both paths get the same inputs: k target layers `[B, Lmax, H]` and an attention mask whose rows
have ragged lengths, so that a chosen fraction of B x Lmax is padding. For each case it reports

- peak memory each path allocates beyond its inputs, as a multiple of the output `[T, k*H]`
  (the packed path should be ~1x; the padded path ~(1 + B*Lmax/T)x);
- the time of each path and of a plain copy of the output's bytes (the memory-bandwidth floor;
  `clone()`, which allocates its result as both paths must, so first-touch page faults of a fresh
  output count in the floor too).

Memory is what torch itself allocates, never process RSS: on CUDA the caching allocator's
`max_memory_allocated` after a reset; on CPU the running sum of the allocation and free events
that `torch.profiler(profile_memory=True)` records for torch's CPU allocator (see
`benchmarks.memory`). Times are the best of interleaved repeats (packed, padded, copy in turn): on a
shared machine the fastest run is the one least disturbed, and interleaving exposes all three
paths to the same conditions; the profiler is off while timing.

Prints a table, then, as its last line, one JSON object with every figure. Writes a plot of peak
memory against padding fraction to `benchmarks/results/hidden_states.png` when matplotlib exists.

    python -m benchmarks.hidden_states                 # the default sizes, under ~2 min on 2 cores
    python -m benchmarks.hidden_states --hidden 4096 --batch 8 --max-len 2048 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.memory import peak_allocated_bytes
from dflash_ops.model.hidden_states import get_hidden_states_packed, get_hidden_states_padded

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PLOT_PATH = Path(__file__).resolve().parent / "results" / "hidden_states.png"


def ragged_lengths(batch: int, max_len: int, padding: float) -> list[int]:
    """Row lengths spread around (1 - padding) * max_len whose sum leaves `padding` of B x Lmax empty."""
    real = round((1 - padding) * batch * max_len)
    if batch == 1:
        return [max(1, real)]
    spread = min(padding, 1 - padding)
    mean = real / batch
    lengths = [min(max_len, max(1, round(mean * (1 - spread + 2 * spread * b / (batch - 1)))))
               for b in range(batch)]
    # Correct the rounding so that the total is exact where the rows allow it.
    for b in range(batch):
        delta = real - sum(lengths)
        lengths[b] = min(max_len, max(1, lengths[b] + delta))
    return lengths


def make_inputs(batch: int, max_len: int, hidden: int, k: int, padding: float, dtype: torch.dtype,
                device: torch.device):
    layers = [torch.randn(batch, max_len, hidden, device=device).to(dtype) for _ in range(k)]
    mask = torch.zeros(batch, max_len, dtype=torch.int64, device=device)
    for row, n in enumerate(ragged_lengths(batch, max_len, padding)):
        mask[row, :n] = 1
    # transformers' layout: index 0 is the embedding output, layer i is hidden_states[i + 1].
    return [layers[0], *layers], list(range(k)), mask


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fns: list, repeats: int, device: torch.device) -> list[float]:
    """Fastest wall time of each function, run interleaved `repeats` times after one warm-up."""
    samples = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            samples[i].append(time.perf_counter() - start)
    return [min(s) for s in samples]


def measure(batch: int, max_len: int, hidden: int, k: int, padding: float, dtype_name: str,
            device: torch.device, repeats: int) -> dict:
    states, layer_ids, mask = make_inputs(batch, max_len, hidden, k, padding, DTYPES[dtype_name], device)
    def run_packed():
        return get_hidden_states_packed(states, layer_ids, mask)

    def run_padded():
        return get_hidden_states_padded(states, layer_ids, mask)

    packed, packed_peak = peak_allocated_bytes(run_packed, device)
    padded, padded_peak = peak_allocated_bytes(run_padded, device)
    if not torch.equal(packed.features, padded.features):
        raise AssertionError(f"packed and padded differ for B={batch} H={hidden} padding={padding}")
    out = packed.features
    out_bytes = out.numel() * out.element_size()
    n_tokens = out.shape[0]
    del padded
    copy_src = out.clone()
    t_packed, t_padded, t_copy = best_seconds([run_packed, run_padded, copy_src.clone], repeats, device)
    return {
        "dtype": dtype_name, "hidden": hidden, "batch": batch, "max_len": max_len, "k": k,
        "padding": round(1 - n_tokens / (batch * max_len), 4), "tokens": n_tokens,
        "output_mib": round(out_bytes / 2**20, 3),
        "packed_peak_x": round(packed_peak / out_bytes, 3),
        "padded_peak_x": round(padded_peak / out_bytes, 3),
        "padded_expected_x": round(1 + batch * max_len / n_tokens, 3),
        "packed_ms": round(t_packed * 1e3, 3), "padded_ms": round(t_padded * 1e3, 3),
        "copy_ms": round(t_copy * 1e3, 3),
        "speedup_vs_padded": round(t_padded / t_packed, 3),
        "packed_vs_copy": round(t_packed / t_copy, 3),
    }


def print_table(rows: list[dict]) -> None:
    header = (f"{'dtype':>8} {'H':>5} {'B':>3} {'Lmax':>5} {'pad':>5} {'out MiB':>8} | {'packed x':>8} "
              f"{'padded x':>8} {'expect x':>8} | {'packed ms':>9} {'padded ms':>9} {'copy ms':>8} "
              f"{'speedup':>7} {'vs copy':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['dtype']:>8} {r['hidden']:>5} {r['batch']:>3} {r['max_len']:>5} {r['padding']:>5.2f} "
              f"{r['output_mib']:>8.2f} | {r['packed_peak_x']:>8.2f} {r['padded_peak_x']:>8.2f} "
              f"{r['padded_expected_x']:>8.2f} | {r['packed_ms']:>9.2f} {r['padded_ms']:>9.2f} "
              f"{r['copy_ms']:>8.2f} {r['speedup_vs_padded']:>7.2f} {r['packed_vs_copy']:>7.2f}")


def summarise(rows: list[dict]) -> dict:
    at_half = [r for r in rows if abs(r["padding"] - 0.5) < 0.05]
    return {
        "max_packed_peak_x": max(r["packed_peak_x"] for r in rows),
        "min_speedup_at_50pct_padding": min((r["speedup_vs_padded"] for r in at_half), default=None),
        "median_speedup_at_50pct_padding": (statistics.median(r["speedup_vs_padded"] for r in at_half)
                                            if at_half else None),
        "max_packed_vs_copy": max(r["packed_vs_copy"] for r in rows),
        "median_packed_vs_copy": statistics.median(r["packed_vs_copy"] for r in rows),
        "targets": {"packed_peak_x_max": 1.1, "speedup_at_50pct_min": 1.3, "packed_vs_copy_max": 1.5},
    }


def plot(rows: list[dict], path: Path) -> str | None:
    """Peak memory (x output) against padding fraction for both paths, every measured size drawn
    (they coincide), with the padded path's expected 1 + B*Lmax/T; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    groups = sorted({(r["dtype"], r["hidden"], r["batch"]) for r in rows})
    for n, group in enumerate(groups):
        series = sorted((r for r in rows if (r["dtype"], r["hidden"], r["batch"]) == group),
                        key=lambda r: r["padding"])
        pads = [r["padding"] * 100 for r in series]
        first = n == 0
        ax.plot(pads, [r["padded_expected_x"] for r in series], ":", color="gray",
                label="expected padded: 1 + B*Lmax/T" if first else None)
        ax.plot(pads, [r["padded_peak_x"] for r in series], "o-", color="tab:red", alpha=0.6,
                label="padded (concatenate, then strip)" if first else None)
        ax.plot(pads, [r["packed_peak_x"] for r in series], "s-", color="tab:blue", alpha=0.6,
                label="packed (gather into [T, k*H])" if first else None)
    sizes = ", ".join(f"{d} H={h} B={b}" for d, h, b in groups)
    ax.set_xlabel("padding (% of B x Lmax)")
    ax.set_ylabel("peak memory beyond inputs (x output size)")
    ax.set_title(f"Hidden-state extraction, k={rows[0]['k']} layers", fontsize=11)
    ax.text(0.01, 0.01, f"sizes: {sizes}", transform=ax.transAxes, fontsize=6, color="gray")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hidden_states",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096], help="hidden sizes H")
    parser.add_argument("--batch", type=int, nargs="+", default=[8], help="batch sizes B")
    parser.add_argument("--max-len", type=int, default=512, help="padded sequence length Lmax")
    parser.add_argument("--padding", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75],
                        help="fractions of B x Lmax that are padding")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=5, help="k, target layers concatenated")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per path (best of)")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: steadier figures on a shared machine)")
    parser.add_argument("--plot", type=Path, default=PLOT_PATH, help="where to write the PNG plot")
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    args = parser.parse_args(argv)
    if any(not 0 <= p < 1 for p in args.padding):
        parser.error("--padding values must be in [0, 1)")
    if min(args.hidden + args.batch + [args.max_len, args.layers, args.repeats]) < 1:
        parser.error("sizes, --layers and --repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    rows = [measure(batch, args.max_len, hidden, args.layers, padding, dtype, device, args.repeats)
            for dtype in args.dtype for hidden in args.hidden for batch in args.batch
            for padding in args.padding]
    print(f"packed vs padded hidden states on {device.type}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"k={args.layers}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print_table(rows)
    plot_path = None if args.no_plot else plot(rows, args.plot)
    summary = summarise(rows)
    print(f"packed peak <= {summary['max_packed_peak_x']}x output; speedup at 50% padding "
          f"min {summary['min_speedup_at_50pct_padding']}x; "
          f"packed vs copy floor max {summary['max_packed_vs_copy']}x"
          + (f"; plot: {plot_path}" if plot_path else "; no plot (matplotlib missing)"))
    print(json.dumps({"benchmark": "hidden_states", "device": device.type, "threads": torch.get_num_threads(),
                      "k": args.layers, "rows": rows, "summary": summary, "plot": plot_path}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

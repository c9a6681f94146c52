"""Loss and tau curves of runs as PNG: `python -m dflash_ops.plots RUN [RUN ...] --out DIR`.

Each RUN is a run's output directory (its `metrics.jsonl`) or a metrics file itself, fetched from
a container for example. Writes `DIR/loss.png` (training loss, the mean of each log interval, and
held-out loss against the step) and `DIR/tau.png` (held-out tau against the step), one line per
run, labelled with the run's directory name (or `--labels`). A step recorded twice (steps redone
after a resume) is drawn once, with its latest figures. DIR must be this user's (made when missing, no
link on the way, dflash_ops.core.safe_paths); each PNG is written 0600 to a temporary file there and
renamed over its name, so a link planted at `loss.png` is replaced, never written through.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_ops.core.runtime import ensure_dir
from dflash_ops.core.safe_paths import replace_file
from dflash_ops.training.telemetry import METRICS_FILE


def read_metrics(source: str | Path) -> dict[str, dict[int, dict]]:
    """{kind: {step: record}} from a metrics file or a run directory; the last record of a step wins."""
    path = Path(source)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics at {path}")
    series: dict[str, dict[int, dict]] = {}
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            series.setdefault(record["kind"], {})[int(record["step"])] = record
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{line_no}: not a metrics record ({exc})") from exc
    return series


def _points(records: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps = [s for s in sorted(records) if records[s].get(key) is not None]
    return steps, [records[s][key] for s in steps]


EMPTY_NOTE = ("no held-out figures: the run had no data.eval_path\n(set one for held-out loss and tau "
              "every run.eval_every steps)")


def empty_figures(runs: dict[str, dict[str, dict[int, dict]]]) -> list[str]:
    """The figures that would have no curve: tau.png when no run recorded a held-out tau."""
    tau = any(_points(series.get("heldout", {}), "heldout_tau")[0] for series in runs.values())
    return [] if tau else ["tau.png"]


def plot_runs(runs: dict[str, dict[str, dict[int, dict]]], out_dir: str | Path) -> list[Path]:
    """Write loss.png and tau.png for `runs` ({label: read_metrics(...)}); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir = ensure_dir(out_dir)  # never another user's directory, nor one reached through a link
    written = []
    figures = (
        ("loss.png", "loss", [("train", "loss", "train"), ("heldout", "heldout_loss", "held-out")]),
        ("tau.png", "held-out tau (tokens per verify step)", [("heldout", "heldout_tau", "held-out")]),
    )
    for name, ylabel, curves in figures:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        if name in empty_figures(runs):
            ax.text(0.5, 0.5, EMPTY_NOTE, ha="center", va="center", wrap=True, transform=ax.transAxes)
        for label, series in runs.items():
            for kind, key, what in curves:
                steps, values = _points(series.get(kind, {}), key)
                if steps:
                    ax.plot(steps, values, marker="o" if kind == "heldout" else None, markersize=3,
                            label=f"{label} {what}" if len(curves) > 1 else label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        # A link planted at out_dir/name is replaced by the rename, never written through.
        written.append(replace_file(out_dir, name, lambda handle, fig=fig: fig.savefig(handle, format="png")))
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_ops.plots",
                                     description="Write loss and held-out tau curves (PNG) of training runs.")
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="a run's output directory or its metrics.jsonl (several: one line each)")
    parser.add_argument("--out", required=True, help="directory for loss.png and tau.png")
    parser.add_argument("--labels", nargs="+", help="one label per RUN (default: the run directory's name)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error("--labels needs one label per RUN")
    labels = args.labels or [Path(r).name if Path(r).is_dir() else Path(r).resolve().parent.name
                             for r in args.runs]
    try:
        runs = {label: read_metrics(run) for label, run in zip(labels, args.runs, strict=True)}
        written = plot_runs(runs, args.out)
    except (FileNotFoundError, ValueError) as err:  # UnsafePath too: a directory of another user's
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    for name in empty_figures(runs):
        print(f"note: {name} is empty: {' '.join(EMPTY_NOTE.split())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

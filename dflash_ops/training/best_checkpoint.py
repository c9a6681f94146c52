"""run.keep_best: the run's best held-out checkpoint is never pruned.

The best is the one `python -m dflash_ops.export --best` picks (dflash_ops.serve.export.best_step): of the
checkpoints kept, and the one being saved, the step of the highest held-out tau in the run's metrics.jsonl
(the latest of equal ones). Saving spares it from run.keep_checkpoints' pruning, so that a run whose tau
peaked early still holds that checkpoint at its end, beside the latest ones.
"""

from __future__ import annotations

from pathlib import Path

from dflash_ops.training.checkpoint import list_checkpoints, step_of
from dflash_ops.training.plots import read_metrics


def recorded_taus(output_dir: str | Path) -> dict[int, float]:
    """{step: held-out tau} of the run's metrics.jsonl ({} when it has none or cannot be read)."""
    try:
        heldout = read_metrics(output_dir).get("heldout", {})
    except (FileNotFoundError, ValueError):
        return {}
    return {step: r["heldout_tau"] for step, r in heldout.items() if r.get("heldout_tau") is not None}


def best_step_to_keep(output_dir: str | Path, saving: int, taus: dict[int, float]) -> int | None:
    """The step of the best held-out tau among the kept checkpoints of `output_dir` and the one being saved
    (`saving`), by the metrics recorded and `taus` (this process's, which win); None when none has a tau."""
    taus = {**recorded_taus(output_dir), **taus}
    candidates = {step_of(p) for p in list_checkpoints(output_dir)} | {saving}
    scored = {step: taus[step] for step in candidates if step in taus}
    if not scored:
        return None
    return max(scored, key=lambda step: (scored[step], step))

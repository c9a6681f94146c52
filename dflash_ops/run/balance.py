"""The pipeline's split between target and drafter workers: predicted from the shapes, advised from the waits.

A pipeline's rate is that of its slower side. With t target workers, each taking `target_cost` a batch,
and d drafter workers, each taking `drafter_cost` a batch (a drafter trains on one batch a step), the run
trains min(t / target_cost, d / drafter_cost) batches a second; `best_split` picks the t + d = n that
maximises it, and `Advice` says it with the rate it gains over the configured split.

The costs come from two places, in the same units for both roles:
- before a run (`python -m dflash_ops.config validate`): FLOPs a sample from the shapes (`predicted_costs`):
  the target's forward up to its deepest captured layer, against the drafter's layers forward and
  backward, its `fc` and context projections, its attention, and the frozen head's forward and input
  gradient over the scored positions. At Qwen3-8B with the recipe's data (3,072 tokens, 512 anchors of
  16) that is ~43 against ~72 TFLOP: of 8 GPUs, 3 targets and 5 drafters balance them (1.67x the rate)
  where 5:3 leaves the targets waiting ~64 % of the time.
- while it runs: each rank's own seconds (`MeasuredWaits`): a target's time computing a batch, a
  drafter's time stepping (its wait for a batch left out), from the `waits` lines the targets log and the
  `wait_fraction` and `busy_s` of the drafters' `step` lines. The launcher logs the advice they give as a
  `balance` line every log interval from the seconds summed over the run so far, and status.json shows
  the latest.

No torch: the validation runs this before anything is started. Each FLOP term: docs/PIPELINE.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from dflash_ops.core.loss_section import extra_head_flops, needs_target

# A layout is called balanced when neither side waits for more than this share of its time.
BALANCED_WAIT = 0.15


def best_split(workers: int, target_cost: float, drafter_cost: float) -> tuple[int, int]:
    """The (targets, drafters) of `workers` in all (one of each at least) that trains fastest; the one
    with more drafters on a tie (their memory holds the optimizer)."""
    if workers < 2:
        raise ValueError("a pipeline needs a target and a drafter worker")
    return max(((t, workers - t) for t in range(1, workers)),
               key=lambda split: (rate(*split, target_cost, drafter_cost), split[1]))


def rate(targets: int, drafters: int, target_cost: float, drafter_cost: float) -> float:
    """Batches a second (in the costs' units) of a split: its slower side's."""
    return min(targets / target_cost, drafters / drafter_cost)


@dataclass(frozen=True)
class Advice:
    """The split a layout has, the one its costs call for, and what each side waits under the first."""

    targets: int
    drafters: int
    target_cost: float  # a batch's cost on one target worker (FLOPs or seconds)
    drafter_cost: float

    @property
    def best(self) -> tuple[int, int]:
        return best_split(self.targets + self.drafters, self.target_cost, self.drafter_cost)

    @property
    def gain(self) -> float:
        """The best split's rate over this one's."""
        here = rate(self.targets, self.drafters, self.target_cost, self.drafter_cost)
        return rate(*self.best, self.target_cost, self.drafter_cost) / here

    def waits(self) -> tuple[float, float]:
        """The share of its time each side would wait under this split (targets, drafters)."""
        pace = rate(self.targets, self.drafters, self.target_cost, self.drafter_cost)
        return 1 - pace * self.target_cost / self.targets, 1 - pace * self.drafter_cost / self.drafters

    def bound(self, target_wait: float, drafter_wait: float) -> str:
        if max(target_wait, drafter_wait) <= BALANCED_WAIT:
            return "balanced"
        return "drafter-bound" if target_wait > drafter_wait else "target-bound"

    def say(self, target_wait: float, drafter_wait: float, unit: str, scale: float = 1.0,
            per: str = "a batch") -> str:
        """One line: who waits, what binds, and the split to use (the costs divided by `scale`, in `unit`)."""
        t, d = self.best
        costs = (f"{per} costs a target {self.target_cost / scale:.4g} {unit}, a drafter "
                 f"{self.drafter_cost / scale:.4g} {unit}")
        head = (f"targets wait {target_wait:.0%}, drafters wait {drafter_wait:.0%}: "
                f"{self.bound(target_wait, drafter_wait)}")
        if (t, d) == (self.targets, self.drafters):
            return f"{head}; {self.targets}:{self.drafters} is the best split of {t + d} workers ({costs})"
        split = f"{t} target{'s' * (t > 1)} : {d} drafter{'s' * (d > 1)}"
        return (f"{head}; {split} of the {t + d} workers would train {self.gain:.2f}x as fast as "
                f"{self.targets}:{self.drafters} ({costs})")

    def fields(self, target_wait: float, drafter_wait: float, unit: str) -> dict:
        t, d = self.best
        return {"target_wait": round(target_wait, 3), "drafter_wait": round(drafter_wait, 3),
                "bound": self.bound(target_wait, drafter_wait), "split": [self.targets, self.drafters],
                "best_split": [t, d], "gain": round(self.gain, 2),
                "advice": self.say(target_wait, drafter_wait, unit)}


# --- before a run: FLOPs a sample from the shapes ------------------------------------------------
def layer_flops(shape, tokens: int) -> float:
    """One decoder layer's matrix products over `tokens` tokens, forward (2 FLOPs a multiply-add)."""
    return 2.0 * tokens * shape.layer_parameters()


def predicted_costs(cfg, shape) -> tuple[float, float]:
    """(target, drafter) FLOPs a sample at data.max_length tokens and data.max_anchors blocks.

    Target: layers 0 .. deepest captured, forward: their products and causal attention (QK and PV over
    half the L x L pairs). Drafter: `drafter_flops`."""
    from dflash_ops.training.memory_fit import feature_layer_ids, sent_layer_ids

    length, layer_ids = cfg.data.max_length, feature_layer_ids(cfg, shape)
    deepest = max(sent_layer_ids(cfg, shape)) + 1  # the last layer too when the loss needs its distribution
    target = deepest * (layer_flops(shape, length) + 2.0 * length * length * shape.heads * shape.head_dim)
    m = cfg.model
    # loss.kind's target logits and DSpark's heads (dflash_ops.core.loss_section.extra_head_flops).
    rank = m.markov_rank if m.kind == "dspark" else None
    anchors = cfg.data.max_anchors
    extra = extra_head_flops(cfg.loss.mix, rank, anchors, m.block_size, shape.hidden, shape.vocab)
    return target, drafter_flops(shape, length, cfg.data.max_anchors, m.block_size, m.num_draft_layers,
                                 len(layer_ids)) + extra


def drafter_flops(shape, length: int, anchors: int, block_size: int, layers: int, k: int) -> float:
    """A drafter's FLOPs a sample: its layers over the queries (anchors x block) forward and backward (3x
    the forward), the K/V projections of the context tokens and `fc` (k x H to H) likewise, attention
    from each query to its anchor's context (L/2 on average) and its block, and the frozen head over the
    scored positions, forward and input gradient (2x the forward)."""
    h, attention_width = shape.hidden, shape.heads * shape.head_dim
    queries, scored = anchors * block_size, anchors * (block_size - 1)
    kv_projection = 2 * h * shape.kv_heads * shape.head_dim
    per_layer = (layer_flops(shape, queries) + 2.0 * length * kv_projection
                 + 4.0 * queries * (length / 2 + block_size) * attention_width)
    return 3.0 * layers * per_layer + 3.0 * 2.0 * length * k * h * h + 2.0 * 2.0 * scored * h * shape.vocab


def predicted_advice(cfg, shape) -> Advice | None:
    """The validation's advice for a pipeline layout (None for a single process)."""
    p = cfg.pipeline
    if not p.is_multi_process:
        return None
    targets = sum(t for _, t in p.member_counts)
    drafters = sum(n for n, _ in p.member_counts)
    if targets == 0:  # a feature cache's layout: no target worker to balance
        return None
    target, drafter = predicted_costs(cfg, shape)
    return Advice(targets, drafters, target, drafter)


def predicted_line(advice: Advice) -> str:
    """The validation's line: the waits the prediction implies and the split it calls for."""
    unit, scale = next((u, x) for u, x in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("FLOP", 1.0))
                       if advice.target_cost >= x or x == 1.0)
    return "split (predicted from the shapes): " + advice.say(*advice.waits(), unit, scale, "a sample")


# --- the run's cost before it starts: samples/s and GPU-hours -----------------------------------
@dataclass(frozen=True)
class StepFigure:
    """A drafter step measured on a GPU at a shape: its FLOPs (`drafter_flops`) over its seconds are the
    rate this code reaches there, from which any config's costs are modelled."""

    gpu: str
    seconds: float  # one step of `samples` samples
    samples: int
    length: int
    anchors: int
    block_size: int
    layers: int
    feature_layers: int
    source: str

    def flops_per_s(self) -> float:
        from dflash_ops.training.memory_fit import QWEN3_8B

        return drafter_flops(QWEN3_8B, self.length, self.anchors, self.block_size, self.layers,
                             self.feature_layers) * self.samples / self.seconds


# The one measured figure the cost is modelled from: the recipe's drafter rank (configs/qwen3-8b.yaml at
# Qwen3-8B's width) on one H200, FlexAttention compiled, bf16 autocast, the chunked loss and AdamW: 1.456 s
# for 8 x 3,072 tokens, 5.50 samples/s (BENCHMARKS.md section 10; docs/SCALE.md, "Step time"), ~72 TFLOP a
# sample: ~400 TFLOP/s. The target's forward is modelled at the same rate until the GPU check's part b
# measures it (an estimate: an inference forward usually reaches more of the peak than a training step).
H200_DRAFTER_STEP = StepFigure("H200", 1.456, 8, 3072, 512, 16, 5, 5, "BENCHMARKS.md section 10")


@dataclass(frozen=True)
class RunCost:
    """A run's whole cost: its samples over the pace of its slower side, on all of its GPUs."""

    samples: int  # the run's samples: steps x batch x drafters (x accumulate)
    target_s: float | None  # seconds a sample on one target GPU (None: no target rank, a feature cache)
    drafter_s: float  # seconds a sample on one drafter GPU
    targets: int
    drafters: int
    gpus: int
    how: str  # "modelled from ..." or "measured ..."
    shared: bool = False  # one process: the target and the drafter take turns on one GPU

    @property
    def samples_per_s(self) -> float:
        if self.target_s is None:
            return self.drafters / self.drafter_s
        if self.shared:
            return 1.0 / (self.target_s + self.drafter_s)
        return rate(self.targets, self.drafters, self.target_s, self.drafter_s)

    @property
    def slower(self) -> str:
        if self.target_s is None or self.shared:
            return "drafter" if self.target_s is None else "one GPU"
        return "target" if self.targets / self.target_s < self.drafters / self.drafter_s else "drafter"

    @property
    def hours(self) -> float:
        return self.samples / self.samples_per_s / 3600

    @property
    def gpu_hours(self) -> float:
        return self.hours * self.gpus

    def fields(self) -> dict:
        return {"how": self.how, "samples": self.samples, "samples_per_s": round(self.samples_per_s, 3),
                "slower_side": self.slower, "hours": round(self.hours, 2), "gpus": self.gpus,
                "gpu_hours": round(self.gpu_hours, 1), "target_s_per_sample": self.target_s and
                round(self.target_s, 4), "drafter_s_per_sample": round(self.drafter_s, 4)}

    def line(self, plan: str) -> str:
        per = "" if self.target_s is None else f"a target {self.target_s:.3g} s, "
        return (f"cost ({self.how}): {self.samples_per_s:.2f} samples/s (a sample takes {per}a drafter "
                f"{self.drafter_s:.3g} s of one GPU; the {self.slower} sets the pace); {plan}: "
                f"{self.hours:.1f} h on {self.gpus} GPU{'s' * (self.gpus > 1)}, "
                f"{self.gpu_hours:,.0f} GPU-hours")


def run_samples(cfg) -> int:
    """The samples the run trains: its optimizer steps, each one batch per drafter (per accumulation)."""
    return cfg.total_steps * cfg.data.batch_size * cfg.drafters * cfg.optim.accumulate


def run_plan(cfg) -> str:
    """How many samples, said as the config says them (epochs of rows, or steps)."""
    samples = run_samples(cfg)
    if cfg.optim.epochs is not None and cfg.examples is not None:
        return f"{samples:,} samples ({cfg.optim.epochs:g} epochs of {cfg.examples:,} rows)"
    return f"{samples:,} samples ({cfg.total_steps:,} steps of {cfg.data.batch_size} x {cfg.drafters})"


def _layout(cfg) -> tuple[int, int, int, bool]:
    """(target ranks, drafter ranks, GPUs, shared): a single process holds both on one device."""
    p = cfg.pipeline
    if not p.is_multi_process:
        return 1, 1, 1, True
    targets = sum(t for _, t in p.member_counts)
    drafters = sum(n for n, _ in p.member_counts)
    return targets, drafters, targets + drafters, False


def modelled_cost(cfg, shape, step: StepFigure = H200_DRAFTER_STEP) -> RunCost | None:
    """The run's cost modelled from `step` (a GPU's measured drafter step) scaled by each side's FLOPs a
    sample (`predicted_costs`); None on a cpu layout (the figure is a GPU's)."""
    if cfg.pipeline.device != "cuda":
        return None
    target_flops, drafter_flops_ = predicted_costs(cfg, shape)
    pace = step.flops_per_s()
    targets, drafters, gpus, shared = _layout(cfg)
    how = f"modelled from the {step.gpu} drafter step of {step.source}"
    return RunCost(run_samples(cfg), target_flops / pace if targets else None, drafter_flops_ / pace,
                   targets, drafters, gpus, how, shared)


def measured_cost(cfg, path, shape=None) -> RunCost:
    """The run's cost from a measured figure in the file at `path`:
    - a run's `balance` (its status.json, or the last `balance` line of its log): each side's seconds a
      batch as the run measured them, the split as configured;
    - the GPU check's result (gpu_check.json, part f): the drafter step it measured at the recipe's shape,
      which replaces H200_DRAFTER_STEP in the model (needs `shape`, the target's); for a distilled or a
      DSpark drafter, with the correction part g measured for its kind (`kind_correction`).
    ValueError when the file holds neither."""
    from pathlib import Path

    text = Path(path).read_text()
    try:
        records = [json.loads(text)]  # one JSON document: status.json, gpu_check.json
    except json.JSONDecodeError:  # JSON lines: a run's log
        records = []
        for line in text.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    records = [r for r in records if isinstance(r, dict)]
    balance = next((r for r in reversed(records) if r.get("event") == "balance"), None)
    balance = balance or next((r.get("balance") for r in reversed(records) if r.get("balance")), None)
    if balance and balance.get("drafter_cost_s"):
        targets, drafters, gpus, shared = _layout(cfg)
        batch = cfg.data.batch_size
        target = balance.get("target_cost_s")
        return RunCost(run_samples(cfg), target / batch if target and targets else None,
                       balance["drafter_cost_s"] / batch, targets, drafters, gpus,
                       f"measured: the run's balance in {path}", shared)
    speed = next((r["drafter_speed"].get("auto") for r in records
                  if isinstance(r.get("drafter_speed"), dict) and not r.get("dry_run")), None)
    if speed and speed.get("step_s"):
        if shape is None:
            raise ValueError(f"{path}'s drafter step is scaled by the target's shape, which is read with the "
                             "machine checks on (without --no-target-check)")
        ref = H200_DRAFTER_STEP
        step = StepFigure(records[0].get("device", "GPU"), speed["step_s"], ref.samples, ref.length,
                          ref.anchors, ref.block_size, ref.layers, ref.feature_layers, str(path))
        on_gpu = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, device="cuda"))
        cost = modelled_cost(on_gpu, shape, step)
        how = f"drafter step measured in {path}, the rest modelled from it"
        correction = kind_correction(cfg, records[0])
        if correction:
            factor, said = correction
            return dataclasses.replace(cost, drafter_s=cost.drafter_s * factor, how=f"{how}; {said}")
        return dataclasses.replace(cost, how=how)
    raise ValueError(f"{path} holds no measured step time: a run's status.json or log with a balance line "
                     "(target_cost_s, drafter_cost_s), or a GPU check's gpu_check.json with part f")


def check_kind(cfg) -> str:
    """The row of the GPU check's part g (`benchmarks.gpu_check_drafter.KINDS`) that times `cfg`'s drafter."""
    if cfg.model.kind == "dspark":
        return "dspark"
    return "dflash_distilled" if needs_target(cfg.loss.mix) else "dflash"


def kind_correction(cfg, check: dict) -> tuple[float, str] | None:
    """(factor, what it is) for the modelled drafter seconds of a distilled or DSpark drafter, from the GPU
    check's part g (its step over DFlash's, measured side by side at the DSpark recipe's shape): the
    measured ratio over the FLOPs model's at that shape, so that what the heads and the loss cost beyond
    their FLOPs (an eager loss, the Markov gather) is counted. None for plain DFlash, a dry run or a check
    without part g."""
    kind = check_kind(cfg)
    rows = check.get("drafter_kinds")
    row = rows.get(kind) if isinstance(rows, dict) and kind != "dflash" and not check.get("dry_run") else None
    if not isinstance(row, dict) or not (row.get("time_ratio") and row.get("modelled_ratio")):
        return None
    factor = row["time_ratio"] / row["modelled_ratio"]
    return factor, (f"{kind}'s step over DFlash's as part g measured it, {row['time_ratio']}x against the "
                    f"model's {row['modelled_ratio']}x (x{factor:.3f})")


# --- while it runs: each rank's own seconds ------------------------------------------------------
class MeasuredWaits:
    """Each side's seconds summed over the run so far: every target's `waits` lines, the drafters' `step`
    lines. Sums, not the latest interval: one interval of one step is noise (a drafter's collectives on a
    busy machine), and the advice should not change its mind with it. The drafters' first interval is
    left out (its first step compiles and warms up)."""

    def __init__(self, targets: int, drafters: int):
        self.targets, self.drafters = targets, drafters
        self.target_sums: dict[str, list[float]] = {}  # worker -> [batches, compute_s, wall_s]
        self.drafter_steps, self.drafter_busy, self.drafter_waited = 0, 0.0, 0.0

    def follow(self, record: dict) -> None:
        event = record.get("event")
        if event == "waits" and record.get("batches"):
            sums = self.target_sums.setdefault(record.get("worker", ""), [0, 0.0, 0.0])
            sums[0] += record["batches"]
            sums[1] += record["compute_s"]
            sums[2] += record["wall_s"]
        elif (event == "step" and record.get("busy_s") is not None and record.get("interval_steps")
              and "first_step_seconds" not in record):
            busy, waiting = record["busy_s"], record.get("wait_fraction") or 0.0
            if waiting >= 1.0:
                return
            self.drafter_steps += record["interval_steps"]
            self.drafter_busy += busy
            # The interval's seconds less its busy ones.
            self.drafter_waited += busy * waiting / (1.0 - waiting)

    def advice(self) -> dict | None:
        """The balance line's fields once both sides have measured something, else None."""
        sums = [s for s in self.target_sums.values() if s[0] and s[2] > 0]
        if not sums or self.drafter_steps == 0 or self.targets == 0:
            return None
        batches, compute = sum(s[0] for s in sums), sum(s[1] for s in sums)
        if compute <= 0 or self.drafter_busy <= 0:
            return None
        target_wait = max(0.0, sum(1 - s[1] / s[2] for s in sums) / len(sums))
        drafter_wait = self.drafter_waited / (self.drafter_waited + self.drafter_busy)
        drafter_cost = self.drafter_busy / self.drafter_steps
        advice = Advice(self.targets, self.drafters, compute / batches, drafter_cost)
        # Each side's seconds a batch, which `validate --measured` turns into the run's cost.
        return {**advice.fields(target_wait, drafter_wait, "s"), "target_cost_s": round(compute / batches, 4),
                "drafter_cost_s": round(drafter_cost, 4)}

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

from dataclasses import dataclass

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
    half the L x L pairs). Drafter: its layers over the queries (anchors x block) forward and backward
    (3x the forward), the K/V projections of the context tokens and `fc` (k x H to H) likewise, attention
    from each query to its anchor's context (L/2 on average) and its block, and the frozen head over the
    scored positions, forward and input gradient (2x the forward)."""
    from dflash_ops.training.memory_fit import feature_layer_ids

    m, d = cfg.model, cfg.data
    length, h = d.max_length, shape.hidden
    attention_width = shape.heads * shape.head_dim
    deepest = max(feature_layer_ids(cfg, shape)) + 1
    target = deepest * (layer_flops(shape, length) + 2.0 * length * length * attention_width)

    queries = d.max_anchors * m.block_size
    scored = d.max_anchors * (m.block_size - 1)
    k = len(feature_layer_ids(cfg, shape))
    kv_projection = 2 * h * shape.kv_heads * shape.head_dim
    per_layer = (layer_flops(shape, queries) + 2.0 * length * kv_projection
                 + 4.0 * queries * (length / 2 + m.block_size) * attention_width)
    drafter = (3.0 * m.num_draft_layers * per_layer + 3.0 * 2.0 * length * k * h * h
               + 2.0 * 2.0 * scored * h * shape.vocab)
    return target, drafter


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
        return advice.fields(target_wait, drafter_wait, "s")

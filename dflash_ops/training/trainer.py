"""One drafter rank's optimisation step, for any process that holds packed target features.

`DrafterTrainer.train_step(features, cu_seqlens, position_ids, input_ids, loss_mask)` takes the
packed output of the target (`[T, k*H]` plus its metadata, as `get_hidden_states_packed` gives it
or another process sent it), samples anchors, builds the blocks, and takes one AdamW step.
With other drafter ranks (a process group) the forward and backward run through DDP, which averages
the gradients; the drafter itself stays beside its wrapper, and is what the run saves and evaluates.
Its `state_dict()` holds what a resume needs besides the weights and the random state: optimizer
moments, scheduler, step (the anchor RNG, one per drafter rank, is saved by the run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel

from dflash_ops.core.config import OptimConfig, TrainConfig
from dflash_ops.core.mask_token import resolve_mask_token_id
from dflash_ops.core.target_layers import build_target_layer_ids
from dflash_ops.data.target import TargetHead
from dflash_ops.model.distill import scored_mix_loss, split_features
from dflash_ops.model.drafter import BlockMask, DFlashDrafter, DrafterConfig
from dflash_ops.model.dspark import DSparkDrafter, dspark_loss, dspark_targets
from dflash_ops.model.flex import choose_attention
from dflash_ops.model.loss import (
    BlockBatch,
    ChunkLoss,
    build_block_batch,
    chunked_head_loss_on_device,
    correct_by_position,
    cross_entropy_chunk_loss,
    dflash_loss,
    dpace_row_weights,
    sample_anchors,
    softmax_cross_entropy,
)
from dflash_ops.training.checkpoint import dspark_args, new_drafter

# Where a step reads the device from the host (`.item()`, `.tolist()`, `.cpu()`, a tensor's bool, int or
# float): laying out the batch before the forward, and the figures the log shows, once at the end.
# Nothing in between: tests/dflash/training/test_host_syncs.py counts them.
HOST_READS = ("DrafterTrainer.layout", "DrafterTrainer.figures")


def resolve_layer_ids(cfg: TrainConfig, n_target_layers: int) -> list[int]:
    """The configured target layer ids, else the paper's spacing for the number of draft layers."""
    ids = cfg.model.target_layer_ids or build_target_layer_ids(n_target_layers, cfg.model.num_draft_layers)
    if max(ids) >= n_target_layers:
        raise ValueError(f"model.target_layer_ids {ids} out of range for {n_target_layers} target layers")
    return list(ids)


def build_drafter(cfg: TrainConfig, head: TargetHead) -> DFlashDrafter:
    """A fresh drafter for the target whose `head` it borrows (initialised from the torch RNG):
    it shares the frozen embedding and lm_head (in the target's dtype) and lives on their device.
    Its trainable weights are float32 whatever the target's dtype: they are the master weights
    that bf16 training (`compute_precision`) updates, so that steps smaller than a bf16 ulp are
    not lost."""
    tconf = head.config
    layer_ids = resolve_layer_ids(cfg, tconf.num_hidden_layers)
    mask_token_id = resolve_mask_token_id(cfg.model.mask_token_id, cfg.model.target_path, tconf.vocab_size)
    drafter_cfg = DrafterConfig.from_target_config(
        tconf, num_layers=cfg.model.num_draft_layers, num_target_features=len(layer_ids),
        block_size=cfg.model.block_size, mask_token_id=mask_token_id,
        layer_types=cfg.model.layer_types, sliding_window=cfg.model.sliding_window,
    )
    dspark = dspark_args(dataclasses.asdict(cfg.model))  # None: DFlash; else DSpark's heads
    drafter = new_drafter(drafter_cfg, head.embed_tokens, head.lm_head, dspark)
    return drafter.to(device=head.embed_tokens.weight.device)


def compute_precision(cfg: TrainConfig, device: torch.device):
    """The context the drafter's forward and loss run in: bf16 autocast over the fp32 master
    weights when `model.dtype` is bfloat16 (gradients, clipping and AdamW state stay fp32);
    plain fp32 otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.model.dtype == "bfloat16")


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str = "cosine") -> float:
    """Linear warmup to 1 over `warmup_steps`, then `schedule` (optim.schedule): cosine or linear decay
    to 0 at `total_steps`, or constant at 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def compiled_regions_on(device: torch.device) -> bool:
    """Whether the drafter's elementwise work and the head's cross entropy run under torch.compile
    (`dflash_ops.model.drafter.compiled_regions`, `dflash_ops.model.loss.fused_softmax_cross_entropy`):
    on CUDA, where they are fused kernels; elsewhere they run as written (the exact reference)."""
    return device.type == "cuda"


def adamw_implementation(params: list[torch.Tensor]) -> dict:
    """AdamW's implementation for `params`: `fused=True` (one kernel over all of them) when they are all on
    CUDA, torch's `foreach` path (a few kernels per parameter list) elsewhere."""
    if params and all(p.device.type == "cuda" for p in params):
        return {"fused": True}
    return {"foreach": True}


def make_optimizer_and_scheduler(params, optim: OptimConfig, total_steps: int):
    """AdamW over `params` (`adamw_implementation`) and a LambdaLR with warmup + optim.schedule over the run's
    `total_steps` (optim's, or those its epochs derive: `TrainConfig.total_steps`) (paper: lr 6e-4, warmup
    4%)."""
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay,
                                  **adamw_implementation(params))
    return optimizer, make_scheduler(optimizer, optim, total_steps)


def make_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int, step: int = 0):
    """The schedule of `optim` (its lr, warmup_ratio, schedule) over `total_steps`, standing at `step`
    (the steps done: a resume's): every param group's lr is then optim.lr times the schedule's multiplier
    there. A resume builds it afresh from its own config, so a changed lr or schedule is the one it trains by
    (the optimizer's moments stay the checkpoint's)."""
    warmup_steps = round(optim.warmup_ratio * total_steps)
    for group in optimizer.param_groups:
        group["initial_lr"] = optim.lr
        group["weight_decay"] = optim.weight_decay
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, warmup_steps, total_steps, optim.schedule),
        last_epoch=step - 1
    )


def document_groups(bounds: list[int], blocks_per_document: list[int], max_tokens: int,
                    max_blocks: int) -> list[tuple[int, int]]:
    """Consecutive documents `[first, last)` that go through the drafter together: a group grows
    while it holds at most `max_tokens` tokens and `max_blocks` blocks (a document alone may
    exceed them), so one group costs about as much memory as one full-size document. Groups
    without any block are dropped."""
    groups: list[tuple[int, int]] = []
    tokens = blocks = 0
    for doc, n_blocks in enumerate(blocks_per_document):
        length = bounds[doc + 1] - bounds[doc]
        if groups and tokens + length <= max_tokens and blocks + n_blocks <= max_blocks:
            groups[-1] = (groups[-1][0], doc + 1)
            tokens, blocks = tokens + length, blocks + n_blocks
        else:
            groups.append((doc, doc + 1))
            tokens, blocks = length, n_blocks
    return [(first, last) for first, last in groups if sum(blocks_per_document[first:last])]


def scored_weight(batch: BlockBatch) -> torch.Tensor:
    """The weight a group adds to the batch's normalizer: its scored rows' (DSpark's rows, if it has them)."""
    dspark = getattr(batch, "dspark", None)
    return batch.weights.sum() if dspark is None else dspark.weights.sum()


def scored_loss(drafter: DFlashDrafter, hidden: torch.Tensor, batch: BlockBatch,
                normalizer: float | torch.Tensor, chunk_size: int | None,
                dpace_alpha: float | None = None, chunk_loss: ChunkLoss = softmax_cross_entropy
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A group's share of the batch loss (sum(w * ce) / `normalizer`) from the drafter's hidden
    states `[Q, H]`, and per block position (`[b]` tensors) the scored predictions equal to the label
    and the scored predictions. The lm_head (vocab-wide) runs only where a position is scored
    (`batch.scored_rows`), never on anchors: `chunk_size` rows at a time (`chunked_head_loss`), or all
    at once when None. With `dpace_alpha` the weights are D-PACE's, from the drafter's own cross
    entropies of this pass (`dflash_ops.model.loss.dpace_row_weights`; the batch's weights then only say
    which rows are scored). `chunk_loss`: the chunked head's loss of a chunk of logits
    (`dflash_ops.model.loss.ChunkLoss`). Nothing here waits for the device."""
    block_size = drafter.cfg.block_size
    rows = batch.scored_rows
    labels, weights = batch.labels[rows], batch.weights[rows]
    offsets = rows % block_size
    weigh = None if dpace_alpha is None else functools.partial(
        dpace_row_weights, rows=rows, n_rows=batch.weights.numel(), block_size=block_size, alpha=dpace_alpha)
    if chunk_size is not None:
        return chunked_head_loss_on_device(hidden[rows], drafter.lm_head, labels, weights, offsets,
                                           block_size, chunk_size, normalizer, weigh, chunk_loss)
    logits = drafter.logits(hidden[rows])
    loss = dflash_loss(logits, labels, weights, normalizer=normalizer, weigh=weigh)
    return (loss, *correct_by_position(logits, labels, weights, offsets, block_size))


@dataclass
class StepResult:
    step: int            # optimizer steps done after this one
    loss: float
    accuracy: float      # nan when no position was scored
    lr: float            # the learning rate this step used
    num_tokens: int      # real (context) tokens in the batch
    num_blocks: int
    grad_norm: float = math.nan  # before clipping
    # Per block position 0..b-1: scored predictions equal to the label, and scored predictions.
    position_hits: list[int] = field(default_factory=list)
    position_counts: list[int] = field(default_factory=list)


def global_normalizer(weight: torch.Tensor, process_group) -> torch.Tensor:
    """What each drafter rank divides its sum(w * ce) by so that the objective is one token-weighted mean
    over every drafter's scored positions: the weight summed over the drafters (one scalar all-reduce)
    over their count, since DDP then averages the ranks' gradients. Each rank's gradient is thus its
    share of sum_all(w * ce) / sum_all(w), and their mean is the gradient of one process on the
    concatenated batch; a rank with nothing scored adds nothing and divides by the same."""
    if process_group is None:
        return weight
    total = torch.as_tensor(weight, dtype=torch.float32).reshape(1).clone()
    torch.distributed.all_reduce(total, group=process_group)
    return total[0] / torch.distributed.get_world_size(process_group)


def reduce_step(result: StepResult, process_group, device: torch.device) -> StepResult:
    """The step as all drafters saw it (a collective): the loss averaged over them (each rank's is its
    share of the global mean times their count, `global_normalizer`: the mean is that mean), tokens and
    blocks summed, and the accuracy over every
    drafter's scored positions, per block position too (nan only when no drafter scored any)."""
    if process_group is None:
        return result
    b = len(result.position_hits)
    figures = torch.tensor([result.loss, result.num_tokens, result.num_blocks, *result.position_hits,
                            *result.position_counts], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(figures, group=process_group)
    values = figures.tolist()
    hits, counts = [int(v) for v in values[3: 3 + b]], [int(v) for v in values[3 + b:]]
    scored = sum(counts)
    world = torch.distributed.get_world_size(process_group)
    return dataclasses.replace(result, loss=values[0] / world, num_tokens=int(values[1]),
                               num_blocks=int(values[2]), accuracy=sum(hits) / scored if scored else math.nan,
                               position_hits=hits, position_counts=counts)


def anchor_seed(seed: int, rank: int) -> int:
    """The anchor RNG's seed of drafter rank `rank`: the run's seed for rank 0 (so one drafter
    draws what the single-process trainer draws), a distinct stream for every other rank."""
    return seed + rank * 1_000_003


class DrafterTrainer:
    """One drafter, its optimizer and scheduler, and the anchor RNG of its rank; with the other
    drafter ranks' `process_group`, also its DDP wrapper (`ddp`), through which it trains. Every
    drafter rank must build its trainer at the same point: DDP's construction is a collective."""

    def __init__(self, drafter: DFlashDrafter, cfg: TrainConfig, rank: int = 0, process_group=None):
        self.drafter = drafter
        self.ddp = None if process_group is None else DistributedDataParallel(drafter,
                                                                              process_group=process_group)
        self.process_group = process_group
        self.cfg = cfg
        # D-PACE weighs the positions itself (scored_loss); the batch's weights then only mark them.
        dpace = cfg.optim.loss_weighting == "dpace"
        self.gamma = math.inf if dpace else cfg.gamma
        self.dpace_alpha = cfg.optim.dpace_alpha if dpace else None
        self.optimizer, self.scheduler = make_optimizer_and_scheduler(drafter.parameters(), cfg.optim,
                                                                       cfg.total_steps)
        self.anchor_generator = torch.Generator().manual_seed(anchor_seed(cfg.run.seed, rank))
        self.attention = choose_attention(cfg.model.attention_backend, drafter.fc.weight.device)
        # The layers' elementwise work and the head's cross entropy: fused under torch.compile on CUDA.
        self.compiled_regions = compiled_regions_on(drafter.fc.weight.device)
        drafter.compile_regions(self.compiled_regions)
        self.chunk_loss = cross_entropy_chunk_loss(self.compiled_regions)
        # loss.kind other than ce: the mix of dflash_ops.model.distill (None: the cross entropy above).
        self.loss_mix = None if cfg.loss.mix == {"ce": 1.0} else cfg.loss.mix
        self.dspark = isinstance(drafter, DSparkDrafter)
        self.step = 0

    def sample_anchors(self, loss_mask: torch.Tensor, bounds: list[int]) -> list[torch.Tensor]:
        return [
            sample_anchors(loss_mask[start:end], self.drafter.cfg.block_size, self.cfg.data.max_anchors,
                           self.anchor_generator)
            for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        ]

    def train_step(self, features: torch.Tensor, cu_seqlens: torch.Tensor, position_ids: torch.Tensor,
                   input_ids: torch.Tensor, loss_mask: torch.Tensor) -> StepResult:
        """One optimizer step on packed target features `[T, k*H]` with their `[T]` metadata.

        The documents go through the drafter in groups (`document_groups`), each backward adding
        its share of sum(w * ce) / sum(w) over the whole batch: the gradient is the full batch's,
        while the `[Q, T+Q]` mask and `[Q, vocab]` logits exist for one group at a time. The host
        reads the device only where `HOST_READS` says: laying out the batch, and the step's figures."""
        return self.accumulated_step([{"features": features, "cu_seqlens": cu_seqlens,
                                       "position_ids": position_ids, "input_ids": input_ids,
                                       "loss_mask": loss_mask}])

    def accumulated_step(self, micro_batches: list[dict]) -> StepResult:
        """One optimizer step over several micro-batches (optim.accumulate; each the keyword arguments of
        `train_step`): all of them are laid out first, so that every backward divides by the weight of
        them all, and the step is the one of their concatenation (one token-weighted mean; the anchors
        drawn in the same order). Under DDP only the last micro-batch's last pass synchronises."""
        device = self.drafter.fc.weight.device
        laid_out = []
        for batch in micro_batches:
            features, position_ids = batch["features"].to(device), batch["position_ids"].to(device)
            input_ids, loss_mask = batch["input_ids"].to(device), batch["loss_mask"].to(device)
            parts, n_blocks = self.layout(batch["cu_seqlens"], position_ids, input_ids, loss_mask)
            laid_out.append((features, position_ids, parts, n_blocks))
        # One token-weighted mean over every drafter's scored positions (the batch's, with one drafter).
        total_weight = global_normalizer(sum(scored_weight(b) for *_, parts, _ in laid_out
                                             for _, _, b, _ in parts), self.process_group)
        self.drafter.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = hits = counts = 0
        # One autocast for the whole step: its cache casts each fp32 weight to bf16 once a step, not once
        # per group of documents (it is dropped on leaving, before the optimizer changes the weights).
        with compute_precision(self.cfg, device):
            for i, (features, position_ids, parts, _) in enumerate(laid_out):
                sync = i == len(laid_out) - 1
                with contextlib.nullcontext() if sync or self.ddp is None else self.ddp.no_sync():
                    micro = self.forward_backward(features, position_ids, parts, total_weight)
                loss_sum, hits, counts = loss_sum + micro[0], hits + micro[1], counts + micro[2]
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.drafter.parameters() if p.requires_grad], self.cfg.optim.max_grad_norm
        )
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return self.figures(loss_sum, grad_norm, hits, counts, lr,
                            sum(int(b[0].shape[0]) for b in laid_out), sum(b[3] for b in laid_out))

    def layout(self, cu_seqlens: torch.Tensor, position_ids: torch.Tensor, input_ids: torch.Tensor,
               loss_mask: torch.Tensor) -> tuple[list[tuple[int, int, BlockBatch, BlockMask]], int]:
        """The step's groups, laid out on the host from the batch's metadata: `(start, end, blocks,
        attention pattern)` per group, and the number of blocks. The documents' bounds, the anchors
        (drawn from the loss mask, read once) and each group's scored rows are read here, so that the
        forward and backward that follow never wait for the device."""
        bounds = [int(b) for b in cu_seqlens.tolist()]
        anchors = self.sample_anchors(loss_mask.cpu(), bounds)
        dcfg, data = self.drafter.cfg, self.cfg.data
        groups = document_groups(bounds, [a.numel() for a in anchors], data.max_length, data.max_anchors)
        # Compiled, the attention sees one shape whatever the group: a full one's, padded.
        context_rows, query_rows = ((data.max_length, data.max_anchors * dcfg.block_size)
                                    if self.attention.compiled else (0, 0))
        # A batch without any block still runs one (empty) pass: under DDP every rank must join
        # the gradient all-reduce of every step.
        parts = []
        for first, last in groups or [(0, len(anchors))]:
            start, end = bounds[first], bounds[last]
            part_bounds = torch.tensor([b - start for b in bounds[first: last + 1]], dtype=torch.int32)
            batch = build_block_batch(input_ids[start:end], loss_mask[start:end], part_bounds,
                                      position_ids[start:end], anchors[first:last], dcfg.block_size,
                                      dcfg.mask_token_id, self.gamma)
            batch.scored_rows  # noqa: B018 (found here, once: the loss reads them in the hot path)
            if self.dspark:  # DSpark's rows: labels one further, position 0 scored (dflash_ops.model.dspark)
                batch.dspark = dspark_targets(batch, input_ids[start:end], loss_mask[start:end], self.gamma)
            mask = batch.block_mask(self.attention.backend, context_rows, query_rows, self.attention.compiled)
            parts.append((start, end, batch, mask))
        return parts, sum(a.numel() for a in anchors)

    def forward_backward(self, features: torch.Tensor, position_ids: torch.Tensor, parts: list,
                         total_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every group's forward, loss and backward: the step's hot path, where nothing reads the
        device from the host. The loss summed over the groups and per block position the scored
        predictions equal to the label and the scored ones, all on the device."""
        device, block_size = features.device, self.drafter.cfg.block_size
        forward = self.drafter if self.ddp is None else self.ddp
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        hits = counts = torch.zeros(block_size, dtype=torch.int64, device=device)
        for i, (start, end, batch, mask) in enumerate(parts):
            # Under DDP only the last pass synchronises, so that every rank all-reduces once a step
            # however many groups its batch has.
            last = i == len(parts) - 1
            with contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync():
                with compute_precision(self.cfg, device):  # within the step's: its cast weights
                    # With a loss.kind that needs it, the features' last H columns are the target's last
                    # hidden state: the loss reads them, the drafter never does.
                    context, target_last = split_features(features[start:end], self.drafter.cfg.hidden_size,
                                                          self.drafter.cfg.num_target_features)
                    hidden = forward(context, position_ids[start:end], batch.block_input_ids,
                                     batch.block_positions, mask)
                    if self.dspark:
                        loss, group_hits, group_counts = dspark_loss(
                            self.drafter, hidden, batch.dspark, target_last, total_weight, self.cfg.loss.mix,
                            self.cfg.model.loss_chunk_size, self.dpace_alpha, batch.weights.numel())
                    elif self.loss_mix is None:
                        loss, group_hits, group_counts = scored_loss(
                            self.drafter, hidden, batch, total_weight, self.cfg.model.loss_chunk_size,
                            self.dpace_alpha, self.chunk_loss)
                    else:
                        loss, group_hits, group_counts = scored_mix_loss(
                            self.drafter, hidden, batch, target_last, total_weight,
                            self.cfg.model.loss_chunk_size, self.loss_mix, self.dpace_alpha)
                # Outside autocast (the backward ops follow the forward's dtypes); an inner disabled
                # autocast, so that the step's cache of cast weights outlives it.
                with torch.autocast(device.type, enabled=False):
                    loss.backward()
            loss_sum = loss_sum + loss.detach().float()
            hits, counts = hits + group_hits, counts + group_counts
        return loss_sum, hits, counts

    def figures(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor, hits: torch.Tensor,
                counts: torch.Tensor, lr: float, n_tokens: int, n_blocks: int) -> StepResult:
        """The step's figures for the log, read from the device in one transfer."""
        values = torch.cat([torch.stack([loss_sum.double(), grad_norm.double()]), hits.double(),
                            counts.double()]).tolist()
        b = hits.numel()
        hits_by_position = [int(v) for v in values[2:2 + b]]
        counts_by_position = [int(v) for v in values[2 + b:]]
        scored = sum(counts_by_position)
        return StepResult(self.step, values[0], sum(hits_by_position) / scored if scored else math.nan, lr,
                          n_tokens, n_blocks, values[1], hits_by_position, counts_by_position)

    def state_dict(self) -> dict:
        """What every drafter rank shares (DDP keeps it equal); the anchor RNG, which is each
        rank's own, is saved per rank by the run (`dflash_ops.train`)."""
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])  # the moments; lr and schedule: this config's
        self.scheduler = make_scheduler(self.optimizer, self.cfg.optim, self.cfg.total_steps, self.step)

"""DSpark (`model.kind: dspark`): the DFlash backbone, a low-rank Markov head and an optional confidence head.

The heads, as vLLM serves them (vllm-project/vllm `vllm/model_executor/models/qwen3_dspark.py` at
0302ff40439493d0db2e3bbfd509211703375d08: `DSparkMarkovHead`, `DSparkConfidenceHead`,
`Qwen3DSparkModel`) and Model-Optimizer trains them (NVIDIA/Model-Optimizer
`modelopt/torch/speculative/plugins/hf_dspark.py` at 8265768240bd8e4fc86cf9a6b2616fc9c3966055):
  - `markov_head.markov_w1`: Embedding(vocab, rank), the previous token's rank-r embedding e;
  - `markov_head.markov_w2`: weight `[vocab, rank]`; the block position's logits are
    lm_head(h) + markov_w2 @ e (vLLM: `logits_processor(markov_w2, markov_embed)`);
  - `confidence_head.proj`: Linear(hidden [+ rank], 1, bias), float32, on [h ; e]
    (`confidence_head_with_markov`) or h: the logit of the position's acceptance probability.

Alignment (Model-Optimizer's `shift_label`, vLLM's `DSparkProposer`, vllm/v1/spec_decode/dspark.py at
26a86f53842d97d16e23cf4a69378f358e328c48): the block is DFlash's, [anchor token, MASK x (b-1)] at
positions anchor .. anchor+b-1, seeing the context before the anchor; but block position k predicts the
token at anchor + k + 1 (position 0 included: b drafts a block), its previous token is the token at
anchor + k (teacher-forced in training; at serving the anchor, then each drafted token), its target
distribution the target's output at anchor + k, and its weight exp(-k / gamma) (position 0: 1).

The loss (Model-Optimizer's `_compute_dspark_loss`, its defaults CE x 0.1 + TVD x 0.9 + BCE): the
`dflash_ops.model.distill` mix of the corrected logits (`loss.weights` ce, kl, tvd), plus `bce` x the
confidence head's binary cross entropy against the analytical acceptance rate 1 - TVD/2 = 1 - L1/2
(detached), each term weighted per position and divided by the batch's weight. The head runs `chunk_size`
rows at a time under activation checkpointing (Model-Optimizer's `_tvd_per_token` does the same): no
`[rows, vocab]` tensor outlives its chunk, at the price of the head's forward once more in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig
from dflash_ops.model.loss import BlockBatch, head_in_compute_dtype, tally_by_position


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # weight [vocab, rank], as vLLM's
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # a fresh head adds nothing: training starts from DFlash's

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids)

    def bias(self, embed: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(embed)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return self.proj(x.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """A DFlash drafter with `markov_head` (and `confidence_head`, or None), trained with it."""

    def __init__(self, cfg: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear, markov_rank: int,
                 confidence_head: bool = False, confidence_with_markov: bool = True):
        super().__init__(cfg, embed_tokens, lm_head)
        if markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1, got {markov_rank}")
        self.markov_rank = markov_rank
        self.markov_head = MarkovHead(cfg.vocab_size, markov_rank)
        width = cfg.hidden_size + (markov_rank if confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(width, confidence_with_markov) if confidence_head else None

    def corrected_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """lm_head(hidden) + markov_w2 @ markov_w1[prev_ids], `[N, vocab]` (unchunked: evaluation, tests)."""
        return self.logits(hidden) + self.markov_head.bias(self.markov_head.embed(prev_ids)).to(
            self.lm_head.weight.dtype)

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """The acceptance probability of each position, `[N]` float32 (vLLM's `compute_confidence`)."""
        return torch.sigmoid(self.confidence_head(hidden, self.markov_head.embed(prev_ids)))


@dataclass
class DSparkTargets:
    """A group's DSpark rows: the block rows with a weight (`rows`, positions anchor+k+1 in the document
    and in the loss mask), their labels (token at anchor+k+1), previous tokens (token at anchor+k), weights
    exp(-k/gamma) and the context row whose target output predicts their label (anchor + k)."""

    rows: torch.Tensor
    labels: torch.Tensor
    prev_ids: torch.Tensor
    weights: torch.Tensor
    target_rows: torch.Tensor
    offsets: torch.Tensor


def dspark_targets(batch: BlockBatch, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                   gamma: float) -> DSparkTargets:
    """The DSpark rows of a group (`batch` built from its `input_ids` and `loss_mask`, `[T]` each). Reads
    the scored rows from the device once: call it while laying out a step."""
    b = batch.block_size
    device = batch.block_anchor.device
    starts = batch.cu_seqlens.to(device, torch.int64)
    lengths = (starts[1:] - starts[:-1])[batch.block_doc][:, None]
    k = torch.arange(b, device=device)
    label_pos = batch.block_anchor[:, None] + k[None, :] + 1
    in_document = label_pos < lengths
    base = starts[:-1][batch.block_doc][:, None]
    label_flat = torch.where(in_document, base + label_pos, 0)
    scored = in_document & loss_mask.to(device)[label_flat].to(torch.bool)
    decay = torch.exp(-k.to(torch.float32) / gamma) if gamma != float("inf") else torch.ones(b, device=device)
    rows = scored.reshape(-1).nonzero().squeeze(1)
    prev_flat = (base + label_pos - 1).reshape(-1)[rows]
    ids = input_ids.to(device)
    return DSparkTargets(rows, ids[label_flat.reshape(-1)[rows]], ids[prev_flat],
                         decay.expand(scored.shape[0], b).reshape(-1)[rows], prev_flat, rows % b)


def _row_terms(hidden, prev_ids, target_hidden, labels, head, w2, w1, conf_weight, conf_bias, with_markov,
               mix, want_tvd):
    """(ce, mixed, l1, confidence logits) of a chunk of rows, float32, differentiable."""
    embed = F.embedding(prev_ids, w1)
    logits = F.linear(hidden.to(head.dtype), head).float() + F.linear(embed, w2).float()
    log_q = torch.log_softmax(logits, dim=-1)
    ce = -log_q.gather(1, labels[:, None]).squeeze(1)
    mixed = torch.zeros_like(ce)
    l1 = torch.zeros_like(ce)
    if target_hidden is not None:
        log_p = torch.log_softmax(F.linear(target_hidden.to(head.dtype), head).float(), dim=-1)
        p = log_p.exp()
        if want_tvd or "tvd" in mix:
            l1 = (log_q.exp() - p).abs().sum(-1)
        if "kl" in mix:
            mixed = mixed + mix["kl"] * (p * (log_p - log_q)).sum(-1)
        if "tvd" in mix:
            mixed = mixed + mix["tvd"] * l1
    if "ce" in mix:
        mixed = mixed + mix["ce"] * ce
    confidence = torch.zeros_like(ce)
    if conf_weight is not None:
        x = torch.cat([hidden, embed.to(hidden.dtype)], -1) if with_markov else hidden
        confidence = F.linear(x.float(), conf_weight, conf_bias).squeeze(-1)
    return ce, mixed, l1, confidence


def dspark_loss(drafter: DSparkDrafter, hidden: torch.Tensor, targets: DSparkTargets,
                target_last: torch.Tensor | None, normalizer: float | torch.Tensor, mix: dict[str, float],
                chunk_size: int | None = None, dpace_alpha: float | None = None, n_rows: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A group's share of the DSpark loss from the drafter's hidden states `[Q, H]` and the group's target
    last hidden states `[T, H]` (None: the mix is ce alone and there is no bce), and per block position
    the scored rows whose corrected argmax is the label and the scored rows (`[b]` tensors). `mix`: the
    terms ce, kl, tvd, bce and their weights; `n_rows` (the group's Q) with `dpace_alpha` for D-PACE."""
    from dflash_ops.model.loss import dpace_row_weights

    block_size = drafter.cfg.block_size
    rows = targets.rows
    terms = {t: w for t, w in mix.items() if t != "bce"}
    bce_weight = mix.get("bce", 0.0)
    if bce_weight and drafter.confidence_head is None:
        raise ValueError("loss.weights.bce trains the confidence head: set model.confidence_head true")
    if (bce_weight or any(t != "ce" for t in terms)) and target_last is None:
        raise ValueError("the DSpark loss needs the target's distribution, and none was given")
    h = hidden[rows]
    target_hidden = None if target_last is None else target_last[targets.target_rows]
    device_type = h.device.type
    head = head_in_compute_dtype(drafter.lm_head.weight, device_type)
    conf = drafter.confidence_head
    conf_args = (None, None, False) if conf is None or not bce_weight else (conf.proj.weight, conf.proj.bias,
                                                                           conf.with_markov)
    markov = drafter.markov_head
    step = max(1, chunk_size or max(1, h.shape[0]))
    outputs = []
    with torch.autocast(device_type, enabled=False):
        for start in range(0, h.shape[0], step):
            sl = slice(start, start + step)
            args = (h[sl], targets.prev_ids[sl], None if target_hidden is None else target_hidden[sl],
                    targets.labels[sl], head, markov.markov_w2.weight, markov.markov_w1.weight, *conf_args,
                    terms, bool(bce_weight))
            if torch.is_grad_enabled() and h.requires_grad:
                outputs.append(torch.utils.checkpoint.checkpoint(_row_terms, *args, use_reentrant=False))
            else:
                outputs.append(_row_terms(*args))
    if outputs:
        ce, mixed, l1, confidence = (torch.cat(parts) for parts in zip(*outputs, strict=True))
    else:
        ce = mixed = l1 = confidence = h.new_zeros(0, dtype=torch.float32) + h.sum() * 0
    weights = targets.weights
    if dpace_alpha is not None:
        weights = dpace_row_weights(ce.detach(), rows, n_rows, block_size, dpace_alpha)
    total = mixed
    if bce_weight:
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
        total = total + bce_weight * F.binary_cross_entropy_with_logits(confidence, accept, reduction="none")
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=h.device).clamp_min(1e-6)
    loss = (weights * total).sum() / normalizer
    with torch.no_grad():
        logits_argmax = _corrected_argmax(drafter, h, targets.prev_ids, step)
        correct = logits_argmax == targets.labels
    return (loss, tally_by_position(targets.offsets, correct, block_size),
            tally_by_position(targets.offsets, torch.ones_like(correct), block_size))


@torch.no_grad()
def _corrected_argmax(drafter: DSparkDrafter, h: torch.Tensor, prev_ids: torch.Tensor, step: int
                      ) -> torch.Tensor:
    out = torch.empty(h.shape[0], dtype=torch.int64, device=h.device)
    for start in range(0, h.shape[0], step):
        sl = slice(start, start + step)
        out[sl] = drafter.corrected_logits(h[sl], prev_ids[sl]).argmax(-1)
    return out

"""Held-out loss and acceptance length during training, cheap enough to compute every few hundred steps.

The held-out examples' target features are computed once (the target is frozen). Each evaluation
is then drafter passes only: a block at every response position, in chunks of `data.max_anchors`
blocks through the training step's attention (`choose_attention` of the same `model.attention_backend`
on the same device: FlexAttention compiled on CUDA, the block-sparse tiles elsewhere), in its precision
(`precision`, the training autocast), and the lm_head `chunk_size` rows at a time (`model.loss_chunk_size`,
`chunked_head_eval`): its peak memory is that of a training step's forward at the same shape, never a
chunk's `[blocks x b, vocab]` logits. It gives

- the loss: the training loss with the decay's weights over those blocks (D-PACE's depend on the
  drafter itself, so the held-out loss stays the decay-weighted one and runs of either compare);
- tau and the acceptance by draft position of greedy speculative decoding replayed on the response:
  from the response's first token, each step accepts the drafts that equal the response's next
  tokens, gains them plus one, and moves on. When the held-out responses are the target's own greedy
  output (as regenerated data is with greedy decoding) this is exactly what `dflash_ops.evaluate` measures
  with the response length as the token budget, without running the target again.

A DSpark drafter (`model.kind: dspark`, `dflash_ops.model.dspark`) is measured as vLLM's DSparkProposer
serves it (`dflash_ops.serve.dspark_decode.dspark_proposer`): the same block [anchor, MASK x (b-1)] gives b
drafts, for anchor+1 .. anchor+b, position k's logits lm_head(h_k) + markov_w2 @ markov_w1[prev], prev the
anchor for k = 0 then the token drafted at k - 1. The replay takes the response's own token at anchor + k
as prev instead (teacher-forced, `dspark_head_eval`: the base head `chunk_size` rows at a time, then
`[blocks, vocab]` a position): the acceptance lengths are the same, since up to the first rejected draft
each drafted token is the response's, and the first rejection sees the same logits either way.
tau is then bounded by b + 1 (`AcceptanceStats` of block b + 1, as `dflash_ops.evaluate` verifies a DSpark
drafter). Its loss is the cross entropy of the corrected logits with the teacher-forced previous token
(the token at anchor + k) at DSpark's alignment (`dflash_ops.model.dspark.dspark_targets`: rows whose label
anchor + k + 1 is scored), weighted by the decay exp(-k / gamma) and divided by those weights: the `ce`
term of the DSpark training loss. The training mix's other terms need the target's distribution, which the
held-out features do not carry, so whatever `loss.weights` a DSpark run trains with, its held-out loss is
this one and compares between DSpark runs (not with a DFlash run's, whose rows are one position earlier).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ops.data.examples import Example
from dflash_ops.data.target import step_features
from dflash_ops.model import flex
from dflash_ops.model.acceptance import AcceptanceStats, replay_acceptance
from dflash_ops.model.drafter import DFlashDrafter
from dflash_ops.model.dspark import DSparkDrafter, dspark_targets
from dflash_ops.model.loss import BlockBatch, build_block_batch, chunked_head_eval, head_in_compute_dtype


@dataclass
class HeldOutDocument:
    features: torch.Tensor   # [L, k*H] target features of the example
    input_ids: torch.Tensor  # [L]
    loss_mask: torch.Tensor  # [L]
    response_start: int      # first response (loss_mask 1) position


@dataclass
class HeldOutResult:
    loss: float
    stats: AcceptanceStats

    def as_fields(self) -> dict:
        return {"heldout_loss": self.loss, "heldout_tau": round(self.stats.tau, 4),
                "heldout_acceptance_by_position": [round(r, 4) for r in self.stats.acceptance_by_position()]}


NO_HELDOUT_DOCUMENTS = "no held-out example has both a prompt and a response of two tokens or more"


def heldout_documents(features: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor,
                      loss_mask: torch.Tensor, require: bool = True, **_) -> list[HeldOutDocument]:
    """The held-out documents of packed target features (`dflash_ops.data.target.step_features` of the
    held-out examples, computed by whichever process holds the target: a pipeline's target rank 0 sends
    them a batch of rows at a time), those with a prompt and a response of two tokens or more (with
    `require`, at least one)."""
    documents = []
    bounds = [int(b) for b in cu_seqlens.tolist()]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        mask = loss_mask[start:end].cpu()
        scored = mask.tolist()
        if 1 not in scored or scored.index(1) == 0 or scored.index(1) >= len(scored) - 1:
            continue  # no prompt, or nothing to draft after the response's first token
        documents.append(HeldOutDocument(features[start:end], input_ids[start:end].cpu(), mask,
                                         scored.index(1)))
    if require and not documents:
        raise ValueError(NO_HELDOUT_DOCUMENTS)
    return documents


class HeldOutEvaluator:
    """The held-out figures of a drafter on `documents` (`heldout_documents`)."""

    def __init__(self, documents: list[HeldOutDocument], max_anchors: int, gamma: float,
                 chunk_size: int | None = None, precision=None, attention_backend: str = "auto"):
        """`precision(device)`: the context the drafter's forward and head run in (the training's
        autocast; none by default); `chunk_size`: lm_head rows at a time (None: all of a chunk's);
        `attention_backend`: the run's `model.attention_backend`, chosen on the drafter's device as the
        training step chooses it (`dflash_ops.model.flex.choose_attention`)."""
        self.documents = documents
        self.max_anchors, self.gamma, self.chunk_size = max_anchors, gamma, chunk_size
        self.precision = precision or (lambda device: contextlib.nullcontext())
        self.attention_backend = attention_backend
        # Compiled, every pass sees one shape: the longest document's context and a full chunk's blocks.
        self.context_rows = max((doc.input_ids.numel() for doc in documents), default=0)

    @classmethod
    def of(cls, target: nn.Module, examples: list[Example], layer_ids: list[int], max_anchors: int,
           gamma: float, chunk_size: int | None = None, precision=None,
           attention_backend: str = "auto") -> HeldOutEvaluator:
        """The evaluator of `examples`, their features computed here by `target`."""
        device = target.get_input_embeddings().weight.device
        features = step_features(target, examples, layer_ids, 1, device)  # one example a pass
        return cls(heldout_documents(**features), max_anchors, gamma, chunk_size, precision,
                   attention_backend)

    @torch.no_grad()
    def __call__(self, drafter: DFlashDrafter) -> HeldOutResult:
        was_training = drafter.training
        drafter.eval()
        block_size = drafter.cfg.block_size
        dspark = isinstance(drafter, DSparkDrafter)  # b drafts a block, verified with b + 1
        device = drafter.fc.weight.device
        attention = flex.choose_attention(self.attention_backend, device)  # the training step's
        padded = (self.context_rows, self.max_anchors * block_size) if attention.compiled else (0, 0)
        stats = AcceptanceStats("held-out", block_size + 1 if dspark else block_size)
        weighted_ce, total_weight = 0.0, 0.0
        for doc in self.documents:
            length = doc.input_ids.numel()
            anchors = torch.arange(doc.response_start, length - 1)
            cu_seqlens = torch.tensor([0, length], dtype=torch.int32)
            positions = torch.arange(length, device=device)
            input_ids, loss_mask = doc.input_ids.to(device), doc.loss_mask.to(device)
            drafts_at: dict[int, list[int]] = {}
            for chunk in anchors.split(self.max_anchors):
                batch = build_block_batch(input_ids, loss_mask, cu_seqlens, positions, [chunk], block_size,
                                          drafter.cfg.mask_token_id, self.gamma)
                mask = batch.block_mask(attention.backend, *padded, attention.compiled)
                with self.precision(device):
                    hidden = drafter(doc.features.to(device), positions, batch.block_input_ids,
                                     batch.block_positions, mask)
                    if dspark:
                        ce_sum, weight, drafts = dspark_head_eval(drafter, hidden, batch, input_ids,
                                                                  loss_mask, self.gamma, self.chunk_size)
                    else:
                        drafted = torch.arange(batch.labels.numel(), device=device) % block_size > 0
                        ce_sum, argmax = chunked_head_eval(hidden[drafted], drafter.lm_head,
                                                           batch.labels[drafted], batch.weights[drafted],
                                                           self.chunk_size)
                        weight, drafts = float(batch.weights.sum()), argmax.view(-1, block_size - 1)
                del hidden
                weighted_ce += ce_sum
                total_weight += weight
                drafts_at.update(zip(chunk.tolist(), drafts.tolist(), strict=True))
            lengths = replay_acceptance(doc.input_ids.tolist(), doc.response_start, drafts_at)
            stats.lengths += lengths
            stats.generated_tokens += 1 + sum(lengths)
        drafter.train(was_training)
        loss = weighted_ce / total_weight if total_weight else float("nan")
        return HeldOutResult(loss, stats)


def dspark_head_eval(drafter: DSparkDrafter, hidden: torch.Tensor, batch: BlockBatch, input_ids: torch.Tensor,
                     loss_mask: torch.Tensor, gamma: float, chunk_size: int | None
                     ) -> tuple[float, float, torch.Tensor]:
    """A chunk's DSpark figures from the drafter's hidden states `[blocks x b, H]` of `batch` (one document's
    blocks, its `input_ids` and `loss_mask`), without gradient: sum(w * ce) and sum(w) over the loss's rows
    (`dspark_targets`: teacher-forced previous token, decay weights) and the `[blocks, b]` greedy drafts with
    the document's token at anchor + k as each position's previous token (the module's docstring: the same
    acceptance as `dspark_proposer`'s drafts, whose previous token is the draft before). The head runs on
    `chunk_size` rows (whole blocks, one at least; all when None) at a time, in the training head's dtypes
    (the autocast dtype's lm_head, the Markov head in its own, the softmax in float32), then one position
    after the other, `[blocks, vocab]` at a time: no `[blocks x b, vocab]` float32 tensor exists."""
    b = batch.block_size
    blocks = batch.block_anchor.numel()
    device = hidden.device
    targets = dspark_targets(batch, input_ids, loss_mask, gamma)  # the training loss's rows
    labels = torch.zeros(blocks * b, dtype=torch.int64, device=device)
    weights = torch.zeros(blocks * b, dtype=torch.float32, device=device)
    labels[targets.rows], weights[targets.rows] = targets.labels, targets.weights
    labels, weights = labels.view(blocks, b), weights.view(blocks, b)
    # Every position's previous token, the document's at anchor + k (= dspark_targets' on the loss's rows;
    # past the document's end a position is never replayed).
    length = input_ids.numel()
    forced = input_ids[(batch.block_anchor[:, None] + torch.arange(b, device=device)).clamp(max=length - 1)]
    rows = hidden.reshape(blocks, b, hidden.shape[-1])
    head = head_in_compute_dtype(drafter.lm_head.weight, device.type)
    markov = drafter.markov_head
    drafts = torch.empty(blocks, b, dtype=torch.int64, device=device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    step = max(1, (chunk_size or blocks * b) // b)
    with torch.autocast(device.type, enabled=False):
        for start in range(0, blocks, step):
            group = slice(start, start + step)
            base = F.linear(rows[group].reshape(-1, rows.shape[-1]).to(head.dtype), head)
            base = base.view(-1, b, base.shape[-1])  # [blocks of the group, b, vocab], the head's dtype
            for k in range(b):
                logits = base[:, k].float() + markov.bias(markov.embed(forced[group, k])).float()
                drafts[group, k] = logits.argmax(-1)
                log_q = torch.log_softmax(logits, -1)
                total -= (weights[group, k] * log_q.gather(1, labels[group, k, None]).squeeze(1)).sum()
                del log_q, logits
            del base
    return float(total), float(weights.sum()), drafts

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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from dflash_ops.data.examples import Example
from dflash_ops.data.target import step_features
from dflash_ops.model import flex
from dflash_ops.model.acceptance import AcceptanceStats, replay_acceptance
from dflash_ops.model.drafter import DFlashDrafter
from dflash_ops.model.loss import build_block_batch, chunked_head_eval


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
        device = drafter.fc.weight.device
        attention = flex.choose_attention(self.attention_backend, device)  # the training step's
        padded = (self.context_rows, self.max_anchors * block_size) if attention.compiled else (0, 0)
        stats = AcceptanceStats("held-out", block_size)
        weighted_ce, total_weight = 0.0, 0.0
        for doc in self.documents:
            length = doc.input_ids.numel()
            anchors = torch.arange(doc.response_start, length - 1)
            cu_seqlens = torch.tensor([0, length], dtype=torch.int32)
            positions = torch.arange(length, device=device)
            drafts_at: dict[int, list[int]] = {}
            for chunk in anchors.split(self.max_anchors):
                batch = build_block_batch(doc.input_ids.to(device), doc.loss_mask.to(device), cu_seqlens,
                                          positions, [chunk], block_size, drafter.cfg.mask_token_id,
                                          self.gamma)
                drafted = torch.arange(batch.labels.numel(), device=device) % block_size > 0  # not anchors
                mask = batch.block_mask(attention.backend, *padded, attention.compiled)
                with self.precision(device):
                    hidden = drafter(doc.features.to(device), positions, batch.block_input_ids,
                                     batch.block_positions, mask)
                    ce_sum, argmax = chunked_head_eval(hidden[drafted], drafter.lm_head,
                                                       batch.labels[drafted], batch.weights[drafted],
                                                       self.chunk_size)
                del hidden
                weighted_ce += ce_sum
                total_weight += float(batch.weights.sum())
                predicted = argmax.view(-1, block_size - 1).tolist()
                drafts_at.update(zip(chunk.tolist(), predicted, strict=True))
            lengths = replay_acceptance(doc.input_ids.tolist(), doc.response_start, drafts_at)
            stats.lengths += lengths
            stats.generated_tokens += 1 + sum(lengths)
        drafter.train(was_training)
        loss = weighted_ce / total_weight if total_weight else float("nan")
        return HeldOutResult(loss, stats)

"""Greedy DSpark drafting, as vLLM's `DSparkProposer` drafts (vllm/v1/spec_decode/dspark.py at
26a86f53842d97d16e23cf4a69378f358e328c48): one backbone pass over the block [anchor, MASK x (b-1)] after the
context gives b base logits, then the Markov head corrects them left to right, each position's bias from the
token drafted before it (the anchor for the first): b drafts per verify step, where DFlash drafts b - 1.
`dflash_ops.serve.evaluate.speculative_decode(..., block_size=b + 1, ...)` verifies them
(`dflash_ops.serve.evaluate.kind_proposer` gives a drafter of either kind's proposer with that block size).
"""

from __future__ import annotations

import torch

from dflash_ops.model.dspark import DSparkDrafter
from dflash_ops.model.loss import build_block_attention_mask
from dflash_ops.serve.baselines import Proposer


def dspark_proposer(drafter: DSparkDrafter) -> Proposer:
    """b greedy drafts from a DSpark drafter (the anchor: the sequence's last token)."""
    cfg = drafter.cfg
    drafter.eval()

    @torch.no_grad()
    def propose(sequence: list[int], context: torch.Tensor) -> list[int]:
        device = context.device
        n_context = context.shape[0]
        positions = torch.arange(n_context, device=device)
        block_ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=device)
        block_ids[0] = sequence[-1]
        zero = torch.zeros(1, dtype=torch.long, device=device)
        mask = build_block_attention_mask(torch.zeros(n_context, dtype=torch.long, device=device), positions,
                                          zero, torch.tensor([n_context], device=device), cfg.block_size)
        block_positions = n_context + torch.arange(cfg.block_size, device=device)
        hidden = drafter(context, positions, block_ids, block_positions, mask)
        base = drafter.logits(hidden)
        drafts, prev = [], sequence[-1]
        for k in range(cfg.block_size):
            embed = drafter.markov_head.embed(torch.tensor([prev], device=device))
            prev = int((base[k] + drafter.markov_head.bias(embed)[0].to(base.dtype)).argmax())
            drafts.append(prev)
        return drafts

    return propose

"""Drafters that need no training, to tell what a trained drafter's acceptance length is worth.

- `prompt_lookup_proposer`: prompt-lookup decoding. The drafts are the tokens that followed the
  most recent earlier occurrence of the sequence's last n tokens (n from `max_ngram` down to 1);
  when that copy runs out before b-1 drafts, the lookup repeats on the sequence extended by the
  drafts so far, and a sequence with no match at all repeats its last token. Source code and
  chat repeat themselves, so this is the bar a drafter must clear to be worth its compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# proposer(sequence so far, context features [len(sequence) - 1, k*H]) -> b-1 draft tokens
Proposer = Callable[[list[int], torch.Tensor], list[int]]


def lookup_continuation(tokens: list[int], max_ngram: int, limit: int) -> list[int]:
    """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (at most `max_ngram` long) seen before; [] when no suffix occurs earlier."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        # Latest start first: the most recent context is the likeliest to repeat.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + limit]
    return []


def prompt_lookup_proposer(block_size: int, max_ngram: int = 3) -> Proposer:
    """b-1 drafts copied from earlier in the sequence (see the module docstring)."""
    if block_size < 2 or max_ngram < 1:
        raise ValueError(f"prompt lookup needs block_size >= 2 and max_ngram >= 1, "
                         f"got {block_size} and {max_ngram}")

    def propose(sequence: list[int], context: torch.Tensor) -> list[int]:
        drafts: list[int] = []
        while len(drafts) < block_size - 1:
            copied = lookup_continuation(sequence + drafts, max_ngram, block_size - 1 - len(drafts))
            drafts += copied or [(sequence + drafts)[-1]]
        return drafts

    return propose

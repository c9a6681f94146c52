"""The prompt-lookup baseline and the replay of speculative decoding on a known response."""

from __future__ import annotations

import pytest
import torch

from dflash_ops.serve.baselines import lookup_continuation, prompt_lookup_proposer
from dflash_ops.training.heldout import replay_acceptance

NO_CONTEXT = torch.zeros(0, 1)


def test_lookup_copies_what_followed_the_latest_match_of_the_longest_ngram():
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 1, 2, 9, 7, 1, 2, 3, 4, 5, 1, 2]
    # "5 1 2" occurred at 0..2 (then 9); "1 2" more recently at 5..6 (then 3): the longer n-gram wins.
    assert lookup_continuation(tokens, max_ngram=3, limit=2) == [9, 7]
    assert lookup_continuation(tokens, max_ngram=2, limit=3) == [3, 4, 5]
    assert lookup_continuation([1, 2, 3], max_ngram=3, limit=4) == []


def test_prompt_lookup_drafts_a_full_block_and_continues_a_repeating_text():
    propose = prompt_lookup_proposer(block_size=6)
    assert propose([4, 5, 6, 4, 5], NO_CONTEXT) == [6, 4, 5, 6, 4]
    # No match anywhere: the last token repeated, still b-1 drafts.
    assert propose([1, 2, 3], NO_CONTEXT) == [3, 3, 3, 3, 3]
    with pytest.raises(ValueError, match="block_size >= 2"):
        prompt_lookup_proposer(block_size=1)


def test_replay_counts_accepted_drafts_plus_one_within_the_budget():
    tokens = [0, 1, 2, 3, 4, 5, 6, 7]
    drafts_at = {
        2: [3, 4, 9],   # two accepted: gains 3, next anchor 5
        5: [6, 9, 9],   # one accepted: gains 2, next anchor 7 = the last token, done
    }
    assert replay_acceptance(tokens, 2, drafts_at) == [3, 2]
    # Every draft right but the budget ends first: the last step gains only what is left.
    perfect = {a: tokens[a + 1: a + 4] + [0] * 3 for a in range(len(tokens))}
    assert replay_acceptance(tokens, 1, perfect) == [4, 2]

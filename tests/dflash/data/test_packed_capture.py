"""The target's capture packs its documents: no padding token is computed, and each document's
features are those it has alone."""

from __future__ import annotations

import pytest
import torch

from dflash_ops.data.document_attention import DOCUMENTS
from dflash_ops.data.examples import Example, collate
from dflash_ops.data.target import load_target, step_features, target_document_states, target_hidden_states

# Ragged, and each at least 16 tokens: below that MKL's matrix product may pick another kernel for a
# document alone than for the same rows inside a longer product (measured: 1 row at H 32, up to 15
# rows at H 4096), which changes the document-alone reference, not the packed capture.
LENGTHS = [40, 17, 23, 31]


def examples(lengths=LENGTHS, seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    return [Example(torch.randint(0, 120, (n,), generator=g), torch.randint(0, 2, (n,), generator=g))
            for n in lengths]


def alone(target, batch: list[Example], layer_ids: list[int]) -> torch.Tensor:
    """Each document captured as a batch of its own (today's capture, no padding in it)."""
    return torch.cat([target_hidden_states(target, e.input_ids[None], torch.ones_like(e.input_ids)[None],
                                           layer_ids).features for e in batch])


def layer_tokens(target) -> tuple[list[int], object]:
    """The token count of every forward the first decoder layer sees, and the hook's handle."""
    counts: list[int] = []
    handle = target.base_model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: counts.append(int((args[0] if args else kwargs["hidden_states"])
                                                       .shape[:-1].numel())), with_kwargs=True)
    return counts, handle


@pytest.mark.parametrize("rows_per_pass", [None, 1, 3])
def test_the_captures_forward_computes_no_padding_token(make_target, rows_per_pass):
    target = load_target(make_target(num_hidden_layers=4))
    batch = examples()
    counts, handle = layer_tokens(target)
    try:
        step_features(target, batch, [1, 2], rows_per_pass, torch.device("cpu"))
    finally:
        handle.remove()
    assert sum(counts) == sum(LENGTHS)  # the padded batch: 4 x 40 = 160 tokens
    assert len(counts) == -(-len(LENGTHS) // (rows_per_pass or len(LENGTHS)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("layer_ids", "rows_per_pass"), [([1, 3], None), ([0, 2, 5], None), ([4, 4, 1], 2),
                                                          ([1, 5], 1)])
def test_packed_features_are_bit_equal_to_each_document_captured_alone(make_target, dtype, layer_ids,
                                                                       rows_per_pass):
    # Layer 5 is the last of 6: transformers reports it after the final norm, and so does the capture.
    target = load_target(make_target(num_hidden_layers=6), dtype)
    batch = examples()
    got = step_features(target, batch, layer_ids, rows_per_pass, torch.device("cpu"))
    assert got["features"].dtype == getattr(torch, dtype)
    assert torch.equal(got["features"], alone(target, batch, layer_ids))
    # The rest is what a drafter received before, from the padded batch.
    padded = collate(batch)
    before = target_hidden_states(target, padded["input_ids"], padded["attention_mask"], layer_ids)
    assert torch.equal(got["cu_seqlens"], before.cu_seqlens) and got["cu_seqlens"].dtype == torch.int32
    assert torch.equal(got["position_ids"], before.position_ids)
    assert torch.equal(got["input_ids"], before.pack(padded["input_ids"]))
    assert torch.equal(got["loss_mask"], before.pack(padded["loss_mask"]))
    assert target.config._attn_implementation == "sdpa"  # the packed pass's attention is put back


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_features_match_the_padded_batch_to_a_few_units_of_rounding(make_target, dtype):
    # Not bit-equal: the padded attention of a shorter row reduces over the batch's longest row (its
    # masked keys included), so a padded document's features depend on its batch-mates' lengths.
    target = load_target(make_target(num_hidden_layers=6), dtype)
    batch = examples()
    padded = collate(batch)
    before = target_hidden_states(target, padded["input_ids"], padded["attention_mask"], [0, 2, 5]).features
    got = step_features(target, batch, [0, 2, 5], None, torch.device("cpu"))["features"]
    eps = torch.finfo(getattr(torch, dtype)).eps
    assert not torch.equal(got[40:], before[40:])
    assert torch.equal(got[:40], before[:40])  # the longest row has no padding: same reduction
    worst = (got.float() - before.float()).abs().max()
    assert worst <= 8 * eps * before.float().abs().max()


def test_a_target_that_cannot_pack_runs_the_padded_batch(make_target):
    target = load_target(make_target(num_hidden_layers=4))
    target.set_attn_implementation("eager")
    batch = examples()
    counts, handle = layer_tokens(target)
    try:
        got = step_features(target, batch, [1, 3], None, torch.device("cpu"))
    finally:
        handle.remove()
    padded = collate(batch)
    assert counts == [len(LENGTHS) * max(LENGTHS)]
    expected = target_hidden_states(target, padded["input_ids"], padded["attention_mask"], [1, 3])
    assert torch.equal(got["features"], expected.features)
    assert target.config._attn_implementation == "eager"


def test_a_failed_pass_puts_the_attention_back_and_empty_documents_are_kept(make_target):
    target = load_target(make_target(num_hidden_layers=4))
    batch = examples([12, 0, 20])
    ids = torch.cat([e.input_ids for e in batch])
    got = target_document_states(target, ids, [12, 0, 20], [1])
    assert got.cu_seqlens.tolist() == [0, 12, 12, 32] and got.features.shape == (32, 32)
    assert torch.equal(got.features, alone(target, [batch[0], batch[2]], [1]))

    def fail(module, args, output):
        assert target.config._attn_implementation == DOCUMENTS
        raise RuntimeError("a layer failed")

    handle = target.base_model.layers[0].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="a layer failed"):
        target_document_states(target, ids, [12, 0, 20], [1])
    handle.remove()
    assert target.config._attn_implementation == "sdpa"
    assert not target.base_model.layers[1]._forward_hooks  # the capture's hook is gone too
    with pytest.raises(ValueError, match="documents of 31 tokens in all, input_ids has 32"):
        target_document_states(target, ids, [12, 0, 19], [1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_capture_on_cuda_computes_no_padding_and_matches_each_document_alone(make_target, dtype):
    # cuBLAS may pick another kernel for a document's rows alone than inside the packed row, and the
    # flash kernel's tiles differ with the length: equal to a few units of rounding, not bit for bit.
    target = load_target(make_target(num_hidden_layers=6), dtype, "cuda")
    batch = [Example(e.input_ids.cuda(), e.loss_mask.cuda()) for e in examples()]
    counts, handle = layer_tokens(target)
    try:
        got = step_features(target, batch, [0, 2, 5], None, torch.device("cuda"))["features"]
    finally:
        handle.remove()
    assert sum(counts) == sum(LENGTHS)
    reference = alone(target, batch, [0, 2, 5]).float()
    eps = torch.finfo(getattr(torch, dtype)).eps
    assert (got.float() - reference).abs().max() <= 8 * eps * reference.abs().max()

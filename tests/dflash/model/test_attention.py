"""Block-sparse attention: equal to SDPA with the dense block mask, in fp32 and bf16, with and without
a sliding window (whose dense mask is transformers' own sliding window, counted in positions)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_ops.model.attention import BlockSparseMask
from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig, sliding_window_mask
from dflash_ops.model.loss import build_block_attention_mask

BLOCK = 4
# Three documents; anchors sorted in each, one at 0 (a block that sees no context at all).
LENGTHS = [20, 9, 14]
ANCHORS = [[0, 3, 5, 9, 12, 16], [2, 4], [1, 6, 7, 10]]
TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Gradients here are up to ~13; where the true one is 0 (q and k of a query that sees only itself),
# either side's rounding leaves up to ~5e-6.
GRAD_TOLERANCE = {**TOLERANCE, torch.float32: dict(atol=1e-5, rtol=1e-5)}


# Windows below the block size, equal to it, inside the documents, equal to the longest one, past it.
WINDOWS = [1, 3, BLOCK, 9, max(LENGTHS), max(LENGTHS) + 1, 1000]


def layout(window: int | None = None, lengths=LENGTHS, anchors=ANCHORS):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    context_doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    context_pos = torch.cat([torch.arange(n) for n in lengths])
    block_doc = torch.cat([torch.full((len(a),), d) for d, a in enumerate(anchors)])
    block_anchor = torch.tensor([a for per_doc in anchors for a in per_doc])
    dense = build_block_attention_mask(context_doc, context_pos, block_doc, block_anchor, BLOCK, window)
    return cu_seqlens, block_doc, block_anchor, dense


def assert_sparse_equals_dense(sparse: BlockSparseMask, dense: torch.Tensor, dtype=torch.float32) -> None:
    """Forward and the gradients of q, k and v."""
    n_q, n_kv = dense.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 8, generator=g).to(dtype).requires_grad_()
               for heads, n in ((4, n_q), (2, n_kv), (2, n_kv)))
    out_dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    grads_dense = torch.autograd.grad(out_dense.float().square().sum(), (q, k, v))
    out_sparse = sparse.attend(q, k, v, enable_gqa=True)
    grads_sparse = torch.autograd.grad(out_sparse.float().square().sum(), (q, k, v))
    assert out_sparse.dtype == dtype
    torch.testing.assert_close(out_sparse, out_dense, **TOLERANCE[dtype])
    for ours, reference in zip(grads_sparse, grads_dense, strict=True):
        torch.testing.assert_close(ours, reference, **GRAD_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile_queries", [4, 8, 128])
def test_sparse_attention_equals_the_dense_mask_forward_and_backward(dtype, tile_queries):
    cu_seqlens, block_doc, block_anchor, dense = layout()
    sparse = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, tile_queries)
    assert len(sparse.tiles) >= len(LENGTHS)
    assert_sparse_equals_dense(sparse, dense, dtype)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("tile_queries", [4, 8, 128])
def test_sliding_window_attention_equals_its_dense_mask_forward_and_backward(window, tile_queries):
    cu_seqlens, block_doc, block_anchor, dense = layout(window)
    full = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, tile_queries)
    assert_sparse_equals_dense(full.with_window(window), dense)
    if window >= max(LENGTHS) + BLOCK:  # past every document: the full context, a causal block
        full_dense, n_context = layout()[3], sum(LENGTHS)
        assert torch.equal(dense[:, :n_context], full_dense[:, :n_context])
        assert torch.equal(dense[:, n_context:], full_dense[:, n_context:].tril())


@pytest.mark.parametrize("window", [3, 9])
def test_sliding_window_attention_in_bf16(window):
    cu_seqlens, block_doc, block_anchor, dense = layout(window)
    sparse = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, 8, window=window)
    assert_sparse_equals_dense(sparse, dense, torch.bfloat16)


def test_the_window_is_transformers_sliding_window_counted_from_the_query_itself():
    from transformers.masking_utils import sliding_window_causal_mask_function

    window, anchor, length = 3, 10, 20
    _, _, _, full = layout(None, [length], [[anchor]])
    _, _, _, dense = layout(window, [length], [[anchor]])
    positions = torch.cat([torch.arange(length), anchor + torch.arange(BLOCK)])
    queries = positions[length:]
    hugging_face = sliding_window_causal_mask_function(window)(0, 0, queries[:, None], positions[None, :])
    assert torch.equal(dense, full & hugging_face)
    assert torch.equal(sliding_window_mask(queries, positions, window), hugging_face)
    seen = [(row[:length].nonzero().flatten().tolist(), (row[length:].nonzero().flatten()).tolist())
            for row in dense]
    # (context positions, block offsets) per block offset: the anchor's query sees W - 1 context
    # tokens, and inside the block attention is causal, W wide.
    assert seen == [([8, 9], [0]), ([9], [0, 1]), ([], [0, 1, 2]), ([], [1, 2, 3])]


def test_a_sliding_windows_tiles_follow_the_window_not_the_document():
    window, tile_queries = 16, 32
    lengths, anchors = [400, 30], [list(range(3, 390, 7)), [0, 5, 20]]
    cu_seqlens, block_doc, block_anchor, dense = layout(window, lengths, anchors)
    full = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, tile_queries)
    sliding = full.with_window(window)
    assert max(end - start for _, _, start, end in sliding.tiles) <= window + tile_queries
    rows = sum((last - first) * (end - start) for first, last, start, end in sliding.tiles)
    full_rows = sum((last - first) * (end - start) for first, last, start, end in full.tiles)
    assert rows * 5 < full_rows
    assert_sparse_equals_dense(sliding, dense)


@pytest.mark.parametrize("window", [None, 3, 9])
def test_a_key_outside_the_allowed_ranges_never_reaches_a_query(window):
    cu_seqlens, block_doc, block_anchor, dense = layout(window)
    sparse = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, tile_queries=8,
                                         window=window)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, dense.shape[0], 8, generator=g)
    k = torch.randn(1, 2, dense.shape[1], 8, generator=g)
    v = torch.randn(1, 2, dense.shape[1], 8, generator=g, requires_grad=True)
    out = sparse.attend(q, k, v, enable_gqa=False)
    for query in (0, 5, 30, dense.shape[0] - 1):
        (grad,) = torch.autograd.grad(out[0, :, query].sum(), v, retain_graph=True)
        reached = grad[0].abs().sum(dim=(0, 2)) > 0
        assert torch.equal(reached, dense[query]), query


LAYERS = [(["full_attention", "full_attention"], None), (["sliding_attention", "full_attention"], 5),
          (["full_attention", "sliding_attention"], 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("layer_types", "window"), LAYERS)
def test_the_drafter_gives_the_same_blocks_and_gradients_with_either_mask(dtype, layer_types, window):
    cu_seqlens, block_doc, block_anchor, dense = layout()
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=4, num_layers=2, num_target_features=2, block_size=BLOCK, mask_token_id=49,
                        vocab_size=50, layer_types=layer_types, sliding_window=window)
    drafter = DFlashDrafter(cfg, torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False))
    features = torch.randn(sum(LENGTHS), 32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    block_ids = torch.randint(0, 49, (dense.shape[0],))
    block_positions = (block_anchor[:, None] + torch.arange(BLOCK)).reshape(-1)
    sparse = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, tile_queries=8)
    weights = [p for p in drafter.parameters() if p.requires_grad]
    results = []
    for mask in (sparse, dense):  # the drafter narrows either to each sliding layer's window
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            hidden = drafter(features, positions, block_ids, block_positions, mask)
        results.append((hidden, torch.autograd.grad(hidden.float().square().sum(), weights)))
    (ours, our_grads), (reference, reference_grads) = results
    torch.testing.assert_close(ours, reference, **TOLERANCE[dtype])
    if dtype == torch.float32:
        for got, want in zip(our_grads, reference_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    if window is not None:  # the window changes what the blocks see
        full = DFlashDrafter(DrafterConfig(**{**cfg.__dict__, "layer_types": None, "sliding_window": None}),
                             drafter.embed_tokens, drafter.lm_head)
        full.load_trainable_state_dict(drafter.trainable_state_dict())
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            assert not torch.allclose(full(features, positions, block_ids, block_positions, sparse), ours)

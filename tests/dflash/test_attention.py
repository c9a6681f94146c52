"""Block-sparse attention: equal to SDPA with the dense block mask, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.attention import BlockSparseMask
from dflash.loss import build_block_attention_mask
from dflash.model import DFlashDrafter, DrafterConfig

BLOCK = 4
# Three documents; anchors sorted in each, one at 0 (a block that sees no context at all).
LENGTHS = [20, 9, 14]
ANCHORS = [[0, 3, 5, 9, 12, 16], [2, 4], [1, 6, 7, 10]]
TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def layout():
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    context_doc = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    context_pos = torch.cat([torch.arange(n) for n in LENGTHS])
    block_doc = torch.cat([torch.full((len(a),), d) for d, a in enumerate(ANCHORS)])
    block_anchor = torch.tensor([a for anchors in ANCHORS for a in anchors])
    dense = build_block_attention_mask(context_doc, context_pos, block_doc, block_anchor, BLOCK)
    return cu_seqlens, block_doc, block_anchor, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile_queries", [4, 8, 128])
def test_sparse_attention_equals_the_dense_mask_forward_and_backward(dtype, tile_queries):
    cu_seqlens, block_doc, block_anchor, dense = layout()
    sparse = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, tile_queries)
    assert len(sparse.tiles) >= len(LENGTHS)
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
        torch.testing.assert_close(ours, reference, **TOLERANCE[dtype])


def test_a_key_outside_the_allowed_ranges_never_reaches_a_query():
    cu_seqlens, block_doc, block_anchor, dense = layout()
    sparse = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, tile_queries=8)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, dense.shape[0], 8, generator=g)
    k = torch.randn(1, 2, dense.shape[1], 8, generator=g)
    v = torch.randn(1, 2, dense.shape[1], 8, generator=g, requires_grad=True)
    out = sparse.attend(q, k, v, enable_gqa=False)
    for query in (0, 5, 30, dense.shape[0] - 1):
        (grad,) = torch.autograd.grad(out[0, :, query].sum(), v, retain_graph=True)
        reached = grad[0].abs().sum(dim=(0, 2)) > 0
        assert torch.equal(reached, dense[query]), query


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_drafter_gives_the_same_blocks_with_either_mask(dtype):
    cu_seqlens, block_doc, block_anchor, dense = layout()
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=4, num_layers=2, num_target_features=2, block_size=BLOCK, mask_token_id=49,
                        vocab_size=50)
    drafter = DFlashDrafter(cfg, torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False))
    features = torch.randn(sum(LENGTHS), 32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    block_ids = torch.randint(0, 49, (dense.shape[0],))
    block_positions = (block_anchor[:, None] + torch.arange(BLOCK)).reshape(-1)
    sparse = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, tile_queries=8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ours = drafter(features, positions, block_ids, block_positions, sparse)
        reference = drafter(features, positions, block_ids, block_positions, dense)
    torch.testing.assert_close(ours, reference, **TOLERANCE[dtype])

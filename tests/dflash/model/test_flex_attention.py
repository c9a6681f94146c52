"""FlexAttention's block pattern (`dflash_ops.model.flex`): equal to SDPA with the dense block mask and to the
tiles (`BlockSparseMask`), forward and gradients, full and sliding, ragged documents, padded shapes, a
group with no block; the mask itself equal to the dense one entry by entry.

torch refuses FlexAttention's backward on CPU (`_validate_device`), yet its eager path has one: the
dense reference backward of the same `BlockMask` and `mask_mod`. `cpu_backward` lets the CPU tests
run it, so that the gradients of the padding, the GQA and the mask's partial tiles are pinned here;
the fused CUDA kernels are pinned by the `gpu` tests (`pytest -m gpu`, the GPU check)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_ops.model.attention import BlockSparseMask
from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig
from dflash_ops.model.flex import FlexBlockMask, choose_attention, padded_rows
from dflash_ops.model.loss import build_block_attention_mask

BLOCK = 4
# Three documents, the middle one without a block (ragged); anchors sorted, one at 0 (no context).
LENGTHS = [20, 7, 9, 14]
ANCHORS = [[0, 3, 5, 9, 12, 16], [], [2, 4], [1, 6, 7, 10]]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# The fused kernels sum in another order than the math reference (and SDPA's own CUDA kernels).
GPU_TOLERANCE = {**TOLERANCE, torch.float32: dict(atol=1e-4, rtol=1e-4)}
WINDOWS = [None, 1, 3, BLOCK, 9, max(LENGTHS) + BLOCK, 1000]
CUDA = torch.cuda.is_available()


@pytest.fixture
def cpu_backward(monkeypatch):
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)


def layout(window=None, lengths=LENGTHS, anchors=ANCHORS, device="cpu"):
    """(context_doc, context_pos, block_doc, block_anchor, cu_seqlens, dense mask)."""
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    context_doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    context_pos = torch.cat([torch.arange(n) for n in lengths])
    block_doc = torch.cat([torch.full((len(a),), d) for d, a in enumerate(anchors)])
    block_anchor = torch.tensor([a for per_doc in anchors for a in per_doc], dtype=torch.int64)
    dense = build_block_attention_mask(context_doc, context_pos, block_doc, block_anchor, BLOCK, window)
    on = [t.to(device) for t in (context_doc, context_pos, block_doc, block_anchor)]
    return (*on, cu_seqlens, dense.to(device))


def flex_mask(window=None, lengths=LENGTHS, anchors=ANCHORS, device="cpu", **padding) -> FlexBlockMask:
    context_doc, context_pos, block_doc, block_anchor, _, _ = layout(None, lengths, anchors, device)
    mask = FlexBlockMask.from_blocks(context_doc, context_pos, block_doc, block_anchor, BLOCK,
                                     compiled=device == "cuda", **padding)
    return mask if window is None else mask.with_window(window)


def attend_with_grads(attend, n_q: int, n_kv: int, dtype, device="cpu", rounded_to=None):
    """`attend`'s output and q, k, v gradients on random inputs in `dtype` (first rounded to `rounded_to`)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 16, generator=g).to(rounded_to or dtype).to(device, dtype)
               for heads, n in ((4, n_q), (2, n_kv), (2, n_kv)))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attend(q, k, v)
    return out, torch.autograd.grad(out.float().square().sum(), (q, k, v))


def assert_attention_equal(ours, reference, dtype, tolerance=TOLERANCE):
    (out, grads), (want, want_grads) = ours, reference
    assert out.dtype == want.dtype == dtype
    torch.testing.assert_close(out, want, **tolerance[dtype])
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, **tolerance[dtype])


def attention_results(window, dtype, rounded_to=None, device="cpu") -> dict:
    """(output, gradients of q, k, v) of the dense mask, the tiles and flex."""
    context_doc, context_pos, block_doc, block_anchor, cu_seqlens, dense = layout(window, device=device)
    n_q, n_kv = dense.shape
    tiles = BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, BLOCK, tile_queries=8,
                                        window=window)
    padding = {"context_rows": 256, "query_rows": 256} if device == "cuda" else {}
    flex = flex_mask(window, device=device, **padding)
    attend = {"dense": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense,
                                                                      enable_gqa=True),
              "tiles": lambda q, k, v: tiles.attend(q, k, v, enable_gqa=True),
              "flex": lambda q, k, v: flex.attend(q, k, v, enable_gqa=True)}
    return {name: attend_with_grads(fn, n_q, n_kv, dtype, device, rounded_to)
            for name, fn in attend.items()}


def assert_bf16_as_close_to_the_truth_as_sdpa(window, device="cpu", factor=2.5):
    """bf16 outputs within the tolerance the tile tests pin; gradients (bf16-rounded sums over up to a
    few dozen keys) no further from fp32 on the same inputs than `factor` times SDPA's own bf16
    gradients (on CPU flex runs its unfused reference backward, measured at up to ~2x SDPA's error)."""
    truth = attention_results(window, torch.float32, torch.bfloat16, device)["dense"]
    results = attention_results(window, torch.bfloat16, device=device)
    torch.testing.assert_close(results["flex"][0], results["dense"][0], **TOLERANCE[torch.bfloat16])
    for i, want in enumerate(truth[1]):
        sdpa_error = max((results[name][1][i].float() - want).abs().max() for name in ("dense", "tiles"))
        assert (results["flex"][1][i].float() - want).abs().max() <= factor * sdpa_error, i


@pytest.mark.parametrize("window", WINDOWS)
def test_the_mask_mod_is_the_dense_block_mask_entry_by_entry(window):
    from torch.nn.attention.flex_attention import create_mask

    *_, dense = layout(window)
    mask = flex_mask(window, context_rows=200)
    rows = mask.context_rows + mask.query_rows
    full = create_mask(mask.mask_mod(), None, None, mask.query_rows, rows)[0, 0]
    n_q, n_context = dense.shape[0], sum(LENGTHS)
    assert torch.equal(full[:n_q, :n_context], dense[:, :n_context])
    assert torch.equal(full[:n_q, mask.context_rows: mask.context_rows + n_q], dense[:, n_context:])
    # No real query sees a padding key; a padding query sees only its own padding block.
    assert not full[:n_q, n_context: mask.context_rows].any()
    assert not full[:n_q, mask.context_rows + n_q:].any()
    assert not full[n_q:, :mask.context_rows + n_q].any()


@pytest.mark.parametrize("window", WINDOWS)
def test_flex_equals_the_dense_mask_and_the_tiles_forward_and_backward(cpu_backward, window):
    results = attention_results(window, torch.float32)
    assert_attention_equal(results["flex"], results["dense"], torch.float32)
    assert_attention_equal(results["flex"], results["tiles"], torch.float32)


@pytest.mark.parametrize("window", [None, 3, 9])
def test_flex_in_bf16_is_as_close_to_the_truth_as_sdpa_in_bf16(cpu_backward, window):
    assert_bf16_as_close_to_the_truth_as_sdpa(window)


@pytest.mark.parametrize("window", [None, 3])
def test_padding_to_a_fixed_shape_changes_nothing(cpu_backward, window):
    *_, dense = layout(window)
    n_q, n_kv = dense.shape
    results = [attend_with_grads(lambda q, k, v, m=mask: m.attend(q, k, v, enable_gqa=True), n_q, n_kv,
                                 torch.float32)
               for mask in (flex_mask(window), flex_mask(window, context_rows=300, query_rows=256))]
    assert results[1][0].shape == results[0][0].shape == (1, 4, n_q, 16)
    assert_attention_equal(results[1], results[0], torch.float32)


def test_a_group_without_blocks_gives_no_rows_and_zero_gradients(cpu_backward):
    mask = flex_mask(None, [12, 5], [[], []])
    out, grads = attend_with_grads(lambda q, k, v: mask.attend(q, k, v, enable_gqa=True), 0, 17,
                                   torch.float32)
    assert out.shape == (1, 4, 0, 16)
    assert all(g is not None and not g.any() for g in grads)


def test_padded_shapes_are_whole_tiles_and_at_least_what_was_asked():
    assert [padded_rows(n) for n in (0, 1, 128, 129)] == [128, 128, 128, 256]
    assert padded_rows(100, at_least=3072) == 3072 and padded_rows(5000, at_least=3072) == 5120
    mask = flex_mask(None, context_rows=3072, query_rows=8192)
    assert (mask.context_rows, mask.query_rows) == (3072, 8192)


def test_the_backend_is_flex_on_cuda_and_the_tiles_where_flex_cannot_train():
    cpu = choose_attention("auto", torch.device("cpu"))
    assert (cpu.backend, cpu.compiled) == ("tiles", False) and "backward" in cpu.reason
    assert choose_attention("tiles", torch.device("cuda")).backend == "tiles"
    cuda = choose_attention("auto", torch.device("cuda"))
    assert (cuda.backend, cuda.compiled) == ("flex", True)
    with pytest.raises(ValueError, match="cannot train here"):
        choose_attention("flex", torch.device("cpu"))
    with pytest.raises(ValueError, match="expected one of"):
        choose_attention("dense", torch.device("cpu"))


LAYERS = [(["full_attention", "full_attention"], None), (["sliding_attention", "full_attention"], 5),
          (["full_attention", "sliding_attention"], 2)]


def drafter_results(layer_types, window, masks, dtype, device="cpu"):
    """Per mask: the drafter's hidden states and every trainable weight's gradient."""
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_layers=2, num_target_features=2, block_size=BLOCK, mask_token_id=49,
                        vocab_size=50, layer_types=layer_types, sliding_window=window)
    drafter = DFlashDrafter(cfg, torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50, bias=False)).to(device)
    block_anchor = layout()[3]
    features = torch.randn(sum(LENGTHS), 64).to(device)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).to(device)
    block_ids = torch.randint(0, 49, (block_anchor.numel() * BLOCK,)).to(device)
    block_positions = (block_anchor[:, None] + torch.arange(BLOCK)).reshape(-1).to(device)
    weights = [p for p in drafter.parameters() if p.requires_grad]
    results = []
    for mask in masks:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            hidden = drafter(features, positions, block_ids, block_positions, mask)
        results.append((hidden, torch.autograd.grad(hidden.float().square().sum(), weights)))
    return results


@pytest.mark.parametrize(("layer_types", "window"), LAYERS)
def test_the_drafter_gives_the_same_blocks_and_gradients_with_flex(cpu_backward, layer_types, window):
    *_, dense = layout()
    (ours, our_grads), (reference, reference_grads) = drafter_results(
        layer_types, window, [flex_mask(), dense], torch.float32)
    torch.testing.assert_close(ours, reference, atol=2e-6, rtol=1e-5)
    for got, want in zip(our_grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 3, 9])
def test_compiled_flex_on_cuda_equals_the_dense_mask_forward_and_backward(window):
    results = attention_results(window, torch.float32, device="cuda")
    assert_attention_equal(results["flex"], results["dense"], torch.float32, GPU_TOLERANCE)
    assert_bf16_as_close_to_the_truth_as_sdpa(window, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("layer_types", "window"), LAYERS)
def test_the_drafter_on_cuda_gives_the_same_blocks_and_gradients_with_compiled_flex(layer_types, window):
    *_, dense = layout(device="cuda")
    (ours, our_grads), (reference, reference_grads) = drafter_results(
        layer_types, window, [flex_mask(device="cuda"), dense], torch.float32, "cuda")
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    for got, want in zip(our_grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)

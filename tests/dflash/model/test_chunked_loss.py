"""The chunked lm_head + cross entropy (`chunked_head_loss`) against the unchunked path it replaces."""

from __future__ import annotations

import pytest
import torch

from benchmarks.memory import peak_allocated_bytes
from dflash_ops.core.config import DEFAULT_LOSS_CHUNK_SIZE, ConfigError, config_from_dict
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.model.loss import build_block_batch, chunked_head_loss, count_correct_by_position, dflash_loss
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, compute_precision, scored_loss

# bf16 runs the head in bf16 on both paths; what differs is the order of float32 sums.
TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-7), "bfloat16": dict(rtol=1e-3, atol=1e-6)}


def _rows(n: int, hidden: int, vocab: int, block_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    weights = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.2)
    offsets = torch.randint(1, block_size, (n,), generator=g)
    return h, labels, weights, offsets


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunked_head_loss_equals_the_unchunked_loss_gradient_and_counts(dtype, chunk_size):
    torch.manual_seed(0)
    vocab, block_size = 97, 8
    head = torch.nn.Linear(16, vocab, bias=False).to(getattr(torch, dtype)).requires_grad_(False)
    h, labels, weights, offsets = _rows(64, 16, vocab, block_size)
    # Near-ties in bf16 logits must not decide the counts: make the label the argmax on some rows.
    labels[::3] = head(h[::3].to(head.weight.dtype)).argmax(-1)
    hidden = h.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        logits = head(hidden.to(head.weight.dtype))
        reference = dflash_loss(logits, labels, weights, normalizer=40.0)
    reference_grad, = torch.autograd.grad(reference, hidden)
    want_hits, want_counts = count_correct_by_position(logits, labels, weights, offsets, block_size)

    hidden = h.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        loss, hits, counts = chunked_head_loss(hidden, head, labels, weights, offsets, block_size, chunk_size,
                                               normalizer=40.0)
    (2.0 * loss).backward()  # the upstream gradient must scale the stored one
    torch.testing.assert_close(loss, reference, **TOLERANCE[dtype])
    torch.testing.assert_close(hidden.grad, 2.0 * reference_grad, **TOLERANCE[dtype])
    assert (hits, counts) == (want_hits, want_counts)
    assert sum(hits) > 0


def test_chunked_head_loss_without_grad_and_with_nothing_scored():
    head = torch.nn.Linear(8, 11, bias=False).requires_grad_(False)
    h, labels, _, offsets = _rows(5, 8, 11, 4)
    with torch.no_grad():
        loss, hits, counts = chunked_head_loss(h, head, labels, torch.zeros(5), offsets, 4, 2)
    assert loss.item() == 0.0 and sum(hits) == sum(counts) == 0
    with pytest.raises(ValueError, match="frozen lm_head"):
        chunked_head_loss(h, torch.nn.Linear(8, 11, bias=False), labels, torch.ones(5), offsets, 4, 2)


def test_chunked_head_loss_never_holds_the_whole_logits():
    vocab, n, chunk = 4096, 512, 32
    head = torch.nn.Linear(64, vocab, bias=False).requires_grad_(False)
    h, labels, weights, offsets = _rows(n, 64, vocab, 16)

    def step(chunk_size):
        hidden = h.clone().requires_grad_()
        if chunk_size is None:
            loss = dflash_loss(head(hidden), labels, weights)
        else:
            loss = chunked_head_loss(hidden, head, labels, weights, offsets, 16, chunk_size)[0]
        loss.backward()

    _, unchunked = peak_allocated_bytes(lambda: step(None))
    _, chunked = peak_allocated_bytes(lambda: step(chunk))
    whole_logits = n * vocab * 4
    assert unchunked >= whole_logits
    assert chunked < whole_logits / 4, (chunked, unchunked)


def _drafter_and_batch(tiny_target, tiny_config, tmp_path, dtype: str):
    cfg = config_from_dict(tiny_config(tmp_path, model={"dtype": dtype}))
    target = load_target(tiny_target, dtype)
    torch.manual_seed(0)
    drafter = build_drafter(cfg, TargetHead.of(target))
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 100, (2, 40), generator=g)
    packed = target_hidden_states(target, input_ids, torch.ones_like(input_ids), [2])
    tokens = packed.pack(input_ids)
    loss_mask = torch.ones_like(tokens)
    anchors = [torch.arange(0, 36, 3), torch.arange(1, 37, 2)]
    batch = build_block_batch(tokens, loss_mask, packed.cu_seqlens, packed.position_ids, anchors,
                              drafter.cfg.block_size, drafter.cfg.mask_token_id, gamma=7.0)
    return cfg, drafter, packed, batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_scored_loss_gives_the_unchunked_loss_and_every_trainable_gradient(
        tiny_target, tiny_config, tmp_path, dtype):
    cfg, drafter, packed, batch = _drafter_and_batch(tiny_target, tiny_config, tmp_path, dtype)
    params = {name: p for name, p in drafter.named_parameters() if p.requires_grad}
    results = {}
    for chunk_size in (None, 5):
        with compute_precision(cfg, torch.device("cpu")):
            hidden = drafter(packed.features, packed.position_ids, batch.block_input_ids,
                             batch.block_positions, batch.sparse_mask)
            loss, hits, counts = scored_loss(drafter, hidden, batch, batch.weights.sum() * 1.5, chunk_size)
        grads = torch.autograd.grad(loss, list(params.values()))
        results[chunk_size] = loss.detach(), dict(zip(params, grads, strict=True)), hits, counts
    (ref_loss, ref_grads, ref_hits, ref_counts), (loss, grads, hits, counts) = results[None], results[5]
    torch.testing.assert_close(loss, ref_loss, **TOLERANCE[dtype])
    assert len(grads) == len(params) > 4
    for name, grad in grads.items():
        assert ref_grads[name].abs().sum() > 0, name
        # bf16: the head's gradient is rounded per row alike, the layers' matmuls then differ only
        # by the rows' summation order.
        torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE[dtype], msg=name)
    assert torch.equal(counts, ref_counts) and int(counts.sum()) == int((batch.weights > 0).sum())
    assert torch.equal(hits, ref_hits)


def test_train_steps_chunked_and_unchunked_agree(tiny_target, tiny_config, tmp_path):
    target = load_target(tiny_target, "float32")
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 100, (3, 32), generator=g)
    packed = target_hidden_states(target, input_ids, torch.ones_like(input_ids), [2])
    runs = {}
    for chunk_size in (None, 3):
        cfg = config_from_dict(tiny_config(tmp_path, model={"loss_chunk_size": chunk_size}))
        torch.manual_seed(0)
        trainer = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
        steps = [trainer.train_step(packed.features, packed.cu_seqlens, packed.position_ids,
                                    packed.pack(input_ids), torch.ones(96, dtype=torch.int64))
                 for _ in range(3)]
        runs[chunk_size] = steps, trainer.drafter.trainable_state_dict()
    (ref_steps, ref_weights), (steps, weights) = runs[None], runs[3]
    for ref, got in zip(ref_steps, steps, strict=True):
        assert got.loss == pytest.approx(ref.loss, rel=1e-5)
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-4)
        assert (got.position_hits, got.position_counts) == (ref.position_hits, ref.position_counts)
    # AdamW's first steps move an element by about lr (3e-3) whatever its gradient's size, so an
    # element whose gradient is near AdamW's eps moves by a float-rounding-sized difference x lr/eps.
    for name, value in weights.items():
        torch.testing.assert_close(value, ref_weights[name], rtol=0, atol=1e-4, msg=name)


def test_loss_chunk_size_defaults_to_chunked_and_is_validated(tiny_config, tmp_path):
    raw = tiny_config(tmp_path)
    assert "loss_chunk_size" not in raw["model"]  # a config written before the key still loads
    assert config_from_dict(raw).model.loss_chunk_size == DEFAULT_LOSS_CHUNK_SIZE
    unchunked = config_from_dict(tiny_config(tmp_path, model={"loss_chunk_size": None}))
    assert unchunked.model.loss_chunk_size is None
    with pytest.raises(ConfigError, match=r"model\.loss_chunk_size: must be >= 1"):
        config_from_dict(tiny_config(tmp_path, model={"loss_chunk_size": 0}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_head_loss_equals_the_unchunked_loss_on_cuda_in_bf16():
    torch.manual_seed(0)
    vocab, block_size = 50_000, 16
    head = torch.nn.Linear(256, vocab, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    h, labels, weights, offsets = (t.cuda() for t in _rows(600, 256, vocab, block_size))
    results = []
    for chunk_size in (None, 128):
        hidden = h.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if chunk_size is None:
                loss = dflash_loss(head(hidden.to(torch.bfloat16)), labels, weights)
            else:
                loss = chunked_head_loss(hidden, head, labels, weights, offsets, block_size, chunk_size)[0]
        loss.backward()
        results.append((loss.detach(), hidden.grad))
    (ref_loss, ref_grad), (loss, grad) = results
    torch.testing.assert_close(loss, ref_loss, **TOLERANCE["bfloat16"])
    torch.testing.assert_close(grad, ref_grad, **TOLERANCE["bfloat16"])

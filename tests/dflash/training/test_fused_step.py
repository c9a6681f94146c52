"""The drafter step's fused work: the layers' elementwise regions, the one-pass head loss, the weights cast
once a step, AdamW's fused kernel on CUDA. Eager, on CPU, each is the exact reference; compiled (CUDA, or
CPU with DFLASH_COMPILE_ON_CPU=1: Inductor's C++ kernels, minutes) each equals it within float32 rounding."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.model.drafter import EAGER, DFlashDrafter, DrafterConfig, DraftMLP, RMSNorm
from dflash_ops.model.loss import (
    chunked_head_loss,
    cross_entropy_chunk_loss,
    dflash_loss,
    fused_softmax_cross_entropy,
    softmax_cross_entropy,
)
from dflash_ops.training.trainer import (
    DrafterTrainer,
    adamw_implementation,
    build_drafter,
    compiled_regions_on,
    make_optimizer_and_scheduler,
)

CUDA = torch.cuda.is_available()
COMPILED_DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu,
                                                pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
                    pytest.param("cpu", marks=pytest.mark.skipif(
                        os.environ.get("DFLASH_COMPILE_ON_CPU") != "1",
                        reason="compiles with Inductor on CPU (minutes): DFLASH_COMPILE_ON_CPU=1"))]


class ParameterCasts(TorchDispatchMode):
    """Counts the casts (`aten._to_copy`) whose source is one of `params`' storage."""

    def __init__(self, params):
        super().__init__()
        self.storage = {p.untyped_storage().data_ptr(): name for name, p in params}
        self.casts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            name = self.storage.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.casts[name] = self.casts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_each_weight_is_cast_to_bf16_once_a_step_whatever_its_groups(tiny_target, tiny_config, tmp_path):
    # Three documents of 24 tokens with max_length 24: three groups, each its own forward and backward.
    cfg = config_from_dict(tiny_config(tmp_path, model={"dtype": "bfloat16"}, data={"max_length": 24}))
    target = load_target(tiny_target, "bfloat16")
    torch.manual_seed(0)
    trainer = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
    input_ids = torch.randint(0, 100, (3, 24), generator=torch.Generator().manual_seed(0))
    packed = target_hidden_states(target, input_ids, torch.ones_like(input_ids), [2])
    trainable = [(n, p) for n, p in trainer.drafter.named_parameters() if p.requires_grad]
    counter = ParameterCasts(trainable)
    with counter:
        result = trainer.train_step(packed.features, packed.cu_seqlens, packed.position_ids,
                                    packed.pack(input_ids), torch.ones(72, dtype=torch.int64))
    assert result.num_blocks > 0
    matmul_weights = {n for n, p in trainable if p.dim() == 2}
    assert set(counter.casts) == matmul_weights, "every matmul's fp32 weight is cast, and only they"
    assert set(counter.casts.values()) == {1}, f"cast more than once a step: {counter.casts}"


def test_adamw_runs_fused_on_cuda_and_foreach_elsewhere(tiny_config, tmp_path):
    on = {kind: adamw_implementation([SimpleNamespace(device=torch.device(kind))])
          for kind in ("cuda", "cpu")}
    assert on == {"cuda": {"fused": True}, "cpu": {"foreach": True}}
    cfg = config_from_dict(tiny_config(tmp_path))
    optimizer, _ = make_optimizer_and_scheduler([torch.nn.Parameter(torch.ones(3))], cfg.optim, 10)
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


def _drafter(layers: int = 2) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, num_layers=layers, num_target_features=3, block_size=4, mask_token_id=63,
                        vocab_size=64)
    return DFlashDrafter(cfg, torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))


def test_compiled_regions_are_chosen_on_cuda_only_and_reach_every_norm_and_mlp():
    assert compiled_regions_on(torch.device("cuda")) and not compiled_regions_on(torch.device("cpu"))
    assert cross_entropy_chunk_loss(True) is fused_softmax_cross_entropy
    assert cross_entropy_chunk_loss(False) is softmax_cross_entropy
    drafter = _drafter()
    holders = [m for m in drafter.modules() if isinstance(m, RMSNorm | DraftMLP)]
    assert len(holders) == 2 + 2 * (4 + 1) and all(m.regions is EAGER for m in holders)
    drafter.compile_regions(True)
    assert all(m.regions.compiled for m in holders)
    drafter.compile_regions(False)
    assert all(m.regions is EAGER for m in holders)


def _logits(rows: int, vocab: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(device)
    weights = (torch.rand(rows, generator=g) * (torch.rand(rows, generator=g) > 0.2)).to(device)
    return logits, labels, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunk_loss_writes_its_gradient_over_the_logits_in_their_dtype_equal_to_the_reference(dtype):
    logits, labels, weights = _logits(37, 301, dtype)
    reference_logits = logits.clone().requires_grad_()
    reference = dflash_loss(reference_logits, labels, weights, normalizer=20.0)
    reference.backward()
    storage = logits.data_ptr()
    row_losses, grad = softmax_cross_entropy(logits, labels, weights / 20.0)
    assert grad.dtype == dtype and grad.data_ptr() == storage, "the gradient is written over the logits"
    torch.testing.assert_close((weights * row_losses).sum() / 20.0, reference.detach(), rtol=1e-6, atol=1e-7)
    # The reference's backward rounds its float32 gradient into the logits' dtype as this one does.
    tolerance = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(grad, reference_logits.grad, **tolerance)
    ce, none = softmax_cross_entropy(reference_logits.detach(), labels, None)
    assert none is None
    torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(
        reference_logits.detach().float(), labels, reduction="none"), rtol=1e-6, atol=1e-6)


def test_the_head_loss_runs_the_chunk_loss_it_is_given():
    # A chunk loss other than the cross entropy (here half the squared logit of the label, weighted):
    # the head runs it per chunk and its gradient reaches the hidden states through the head.
    calls = []

    def half_square(logits, labels, scale):
        calls.append(logits.shape[0])
        picked = logits.gather(1, labels[:, None]).squeeze(1).float()
        if scale is None:
            return picked.square() / 2, None
        grad = torch.zeros_like(logits)
        grad.scatter_(1, labels[:, None], (picked * scale)[:, None].to(logits.dtype))
        return picked.square() / 2, grad

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    h, labels = torch.randn(23, 16, generator=g), torch.randint(0, 50, (23,), generator=g)
    weights, offsets = torch.rand(23, generator=g), torch.arange(23) % 4
    hidden = h.clone().requires_grad_()
    loss, _, _ = chunked_head_loss(hidden, head, labels, weights, offsets, 4, 10, normalizer=5.0,
                                   chunk_loss=half_square)
    loss.backward()
    assert calls == [10, 10, 3]
    reference_hidden = h.clone().requires_grad_()
    picked = head(reference_hidden).gather(1, labels[:, None]).squeeze(1)
    reference = (weights * picked.square() / 2).sum() / 5.0
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    torch.testing.assert_close(hidden.grad, reference_hidden.grad)


@pytest.mark.parametrize("device", COMPILED_DEVICES)
def test_the_compiled_one_pass_loss_equals_the_reference(device):
    for rows, seed in ((37, 0), (64, 1)):  # two row counts: one compilation (dynamic rows)
        logits, labels, weights = _logits(rows, 1001, torch.bfloat16, device, seed)
        want_loss, want_grad = softmax_cross_entropy(logits.clone(), labels, weights)
        got_loss, got_grad = fused_softmax_cross_entropy(logits, labels, weights)
        assert got_grad.dtype == torch.bfloat16 and got_grad.data_ptr() == logits.data_ptr()
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2, atol=1e-5)
        no_grad_loss, none = fused_softmax_cross_entropy(logits.clone(), labels, None)
        assert none is None


@pytest.mark.parametrize("device", COMPILED_DEVICES)
def test_compiled_regions_give_the_eager_drafters_blocks_and_gradients(device):
    def run(compiled: bool, n_context: int):
        drafter = _drafter().to(device)
        drafter.compile_regions(compiled)
        g = torch.Generator().manual_seed(n_context)
        features = torch.randn(n_context, 96, generator=g).to(device)
        block_ids = torch.randint(0, 63, (8,), generator=g).to(device)
        positions = torch.arange(n_context, device=device)
        block_positions = torch.arange(8, device=device) + 2
        with torch.autocast(device, dtype=torch.bfloat16):
            hidden = drafter(features, positions, block_ids, block_positions, None)
            loss = hidden.float().square().mean()
        loss.backward()
        return hidden.detach().float(), [p.grad for p in drafter.parameters() if p.requires_grad]

    graphs = []
    for n_context in (12, 20):  # the rows change: no recompilation (rows dynamic), the same answers
        (ours, our_grads), (eager, eager_grads) = run(True, n_context), run(False, n_context)
        graphs.append(counters["stats"]["unique_graphs"])
        torch.testing.assert_close(ours, eager, rtol=2e-2, atol=2e-2)
        for got, want in zip(our_grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=5e-2, atol=1e-3)
    assert graphs[1] == graphs[0], "a group of other rows compiled the regions again"

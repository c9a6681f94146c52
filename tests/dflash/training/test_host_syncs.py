"""The drafter step's hot path (every group's forward, loss and backward) never reads the device from
the host: `.item()`, `.tolist()`, `.cpu()`, `.numpy()` and a tensor's bool, int or float are counted
during a real training step, and allowed only inside `HOST_READS` (the batch's layout, the log's
figures). On CUDA `torch.cuda.set_sync_debug_mode("error")` also catches what Python cannot see
(a boolean index, a blocking copy) around the forward and backward.

The CPU step runs FlexAttention with its reference backward (`cpu_backward`: torch refuses it on CPU
only by a check), so that the code the GPU runs is what is counted."""

from __future__ import annotations

import sys

import pytest
import torch

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.model.flex import AttentionChoice
from dflash_ops.training import trainer as trainer_module
from dflash_ops.training.trainer import HOST_READS, DrafterTrainer, build_drafter

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
HOT_PATH = "DrafterTrainer.forward_backward"


@pytest.fixture
def cpu_backward(monkeypatch):
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)


class HostReads:
    """Counts the host's reads of tensors while `counting`: (read, calling function, stack's functions)."""

    def __init__(self, monkeypatch):
        self.counting, self.calls = False, []
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))

    def _counted(self, name, original):
        def read(tensor, *args, **kwargs):
            if self.counting:
                frame, stack = sys._getframe(1), []
                while frame is not None:
                    stack.append(frame.f_code.co_qualname)
                    frame = frame.f_back
                self.calls.append((name, stack[0], stack))
            return original(tensor, *args, **kwargs)
        return read

    def in_hot_path(self) -> list:
        return [(name, caller) for name, caller, stack in self.calls if HOT_PATH in stack]

    def unlisted(self) -> list:
        """Reads of the trainer's own code outside HOST_READS (torch.optim's CPU step counters aside)."""
        return [(name, caller) for name, caller, stack in self.calls
                if "DrafterTrainer.train_step" in stack and not set(HOST_READS) & set(stack)
                and not any(frame.startswith(("Optimizer.", "AdamW.", "_use_grad", "adamw", "_multi_tensor",
                                              "_single_tensor", "_get_value", "LRScheduler.", "clip_grad"))
                            for frame in stack[:4])]


def flex_trainer(target_path, tiny_config, tmp_path, device="cpu", **model):
    # torch runs even eager flex through torch.compile (its "eager" backend); after other tests' shapes
    # that graph turns dynamic and reads its sizes with `.item()`. The trainer's compiled flex is
    # static (`dynamic=False`): start from a fresh compiler, as a run's process does.
    torch._dynamo.reset()
    model = {"num_draft_layers": 2, "target_path": str(target_path), **model}
    cfg = config_from_dict(tiny_config(tmp_path, model=model, pipeline={"device": device}))
    target = load_target(target_path, "float32").to(device)
    torch.manual_seed(0)
    trainer = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
    if device == "cpu":
        trainer.attention = AttentionChoice("flex", False, "flex on CPU, its reference backward")
    assert trainer.attention.backend == "flex"
    g = torch.Generator().manual_seed(0)

    def batch(loss_mask=None):
        input_ids = torch.randint(0, 100, (3, 20), generator=g).to(device)
        packed = target_hidden_states(target, input_ids, torch.ones_like(input_ids), [1, 3])
        tokens = packed.pack(input_ids)
        mask = torch.ones_like(tokens) if loss_mask is None else loss_mask(tokens)
        return packed.features, packed.cu_seqlens, packed.position_ids, tokens, mask

    return trainer, batch


SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}


@pytest.mark.parametrize("model", [{}, SLIDING, {"loss_chunk_size": None}])
def test_a_training_step_reads_the_device_only_where_host_reads_says(
        cpu_backward, monkeypatch, tiny_target, tiny_config, tmp_path, model):
    trainer, batch = flex_trainer(tiny_target, tiny_config, tmp_path, **model)
    reads = HostReads(monkeypatch)
    trainer.train_step(*batch())  # first use: nothing lazy is left for the counted step
    inputs = batch()
    reads.counting = True
    result = trainer.train_step(*inputs)
    reads.counting = False
    assert result.num_blocks > 0 and result.loss > 0
    assert reads.in_hot_path() == []
    assert reads.unlisted() == []
    # What is left: the layout's reads of the batch's metadata, one read of the log's figures, and
    # torch.optim's CPU step counters.
    assert {(name, caller) for name, caller, _ in reads.calls} <= {
        ("tolist", "DrafterTrainer.layout"), ("cpu", "DrafterTrainer.layout"), ("cpu", "sample_anchors"),
        ("cpu", "build_block_batch"), ("cpu", "build_block_batch.<locals>.<listcomp>"),
        ("tolist", "DrafterTrainer.figures"), ("item", "_get_value")}
    assert [caller for _, caller, _ in reads.calls].count("DrafterTrainer.figures") == 1


def test_the_count_sees_a_read_in_the_hot_path(cpu_backward, monkeypatch, tiny_target, tiny_config, tmp_path):
    trainer, batch = flex_trainer(tiny_target, tiny_config, tmp_path)
    scored_loss = trainer_module.scored_loss

    def logged_loss(*args, **kwargs):
        loss, hits, counts = scored_loss(*args, **kwargs)
        print(f"loss {float(loss):.3f}")  # what a step that logs each group would do
        return loss, hits, counts

    monkeypatch.setattr(trainer_module, "scored_loss", logged_loss)
    reads, inputs = HostReads(monkeypatch), batch()
    reads.counting = True
    trainer.train_step(*inputs)
    assert ("__float__", f"{test_the_count_sees_a_read_in_the_hot_path.__name__}.<locals>.logged_loss"
            ) in reads.in_hot_path()


def test_a_step_without_any_scored_position_still_gives_every_weight_a_zero_gradient(
        cpu_backward, tiny_target, tiny_config, tmp_path):
    # Under DDP a rank that scores nothing must still join the all-reduce with a gradient for every weight.
    trainer, batch = flex_trainer(tiny_target, tiny_config, tmp_path)
    result = trainer.train_step(*batch(lambda tokens: torch.zeros_like(tokens)))
    assert result.num_blocks == 0 and result.loss == 0.0
    grads = [p.grad for p in trainer.drafter.parameters() if p.requires_grad]
    assert grads and all(g is not None and not g.any() for g in grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_forward_and_backward_never_synchronise(make_target, tiny_config, tmp_path):
    # FlexAttention's CUDA kernels need heads of at least 16 (the tiny target's are 8).
    target = make_target("target16", head_dim=16)
    trainer, batch = flex_trainer(target, tiny_config, tmp_path, "cuda")
    trainer.train_step(*batch())  # compiles
    features, cu_seqlens, position_ids, tokens, loss_mask = batch()
    parts, _ = trainer.layout(cu_seqlens, position_ids, tokens, loss_mask)
    total_weight = sum(part[2].weights.sum() for part in parts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, hits, counts = trainer.forward_backward(features, position_ids, parts, total_weight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(loss) > 0 and int(counts.sum()) > 0

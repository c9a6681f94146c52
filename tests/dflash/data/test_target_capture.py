"""The target computes and keeps only what the drafter needs: k layers, up to the deepest one."""

from __future__ import annotations

import pytest
import torch

from dflash_ops.data.target import load_target, target_hidden_states, target_hidden_states_all_layers


def padded_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 120, (3, 20), generator=g)
    attention_mask = torch.tensor([[1] * 20, [1] * 13 + [0] * 7, [1] * 6 + [0] * 14])
    return input_ids, attention_mask


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("layer_ids", "rows_per_pass"),
                         [([1, 3], None), ([0, 2, 5], None), ([4, 4, 1], None), ([1, 5], 1), ([0, 3], 2)])
def test_captured_features_are_bit_equal_to_the_all_layers_path(make_target, dtype, layer_ids, rows_per_pass):
    # Layer 5 is the last of 6: transformers reports it after the final norm, and so do we.
    target = load_target(make_target(num_hidden_layers=6), dtype)
    input_ids, attention_mask = padded_batch()
    ours = target_hidden_states(target, input_ids, attention_mask, layer_ids, rows_per_pass)
    reference = target_hidden_states_all_layers(target, input_ids, attention_mask, layer_ids)
    assert ours.features.dtype == reference.features.dtype == getattr(torch, dtype)
    assert ours.features.shape == (39, len(layer_ids) * 32)
    assert torch.equal(ours.features, reference.features)
    assert torch.equal(ours.cu_seqlens, reference.cu_seqlens)
    assert torch.equal(ours.position_ids, reference.position_ids)
    assert torch.equal(ours.token_index, reference.token_index)


def test_no_layer_past_the_deepest_runs_and_no_hook_is_left(make_target):
    target = load_target(make_target(num_hidden_layers=6))
    base = target.base_model
    ran: list[str] = []
    modules = {f"layer{i}": layer for i, layer in enumerate(base.layers)}
    modules.update(norm=base.norm, lm_head=target.lm_head)
    handles = [m.register_forward_hook(lambda mod, a, out, name=name: ran.append(name))
               for name, m in modules.items()]
    hooks_before = {name: len(m._forward_hooks) for name, m in modules.items()}
    target_hidden_states(target, *padded_batch(), [1, 3])
    assert ran == ["layer0", "layer1", "layer2", "layer3"]
    assert {name: len(m._forward_hooks) for name, m in modules.items()} == hooks_before
    for handle in handles:
        handle.remove()


def test_a_layer_id_beyond_the_target_is_refused(make_target):
    target = load_target(make_target(num_hidden_layers=4))
    with pytest.raises(ValueError, match="layer id 4 out of range for a target with 4 layers"):
        target_hidden_states(target, *padded_batch(), [1, 4])

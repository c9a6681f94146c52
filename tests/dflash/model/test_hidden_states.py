"""The packed hidden-state core: bit-identical to the padded reference, and lighter."""

from __future__ import annotations

import pytest
import torch

from benchmarks.memory import peak_allocated_bytes
from dflash_ops.model.hidden_states import document_ids, get_hidden_states_packed, get_hidden_states_padded


def ragged_batch(lengths: list[int], max_len: int, hidden: int, n_layers: int, left_pad: bool,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
    """n_layers + 1 random [B, max_len, H] tensors and an attention mask with the given row lengths."""
    generator = torch.Generator().manual_seed(seed)
    states = tuple(torch.randn(len(lengths), max_len, hidden, generator=generator).to(dtype)
                   for _ in range(n_layers + 1))
    mask = torch.zeros(len(lengths), max_len, dtype=torch.int64)
    for row, n in enumerate(lengths):
        if left_pad:
            mask[row, max_len - n:] = 1
        else:
            mask[row, :n] = 1
    return states, mask


def per_row_reference(states, layer_ids, mask) -> torch.Tensor:
    """Independent construction: row by row, the real tokens of each selected layer side by side."""
    rows = []
    for row in range(mask.shape[0]):
        real = mask[row].nonzero().squeeze(1)
        rows.append(torch.cat([states[i + 1][row, real] for i in layer_ids], dim=-1))
    return torch.cat(rows)


CASES = [
    # (lengths, max_len, left_pad)
    ([7, 3, 5, 1], 7, False),
    ([7, 3, 5, 1], 9, True),
    ([4, 0, 6, 0], 6, False),
    ([0, 5], 5, True),
    ([6], 6, False),
    ([3], 8, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "max_len", "left_pad"), CASES)
def test_packed_equals_padded_bit_for_bit(lengths, max_len, left_pad, dtype):
    states, mask = ragged_batch(lengths, max_len, 12, 6, left_pad, dtype, seed=1)
    layer_ids = [0, 2, 5]
    packed = get_hidden_states_packed(states, layer_ids, mask)
    padded = get_hidden_states_padded(states, layer_ids, mask)
    assert packed.features.dtype == dtype
    assert packed.features.shape == (sum(lengths), 3 * 12)
    assert torch.equal(packed.features, padded.features)
    assert torch.equal(packed.features, per_row_reference(states, layer_ids, mask))
    assert packed.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    expected_positions = [p for n in lengths for p in range(n)]
    assert packed.position_ids.tolist() == expected_positions
    assert torch.equal(packed.position_ids, padded.position_ids)
    assert document_ids(packed.cu_seqlens).tolist() == [d for d, n in enumerate(lengths) for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_packed_equals_padded_on_random_ragged_batches(seed):
    g = torch.Generator().manual_seed(100 + seed)
    batch = int(torch.randint(1, 7, (1,), generator=g))
    max_len = int(torch.randint(1, 20, (1,), generator=g))
    lengths = torch.randint(0, max_len + 1, (batch,), generator=g).tolist()
    left_pad = bool(seed % 2)
    dtype = (torch.float32, torch.bfloat16)[seed % 3 == 0]
    states, mask = ragged_batch(lengths, max_len, 8, 5, left_pad, dtype, seed)
    layer_ids = [1, 2, 4]
    packed = get_hidden_states_packed(states, layer_ids, mask)
    assert torch.equal(packed.features, get_hidden_states_padded(states, layer_ids, mask).features)
    assert torch.equal(packed.features, per_row_reference(states, layer_ids, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_with_holes_take_the_gather_path_and_still_match(dtype):
    states, _ = ragged_batch([1, 1, 1], 6, hidden=8, n_layers=4, left_pad=False, dtype=dtype)
    mask = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0]])
    packed = get_hidden_states_packed(states, [3, 0], mask)
    assert torch.equal(packed.features, get_hidden_states_padded(states, [3, 0], mask).features)
    assert torch.equal(packed.features, per_row_reference(states, [3, 0], mask))
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_pack_gathers_token_tensors_like_the_features():
    states, mask = ragged_batch([2, 4, 0], 5, hidden=4, n_layers=2, left_pad=True)
    packed = get_hidden_states_packed(states, [0], mask)
    ids = torch.arange(15).view(3, 5)
    assert packed.pack(ids).tolist() == [3, 4, 6, 7, 8, 9]


def test_bad_layer_ids_and_mask_are_rejected():
    states, mask = ragged_batch([2, 3], 3, hidden=4, n_layers=2, left_pad=False, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="layer id 2 out of range"):
        get_hidden_states_packed(states, [0, 2], mask)
    with pytest.raises(ValueError, match="does not match"):
        get_hidden_states_packed(states, [0], mask[:, :2])


def peaks_of_both_paths(states, mask, device: str) -> tuple[int, int, int]:
    """(packed peak, padded peak, output bytes) for layers 0..4, after checking equal results."""
    ids = [0, 1, 2, 3, 4]
    packed, packed_peak = peak_allocated_bytes(lambda: get_hidden_states_packed(states, ids, mask), device)
    padded, padded_peak = peak_allocated_bytes(lambda: get_hidden_states_padded(states, ids, mask), device)
    assert torch.equal(packed.features, padded.features)
    return packed_peak, padded_peak, packed.features.numel() * packed.features.element_size()


def test_packed_peak_memory_is_the_output_and_below_padded():
    # Half of B x Lmax is padding: padded peaks near (1 + B*Lmax/T) = 3x the output, packed near 1x.
    lengths = [64, 32, 16, 16]
    states, mask = ragged_batch(lengths, 64, hidden=64, n_layers=6, left_pad=False)
    packed_peak, padded_peak, output_bytes = peaks_of_both_paths(states, mask, "cpu")
    assert packed_peak <= 1.1 * output_bytes
    assert padded_peak >= 2.5 * output_bytes
    assert packed_peak < padded_peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_padded_on_cuda_and_peaks_at_the_output(dtype):
    states, mask = ragged_batch([64, 32, 16, 0], 64, hidden=256, n_layers=6, left_pad=True, dtype=dtype)
    states, mask = tuple(s.cuda() for s in states), mask.cuda()
    packed_peak, padded_peak, output_bytes = peaks_of_both_paths(states, mask, "cuda")
    assert packed_peak <= 1.1 * output_bytes < padded_peak

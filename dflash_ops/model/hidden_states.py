"""The packed hidden-state core: k target layers of a padded batch to one `[T, k*H]` tensor.

The target runs on a padded batch `[B, Lmax]` and returns one `[B, Lmax, H]` tensor per layer.
The drafter needs only the T real tokens, concatenated over the k selected layers.

- `get_hidden_states_padded` is the obvious reference: concatenate to `[B, Lmax, k*H]`, then strip
  the padding with a boolean index (a second copy). Peak ~ (1 + B*Lmax/T) x the output.
- `get_hidden_states_packed` copies each layer's real tokens straight into its column slice of a
  preallocated `[T, k*H]` output, so the padded concatenation never exists. Peak ~ 1 x the output.
  On CPU, when every row's real tokens are one run (left or right padding), it stacks each row's k
  layer slices into the row's contiguous block of the output (B calls writing front to back, the
  fastest CPU path); otherwise, and always on GPU (one kernel per layer,
  no host sync), `index_select(..., out=column_view)` gathers through the strided view without a
  temporary.

Both copy the same values into the same places, so the results are bit-identical in any dtype.
The packed metadata follows the varlen-attention convention: `cu_seqlens` `[B+1]` int32 (document
d is rows `cu_seqlens[d]:cu_seqlens[d+1]`) and `position_ids` `[T]`, each token's 0-based position
within its own document (padding skipped, so left and right padding give the same positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PackedHiddenStates:
    """The real tokens of a padded batch, packed: features plus the metadata the masks need."""

    features: torch.Tensor      # [T, k*H]
    cu_seqlens: torch.Tensor    # [B+1] int32, document boundaries
    position_ids: torch.Tensor  # [T] int64, position within the document
    token_index: torch.Tensor   # [T] int64, flat index of each real token in the padded [B*Lmax]

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """Pack a per-token tensor of the same padded batch (`[B, Lmax, ...]`) to `[T, ...]`."""
        return padded.reshape(-1, *padded.shape[2:]).index_select(0, self.token_index.to(padded.device))


def _select_layers(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> list[torch.Tensor]:
    """hidden_states[i + 1] for each layer id: index 0 of a transformers output is the embeddings."""
    if not layer_ids:
        raise ValueError("layer_ids must name at least one target layer")
    n_layers = len(hidden_states) - 1
    for layer_id in layer_ids:
        if not 0 <= layer_id < n_layers:
            raise ValueError(f"layer id {layer_id} out of range for a target with {n_layers} layers")
    selected = [hidden_states[layer_id + 1] for layer_id in layer_ids]
    shape = selected[0].shape
    if len(shape) != 3 or any(h.shape != shape for h in selected):
        shapes = [tuple(h.shape) for h in selected]
        raise ValueError(f"expected k tensors of one shape [B, Lmax, H], got {shapes}")
    return selected


def _check_mask(attention_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if attention_mask.shape != shape[:2]:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match hidden states "
                         f"{tuple(shape[:2])}")
    return attention_mask.to(torch.bool)


def packing_metadata(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens, position_ids, token_index) of the real tokens of a `[B, Lmax]` attention mask."""
    mask = attention_mask.to(torch.bool)
    lengths = mask.sum(dim=1)
    cu_seqlens = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    cu_seqlens[1:] = torch.cumsum(lengths, dim=0)
    token_index = mask.reshape(-1).nonzero().squeeze(1)
    position_ids = (torch.cumsum(mask.to(torch.int64), dim=1) - 1).reshape(-1).index_select(0, token_index)
    return cu_seqlens, position_ids, token_index


def _row_runs(attention_mask: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """(first real column, length, packed offset) per row when each row's real tokens are one
    contiguous run; None when some row has a hole."""
    mask = attention_mask.to(torch.bool)
    lengths = mask.sum(dim=1)
    columns = torch.arange(mask.shape[1], device=mask.device)
    first = torch.where(mask, columns, mask.shape[1]).min(dim=1).values
    last = torch.where(mask, columns, -1).max(dim=1).values
    if not bool(((last - first + 1 == lengths) | (lengths == 0)).all()):
        return None
    offsets = torch.cumsum(lengths, dim=0) - lengths
    return list(zip(first.tolist(), lengths.tolist(), offsets.tolist(), strict=True))


def get_hidden_states_packed(
    hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int], attention_mask: torch.Tensor
) -> PackedHiddenStates:
    """Gather each selected layer's real tokens into its slice of a `[T, k*H]` output."""
    selected = _select_layers(hidden_states, layer_ids)
    batch, max_len, hidden = selected[0].shape
    _check_mask(attention_mask, selected[0].shape)
    cu_seqlens, position_ids, token_index = packing_metadata(attention_mask)
    n_tokens = token_index.numel()
    features = selected[0].new_empty(n_tokens, len(selected), hidden)
    runs = _row_runs(attention_mask) if features.device.type == "cpu" else None
    if runs is not None:
        for row, (first, length, offset) in enumerate(runs):
            if length:
                # One call per row: the k layers' slices interleave into the row's contiguous
                # [length, k, H] block of the output, written front to back (views, no temporary).
                torch.stack([layer[row, first: first + length] for layer in selected], dim=1,
                            out=features[offset: offset + length])
    else:
        for i, layer in enumerate(selected):
            # Writes through the strided column view: no [T, H] temporary, no [B, Lmax, k*H] tensor.
            torch.index_select(layer.reshape(batch * max_len, hidden), 0, token_index, out=features[:, i])
    return PackedHiddenStates(features.view(n_tokens, len(selected) * hidden), cu_seqlens, position_ids,
                              token_index)


def get_hidden_states_padded(
    hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int], attention_mask: torch.Tensor
) -> PackedHiddenStates:
    """Reference path: concatenate to `[B, Lmax, k*H]` first, strip the padding after."""
    selected = _select_layers(hidden_states, layer_ids)
    mask = _check_mask(attention_mask, selected[0].shape)
    cu_seqlens, position_ids, token_index = packing_metadata(attention_mask)
    features = torch.cat(selected, dim=-1)[mask]
    return PackedHiddenStates(features, cu_seqlens, position_ids, token_index)


def document_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] index of the document each packed token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)

"""Which target layers condition the drafter, without importing torch (the launcher and `validate`
check a feature cache's layer ids with it)."""

from __future__ import annotations


def build_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """Target layers whose hidden states condition the drafter: one per draft layer, uniformly
    spaced from layer 1 to layer n-3 (36 layers, 5 draft layers: 1, 9, 17, 25, 33); the middle
    layer for a single draft layer. On shallow targets the span widens (up to layer n-1) so that
    the ids stay distinct where the depth allows."""
    if n_target_layers < 1 or n_draft_layers < 1:
        raise ValueError(f"need at least one target and one draft layer, "
                         f"got {n_target_layers} and {n_draft_layers}")
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    start = min(1, n_target_layers - 1)
    end = min(n_target_layers - 1, max(n_target_layers - 3, start + n_draft_layers - 1))
    span = end - start
    return [round(start + i * span / (n_draft_layers - 1)) for i in range(n_draft_layers)]
